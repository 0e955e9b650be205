"""The admission queue: jobs the placer told to wait, retried whenever a job finishes.

Retries go in submission order, and a job that still does not fit does not block the ones
behind it (backfilling): a small job can overtake a large one. That keeps devices busy; the
price is that a large job can wait long on a busy cluster, which is why every wait is
recorded. Queueing delay = admission time - submission time (docs/design.md §7), 0 for a job placed
at once. A waiting job may also be admitted at a placed job's step boundary, when moving that
job lets it start (`make_room`: onto devices nobody uses or into a share). Time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

from collections.abc import Sequence

from plexrl.policy.placement import Placement, Placer, Wait
from plexrl.policy.profile import JobProfile

MEASURED_STEPS = 3  # steps a job's measured inflation averages over (the closed loop)


def measured_inflation(step_times_s: Sequence[float], period_s: float, last: int = MEASURED_STEPS) -> float:
    """A placed job's measured step inflation, what `Placer.observe` takes: the mean of its last
    `last` step durations against the period of the profile it was placed with, minus one,
    rounded to a point (the simulator and the runtime both measure it so)."""
    recent = list(step_times_s)[-last:]
    if not recent or period_s <= 0:
        raise ValueError(f"measured_inflation needs step times and a positive period; got {len(recent)} steps "
                         f"and period_s={period_s}")
    return round(sum(recent) / (len(recent) * period_s) - 1, 2)


class Forecast:
    """A placed job's predicted inflation as a step function of time, and its mean over the job's
    steps (what the simulator and the runtime report against the realised slowdown, itself a mean
    over steps). A stretch of `dt` seconds predicted at inflation x holds dt / (1 + x) steps' worth
    of the job's time alone, so that is its weight: a time average would count a slow stretch more,
    by the very slowdown it predicts. A value of None is a stretch without a prediction to judge
    (the runtime's placer holding a guess for the job or a co-tenant): it counts neither way. Times
    are passed in."""

    def __init__(self, since: float):
        self.last_t, self.value = since, 0.0
        self.area = 0.0  # sum of x * weight
        self.weight = 0.0  # sum of dt / (1 + x) over stretches with a value
        self.shared = False
        self.closed: float | None = None

    @staticmethod
    def _stretch(value: float, seconds: float) -> tuple[float, float]:
        weight = seconds / (1.0 + value)  # the model's inflations are never negative
        return value * weight, weight

    def update(self, now: float, value: float | None, shared: bool) -> None:
        if self.value is not None:
            area, weight = self._stretch(self.value, now - self.last_t)
            self.area += area
            self.weight += weight
        self.last_t, self.value = now, value
        self.shared = self.shared or shared

    def close(self, now: float) -> None:
        self.update(now, self.value, False)
        self.closed = now

    def mean(self, end: float) -> float | None:
        """The step-weighted mean over its time with a value, up to `end` (or its close); its
        latest value when no such time has passed (None when that is None too)."""
        area, weight = self.area, self.weight
        if self.closed is None and self.value is not None:
            more_area, more_weight = self._stretch(self.value, end - self.last_t)
            area, weight = area + more_area, weight + more_weight
        return area / weight if weight > 0 else self.value


@dataclass(frozen=True)
class Admission:
    job: str
    submitted_s: float
    admitted_s: float
    placement: Placement

    @property
    def queueing_delay_s(self) -> float:
        return self.admitted_s - self.submitted_s


@dataclass(frozen=True)
class Waiting:
    profile: JobProfile
    submitted_s: float
    reason: str  # the latest Wait reason


class AdmissionQueue:
    def __init__(self, placer: Placer):
        self.placer = placer
        self.admitted: dict[str, Admission] = {}  # every admission, finished jobs included
        self._waiting: dict[str, Waiting] = {}  # insertion order = submission order

    @property
    def waiting(self) -> tuple[Waiting, ...]:
        return tuple(self._waiting.values())

    @property
    def queued(self) -> int:
        """How many jobs wait."""
        return len(self._waiting)

    def submit(self, profile: JobProfile, now: float) -> Placement | Wait:
        """Place the job now, or queue it; either way the decision is returned."""
        if profile.job in self._waiting or profile.job in self.placer.placements():
            raise ValueError(f"job {profile.job!r} is already waiting or placed")
        return self._try(profile, submitted_s=now, now=now)

    def release(self, job: str, now: float) -> list[Admission]:
        """`job` is done: free its place and admit whoever now fits. Its record stays."""
        self.placer.release(job)
        return self.retry(now)

    def cancel(self, job: str) -> None:
        """Withdraw a job that is still waiting."""
        self._waiting.pop(job, None)

    def retry(self, now: float) -> list[Admission]:
        admitted = []
        for waiting in list(self._waiting.values()):
            del self._waiting[waiting.profile.job]
            if isinstance(self._try(waiting.profile, waiting.submitted_s, now), Placement):
                admitted.append(self.admitted[waiting.profile.job])
        return admitted

    def move(self, job: str, now: float) -> tuple[Placement, Admission | None] | None:
        """Moves at placed `job`'s step boundary, the rule both fronts follow: while jobs wait,
        when moving it lets one start (`make_room`: returns its new placement and the
        admission); while none waits, out of a share onto devices nobody uses
        (`Placer.spread_out`: its new placement, no admission), so that sharing lasts as long as
        it lets jobs start. None when it stays where it is."""
        if self._waiting:
            return self.make_room(job, now)
        moved = self.placer.spread_out(job, now)
        return None if moved is None else (moved, None)

    def make_room(self, job: str, now: float) -> tuple[Placement, Admission] | None:
        """Making room, at placed `job`'s step boundary: the first waiting job (in submission
        order) that can start if `job` moves (`Placer.make_room`) is admitted; returns (the job's
        new placement, the admission), or None when no waiting job can start so."""
        room = self.placer.room_if_moved(job) if self._waiting else 0
        if room == 0:  # it may not move, or nobody waits
            return None
        for waiting in [w for w in self._waiting.values() if w.profile.devices <= room]:
            found = self.placer.make_room(job, waiting.profile, now)
            if found is not None:
                moved, placement = found
                del self._waiting[waiting.profile.job]
                admission = self.admitted[waiting.profile.job] = Admission(waiting.profile.job, waiting.submitted_s,
                                                                           now, placement)
                return moved, admission
        return None

    def queueing_delays(self) -> dict[str, float]:
        """Seconds each admitted job waited (jobs still waiting are not in it)."""
        return {job: a.queueing_delay_s for job, a in self.admitted.items()}

    def _try(self, profile: JobProfile, submitted_s: float, now: float) -> Placement | Wait:
        decision = self.placer.place(profile, now)
        if isinstance(decision, Placement):
            self.admitted[profile.job] = Admission(profile.job, submitted_s, now, decision)
        else:
            self._waiting[profile.job] = Waiting(profile, submitted_s, decision.reason)
        return decision
