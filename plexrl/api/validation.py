"""The job side's input checks, and the table of built-in losses they check against.

A bad call fails here, in the caller's process, before any engine sees it; the backend runs the
same checks (one definition) so a direct call on a model fails the same way. Every message names
the parameter, its value and what was expected. Types are checked here too, never assumed: every
problem with a call's arguments is an `errors.InvalidInput` (a subclass where one fits), never a
TypeError or AttributeError from deeper down; a bool is not a number, numpy scalars are.

`BUILTIN_LOSSES` says what each built-in loss needs and accepts: the model output it reads,
the `loss_fn_inputs` every datum must carry, those that default to a constant, and its config
keys with their defaults. Their per-token maths is in plexrl/backends/losses.py.

Standard library and numpy only (tests/test_api_pure.py imports this with torch, ray and
transformers unimportable).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import numpy as np

from plexrl.api import errors
from plexrl.api.types import (ATTENTION_MODULES, MLP_MODULES, UNEMBED_MODULES, AdamParams, Datum, LoraConfig,
                              ModelInput, SamplingParams, TensorData, all_ints, is_finite_number, is_integer, shown)


@dataclass(frozen=True)
class LossSpec:
    name: str
    reads: Literal["logprobs", "values"]  # the model output the loss is a function of
    required: tuple[str, ...]  # loss_fn_inputs every datum must carry
    optional: Mapping[str, float] = field(default_factory=dict)  # inputs that default to a constant
    config_defaults: Mapping[str, float] = field(default_factory=dict)


_POLICY_INPUTS = ("target_tokens", "logprobs", "advantages")
# Tinker documents dro's `beta` (loss_fn_config={"beta": 0.05} in its example) but not its default.
DRO_BETA = 0.01

BUILTIN_LOSSES: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        LossSpec("cross_entropy", "logprobs", ("target_tokens",), {"weights": 1.0}),
        LossSpec("importance_sampling", "logprobs", _POLICY_INPUTS),
        LossSpec("ppo", "logprobs", _POLICY_INPUTS,
                 config_defaults={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
        LossSpec("cispo", "logprobs", _POLICY_INPUTS,
                 config_defaults={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
        LossSpec("dro", "logprobs", _POLICY_INPUTS, config_defaults={"beta": DRO_BETA}),
        LossSpec("value_mse", "values", ("target_values",), {"weights": 1.0}),
    )
}


# ---------------------------------------------------------------------------- call arguments

def check_bool(value: Any, what: str) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise errors.InvalidInput(f"{what}={shown(value)}; expected True or False")


SAMPLERS = ("hf", "vllm")  # what runs a model's sample and compute_logprobs (plexrl/samplers/)


def check_sampler(sampler: Any) -> str:
    """`sampler` if it names a sampler, else InvalidInput naming the choices."""
    if not isinstance(sampler, str) or sampler not in SAMPLERS:
        raise errors.InvalidInput(f"sampler={shown(sampler)}; expected one of {list(SAMPLERS)}")
    return sampler


def check_count(value: Any, what: str) -> None:
    """An integer >= 1 (a bool is not)."""
    if not is_integer(value) or value < 1:
        raise errors.InvalidInput(f"{what}={shown(value)}; expected an integer >= 1")


def check_seed(seed: Any) -> None:
    if not is_integer(seed):
        raise errors.InvalidInput(f"seed={shown(seed)}; expected an integer")


def input_tokens(model_input: Any, what: str, error: type[errors.InvalidInput] = errors.InvalidInput) -> list[int]:
    """The token ids of a ModelInput (their values are checked by check_tokens)."""
    if not isinstance(model_input, ModelInput):
        raise error(f"{what}={shown(model_input)}; expected a ModelInput (ModelInput.from_ints(token_ids))")
    try:
        return model_input.to_ints()
    except (TypeError, AttributeError):
        raise error(f"{what}: chunks={shown(model_input.chunks)}; expected a tuple of EncodedTextChunk "
                    "holding token ids") from None


def sampling_params(params: Any) -> SamplingParams:
    return _checked_params(params, SamplingParams, "sampling_params", "a SamplingParams", errors.InvalidSamplingParams)


def adam_params(params: Any) -> AdamParams:
    return _checked_params(params, AdamParams, "adam_params", "an AdamParams", errors.InvalidAdamParams)


def _checked_params(params: Any, kind: type, what: str, expected: str, error: type[errors.InvalidInput]):
    """`params` (None: the defaults) validated, as a copy with plain Python numbers."""
    if params is None:
        return kind()
    if not isinstance(params, kind):
        raise error(f"{what}={shown(params)}; expected {expected} or None")
    params.validate()
    return params.plain()


def datum_list(data: Any) -> list:
    """`data` as a list (its items are checked by validate_datums)."""
    if isinstance(data, (Datum, str, bytes, Mapping)) or not hasattr(data, "__iter__"):
        raise errors.DatumShapeError(f"data={shown(data)}; expected a list of Datum")
    return list(data)


PLAIN_NAME_BYTES = 200  # a name is one path component (255 bytes on most filesystems) with room for a prefix


def check_plain_name(name: Any, what: str) -> None:
    """A name that is one path component: a non-empty str of valid Unicode, at most
    PLAIN_NAME_BYTES as UTF-8, no '/', no control character (NUL included), not '.' or '..'."""
    ok = isinstance(name, str) and bool(name) and "/" not in name and name not in (".", "..")
    if ok:
        try:
            ok = len(name.encode("utf-8")) <= PLAIN_NAME_BYTES and not any(
                ord(c) < 32 or ord(c) == 127 for c in name)
        except UnicodeEncodeError:  # a lone surrogate
            ok = False
    if not ok:
        raise errors.InvalidInput(f"{what} {shown(name)}; expected a plain non-empty name (valid Unicode text of at "
                                  f"most {PLAIN_NAME_BYTES} bytes as UTF-8, without '/' or control characters, not "
                                  "'.' or '..')")


def check_checkpoint_name(name: Any) -> None:
    """save_state's name: the rule of the front's `checkpoint_path`, checked before it is asked."""
    check_plain_name(name, "checkpoint name")


def lora_adapter(folder: Any) -> tuple[str, LoraConfig] | None:
    """(base model, LoraConfig) of a LoRA adapter folder (peft's `adapter_config.json`, as a LoRA
    model's save_state writes it), or None when `folder` is not one. InvalidInput when the
    adapter is not one PlexRL makes (other target modules, no base named)."""
    import json

    config_file = Path(str(folder)) / "adapter_config.json"
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
        base, rank, alpha = config["base_model_name_or_path"], config["r"], config.get("lora_alpha")
        targets = set(config["target_modules"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise errors.InvalidInput(f"{str(config_file)!r} is not a peft LoRA config ({type(exc).__name__}: {exc}); "
                                  "expected the adapter_config.json a LoRA model's save_state writes") from None
    lora = LoraConfig(rank=rank, alpha=alpha, train_attn=bool(targets & set(ATTENTION_MODULES)),
                      train_mlp=bool(targets & set(MLP_MODULES)), train_unembed=bool(targets & set(UNEMBED_MODULES)))
    if not isinstance(base, str) or not base or set(lora.target_modules) != targets:
        raise errors.InvalidInput(f"{str(config_file)!r} adapts {sorted(targets)} over {shown(base)}; expected an "
                                  "adapter over a named base whose targets are attention, MLP or lm_head layers")
    lora.validate()
    return base, lora.plain()


def checkpoint_folder(path: Any) -> Path:
    if isinstance(path, str) and path or isinstance(path, os.PathLike):
        return Path(path)
    raise errors.InvalidInput(f"checkpoint path={shown(path)}; expected a str or Path of a save_state folder")


# ---------------------------------------------------------------------------- tokens and datums

def check_tokens(tokens: Sequence[int], vocab_size: int, what: str) -> None:
    if not all_ints(tokens):
        for position, token in enumerate(tokens):
            if not is_integer(token):
                raise errors.InvalidInput(f"{what}: token {shown(token)} at position {position} is not an integer; "
                                          "expected token ids")
    if len(tokens) and not (0 <= min(tokens) and max(tokens) < vocab_size):
        bad = [(i, t) for i, t in enumerate(tokens) if not 0 <= t < vocab_size]
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
    """Every datum: a Datum whose model_input is a ModelInput of 1..max_positions tokens in the
    vocabulary, and whose every loss_fn_input is a flat finite array of the model_input's length
    (Tinker: `target_tokens[t]` follows position t)."""
    if not datums:
        raise errors.DatumShapeError("forward_backward got no datums; expected at least one Datum")
    for index, datum in enumerate(datums):
        if not isinstance(datum, Datum):
            raise errors.DatumShapeError(f"data[{index}]={shown(datum)}; expected a Datum")
        tokens = input_tokens(datum.model_input, f"datum {index}: model_input", errors.DatumShapeError)
        check_sequence(tokens, vocab_size, max_positions, f"datum {index}: model_input")
        if not isinstance(datum.loss_fn_inputs, Mapping):
            raise errors.DatumShapeError(f"datum {index}: loss_fn_inputs={shown(datum.loss_fn_inputs)}; "
                                         "expected a dict of name -> array")
        for key, value in datum.loss_fn_inputs.items():
            if not isinstance(key, str):
                raise errors.DatumShapeError(f"datum {index}: loss_fn_inputs key {shown(key)}; "
                                             "expected a str such as 'target_tokens'")
            check_datum_input(index, key, value, len(tokens), vocab_size)


def check_datum_input(index: int, key: str, value: Any, expected_length: int, vocab_size: int) -> None:
    where = f"datum {index}: loss_fn_inputs[{key!r}]"
    array = datum_input_array(where, value)
    if array.ndim != 1 or array.shape[0] != expected_length:
        raise errors.DatumShapeError(
            f"{where} has shape {tuple(array.shape)} (length {array.shape[0] if array.ndim else 0}); "
            f"expected a flat array of length {expected_length}, the length of its model_input")
    if not np.isfinite(array).all():
        raise errors.DatumShapeError(f"{where} holds NaN or infinite values; expected finite numbers")
    if key == "target_tokens":
        if (array != array.round()).any():
            raise errors.DatumShapeError(f"{where} holds non-integer values; expected token ids")
        ids = array.astype("int64")
        if ids.size and not (0 <= ids.min() and ids.max() < vocab_size):  # the message names the first
            check_tokens(ids.tolist(), vocab_size, where)


def datum_input_array(where: str, value: Any) -> np.ndarray:
    """A loss_fn_input as the array the backend will read; DatumShapeError if it is not numbers
    (Datum keeps what it could not convert, and a TensorData can be built by hand)."""
    expected = "expected numbers: a list, numpy array or TensorData"
    if not isinstance(value, TensorData):
        raise errors.DatumShapeError(f"{where}={shown(value)}; {expected}")
    try:
        raw = np.asarray(value.data)
    except (TypeError, ValueError):  # ragged
        raw = np.empty(0, dtype=object)
    if value.dtype not in ("float32", "int64") or raw.dtype.kind not in "biuf":
        raise errors.DatumShapeError(f"{where}={shown(value)}; {expected} ('float32' or 'int64')")
    if value.dtype == "int64" and raw.dtype.kind == "f" and not (np.isfinite(raw) & (raw == raw.round())).all():
        raise errors.DatumShapeError(f"{where} has dtype 'int64' but holds non-integer values")
    try:
        return value.to_numpy()
    except (TypeError, ValueError):
        raise errors.DatumShapeError(f"{where}: {raw.size} values do not fit shape {shown(value.shape)}") from None


def check_sample_request(prompt: Sequence[int], num_samples: int, params: SamplingParams,
                         vocab_size: int, max_positions: int) -> None:
    params.validate()
    check_count(num_samples, "num_samples")
    check_sequence(prompt, vocab_size, max_positions, "sample prompt")
    if len(prompt) + params.max_tokens > max_positions:
        raise errors.InvalidInput(
            f"prompt of {len(prompt)} tokens + max_tokens={params.max_tokens} = "
            f"{len(prompt) + params.max_tokens} positions; expected at most the model's {max_positions}")


# ---------------------------------------------------------------------------- losses

def loss_spec(name: Any) -> LossSpec:
    if not isinstance(name, str) or name not in BUILTIN_LOSSES:
        raise errors.UnknownLossFunction(
            f"unknown loss_fn {shown(name)}; expected one of {sorted(BUILTIN_LOSSES)} or a callable "
            "fn(datums, logprobs) -> (loss, metrics)")
    return BUILTIN_LOSSES[name]


def resolve_config(spec: LossSpec, loss_fn_config: Mapping[str, float] | None) -> dict[str, float]:
    """The loss's config defaults overridden by `loss_fn_config`; unknown keys are an error."""
    if loss_fn_config is not None and not isinstance(loss_fn_config, Mapping):
        raise errors.InvalidInput(f"loss_fn_config={shown(loss_fn_config)}; expected a dict such as "
                                  "{'clip_low_threshold': 0.8} or None")
    given = dict(loss_fn_config or {})
    for key in given:
        if not isinstance(key, str):
            raise errors.InvalidInput(f"loss_fn_config key {shown(key)}; expected a str, one of "
                                      f"{sorted(spec.config_defaults) or '(none)'}")
    unknown = sorted(set(given) - set(spec.config_defaults))
    if unknown:
        raise errors.InvalidInput(
            f"loss_fn_config for {spec.name!r} has unknown keys {unknown}; "
            f"expected a subset of {sorted(spec.config_defaults) or '(none)'}")
    for key, value in given.items():
        if not is_finite_number(value):
            raise errors.InvalidInput(f"loss_fn_config[{key!r}]={shown(value)}; expected a finite number")
    config = {**spec.config_defaults, **{k: float(v) for k, v in given.items()}}
    if "clip_low_threshold" in config and not 0 <= config["clip_low_threshold"] <= config["clip_high_threshold"]:
        raise errors.InvalidInput(
            f"{spec.name} clip thresholds low={config['clip_low_threshold']}, "
            f"high={config['clip_high_threshold']}; expected 0 <= low <= high")
    if config.get("beta", 0.0) < 0:
        raise errors.InvalidInput(f"{spec.name} beta={config['beta']}; expected a number >= 0 (a negative "
                                  "beta would reward moving away from the sampler without bound)")
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
    if loss_fn_config is not None and not (isinstance(loss_fn_config, Mapping) and not loss_fn_config):
        raise errors.InvalidInput(
            f"loss_fn_config={shown(loss_fn_config)} given with a custom loss; expected none "
            "(a custom loss carries its own settings)")
    for index, datum in enumerate(datums):
        if "target_tokens" not in datum.loss_fn_inputs:
            raise errors.DatumShapeError(
                f"datum {index}: a custom loss needs loss_fn_inputs['target_tokens'] "
                f"(given {sorted(datum.loss_fn_inputs)})")
    return None
