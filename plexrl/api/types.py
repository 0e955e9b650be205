"""The job-facing data types, with the same names and meanings as Tinker's.

A `ModelInput` is a list of token chunks; a `Datum` pairs one with the per-token inputs its
loss needs (`loss_fn_inputs`: `target_tokens`, `weights`, `logprobs`, `advantages`, `values`...).
Tensors crossing the API are `TensorData` (a flat numpy-backed list with a shape), so nothing
job-side needs torch, and nothing pickled as a torch tensor crosses an engine boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import numpy as np

from plexrl.api import errors


@dataclass(frozen=True)
class EncodedTextChunk:
    tokens: tuple[int, ...]

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class ModelInput:
    chunks: tuple[EncodedTextChunk, ...] = ()

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> "ModelInput":
        return cls((EncodedTextChunk(tuple(int(t) for t in tokens)),))

    @classmethod
    def empty(cls) -> "ModelInput":
        return cls(())

    def to_ints(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk.tokens]

    def append_int(self, token: int) -> "ModelInput":
        return ModelInput(self.chunks + (EncodedTextChunk((int(token),)),))

    @property
    def length(self) -> int:
        return sum(c.length for c in self.chunks)


@dataclass(frozen=True)
class TensorData:
    """A dense array: `data` flat, `shape` its shape, `dtype` 'float32' or 'int64'."""

    data: tuple[float | int, ...]
    dtype: Literal["float32", "int64"] = "float32"
    shape: tuple[int, ...] | None = None

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> "TensorData":
        array = np.asarray(array)
        dtype = "int64" if np.issubdtype(array.dtype, np.integer) else "float32"
        return cls(tuple(array.reshape(-1).tolist()), dtype, tuple(array.shape))

    @classmethod
    def of(cls, values: Any) -> "TensorData":
        """TensorData from a TensorData, numpy array, torch tensor or (nested) list."""
        if isinstance(values, TensorData):
            return values
        if hasattr(values, "detach"):  # a torch tensor, converted without importing torch
            values = values.detach().cpu().numpy()
        return cls.from_numpy(np.asarray(values))

    def to_numpy(self) -> np.ndarray:
        array = np.asarray(self.data, dtype=np.float32 if self.dtype == "float32" else np.int64)
        return array.reshape(self.shape) if self.shape is not None else array

    def tolist(self) -> list:
        return self.to_numpy().tolist()


@dataclass(frozen=True)
class Datum:
    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = field(default_factory=dict)

    def __post_init__(self) -> None:
        converted = {k: TensorData.of(v) for k, v in self.loss_fn_inputs.items()}
        object.__setattr__(self, "loss_fn_inputs", converted)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[int, ...] | tuple[str, ...] | None = None

    def validate(self) -> None:
        problems = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(f"max_tokens={self.max_tokens!r} (expected an integer >= 1)")
        if not (self.temperature >= 0.0):
            problems.append(f"temperature={self.temperature!r} (expected a number >= 0)")
        if not (0.0 < self.top_p <= 1.0):
            problems.append(f"top_p={self.top_p!r} (expected 0 < top_p <= 1)")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            problems.append(f"top_k={self.top_k!r} (expected -1 for no limit, or an integer >= 1)")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            problems.append(f"seed={self.seed!r} (expected None or an integer >= 0)")
        if problems:
            raise errors.InvalidSamplingParams("bad sampling params: " + "; ".join(problems))


@dataclass(frozen=True)
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 means no clipping

    def validate(self) -> None:
        problems = []
        if not (self.learning_rate >= 0):
            problems.append(f"learning_rate={self.learning_rate!r} (expected >= 0)")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not (0.0 <= value < 1.0):
                problems.append(f"{name}={value!r} (expected 0 <= {name} < 1)")
        if not (self.eps > 0):
            problems.append(f"eps={self.eps!r} (expected > 0)")
        if not (self.weight_decay >= 0):
            problems.append(f"weight_decay={self.weight_decay!r} (expected >= 0)")
        if not (self.grad_clip_norm >= 0):
            problems.append(f"grad_clip_norm={self.grad_clip_norm!r} (expected >= 0; 0 disables)")
        if problems:
            raise errors.InvalidAdamParams("bad Adam params: " + "; ".join(problems))


StopReason = Literal["length", "stop"]


@dataclass(frozen=True)
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason


@dataclass(frozen=True)
class SampleResponse:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None


@dataclass(frozen=True)
class ForwardBackwardOutput:
    """Per datum outputs (`logprobs` for every built-in loss, `values` for `value_mse`) and metrics."""

    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, float]


@dataclass(frozen=True)
class OptimStepResponse:
    metrics: dict[str, float]


@dataclass(frozen=True)
class SaveStateResponse:
    path: str


@dataclass(frozen=True)
class LoadStateResponse:
    path: str

__all__ = ["AdamParams", "Datum", "EncodedTextChunk", "ForwardBackwardOutput", "LoadStateResponse", "ModelInput", "OptimStepResponse", "SampleResponse", "SampledSequence", "SamplingParams", "SaveStateResponse", "StopReason", "TensorData"]
