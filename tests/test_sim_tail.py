"""Long-tail consolidation: the cut, the decoded work it conserves, a step-by-step reference for
the main and tail shards, and a timeline where the freed worker serves another job."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plexrl.policy import Policy
from plexrl.sim.engine import EventLoop
from plexrl.sim.group import Group
from plexrl.sim.latency import consolidated_shards, job_costs, tail_cut
from plexrl.sim.phases import Phase, first_step, gpu_seconds, plan_step, solo_step_s
from plexrl.sim.service import SimService
from plexrl.sim.worker import SimWorker
from plexrl.sim.workload import WorkloadJob, load_cluster

from test_sim_latency import decode_reference
from test_sim_timeline import ScriptedJob

COSTS = job_costs(WorkloadJob(name="j", params_b=30, active_params_b=3, tp=2, dp=8), load_cluster("h200-256"))


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(1, 500), min_size=1, max_size=60), capacity=st.integers(1, 20))
def test_cut_leaves_at_most_capacity_running(lengths, capacity):
    arr = np.array(lengths, dtype=float)
    cut = tail_cut(arr, capacity)
    if len(arr) <= capacity:
        assert cut is None
        return
    assert np.sum(arr > cut) <= capacity, "the tail holds at most `capacity` responses"
    assert np.sum(arr >= cut) > capacity, "and the cut is as late as possible"


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 80), min_size=2, max_size=400), replicas=st.integers(2, 8),
       tail_replicas=st.integers(1, 3))
def test_consolidated_shards_match_step_by_step_reference(lengths, replicas, tail_replicas):
    """Main shards decode every response up to the cut; the tail replicas decode the rest after
    re-prefilling prompt + cut tokens per moved response."""
    costs, prompt = COSTS, 16
    arr = np.array(lengths, dtype=float)
    split = consolidated_shards(costs, arr, replicas, prompt, tail_replicas)
    cut = tail_cut(arr, costs.tail_batch * tail_replicas) if replicas > tail_replicas else None
    if cut is None or cut <= 0:
        assert split is None
        return
    main, tail = split
    assert main == pytest.approx(dealt_reference(costs, np.minimum(arr, cut), replicas), rel=1e-9)
    rest = arr[arr > cut] - cut
    moved = [len(b) for b in deal(rest, tail_replicas)]
    prefill = costs.prefill_token_s * (prompt + cut)
    want = [d + prefill * m for d, m in zip(dealt_reference(costs, rest, tail_replicas), moved)]
    assert tail == pytest.approx(want, rel=1e-9)
    # the tail holds what the cut left, and main + tail decode every token exactly once
    assert sum(moved) == len(rest) <= costs.tail_batch * tail_replicas


def deal(lengths: np.ndarray, replicas: int) -> list[list[float]]:
    """Even blocks in order, the remainder one each to the first replicas (as decode_shards)."""
    n = len(lengths) - len(lengths) % replicas
    blocks = [list(lengths[:n].reshape(replicas, -1)[r]) if n else [] for r in range(replicas)]
    for r, extra in enumerate(lengths[n:]):
        blocks[r].append(extra)
    return blocks


def dealt_reference(costs, lengths: np.ndarray, replicas: int) -> list[float]:
    return [decode_reference(costs.decode_step_s, costs.decode_seq_s, [int(x) for x in b]) if b else 0.0
            for b in deal(lengths, replicas)]


def test_no_more_replicas_than_the_tail_has_nothing_to_free():
    lengths = np.arange(1.0, 5000.0)
    assert consolidated_shards(COSTS, lengths, 1, 512, tail_replicas=1) is None
    assert consolidated_shards(COSTS, lengths, 2, 512, tail_replicas=2) is None
    assert consolidated_shards(COSTS, lengths, 3, 512, tail_replicas=2) is not None


def test_consolidation_saves_worker_time_at_a_small_step_cost():
    """On the 30B job of paper-mix (8 replicas of 2 GPUs) the plan with the tail consolidated
    uses fewer GPU-seconds, and its solo step is at most a few percent longer."""
    cluster = load_cluster("h200-256")
    job = WorkloadJob(name="code", algorithm="dapo", params_b=30, active_params_b=3, tp=2, dp=8, reward_s=0)
    costs = job_costs(job, cluster)
    whole = plan_step(job, costs, first_step(job, 0, 0), 16, 16, consolidate_tail=False)
    split = plan_step(job, costs, first_step(job, 0, 0), 16, 16, consolidate_tail=True)
    assert [p.fn for p in split].count("sample_tail") == 1
    assert gpu_seconds(split) < 0.95 * gpu_seconds(whole)
    assert solo_step_s(whole) <= solo_step_s(split) <= 1.06 * solo_step_s(whole)


def test_freed_worker_serves_another_job_during_the_tail():
    """A samples 10 s on GPUs 0 and 1, then its 30 s tail on one of them (step 0, phase 2:
    GPU 0). B's 5 s call arrives on GPU 1 at t=12 and runs at once: done at 17, not 40."""
    loop = EventLoop()
    service = SimService(loop, Policy.PLEXRL, on_job_done=lambda job: None)
    workers = [SimWorker(wid=i, arena_bytes=400, host_bytes=10**6, link_bytes_per_s=1e9,
                         disk_bytes_per_s=1e9) for i in range(2)]
    Group(0, workers)
    a = ScriptedJob("A", 0.0, [Phase("sample", "s", (10.0, 10.0)), Phase("sample_tail", "s", (30.0,))])
    b = ScriptedJob("B", 12.0, [Phase("update", "s", (5.0,))])
    for w in workers:
        w.add_state("A/s", "A", 100)
    workers[1].add_state("B/s", "B", 100)
    a.workers["s"], b.workers["s"] = workers, [workers[1]]
    loop.at(0.0, service.start, a)
    loop.at(12.0, service.start, b)
    loop.run()
    assert b.finished == pytest.approx(17.0 + 100 / 1e9)
    assert a.finished == pytest.approx(40.0 + 100 / 1e9)
    # A consumed 10 + 10 + 30 worker-seconds of execution, not 2 x 40
    assert service.ledger.jobs["A"].exec_s == pytest.approx(50.0)


def _two_jobs_on_one_set(tail, slack: float = 1.0, count: int = 2):
    """Two code-style jobs on one 16-GPU set with slack to share it: the first runs alone until
    the second arrives, then both share every GPU."""
    from plexrl.sim.plexrl_mode import PlexRLMode
    from plexrl.sim.workload import SimCluster, Workload

    cluster = SimCluster(name="one-set", nodes_per_pod=2, group_nodes=2)
    workload = Workload.model_validate({"name": "pair", "seed": 1, "jobs": [
        {"name": "code", "count": count, "algorithm": "dapo", "params_b": 30, "active_params_b": 3, "tp": 2,
         "dp": 8, "steps": 6, "reward_s": 650, "arrival_every_s": 1500, "slack": slack, "rollout": {"prompts": 64}},
    ]})
    mode = PlexRLMode(workload, cluster, Policy.PLEXRL, tail=tail)
    mode.run()
    return mode


def test_a_job_consolidates_its_tail_while_it_shares_its_gpus_or_while_that_pays_alone():
    """`Tail.SHARED` (the default): a job consolidates while a co-tenant is placed on its GPUs
    (from its next step on), and alone when that is its own bargain (`tail_pays`: this code job's
    consolidated solo step spends ~1,600 fewer GPU-seconds, ~41%, and holds its 16 GPUs ~18 s longer,
    ~3%, within its slack of 100%). Its rollouts are elastic only while it shares (alone, they are dealt once, as the
    baselines' are: no job runs faster than alone). `Tail.ALWAYS` and `Tail.NEVER` decide the same
    for every step. Each step's solo time is planned the way that step ran."""
    from plexrl.sim.plexrl_mode import Tail

    mode = _two_jobs_on_one_set(Tail.SHARED)
    first, second = mode.by_name["code-0"], mode.by_name["code-1"]
    assert first.finished is not None and second.finished is not None
    assert second.started < first.finished, "the workload must make them share"
    assert mode.lone_tail == {"code-0": True, "code-1": True}
    assert all(first.tail_steps) and all(second.tail_steps), "alone or sharing, consolidating pays"
    assert second.elastic is False, "alone at the end: its rollouts are dealt once again"
    for job in (first, second):
        rollout, train = len(job.workers["sampler"]), len(job.workers["trainer"])
        want = sum(solo_step_s(job.plans.step(job.spec, job.seed, job.index, job.costs, k, rollout, train, tail))
                   for k, tail in enumerate(job.tail_steps[:job.step]))
        assert job.solo_s() == want
    for tail, every in ((Tail.ALWAYS, True), (Tail.NEVER, False)):
        mode = _two_jobs_on_one_set(tail)
        assert all(t is every for job in mode.by_name.values() for t in job.tail_steps)


def test_a_job_whose_slack_the_consolidated_tail_would_exceed_keeps_its_tail_alone():
    """Slack 1%: a consolidated step (~3% slower) would break it, so alone the job keeps every
    replica through the tail, every step."""
    from plexrl.sim.plexrl_mode import Tail

    mode = _two_jobs_on_one_set(Tail.SHARED, slack=0.01, count=1)
    job = mode.by_name["code"]
    assert mode.lone_tail == {"code": False} and job.finished is not None
    assert not any(job.tail_steps)


def test_tail_pays_when_it_saves_more_gpu_time_than_it_holds_longer_within_the_slack():
    from plexrl.policy.profile import JobProfile, ModelMemory
    from plexrl.sim.plexrl_mode import tail_pays

    def profile(period_s, demand, slack=0.1):
        return JobProfile("j", period_s, demand, 2, (ModelMemory("m", 1, 1),), slack)

    whole = profile(10.0, (2, 2, 1, 1, 0))  # 12 GPU-s per step on 2 GPUs
    # 5% slower: 2 x 0.5 = 1.0 GPU-s held longer, 12 - 10.5 = 1.5 saved
    assert tail_pays(whole, profile(10.5, (2, 2, 1, 0, 0)))
    # 2 x 1.0 = 2.0 GPU-s held longer, 12 - 11 x 1.0 = 1.0 saved: the cluster loses GPU-time
    assert not tail_pays(whole, profile(11.0, (2, 2, 0.5, 0.5, 0)))
    # 15% slower, past the slack of 10% (2 x 1.5 = 3.0 held longer, 12 - 6.9 = 5.1 saved)
    assert not tail_pays(whole, profile(11.5, (2, 1, 0, 0, 0)))
    assert tail_pays(profile(10.0, (2, 2, 1, 1, 0), slack=0.2), profile(11.5, (2, 1, 0, 0, 0)))
    assert not tail_pays(whole, profile(10.0, (2, 2, 1, 1, 0)))  # nothing saved
