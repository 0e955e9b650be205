"""Gang dispatch on a group of GPUs: exact timelines, reservation per policy, switch accounting.

Two GPUs g0, g1 in one group, every state resident unless a case says otherwise.
  A (t=0) samples 10 s on g0.
  G (t=2) runs a 3 s collective over g0 and g1: it needs both, g0 is busy until 10.
  D (t=3) runs 1 s on g1, which is idle.
fcfs ranks G first: G claims g1 as well (reservation), so D waits: G [10,13], D [13,14].
sjf ranks D (1 s) above G (3 s): D takes g1 at once, [3,4]; G still starts at 10.
hrrn at t=3: G 1+1/3 = 1.33 > D 1+0/1 = 1, so G claims g1 and D waits; at t=10 (g0 frees)
  D 1+7/1 = 8 > G 1+8/3 = 3.67, so D runs [10,11] and G [11,14].
plexrl: every state is resident, so no switch term: as hrrn.
"""

from __future__ import annotations

import pytest

from plexrl.policy import Policy
from plexrl.sim.engine import EventLoop
from plexrl.sim.group import Group
from plexrl.sim.phases import Phase
from plexrl.sim.service import Service
from plexrl.sim.worker import SimWorker

from test_sim_timeline import ScriptedJob


def gpus(n: int, arena: int = 10**6, link: float = 50.0) -> list[SimWorker]:
    workers = [SimWorker(wid=i, arena_bytes=arena, host_bytes=10**9, link_bytes_per_s=link, disk_bytes_per_s=link)
               for i in range(n)]
    Group(0, workers)
    return workers


def run(policy: Policy, jobs: list[tuple[ScriptedJob, list[SimWorker]]], resident: bool = True):
    loop = EventLoop()
    service = Service(loop, policy, on_job_done=lambda job: None)
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


def three_jobs():
    g0, g1 = gpus(2)
    a = ScriptedJob("A", 0.0, [Phase("sample", "s", (10.0,))])
    g = ScriptedJob("G", 2.0, [Phase("update", "s", (3.0,), shard_gpus=2)])
    d = ScriptedJob("D", 3.0, [Phase("sample", "s", (1.0,))])
    return [(a, [g0]), (g, [g0, g1]), (d, [g1])], (g0, g1)


EXPECTED = {  # policy: {job: finished}
    "fcfs": {"G": 13.0, "D": 14.0},
    "sjf": {"G": 13.0, "D": 4.0},
    "hrrn": {"G": 14.0, "D": 11.0},
    "plexrl": {"G": 14.0, "D": 11.0},
}


@pytest.mark.parametrize("policy", list(EXPECTED), ids=list(EXPECTED))
def test_gang_reservation_timeline_per_policy(policy):
    jobs, (g0, g1) = three_jobs()
    service = run(Policy(policy), jobs)
    finished = {job.name: job.finished for job, _ in jobs}
    assert finished["A"] == 10.0
    for name, end in EXPECTED[policy].items():
        assert finished[name] == pytest.approx(end), (policy, finished)
    ledger = service.ledger
    # the collective is charged on both GPUs; nothing is charged for g1's reserved idle time
    assert ledger.jobs["G"].consumed_device_s == pytest.approx(6.0)
    assert dict(ledger.device_busy_s) == pytest.approx({0: 13.0, 1: 4.0})
    assert (g0.busy_s, g1.busy_s) == (13.0, 4.0)
    assert not g0.busy and not g1.busy and g0.group.idle == 2


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
    service = Service(loop, Policy.PLEXRL, on_job_done=lambda job: None)
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
