"""The router: maps each model state to the worker group holding it and forwards requests there.

Stateless apart from the placement table it is given (decisions come from the Placer); a state
never leaves its group (affinity) unless a migration re-binds it.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from plexrl.runtime.scheduler import GroupScheduler, Request


class Router:
    def __init__(self, groups: list[GroupScheduler]):
        self.groups = groups
        self._job_group: dict[str, int] = {}
        self._state_group: dict[str, int] = {}
        self._samplers: dict[tuple[str, str], str] = {}
        self._versions: dict[tuple[str, str], int] = defaultdict(int)
        self._lock = threading.Lock()

    def assign(self, job: str, group: int) -> None:
        with self._lock:
            self._job_group[job] = group

    def forget(self, job: str) -> None:
        with self._lock:
            self._job_group.pop(job, None)

    def placement(self, job: str) -> int | None:
        return self._job_group.get(job)

    def jobs_on(self, group: int) -> list[str]:
        with self._lock:
            return sorted(job for job, g in self._job_group.items() if g == group)

    def bind(self, state_id: str, group: int) -> None:
        with self._lock:
            self._state_group[state_id] = group

    def unbind(self, state_id: str) -> None:
        with self._lock:
            self._state_group.pop(state_id, None)

    def group_of(self, state_id: str) -> int | None:
        return self._state_group.get(state_id)

    def route(self, request: Request) -> None:
        self.groups[self._state_group[request.state_id]].submit(request)

    # Sampler snapshots of trainable models (weight sync targets).
    def sampler(self, trainer_id: str, name: str) -> str | None:
        return self._samplers.get((trainer_id, name))

    def synced_names(self, trainer_id: str) -> list[str]:
        """The sampler names `trainer_id`'s weights have been synced to."""
        with self._lock:
            return sorted(name for (tid, name) in self._samplers if tid == trainer_id)

    def set_sampler(self, trainer_id: str, name: str, state_id: str) -> None:
        with self._lock:
            self._samplers[(trainer_id, name)] = state_id

    def next_version(self, trainer_id: str, name: str) -> int:
        with self._lock:
            self._versions[(trainer_id, name)] += 1
            return self._versions[(trainer_id, name)]
