"""The activation reserve: the device memory a function needs beyond its state, measured per base model.

A device's budget (`device_memory_bytes`) is everything PlexRL may use on it; states get what is
left (state_manager.py) once the node has set aside the activation reserve of the largest model it
hosts (one function runs at a time per device, so the largest covers them all), the vLLM engines'
shares and the shared LoRA bases. A device worker measures the reserve of each base model folder
once, when a model of it is first added, by running the real backend (backends/execution.py) on a
trainable copy of the model and a reference batch of `tokens` tokens (rows of at most the model's
positions):

1) a forward_backward (cross_entropy over every position), then
2) a sample-sized forward: a prefill and a decode step of as many sequences, a KV cache of `tokens`,

both under the autocast the cluster's trainers run under (precision "bf16", "auto" on CUDA:
bfloat16, whose forward keeps a bf16 copy of each weight it multiplies for backward), and taking
the larger of their peaks beyond the copy's own weights and gradients.

How a peak is measured:
- CUDA: the caching allocator's peak of reserved memory less what it held before the probe
  (`reset_peak_memory_stats`, `max_memory_reserved`): what the process really took from the device.
  The probe runs once unmeasured first, each forward_backward from zero gradients: a process's
  first matmuls create the cuBLAS and cuBLASLt workspaces through the same allocator and keep them
  for the life of the process (about 64 MiB on an H200 with torch 2.11), so measured cold they
  would count as the first model's reserve. After the warm-up they are held before the
  measurement starts, so the reserve is the model's own and the same in every process.
- CPU (no allocator statistics): the bytes alive when backward starts — every tensor autograd saved
  (distinct storages; the copy's own weights and gradients excluded) and the model's outputs
  (logits; a KV cache) — plus one gradient the size of the logits, the largest tensor backward
  makes. A lower bound of the true peak (backward's smaller temporaries are left out), the same on
  every run: the figure the CPU tests check.

Out of scope: calls larger than the probe (a forward_backward of more tokens needs more: size
`activation_probe_tokens` to the largest batch a job sends); what a device process holds once
whatever it runs (the CUDA context, outside torch's allocator; the libraries' workspaces, above),
which sits beside the budget, so device_memory_bytes must leave room for it; LoRA states are
measured on their full-parameter base (their adapters' own intermediates are rank-sized); a
forward_backward that adds onto non-zero gradients (several before an optim_step) also keeps a
copy of them while it runs, 4 bytes per trainable parameter (execution.checked_backward), which a
budget for such jobs must leave room for beside the reserve.
"""

from __future__ import annotations

import math

import torch

from plexrl.api import errors
from plexrl.api.types import Datum, ModelInput, SamplingParams
from plexrl.backends import execution
from plexrl.runtime.state import FLOAT_BYTES, ModelState, skeleton_like

DEFAULT_PROBE_TOKENS = 4096  # activation_probe_tokens=None: one sequence, at most this long


def measure_reserve(template: torch.nn.Module, tokens: int | None, torch_device: str,
                    autocast: torch.dtype | None = None) -> int:
    """Peak bytes beyond a trainable state of `template` that a forward_backward or a sample
    of `tokens` tokens needs on `torch_device` (a multiple of FLOAT_BYTES), both run under
    `autocast` as the cluster's trainers are (precision.state_dtypes)."""
    probe, flat = trainable_copy(template, torch_device)
    rows, length = batch_shape(probe.config, tokens)
    ids = [[(7 * (r * length + i) + 5) % probe.config.vocab_size for i in range(length + 1)] for r in range(rows)]
    datums = [Datum(ModelInput.from_ints(row[:-1]), {"target_tokens": row[1:], "weights": [1.0] * length})
              for row in ids]

    def fb():  # from zero gradients each time: the runs are repeated, and a forward_backward onto
        # non-zero ones also keeps a copy of them (execution.checked_backward), which is not its
        # activations (counted, a 512 MB model's reserve on a 32-token probe was 589 MB on an H100)
        flat[flat.numel() // 2:].zero_()  # the copy's gradients: trainable_copy's second half
        execution.forward_backward(probe, datums, "cross_entropy", autocast=autocast)

    def sample():  # max_tokens=2: the decode step runs on the cache of every sequence
        execution.sample(probe, ids[0][: length - 2], rows, SamplingParams(max_tokens=2), seed=0, autocast=autocast)

    try:
        if torch_device.startswith("cuda"):
            peak = cuda_peak(torch.device(torch_device), [fb, sample])
        else:
            peak = max(cpu_peak(probe, flat, fb, backward=True), cpu_peak(probe, flat, sample, backward=False))
    except torch.OutOfMemoryError:
        raise errors.ConfigError(
            f"measuring the activation reserve of {template.config.name_or_path!r} ({tokens or 'default'} tokens) ran out of "
            f"memory on {torch_device}: the probe needs the model's weights and gradients and its activations free "
            "beside the arena; expected activation_probe_tokens smaller, or activation_reserve_bytes set by hand"
        ) from None
    finally:
        del probe, flat
        if torch_device.startswith("cuda"):
            torch.cuda.empty_cache()
    return math.ceil(peak / FLOAT_BYTES) * FLOAT_BYTES


def reserve_of(folder: str, tokens: int | None = None, torch_device: str = "cpu", precision: str = "fp32") -> int:
    """The reserve a cluster of `precision` measures for the model in `folder` (for sizing a
    budget before one exists)."""
    from plexrl.runtime import precision as precisions
    from plexrl.runtime.state import load_module

    autocast = trainer_autocast(precisions.resolve(precision, torch_device))
    return measure_reserve(load_module(folder), tokens, torch_device, autocast)


def trainer_autocast(precision: str) -> torch.dtype | None:
    """The autocast dtype of a full-parameter trainer under a resolved `precision`: the reserve is
    measured under it (a bf16 trainer's forward keeps bf16 copies of its weights for backward)."""
    from plexrl.runtime import precision as precisions

    return precisions.state_dtypes(precision, True, None)[1]


def batch_shape(config, tokens: int | None) -> tuple[int, int]:
    """(rows, tokens per row) of the reference batch: at least `tokens` in rows the model can take
    (None: one sequence of the model's positions, at most DEFAULT_PROBE_TOKENS)."""
    positions = int(getattr(config, "max_position_embeddings", DEFAULT_PROBE_TOKENS))
    tokens = min(positions, DEFAULT_PROBE_TOKENS) if tokens is None else tokens
    length = max(3, min(tokens, positions))
    return math.ceil(tokens / length), length


def trainable_copy(template: torch.nn.Module, torch_device: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """A copy of `template` on `torch_device` whose weights and zeroed gradients are views into
    one flat tensor, bound as a resident trainable state's are into the arena (ModelState.bind:
    its first two segments), every parameter trainable."""
    state = ModelState("probe", "probe", "probe", skeleton_like(template), True, "")
    flat = torch.zeros(2 * state.numel, dtype=torch.float32, device=torch_device)
    # gathered where the template lives (host memory), then one copy onto the device: `cat` with
    # `out=` on another device than its inputs is refused on CUDA
    state.segment(flat, 0).copy_(torch.cat([p.detach().reshape(-1) for p in template.parameters()]))
    state.bind(flat)
    state._move_buffers(flat.device)  # rotary frequencies and the like follow the weights
    for p in state.params:
        p.requires_grad_(True)
    return state.module, flat


def cuda_peak(device: torch.device, runs) -> int:
    """The most memory the caching allocator held during `runs` beyond what it held before, the
    runs done once before (what they allocate once per process is held by then: see above)."""
    for run in runs:
        run()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    for run in runs:
        run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_reserved(device) - before


def cpu_peak(module: torch.nn.Module, own: torch.Tensor, run, backward: bool) -> int:
    """Bytes alive when backward would start: tensors saved for it and the model's outputs
    (distinct storages outside `own`, the copy's weights and gradients), plus, when `backward`,
    one gradient of the largest output (the logits')."""
    low = own.untyped_storage().data_ptr()
    high = low + own.untyped_storage().nbytes()
    saved: dict[int, int] = {}
    outputs: dict[int, int] = {}

    def keep(into: dict[int, int], tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if not low <= storage.data_ptr() < high:
            into[storage.data_ptr()] = storage.nbytes()

    def pack(tensor):
        if isinstance(tensor, torch.Tensor) and tensor.layout is torch.strided:
            keep(saved, tensor)
        return tensor

    def on_output(_module, _inputs, output):
        step: dict[int, int] = {}
        for tensor in tensors_in(output):
            keep(step, tensor)
        if sum(step.values()) > sum(outputs.values()):  # the largest step's outputs (a decode keeps one at a time)
            outputs.clear()
            outputs.update(step)

    hook = module.register_forward_hook(on_output)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            run()
    finally:
        hook.remove()
    largest = max(outputs.values(), default=0)
    return sum({**saved, **outputs}.values()) + (largest if backward else 0)


def tensors_in(value, depth: int = 0):
    """The strided tensors in a model output: its fields, lists and a KV cache's layers."""
    if isinstance(value, torch.Tensor):
        if value.layout is torch.strided:
            yield value
        return
    if depth > 4 or value is None or isinstance(value, (str, bytes, int, float, bool)):
        return
    if isinstance(value, dict):
        items = value.values()
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        items = vars(value).values() if hasattr(value, "__dict__") else ()
    for item in items:
        yield from tensors_in(item, depth + 1)
