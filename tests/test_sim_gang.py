"""Gang dispatch on a group of GPUs: exact timelines, reservation and backfill per policy,
switch accounting.

Two GPUs g0, g1 in one group, every state resident unless a case says otherwise.
  A (t=0) samples 10 s on g0 (expected to end at 10: the estimator knows every duration).
  G (t=2) runs a 3 s collective over g0 and g1: it needs both, g0 is busy until 10.
  D (t=3) runs d s on g1, which is idle.
d = 1 (backfill): D ends at 4, before G's expected start at 10, so every policy starts it at
  once, [3,4]; G runs [10,13].
d = 8 (no backfill: 3 + 8 > 10):
  fcfs ranks G first: G claims g1, so D waits: G [10,13], D [13,21].
  sjf ranks D (8 s) above G (3 s)? No: G is shorter; as fcfs.
  hrrn at t=3: G 1+1/3 = 1.33 > D 1+0/8 = 1, so G claims g1 and D waits; at t=10 (g0
    frees) G 1+8/3 = 3.67 > D 1+7/8 = 1.88: G [10,13], D [13,21].
  plexrl: every state is resident, so no switch term: as hrrn.
sjf with a 9 s collective: D (8 s) ranks first and starts at once, [3,11]; G [11,20].
"""

from __future__ import annotations

import pytest

from plexrl.policy import Policy
from plexrl.sim.engine import EventLoop
from plexrl.sim.group import Group
from plexrl.sim.phases import Phase
from plexrl.sim.service import SimService
from plexrl.sim.worker import SimWorker

from test_sim_timeline import ScriptedJob


def gpus(n: int, arena: int = 10**6, link: float = 50.0) -> list[SimWorker]:
    workers = [SimWorker(wid=i, arena_bytes=arena, host_bytes=10**9, link_bytes_per_s=link, disk_bytes_per_s=link)
               for i in range(n)]
    Group(0, workers)
    return workers


def run(policy: Policy, jobs: list[tuple[ScriptedJob, list[SimWorker]]], resident: bool = True):
    loop = EventLoop()
    service = SimService(loop, policy, on_job_done=lambda job: None)
    for job, on in jobs:
        for w in on:
            w.add_state(job.state_id("s"), job.name, 100)
            if resident:
                w.make_resident(job.state_id("s"), 0.0)
        job.workers["s"] = on
        phase = job.script[0]
        service.estimator.observe(job.state_id("s"), phase.fn, phase.shard_s[0])
        loop.at(job.arrival, service.start, job)
    loop.run()
    return service


def three_jobs(d_s: float):
    g0, g1 = gpus(2)
    a = ScriptedJob("A", 0.0, [Phase("sample", "s", (10.0,))])
    g = ScriptedJob("G", 2.0, [Phase("update", "s", (3.0,), shard_gpus=2)])
    d = ScriptedJob("D", 3.0, [Phase("sample", "s", (d_s,))])
    return [(a, [g0]), (g, [g0, g1]), (d, [g1])], (g0, g1)


CASES = [  # (D's seconds, policy, {job: finished})
    *[(1.0, p, {"G": 13.0, "D": 4.0}) for p in ("fcfs", "sjf", "hrrn", "plexrl")],
    *[(8.0, p, {"G": 13.0, "D": 21.0}) for p in ("fcfs", "sjf", "hrrn", "plexrl")],
]


@pytest.mark.parametrize("d_s,policy,expected", CASES, ids=[f"d{d:g}-{p}" for d, p, _ in CASES])
def test_gang_reservation_and_backfill_timeline(d_s, policy, expected):
    jobs, (g0, g1) = three_jobs(d_s)
    service = run(Policy(policy), jobs)
    finished = {job.name: job.finished for job, _ in jobs}
    assert finished["A"] == 10.0
    for name, end in expected.items():
        assert finished[name] == pytest.approx(end), (policy, finished)
    ledger = service.ledger
    # the collective is charged on both GPUs; nothing is charged for g1's reserved idle time
    assert ledger.jobs["G"].consumed_device_s == pytest.approx(6.0)
    assert dict(ledger.device_busy_s) == {0: 13.0, 1: 3.0 + d_s}
    assert not g0.busy and not g1.busy and g0.group.idle == 2


def test_sjf_ranks_a_short_call_above_the_collective():
    """D (8 s) vs a 9 s collective: sjf starts D on idle g1 at once, fcfs holds g1 for G."""
    g0, g1 = gpus(2)
    a = ScriptedJob("A", 0.0, [Phase("sample", "s", (10.0,))])
    g = ScriptedJob("G", 2.0, [Phase("update", "s", (9.0,), shard_gpus=2)])
    d = ScriptedJob("D", 3.0, [Phase("sample", "s", (8.0,))])
    run(Policy.SJF, [(a, [g0]), (g, [g0, g1]), (d, [g1])])
    assert (d.finished, g.finished) == (11.0, 20.0)


def test_gang_starts_together_after_the_slowest_switch():
    """G's state is resident on g0 only; g1 loads it (100 B at 50 B/s = 2 s) and g0 waits in the
    gang: the collective runs [2, 5] and both GPUs are charged 2 s of switch-in."""
    g0, g1 = gpus(2)
    g = ScriptedJob("G", 0.0, [Phase("update", "s", (3.0,), shard_gpus=2)])
    for w in (g0, g1):
        w.add_state("G/s", "G", 100)
    g0.make_resident("G/s", 0.0)
    g.workers["s"] = [g0, g1]
    loop = EventLoop()
    service = SimService(loop, Policy.PLEXRL, on_job_done=lambda job: None)
    loop.at(0.0, service.start, g)
    loop.run()
    assert g.finished == pytest.approx(5.0)
    usage = service.ledger.jobs["G"]
    assert usage.exec_s == pytest.approx(6.0) and usage.switch_s == pytest.approx(4.0)
    assert service.ledger.transitions_by_kind == {"load": 1, "gang_wait": 1}
    assert dict(service.ledger.device_busy_s) == pytest.approx({0: 5.0, 1: 5.0})


def test_replicas_release_their_gpus_one_by_one():
    """A samples on two 1-GPU replicas, 10 s and 4 s; B's 2 s call on g1 arrives at t=1 and runs
    as soon as A's short replica ends, [4, 6], not after A's whole phase."""
    g0, g1 = gpus(2)
    a = ScriptedJob("A", 0.0, [Phase("sample", "s", (10.0, 4.0))])
    b = ScriptedJob("B", 1.0, [Phase("sample", "s", (2.0,))])
    service = run(Policy.PLEXRL, [(a, [g0, g1]), (b, [g1])])
    assert (a.finished, b.finished) == (10.0, 6.0)
    assert service.ledger.jobs["A"].exec_s == 14.0
    assert service.ledger.jobs["B"].queue_wait_s == 3.0


def test_gangs_are_consecutive_runs_of_the_states_gpus():
    ws = gpus(4)
    job = ScriptedJob("J", 0.0, [])
    job.workers["s"] = ws
    replicas = job.gangs(Phase("sample", "s", (1.0, 1.0), shard_gpus=2))
    assert replicas == [(ws[0], ws[1]), (ws[2], ws[3])]
    assert job.gangs(Phase("update", "s", (1.0,), shard_gpus=4)) == [tuple(ws)]
    # a tail of one replica rotates with the step and phase
    job.step, job.phase_i = 0, 1
    assert job.gangs(Phase("sample_tail", "s", (1.0,), shard_gpus=2)) == [(ws[2], ws[3])]
