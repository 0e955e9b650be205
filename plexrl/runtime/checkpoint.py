"""Optimizer steps and checkpoints over a state's flat memory.

`adam_step` runs torch's AdamW on the flat weights with the state's own moment buffers injected
as the optimizer state, so the moments never leave the state's memory (arena or host buffer).
A saved state is a Hugging Face model folder (`AutoModelForCausalLM.from_pretrained` loads it,
and so does `create_training_client(base_model=...)`) plus `optimizer.safetensors` with the moments.
A saved LoRA state is peft's adapter folder (`adapter_model.safetensors` + `adapter_config.json`:
`PeftModel.from_pretrained(base, folder)` loads it) plus the same `optimizer.safetensors` over
the adapter's parameters; its base is not copied (the config names it). A LoRA checkpoint loads
only into a LoRA state of the same shapes, a full one only into a full state.

Dtypes: a state saves its weights in its own dtype (a bfloat16 snapshot or frozen model writes
bfloat16 tensors, and its config says so); a load reads any dtype and converts it to the state's
(float32 from bfloat16 is exact, so a bfloat16 state's save and load round-trip bit for bit).
Optimizer moments are float32.

A checkpoint folder is complete or absent: it is written beside its final name and renamed into
place, so a writer that dies midway (a lost node) leaves no half-written checkpoint to restore from.

Invariants:
- a refused `adam_step` (AdamParams out of range, gradients or a result that are non-finite)
  leaves the state bitwise as it was: weights, gradients, moments and the step count;
- a load is atomic: the whole checkpoint is read and checked in memory (weights of the right
  shapes, finite; with the optimizer both moments complete, of the right size, finite, and the
  step count) before anything in the state changes, so a failed load changes nothing;
- the guards only read: a good step's or load's arithmetic is the same as without them.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from plexrl import errors
from plexrl.runtime import lora
from plexrl.runtime.state import ModelState, load_module
from plexrl.types import AdamParams

OPTIMIZER_FILE = "optimizer.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "chat_template.jinja", "generation_config.json")


# A bound on every intermediate of a step below this proves it finite (float32 max / 16: the
# bound is computed in float64 from float32 maxima, so rounding cannot reach the real limit).
FLOAT32_SAFE = torch.finfo(torch.float32).max / 16


def adam_step(state: ModelState, params: AdamParams) -> dict[str, float]:
    """One AdamW step over the flat buffer (torch's single-tensor AdamW), then the gradients zeroed.

    Refused, with the state bitwise as it was (step count included): AdamParams out of range
    (InvalidAdamParams), gradients whose norm is non-finite, and a step whose weights or moments
    would come out non-finite (NonFiniteUpdate). Cost on a good step: the norms of the weights
    and both moments (three reads, one sync), from which a float64 bound proves the step finite.
    Only when the bound cannot (an enormous learning rate or weight decay, a tiny eps, moments
    already near float32's limit) is the whole flat state copied first (16 bytes per parameter,
    on the state's device, outside the arena) and restored if the step did go non-finite.
    """
    check_adam_params(params)
    flat = state.current()
    weights, grads, exp_avg, exp_avg_sq = (state.segment(flat, i) for i in range(4))
    grad_norm = float(torch.linalg.vector_norm(grads))
    if not math.isfinite(grad_norm):
        raise errors.NonFiniteUpdate(
            f"optim_step refused: the gradients of model {state.name!r} have a non-finite norm ({grad_norm}); "
            "nothing was changed. forward_backward refuses such gradients, so they did not come from it")
    clip = params.grad_clip_norm > 0 and grad_norm > params.grad_clip_norm
    scale = params.grad_clip_norm / (grad_norm + 1e-6) if clip else 1.0
    backup = None if step_is_finite(state, flat, params, grad_norm * scale) else flat.clone()
    if clip:
        grads.mul_(scale)
    try:
        _adamw(state, flat, params)
    except RuntimeError as exc:  # torch refuses a scalar beyond float32 (lr / bias correction), midway
        if backup is None or "overflow" not in str(exc):
            raise
        flat.copy_(backup)
        raise errors.NonFiniteUpdate(nonfinite_step_message(state, params, was_finite=True)) from exc
    if backup is not None and not all_finite(weights, exp_avg, exp_avg_sq):
        was_finite = all_finite(*(state.segment(backup, i) for i in (0, 2, 3)))
        flat.copy_(backup)
        raise errors.NonFiniteUpdate(nonfinite_step_message(state, params, was_finite))
    state.adam_step += 1
    grads.zero_()
    return {"grad_norm": grad_norm, "step": float(state.adam_step), "learning_rate": params.learning_rate}


def _adamw(state: ModelState, flat: torch.Tensor, params: AdamParams) -> None:
    """torch's single-tensor AdamW on the flat weights, its state the flat buffer's own moments."""
    weights, grads, exp_avg, exp_avg_sq = (state.segment(flat, i) for i in range(4))
    weights.grad = grads
    optimizer = torch.optim.AdamW(
        [weights], lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
        weight_decay=params.weight_decay, foreach=False, fused=False,
    )
    optimizer.state[weights] = {"step": torch.tensor(float(state.adam_step)), "exp_avg": exp_avg,
                                "exp_avg_sq": exp_avg_sq}
    try:
        optimizer.step()
    finally:
        weights.grad = None


def check_adam_params(params: object) -> None:
    """The runtime's own line of defence: AdamParams.validate (the client checks the same)."""
    if not isinstance(params, AdamParams):
        raise errors.InvalidAdamParams(f"adam_params={params!r}; expected plexrl.AdamParams")
    params.validate()


def step_is_finite(state: ModelState, flat: torch.Tensor, params: AdamParams, max_grad: float) -> bool:
    """Whether a float64 bound proves every intermediate of this AdamW step finite in float32.

    With W, M, V >= the max |x| of weights, exp_avg, exp_avg_sq (their 2-norms: a loose bound, but
    a fast reduction, unlike max |x|) and G >= max |grad| (the clipped norm): decay = |1 - lr*wd|; exp_avg and its lerp stay within M + G; exp_avg_sq within V + G^2;
    the denominator sqrt(v)/sqrt(bc2) + eps is >= eps, so the update is within
    lr/bc1 * (M + G)/eps, and the new weights within W*decay + that. NaN anywhere fails the test.
    """
    w, m, v = torch.stack([torch.linalg.vector_norm(state.segment(flat, i)) for i in (0, 2, 3)]).tolist()
    lr, eps = params.learning_rate, params.eps
    bias_correction1 = 1 - params.beta1 ** (state.adam_step + 1)
    if bias_correction1 <= 0:
        return False
    decay = abs(1 - lr * params.weight_decay)
    step_size = lr / bias_correction1
    ratio = (m + max_grad) / eps
    bounds = (decay, w * decay, m + max_grad, v + max_grad * max_grad, step_size, ratio,
              w * decay + step_size * ratio)
    return all(b < FLOAT32_SAFE for b in bounds)  # False for NaN


def all_finite(*tensors: torch.Tensor) -> bool:
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def nonfinite_step_message(state: ModelState, params: AdamParams, was_finite: bool) -> str:
    if not was_finite:
        return (f"optim_step refused: model {state.name!r} already has non-finite weights or Adam moments; "
                "nothing was changed. Restore it from a checkpoint with load_state_with_optimizer")
    return (f"optim_step refused: this step would make the weights or Adam moments of model {state.name!r} "
            f"non-finite (learning_rate={params.learning_rate!r}, weight_decay={params.weight_decay!r}, "
            f"eps={params.eps!r}); nothing was changed. Check for a learning rate or weight decay far too large "
            "(weights are scaled by 1 - lr * weight_decay) or an eps too small for float32")


def save_state(state: ModelState, path: Path, with_optimizer: bool = True) -> int:
    """Write `state` as a Hugging Face folder (+ optimizer moments), atomically; returns bytes written."""
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    written = _write_state(state, partial, with_optimizer)
    if path.exists():  # a checkpoint of the same name is replaced
        shutil.rmtree(path)
    partial.rename(path)
    return written


def _write_state(state: ModelState, path: Path, with_optimizer: bool) -> int:
    path.mkdir(parents=True, exist_ok=True)
    if state.lora is None:
        weights = {k: v.detach().clone() for k, v in state.module.state_dict().items()}
        state.module.save_pretrained(str(path), state_dict=weights, safe_serialization=True)
    else:
        _write_adapter(state, path)
    for name in TOKENIZER_FILES:
        source = Path(state.source) / name
        if source.is_file() and not (path / name).exists():
            shutil.copyfile(source, path / name)
    written = state.numel * state.dtype.itemsize
    if with_optimizer and state.trainable:
        flat = state.current()
        save_file(
            {"exp_avg": state.segment(flat, 2).clone(), "exp_avg_sq": state.segment(flat, 3).clone()},
            str(path / OPTIMIZER_FILE),
            metadata={"adam_step": str(state.adam_step), "numel": str(state.numel)},
        )
        written += 2 * state.numel * 4
    (path / "plexrl_state.json").write_text(json.dumps({"job": state.job, "model": state.name, "adam_step": state.adam_step,
                                                        "lora_rank": 0 if state.lora is None else state.lora.rank}))
    return written


def _write_adapter(state: ModelState, path: Path) -> None:
    """peft's adapter files: the adapter's weights by peft's keys, and its config naming the base."""
    names = lora.adapter_names(state.module)
    tensors = {lora.peft_key(n): p.detach().clone().contiguous() for n, p in zip(names, state.params)}
    save_file(tensors, str(path / ADAPTER_FILE), metadata={"format": "pt"})
    config = lora.peft_config(state.lora)
    config.base_model_name_or_path = str(state.source)
    config.save_pretrained(str(path))


def load_state(state: ModelState, path: Path, with_optimizer: bool) -> int:
    """Overwrite `state`'s weights (and moments) from a folder written by `save_state`, atomically:
    everything is read and checked first (ModelLoadError on any fault), then written. Gradients
    are zeroed; without the optimizer the moments and step count restart from zero."""
    # 1) read and check the whole checkpoint into memory; the state is not touched yet
    check_kind(state, path)
    weights = _read_weights(state, path) if state.lora is None else _read_adapter(state, path)
    moments = _read_moments(state, path) if with_optimizer and state.trainable else None
    # 2) write it into the state: nothing below can fail, every size was checked
    flat = state.current()
    torch.cat(weights, out=state.segment(flat, 0))  # rounded to nearest into a bfloat16 state
    written = state.numel * state.dtype.itemsize
    if state.trainable:
        state.segment(flat, 1).zero_()
        if moments is not None:
            exp_avg, exp_avg_sq, step = moments
            state.segment(flat, 2).copy_(exp_avg)
            state.segment(flat, 3).copy_(exp_avg_sq)
            state.adam_step = step
            written += 2 * state.numel * 4
        else:
            state.segment(flat, 2).zero_()
            state.segment(flat, 3).zero_()
            state.adam_step = 0
    return written


def _read_weights(state: ModelState, path: Path) -> list[torch.Tensor]:
    """The checkpoint's parameters, flattened in the state's order, after checking count, shapes and finiteness."""
    source = load_module(path)
    params = list(source.parameters())
    numel = sum(p.numel() for p in params)
    if numel != state.numel:
        raise errors.ModelLoadError(
            f"checkpoint {str(path)!r} has {numel:,} parameters but model {state.name!r} has {state.numel:,}; "
            "expected a checkpoint of the same architecture"
        )
    shapes = [p.shape for p in params]
    if shapes != state.shapes:
        first = next(i for i, (a, b) in enumerate(zip(shapes, state.shapes)) if a != b)
        raise errors.ModelLoadError(
            f"checkpoint {str(path)!r} has parameter shapes that differ from model {state.name!r}'s "
            f"(parameter {first}: {tuple(shapes[first])} vs {tuple(state.shapes[first])}); expected a checkpoint "
            "of the same architecture"
        )
    flat = [p.detach().reshape(-1) for p in params]
    if not all_finite(*flat):
        raise errors.ModelLoadError(f"checkpoint {str(path)!r} has non-finite (NaN or inf) weights; expected finite ones")
    return flat


def check_kind(state: ModelState, path: Path) -> None:
    """ModelLoadError unless the folder is the kind of checkpoint `state` takes: a LoRA adapter
    folder for a LoRA state, a full model folder for a full one."""
    is_adapter = (path / ADAPTER_CONFIG).is_file()
    if state.lora is not None and not is_adapter:
        raise errors.ModelLoadError(
            f"checkpoint {str(path)!r} has no {ADAPTER_CONFIG}: it is not a LoRA adapter, but model {state.name!r} is "
            f"a LoRA model (rank {state.lora.rank}); expected a folder saved by save_state of a LoRA model "
            f"({ADAPTER_FILE} + {ADAPTER_CONFIG})")
    if state.lora is None and is_adapter:
        raise errors.ModelLoadError(
            f"checkpoint {str(path)!r} is a LoRA adapter ({ADAPTER_CONFIG}), but model {state.name!r} is a "
            "full-parameter model; expected a full model folder (config.json + weights) saved by save_state of a "
            "full-parameter model")


def _read_adapter(state: ModelState, path: Path) -> list[torch.Tensor]:
    """The adapter's parameters, flattened in the state's order, after checking keys, shapes and finiteness."""
    file = path / ADAPTER_FILE
    try:
        tensors = load_file(str(file))
    except Exception as exc:  # missing, torn or not safetensors
        raise errors.ModelLoadError(f"could not read {str(file)!r} ({type(exc).__name__}: {exc}); expected the "
                                    "adapter weights a LoRA save_state writes") from exc
    keys = [lora.peft_key(n) for n in lora.adapter_names(state.module)]
    missing, extra = [k for k in keys if k not in tensors], sorted(set(tensors) - set(keys))
    if missing or extra:
        raise errors.ModelLoadError(
            f"checkpoint {str(path)!r} adapts other layers than model {state.name!r} ({len(missing)} of its adapter "
            f"weights missing, e.g. {missing[:1]}; {len(extra)} unknown, e.g. {extra[:1]}); expected an adapter with "
            f"the same targets {list(state.lora.target_modules)}")
    for key, shape in zip(keys, state.shapes):
        if tensors[key].shape != shape or tensors[key].dtype != torch.float32:
            raise errors.ModelLoadError(
                f"checkpoint {str(path)!r} has {key} of {tensors[key].dtype} {tuple(tensors[key].shape)}, but model "
                f"{state.name!r} (rank {state.lora.rank}) expects float32 {tuple(shape)}; expected an adapter of the "
                "same rank over the same base")
    flat = [tensors[k].reshape(-1) for k in keys]
    if not all_finite(*flat):
        raise errors.ModelLoadError(f"checkpoint {str(path)!r} has non-finite (NaN or inf) adapter weights; expected finite ones")
    return flat


def _read_moments(state: ModelState, path: Path) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(exp_avg, exp_avg_sq, adam step) from the checkpoint's optimizer file, each checked."""
    file = path / OPTIMIZER_FILE
    if not file.is_file():
        raise errors.ModelLoadError(
            f"checkpoint {str(path)!r} has no {OPTIMIZER_FILE}; use load_state (weights only) or a checkpoint "
            "saved with its optimizer"
        )
    try:
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata() or {}
        moments = load_file(str(file))
    except Exception as exc:  # safetensors raises its own error type for a torn or corrupt file
        raise errors.ModelLoadError(
            f"could not read {str(file)!r} ({type(exc).__name__}: {exc}); the file is incomplete or corrupt: "
            "use load_state for the weights only, or another checkpoint"
        ) from exc

    def fault(what: str) -> errors.ModelLoadError:
        return errors.ModelLoadError(f"{str(file)!r} {what}; expected a file written by save_state for model {state.name!r}")

    for key in ("exp_avg", "exp_avg_sq"):
        tensor = moments.get(key)
        if tensor is None:
            raise fault(f"has no {key!r}")
        if tensor.dtype != torch.float32 or tuple(tensor.shape) != (state.numel,):
            raise fault(f"has {key!r} of {tensor.dtype} {tuple(tensor.shape)}, not float32 ({state.numel},)")
    if not all_finite(moments["exp_avg"], moments["exp_avg_sq"]) or bool((moments["exp_avg_sq"] < 0).any()):
        raise fault("has non-finite moments (or a negative exp_avg_sq)")
    step = metadata.get("adam_step", "")
    if not step.isdigit():
        raise fault(f"has adam_step={step!r} in its metadata, not an integer >= 0")
    if metadata.get("numel", str(state.numel)) != str(state.numel):
        raise fault(f"is for {metadata['numel']} parameters, not {state.numel}")
    return moments["exp_avg"], moments["exp_avg_sq"], int(step)
