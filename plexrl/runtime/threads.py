"""Thread pools of the runtime's own, whose threads keep the priority of whoever built them.

A `ThreadPoolExecutor` starts a thread on the `submit` that finds none idle, on the submitting
thread, and on Linux a new thread inherits that thread's scheduling priority (nice is per
thread). Job controllers run niced (`rl.train.controllers`: on a CPU machine the devices' cores
come first), so the runtime's pools that a controller's call happened to grow (a node's call
threads, a group scheduler's state copies, the front's bookkeeping) ran the service's work at
the controllers' lower priority: in one `plexrl demo` run, 10 of the process's 13 niced threads
were the runtime's. A `ServicePool` grows the same way (a thread per submit that finds none idle,
up to `workers`), but its threads are started by a spawner thread of its own, made when the pool
is built: they get the builder's priority (the cluster's constructor), whoever submits.
`usable_cpus`: the cores this process's threads may run on.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable


class ServicePool:
    """`submit(fn, *args) -> Future` on up to `workers` threads named `name_i`; `shutdown` as
    `ThreadPoolExecutor.shutdown`."""

    def __init__(self, workers: int, name: str):
        if workers < 1:
            raise ValueError(f"workers={workers!r}; expected at least 1")
        self._workers, self._name = workers, name
        self._work: queue.SimpleQueue = queue.SimpleQueue()  # (future, fn, args), or None: a thread's end
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for work
        self._wanted = 0  # threads asked of the spawner, not yet started
        self._closed = False
        self._grow = threading.Condition(self._lock)
        self._spawner = threading.Thread(target=self._spawn, name=f"{name}-spawner", daemon=True)
        self._spawner.start()

    def submit(self, fn: Callable, *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: cannot submit after shutdown")
            self._work.put((future, fn, args))
            if self._idle > 0:
                self._idle -= 1  # that thread takes this item (as ThreadPoolExecutor's idle count)
            elif len(self._threads) + self._wanted < self._workers:
                self._wanted += 1
                self._grow.notify()
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                if cancel_futures:
                    self._cancel_queued()
                self._grow.notify()
        for _ in range(self._workers):
            self._work.put(None)  # after the work queued: each thread ends once it is done
        if wait:
            self._spawner.join()  # every thread asked for has started
            with self._lock:
                threads = list(self._threads)
            for thread in threads:
                thread.join()

    def _cancel_queued(self) -> None:
        while True:
            try:
                item = self._work.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[0].cancel()

    def _spawn(self) -> None:
        while True:
            with self._lock:
                while not self._wanted and not self._closed:
                    self._grow.wait()
                if not self._wanted:  # closed, and every thread asked for started: work queued runs
                    return
                self._wanted -= 1
                thread = threading.Thread(target=self._serve, name=f"{self._name}_{len(self._threads)}", daemon=True)
                self._threads.append(thread)
            thread.start()  # on this thread: the new one inherits the builder's priority

    def _serve(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except BaseException as error:  # the caller's future carries it, as an executor's does
                    future.set_exception(error)
                else:
                    future.set_result(result)
            with self._lock:
                self._idle += 1


def usable_cpus() -> int:
    """The cores this process's threads may run on (its affinity; the machine's count where the
    platform has none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on every platform
        return os.cpu_count() or 1
