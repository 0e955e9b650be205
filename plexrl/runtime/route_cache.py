"""A front's copies of the control plane's tables: which node group each model is on, its
handle, each trainer's latest sampler snapshot per sync name.

Calls go straight from a front to their node, so a front routes from these copies and asks the
control plane only when a copy cannot answer: a model it has not seen (bound by another front)
or one on a group it has heard is lost (recovery moved its job). Invariants: `bind` tells the
control plane before the copy changes, so no front routes to a group the control plane does
not know; a `refresh` replaces every copy at once, under the lock.
"""

from __future__ import annotations

import threading

from plexrl.api.cluster import StateHandle
from plexrl.runtime.control_plane import ControlPlane


class RouteCache:
    def __init__(self, plane: ControlPlane):
        self.plane = plane
        self.handles: dict[str, StateHandle] = {}
        self.groups: dict[str, int] = {}
        self.samplers: dict[tuple[str, str], str] = {}  # (trainer id, sync name) -> state id
        self.lost_seen: set[int] = set()  # lost groups this front has heard of
        self._lock = threading.Lock()

    def bind(self, handle: StateHandle, group: int, sampler: tuple[str, str] | None = None) -> StateHandle:
        """Route `handle` to `group` (`sampler`: (trainer id, sync name) when it is that trainer's latest snapshot)."""
        self.plane.bind(handle, group, sampler)
        with self._lock:
            self.handles[handle.state_id] = handle
            self.groups[handle.state_id] = group
            if sampler is not None:
                self.samplers[sampler] = handle.state_id
        return handle

    def forget(self, state_id: str) -> None:
        with self._lock:
            self.handles.pop(state_id, None)
            self.groups.pop(state_id, None)

    def refresh(self) -> None:
        """Reload every copy from the control plane (after a node loss moved jobs)."""
        tables = self.plane.tables()
        with self._lock:
            self.handles, self.groups, self.samplers = tables.handles, tables.groups, tables.samplers

    def latest_sampler(self, trainer_id: str, name: str) -> StateHandle | None:
        state_id = self.samplers.get((trainer_id, name))
        if state_id is None or self.groups.get(state_id) in self.lost_seen:
            self.refresh()
            state_id = self.samplers.get((trainer_id, name))
        return None if state_id is None else self.handles.get(state_id)

    def models_of(self, job: str) -> list[StateHandle]:
        """The job's models, sampler snapshots left out."""
        return [h for h in list(self.handles.values()) if h.job == job and not h.is_snapshot]
