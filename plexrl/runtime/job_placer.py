"""Job placement on the local cluster: the pure Placer and AdmissionQueue, plus what a runtime
adds — waiting callers, provisional placement, online profiling and re-placement (docs/design.md §6).

- A job that brings a `JobProfile` is placed with it (and may wait for room: admission).
- A job that brings none is admitted *provisionally* when its first model arrives: its demand is
  assumed to be one busy device, and no slack check is made (a job is not refused on a guess);
  memory still has to fit. After `profile_steps` step boundaries its profile is measured from
  the event log and it is re-placed with its real slack; later it is re-placed whenever the
  measured profile drifts from the one it was placed with. A new group means a migration,
  which the cluster carries out (spill on the old node, restore on the new one). A refused
  re-placement leaves the job where it is, and the placer holds its measured profile there
  (`Placer.reprofile`): later decisions rest on what the job does, not on the guess.
- Profiles are measured with the job's waits for devices cut out (`profile_from_events`), and
  the placer models the group's devices as a pool (`Placer(pooled=True)`), as the group
  scheduler runs them. What it predicts for each job is kept over time (`Forecast`, while no
  job of the group is on a guess) and reported as `inflation_predicted` next to the inflation
  measured from the job's step times.
- A placement's phase shift delays the job's start (or, when re-placed, its next step).
- Moves at step boundaries, for a job placed on its measured profile: while jobs wait, a job
  alone on its devices moves when that lets a waiting job start (`Placer.make_room`: onto
  devices nobody uses, or into a share every tenant's judgement accepts); the waiting job is
  admitted on what it left. While none waits, a job that shares devices moves onto devices
  nobody uses where there are some (`Placer.spread_out`). The cluster migrates a job that
  changes group as for a re-placement.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

import numpy as np

from plexrl import errors
from plexrl.policy import (
    MEASURED_STEPS,
    AdmissionQueue,
    Forecast,
    JobProfile,
    ModelMemory,
    Placement,
    ResourceView,
    Wait,
    drifted,
    measured_inflation,
    profile_from_events,
)
from plexrl.runtime.config import PLACEMENTS

if TYPE_CHECKING:
    from plexrl.runtime.router import Router
    from plexrl.runtime.telemetry import Telemetry

log = logging.getLogger("plexrl.runtime")

WAIT_LOG_S = 30.0  # a wait for admission is logged this often, with its reason
PROVISIONAL_PERIOD_S = 1.0


@dataclass
class JobRecord:
    profile: JobProfile
    slack: float  # the job's own slack (a provisional profile is placed without one)
    ends: bool = False  # it declared its length (`JobProfile.ends`; a provisional profile is placed without it)
    placement: Placement | None = None
    provisional: bool = False
    steps_seen: int = 0
    migrations: int = 0
    replacements: int = 0
    reason: str = ""  # the latest Wait reason while waiting
    refused: str = ""  # why its latest re-placement was refused ("" once one is taken)
    guessed: bool = False  # `profile` is the provisional guess (no measured one held yet)
    forecast: Forecast | None = None  # the placer's prediction for it over time, once its profile is measured
    history: list[str] = field(default_factory=list)
    step_marks: list[float] = field(default_factory=list)  # its latest step boundaries since it was (re-)placed
    measured: float | None = None  # its measured step inflation, as the placer was last told


class JobPlacer:
    def __init__(self, view: ResourceView, horizon_slots: int, slot_s: float, placement: str,
                 profile_steps: int, drift_tolerance: float = 0.25, pack_limit: float | None = None):
        placer_cls = PLACEMENTS[placement]  # `ClusterConfig.placement`
        # pooled: the group scheduler runs a group's states on whichever of its devices is free
        self.placer = placer_cls(view, horizon_slots=horizon_slots, slot_s=slot_s, pack_limit=pack_limit, pooled=True)
        self.queue = AdmissionQueue(self.placer)
        self.slot_s = slot_s
        self.profile_steps = profile_steps
        self.drift_tolerance = drift_tolerance
        self.jobs: dict[str, JobRecord] = {}
        self._cond = threading.Condition()

    def group_index(self, placement: Placement) -> int:
        return self.placer.view.index[placement.group]

    # -- admission ----------------------------------------------------------------------------------
    def admit(self, profile: JobProfile, slack: float, provisional: bool, now, timeout: float | None,
              ends: bool = False) -> Placement:
        """Place `profile`'s job, waiting (up to `timeout` s) while the placer says Wait. `ends`:
        it declared its length; its measured profiles say so (a provisional one does not: it is
        placed without a slack check)."""
        with self._cond:
            if profile.job in self.jobs and self.jobs[profile.job].placement is not None:
                return self.jobs[profile.job].placement
            if any(w.profile.job == profile.job for w in self.queue.waiting):
                return self._join(profile.job, now, timeout)
            self._check_ever_fits(profile)
            if not provisional:
                profile = replace(profile, ends=ends)
            record = JobRecord(profile, slack, ends, provisional=provisional, guessed=provisional)
            self.jobs[profile.job] = record
            decision = self.queue.submit(profile, now())
            if isinstance(decision, Wait):
                decision = self._await_admission(profile.job, now, timeout, record)
            record.placement = decision
            record.history.append(decision.group)
            if not provisional:
                record.forecast = Forecast(now())
            self._forecast(decision.group, now())
            return decision

    def _join(self, job: str, now, timeout: float | None) -> Placement:
        """A second model of a job that waits for admission waits with it (the job is placed once,
        with the profile it waits with). Call with the condition held."""
        return self._await_admission(job, now, timeout, None)

    def _await_admission(self, job: str, now, timeout: float | None, first: JobRecord | None) -> Placement:
        """Wait while `job` is in the admission queue: its placement once admitted, else
        AdmissionTimeout past `timeout` (the job's first waiter, `first`, then withdraws it, and
        models that joined its wait stop too) or once it left the queue unadmitted (finished).
        Every WAIT_LOG_S the wait is logged with what it waits for and since when. Call with the
        condition held."""
        since = now()
        deadline = None if timeout is None else since + timeout
        logged = since
        while True:
            record = self.jobs.get(job)
            if first is None and record is not None and record.placement is not None:
                return record.placement
            waiting = next((w for w in self.queue.waiting if w.profile.job == job), None)
            if waiting is None:
                if job in self.queue.admitted and record is not None:
                    return self.queue.admitted[job].placement
                raise errors.AdmissionTimeout(f"job {job!r} stopped waiting for room before it was admitted (it "
                                              "finished, or the wait of another of its models timed out)")
            if first is not None:
                first.reason = waiting.reason
            left = None if deadline is None else deadline - now()
            if left is not None and left <= 0:
                if first is not None:
                    self.queue.cancel(job)
                    del self.jobs[job]
                    self._cond.notify_all()
                raise errors.AdmissionTimeout(f"job {job!r} waited {timeout} s for room and was not admitted: "
                                              f"{waiting.reason}")
            self._cond.wait(WAIT_LOG_S if left is None else min(left, WAIT_LOG_S))  # woken when the queue retried
            if now() - logged >= WAIT_LOG_S:
                logged = now()
                log.info("job %r has waited %.0f s for room on the cluster: %s", job, logged - since, waiting.reason)

    def _check_ever_fits(self, profile: JobProfile) -> None:
        """Waiting only makes sense for room that other jobs hold, not for a cluster too small."""
        view = self.placer.view
        if profile.device_bytes > view.node_arena.max():
            raise errors.StateTooLarge(
                f"job {profile.job!r} has a model of {profile.device_bytes:,} device bytes; the largest device "
                f"budget is {int(view.node_arena.max()):,} bytes")
        if profile.host_bytes_per_device > view.node_host.max() or profile.devices > view.capacity.max():
            raise errors.StateTooLarge(
                f"job {profile.job!r} needs {profile.devices} device(s) with {profile.host_bytes_per_device:,} host "
                f"bytes each; no node group has that even when empty")

    def finish(self, job: str, now: float) -> None:
        with self._cond:
            record = self.jobs.get(job)
            if record is not None and record.placement is not None:
                if record.forecast is not None:
                    record.forecast.close(now)
                self.queue.release(job, now)
                self._forecast(record.placement.group, now)
            else:
                self.queue.cancel(job)
            self._cond.notify_all()

    def retire_group(self, group: int, jobs: list[str], now: float) -> None:
        """Node group `group` is gone (a lost node): `jobs` leave it, to be admitted again elsewhere,
        and nothing is placed there any more (all its host memory is held by a marker)."""
        with self._cond:
            for job in jobs:
                record = self.jobs.pop(job, None)
                if record is not None and record.placement is not None:
                    self.queue.release(job, now)
            view = self.placer.view
            devices = view.groups[group].devices
            per_device = min(int(view.node_host[n] - view.host_used[n]) // int(view.node_devices[n])
                             for n in np.flatnonzero(view.node_group == group))
            view.allocate(f"<lost node group {group}>", devices, per_device)
            self._cond.notify_all()

    # -- online profiling -----------------------------------------------------------------------------
    def slack_of(self, job: str) -> float | None:
        """The job's own slack (None: not known here)."""
        with self._cond:
            record = self.jobs.get(job)
            return None if record is None else record.slack

    def profile_due(self, job: str) -> bool:
        """Whether the job's next `on_step` measures its profile (and so reads the events)."""
        with self._cond:
            record = self.jobs.get(job)
            return record is not None and record.placement is not None and (record.steps_seen + 1) % self.profile_steps == 0

    def on_step(self, job: str, events: Callable[[], list[dict]], models: list[ModelMemory],
                now: float) -> Placement | None:
        """Called at a job's step boundary. The closed loop: once the job has run MEASURED_STEPS
        steps where it is, the placer is told its measured step inflation (`Placer.observe`;
        admission judges its group's room by it). Every `profile_steps` steps the job's profile
        is measured from `events()` (read only then: the job's records of the steps it measures). Returns a new
        placement when the job must move."""
        with self._cond:
            record = self.jobs.get(job)
            if record is None or record.placement is None or not models:
                return None
            record.steps_seen += 1
            self._observe(job, record, now)
            moved = self._move(job, record, now)
            if moved is not None:
                return moved
            if record.steps_seen % self.profile_steps:
                return None
            log = events()
            try:
                measured = profile_from_events(log, job, self.slot_s, models, slack=record.slack,
                                               last_steps=self.profile_steps, ends=record.ends)
            except ValueError:
                return None  # not enough step records to measure yet
            if not (record.provisional or drifted(record.profile, measured, self.drift_tolerance)):
                return None
            decision = self.placer.replace(measured, now)
            record.replacements += 1
            if isinstance(decision, Wait):  # it keeps its old place (measured again later), now known as it is
                record.refused = decision.reason
                here = len(record.placement.devices)  # what it has where it stays
                if measured.devices != here:
                    measured = profile_from_events(log, job, self.slot_s, models, devices=here, slack=record.slack,
                                                   last_steps=self.profile_steps, ends=record.ends)
                self.placer.reprofile(measured)
                self._measured_now(record, measured, now)
                self._forecast(record.placement.group, now)
                return None
            record.refused, record.provisional = "", False
            self._measured_now(record, measured, now)
            return self._relocate(record, decision, now)

    def _move(self, job: str, record: JobRecord, now: float) -> Placement | None:
        """Moves at the step boundary (under the lock, `AdmissionQueue.move`), for a job placed on
        its measured profile: while jobs wait, when moving it lets one start (`make_room`: only off
        devices it uses alone, onto devices nobody uses or into a share every tenant's judgement
        accepts), and the waiting job's `admit` is woken with its placement; while none waits,
        out of a share onto devices nobody uses (`Placer.spread_out`). The new placement is
        returned when it changes group or phase (the cluster migrates the job: spill on the old
        node, restore on the new one)."""
        if record.provisional:
            return None
        found = self.queue.move(job, now)
        if found is None:
            return None
        moved = found[0]
        if moved.devices != record.placement.devices:
            record.step_marks, record.measured = [now], None  # measured where it now is, from here on
        self._cond.notify_all()
        return self._relocate(record, moved, now)

    def _relocate(self, record: JobRecord, placement: Placement, now: float) -> Placement | None:
        """The job's placement is now `placement` (re-placed or moved); its history, migrations
        and both groups' predictions follow. Returns it when the cluster must act on it: another
        group (a migration) or a phase shift before the job's next step."""
        old = record.placement
        record.placement = placement
        record.history.append(placement.group)
        if placement.group != old.group:
            record.migrations += 1
        self._forecast(old.group, now)
        self._forecast(placement.group, now)
        return placement if placement.group != old.group or placement.phase_shift_s > 0 else None

    def _measured_now(self, record: JobRecord, measured: JobProfile, now: float) -> None:
        """`measured` is the profile the placer holds for the job from now on."""
        record.profile = measured
        record.step_marks = [now]  # measured against its new profile from here on
        record.measured = None  # so its first inflation measured against it is told, changed or not
        if record.guessed:  # its predictions count from its first measured profile
            record.guessed, record.forecast = False, Forecast(now)

    def _forecast(self, group: str, now: float) -> None:
        """The jobs placed on `group` have new co-tenants or profiles: record what the placer now
        predicts for each (a job on its guess has no prediction yet)."""
        placed = self.placer.placements()
        here = {job for job, p in placed.items() if p.group == group}
        guessing = any(self.jobs[job].guessed for job in here if job in self.jobs)
        for job in here:
            forecast = self.jobs[job].forecast if job in self.jobs else None
            if forecast is not None and forecast.closed is None:  # no prediction to judge while any is a guess
                forecast.update(now, None if guessing else self.placer.inflation_of(job), len(here) > 1)

    def _observe(self, job: str, record: JobRecord, now: float) -> None:
        """Tell the placer the job's step inflation over its last MEASURED_STEPS steps against the
        period of the profile it was placed with (a provisional profile is a guess: not measured
        against), when it changed by a point or more."""
        record.step_marks = [*record.step_marks, now][-(MEASURED_STEPS + 1):]
        if record.guessed or len(record.step_marks) <= MEASURED_STEPS:
            return
        inflation = measured_inflation(np.diff(record.step_marks).tolist(), record.profile.period_s)
        if record.measured != inflation:
            record.measured = inflation
            self.placer.observe(job, inflation)

    # -- observability ----------------------------------------------------------------------------------
    def summary(self, now: float) -> dict[str, dict]:
        """Per job: where it is, why it waits or stays, and the placer's predicted step inflation:
        at its placement (`inflation`) and averaged over its time placed with a measured profile
        up to `now` or its end (`inflation_predicted`: what its realised slowdown compares to)."""
        with self._cond:
            delays = self.queue.queueing_delays()
            waiting = {w.profile.job: w.reason for w in self.queue.waiting}
            out = {}
            for job, r in self.jobs.items():
                p = r.placement
                out[job] = {
                    "group": None if p is None else self.group_index(p),
                    "group_name": None if p is None else p.group,
                    "phase_shift_s": None if p is None else p.phase_shift_s,
                    "score": None if p is None else p.score,
                    "inflation": None if p is None else p.inflation,
                    "inflation_predicted": None if r.forecast is None else r.forecast.mean(now),
                    "measured_inflation": r.measured,
                    "provisional": r.provisional,
                    "replacement_refused": r.refused or None,  # why it stays where it is, when it does
                    "queueing_delay_s": delays.get(job, 0.0),
                    "waiting_reason": waiting.get(job),
                    "slack": r.slack,
                    "migrations": r.migrations,
                    "replacements": r.replacements,
                }
            return out


def admit_and_route(placer: JobPlacer, router: Router, telemetry: Telemetry, profile: JobProfile, slack: float,
                    provisional: bool, timeout: float | None, ends: bool = False) -> tuple[int, Placement, float]:
    """Admit a job (waiting up to `timeout` s for room), route it to its group and log the
    placement: (group, placement, when admission began). Shared by every engine's control."""
    decided = telemetry.now()
    placement = placer.admit(profile, slack, provisional, telemetry.now, timeout, ends)
    group = placer.group_index(placement)
    router.assign(profile.job, group)
    telemetry.events.emit(telemetry.now(), "placement", job=profile.job, group=group,
                          phase_shift_s=placement.phase_shift_s, score=placement.score,
                          provisional=provisional, waited_s=telemetry.now() - decided)
    return group, placement, decided


def route_migration(router: Router, telemetry: Telemetry, job: str, source: int, target: int,
                    states: list[str]) -> None:
    """A job's states moved from group `source` to `target`: route it there and log it."""
    router.assign(job, target)
    telemetry.events.emit(telemetry.now(), "migration", job=job, source=source, target=target, states=states)


def provisional_profile(job: str, models: list[ModelMemory], slot_s: float) -> JobProfile:
    """Worst-case guess for a job that brought no profile: one device busy all the time.
    Placed without a slack check (slack=inf); the measured profile replaces it."""
    slots = max(1, math.ceil(PROVISIONAL_PERIOD_S / slot_s))
    return JobProfile(job, slots * slot_s, (1.0,) * slots, 1, tuple(models), slack=math.inf)
