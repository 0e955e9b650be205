"""Elastic rollouts (`sim/rollout.py`, `ElasticRollouts.rebalance`): the decode model against references,
the consolidation cut against the pinned one, what moving responses costs, and whole runs where
jobs share GPUs: every GPU runs one thing at a time, every segment is charged and counted, and
a rollout that shares its replicas beats the pinned one where the paper's small-DP argument says
it should."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plexrl.policy import Policy
from plexrl.sim import service as service_module
from plexrl.sim.elastic_rollouts import ElasticRollouts
from plexrl.sim.latency import TAIL_REPLICAS, decode_shards, job_costs, tail_cut
from plexrl.sim.modes import make_mode
from plexrl.sim.plexrl_mode import PlexRLMode
from plexrl.sim.rollout import Decode, Rollout
from plexrl.sim.workload import WorkloadJob, SimCluster, Workload, load_cluster

COSTS = job_costs(WorkloadJob(name="j", params_b=30, active_params_b=3, tp=2, dp=8), load_cluster("h200-256"))
lengths_st = st.lists(st.integers(1, 3000), min_size=1, max_size=300).map(lambda xs: np.array(xs, dtype=float))


@settings(max_examples=60, deadline=None)
@given(lengths_st)
def test_one_replica_decodes_as_the_pinned_shard(lengths):
    decode = Decode(lengths, COSTS)
    assert decode.seconds(0.0, decode.last, 1) == pytest.approx(decode_shards(COSTS, lengths, 1)[0], rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(lengths_st, st.floats(0, 3500))
def test_live_and_tokens_against_brute_force(lengths, k):
    decode = Decode(lengths, COSTS)
    assert decode.live(k) == int(np.sum(lengths > k))
    assert decode.tokens(k) == pytest.approx(float(np.minimum(lengths, k).sum()), rel=1e-12, abs=1e-9)


@settings(max_examples=100, deadline=None)
@given(lengths_st, st.floats(0, 1), st.floats(0, 1), st.integers(1, 8))
def test_reach_inverts_seconds(lengths, start, share, replicas):
    """The step reached after t seconds is the one that t seconds of decoding take to reach."""
    decode = Decode(lengths, COSTS)
    k1 = start * decode.last
    total = decode.seconds(k1, decode.last, replicas)
    k2 = decode.reach(k1, share * total, replicas, decode.last)
    assert k1 <= k2 <= decode.last
    assert decode.seconds(k1, k2, replicas) == pytest.approx(share * total, rel=1e-9, abs=1e-9)
    assert decode.reach(k1, 2 * total + 1, replicas, decode.last) == decode.last


class _GPU:
    def __init__(self, wid: int):
        self.wid = wid


class _Job:
    def __init__(self, costs, prompt_tokens=512):
        self.costs = costs
        self.spec = WorkloadJob(name="j", params_b=30, active_params_b=3, tp=2, dp=8,
                        rollout={"prompt_tokens": prompt_tokens})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 30000), min_size=2, max_size=2048).map(lambda xs: np.array(xs, dtype=float)))
def test_the_consolidation_cut_is_the_pinned_one(lengths):
    units = [(_GPU(i),) for i in range(8)]
    rollout = Rollout(_Job(COSTS), "j/sampler", units, Decode(lengths, COSTS), 0.0, 1.0)
    assert rollout.cut == tail_cut(lengths, COSTS.tail_batch * TAIL_REPLICAS)
    assert rollout.want() == 8
    if rollout.cut is not None:
        rollout.k = rollout.cut
        assert rollout.want() == TAIL_REPLICAS and rollout.target() == rollout.decode.last


def test_moving_responses_costs_their_prompt_and_tokens_so_far():
    lengths = np.full(800, 1000.0)
    units = [(_GPU(i),) for i in range(8)]
    rollout = Rollout(_Job(COSTS, prompt_tokens=100), "j/sampler", units, Decode(lengths, COSTS), 0.0, 1.0)
    assert rollout.moving_s(tuple(units[:4]), ()) == 0.0, "the first segment moves nothing"
    rollout.kv_units, rollout.k = tuple(units), 300.0
    per = COSTS.prefill_token_s * (100 + 300)
    assert rollout.moving_s(tuple(units), tuple(units)) == 0.0, "staying put moves nothing"
    assert rollout.moving_s(tuple(units[:4]), tuple(units[:4])) == pytest.approx(per * 400 / 4)
    assert rollout.moving_s(tuple(units[4:]), ()) == pytest.approx(per * 800 / 4), "KV lost: all move"


# --- whole runs ------------------------------------------------------------------------------

PAIR_CLUSTER = SimCluster(name="pair", nodes_per_pod=2, group_nodes=2)


def pair(seed: int = 0, agents: int = 1) -> Workload:
    """A code job (long rollouts, long sandbox) and `agents` agentic ones (short turns) forced onto
    the same 16 GPUs: the combination where rollouts pinned to every replica hurt most."""
    common = {"algorithm": "dapo", "params_b": 30, "active_params_b": 3, "tp": 2, "dp": 8, "steps": 6,
              "slack": 10.0}
    return Workload.model_validate({"name": "pair", "seed": seed, "pack_limit": None, "jobs": [
        {"name": "code", "reward_s": 650, "rollout": {"refill_fraction": 0.25}, **common},
        {"name": "agent", "count": agents, "arrival_s": 1.0, "arrival_every_s": 1.0, "reward_s": 20,
         "rollout": {"turns": 5, "tool_s": 60}, **common},
    ]})


def checked_run(make, workload):
    """Run with every hold of a GPU checked: nothing starts on a busy GPU, and a rollout never
    takes a GPU a queued call waits for (it may keep one it held: calls do not preempt it)."""
    occupy, start, rebalance = service_module.occupy_gang, ElasticRollouts._start_segment, ElasticRollouts.rebalance

    def occupy_free(ledger, job, gang, *args):
        assert not any(w.busy for w in gang), "a call started on a busy GPU"
        return occupy(ledger, job, gang, *args)

    def start_free(self, rollout, units, now):
        assert not any(w.busy for unit in units for w in unit), "a rollout started on a busy GPU"
        return start(self, rollout, units, now)

    def rebalance_fair(self, group):
        claimed = {w for r in group.waiting.values() for w in r.gang}
        before = {r: {w for u in r.segment.units for w in u} if r.segment else set() for r in group.rollouts}
        rebalance(self, group)
        for r, held in before.items():
            now_held = {w for u in r.segment.units for w in u} if r.segment else set()
            assert not (now_held & claimed) - held, "a rollout took a GPU a queued call waits for"

    service_module.occupy_gang = occupy_free
    ElasticRollouts._start_segment, ElasticRollouts.rebalance = start_free, rebalance_fair
    try:
        mode = make(workload, PAIR_CLUSTER, Policy.PLEXRL)
        return mode, mode.run()
    finally:
        service_module.occupy_gang = occupy
        ElasticRollouts._start_segment, ElasticRollouts.rebalance = start, rebalance


def pinned_mode(workload, cluster, policy):
    return make_mode("plexrl-pinned", workload, cluster)  # `policy`: always PLEXRL here, the table's


@pytest.fixture(scope="module")
def runs():
    return {**{name: checked_run(make, pair()) for name, make in (("elastic", PlexRLMode), ("pinned", pinned_mode))},
            "elastic, three jobs": checked_run(PlexRLMode, pair(agents=2))}


@pytest.mark.parametrize("name", ["elastic", "pinned", "elastic, three jobs"])
def test_every_gpu_second_is_charged_once_and_every_segment_counted(runs, name):
    mode, result = runs[name]
    start, end, gpus = result.busy_intervals
    assert np.all(end >= start)
    assert result.busy_gpu_s == pytest.approx(result.ledger["device_busy_s"], rel=1e-9)
    assert sum(r.charged_gpu_s for r in result.records) == pytest.approx(result.ledger["device_busy_s"], rel=1e-9)
    for r in result.records:
        assert r.finished is not None and r.submitted == r.served > 0
    assert sum(j["requests"] for j in result.ledger["jobs"].values()) == sum(r.served for r in result.records)
    assert all(r.shared for r in result.records), "the pair must share its GPUs"


def test_elastic_rollouts_move_and_beat_pinned_ones(runs):
    """Pinned, every agentic turn waits for all 8 replicas, which the code job's 4-5 minute
    rollouts hold; elastic, it decodes on what the code job leaves it."""
    elastic, pinned_ = (runs[n][1] for n in ("elastic", "pinned"))
    slow = {n: {r.name: r.realised_inflation for r in runs[n][1].records} for n in ("elastic", "pinned")}
    assert slow["elastic"]["agent"] < slow["pinned"]["agent"] - 0.1, slow
    assert sum(slow["elastic"].values()) < sum(slow["pinned"].values()), slow
    assert elastic.end_s < pinned_.end_s
    segments = runs["elastic"][0].service.rollouts.segments
    assert segments > 2 * sum(r.steps for r in elastic.records), "rollouts ran in several segments"
