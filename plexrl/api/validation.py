"""The job side's input checks, and the table of built-in losses they check against.

A bad call fails here, in the caller's process, before any engine sees it; the backend runs the
same checks (one definition) so a direct call on a model fails the same way. Every message names
the parameter, its value and what was expected.

`BUILTIN_LOSSES` says what each built-in loss needs and accepts: the model output it reads,
the `loss_fn_inputs` every datum must carry, those that default to a constant, and its config
keys with their defaults. Their per-token maths is in plexrl/backends/losses.py.

Standard library and numpy only (tests/test_api_pure.py imports this with torch, ray and
transformers unimportable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

import numpy as np

from plexrl.api import errors
from plexrl.api.types import Datum, SamplingParams


@dataclass(frozen=True)
class LossSpec:
    name: str
    reads: Literal["logprobs", "values"]  # the model output the loss is a function of
    required: tuple[str, ...]  # loss_fn_inputs every datum must carry
    optional: Mapping[str, float] = field(default_factory=dict)  # inputs that default to a constant
    config_defaults: Mapping[str, float] = field(default_factory=dict)


_POLICY_INPUTS = ("target_tokens", "logprobs", "advantages")

BUILTIN_LOSSES: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        LossSpec("cross_entropy", "logprobs", ("target_tokens",), {"weights": 1.0}),
        LossSpec("importance_sampling", "logprobs", _POLICY_INPUTS),
        LossSpec("ppo", "logprobs", _POLICY_INPUTS,
                 config_defaults={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
        LossSpec("cispo", "logprobs", _POLICY_INPUTS,
                 config_defaults={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
        LossSpec("value_mse", "values", ("target_values",), {"weights": 1.0}),
    )
}


# ---------------------------------------------------------------------------- tokens and datums

def check_tokens(tokens: Sequence[int], vocab_size: int, what: str) -> None:
    bad = [(i, t) for i, t in enumerate(tokens) if not 0 <= t < vocab_size]
    if bad:
        position, token = bad[0]
        raise errors.InvalidInput(
            f"{what}: token {token} at position {position} is outside the vocabulary "
            f"(expected 0 <= token < {vocab_size}; {len(bad)} bad token(s) in all)")


def check_length(length: int, max_positions: int, what: str) -> None:
    if not 1 <= length <= max_positions:
        raise errors.InvalidInput(
            f"{what} has {length} tokens; expected between 1 and the model's {max_positions} positions")


def check_sequence(tokens: Sequence[int], vocab_size: int, max_positions: int, what: str) -> None:
    """1..max_positions tokens, each in the vocabulary."""
    check_length(len(tokens), max_positions, what)
    check_tokens(tokens, vocab_size, what)


def validate_datums(datums: Sequence[Datum], vocab_size: int, max_positions: int) -> None:
    """Every datum: 1..max_positions tokens in the vocabulary, and every loss_fn_input a flat
    finite array of the model_input's length (Tinker: `target_tokens[t]` follows position t)."""
    if not datums:
        raise errors.DatumShapeError("forward_backward got no datums; expected at least one Datum")
    for index, datum in enumerate(datums):
        tokens = datum.model_input.to_ints()
        check_sequence(tokens, vocab_size, max_positions, f"datum {index}: model_input")
        for key, tensor in datum.loss_fn_inputs.items():
            check_datum_input(index, key, tensor.to_numpy(), len(tokens), vocab_size)


def check_datum_input(index: int, key: str, array: np.ndarray, expected_length: int, vocab_size: int) -> None:
    where = f"datum {index}: loss_fn_inputs[{key!r}]"
    if array.ndim != 1 or array.shape[0] != expected_length:
        raise errors.DatumShapeError(
            f"{where} has shape {tuple(array.shape)} (length {array.shape[0] if array.ndim else 0}); "
            f"expected a flat array of length {expected_length}, the length of its model_input")
    if not np.isfinite(array).all():
        raise errors.DatumShapeError(f"{where} holds NaN or infinite values; expected finite numbers")
    if key == "target_tokens":
        if (array != array.round()).any():
            raise errors.DatumShapeError(f"{where} holds non-integer values; expected token ids")
        check_tokens(array.astype("int64").tolist(), vocab_size, where)


def check_sample_request(prompt: Sequence[int], num_samples: int, params: SamplingParams,
                         vocab_size: int, max_positions: int) -> None:
    params.validate()
    if not isinstance(num_samples, int) or num_samples < 1:
        raise errors.InvalidInput(f"num_samples={num_samples!r}; expected an integer >= 1")
    check_sequence(prompt, vocab_size, max_positions, "sample prompt")
    if len(prompt) + params.max_tokens > max_positions:
        raise errors.InvalidInput(
            f"prompt of {len(prompt)} tokens + max_tokens={params.max_tokens} = "
            f"{len(prompt) + params.max_tokens} positions; expected at most the model's {max_positions}")


# ---------------------------------------------------------------------------- losses

def loss_spec(name: Any) -> LossSpec:
    if not isinstance(name, str) or name not in BUILTIN_LOSSES:
        raise errors.UnknownLossFunction(
            f"unknown loss_fn {name!r}; expected one of {sorted(BUILTIN_LOSSES)} or a callable "
            "fn(datums, logprobs) -> (loss, metrics)")
    return BUILTIN_LOSSES[name]


def resolve_config(spec: LossSpec, loss_fn_config: Mapping[str, float] | None) -> dict[str, float]:
    """The loss's config defaults overridden by `loss_fn_config`; unknown keys are an error."""
    given = dict(loss_fn_config or {})
    unknown = sorted(set(given) - set(spec.config_defaults))
    if unknown:
        raise errors.InvalidInput(
            f"loss_fn_config for {spec.name!r} has unknown keys {unknown}; "
            f"expected a subset of {sorted(spec.config_defaults) or '(none)'}")
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise errors.InvalidInput(f"loss_fn_config[{key!r}]={value!r}; expected a finite number")
    config = {**spec.config_defaults, **{k: float(v) for k, v in given.items()}}
    if "clip_low_threshold" in config and not 0 <= config["clip_low_threshold"] <= config["clip_high_threshold"]:
        raise errors.InvalidInput(
            f"{spec.name} clip thresholds low={config['clip_low_threshold']}, "
            f"high={config['clip_high_threshold']}; expected 0 <= low <= high")
    return config


def check_required_inputs(spec: LossSpec, datums: Sequence[Datum]) -> None:
    for index, datum in enumerate(datums):
        missing = [key for key in spec.required if key not in datum.loss_fn_inputs]
        if missing:
            raise errors.DatumShapeError(
                f"datum {index}: loss {spec.name!r} needs loss_fn_inputs {list(spec.required)}, "
                f"missing {missing} (given {sorted(datum.loss_fn_inputs)})")


def check_loss(loss_fn: Any, loss_fn_config: Mapping[str, float] | None,
               datums: Sequence[Datum]) -> tuple[LossSpec, dict[str, float]] | None:
    """A built-in loss's spec and resolved config once every datum carries what it needs; None
    for a custom callable (which takes no config and reads every datum's `target_tokens`)."""
    if not callable(loss_fn):
        spec = loss_spec(loss_fn)
        config = resolve_config(spec, loss_fn_config)
        check_required_inputs(spec, datums)
        return spec, config
    if loss_fn_config:
        raise errors.InvalidInput(
            f"loss_fn_config={loss_fn_config!r} given with a custom loss; expected none "
            "(a custom loss carries its own settings)")
    for index, datum in enumerate(datums):
        if "target_tokens" not in datum.loss_fn_inputs:
            raise errors.DatumShapeError(
                f"datum {index}: a custom loss needs loss_fn_inputs['target_tokens'] "
                f"(given {sorted(datum.loss_fn_inputs)})")
    return None
