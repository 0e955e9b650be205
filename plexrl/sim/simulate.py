"""Run one workload in every mode and compare: the simulator's entry point for code and CLI.

Modes: `colocated`, `split`, and PlexRL once per request policy — `plexrl` (the switch-aware
priority) and `plexrl-hrrn`, `plexrl-sjf`, `plexrl-fcfs`, all with phase-shift placement — and
`plexrl-firstfit` (switch-aware priority, first-fit placement), `plexrl-noshift` (the Placer's
groups and devices without phase shifts), and `plexrl-wholetail` (PlexRL
without long-tail consolidation: every sampler worker stays through the tail).
"""

from __future__ import annotations

import time
from typing import Callable

from plexrl.policy import Policy
from plexrl.sim.colocated_mode import ColocatedMode
from plexrl.sim.phases import StepPlans
from plexrl.sim.placement_memo import PlacementMemo
from plexrl.sim.plexrl_mode import PlexRLMode, first_fit, no_shift, whole_tail
from plexrl.sim.report import summarize
from plexrl.sim.runner import Mode, ModeResult
from plexrl.sim.split_mode import SplitMode
from plexrl.sim.workload import Cluster, Workload


def mode_table() -> dict[str, Callable[[Workload, Cluster], Mode]]:
    table: dict[str, Callable[[Workload, Cluster], Mode]] = {
        "colocated": ColocatedMode,
        "split": SplitMode,
        "plexrl": lambda w, c: PlexRLMode(w, c, Policy.PLEXRL),
    }
    for policy in (Policy.HRRN, Policy.SJF, Policy.FCFS):
        table[f"plexrl-{policy.value}"] = lambda w, c, p=policy: PlexRLMode(w, c, p)
    table["plexrl-firstfit"] = lambda w, c: first_fit(w, c, Policy.PLEXRL)
    table["plexrl-noshift"] = lambda w, c: no_shift(w, c, Policy.PLEXRL)
    table["plexrl-wholetail"] = lambda w, c: whole_tail(w, c, Policy.PLEXRL)
    return table


MODES = tuple(mode_table())


def simulate(
    workload: Workload,
    cluster: Cluster,
    modes: tuple[str, ...] = MODES,
    on_mode: Callable[[str], None] | None = None,
) -> dict:
    """{"events_per_s", "wall_s", "events", "results": {mode: summary}, "runs": {mode: ModeResult}}."""
    table = mode_table()
    unknown = [m for m in modes if m not in table]
    if unknown:
        raise ValueError(f"unknown simulator modes {unknown}; expected some of {list(table)}")
    if "colocated" not in modes:
        modes = ("colocated", *modes)
    t0 = time.perf_counter()
    runs: dict[str, ModeResult] = {}
    plans = StepPlans()  # modes that plan a step alike draw and plan it once
    placements = PlacementMemo()  # modes that ask the placer the same question in the same state ask once
    for mode in modes:
        if on_mode:
            on_mode(mode)
        runs[mode] = table[mode](workload, cluster).run(plans, placements)
    wall = time.perf_counter() - t0
    events = sum(r.events for r in runs.values())
    sim_wall = sum(r.wall_s for r in runs.values())
    return {
        "events_per_s": events / sim_wall if sim_wall > 0 else 0.0,
        "wall_s": wall,
        "events": events,
        "results": {m: summarize(r, runs["colocated"]) for m, r in runs.items()},
        "runs": runs,
    }


def over_seeds(workload: Workload, cluster: Cluster, seeds: int, modes: tuple[str, ...] = MODES,
               on_mode: Callable[[str], None] | None = None) -> dict:
    """The same workload under seeds `workload.seed + k`, k < `seeds`: per mode, the mean and the
    worst of cost reduction and mean slowdown, and the worst p95 slowdown, so a figure that holds
    for one draw of lengths and tool waits only is visible as such."""
    if seeds < 1:
        raise ValueError(f"seeds = {seeds}; expected at least 1")
    per_seed = [simulate(workload.model_copy(update={"seed": workload.seed + k}), cluster, modes, on_mode)
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
        }
    return {"seeds": [workload.seed + k for k in range(seeds)], "modes": table, "runs": per_seed}
