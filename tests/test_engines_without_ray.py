"""docs/design.md §8: Ray where Ray hosts. The local and process engines run a job end to end from a
driver where Ray cannot be imported (the process engine's device workers are plain Python
children running runtime/device_worker.py), and every engine's settings are one frozen config."""

from __future__ import annotations

import os
import time

import pytest

from plexrl import errors
from plexrl.engines.process import ProcessCluster
from plexrl.runtime.config import ClusterConfig
from tests.helpers import run_with_blocked_imports


@pytest.mark.parametrize("engine", ["local", "process"])
def test_an_engine_runs_a_job_with_ray_unimportable(engine, micro_model):
    body = f"""
import plexrl
from plexrl import engines
datum = plexrl.Datum(plexrl.ModelInput.from_ints([5, 6, 7]), {{"target_tokens": [6, 7, 8]}})
with engines.open_cluster({engine!r}, 1, device_memory_bytes=16 << 20, host_memory_bytes=64 << 20) as c:
    trainer = c.service_client("job").create_training_client(base_model={micro_model!r})
    trainer.forward_backward([datum]).result(120)
    assert trainer.optim_step(plexrl.AdamParams()).result(120).metrics["step"] == 1.0
    sampler = trainer.save_weights_and_get_sampling_client()
    assert sampler.sample(plexrl.ModelInput.from_ints([5]), 1, plexrl.SamplingParams(max_tokens=2, seed=0)).result(120)
    assert c.metrics()["engine"] == {engine!r}
print("ok")
"""
    result = run_with_blocked_imports(("ray",), body)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


@pytest.mark.parametrize("settings, message", [
    ({"device_memory_bytes": 0}, "device_memory_bytes=0; expected a positive integer"),
    ({"host_memory_bytes": 1.5}, "host_memory_bytes=1.5; expected a positive integer"),
    ({"policy": "lifo"}, "policy='lifo': unknown scheduling policy 'lifo'"),
    ({"placement": "random"}, "placement='random'; expected one of"),
    ({"slot_s": -1}, "slot_s=-1; expected a positive number"),
    ({"torch_device": "tpu"}, "torch_device='tpu'; expected one of"),
    ({"checkpoint_every_steps": -2}, "checkpoint_every_steps=-2; expected 0"),
    ({"threads_per_device": True}, "threads_per_device=True; expected a positive integer"),
    ({"workdir": ""}, "workdir=''; expected a path"),
    ({"pack_limit": -0.1}, r"pack_limit=-0.1; expected None \(each job's own slack\) or a fraction"),
    ({"events_kept": 0}, r"events_kept=0; expected None \(every record\) or a positive integer"),
    ({"device_memory": 5}, r"unknown cluster setting\(s\) \['device_memory'\]"),
])
def test_one_config_names_the_bad_setting(settings, message):
    with pytest.raises(errors.ConfigError, match=message):
        ClusterConfig.of(2, **settings)


def test_devices_split_over_nodes():
    assert ClusterConfig.of(4, nodes=2).devices_per_node == 2
    assert ClusterConfig.of(None, nodes=3, devices_per_node=2).devices == 6
    with pytest.raises(errors.ConfigError, match="devices=3 must be a multiple of nodes=2"):
        ClusterConfig.of(3, nodes=2)
    with pytest.raises(errors.ConfigError, match="give devices or devices_per_node"):
        ClusterConfig.of(3, nodes=1, devices_per_node=2)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this OS")
def test_process_devices_are_pinned_from_first_device_on(micro_model):
    """Two one-device clusters side by side (`plexrl demo`'s exclusive schedule) compute on
    different cores: device d of a cluster given `first_device=k` takes the machine's (k + d)-th."""
    cores = sorted(os.sched_getaffinity(0))
    for first in (0, 1):
        with ProcessCluster(devices=1, first_device=first, device_memory_bytes=16 << 20,
                            host_memory_bytes=64 << 20) as cluster:
            pid, deadline = cluster.workers[0]._process.pid, time.monotonic() + 30
            while os.sched_getaffinity(pid) != {cores[first % len(cores)]} and time.monotonic() < deadline:
                time.sleep(0.05)  # the child pins itself as it starts
            assert os.sched_getaffinity(pid) == {cores[first % len(cores)]}


@pytest.mark.parametrize("first_device", [-1, 1.5, True, "1"])
def test_a_bad_first_device_is_named(first_device):
    with pytest.raises(errors.ConfigError, match="first_device"):
        ProcessCluster(devices=1, first_device=first_device)
