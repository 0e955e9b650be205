"""`plexrl bench switch`: offload+load bandwidth through the real StateManager, against `copy_`
between preallocated buffers of the same size measured in the same run (the physical reference).

Two dirty states of SIZE bytes alternate on one device whose arena holds one of them, so every
switch is an offload (SIZE bytes out) and a load (SIZE bytes in). With a CUDA device the arena
is device memory and host buffers are pinned; the reference is then the pinned host-to-device copy.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from plexrl.bench.common import emit, median
from plexrl.runtime.arena import DeviceArena
from plexrl.runtime.events import EventLog
from plexrl.runtime.state import ModelState
from plexrl.runtime.state_manager import StateManager
from plexrl.runtime.telemetry import Telemetry


def synthetic_state(state_id: str, nbytes: int) -> ModelState:
    """A weights-only state of about `nbytes` (a stack of square linear layers)."""
    width = 1024
    layers = max(1, nbytes // (width * width * 4))
    module = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    return ModelState(state_id, "bench", state_id, module, trainable=False, source="synthetic")


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


def switch_gbps(nbytes: int, repeats: int, device: str) -> tuple[float, int]:
    telemetry = Telemetry(EventLog())
    with tempfile.TemporaryDirectory() as spill:
        a, b = synthetic_state("a", nbytes), synthetic_state("b", nbytes)
        arena = DeviceArena(0, a.device_bytes, device)
        sm = StateManager(0, {0: arena}, 4 * a.host_bytes, spill, telemetry, pin_memory=device.startswith("cuda"))
        sm.add(a)
        sm.add(b)
        arena.buffer.fill_(0.0)  # first touch, as a long-running worker's arena would be
        times, moved = [], 0
        for i in range(repeats + 1):
            target = (a, b)[i % 2]
            with sm.lock:
                plan = sm.prepare(target.state_id, 0, "bench")
            _sync(device)
            t0 = time.perf_counter()
            sm.apply(plan, "bench")
            _sync(device)
            elapsed = time.perf_counter() - t0
            sm.release(plan, float(i))
            target.dirty = True  # as after a training step: the next switch must copy it back
            if i == 0:
                continue  # the first load has nothing to offload
            times.append(elapsed)
            moved = sum(t.bytes for t in plan.transitions)
        return moved / median(times) / 1e9, moved


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
        reference = memcpy_gbps(nbytes, args.repeats, device)
        prefix = "" if device == "cpu" else "cuda_"
        result.update({
            f"{prefix}switch_gbps": switch,
            f"{prefix}memcpy_gbps": reference,
            f"{prefix}ratio": switch / reference,
            f"{prefix}bytes_per_switch": moved,
        })
    result["state_bytes"] = nbytes
    result["threads"] = torch.get_num_threads()
    emit("switch: offload+load vs copy_ between preallocated buffers", result, args.json)
    return 0
