"""runtime.threads.ServicePool: an executor whose threads keep the builder's priority.

The runtime's pools are grown by whoever submits, and job controllers run niced; a thread a
controller's call starts must still run the service's work at the service's priority."""

from __future__ import annotations

import os
import threading
import time

import pytest

from plexrl.runtime.threads import ServicePool


def test_results_and_errors_come_back_through_futures():
    pool = ServicePool(2, "t")
    assert pool.submit(lambda a, b: a + b, 2, 3).result(timeout=10) == 5
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(timeout=10)
    pool.shutdown()


def test_it_grows_to_its_size_and_no_further():
    pool, release = ServicePool(3, "t"), threading.Event()
    running, lock = [], threading.Lock()

    def hold(i):
        with lock:
            running.append(i)
        release.wait(10)
        return i

    futures = [pool.submit(hold, i) for i in range(5)]
    deadline = time.monotonic() + 10
    while len(running) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert len(running) == 3  # three threads, each holding a call; two calls queued
    release.set()
    assert [f.result(timeout=10) for f in futures] == list(range(5))
    pool.shutdown()
    assert len([t for t in threading.enumerate() if t.name.startswith("t_")]) == 0


@pytest.mark.skipif(not hasattr(os, "nice"), reason="no per-thread nice on this OS")
def test_a_thread_started_for_a_niced_caller_keeps_the_builders_priority():
    """Linux: nice is per thread and a new thread inherits its starter's. A ThreadPoolExecutor's
    thread started by a niced caller's submit runs niced; a ServicePool's does not."""
    pool = ServicePool(1, "t")
    built_at = os.nice(0)
    seen = {}

    def niced_caller():
        os.nice(5)
        seen["caller"] = os.nice(0)
        seen["pool thread"] = pool.submit(os.nice, 0).result(timeout=10)

    caller = threading.Thread(target=niced_caller)
    caller.start()
    caller.join(10)
    pool.shutdown()
    assert seen == {"caller": built_at + 5, "pool thread": built_at}


def test_shutdown_waits_for_queued_work_or_cancels_it():
    pool, done = ServicePool(1, "t"), []
    futures = [pool.submit(lambda i=i: (time.sleep(0.02), done.append(i))) for i in range(3)]
    pool.shutdown(wait=True)
    assert done == [0, 1, 2] and all(f.done() for f in futures)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(print)

    pool, release = ServicePool(1, "t"), threading.Event()
    first = pool.submit(release.wait, 10)
    time.sleep(0.05)  # the one thread holds the first call
    queued = [pool.submit(lambda: None) for _ in range(3)]
    pool.shutdown(wait=False, cancel_futures=True)
    release.set()
    assert first.result(timeout=10) is True
    assert all(f.cancelled() for f in queued)


@pytest.mark.parametrize("workers", [0, -1])
def test_a_pool_needs_a_thread(workers):
    with pytest.raises(ValueError, match="workers"):
        ServicePool(workers, "t")
