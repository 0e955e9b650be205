"""Defragmenting in the simulator (issue 11): a PlexRL job alone on its GPUs moves at a step
boundary onto GPUs nobody uses when that lets a waiting job start (`Placer.make_room`).

Two node groups of 16 GPUs. `long-0` and `short-0` fill the first, `long-1` and `short-1` the
second; the short jobs end after one step, leaving 8 GPUs free in each group, and `wide` (16
GPUs) cannot start in either. With moves, the first long job to end a step after that moves
onto the other group's free GPUs and `wide` starts on the GPUs it left; without
(`plexrl-nodefrag`), `wide` waits for a long job to end."""

from __future__ import annotations

import numpy as np
import pytest

from plexrl.policy import Policy
from plexrl.sim.latency import job_costs
from plexrl.sim.phases import states_of
from plexrl.sim.plexrl_mode import PlexRLMode, no_defragment
from plexrl.sim.report import stranded_gpus, summarize
from plexrl.sim.runner import expand_jobs
from plexrl.sim.workload import GB, Cluster, Workload

CLUSTER = Cluster(name="tiny", nodes_per_pod=4, group_nodes=2)
WORKLOAD = Workload.model_validate({
    "name": "fragments", "seed": 0,
    "jobs": [
        {"name": "long", "count": 2, "params_b": 7, "dp": 8, "steps": 6, "arrival_every_s": 2},
        {"name": "short", "count": 2, "params_b": 7, "dp": 8, "steps": 1, "arrival_s": 1, "arrival_every_s": 2},
        {"name": "wide", "params_b": 7, "dp": 16, "steps": 2, "arrival_s": 5},
    ],
})


@pytest.fixture(scope="module")
def runs():
    moving, still = PlexRLMode(WORKLOAD, CLUSTER, Policy.PLEXRL), no_defragment(WORKLOAD, CLUSTER, Policy.PLEXRL)
    return {"moving": (moving, moving.run()), "still": (still, still.run())}


def records(result):
    return {r.name: r for r in result.records}


def test_a_move_at_a_step_boundary_lets_the_waiting_job_start(runs):
    mode, result = runs["moving"]
    got, still = records(result), records(runs["still"][1])
    moved = [r for r in result.records if r.moves]
    assert all(w.wid == d for d, w in mode.workers.items())  # a record's GPUs are the placer's devices
    assert mode.moves == 1 and len(moved) == 1 and len(moved[0].moves) == 1
    when, left = moved[0].moves[0]
    shorts_end = max(got["short-0"].finished, got["short-1"].finished)
    assert shorts_end < when < still["wide"].placed
    assert got["wide"].placed == when and set(left) < set(got["wide"].devices)
    assert not set(left) & set(moved[0].devices)  # it went where nobody was
    assert still["wide"].placed == min(still["long-0"].finished, still["long-1"].finished)
    assert summarize(result, result)["jobs_moved"] == 1


def test_the_move_pauses_the_moved_job_while_its_host_state_crosses(runs):
    """The step it moved before is the same step unmoved plus the pause (its host copies, trainer
    and reference, crossing at `network_gb_s` per GPU) and the loads onto its new GPUs (each GPU
    of a gang loads the same shard: the extra switch GPU-seconds over its 8 GPUs); every other
    step is the same step unmoved."""
    _, result = runs["moving"]
    moved = next(r for r in result.records if r.moves)
    same = records(runs["still"][1])[moved.name]
    spec = next(j for j in expand_jobs(WORKLOAD) if j.name == moved.name)
    assert "ref" in states_of(spec)
    costs = job_costs(spec, CLUSTER)
    pause_s = (costs.trainer_bytes + costs.ref_bytes) / (CLUSTER.network_gb_s * GB)
    reload_s = (moved.switch_gpu_s - same.switch_gpu_s) / moved.gpus
    assert pause_s > 0 and reload_s > 0
    k = int(np.searchsorted(np.cumsum(moved.step_times), moved.moves[0][0] - moved.started + 1e-6))
    assert moved.step_times[k] - same.step_times[k] == pytest.approx(pause_s + reload_s, rel=1e-6)
    others = [i for i in range(moved.steps) if i != k]
    assert [moved.step_times[i] for i in others] == pytest.approx([same.step_times[i] for i in others], rel=1e-12)


@pytest.mark.parametrize("run", ["moving", "still"])
def test_every_call_is_served_and_the_ledger_matches_the_busy_intervals(runs, run):
    _, result = runs[run]
    for r in result.records:
        assert r.finished is not None and r.submitted == r.served > 0
    assert result.busy_gpu_s == pytest.approx(result.ledger["device_busy_s"], rel=1e-9)


def test_stranded_gpus_follow_a_moved_job_to_its_new_gpus(runs):
    """The report's share against counting held GPUs at 4,000 instants, a moved job holding the
    GPUs it left until its move and its new ones after."""
    _, result = runs["moving"]
    times = (np.arange(4000) + 0.5) * result.end_s / 4000
    free, waiting = [], []
    for t in times:
        held = set()
        for r in result.records:
            if r.placed is None or not r.placed <= t < r.finished:
                continue
            since, gpus = r.placed, r.devices
            for when, left in r.moves:
                if t < when:
                    gpus = left
                    break
                since = when
            held |= set(gpus)
        free.append(result.cluster_gpus - len(held))
        waiting.append(any(r.arrival <= t and (r.placed is None or t < r.placed) for r in result.records))
    free, waiting = np.array(free), np.array(waiting)
    sampled = (free * waiting).sum() / (result.cluster_gpus * waiting.sum())
    assert stranded_gpus(result)[1] == pytest.approx(sampled, abs=0.01)
    assert stranded_gpus(result)[1] < stranded_gpus(runs["still"][1])[1]


def test_moves_are_a_pure_function_of_the_workload():
    again = PlexRLMode(WORKLOAD, CLUSTER, Policy.PLEXRL).run()
    first = PlexRLMode(WORKLOAD, CLUSTER, Policy.PLEXRL).run()
    assert again.records == first.records and again.ledger == first.ledger
