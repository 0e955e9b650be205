"""engines/hosting.py: an object in its own process, called like a Ray actor.

Checked: calls run in order and return their values; the object's exceptions come back and it
carries on; a process that dies fails the call in flight with WorkerGone and is restarted with
the same constructor arguments; a process engine that exits without close() leaves nothing in
/dev/shm (host buffers are RAM).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest

from plexrl.engines import hosting
from plexrl.runtime import remote

TIMEOUT_S = 60
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the child cannot import a test module


class Counter:
    def __init__(self, start: int):
        self.value = start

    def add(self, n: int) -> int:
        self.value += n
        return self.value

    def fail(self) -> None:
        raise ArithmeticError("deliberately")

    def die(self) -> None:
        os._exit(3)


@pytest.fixture
def counter():
    actor = hosting.ProcessActor(Counter, (10,), "test-counter")
    yield actor
    actor.kill()


def test_calls_run_in_order_and_errors_come_back(counter):
    futures = [counter.add.remote(n) for n in range(1, 6)]
    assert [f.result(TIMEOUT_S) for f in futures] == [11, 13, 16, 20, 25]
    with pytest.raises(ArithmeticError, match="deliberately"):
        counter.fail.remote().result(TIMEOUT_S)
    assert remote.get(counter.add.remote(1), TIMEOUT_S) == 26


def test_a_dead_process_fails_its_call_and_is_restarted(counter):
    counter.add.remote(5).result(TIMEOUT_S)
    with pytest.raises(remote.WorkerGone, match="exit code 3"):
        counter.die.remote().result(TIMEOUT_S)
    assert counter.add.remote(1).result(TIMEOUT_S) == 11, "restarted with the same constructor arguments"
    assert counter.restarts == 1


def test_a_killed_actor_refuses_calls(counter):
    counter.kill()
    with pytest.raises(remote.WorkerGone, match="shut down"):
        counter.add.remote(1).result(TIMEOUT_S)


def test_no_shared_memory_is_left_by_a_process_that_does_not_close(tmp_path, micro_model):
    script = (
        "from plexrl.engines.process import ProcessCluster\n"
        "c = ProcessCluster(devices=1, device_memory_bytes=16 << 20, host_memory_bytes=64 << 20)\n"
        f"c.service_client('j').create_training_client(base_model={micro_model!r})\n"
        "print(c.name)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    name = done.stdout.split()[-1]
    assert not list(Path("/dev/shm").glob(f"{name}-*")), "host buffers left in /dev/shm"


class _Unbuildable:
    """Pickles fine here, cannot be rebuilt in the child (as a custom loss from a module it cannot import)."""

    def __reduce__(self):
        return (_missing_module_thing, ())


def _missing_module_thing():
    raise ModuleNotFoundError("No module named 'the_users_training_script'")


def test_arguments_the_child_cannot_rebuild_fail_that_call_only(counter):
    with pytest.raises(RuntimeError, match="could not be rebuilt in the worker process"):
        counter.add.remote(_Unbuildable()).result(TIMEOUT_S)
    assert counter.add.remote(1).result(TIMEOUT_S) == 11 and counter.restarts == 0, "the child lived on"
