"""The control plane as a front calls it: typed methods, whatever hosts it.

`ControlPlane` is the contract: every call a front makes to the cluster's one `Control`
(control.py) — placement, routes, checkpoints, lost groups, recovery points. `Control`
implements it where it lives (a thread pool in the driver's process, or a named Ray actor);
`ControlClient` implements it where a front is, over the handle an engine hosts `Control`
behind (plexrl/engines/: `_host_control`). A call crosses any host the same way
(`remote.call`: the handle's method of the same function, `.remote(*args)`), and is awaited
here: the control plane is never on a call's path, only on placement and table refreshes.

Invariants (tests/test_control_plane.py): `Control` and `ControlClient` each have every method
of `ControlPlane`, with its parameters; a PlexRL error raised in `Control` reaches the front as
it is, not wrapped by the transport (`remote.unwrapped`).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from plexrl.policy import JobProfile, ModelMemory
from plexrl.runtime import remote
from plexrl.runtime.control import Control, Recovery, RestoreInputs, Tables


class ControlPlane(Protocol):
    def describe(self) -> Any: ...  # front.Description: what an attaching front needs

    def new_front(self) -> int: ...

    def claim(self, job: str) -> int: ...

    def own(self, job: str, owner: int, state_id: str) -> None: ...

    def release(self, job: str, owner: int) -> tuple[list[str], bool]: ...

    def now(self) -> float: ...

    def admit(self, profile: JobProfile, slack: float, provisional: bool, timeout: float | None,
              ends: bool = False) -> tuple[int, float]: ...

    def placement(self, job: str) -> int | None: ...

    def finish(self, job: str) -> list[str]: ...

    def on_step(self, job: str, models: list[ModelMemory], events: list[dict] | None) -> tuple[int, float] | None: ...

    def migrated(self, job: str, source: int, target: int, states: list[str]) -> None: ...

    def bind(self, handle, group: int, sampler: tuple[str, str] | None = None) -> None: ...

    def unbind(self, state_id: str) -> None: ...

    def tables(self) -> Tables: ...

    def saved(self, state_id: str, job: str, path: str, with_optimizer: bool) -> None: ...

    def step(self, job: str, step: int, fields: dict) -> tuple[bool, float | None, int | None, float | None]: ...

    def begin_recovery(self, group: int) -> list[str] | None: ...

    def end_recovery(self, group: int) -> None: ...

    def lost_groups(self) -> dict[int, Recovery]: ...

    def restore_inputs(self, job: str) -> RestoreInputs: ...

    def restored(self, job: str, point: dict, counts: dict) -> None: ...

    def recovery_point(self, job: str) -> dict | None: ...

    def summary(self) -> dict: ...

    def events(self, job: str | None = None, since: float | None = None) -> list[dict]: ...


class ControlClient(ControlPlane):
    """`handle`: the hosted `Control` (a hosting.ThreadActor or a Ray actor handle); each method
    is one call to it, awaited."""

    def __init__(self, handle):
        self.handle = handle

    def _ask(self, method: Callable, *args):
        return remote.unwrapped(lambda: remote.get(remote.call(self.handle, method, *args)))

    def describe(self):
        return self._ask(Control.describe)

    def new_front(self) -> int:
        return self._ask(Control.new_front)

    def claim(self, job: str) -> int:
        return self._ask(Control.claim, job)

    def own(self, job: str, owner: int, state_id: str) -> None:
        self._ask(Control.own, job, owner, state_id)

    def release(self, job: str, owner: int) -> tuple[list[str], bool]:
        return self._ask(Control.release, job, owner)

    def now(self) -> float:
        return self._ask(Control.now)

    def admit(self, profile: JobProfile, slack: float, provisional: bool, timeout: float | None,
              ends: bool = False) -> tuple[int, float]:
        return self._ask(Control.admit, profile, slack, provisional, timeout, ends)

    def placement(self, job: str) -> int | None:
        return self._ask(Control.placement, job)

    def finish(self, job: str) -> list[str]:
        return self._ask(Control.finish, job)

    def on_step(self, job: str, models: list[ModelMemory], events: list[dict] | None) -> tuple[int, float] | None:
        return self._ask(Control.on_step, job, models, events)

    def migrated(self, job: str, source: int, target: int, states: list[str]) -> None:
        self._ask(Control.migrated, job, source, target, states)

    def bind(self, handle, group: int, sampler: tuple[str, str] | None = None) -> None:
        self._ask(Control.bind, handle, group, sampler)

    def unbind(self, state_id: str) -> None:
        self._ask(Control.unbind, state_id)

    def tables(self) -> Tables:
        return self._ask(Control.tables)

    def saved(self, state_id: str, job: str, path: str, with_optimizer: bool) -> None:
        self._ask(Control.saved, state_id, job, path, with_optimizer)

    def step(self, job: str, step: int, fields: dict) -> tuple[bool, float | None, int | None, float | None]:
        return self._ask(Control.step, job, step, fields)

    def begin_recovery(self, group: int) -> list[str] | None:
        return self._ask(Control.begin_recovery, group)

    def end_recovery(self, group: int) -> None:
        self._ask(Control.end_recovery, group)

    def lost_groups(self) -> dict[int, Recovery]:
        return self._ask(Control.lost_groups)

    def restore_inputs(self, job: str) -> RestoreInputs:
        return self._ask(Control.restore_inputs, job)

    def restored(self, job: str, point: dict, counts: dict) -> None:
        self._ask(Control.restored, job, point, counts)

    def recovery_point(self, job: str) -> dict | None:
        return self._ask(Control.recovery_point, job)

    def summary(self) -> dict:
        return self._ask(Control.summary)

    def events(self, job: str | None = None, since: float | None = None) -> list[dict]:
        return self._ask(Control.events, job, since)
