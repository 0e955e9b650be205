"""What the placer answers: a `Placement` (where a job lives) or a `Wait` (why it cannot be
placed now). Frozen data, compared by value: the simulator replays answers by equality
(`sim/placement_memo.py`) and tests compare decisions of two placers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """Where a job lives. The runtime starts the job's first step `phase_shift_s` after the
    decision time (a start offset; a re-placed job delays its next step by it) and keeps its
    states on `devices` (one per job device, all in `group`) and their nodes."""

    group: str
    phase_shift_s: float
    score: float  # device-seconds of projected overload on the job's devices over the horizon
    devices: tuple[int, ...] = ()
    inflation: float = 0.0  # estimated step inflation of the job, a fraction


@dataclass(frozen=True)
class Wait:
    """The job cannot be placed now; `reason` names the resource that is short."""

    reason: str
