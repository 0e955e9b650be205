"""`plexrl bench switch`: switch bandwidth through the real runtime (front -> node -> device worker,
the arena and the node's shared host buffers), against `copy_` between preallocated buffers of
the same size measured in the same run (the physical reference).

Two frozen states of about SIZE bytes alternate on one device whose arena holds one of them, so
every call is a switch: the resident state goes back to its host copy (which write-through keeps
current: nothing to copy) and the other one is loaded (SIZE bytes in). The figure is the loaded
bytes over the load's own time, as the runtime records it. With a CUDA device the arena is
device memory; the reference is then the host-to-device copy.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from plexrl.bench.common import emit, median

import math

LAYER_BYTES_PER_WIDTH2 = 4 * (4 + 3 * 2.75)  # a float32 Llama layer of width h (MLP 2.75 h) is ~49 h^2 bytes


def model_shape(nbytes: int) -> tuple[int, int]:
    """(width, layers) of a Llama of about `nbytes` float32 weights: width 1024 and as many
    layers as it takes, or one narrower layer for small sizes."""
    layer_1024 = LAYER_BYTES_PER_WIDTH2 * 1024 ** 2
    if nbytes >= layer_1024:
        return 1024, round(nbytes / layer_1024)
    return max(64, int(math.sqrt(nbytes / LAYER_BYTES_PER_WIDTH2)) // 64 * 64), 1


def switch_gbps(nbytes: int, repeats: int, device: str) -> tuple[float, int]:
    """(GB/s of the loads, bytes per load) over `repeats` switches between two states (an arena
    holds one and a half of them)."""
    from plexrl.engines.local import LocalCluster
    from plexrl.models.tiny import make_tiny_model, parameter_count

    with tempfile.TemporaryDirectory() as folder:
        width, layers = model_shape(nbytes)
        model = make_tiny_model(f"{folder}/model", hidden_size=width, num_layers=layers, num_heads=width // 64,
                                intermediate_size=round(2.75 * width))
        state_bytes = 4 * parameter_count(model)
        with LocalCluster(devices=1, device_memory_bytes=state_bytes * 3 // 2, host_memory_bytes=4 * state_bytes,
                          torch_device=device, workdir=f"{folder}/cluster") as cluster:
            service = cluster.service_client("bench")
            states = [service.create_sampling_client(model, name=name).state for name in ("a", "b")]
            for i in range(repeats + 2):
                cluster.submit(states[i % 2], "noop", None).result()
            loads = [e for e in cluster.events() if e["event"] == "transition" and e["kind"] == "load"][2:]
    return median([e["bytes"] / e["seconds"] for e in loads]) / 1e9, loads[-1]["bytes"]


def memcpy_gbps(nbytes: int, repeats: int, device: str) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=device.startswith("cuda"))
    dst = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    src.fill_(1.0)
    dst.copy_(src)  # first touch
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return nbytes / median(times) / 1e9


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="plexrl bench switch", description=__doc__)
    parser.add_argument("--size-mb", type=int, default=256, help="bytes per state, in MiB")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    nbytes = args.size_mb << 20
    result = {}
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        switch, moved = switch_gbps(nbytes, args.repeats, device)
        reference = memcpy_gbps(moved, max(args.repeats, 8), device)  # the same bytes
        prefix = "" if device == "cpu" else "cuda_"
        result.update({
            f"{prefix}switch_gbps": switch,
            f"{prefix}memcpy_gbps": reference,
            f"{prefix}ratio": switch / reference,
            f"{prefix}bytes_per_switch": moved,
        })
    result["state_bytes"] = nbytes
    result["threads"] = torch.get_num_threads()
    emit("switch: a state's load through the runtime vs copy_ between preallocated buffers", result, args.json)
    return 0
