"""Moves at step boundaries in the simulator (issue 11).

Defragmenting: a PlexRL job alone on its GPUs moves onto GPUs nobody uses when that lets a
waiting job start (`Placer.make_room`). Two node groups of 16 GPUs. `long-0` and `short-0` fill
the first, `long-1` and `short-1` the second; the short jobs end after one step, leaving 8 GPUs
free in each group, and `wide` (16 GPUs) cannot start in either. With moves, the first long job
to end a step after that moves onto the other group's free GPUs and `wide` starts on the GPUs it
left; without (`plexrl-nomove`), `wide` waits for a long job to end.

Into a share and back out (`SHARING`): one node group of 16 GPUs, two code jobs (long rewards:
their GPUs idle most of a step) on 8 GPUs each, and a math job that may share with neither
waits. At its next step boundary a code job moves beside the other (a share the placer judges
within both jobs' slack) and the math job starts on the GPUs it left; once the math job ends and nobody waits, the
shared code job moves back onto the GPUs nobody uses (`Placer.spread_out`)."""

from __future__ import annotations

import numpy as np
import pytest

from plexrl.policy import Policy
from plexrl.sim.latency import job_costs
from plexrl.sim.phases import states_of
from plexrl.sim.modes import make_mode
from plexrl.sim.plexrl_mode import PlexRLMode
from plexrl.sim.report import stranded_gpus, summarize
from plexrl.sim.runner import expand_jobs
from plexrl.sim.workload import GB, SimCluster, Workload

CLUSTER = SimCluster(name="tiny", nodes_per_pod=4, group_nodes=2)
WORKLOAD = Workload.model_validate({
    "name": "fragments", "seed": 0,
    "jobs": [
        # slack 2%: alone, a long job never consolidates its tails (~3% slower: `plexrl_mode.tail_pays`),
        # so its steps moved and unmoved differ by the move alone
        {"name": "long", "count": 2, "params_b": 7, "dp": 8, "steps": 6, "arrival_every_s": 2, "slack": 0.02},
        {"name": "short", "count": 2, "params_b": 7, "dp": 8, "steps": 1, "arrival_s": 1, "arrival_every_s": 2},
        {"name": "wide", "params_b": 7, "dp": 16, "steps": 2, "arrival_s": 5},
    ],
})


SHARED_GROUP = SimCluster(name="one-group", nodes_per_pod=2, group_nodes=2)
SHARING = Workload.model_validate({
    "name": "sharing", "seed": 0,
    "jobs": [
        {"name": "code", "count": 2, "params_b": 7, "dp": 8, "steps": 6, "arrival_every_s": 2, "reward_s": 650},
        {"name": "math", "params_b": 7, "dp": 8, "steps": 3, "arrival_s": 5, "reward_s": 10},
    ],
})


@pytest.fixture(scope="module")
def runs():
    moving, still = PlexRLMode(WORKLOAD, CLUSTER, Policy.PLEXRL), make_mode("plexrl-nomove", WORKLOAD, CLUSTER)
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


@pytest.fixture(scope="module")
def sharing():
    moving, still = PlexRLMode(SHARING, SHARED_GROUP, Policy.PLEXRL), make_mode("plexrl-nomove", SHARING, SHARED_GROUP)
    return {"moving": (moving, moving.run()), "still": (still, still.run())}


def test_a_job_moves_into_a_share_to_let_a_waiting_job_start_and_back_out_when_none_waits(sharing):
    _, result = sharing["moving"]
    got, still = records(result), records(sharing["still"][1])
    moved = [r for r in result.records if r.moves]
    assert [r.name for r in moved] == ["code-1"] and len(moved[0].moves) == 2
    (into, alone), (out, shared_gpus) = moved[0].moves
    assert got["math"].placed == into and set(alone) == set(got["math"].devices)  # math on what it left
    assert set(shared_gpus) == set(got["code-0"].devices)  # it shared code-0's GPUs
    assert got["math"].finished <= out < got["code-1"].finished  # back out once nobody waits
    assert not set(got["code-1"].devices) & set(got["code-0"].devices)
    assert got["code-0"].shared and got["code-1"].shared and not got["math"].shared
    # without moves math waits for a code job to end; with them the jobs complete sooner, in
    # sum and the last of them, though the code jobs run slower while they share (and code-1
    # waits once for the phase shift that aligns its steps with code-0's idle time)
    assert still["math"].placed == min(still["code-0"].finished, still["code-1"].finished) > into
    assert sum(r.finished - r.arrival for r in got.values()) < sum(r.finished - r.arrival for r in still.values())
    assert max(r.finished for r in got.values()) < max(r.finished for r in still.values())
    assert summarize(result, sharing["still"][1])["jobs_moved"] == 2


@pytest.mark.parametrize("run", ["moving", "still"])
@pytest.mark.parametrize("case", ["fragments", "sharing"])
def test_every_call_is_served_and_the_ledger_matches_the_busy_intervals(runs, sharing, case, run):
    _, result = (runs if case == "fragments" else sharing)[run]
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


@pytest.mark.parametrize("workload,cluster", [(WORKLOAD, CLUSTER), (SHARING, SHARED_GROUP)])
def test_moves_are_a_pure_function_of_the_workload(workload, cluster):
    again = PlexRLMode(workload, cluster, Policy.PLEXRL).run()
    first = PlexRLMode(workload, cluster, Policy.PLEXRL).run()
    assert again.records == first.records and again.ledger == first.ledger
