"""The router: maps each model state to the worker group holding it and forwards requests there.

Stateless apart from the placement table it is given; a state never leaves its group (affinity).
Until the Placer decides (issue 4), a new job goes to the group with the fewest jobs, then bytes.
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

    def place(self, job: str) -> int:
        with self._lock:
            if job not in self._job_group:
                self._job_group[job] = min(range(len(self.groups)), key=self._group_bytes)
            return self._job_group[job]

    def _group_bytes(self, group: int) -> tuple[int, int, int]:
        jobs = sum(1 for g in self._job_group.values() if g == group)
        sm = self.groups[group].sm
        return (jobs, sum(s.host_bytes for s in sm.states.values()), group)

    def placement(self, job: str) -> int | None:
        return self._job_group.get(job)

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

    def set_sampler(self, trainer_id: str, name: str, state_id: str) -> None:
        with self._lock:
            self._samplers[(trainer_id, name)] = state_id

    def next_version(self, trainer_id: str, name: str) -> int:
        with self._lock:
            self._versions[(trainer_id, name)] += 1
            return self._versions[(trainer_id, name)]
