"""The control plane: one per cluster, every front talks to it (a named actor on Ray).

    Control (<cluster name>-control)
      ├ JobPlacer (runtime.job_placer): admission and the node group of every job
      ├ Router tables (runtime.router): job -> group, model -> group, trainer -> latest sampler
      └ what every front must agree on: model handles, checkpoints, lost groups, recovery points

A *front* (runtime/front.py: in the driver that started the cluster, or, on Ray,
`RayCluster.attach(name)` in a job's controller running as its own actor) asks the control plane
for placement and routes, caches them, and sends calls straight to node actors: the control plane
is never on a call's path. Everything here is plain tables; the actor is threaded because
admission may wait (`admit` blocks while the job waits for room).
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from dataclasses import dataclass

from plexrl.policy import JobProfile, ResourceView
from plexrl.runtime.events import EventLog
from plexrl.runtime.job_placer import JobPlacer, admit_and_route, route_migration
from plexrl.runtime.router import Router
from plexrl.runtime.telemetry import Telemetry

CONTROL_THREADS = 64  # admissions may wait for room; every other call returns at once


class Recovery(enum.Enum):
    """Where the recovery of a lost node group stands."""

    RUNNING = "running"
    DONE = "done"


@dataclass(frozen=True)
class Checkpoint:
    path: str
    with_optimizer: bool
    t: float  # control-plane clock when it completed
    step: int | None  # the job's last reported step then (None: before its first step mark)


@dataclass(frozen=True)
class Tables:
    """Every route, handle and sampler: what a front's caches are refreshed from."""

    handles: dict[str, object]  # state id -> StateHandle
    groups: dict[str, int]  # state id -> node group
    samplers: dict[tuple[str, str], str]  # (trainer id, sync name) -> its latest snapshot's id


@dataclass(frozen=True)
class RestoreInputs:
    """What restoring a job elsewhere needs (runtime/recovery.py)."""

    handles: list  # its StateHandles, sampler snapshots too
    synced: dict[str, list[str]]  # state id -> the names its weights were synced under
    checkpoints: dict[str, Checkpoint | None]  # state id -> its latest checkpoint
    started: float  # when the job was first admitted (control-plane clock)


class Control:
    """The control plane's tables and decisions; every method is a call of
    control_plane.ControlPlane (a front reaches it through control_plane.ControlClient)."""

    def __init__(self, description, epoch: float):
        """`description`: front.Description (settings, node ids, paths); the placer's view is built
        here (arrays that crossed a process boundary may arrive read-only, and the placer updates it)."""
        self.description = description  # what an attaching front needs: settings, nodes, paths
        config = description.config
        self.telemetry = Telemetry(EventLog(config.event_log, config.events_kept), epoch=epoch)
        view = ResourceView.uniform(pods=1, groups_per_pod=config.nodes, nodes_per_group=1,
                                    devices_per_node=config.devices_per_node, device_bytes=config.device_memory_bytes,
                                    host_bytes=config.host_memory_bytes)
        self.placer = JobPlacer(view, config.horizon_slots, config.slot_s, config.placement,
                                config.profile_steps, pack_limit=config.pack_limit)
        self.router = Router()
        self.handles: dict[str, object] = {}  # state id -> StateHandle
        self.checkpoints: dict[str, Checkpoint] = {}
        self.steps: dict[str, int] = {}
        self._step_times: dict[str, deque] = {}  # a job's last profile_steps + 1 step marks: its profile's window
        self.started: dict[str, float] = {}
        self.recovery_points: dict[str, dict] = {}
        self.recovery = {"node_losses": 0, "restored_from_checkpoint": 0, "restored_from_base": 0, "lost_work_s": 0.0}
        self._lost: dict[int, Recovery] = {}
        self.migrations = 0
        self._fronts = 0
        self._owners: dict[str, dict[int, set[str]]] = {}  # job -> service client number -> its state ids
        self._clients = 0
        self._lock = threading.Lock()

    def describe(self):
        return self.description

    def new_front(self) -> int:
        """A number for a new front (its request ids and call sequences are its own)."""
        with self._lock:
            self._fronts += 1
            return self._fronts

    def claim(self, job: str) -> int:
        """A number for a new service client of `job`: what it creates is its own (see `release`)."""
        with self._lock:
            self._clients += 1
            self._owners.setdefault(job, {})[self._clients] = set()
            return self._clients

    def own(self, job: str, owner: int, state_id: str) -> None:
        with self._lock:
            self._owners.get(job, {}).setdefault(owner, set()).add(state_id)

    def release(self, job: str, owner: int) -> tuple[list[str], bool]:
        """`owner` closed: the ids of the states it created (their sampler snapshots too), and
        whether it was the job's last open client (then the whole job finishes)."""
        with self._lock:
            owners = self._owners.get(job, {})
            mine = owners.pop(owner, set())
            last = not owners
        ids = [h.state_id for h in self._handles_of(job) if h.state_id.split("@")[0] in mine]
        return ids, last

    def now(self) -> float:
        return self.telemetry.now()

    # -- placement -------------------------------------------------------------------------------------
    def admit(self, profile: JobProfile, slack: float, provisional: bool, timeout: float | None,
              ends: bool = False) -> tuple[int, float]:
        """Place a job (waiting up to `timeout` s for room): its group and phase shift. `ends`:
        the job declared its length (`JobProfile.ends`)."""
        group, placement, decided = admit_and_route(self.placer, self.router, self.telemetry, profile, slack,
                                                    provisional, timeout, ends)
        with self._lock:
            self.started.setdefault(profile.job, decided)
        return group, placement.phase_shift_s

    def placement(self, job: str) -> int | None:
        return self.router.placement(job)

    def finish(self, job: str) -> list[str]:
        """The job is done: its routes go and its place is freed. Returns its state ids."""
        mine = [h.state_id for h in self._handles_of(job)]
        for sid in mine:
            self.unbind(sid)
        self.router.forget(job)
        self.placer.finish(job, self.telemetry.now())
        with self._lock:
            self._owners.pop(job, None)
            self._step_times.pop(job, None)
        return mine

    def on_step(self, job: str, models: list, events: list[dict] | None) -> tuple[int, float] | None:
        """The placer's look at a job's step boundary (`events`: the job's, when `step` said its profile is due):
        its new (group, phase shift) when it must move or shift, else None."""
        decision = self.placer.on_step(job, lambda: events, models, self.telemetry.now())
        if decision is None:
            return None
        return self.placer.group_index(decision), decision.phase_shift_s

    def migrated(self, job: str, source: int, target: int, states: list[str]) -> None:
        route_migration(self.router, self.telemetry, job, source, target, states)
        self.migrations += 1

    # -- routes ----------------------------------------------------------------------------------------
    def bind(self, handle, group: int, sampler: tuple[str, str] | None = None) -> None:
        """Route a model to `group`; `sampler` = (trainer id, sync name) when it is that trainer's
        latest snapshot under that name."""
        with self._lock:
            self.handles[handle.state_id] = handle
        self.router.bind(handle.state_id, group)
        if sampler is not None:
            self.router.set_sampler(*sampler, handle.state_id)

    def unbind(self, state_id: str) -> None:
        with self._lock:
            self.handles.pop(state_id, None)
        self.router.unbind(state_id)

    def tables(self) -> Tables:
        """Every route, handle and sampler: a front's cache is refreshed from this."""
        with self._lock:
            handles = dict(self.handles)
        return Tables(handles, {sid: self.router.group_of(sid) for sid in handles},
                      {(tid, name): self.router.sampler(tid, name)
                       for tid in handles for name in self.router.synced_names(tid)})

    # -- checkpoints and lost groups (orchestrated by a front: runtime/recovery.py) ------------------
    def saved(self, state_id: str, job: str, path: str, with_optimizer: bool) -> None:
        """A save_state completed: the model's latest checkpoint, at the job's last step mark."""
        self.checkpoints[state_id] = Checkpoint(path, with_optimizer, self.telemetry.now(), self.steps.get(job))

    def step(self, job: str, step: int, fields: dict) -> tuple[bool, float | None, int | None, float | None]:
        """A job's step mark (profiles are measured from these events): (whether the placer wants
        the job's events at this boundary (its profile is due), the time its events are wanted
        from (the step mark `profile_steps` steps back; None: all), the job's node group and its
        slack, for the group's scheduler; None when it is not placed)."""
        self.steps[job] = step
        now = self.telemetry.now()
        self.telemetry.events.emit(now, "step", job=job, step=step, **fields)
        with self._lock:
            times = self._step_times.setdefault(job, deque(maxlen=self.placer.profile_steps + 1))
            times.append(now)
            # a microsecond early: the record keeps its time rounded to 1 ns, and earlier records change nothing
            since = times[0] - 1e-6 if len(times) == times.maxlen else None
        return self.placer.profile_due(job), since, self.router.placement(job), self.placer.slack_of(job)

    def _handles_of(self, job: str) -> list:
        with self._lock:
            return [h for h in self.handles.values() if h.job == job]

    def begin_recovery(self, group: int) -> list[str] | None:
        """The first front to report `group` lost gets its jobs (and retires the group); later ones None."""
        with self._lock:
            if group in self._lost:
                return None
            self._lost[group] = Recovery.RUNNING
        jobs = self.router.jobs_on(group)
        self.placer.retire_group(group, jobs, self.telemetry.now())
        for job in jobs:
            self.router.forget(job)
        self.recovery["node_losses"] += 1
        self.telemetry.events.emit(self.telemetry.now(), "node_lost", group=group, jobs=jobs)
        return jobs

    def end_recovery(self, group: int) -> None:
        self._lost[group] = Recovery.DONE

    def lost_groups(self) -> dict[int, Recovery]:
        return dict(self._lost)

    def restore_inputs(self, job: str) -> RestoreInputs:
        """What restoring `job` needs: its handles, their sampler names and checkpoints, its start."""
        handles = self._handles_of(job)
        return RestoreInputs(handles, {h.state_id: self.router.synced_names(h.state_id) for h in handles},
                             {h.state_id: self.checkpoints.get(h.state_id) for h in handles},
                             self.started.get(job, 0.0))

    def restored(self, job: str, point: dict, counts: dict) -> None:
        self.recovery_points[job] = point
        for key, value in counts.items():
            self.recovery[key] += value
        self.telemetry.events.emit(self.telemetry.now(), "job_restored", job=job, **point)

    def recovery_point(self, job: str) -> dict | None:
        return self.recovery_points.get(job)

    def summary(self) -> dict:
        """What a front's metrics() adds to its nodes': lost groups, recovery counts, placements,
        the clock and the migrations, in one call."""
        now = self.telemetry.now()
        return {"lost": dict(self._lost), "recovery": dict(self.recovery), "placements": self.placer.summary(now),
                "now": now, "migrations": self.migrations}

    def events(self, job: str | None = None, since: float | None = None) -> list[dict]:
        return self.telemetry.events.snapshot(job, since)
