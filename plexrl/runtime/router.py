"""The router's tables: job -> node group, model state -> node group, trainer -> latest sampler.

Held by the control plane (decisions come from the Placer); fronts cache them and send each call
straight to its state's node. A state never leaves its group (affinity) unless a migration or a
recovery re-binds it.
"""

from __future__ import annotations

import threading



class Router:
    def __init__(self):
        self._job_group: dict[str, int] = {}
        self._state_group: dict[str, int] = {}
        self._samplers: dict[tuple[str, str], str] = {}
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
