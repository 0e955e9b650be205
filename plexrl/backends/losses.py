"""Built-in losses for `forward_backward`, with Tinker's semantics.

Every built-in loss is a per-token function of one model output, summed (never averaged) over
the tokens of every datum: the caller decides normalisation through `weights` / `advantages`.
With `lp` the log-probs of `target_tokens` under the model and `ratio = exp(lp - logprobs)`
(`logprobs` being the sampler's):

| name                  | per-token loss                                              | reads    |
| --------------------- | ----------------------------------------------------------- | -------- |
| `cross_entropy`       | `-lp * weights`                                             | logprobs |
| `importance_sampling` | `-ratio * advantages`                                       | logprobs |
| `ppo`                 | `-min(ratio * adv, clip(ratio, low, high) * adv)`           | logprobs |
| `cispo`               | `-stopgrad(clip(ratio, low, high)) * lp * adv`              | logprobs |
| `value_mse`           | `0.5 * weights * (v - target_values)**2`                    | values   |

Clip thresholds come from `loss_fn_config` (`clip_low_threshold`, `clip_high_threshold`):
PPO defaults to 0.8 / 1.2 (Tinker's fixed epsilon of 0.2). CISPO defaults to 0.0 / 4.0, Tinker's
documented default: a one-sided clip that only caps large ratios, because CISPO never zeroes a
token's gradient and a lower bound would only inflate the coefficient of unlikely tokens
(the MiniMax-M1 paper likewise imposes no lower bound and tunes only the upper one).

A critic is an ordinary causal LM: its value at position t is `logits[t, VALUE_TOKEN_ID]`.

Invariants: padded positions (`mask` False) contribute exactly 0 to the loss and its gradient;
a loss reads only the inputs it declares; nothing here touches model parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Literal, Mapping, Sequence

import numpy as np
import torch

from plexrl import errors
from plexrl.types import Datum

VALUE_TOKEN_ID = 0  # the critic's value head is the logit of token 0 (`<pad>` in tiny models)

TokenLoss = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], torch.Tensor]


@dataclass(frozen=True)
class BuiltinLoss:
    name: str
    reads: Literal["logprobs", "values"]  # the model output the loss is a function of
    per_token: TokenLoss  # (model output (B, T), padded inputs, config) -> per-token loss (B, T)
    required: tuple[str, ...]  # loss_fn_inputs every datum must carry
    optional: Mapping[str, float] = field(default_factory=dict)  # inputs that default to a constant
    config_defaults: Mapping[str, float] = field(default_factory=dict)


def _thresholds(config: Mapping[str, float]) -> tuple[float, float]:
    return config["clip_low_threshold"], config["clip_high_threshold"]


def _ratio(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(lp - inputs["logprobs"])


def cross_entropy(lp, inputs, config):
    return -lp * inputs["weights"]


def importance_sampling(lp, inputs, config):
    return -_ratio(lp, inputs) * inputs["advantages"]


def ppo(lp, inputs, config):
    ratio, advantages = _ratio(lp, inputs), inputs["advantages"]
    clipped = ratio.clamp(*_thresholds(config))
    return -torch.minimum(ratio * advantages, clipped * advantages)


def cispo(lp, inputs, config):
    coefficient = _ratio(lp, inputs).clamp(*_thresholds(config)).detach()
    return -coefficient * lp * inputs["advantages"]


def value_mse(values, inputs, config):
    return 0.5 * inputs["weights"] * (values - inputs["target_values"]) ** 2


_POLICY_INPUTS = ("target_tokens", "logprobs", "advantages")

BUILTIN_LOSSES: dict[str, BuiltinLoss] = {
    loss.name: loss
    for loss in (
        BuiltinLoss("cross_entropy", "logprobs", cross_entropy, ("target_tokens",), {"weights": 1.0}),
        BuiltinLoss("importance_sampling", "logprobs", importance_sampling, _POLICY_INPUTS),
        BuiltinLoss("ppo", "logprobs", ppo, _POLICY_INPUTS,
                    config_defaults={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
        BuiltinLoss("cispo", "logprobs", cispo, _POLICY_INPUTS,
                    config_defaults={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
        BuiltinLoss("value_mse", "values", value_mse, ("target_values",), {"weights": 1.0}),
    )
}


def get_loss(name: str) -> BuiltinLoss:
    if name not in BUILTIN_LOSSES:
        raise errors.UnknownLossFunction(
            f"unknown loss_fn {name!r}; expected one of {sorted(BUILTIN_LOSSES)} or a callable "
            "fn(datums, logprobs) -> (loss, metrics)")
    return BUILTIN_LOSSES[name]


def resolve_config(loss: BuiltinLoss, loss_fn_config: Mapping[str, float] | None) -> dict[str, float]:
    """The loss's config defaults overridden by `loss_fn_config`; unknown keys are an error."""
    given = dict(loss_fn_config or {})
    unknown = sorted(set(given) - set(loss.config_defaults))
    if unknown:
        raise errors.InvalidInput(
            f"loss_fn_config for {loss.name!r} has unknown keys {unknown}; "
            f"expected a subset of {sorted(loss.config_defaults) or '(none)'}")
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise errors.InvalidInput(f"loss_fn_config[{key!r}]={value!r}; expected a finite number")
    config = {**loss.config_defaults, **{k: float(v) for k, v in given.items()}}
    if "clip_low_threshold" in config and not 0 <= config["clip_low_threshold"] <= config["clip_high_threshold"]:
        raise errors.InvalidInput(
            f"{loss.name} clip thresholds low={config['clip_low_threshold']}, "
            f"high={config['clip_high_threshold']}; expected 0 <= low <= high")
    return config


def check_required_inputs(loss: BuiltinLoss, datums: Sequence[Datum]) -> None:
    for index, datum in enumerate(datums):
        missing = [key for key in loss.required if key not in datum.loss_fn_inputs]
        if missing:
            raise errors.DatumShapeError(
                f"datum {index}: loss {loss.name!r} needs loss_fn_inputs {list(loss.required)}, "
                f"missing {missing} (given {sorted(datum.loss_fn_inputs)})")


def padded_inputs(loss: BuiltinLoss, datums: Sequence[Datum], width: int,
                  device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Each float input the loss reads as a (len(datums), width) tensor, zero past each datum.

    Optional inputs a datum leaves out take the loss's default over that datum's length.
    """
    keys = [k for k in loss.required if k != "target_tokens"] + list(loss.optional)
    padded = {key: np.zeros((len(datums), width), dtype=np.float32) for key in keys}
    for row, datum in enumerate(datums):
        length = datum.model_input.length
        for key in keys:
            given = datum.loss_fn_inputs.get(key)
            padded[key][row, :length] = loss.optional[key] if given is None else given.to_numpy()
    return {key: torch.from_numpy(array).to(device) for key, array in padded.items()}


def loss_sum(loss: BuiltinLoss, model_output: torch.Tensor, inputs: Mapping[str, torch.Tensor],
             mask: torch.Tensor, config: Mapping[str, float]) -> torch.Tensor:
    """Sum over real (mask True) positions of the loss's per-token value; pads give exactly 0."""
    per_token = loss.per_token(model_output, inputs, config)
    return torch.where(mask, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device)).sum()
