"""Exact timelines on one worker, per request policy: hand-computed expectations.

Three jobs share one worker whose arena holds two of their three states (100 bytes each, 50
bytes/s each way, so a load or an offload takes 2 s). J1's state s1 and J2's state s2 start
resident. J1 runs 10 s from t=0; J2 (4 s, resident) arrives at t=1; J3 (2 s, not resident)
at t=2. At t=10 the worker chooses between J2 and J3:
  fcfs: J2 arrived first.                                    J2 [10,14], J3 [14,20]
  sjf: J3 is shorter.                                        J3 [10,16], J2 [16,20]
  hrrn: J2 1+9/4=3.25 < J3 1+8/2=5.                          J3 [10,16], J2 [16,20]
  plexrl: J3 pays the switch, S=2+2+2=6: 1+8/6=2.33 < 3.25.  J2 [10,14], J3 [14,20]
J3's dispatch offloads s1 (no queued work, least recently used), never s2 while J2 waits.
"""

from __future__ import annotations

import numpy as np
import pytest

from plexrl.policy import Policy
from plexrl.sim.engine import EventLoop
from plexrl.sim.group import Group
from plexrl.sim.phases import Phase
from plexrl.sim.service import SimJob, SimService
from plexrl.sim.worker import SimWorker
from plexrl.sim.workload import WorkloadJob


class ScriptedJob(SimJob):
    """A controller whose single step is a fixed list of phases (a fake at the plan seam)."""

    def __init__(self, name: str, arrival: float, phases: list[Phase]):
        super().__init__(WorkloadJob(name=name, params_b=1, steps=1), 0, 0, None, arrival)
        self.script = phases

    def next_phases(self) -> list[Phase]:
        return list(self.script)


def run_three_jobs(policy: Policy, record=None):
    """`record`: a `SimRecorder` the service reports to (test_sim_trace.py)."""
    loop = EventLoop()
    done: list[str] = []
    service = SimService(loop, policy, on_job_done=lambda job: done.append(job.name))
    service.record = record
    worker = SimWorker(wid=0, arena_bytes=200, host_bytes=10**6, link_bytes_per_s=50.0, disk_bytes_per_s=50.0)
    Group(0, [worker])
    jobs = [
        ScriptedJob("J1", 0.0, [Phase("update", "s", (10.0,))]),
        ScriptedJob("J2", 1.0, [Phase("update", "s", (4.0,))]),
        ScriptedJob("J3", 2.0, [Phase("update", "s", (2.0,))]),
    ]
    for job in jobs:
        worker.add_state(job.state_id("s"), job.name, 100)
        job.workers["s"] = [worker]
        # the estimator knows each call's duration, as after a few steps of profiling
        service.estimator.observe(job.state_id("s"), "update", job.script[0].shard_s[0])
        loop.at(job.arrival, service.start, job)
    worker.make_resident("J1/s", 0.0)
    worker.make_resident("J2/s", 0.0)
    loop.run()
    return {j.name: (j.started, j.finished) for j in jobs}, service, worker


EXPECTED = {
    "fcfs": {"J2": 14.0, "J3": 20.0},
    "sjf": {"J3": 16.0, "J2": 20.0},
    "hrrn": {"J3": 16.0, "J2": 20.0},
    "plexrl": {"J2": 14.0, "J3": 20.0},
}


@pytest.mark.parametrize("policy", list(EXPECTED), ids=list(EXPECTED))
def test_timeline_per_policy(policy):
    times, service, worker = run_three_jobs(Policy(policy))
    assert times["J1"] == (0.0, 10.0)
    for job, end in EXPECTED[policy].items():
        assert times[job][1] == pytest.approx(end), (policy, times)
    ledger = service.ledger
    # J3 paid one offload (s1) and one load (s3): 4 s of switch; nobody else switched
    assert ledger.jobs["J3"].switch_s == pytest.approx(4.0)
    assert ledger.jobs["J2"].switch_s == 0.0
    assert ledger.transitions_by_kind == {"offload": 1, "load": 1}
    assert worker.states["J1/s"].tier.value == "host"
    assert worker.states["J2/s"].tier.value == "device"
    # the worker was busy 10 + 4 + (4 + 2) = 20 s of the 20 s: no idle, nothing counted twice
    start, end, gpus = np.frombuffer(service.busy).reshape(-1, 3).T
    assert sum(ledger.device_busy_s.values()) == pytest.approx(20.0) == float(((end - start) * gpus).sum())


def test_waits_are_recorded_per_policy():
    _, service, _ = run_three_jobs(Policy.PLEXRL)
    waits = {job: u.queue_wait_s for job, u in service.ledger.jobs.items()}
    assert waits == pytest.approx({"J1": 0.0, "J2": 9.0, "J3": 12.0})


def test_what_loads_and_offloads_copy():
    """A load copies `loaded_nbytes` (a sampler: its weights, not its KV reserve); offloading a
    read-only state (a sampler, a reference model) copies nothing, a trainer all it holds."""
    w = SimWorker(wid=0, arena_bytes=250, host_bytes=10**6, link_bytes_per_s=50.0, disk_bytes_per_s=50.0)
    w.add_state("j/sampler", "j", 150, 0, loaded_nbytes=50, read_only=True)
    w.add_state("j/trainer", "j", 200)
    load = w.make_resident("j/sampler", 0.0)
    assert [(m.kind.value, m.nbytes, m.seconds) for m in load] == [("load", 50, 1.0)]
    assert w.load_estimate_s("j/sampler") == pytest.approx(1.0)
    swap = w.make_resident("j/trainer", 1.0)  # the sampler must make room
    assert [(m.kind.value, m.state_id, m.nbytes, m.seconds) for m in swap] == [
        ("offload", "j/sampler", 0, 0.0), ("load", "j/trainer", 200, 4.0)]
    back = w.make_resident("j/sampler", 2.0)
    assert [(m.kind.value, m.state_id, m.nbytes, m.seconds) for m in back] == [
        ("offload", "j/trainer", 200, 4.0), ("load", "j/sampler", 50, 1.0)]
    assert w.used == 150 == w.arena_used()
