"""Optimizer steps and checkpoints over a state's flat memory.

`adam_step` runs torch's AdamW on the flat weights with the state's own moment buffers injected
as the optimizer state, so the moments never leave the state's memory (arena or host buffer).
A saved state is a Hugging Face model folder (`AutoModelForCausalLM.from_pretrained` loads it,
and so does `create_training_client(base_model=...)`) plus `optimizer.safetensors` with the moments.

A checkpoint folder is complete or absent: it is written beside its final name and renamed into
place, so a writer that dies midway (a lost node) leaves no half-written checkpoint to restore from.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from plexrl import errors
from plexrl.runtime.state import ModelState, load_module
from plexrl.types import AdamParams

OPTIMIZER_FILE = "optimizer.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "chat_template.jinja", "generation_config.json")


def adam_step(state: ModelState, params: AdamParams) -> dict[str, float]:
    flat = state.current()
    weights, grads, exp_avg, exp_avg_sq = (state.segment(flat, i) for i in range(4))
    grad_norm = float(torch.linalg.vector_norm(grads))
    if params.grad_clip_norm > 0 and grad_norm > params.grad_clip_norm:
        grads.mul_(params.grad_clip_norm / (grad_norm + 1e-6))
    weights.grad = grads
    optimizer = torch.optim.AdamW(
        [weights], lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
        weight_decay=params.weight_decay, foreach=False, fused=False,
    )
    optimizer.state[weights] = {
        "step": torch.tensor(float(state.adam_step)),
        "exp_avg": exp_avg,
        "exp_avg_sq": exp_avg_sq,
    }
    optimizer.step()
    weights.grad = None
    state.adam_step += 1
    grads.zero_()
    return {"grad_norm": grad_norm, "step": float(state.adam_step), "learning_rate": params.learning_rate}


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
    weights = {k: v.detach().clone() for k, v in state.module.state_dict().items()}
    state.module.save_pretrained(str(path), state_dict=weights, safe_serialization=True)
    for name in TOKENIZER_FILES:
        source = Path(state.source) / name
        if source.is_file() and not (path / name).exists():
            shutil.copyfile(source, path / name)
    written = state.numel * 4
    if with_optimizer and state.trainable:
        flat = state.current()
        save_file(
            {"exp_avg": state.segment(flat, 2).clone(), "exp_avg_sq": state.segment(flat, 3).clone()},
            str(path / OPTIMIZER_FILE),
            metadata={"adam_step": str(state.adam_step), "numel": str(state.numel)},
        )
        written += 2 * state.numel * 4
    (path / "plexrl_state.json").write_text(json.dumps({"job": state.job, "model": state.name, "adam_step": state.adam_step}))
    return written


def load_state(state: ModelState, path: Path, with_optimizer: bool) -> int:
    """Overwrite `state`'s weights (and moments) from a folder written by `save_state`."""
    source = load_module(path)
    numel = sum(p.numel() for p in source.parameters())
    if numel != state.numel:
        raise errors.ModelLoadError(
            f"checkpoint {str(path)!r} has {numel:,} parameters but model {state.name!r} has {state.numel:,}; "
            "expected a checkpoint of the same architecture"
        )
    flat = state.current()
    torch.cat([p.detach().reshape(-1) for p in source.parameters()], out=state.segment(flat, 0))
    written = numel * 4
    if state.trainable:
        state.segment(flat, 1).zero_()
        if with_optimizer:
            written += _load_moments(state, flat, path)
        else:
            state.segment(flat, 2).zero_()
            state.segment(flat, 3).zero_()
            state.adam_step = 0
    return written


def _load_moments(state: ModelState, flat: torch.Tensor, path: Path) -> int:
    file = path / OPTIMIZER_FILE
    if not file.is_file():
        raise errors.ModelLoadError(
            f"checkpoint {str(path)!r} has no {OPTIMIZER_FILE}; use load_state (weights only) or a checkpoint "
            "saved with its optimizer"
        )
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        step = int(f.metadata().get("adam_step", "0"))
    moments = load_file(str(file))
    state.segment(flat, 2).copy_(moments["exp_avg"])
    state.segment(flat, 3).copy_(moments["exp_avg_sq"])
    state.adam_step = step
    return 2 * state.numel * 4
