"""The admission queue: jobs the placer told to wait, retried whenever a job finishes.

Retries go in submission order, and a job that still does not fit does not block the ones
behind it (backfilling): a small job can overtake a large one. That keeps devices busy; the
price is that a large job can wait long on a busy cluster, which is why every wait is
recorded. Queueing delay = admission time - submission time (DESIGN §7), 0 for a job placed
at once. Time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

from plexrl.policy.placement import Placement, Placer, Wait
from plexrl.policy.profile import JobProfile


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
