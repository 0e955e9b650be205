"""Whole-run invariants of every mode on a small workload: conservation, every request served
once, memory budgets, determinism under a seed, and cost/slowdown sanity against colocated."""

from __future__ import annotations

import numpy as np
import pytest

from plexrl.policy import Policy
from plexrl.sim.colocated_mode import AloneMode, ColocatedMode
from plexrl.sim.modes import make_mode
from plexrl.sim.plexrl_mode import PlexRLMode
from plexrl.sim.report import summarize, utilization_series
from plexrl.sim.simulate import over_seeds, simulate
from plexrl.sim.split_mode import SplitMode
from plexrl.sim.workload import SimCluster, Workload

# 4 nodes of 8 GPUs in 2 groups of 2 nodes: small enough that jobs must share and queue.
CLUSTER = SimCluster(name="tiny", nodes_per_pod=4, group_nodes=2)


def workload(seed: int = 0) -> Workload:
    return Workload.model_validate({
        "name": "small", "seed": seed,
        "jobs": [
            {"name": "math", "count": 3, "params_b": 7, "dp": 8, "steps": 3, "arrival_every_s": 50},
            {"name": "agent", "count": 3, "params_b": 7, "dp": 8, "steps": 3, "reward_s": 60,
             "rollout": {"turns": 3, "tool_s": 120, "prompts": 64}},
            {"name": "code", "algorithm": "dapo", "params_b": 30, "active_params_b": 3, "tp": 2, "dp": 8,
             "steps": 2, "reward_s": 300, "rollout": {"prompts": 64}},
        ],
    })


MODES = {
    "colocated": lambda w: ColocatedMode(w, CLUSTER),
    "split": lambda w: SplitMode(w, CLUSTER),
    **{f"plexrl-{p.value}": (lambda w, p=p: PlexRLMode(w, CLUSTER, p)) for p in Policy},
    "plexrl-firstfit": lambda w: make_mode("plexrl-firstfit", w, CLUSTER),
    "plexrl-pack": lambda w: make_mode("plexrl-pack", w, CLUSTER),
}


@pytest.fixture(scope="module")
def runs():
    return {name: make(workload()).run() for name, make in MODES.items()}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_request_served_once_and_every_job_finishes(runs, mode):
    result = runs[mode]
    for r in result.records:
        assert r.finished is not None, f"{mode}: {r.name} never finished"
        assert r.steps == len(r.step_times) > 0
        assert r.submitted == r.served > 0, f"{mode}: {r.name} submitted {r.submitted}, served {r.served}"
    ledger_requests = sum(j["requests"] for j in result.ledger["jobs"].values())
    assert ledger_requests == sum(r.served for r in result.records)


@pytest.mark.parametrize("mode", list(MODES))
def test_busy_plus_idle_is_capacity_times_time(runs, mode):
    result = runs[mode]
    start, end, gpus = result.busy_intervals
    assert np.all(end >= start)
    assert result.busy_gpu_s == pytest.approx(result.ledger["device_busy_s"], rel=1e-9)
    centres, share = utilization_series(result, bins=50)
    bin_s = result.end_s / 50
    idle = (1 - share).sum() * bin_s * result.cluster_gpus
    assert result.busy_gpu_s + idle == pytest.approx(result.cluster_gpus * result.end_s, rel=1e-9)
    assert np.all(share <= 1 + 1e-9) and np.all(share >= -1e-12)


@pytest.mark.parametrize("mode", [m for m in MODES if m.startswith("plexrl")])
def test_plexrl_charges_only_consumed_time(runs, mode):
    result, base = runs[mode], runs["colocated"]
    for r in result.records:
        assert r.charged_gpu_s <= r.gpus * (r.finished - r.started) + 1e-6
    s = summarize(result, base)
    assert 0 < s["cost_reduction_vs_colocated"] < 1
    assert s["switch_overhead_share"] >= 0


@pytest.mark.parametrize("mode", ["colocated"] + [m for m in MODES if m.startswith("plexrl")])
def test_no_mode_beats_the_makespan_floor(runs, mode):
    """`makespan_floor_s`: every job from its arrival at its colocated speed. A PlexRL job alone
    on its GPUs runs the colocated job's phases; sharing and switching only add to them."""
    base = runs["colocated"]
    floor = max(r.arrival + sum(r.step_times) for r in base.records) - min(r.arrival for r in base.records)
    s = summarize(runs[mode], base)
    assert s["makespan_floor_s"] == pytest.approx(floor, rel=1e-12)
    assert s["makespan_s"] >= floor * (1 - 1e-9)


@pytest.fixture(scope="module")
def alone():
    return AloneMode(workload(), CLUSTER).run()


def test_alone_is_every_job_from_its_arrival_at_its_colocated_speed(runs, alone):
    """The bound: no job queues or shares, each runs colocated's steps (the same plans), so its
    makespan is the report's `makespan_floor_s`, and it asked for more GPUs than the cluster has."""
    base = {r.name: r for r in runs["colocated"].records}
    assert all(r.queue_delay == 0.0 and not r.shared for r in alone.records)
    for r in alone.records:
        assert r.step_times == pytest.approx(base[r.name].step_times, rel=1e-12)
    s = summarize(alone, runs["colocated"])
    assert s["makespan_s"] == pytest.approx(s["makespan_floor_s"], rel=1e-12)
    assert s["queue_delay_p99_s"] == 0.0
    assert sum(r.gpus for r in alone.records) > CLUSTER.gpus


@pytest.mark.parametrize("mode", ["colocated"] + [m for m in MODES if m.startswith("plexrl")])
def test_no_job_completes_sooner_than_alone(runs, alone, mode):
    """Each job's completion time in a mode is at least its time alone (it waited and was slowed
    or not), so neither mean JCT nor makespan beats the bound."""
    floor = {r.name: r.finished - r.arrival for r in alone.records}
    for r in runs[mode].records:
        assert r.finished - r.arrival >= floor[r.name] * (1 - 1e-9), f"{mode}: {r.name}"
    s, bound = summarize(runs[mode], runs["colocated"]), summarize(alone, runs["colocated"])
    assert s["jct_mean_s"] >= bound["jct_mean_s"] * (1 - 1e-9)


def test_no_mode_completes_more_steps_by_a_horizon_than_alone():
    """Cut off by a horizon (the saturated workloads), no job completes more steps than alone:
    here colocated and PlexRL leave the code job and two math jobs queued or just started by
    the horizon, alone runs every job from its arrival."""
    cut = workload().model_copy(update={"horizon_s": 1500.0})
    runs = {name: MODES[name](cut).run() for name in ("colocated", "plexrl-plexrl")}
    alone = AloneMode(cut, CLUSTER).run()
    most = {r.name: r.steps for r in alone.records}
    assert sum(most.values()) > sum(r.steps for r in runs["colocated"].records)
    for name, result in runs.items():
        for r in result.records:
            assert r.steps <= most[r.name], f"{name}: {r.name}"


def test_same_seed_same_run_other_seed_other_run():
    a = simulate(workload(1), CLUSTER, ("colocated", "plexrl"))["results"]
    b = simulate(workload(1), CLUSTER, ("colocated", "plexrl"))["results"]
    c = simulate(workload(2), CLUSTER, ("colocated", "plexrl"))["results"]
    strip = lambda res: {m: {k: v for k, v in s.items() if k != "wall_s"} for m, s in res.items()}
    assert strip(a) == strip(b)
    assert strip(a) != strip(c)


def test_modes_see_the_same_jobs_and_draws(runs):
    """Colocated and PlexRL-alone-on-its-workers see identical step plans (same seed, same dp)."""
    names = {m: [r.name for r in res.records] for m, res in runs.items()}
    assert len({tuple(v) for v in names.values()}) == 1


def test_over_seeds_reports_each_seed_and_its_worst():
    modes = ("colocated", "plexrl")
    out = over_seeds(workload(seed=3), CLUSTER, 2, modes)
    assert out["seeds"] == [3, 4]
    per_seed = [simulate(workload(seed=s), CLUSTER, modes)["results"]["plexrl"] for s in (3, 4)]
    row = out["modes"]["plexrl"]
    cuts = [r["cost_reduction_vs_colocated"] for r in per_seed]
    assert row["cost_reduction_min"] == min(cuts)
    assert row["cost_reduction_mean"] == pytest.approx(sum(cuts) / 2)
    assert row["slowdown_mean_max"] == max(r["slowdown_mean"] for r in per_seed)
    assert row["slowdown_p95_max"] == max(r["slowdown_p95"] for r in per_seed)
    with pytest.raises(ValueError, match="seeds = 0"):
        over_seeds(workload(), CLUSTER, 0, modes)


def test_the_cost_cut_prices_the_same_steps_at_colocated_prices():
    """A mode that completes more of the costliest class's steps (the run's end cut colocated's
    large job off) is not charged for that mix: each class's steps are priced at colocated's
    cost per step of that class. Here each class costs 20% less, and the cut is 20%, where the
    ratio of the two averages would call it a 47% increase; a class colocated never ran is left out."""
    from plexrl.sim.report import cost_reduction, gpu_hours_per_step
    from plexrl.sim.runner import SimJobRecord, ModeResult

    def record(name, kind, steps, gpu_s_per_step):
        return SimJobRecord(name, 8, 0.0, 0.0, None, steps, [1.0] * steps, steps * gpu_s_per_step, 0.0, 0, 0, kind=kind)

    def result(records):
        return ModeResult("m", 16, records, 100.0, 0, 0.0, 0.0, 0.0)

    base = result([record("small-0", "small", 10, 100.0), record("large-0", "large", 1, 1000.0),
                   record("odd-0", "odd", 0, 0.0)])
    mode = result([record("small-0", "small", 10, 80.0), record("large-0", "large", 5, 800.0),
                   record("odd-0", "odd", 3, 5.0)])
    assert cost_reduction(mode, base) == pytest.approx(0.2)
    assert gpu_hours_per_step(mode) / gpu_hours_per_step(base) == pytest.approx(1.47125)  # the mix, not a price
    assert cost_reduction(base, base) == 0.0
