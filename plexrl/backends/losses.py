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
| `dro`                 | `-(lp * adv - 0.5 * beta * (lp - logprobs)**2)`             | logprobs |
| `value_mse`           | `0.5 * weights * (v - target_values)**2`                    | values   |

Clip thresholds come from `loss_fn_config` (`clip_low_threshold`, `clip_high_threshold`):
PPO defaults to 0.8 / 1.2 (Tinker's fixed epsilon of 0.2). CISPO defaults to 0.0 / 4.0, Tinker's
documented default: a one-sided clip that only caps large ratios, because CISPO never zeroes a
token's gradient and a lower bound would only inflate the coefficient of unlikely tokens
(the MiniMax-M1 paper likewise imposes no lower bound and tunes only the upper one).

DRO (Richemond et al. 2024; Kimi k1.5) is Tinker's `dro` exactly as its loss docs write it
(tinker-docs.thinkingmachines.ai/tinker/losses/dro): a policy-gradient term plus a quadratic
penalty on the log-ratio to the sampler, `beta` from `loss_fn_config` (>= 0). Its gradient in
lp is `-adv + beta * (lp - logprobs)`: the advantage pushes, the penalty pulls back towards the
sampler in proportion to how far lp has moved. Tinker documents no default beta; ours is 0.01.

Which inputs each loss requires and which config keys it takes, with their defaults, is the pure
table `BUILTIN_LOSSES` of plexrl/api/validation.py (the job side checks calls against it); this
file holds only the maths, `PER_TOKEN`, one function per name of that table.

A critic is an ordinary causal LM: its value at position t is `logits[t, VALUE_TOKEN_ID]`.

Invariants: padded positions (`mask` False) contribute exactly 0 to the loss and its gradient;
a loss reads only the inputs it declares; nothing here touches model parameters.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from plexrl.api.validation import LossSpec
from plexrl.types import Datum

VALUE_TOKEN_ID = 0  # the critic's value head is the logit of token 0 (`<pad>` in tiny models)

TokenLoss = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], torch.Tensor]


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


def dro(lp, inputs, config):
    log_ratio = lp - inputs["logprobs"]
    return -(lp * inputs["advantages"] - 0.5 * config["beta"] * log_ratio ** 2)


def value_mse(values, inputs, config):
    return 0.5 * inputs["weights"] * (values - inputs["target_values"]) ** 2


# (model output (B, T), padded inputs, config) -> per-token loss (B, T)
PER_TOKEN: dict[str, TokenLoss] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "value_mse": value_mse,
}


def padded_inputs(loss: LossSpec, datums: Sequence[Datum], width: int,
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


def loss_sum(loss: LossSpec, model_output: torch.Tensor, inputs: Mapping[str, torch.Tensor],
             mask: torch.Tensor, config: Mapping[str, float]) -> torch.Tensor:
    """Sum over real (mask True) positions of the loss's per-token value; pads give exactly 0."""
    per_token = PER_TOKEN[loss.name](model_output, inputs, config)
    return torch.where(mask, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device)).sum()
