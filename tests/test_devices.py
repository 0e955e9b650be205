"""Which device a worker computes on, and the CPU side of the CUDA seam (runtime/cuda.py).

Invariants checked (CPU lane; tests/test_cuda.py has the CUDA ones):
- `--device auto|cpu|cuda` is on every command that opens clusters and maps to
  ClusterConfig.torch_device; "auto" is CUDA when present, "cuda" without a GPU is a ConfigError
  naming it, before anything starts;
- the process engine gives device d's process one GPU (CUDA_VISIBLE_DEVICES), round robin over
  the GPUs the driver sees; Ray workers resolve "auto" where they run;
- on CPU the seam is the plain behaviour: loads and write-backs are `copy_`, a fault injected
  halfway leaves exactly the first half of the first span written;
- a worker registers each host mapping once and unregisters it when it lets it go (a free, a
  new mapping of the same state): checked with a recording fake of the seam;
- the shared libraries this process maps are found by name (how a failed CUDA call's error is
  cleared).
"""

from __future__ import annotations

import argparse

import pytest
import torch

from plexrl import errors
from plexrl.runtime import cuda
from tests.helpers import datum, reserve_bytes

HAS_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("device, visible, count, expected", [
    (0, None, 1, "0"),
    (1, None, 2, "1"),
    (3, None, 2, "1"),  # more devices than GPUs: round robin
    (0, "2,3", None, "2"),  # the driver's own CUDA_VISIBLE_DEVICES is honoured
    (1, " 2, 3 ", None, "3"),
    (2, "GPU-aaaa,GPU-bbbb", None, "GPU-aaaa"),
])
def test_each_device_process_gets_one_gpu(device, visible, count, expected):
    from plexrl.engines.process import gpu_for

    assert gpu_for(device, visible if visible is not None else "", count) == expected


def test_auto_is_cuda_when_present_and_cuda_without_a_gpu_is_refused():
    assert cuda.resolve_device("auto") == ("cuda" if HAS_CUDA else "cpu")
    assert cuda.resolve_device("cpu") == "cpu"
    if not HAS_CUDA:
        with pytest.raises(errors.ConfigError, match="torch_device='cuda' but no CUDA device"):
            cuda.resolve_device("cuda")


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal on a machine without CUDA")
def test_a_cluster_on_cuda_without_a_gpu_is_refused_before_it_starts():
    from plexrl import engines

    with pytest.raises(errors.ConfigError, match="torch_device='cuda'"):
        engines.open_cluster("local", 1, torch_device="cuda")


def test_a_worker_resolves_auto_where_it_runs():
    """What a Ray worker actor gets ("auto" is kept by the Ray front: its driver may have no GPU)."""
    from plexrl.engines.ray_engine import RayCluster
    from plexrl.runtime.device_worker import DeviceWorker

    assert RayCluster._torch_device(None, "auto") == "auto"
    assert DeviceWorker(0, 1 << 16, torch_device="auto").arena.torch_device == ("cuda" if HAS_CUDA else "cpu")


@pytest.mark.parametrize("parser", ["demo", "serve", "add_engine_option"])
def test_the_device_option(parser):
    from plexrl import engines
    from plexrl.rl import demo
    from plexrl.serve.server import build_parser

    def parse(argv):
        if parser == "demo":
            return demo.parse_args(argv)
        if parser == "serve":
            return build_parser().parse_args(argv)
        p = argparse.ArgumentParser()
        engines.add_engine_option(p)
        return p.parse_args(argv)

    assert parse([]).device == "auto"
    assert parse(["--device", "cuda"]).device == "cuda"
    with pytest.raises(SystemExit):
        parse(["--device", "tpu"])
    assert parse([]).precision == "auto"  # ClusterConfig.precision, next to every --device
    assert parse(["--precision", "bf16"]).precision == "bf16"
    with pytest.raises(SystemExit):
        parse(["--precision", "fp16"])


def test_plexrl_run_passes_the_device_on(tmp_path, monkeypatch):
    from plexrl.rl import jobs_file

    seen = {}
    monkeypatch.setattr(jobs_file, "load", lambda path: "spec")
    monkeypatch.setattr(jobs_file, "run", lambda spec, on_step=None, engine="process", device="auto", precision="auto", **_:
                        seen.update(engine=engine, device=device, precision=precision) or {"jobs": []})
    assert jobs_file.main(["jobs.yaml", "--json", "--engine", "local", "--device", "cpu", "--precision", "bf16"]) == 0
    assert seen == {"engine": "local", "device": "cpu", "precision": "bf16"}


# ---------------------------------------------------------------------------- the seam on CPU

def test_cpu_copies_are_plain_copies():
    streams = cuda.Streams("cpu")
    host = torch.arange(40, dtype=torch.float32)
    region = torch.zeros(40)
    assert streams.load(region, host).seconds() >= 0
    assert torch.equal(region, host)
    region.mul_(2)
    streams.write_back(host, region, [slice(0, 10), slice(20, 40)], [slice(10, 20)])
    expected = torch.arange(40, dtype=torch.float32) * 2
    expected[10:20] = 0
    assert torch.equal(host, expected)


def test_a_write_back_interrupted_halfway_wrote_only_the_first_half_of_its_first_span():
    class Died(Exception):
        pass

    def die():
        raise Died

    host, device = torch.zeros(40), torch.ones(40)
    with pytest.raises(Died):
        cuda.Streams("cpu").write_back(host, device, [slice(10, 30)], [], halfway=die)
    assert host[10:20].eq(1).all() and host[:10].eq(0).all() and host[20:].eq(0).all()


class RecordingStreams(cuda.Streams):
    """The CPU seam, recording what a CUDA worker would page-lock and unlock."""

    def __init__(self):
        super().__init__("cpu")
        self.registered: dict[int, int] = {}  # data_ptr -> times registered
        self.log: list[tuple[str, int]] = []

    def register(self, host):
        assert self.registered.get(host.data_ptr(), 0) == 0, "registered twice"
        self.registered[host.data_ptr()] = 1
        self.log.append(("register", host.data_ptr()))

    def unregister(self, host):
        assert self.registered.pop(host.data_ptr(), 0) == 1, "unregistered a buffer that was not registered"
        self.log.append(("unregister", host.data_ptr()))


def test_a_worker_registers_each_mapping_once_and_unregisters_what_it_lets_go(tiny_model):
    from plexrl.engines.local import LocalCluster
    from plexrl.runtime.state import ModelState, load_module

    one = ModelState("x/p", "x", "p", load_module(tiny_model), True, tiny_model).device_bytes
    budget = one * 5 // 4 + reserve_bytes(tiny_model)  # room for one next to the activation reserve: they switch
    with LocalCluster(devices=1, device_memory_bytes=budget) as cluster:
        worker = cluster.workers[0].target
        worker.streams = recording = RecordingStreams()
        trainer = cluster.service_client("reg").create_training_client(tiny_model)
        other = cluster.service_client("reg2").create_training_client(tiny_model)
        for _ in range(2):  # each state loaded more than once: still one registration each
            for t in (trainer, other):
                t.forward_backward([datum([5, 6, 7, 8])]).result(60)
        assert cluster.metrics()["switches"] >= 4, "the states did not switch: the test tests nothing"
        mapped = {sid: m.data_ptr() for sid, (_, m) in worker._mapped.items()}
        assert set(recording.registered) == set(mapped.values()) and len(mapped) == 2
        cluster.finish_job("reg")
        assert set(recording.registered) == {mapped[other.state.state_id]}
        assert ("unregister", mapped[trainer.state.state_id]) in recording.log


def test_a_span_counts_work_done_in_another_process():
    """A vLLM engine's weight push runs in its own process: the switch-in's span adds its wall time."""
    span = cuda.Span().stop()
    own = span.seconds()
    assert span.add_elsewhere(0.25).seconds() == pytest.approx(own + 0.25)


def test_the_libraries_mapped_into_this_process_are_found_by_name():
    """What a failed CUDA runtime call's error is cleared through (`cuda._failed`: the cudart this
    process loaded): the C library and torch's own are mapped here on every Linux machine."""
    import os

    libc = cuda.loaded_libraries("libc.so")
    assert libc and all(os.path.basename(path).startswith("libc.so") for path in libc), libc
    assert any(os.path.basename(path).startswith("libtorch") for path in cuda.loaded_libraries("libtorch")), (
        "torch's libraries were not found among this process's mappings")
    assert cuda.loaded_libraries("libplexrl-no-such-library.so") == []


GiB = 1 << 30


@pytest.mark.parametrize("devices, budget, gpus, refused", [
    (1, 70 * GiB, [80 * GiB], None),
    (2, 40 * GiB, [80 * GiB], None),  # exactly the GPU
    (3, 30 * GiB, [80 * GiB], "GPU 0 hosts 3 of them, 96,636,764,160 bytes"),
    (3, 30 * GiB, [80 * GiB, 80 * GiB], None),  # round robin: two on GPU 0, one on GPU 1
    (5, 30 * GiB, [80 * GiB, 80 * GiB], "GPU 0 hosts 3 of them"),
    (4, 30 * GiB, [80 * GiB, 40 * GiB], "GPU 1 hosts 2 of them"),
])
def test_the_devices_sharing_a_gpu_fit_it(devices, budget, gpus, refused):
    if refused is None:
        cuda.check_gpus_hold(devices, budget, gpus)
        return
    with pytest.raises(errors.ConfigError, match=refused) as caught:
        cuda.check_gpus_hold(devices, budget, gpus)
    sharing = int(refused.split("hosts ")[1].split()[0])
    assert f"expected device_memory_bytes <= {gpus[int(refused.split()[1])] // sharing:,}" in str(caught.value)


def test_a_local_cluster_checks_its_devices_budgets_against_the_gpus(monkeypatch):
    """Before anything starts: four devices of 30 GiB on one 80 GiB GPU are refused."""
    from types import SimpleNamespace

    from plexrl.engines.local import LocalCluster
    from plexrl.runtime.config import ClusterConfig

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 * GiB))
    config = ClusterConfig(devices_per_node=4, device_memory_bytes=30 * GiB)
    with pytest.raises(errors.ConfigError, match="GPU 0 hosts 4 of them"):
        LocalCluster._check_gpus(None, config, "cuda")
    LocalCluster._check_gpus(None, ClusterConfig(devices_per_node=4, device_memory_bytes=20 * GiB), "cuda")


def test_a_host_buffer_the_shared_memory_cannot_hold_is_refused_not_a_sigbus(tmp_path, monkeypatch):
    """A file is made without its pages: on a /dev/shm too small the first write past its room
    kills the process with SIGBUS. The buffer is refused beforehand, saying what to change, counting
    the pages the node's other buffers have not taken yet."""
    import os
    from types import SimpleNamespace

    from plexrl.runtime import host_buffers

    buffers = host_buffers.SharedHostBuffers(tmp_path / "node0")
    monkeypatch.setattr(host_buffers.os, "statvfs", lambda path: SimpleNamespace(f_bavail=5, f_frsize=1 << 19))
    first = buffers.allocate(2 << 20)  # 2 MiB of 2.5 free, none of its pages taken yet
    with pytest.raises(errors.ConfigError, match=r"(?s)1,048,576 bytes does not fit .*2,621,440 bytes free, "
                                                 r"2,097,152 of them promised.*SIGBUS.*--shm-size"):
        buffers.allocate(1 << 20)
    assert sorted(os.listdir(tmp_path / "node0")) == ["host-0.f32", host_buffers.OWNER], "no file for the refused one"
    first.fill_(1.0)  # its pages taken: they are no longer counted as promised
    monkeypatch.setattr(host_buffers.os, "statvfs", lambda path: SimpleNamespace(f_bavail=1, f_frsize=1 << 20))
    buffers.allocate(1 << 20)
    buffers.release_all()
