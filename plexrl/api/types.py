"""The job-facing data types, with the same names and meanings as Tinker's.

A `ModelInput` is a list of token chunks; a `Datum` pairs one with the per-token inputs its
loss needs (`loss_fn_inputs`: `target_tokens`, `weights`, `logprobs`, `advantages`, `values`...).
Tensors crossing the API are `TensorData` (a flat numpy-backed list with a shape), so nothing
job-side needs torch, and nothing pickled as a torch tensor crosses an engine boundary.

The constructors are as permissive as Tinker's plain types, with one exception: token ids are
integers (`ModelInput.from_ints([5.9])` is refused, never truncated). Everything else is checked
when a call is made (`validate()` here, plexrl/api/validation.py for the rest), so a wrong type
fails that call's future with an error naming the parameter. In every check a bool is not a
number, and numpy's integer and float scalars are numbers.
"""

from __future__ import annotations

import math
import numbers
import operator
import reprlib
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

import numpy as np

from plexrl.api import errors


def is_integer(value: Any) -> bool:
    """A Python or numpy integer, never a bool."""
    kind = type(value)
    if kind is int:  # the common case, without the ABC's isinstance
        return True
    return kind is not bool and isinstance(value, numbers.Integral)


def is_finite_number(value: Any) -> bool:
    """A finite Python or numpy real number, never a bool (NaN and infinities are not)."""
    kind = type(value)
    if kind is float:
        return math.isfinite(value)
    if kind is bool or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def all_ints(values: Sequence[Any]) -> bool:
    """Whether every item is exactly a Python int (no bool, no subclass), at C speed: the fast
    path of the token checks; what fails it goes through the per-item checks that name the item."""
    return _INT_ONLY.issuperset(map(type, values))


_INT_ONLY = frozenset({int})


def shown(value: Any) -> str:
    """`value` as an error message shows it: its repr, cut short, and its type unless the repr
    makes it plain."""
    text = reprlib.repr(value)
    if isinstance(value, (str, int, float, type(None), np.generic)) and not isinstance(value, bool):
        return text
    return f"{text} (a {type(value).__name__})"


def token_ids(tokens: Any, what: str) -> tuple[int, ...]:
    """`tokens` as a tuple of ints; InvalidInput naming the first position that is not an integer
    (5.9 is refused, never truncated; numpy and torch integer scalars are fine)."""
    if isinstance(tokens, (str, bytes, Mapping)) or not hasattr(tokens, "__iter__"):
        raise errors.InvalidInput(f"{what}: tokens={shown(tokens)}; expected a sequence of integer token ids")
    if isinstance(tokens, (list, tuple)) and all_ints(tokens):  # the common case: nothing to convert
        return tuple(tokens)
    if isinstance(tokens, np.ndarray) and tokens.ndim == 1 and tokens.dtype.kind in "iu":
        return tuple(tokens.tolist())
    ids = []
    for position, token in enumerate(tokens):
        try:
            if isinstance(token, (bool, np.bool_)):
                raise TypeError
            ids.append(operator.index(token))
        except TypeError:
            raise errors.InvalidInput(f"{what}: tokens[{position}]={shown(token)}; "
                                      "expected an integer token id") from None
    return tuple(ids)


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
        return cls((EncodedTextChunk(token_ids(tokens, "ModelInput.from_ints")),))

    @classmethod
    def empty(cls) -> "ModelInput":
        return cls(())

    def to_ints(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk.tokens]

    def append_int(self, token: int) -> "ModelInput":
        return ModelInput(self.chunks + (EncodedTextChunk(token_ids([token], "ModelInput.append_int")),))

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
        if array.dtype.kind not in "biuf":  # strings, objects, complex: no meaning as a loss input
            raise errors.InvalidInput(f"TensorData of dtype {array.dtype}; expected numbers (bool, int or float)")
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
        # Permissive: what does not convert is kept as given, and the call's check names it.
        if isinstance(self.loss_fn_inputs, Mapping):
            converted = {k: _tensor_or_as_given(v) for k, v in self.loss_fn_inputs.items()}
            object.__setattr__(self, "loss_fn_inputs", converted)


def _tensor_or_as_given(value: Any) -> Any:
    try:
        return TensorData.of(value)
    except (TypeError, ValueError):  # InvalidInput is a ValueError
        return value


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[int, ...] | tuple[str, ...] | None = None

    def validate(self) -> None:
        """InvalidSamplingParams naming every field of the wrong type or out of range."""
        k, p, seed = self.top_k, self.top_p, self.seed
        checks = (
            ("max_tokens", is_integer(self.max_tokens) and self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", is_finite_number(self.temperature) and self.temperature >= 0, "a finite number >= 0"),
            ("top_p", is_finite_number(p) and 0 < p <= 1, "a number with 0 < top_p <= 1"),
            ("top_k", is_integer(k) and (k == -1 or k >= 1), "-1 for no limit, or an integer >= 1"),
            ("seed", seed is None or (is_integer(seed) and 0 <= seed < 2**64), "None or an integer with 0 <= seed < 2**64"),
            ("stop", _is_stop(self.stop), "None, a non-empty string, or a sequence of token ids or non-empty strings"),
        )
        problems = [f"{name}={shown(getattr(self, name))} (expected {expected})" for name, ok, expected in checks if not ok]
        if problems:
            raise errors.InvalidSamplingParams("bad sampling params: " + "; ".join(problems))

    def plain(self) -> "SamplingParams":
        """These (valid) params with Python ints and floats, and `stop` a tuple (a lone string is
        one stop string)."""
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        return SamplingParams(int(self.max_tokens), float(self.temperature), int(self.top_k), float(self.top_p),
                              None if self.seed is None else int(self.seed),
                              None if stop is None else tuple(s if isinstance(s, str) else int(s) for s in stop))


def _is_stop(stop: Any) -> bool:
    if stop is None:
        return True
    if isinstance(stop, str):
        return bool(stop)
    if isinstance(stop, (bytes, Mapping)) or not isinstance(stop, (Sequence, np.ndarray)):
        return False
    return all(is_integer(s) or (isinstance(s, str) and s) for s in stop)


@dataclass(frozen=True)
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 means no clipping

    def validate(self) -> None:
        """InvalidAdamParams naming every field of the wrong type or out of range. Every field
        must be finite: an infinite or NaN one would turn the weights to NaN."""
        ranges = (
            ("learning_rate", lambda v: v >= 0, "a finite number >= 0"),
            ("beta1", lambda v: 0 <= v < 1, "a number with 0 <= beta1 < 1"),
            ("beta2", lambda v: 0 <= v < 1, "a number with 0 <= beta2 < 1"),
            ("eps", lambda v: v > 0, "a finite number > 0"),
            ("weight_decay", lambda v: v >= 0, "a finite number >= 0"),
            ("grad_clip_norm", lambda v: v >= 0, "a finite number >= 0; 0 disables"),
        )
        problems = [f"{name}={shown(getattr(self, name))} (expected {expected})" for name, in_range, expected in ranges
                    if not (is_finite_number(getattr(self, name)) and in_range(getattr(self, name)))]
        if problems:
            raise errors.InvalidAdamParams("bad Adam params: " + "; ".join(problems))

    def plain(self) -> "AdamParams":
        """These (valid) params with Python floats."""
        return AdamParams(*(float(getattr(self, name)) for name in
                            ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")))


ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)


@dataclass(frozen=True)
class LoraConfig:
    """A LoRA adapter over a base model's linear layers (peft's LoRA, Llama module names).

    `rank` >= 1 is the adapter's rank; `alpha` its scale numerator (peft's `lora_alpha`), None
    meaning 2 * rank, so the update is scaled by alpha / rank = 2 whatever the rank. Initial
    weights come from `seed` only (A random, B zero: a fresh adapter computes the base exactly).
    `train_attn` adapts q/k/v/o_proj, `train_mlp` gate/up/down_proj, `train_unembed` lm_head;
    at least one must be on.
    """

    rank: int
    seed: int = 0
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = False
    alpha: float | None = None

    def validate(self) -> None:
        """InvalidInput naming every field of the wrong type or out of range."""
        checks = [
            ("rank", is_integer(self.rank) and self.rank >= 1, "an integer >= 1 (0 means a full-parameter model, "
                                                               "which create_lora_training_client makes itself)"),
            ("seed", is_integer(self.seed), "an integer"),
            ("alpha", self.alpha is None or (is_finite_number(self.alpha) and self.alpha > 0),
             "None (2 * rank) or a finite number > 0"),
        ]
        checks += [(flag, isinstance(getattr(self, flag), (bool, np.bool_)), "True or False")
                   for flag in ("train_mlp", "train_attn", "train_unembed")]
        problems = [f"{name}={shown(getattr(self, name))} (expected {expected})" for name, ok, expected in checks if not ok]
        if problems:
            raise errors.InvalidInput("bad LoRA config: " + "; ".join(problems))
        if not self.target_modules:
            raise errors.InvalidInput("bad LoRA config: train_mlp, train_attn and train_unembed are all False, so "
                                      "the adapter would train nothing; expected at least one of them True")

    @property
    def target_modules(self) -> tuple[str, ...]:
        """The names of the linear layers the adapter wraps (Llama's)."""
        return ((ATTENTION_MODULES if self.train_attn else ()) + (MLP_MODULES if self.train_mlp else ())
                + (UNEMBED_MODULES if self.train_unembed else ()))

    @property
    def lora_alpha(self) -> float:
        return float(2 * self.rank if self.alpha is None else self.alpha)

    def plain(self) -> "LoraConfig":
        """This (valid) config with Python ints, floats and bools."""
        return LoraConfig(int(self.rank), int(self.seed), bool(self.train_mlp), bool(self.train_attn),
                          bool(self.train_unembed), None if self.alpha is None else float(self.alpha))


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

__all__ = ["AdamParams", "Datum", "EncodedTextChunk", "ForwardBackwardOutput", "LoadStateResponse", "LoraConfig", "ModelInput", "OptimStepResponse", "SampleResponse", "SampledSequence", "SamplingParams", "SaveStateResponse", "StopReason", "TensorData"]
