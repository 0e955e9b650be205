"""The runtime on CUDA devices (runtime/cuda.py, device_worker.py, arena.py). Every test needs a
CUDA device and skips, saying so, without one; `make gpu-check` runs them (scripts/gpu_check.sh).

Invariants checked:
- transparency: a job multiplexed with another on one GPU ends bitwise equal to the same job
  alone (the same kernels on the same inputs: a switch moves bytes, it computes nothing), on the
  local and the process engine (a process per device, seeing only its own GPU);
- a host buffer is page-locked where it is while its worker maps it (cudaHostRegister, exact
  size: PyTorch's caching host allocator holds nothing for it) and unlocked when the worker lets
  it go (spill, free): the host budget stays the files' bytes;
- device time comes from CUDA events: every function and load is charged a time > 0;
- a state larger than the device budget is refused with StateTooLarge, and a budget larger than
  the GPU with a ConfigError naming device_memory_bytes: never a CUDA out-of-memory crash;
- precision "auto" is bf16 on CUDA: 2 B/param snapshots that sample what their bf16 weights give
  run directly, trainers in mixed precision, TF32 allowed for float32 matmuls; under "fp32" the
  float32 matmuls stay IEEE float32 (TF32 off for matmuls and cuDNN);
- logical devices sharing a GPU compute on CUDA streams of their own, none the default stream.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import plexrl
from plexrl import errors
from tests.helpers import datum, rl_job

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)")]

MiB = 1 << 20
TIMEOUT_S = 300
PINNED_BYTES_KEY = "allocated_bytes.current"  # torch.cuda.host_memory_stats(): the caching host allocator's bytes


def pinned_host_bytes() -> int:
    """What PyTorch's caching host allocator holds (a missing key fails: never a silent 0)."""
    stats = torch.cuda.host_memory_stats()
    return stats[PINNED_BYTES_KEY] if stats else 0  # {}: CUDA not initialised yet in this process


def trainer_bytes(model: str) -> int:
    from plexrl.runtime.state import ModelState, load_module

    return ModelState("x/p", "x", "p", load_module(model), True, model).device_bytes


@pytest.fixture(scope="module")
def alone(tiny_model):
    """Job `a` alone on one GPU: its final weights."""
    from plexrl.engines.local import LocalCluster

    with LocalCluster(devices=1, torch_device="cuda") as cluster:
        return final_weights(cluster, rl_job(cluster, "a", tiny_model, seed=0))


def final_weights(cluster, client) -> np.ndarray:
    return cluster.fetch_weights(client.state)


@pytest.mark.parametrize("engine", ["local", "process"])
def test_a_multiplexed_job_equals_the_job_alone_on_cuda(engine, tiny_model, alone):
    from concurrent.futures import ThreadPoolExecutor

    from plexrl import engines

    # room for one trainer and one snapshot: the two jobs keep switching each other out. The budget
    # is the states' alone (no activation reserve set aside; the activations live beside the arena)
    budget = trainer_bytes(tiny_model) * 5 // 4 + 4096
    with engines.open_cluster(engine, 1, device_memory_bytes=budget, torch_device="cuda",
                              activation_reserve_bytes=0) as cluster:
        with ThreadPoolExecutor(2) as pool:
            a, b = pool.submit(rl_job, cluster, "a", tiny_model, 0), pool.submit(rl_job, cluster, "b", tiny_model, 1)
            mine, _ = a.result(TIMEOUT_S), b.result(TIMEOUT_S)
        assert cluster.metrics()["switches"] > 2, "the jobs never switched: the test tests nothing"
        np.testing.assert_array_equal(final_weights(cluster, mine), alone,
                                      err_msg=f"job a multiplexed on CUDA ({engine} engine) differs from a alone")


def test_host_buffers_are_page_locked_at_their_size_and_unlocked_when_let_go(tiny_model):
    from plexrl.engines.local import LocalCluster

    held = pinned_host_bytes()
    with LocalCluster(devices=1, torch_device="cuda") as cluster:
        trainer = cluster.service_client("pin").create_training_client(tiny_model)
        trainer.forward_backward([datum([5, 6, 7, 8])]).result(TIMEOUT_S)
        worker = cluster.workers[0].target
        path, mapping = worker._mapped[trainer.state.state_id]
        assert mapping.is_pinned(), "the worker's mapping of the host buffer is not page-locked"
        assert mapping.numel() * 4 == trainer.state.host_bytes
        assert pinned_host_bytes() == held, (
            "PyTorch's caching host allocator holds memory for the host buffers: the host budget would lie")
        cluster.finish_job("pin")
        assert trainer.state.state_id not in worker._mapped
        assert not mapping.is_pinned(), "the host buffer stayed page-locked after its state was freed"


def test_register_and_unregister_a_shared_buffer(tmp_path):
    from plexrl.runtime import cuda
    from plexrl.runtime.host_buffers import SharedHostBuffers, node_folder

    # where the runtime keeps them (under /dev/shm): a file on disk, as under tmp_path, may not be
    # page-locked
    buffers = SharedHostBuffers(node_folder(f"plexrl-test-register-{tmp_path.name}", 0))
    host = buffers.allocate(3 * MiB + 4)  # not a power of two: registered at exactly this size
    cuda.register(host)
    try:
        assert host.is_pinned()
        device = torch.arange(host.numel(), dtype=torch.float32, device="cuda")
        host.copy_(device, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(host, device.cpu())
    finally:
        cuda.unregister(host)
    assert not host.is_pinned()
    buffers.release_all()


def test_device_time_comes_from_cuda_events(tiny_model):
    from plexrl.engines.local import LocalCluster

    with LocalCluster(devices=1, torch_device="cuda") as cluster:
        trainer = cluster.service_client("time").create_training_client(tiny_model)
        trainer.forward_backward([datum([5, 6, 7, 8])]).result(TIMEOUT_S)
        trainer.optim_step(plexrl.AdamParams(learning_rate=1e-3)).result(TIMEOUT_S)
        events = cluster.events("time")
        metrics = cluster.metrics()
    ends = [e for e in events if e["event"] == "end" and e["fn"] in ("forward_backward", "optim_step")]
    assert len(ends) == 2 and all(e["device_s"] > 0 for e in ends), ends
    loads = [e for e in events if e["event"] == "transition" and e["kind"] == "load"]
    assert loads and all(e["seconds"] > 0 for e in loads), loads
    assert metrics["jobs"]["time"]["exec_s"] > 0 and metrics["writeback_s"] > 0


def test_a_state_larger_than_the_device_budget_is_refused(tiny_model):
    from plexrl.engines.local import LocalCluster

    with LocalCluster(devices=1, torch_device="cuda", device_memory_bytes=trainer_bytes(tiny_model) // 2) as cluster:
        with pytest.raises(errors.StateTooLarge, match="device_memory_bytes >="):
            cluster.service_client("big").create_training_client(tiny_model)


def test_a_budget_larger_than_the_gpu_is_a_config_error_not_an_oom_crash(tiny_model):
    from plexrl.engines.local import LocalCluster

    _, total = torch.cuda.mem_get_info()
    with LocalCluster(devices=1, torch_device="cuda", device_memory_bytes=2 * total,
                      host_memory_bytes=256 * MiB) as cluster:
        trainer = cluster.service_client("huge").create_training_client(tiny_model)
        for _ in range(2):  # the worker carries on: the same clear error each time
            with pytest.raises(errors.ConfigError, match="device_memory_bytes=.* does not fit"):
                trainer.forward_backward([datum([5, 6, 7, 8])]).result(TIMEOUT_S)


def test_bf16_is_the_auto_precision_on_cuda_and_a_bf16_snapshot_samples_its_weights(tiny_model):
    """precision="auto" on CUDA: snapshots of 2 B/param sampling what the bf16 weights give run
    directly on the same GPU (tokens identical; log-probs equal to float noise of one kernel choice),
    the trainer in mixed precision (float32 master weights and moments, 16 B/param)."""
    from plexrl.backends import execution
    from plexrl.engines.local import LocalCluster
    from plexrl.models.tiny import parameter_count
    from plexrl.runtime.state import load_module

    n = parameter_count(tiny_model)
    params = plexrl.SamplingParams(max_tokens=6, seed=3)
    with LocalCluster(devices=1, torch_device="cuda") as cluster:
        trainer = cluster.service_client("bf16").create_training_client(tiny_model)
        trainer.forward_backward([datum([5, 6, 7, 8])]).result(TIMEOUT_S)
        trainer.optim_step(plexrl.AdamParams(learning_rate=1e-2)).result(TIMEOUT_S)
        snapshot = trainer.save_weights_and_get_sampling_client()
        assert snapshot.state.device_bytes == -(-2 * n // 4) * 4 and trainer.state.device_bytes == 16 * n
        out = snapshot.sample(plexrl.ModelInput.from_ints([5, 6, 7]), num_samples=2, sampling_params=params).result(
            TIMEOUT_S)
        synced = torch.from_numpy(cluster.fetch_weights(snapshot.state))
    assert torch.equal(synced, synced.bfloat16().float()), "the snapshot does not hold bfloat16 weights"
    module = load_module(tiny_model).to("cuda")
    offset = 0
    for p in module.parameters():
        p.data = synced[offset:offset + p.numel()].view(p.shape).to("cuda", torch.bfloat16)
        offset += p.numel()
    direct = execution.sample(module, [5, 6, 7], 2, params, seed=params.seed)
    assert [s.tokens for s in out.sequences] == [s.tokens for s in direct.sequences]
    np.testing.assert_allclose([s.logprobs for s in out.sequences], [s.logprobs for s in direct.sequences], atol=1e-5)
    assert torch.backends.cuda.matmul.allow_tf32, "a CUDA worker did not allow TF32 for float32 matmuls"


def test_an_fp32_cluster_on_cuda_keeps_float32_matmuls_ieee(tiny_model):
    from plexrl.engines.local import LocalCluster

    with LocalCluster(devices=1, torch_device="cuda", precision="fp32") as cluster:
        trainer = cluster.service_client("fp32").create_training_client(tiny_model)
        trainer.forward_backward([datum([5, 6, 7, 8])]).result(TIMEOUT_S)
        assert not torch.backends.cuda.matmul.allow_tf32, "precision='fp32' ran float32 matmuls at TF32"
        assert not torch.backends.cudnn.allow_tf32, "precision='fp32' left cuDNN's TF32 on"


def test_clusters_one_after_another_in_one_process_page_lock_their_buffers(tiny_model):
    """A closed cluster's workers unregister their host mappings: one that did not left the driver
    holding the addresses, and the next cluster's mapping there failed with CUDA error 712
    ("already mapped"; an H100, 2026-12-06). The local engine's workers live in this process."""
    from plexrl.engines.local import LocalCluster

    for round_ in range(3):
        with LocalCluster(devices=1, torch_device="cuda", precision="fp32") as cluster:
            trainer = cluster.service_client(f"j{round_}").create_training_client(tiny_model)
            trainer.forward_backward([datum([5, 6, 7, 8])]).result(TIMEOUT_S)
            worker = cluster.workers[0].target
            assert worker._mapped, "the trainer's host buffer is mapped (and page-locked) while it is resident"
        assert not worker._mapped and worker.arena._buffer is None, "closing let every mapping and the arena go"


def test_logical_devices_on_one_gpu_compute_on_streams_of_their_own(tiny_model):
    """On the default stream, one device's CUDA-event times would include the kernels the other
    devices on its GPU queued in between."""
    from plexrl.engines.local import LocalCluster

    with LocalCluster(devices=2, torch_device="cuda") as cluster:
        trainer = cluster.service_client("streams").create_training_client(tiny_model)
        trainer.forward_backward([datum([5, 6, 7, 8])]).result(TIMEOUT_S)  # a call ran inside one of them
        workers = [cluster.workers[d].target for d in (0, 1)]
        streams = []
        for worker in workers:
            with worker.streams.computing():
                streams.append(torch.cuda.current_stream(worker.torch_device))
    defaults = {torch.cuda.default_stream(worker.torch_device) for worker in workers}
    assert streams[0] != streams[1] and not defaults & set(streams), streams
