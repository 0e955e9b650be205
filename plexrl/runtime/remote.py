"""How runtime pieces reach each other, whatever hosts them (docs/design.md §8).

Every handle looks like a Ray actor handle: `handle.method.remote(*args)` returns a reference.
A reference is a `concurrent.futures.Future` (the local and process engines, engines/hosting.py),
a `Done` (a call already run on the caller's thread) or a Ray object reference (the Ray engine).
These helpers treat both alike and import Ray only when they meet a Ray reference, so the local
and process engines run where Ray is not installed. A typed call names the hosted class's
function (`call(handle, Control.admit, ...)`), never a method's name as a string.
"""

from __future__ import annotations

import sys
from concurrent.futures import Future
from typing import Any, Callable

from plexrl.api import errors


class WorkerGone(RuntimeError):
    """The process hosting a piece died while a call was in flight (or before it was sent)."""


class Done:
    """The reference an inline call returns: already resolved (cheaper than a Future)."""

    __slots__ = ("value", "error")

    def __init__(self, value: Any = None, error: BaseException | None = None):
        self.value, self.error = value, error

    def result(self, timeout: float | None = None) -> Any:
        if self.error is not None:
            raise self.error
        return self.value

    def add_done_callback(self, fn) -> None:
        fn(self)


def call(handle: Any, method: Callable, *args) -> Any:
    """A call of `method` (a function of the hosted class, e.g. `Control.admit`) on `handle`,
    whatever hosts it: its reference. Every host names a piece's methods as its class does
    (hosting.py's handles, Ray's actor handles), so the typed function picks the handle's."""
    return getattr(handle, method.__name__).remote(*args)


def unwrapped(call: Callable[[], Any]) -> Any:
    """The value of a call to a piece; its PlexRL error raised as it is (not wrapped by the transport)."""
    try:
        return call()
    except errors.PlexRLError:
        raise
    except Exception as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            raise cause from None
        raise


def user_error(exc: BaseException) -> BaseException:
    """The PlexRL error inside a transport's error; an unreachable node reads as a retriable WorkerFailed."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return cause
    if is_gone(exc):
        return errors.WorkerFailed(f"the node runtime holding this model is unreachable: {exc}")
    return exc


def get(ref: Any, timeout: float | None = None) -> Any:
    """The value of a reference (or of each in a list), waiting for it."""
    if isinstance(ref, list):
        return [get(r, timeout) for r in ref]
    if isinstance(ref, (Future, Done)):
        return ref.result(timeout)
    import ray

    return ray.get(ref, timeout=timeout)


def as_future(ref: Any):
    """Something with `add_done_callback` whose argument has `.result()`: a Future or APIFuture
    as it is, a Ray reference's future."""
    return ref if hasattr(ref, "add_done_callback") else ref.future()


def is_gone(exc: BaseException) -> bool:
    """Whether `exc` says the piece called is gone (its process died, its actor is unreachable)."""
    if isinstance(exc, WorkerGone):
        return True
    ray = sys.modules.get("ray")  # a Ray error can only come from a Ray engine, which imported it
    return ray is not None and isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))


def kill(handle: Any) -> None:
    if callable(getattr(type(handle), "kill", None)):  # a host of engines/hosting.py
        handle.kill()
        return
    import ray

    ray.kill(handle)
