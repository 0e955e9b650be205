"""Futures returned by every call: `.result(timeout)`, `.done()`, and `await`-able."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class APIFuture(Generic[T]):
    def __init__(self, request_id: int | None = None):
        self.request_id = request_id
        self._future: concurrent.futures.Future = concurrent.futures.Future()

    def result(self, timeout: float | None = None) -> T:
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn) -> None:
        self._future.add_done_callback(lambda _: fn(self))

    def __await__(self):
        return asyncio.wrap_future(self._future).__await__()

    # Resolved by the runtime.
    def set_result(self, value: Any) -> None:
        if not self._future.done():
            self._future.set_result(value)

    def set_exception(self, exc: BaseException) -> None:
        if not self._future.done():
            self._future.set_exception(exc)

    @classmethod
    def failed(cls, exc: BaseException) -> "APIFuture":
        future = cls()
        future.set_exception(exc)
        return future

    @classmethod
    def completed(cls, value: Any) -> "APIFuture":
        future = cls()
        future.set_result(value)
        return future
