"""Where the runtime's pieces run without Ray: OS processes, threads, or the caller's thread.

The pieces (`Node`, `DeviceWorker`, `Control`) are written once; a *handle* says how they are
reached. All handles look like Ray actor handles: `handle.method.remote(*args)` returns a
`concurrent.futures.Future` (runtime/remote.py waits for any reference).

- `ProcessActor`: the object lives in its own OS process, calls cross a socket pair — the
  process engine's device workers, so that each device computes in parallel with every other
  one and with the job controllers, free of the driver's interpreter lock;
- `ThreadActor`: the object lives in this process; each call runs on a thread of a pool (nodes
  and the control plane, whose calls may block while queued, like a threaded Ray actor);
- `InlineActor`: the object lives in this process; a call runs on the caller's thread (the
  local engine's device workers: the node's dispatcher thread is the device's thread).

Failure semantics of `ProcessActor` mirror a Ray actor with `max_restarts=-1`: when its process
dies, every call in flight fails with `WorkerGone` and a new process is started with the same
constructor arguments; calls made meanwhile run once it is up.
"""

from __future__ import annotations

import itertools
import os
import pickle
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle

from plexrl.runtime.remote import Done, WorkerGone
from plexrl.runtime.threads import ServicePool


class _Method:
    __slots__ = ("_call", "_name")

    def __init__(self, call, name: str):
        self._call, self._name = call, name

    def remote(self, *args) -> Future:
        return self._call(self._name, args)


class ThreadActor:
    """`obj` in this process; every call on a thread of a pool of `max_concurrency`."""

    def __init__(self, obj: Any, max_concurrency: int, name: str):
        self.target = obj  # in this process: callers may also use it directly
        self._pool = ServicePool(max_concurrency, name)  # its threads at the builder's priority, not a caller's

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self._submit, name)

    def _submit(self, name: str, args: tuple) -> Future:
        return self._pool.submit(getattr(self.target, name), *args)

    def kill(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class InlineActor:
    """`obj` in this process; a call runs at once on the caller's thread."""

    def __init__(self, obj: Any, name: str):
        self.target = obj
        self.name = name

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self._run, name)

    def _run(self, name: str, args: tuple) -> Done:
        try:
            return Done(getattr(self.target, name)(*args))
        except Exception as exc:  # the caller's error, as from any other host
            return Done(error=exc)

    def kill(self) -> None:
        pass


class ProcessActor:
    """`cls(*args)` in its own process; calls run there one at a time, in order. `env`: variables
    set in that process (and in every restart of it) before it imports anything."""

    def __init__(self, cls: type, args: tuple, name: str, env: dict[str, str] | None = None):
        self._cls, self._args, self.name, self._env = cls, args, name, dict(env or {})
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._ids = itertools.count()
        self._killed = False
        self.restarts = 0
        with self._lock:
            self._start()

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self._call, name)

    def _start(self) -> None:
        """A fresh process and its reader thread (under the lock). The child is a plain
        `python -m plexrl.engines.hosting FD`, not a multiprocessing child: it never re-imports
        the caller's main script; its stdout goes to stderr (a command's stdout stays its own)."""
        ours, theirs = socket.socketpair()
        process = subprocess.Popen([sys.executable, "-m", "plexrl.engines.hosting", str(theirs.fileno())],
                                   pass_fds=(theirs.fileno(),), stdout=2, env={**os.environ, **self._env})
        theirs.close()
        conn = Connection(ours.detach())
        conn.send_bytes(cloudpickle.dumps((self._cls, self._args)))
        self._conn, self._process = conn, process
        threading.Thread(target=self._read, args=(conn, process), name=f"{self.name}-reader", daemon=True).start()

    def _call(self, name: str, args: tuple) -> Future:
        future: Future = Future()
        call_id = next(self._ids)
        # The arguments travel as a blob of their own (by value: closures and custom losses too), so
        # that arguments the child cannot rebuild fail that call, never the child's loop.
        message = pickle.dumps((call_id, name, dumps(args)))
        with self._lock:
            if self._killed:
                future.set_exception(WorkerGone(f"{self.name} was shut down"))
                return future
            self._pending[call_id] = future
            try:
                self._conn.send_bytes(message)
            except (OSError, ValueError):
                pass  # the process is gone: the reader fails this call and restarts it
        return future

    def _read(self, conn, process) -> None:
        while True:
            try:
                call_id, ok, value = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError, TypeError):  # TypeError: `kill` closed the connection under the read
                break
            with self._lock:
                future = self._pending.pop(call_id)
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)
        process.wait()
        with self._lock:
            lost, self._pending = self._pending, {}
            if not self._killed:
                self.restarts += 1
                self._start()
        for future in lost.values():
            future.set_exception(WorkerGone(
                f"{self.name}'s process died (exit code {process.returncode}) with this call in flight"))

    def kill(self) -> None:
        with self._lock:
            self._killed = True
            self._conn.close()
        self._process.kill()
        self._process.wait()


def dumps(obj: Any) -> bytes:
    """`obj` pickled with cloudpickle's meaning: by the C pickler where that is the same (plain
    data and whatever lives in an importable module, which both pickle by reference; 32 us
    instead of 106 us for the arguments of a `plexrl demo` call), by cloudpickle where it is not:
    what the pickler refuses (closures, lambdas, local classes) and what a stream names from
    `__main__` (the child's `__main__` is this module) or from a module registered to travel by
    value. A name found in the stream's data rather than in a reference only costs the fast path."""
    try:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # what only cloudpickle pickles (or nothing does: then it says why)
        return cloudpickle.dumps(obj)
    by_value = ("__main__", *cloudpickle.list_registry_pickle_by_value())
    return cloudpickle.dumps(obj) if any(name.encode() in data for name in by_value) else data


def _serve(conn: Connection) -> None:
    """The child's loop: build the object, then answer calls until the pipe closes."""
    cls, args = pickle.loads(conn.recv_bytes())
    obj = cls(*args)
    while True:
        try:
            call_id, name, blob = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            call_args = pickle.loads(blob)
        except Exception as exc:
            conn.send_bytes(pickle.dumps((call_id, False, RuntimeError(
                f"the arguments of {name} could not be rebuilt in the worker process ({type(exc).__name__}: {exc}); "
                "a custom loss from a module that process cannot import must travel by value "
                "(cloudpickle.register_pickle_by_value(module))"))))
            continue
        try:
            reply = (call_id, True, getattr(obj, name)(*call_args))
        except Exception as exc:  # the caller's error: it travels back, the worker carries on
            reply = (call_id, False, exc)
        try:
            data = dumps(reply)
        except Exception as exc:
            data = pickle.dumps((call_id, False, RuntimeError(f"{name} returned something that cannot be "
                                                              f"sent back: {type(exc).__name__}: {exc}")))
        conn.send_bytes(data)


if __name__ == "__main__":  # a ProcessActor's child: python -m plexrl.engines.hosting FD
    _serve(Connection(int(sys.argv[1])))
