"""`plexrl bench switch`: switch bandwidth through the real runtime (front -> node -> device worker,
the arena and the node's shared host buffers), against `copy_` between preallocated buffers of
the same size measured in the same run (the physical reference).

Two frozen states of about SIZE bytes alternate on one device whose arena holds one of them, so
every call is a switch: the resident state goes back to its host copy (which write-through keeps
current: nothing to copy) and the other one is loaded (SIZE bytes in). Two figures, each against
the reference copy of the same bytes timed with the same clock in the same run:
- `ratio`: the load's own time as the runtime records it (CUDA events on CUDA) against the copy
  timed by events (`copy_event_s`): the copy engine's part of a switch, close to 1 by design;
- `wall_ratio`: the wall time of a whole switching call as the job sees it (a no-op call on the
  other state, submitted and waited for: planning, mapping, registering, binding and the load)
  against the copy timed by the host clock (`copy_wall_s`), with `noop_wall_s`, the same call
  without a switch, for what a call costs anyway. This is the figure a slow switch shows in.
On CPU a device is a logical one copying with its own threads (threads_per_device, 1 by default),
the reference copy runs with as many (`memcpy_gbps_all_threads`: every core, for scale) and both
clocks are the host's. With a CUDA device the arena is device memory and the reference is the
host-to-device copy from a host buffer page-locked at its size (cudaHostRegister, as the
runtime's own are).

Then the write-back of an RL-like loop (weight sync, sample, log-probs, forward_backward,
optim_step) on a trainer of about SIZE bytes (weights, gradients, both moments): the bytes and
seconds its write-throughs take per step, against writing the whole state back after each of the
step's two mutating calls (what write-through did before it copied only what changed: a `copy_`
of those bytes between the same kind of buffers, measured in the same run).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from plexrl.bench.common import emit, median
from plexrl.runtime.config import ClusterConfig

DEVICE_THREADS = ClusterConfig().threads_per_device  # a CPU device's copy threads: its reference copy's too

import math

LAYER_BYTES_PER_WIDTH2 = 4 * (4 + 3 * 2.75)  # a float32 Llama layer of width h (MLP 2.75 h) is ~49 h^2 bytes


def model_shape(nbytes: int) -> tuple[int, int]:
    """(width, layers) of a Llama of about `nbytes` float32 weights: width 1024 and as many
    layers as it takes, or one narrower layer for small sizes."""
    layer_1024 = LAYER_BYTES_PER_WIDTH2 * 1024 ** 2
    if nbytes >= layer_1024:
        return 1024, round(nbytes / layer_1024)
    return max(64, int(math.sqrt(nbytes / LAYER_BYTES_PER_WIDTH2)) // 64 * 64), 1


def switch_times(nbytes: int, repeats: int, device: str, precision: str = "auto") -> dict:
    """Median seconds of `repeats` switches between two states of about `nbytes` each, in their
    `precision`'s dtype (an arena holds one and a half of them): `load_s` (the runtime's clock),
    `switch_wall_s` (a switching call, host clock), `noop_wall_s` (a call on the resident state),
    and `bytes_per_switch`."""
    from plexrl.engines.local import LocalCluster
    from plexrl.models.tiny import make_tiny_model, parameter_count
    from plexrl.runtime import precision as precisions
    from plexrl.runtime.activation import reserve_of

    per_weight = precisions.state_dtypes(precisions.resolve(precision, device), False, None)[0].itemsize
    with tempfile.TemporaryDirectory() as folder:
        width, layers = model_shape(nbytes * 4 // per_weight)  # the float32 size of as many weights
        model = make_tiny_model(f"{folder}/model", hidden_size=width, num_layers=layers, num_heads=width // 64,
                                intermediate_size=round(2.75 * width))
        state_bytes = per_weight * parameter_count(model)
        budget = state_bytes * 3 // 2 + reserve_of(str(model), torch_device=device, precision=precision)
        with LocalCluster(devices=1, device_memory_bytes=budget, host_memory_bytes=4 * state_bytes,
                          torch_device=device, precision=precision, workdir=f"{folder}/cluster") as cluster:
            service = cluster.service_client("bench")
            states = [service.create_sampling_client(model, name=name).state for name in ("a", "b")]
            switching, resident = [], []
            for i in range(repeats + 2):  # the first two map their fresh files: left out
                switching.append(_call_wall_s(cluster, states[i % 2]))
                resident.append(_call_wall_s(cluster, states[i % 2]))
            loads = [e for e in cluster.events() if e["event"] == "transition" and e["kind"] == "load"][2:]
    if not loads:
        raise RuntimeError(f"no load in {repeats} switching calls; expected the arena to hold one of the two states")
    return {"load_s": median([e["seconds"] for e in loads]), "switch_wall_s": median(switching[2:]),
            "noop_wall_s": median(resident[2:]), "bytes_per_switch": loads[-1]["bytes"]}


def _call_wall_s(cluster, state) -> float:
    t0 = time.perf_counter()
    cluster.submit(state, "noop", None).result()
    return time.perf_counter() - t0


def writeback_per_step(nbytes: int, steps: int, device: str, precision: str = "auto") -> dict:
    """The write-back figures of `steps` RL-like steps on a trainer of about `nbytes` (16 B/param)."""
    import plexrl
    from plexrl.engines.local import LocalCluster
    from plexrl.models.tiny import make_tiny_model, parameter_count
    from plexrl.runtime.activation import reserve_of

    with tempfile.TemporaryDirectory() as folder:
        width, layers = model_shape(nbytes // 4)
        model = make_tiny_model(f"{folder}/model", hidden_size=width, num_layers=layers, num_heads=width // 64,
                                intermediate_size=round(2.75 * width))
        state_bytes = 16 * parameter_count(model)
        budget = state_bytes * 3 // 2 + reserve_of(str(model), torch_device=device, precision=precision)
        with LocalCluster(devices=1, device_memory_bytes=budget, host_memory_bytes=3 * state_bytes,
                          torch_device=device, precision=precision, workdir=f"{folder}/cluster") as cluster:
            trainer = cluster.service_client("bench").create_training_client(model)
            prompt = plexrl.ModelInput.from_ints([5, 6, 7])
            for step in range(steps):
                sampler = trainer.save_weights_and_get_sampling_client()
                out = sampler.sample(prompt, sampling_params=plexrl.SamplingParams(max_tokens=4, seed=step)).result()
                ids = prompt.to_ints() + out.sequences[0].tokens
                old = sampler.compute_logprobs(plexrl.ModelInput.from_ints(ids)).result()
                datum = plexrl.Datum(plexrl.ModelInput.from_ints(ids[:-1]), {
                    "target_tokens": ids[1:], "logprobs": [lp or 0.0 for lp in old[1:]],
                    "advantages": [1.0] * (len(ids) - 1)})
                trainer.forward_backward([datum], loss_fn="importance_sampling").result()
                trainer.optim_step(plexrl.AdamParams(learning_rate=1e-4)).result()
            metrics = cluster.metrics()
    whole = 2 * state_bytes  # two mutating calls a step
    return {"writeback_bytes_per_step": metrics["writeback_bytes"] / steps,
            "writeback_zeroed_bytes_per_step": metrics["writeback_zeroed_bytes"] / steps,
            "writeback_s_per_step": metrics["writeback_s"] / steps,
            "whole_state_writeback_bytes_per_step": whole,
            "whole_state_writeback_s_per_step": whole / (memcpy_gbps(state_bytes, 8, device, to_host=True,
                                                                     threads=DEVICE_THREADS) * 1e9),
            "trainer_state_bytes": state_bytes}


def memcpy_gbps(nbytes: int, repeats: int, device: str, to_host: bool = False, threads: int | None = None) -> float:
    """GB/s of copy_ between preallocated buffers of `nbytes` (host clock)."""
    return nbytes / copy_times(nbytes, repeats, device, to_host, threads)["copy_wall_s"] / 1e9


def copy_times(nbytes: int, repeats: int, device: str, to_host: bool = False, threads: int | None = None) -> dict:
    """Median seconds of copy_ between preallocated buffers of `nbytes`, by the host clock
    (`copy_wall_s`: synchronised before and after) and by the clock the runtime times its loads
    with (`copy_event_s`: CUDA events around the copy on CUDA, the host clock on CPU); on CPU with
    `threads` intra-op threads (None: this process's count) — a logical CPU device copies with
    its own threads_per_device, so that is its physical reference, not every core of the machine."""
    from plexrl.runtime import cuda

    host = torch.empty(nbytes // 4, dtype=torch.float32)
    streams = cuda.Streams(device)
    streams.register(host)  # page-locked at its size on CUDA, as the runtime's host buffers are
    before = torch.get_num_threads()
    if threads is not None and not device.startswith("cuda"):
        torch.set_num_threads(threads)
    try:
        return _copy_times(host, torch.empty(nbytes // 4, dtype=torch.float32, device=device), repeats, device,
                           to_host)
    finally:
        torch.set_num_threads(before)
        streams.unregister(host)


def _copy_times(host: torch.Tensor, arena: torch.Tensor, repeats: int, device: str, to_host: bool) -> dict:
    from plexrl.runtime.cuda import Span

    src, dst = (arena, host) if to_host else (host, arena)
    src.fill_(1.0)
    dst.copy_(src)  # first touch
    walls, events = [], []
    on_cuda = device.startswith("cuda")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        span = Span(torch.cuda.current_stream(device) if on_cuda else None)
        dst.copy_(src, non_blocking=on_cuda)
        span.stop()
        _sync(device)
        walls.append(time.perf_counter() - t0)
        events.append(span.seconds())
    return {"copy_wall_s": median(walls), "copy_event_s": median(events)}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="plexrl bench switch", description=__doc__)
    parser.add_argument("--size-mb", type=int, default=256, help="bytes per state, in MiB")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--rl-steps", type=int, default=4, help="steps of the RL-like loop whose write-back is "
                                                                "measured (0: skip it)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: the CPU, and CUDA too when present (its figures prefixed cuda_)")
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                        help="of the states (auto: bf16 on CUDA, fp32 on CPU); a state is --size-mb in its dtype")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is available; use auto or cpu")
    nbytes = args.size_mb << 20
    result = {}
    devices = {"auto": ["cpu"] + (["cuda"] if torch.cuda.is_available() else []), "cpu": ["cpu"],
               "cuda": ["cuda"]}[args.device]
    for device in devices:
        figures = switch_times(nbytes, args.repeats, device, args.precision)
        moved = figures["bytes_per_switch"]
        figures.update(copy_times(moved, max(args.repeats, 8), device, threads=DEVICE_THREADS))  # the same bytes
        figures.update(switch_gbps=moved / figures["load_s"] / 1e9, memcpy_gbps=moved / figures["copy_event_s"] / 1e9,
                       memcpy_wall_gbps=moved / figures["copy_wall_s"] / 1e9,
                       wall_ratio=figures["copy_wall_s"] / figures["switch_wall_s"])
        figures["ratio"] = figures["switch_gbps"] / figures["memcpy_gbps"]
        if device == "cpu":  # for scale: the same copy on every core of this machine
            figures["memcpy_gbps_all_threads"] = memcpy_gbps(moved, max(args.repeats, 8), device)
        if args.rl_steps > 0:
            figures.update(writeback_per_step(nbytes, args.rl_steps, device, args.precision))
        prefix = "" if device == "cpu" else "cuda_"
        result.update({prefix + key: value for key, value in figures.items()})
    result["state_bytes"] = nbytes
    result["threads"] = DEVICE_THREADS
    result["machine_threads"] = torch.get_num_threads()
    emit("switch: a state's load through the runtime vs copy_ between preallocated buffers; "
         "an RL loop's write-back vs the whole state's", result, args.json)
    return 0
