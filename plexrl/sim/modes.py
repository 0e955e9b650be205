"""The simulator's modes by name: the `Mode` class that runs each, its request policy, its options.

Modes: `colocated`, `split`, and PlexRL once per request policy — `plexrl` (the switch-aware
priority) and `plexrl-hrrn`, `plexrl-sjf`, `plexrl-fcfs`, all with phase-shift placement — and
`plexrl-firstfit` (switch-aware priority, first-fit placement), `plexrl-noshift` (the Placer's
groups and devices without phase shifts), `plexrl-pack` (the Placer packing into groups that
already carry jobs first, `Placer(pack_first=True)`), `plexrl-wholetail` (PlexRL without long-tail
consolidation: every sampler worker stays through the tail), `plexrl-alltail` (every job
consolidates its tails, sharing or not; `plexrl` consolidates only while a job shares its GPUs),
`plexrl-pinned` (a shared job's rollouts dealt to its replicas once instead of elastic) and
`plexrl-nomove` (no job moves at its step boundary: what moving jobs is worth).
`alone` is a bound, run only when asked for (`simulate.BOUNDS`): every job on GPUs of its own
from its arrival, never queueing or sharing (`colocated_mode.AloneMode`).

Invariants: the table is data (a mode class and the constructor options that make a variant);
every run builds a fresh mode from it, so a mode is a pure function of the workload and cluster.
The table's order is the order modes run and are reported in. A variant made by options reports
its results under its own name (`ModeResult.mode`); a request-policy variant under its class's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Mapping

from plexrl.policy import Policy
from plexrl.policy.placement import FirstFit, Placer
from plexrl.sim.colocated_mode import AloneMode, ColocatedMode
from plexrl.sim.plexrl_mode import PlexRLMode, Tail
from plexrl.sim.runner import Mode
from plexrl.sim.split_mode import SplitMode
from plexrl.sim.workload import SimCluster, Workload


@dataclass(frozen=True)
class ModeChoice:
    """One named mode: its class, the request policy its groups dispatch by, and the keyword
    options of the class that make the variant."""

    mode: type[Mode]
    policy: Policy = Policy.PLEXRL
    options: Mapping[str, Any] = field(default_factory=dict)

    def build(self, name: str, workload: Workload, cluster: SimCluster) -> Mode:
        mode = self.mode(workload, cluster, self.policy, **self.options)
        if self.options:
            mode.name = name
        return mode


MODE_TABLE: dict[str, ModeChoice] = {
    "colocated": ModeChoice(ColocatedMode),
    "split": ModeChoice(SplitMode),
    "plexrl": ModeChoice(PlexRLMode),
    "plexrl-hrrn": ModeChoice(PlexRLMode, Policy.HRRN),
    "plexrl-sjf": ModeChoice(PlexRLMode, Policy.SJF),
    "plexrl-fcfs": ModeChoice(PlexRLMode, Policy.FCFS),
    "plexrl-firstfit": ModeChoice(PlexRLMode, options={"placer": FirstFit}),
    # the Placer's choice of group and devices, but every job starts at once (one candidate shift)
    "plexrl-noshift": ModeChoice(PlexRLMode, options={"placer": partial(Placer, max_shifts=1)}),
    # a group already carrying jobs takes a newcomer whenever every job there stays within what it is judged by
    "plexrl-pack": ModeChoice(PlexRLMode, options={"placer": partial(Placer, pack_first=True)}),
    "plexrl-wholetail": ModeChoice(PlexRLMode, options={"tail": Tail.NEVER}),
    "plexrl-alltail": ModeChoice(PlexRLMode, options={"tail": Tail.ALWAYS}),
    "plexrl-pinned": ModeChoice(PlexRLMode, options={"elastic": False}),
    "plexrl-nomove": ModeChoice(PlexRLMode, options={"move_jobs": False}),
    "alone": ModeChoice(AloneMode),
}


def make_mode(name: str, workload: Workload, cluster: SimCluster) -> Mode:
    """A fresh mode `name` of `MODE_TABLE` for one run of `workload` on `cluster`."""
    return MODE_TABLE[name].build(name, workload, cluster)
