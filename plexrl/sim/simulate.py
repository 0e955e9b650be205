"""Run one workload in every mode and compare: the simulator's entry point for code and CLI.

Modes by name: `modes.MODE_TABLE`; `alone` is a bound, run only when asked for (`BOUNDS`).
Every PlexRL mode places with the workload's placement settings: by default a shared placement
is taken where it lowers the summed completion time of the jobs involved, within every job's
slack (`pack_by_effect`; the simulator's jobs all declare their steps); the operator's fixed
`pack_limit` is an option (`plexrl sim --pack-limit 0.333`; `--pack-limit none`: each job's own
slack alone).
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Callable

from plexrl.sim.modes import MODE_TABLE, make_mode
from plexrl.sim.phases import StepPlans
from plexrl.sim.placement_memo import PlacementMemo
from plexrl.sim.report import BOUND_FIGURES, bounds, gain_captured, summarize
from plexrl.sim.runner import ModeResult
from plexrl.sim.workload import SimCluster, Workload

BOUNDS = ("alone",)  # not schedules: run when named (`--modes ...,alone`), not by default
MODES = tuple(m for m in MODE_TABLE if m not in BOUNDS)


# The request policies under phase-shift placement ask the placer the same questions until their
# timelines part, so they share one process's `PlacementMemo` when modes run in several processes.
SHARED_PLACEMENTS = ("plexrl", "plexrl-hrrn", "plexrl-sjf", "plexrl-fcfs")


def simulate(
    workload: Workload,
    cluster: SimCluster,
    modes: tuple[str, ...] = MODES,
    on_mode: Callable[[str], None] | None = None,
    processes: int = 1,
) -> dict:
    """{"events_per_s", "wall_s", "events", "processes", "results": {mode: summary}, "runs":
    {mode: ModeResult}}. With `processes` > 1 the modes run in that many forked processes (the
    results are the same: every mode is a pure function of the workload, tested); `on_mode` is
    called with each mode's name as it finishes. `events_per_s` is events over the wall time of
    the whole call; `events_per_process_s` over the summed wall time of the modes' runs."""
    unknown = [m for m in modes if m not in MODE_TABLE]
    if unknown:
        raise ValueError(f"unknown simulator modes {unknown}; expected some of {list(MODE_TABLE)}")
    if processes < 1:
        raise ValueError(f"processes = {processes}; expected at least 1")
    if "colocated" not in modes:
        modes = ("colocated", *modes)
    asked = modes
    if "alone" not in modes and workload.horizon_s is not None:  # colocated's step times do not make the bound
        modes = (*modes, "alone")
    t0 = time.perf_counter()
    batches = _batches(modes)
    processes = min(processes, len(batches))
    if processes == 1:
        runs = _run_modes(workload, cluster, modes, on_mode)
    else:
        runs = {}
        with ProcessPoolExecutor(processes, mp_context=_context(), initializer=_fresh_caches) as pool:
            for batch in as_completed([pool.submit(_run_pooled, workload, cluster, b) for b in batches]):
                for mode, run in batch.result().items():
                    runs[mode] = run
                    if on_mode:
                        on_mode(mode)
        runs = {m: runs[m] for m in modes}
    wall = time.perf_counter() - t0
    events = sum(r.events for r in runs.values())
    sim_wall = sum(r.wall_s for r in runs.values())
    results = {m: summarize(r, runs["colocated"]) for m, r in runs.items()}
    limits = bounds(runs.get("alone", runs["colocated"]), list(runs.values()), workload.horizon_s)
    for summary in results.values():
        summary.update(bound_figures(limits, gain_captured(summary, results["colocated"], limits)))
    return {
        "events_per_s": events / wall if wall > 0 else 0.0,
        "events_per_process_s": events / sim_wall if sim_wall > 0 else 0.0,
        "wall_s": wall,
        "events": events,
        "processes": processes,
        "results": {m: results[m] for m in asked},
        "runs": {m: runs[m] for m in asked},
    }


def bound_figures(limits: dict, gains: dict) -> dict:
    """The bounds and gains of one mode's summary, flat: `makespan_alone_s`, `makespan_fluid_s`,
    `makespan_bound_s` (the tighter), `gain_makespan`; the same for `jct_mean` and `steps`."""
    out = {}
    for figure in BOUND_FIGURES:
        name, unit = (figure[:-2], "_s") if figure.endswith("_s") else (figure, "")
        for which in ("alone", "fluid", "bound"):
            out[f"{name}_{which}{unit}"] = limits[figure][which]
        out[f"gain_{name}"] = gains[figure]
    return out


def _batches(modes: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Modes that run in one process, the largest batch first (it is submitted first, so the
    others fill the remaining processes around it)."""
    shared = tuple(m for m in modes if m in SHARED_PLACEMENTS)
    rest = [(m,) for m in modes if m not in SHARED_PLACEMENTS]
    return ([shared] if shared else []) + rest


# One process's shared caches: steps planned and placements answered by earlier modes of the
# same `simulate` call (a pool lives for one call; `_fresh_caches` starts each of its processes).
_caches: tuple[StepPlans, PlacementMemo] | None = None


def _fresh_caches() -> None:
    global _caches
    _caches = (StepPlans(), PlacementMemo())


def _run_modes(workload: Workload, cluster: SimCluster, modes: tuple[str, ...],
               on_mode: Callable[[str], None] | None = None,
               caches: tuple[StepPlans, PlacementMemo] | None = None) -> dict[str, ModeResult]:
    plans, placements = caches if caches is not None else (StepPlans(), PlacementMemo())
    runs = {}
    for mode in modes:
        runs[mode] = make_mode(mode, workload, cluster).run(plans, placements)
        if on_mode:
            on_mode(mode)
    return runs


def _run_pooled(workload: Workload, cluster: SimCluster, modes: tuple[str, ...]) -> dict[str, ModeResult]:
    """`_run_modes` in a pool's process, with that process's caches."""
    return _run_modes(workload, cluster, modes, caches=_caches)


def _context() -> multiprocessing.context.BaseContext:
    """Fork where there is one: a forked process starts in milliseconds with everything imported."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def over_seeds(workload: Workload, cluster: SimCluster, seeds: int, modes: tuple[str, ...] = MODES,
               on_mode: Callable[[str], None] | None = None, processes: int = 1) -> dict:
    """The same workload under seeds `workload.seed + k`, k < `seeds`: per mode, the mean and the
    worst of cost reduction and mean slowdown, and the worst p95 slowdown, so a figure that holds
    for one draw of lengths and tool waits only is visible as such."""
    if seeds < 1:
        raise ValueError(f"seeds = {seeds}; expected at least 1")
    per_seed = [simulate(workload.model_copy(update={"seed": workload.seed + k}), cluster, modes, on_mode, processes)
                for k in range(seeds)]
    table = {}
    for mode in per_seed[0]["results"]:
        rows = [run["results"][mode] for run in per_seed]
        cut = [r["cost_reduction_vs_colocated"] for r in rows]
        slow = [r["slowdown_mean"] for r in rows]
        table[mode] = {
            "cost_reduction_mean": sum(cut) / seeds, "cost_reduction_min": min(cut),
            "slowdown_mean_mean": sum(slow) / seeds, "slowdown_mean_max": max(slow),
            "slowdown_p95_max": max(r["slowdown_p95"] for r in rows),
            **_spread(rows, "steps", "capacity_vs_colocated", "jct_mean_s", "makespan_s", "makespan_floor_s",
                      "queue_delay_p99_s", "makespan_bound_s", "jct_mean_bound_s", "steps_bound",
                      "gain_makespan", "gain_jct_mean", "gain_steps",
                      "within_slack", "stranded_gpu_share", "inflation_mae", "inflation_mae_shared"),
        }
    return {"seeds": [workload.seed + k for k in range(seeds)], "modes": table, "runs": per_seed}


def _spread(rows: list[dict], *keys: str) -> dict:
    """Mean, min and max over seeds of each figure in `keys` that every seed reports."""
    out = {}
    for key in keys:
        values = [r.get(key) for r in rows]
        if all(v is not None for v in values):
            out.update({f"{key}_mean": sum(values) / len(values), f"{key}_min": min(values),
                        f"{key}_max": max(values)})
    return out
