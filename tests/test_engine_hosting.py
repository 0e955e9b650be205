"""engines/hosting.py: an object in its own process, called like a Ray actor.

Checked: calls run in order and return their values; the object's exceptions come back and it
carries on; a process that dies fails the call in flight with WorkerGone and is restarted with
the same constructor arguments; a process engine that exits without close() leaves nothing in
/dev/shm (host buffers are RAM); arguments and replies travel as cloudpickle would send them
(by value where the child could not rebuild them by reference), by the C pickler where that is the same.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import types
from pathlib import Path

import cloudpickle
import pytest

from plexrl.engines import hosting
from plexrl.runtime import remote

TIMEOUT_S = 180  # a bound on a hang: a child's first call waits for its imports, slow on a loaded machine
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


# -- how arguments and replies travel (`hosting.dumps`) ----------------------------------------------
def test_plain_data_travels_as_the_c_pickler_writes_it():
    from plexrl.policy import TransitionKind
    from plexrl.runtime.device_worker import WorkerStep

    message = ([WorkerStep(TransitionKind.OFFLOAD, "job/model", dirty=True)], "sample",
               {"tokens": [1, 2, 3], "seed": 7, "temperature": 0.7}, "job/model@sampler.v1", [])
    assert hosting.dumps(message) == pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    assert pickle.loads(hosting.dumps(message)) == message


def test_what_the_pickler_refuses_travels_by_value():
    scale = 3
    closure = lambda x: scale * x  # noqa: E731  (the pickler refuses lambdas and closures)
    with pytest.raises((pickle.PicklingError, AttributeError)):
        pickle.dumps(closure)
    assert pickle.loads(hosting.dumps(closure))(5) == 15


def test_a_module_registered_by_value_travels_by_value(monkeypatch):
    module = types.ModuleType("plexrl_test_by_value")
    exec("def double(x):\n    return 2 * x\n", module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    cloudpickle.register_pickle_by_value(module)
    try:
        data = hosting.dumps({"loss": module.double})
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    monkeypatch.delitem(sys.modules, module.__name__)  # where it is rebuilt, nobody can import it
    assert pickle.loads(data)["loss"](21) == 42


def test_what_main_defines_reaches_the_child_by_value(tmp_path):
    """A custom loss in the user's script: the pickler would name `__main__.triple`, which the
    child (whose `__main__` is hosting.py) does not have."""
    script = (
        "from plexrl.engines import hosting\n"
        "class Box:\n"
        "    def apply(self, fn, x):\n"
        "        return fn(x)\n"
        "def triple(x):\n"
        "    return 3 * x\n"
        "actor = hosting.ProcessActor(Box, (), 'box')\n"
        "print(actor.apply.remote(triple, 5).result(60))\n"
        "actor.kill()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "15"
