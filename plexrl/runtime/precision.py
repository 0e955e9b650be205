"""Numeric precision: what each `ClusterConfig.precision` means for a state, and where it is decided.

- "fp32": every state holds float32 (weights, gradients, Adam moments) and runs in float32.
- "bf16": full-parameter weights-only states (sampler snapshots, frozen reference and teacher
  models) hold bfloat16 weights, 2 B/param in their host buffer and in the arena, and run in
  bfloat16. Trainable states keep float32 master weights, gradients and Adam moments (16 B/param)
  and run forward and forward_backward under `torch.autocast(bfloat16)` (mixed precision: bf16
  has float32's exponent range, so no loss scaler); log-probs and losses are computed in float32
  (backends/execution.py). A weight sync rounds the trainer's float32 weights to nearest into the
  snapshot (`copy_`). LoRA states stay float32 (adapter and shared base): out of scope here.
- "auto" (the default): "bf16" where the devices are CUDA devices, "fp32" on CPU, so the CPU
  path stays bitwise what it always was.

Where "auto" is decided (`resolve`): a node sizes its states, so it must know what its workers
run on. The front resolves `torch_device` itself on the local and process engines (their workers
run on its machine), and with it the precision. On Ray the workers resolve `torch_device` where
they run (the driver may have no GPU), so the front hands "auto" on and each node asks its first
worker what it runs on before it makes its first state (node_models.py). The workers of one node are on
one machine, so one answer holds for the node.

TF32 (`set_tf32`, `computes_in_bf16`): a CUDA device worker lets float32 matmuls and convolutions
use TF32 tensor cores once it holds a state that computes in bfloat16 (a cluster of precision "bf16",
"auto" on CUDA): what is left in float32 there (master-weight updates, log-probs, LoRA states)
runs at TF32. Under "fp32" they stay IEEE float32, as asked: the worker turns TF32 off for matmuls
and for cuDNN (whose default is on) when it starts. It is a process-wide setting: on the local
engine, whose workers are threads of the driver, it holds for the driver's own torch code too,
and the cluster that set it last decides for every cluster of that process. Never on CPU.
"""

from __future__ import annotations

import torch

from plexrl.api.types import LoraConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve(precision: str, torch_device: str) -> str:
    """"fp32" or "bf16" for a cluster whose workers run on `torch_device`; "auto" is kept while
    `torch_device` is itself "auto" (not known here: see the module docstring)."""
    if precision != "auto":
        return precision
    if torch_device == "auto":
        return "auto"
    return "bf16" if torch_device.startswith("cuda") else "fp32"


def state_dtypes(precision: str, trainable: bool, lora: LoraConfig | None) -> tuple[torch.dtype, torch.dtype | None]:
    """(the dtype a state's flat memory holds, the dtype its model runs under autocast or None)
    for a resolved `precision`."""
    if precision == "auto":
        raise ValueError("precision 'auto' must be resolved (precision.resolve) before states are made")
    if precision == "fp32" or lora is not None:
        return torch.float32, None
    return (torch.float32, torch.bfloat16) if trainable else (torch.bfloat16, None)


def computes_in_bf16(dtype: torch.dtype, autocast: torch.dtype | None) -> bool:
    """Whether a state of flat `dtype` run under `autocast` (`state_dtypes`) computes in bfloat16."""
    return dtype == torch.bfloat16 or autocast == torch.bfloat16


def set_tf32(torch_device: str, allowed: bool) -> None:
    """Whether float32 matmuls and convolutions on CUDA may use TF32 (process-wide); nothing on CPU."""
    if torch_device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = allowed
        torch.backends.cudnn.allow_tf32 = allowed
