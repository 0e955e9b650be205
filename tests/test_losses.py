"""Built-in losses against plain per-token Python references: values, gradients, padding, errors."""

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from plexrl import errors
from plexrl.api import validation
from plexrl.backends import losses
from plexrl.types import Datum, ModelInput


# ---------------------------------------------------------------- plain references, one token at a time

def clip(x, low, high):
    return min(max(x, low), high)


def reference_loss(name, out, inputs, config):
    """Sum over tokens of the per-token loss, written as a loop with the math module."""
    total = 0.0
    for t, o in enumerate(out):
        adv = inputs.get("advantages", [0.0] * len(out))[t]
        ratio = math.exp(o - inputs["logprobs"][t]) if "logprobs" in inputs else None
        weight = inputs.get("weights", [1.0] * len(out))[t]
        if name == "cross_entropy":
            total += -o * weight
        elif name == "importance_sampling":
            total += -ratio * adv
        elif name == "ppo":
            total += -min(ratio * adv, clip(ratio, config["low"], config["high"]) * adv)
        elif name == "cispo":
            total += -clip(ratio, config["low"], config["high"]) * o * adv
        elif name == "dro":
            total += -(o * adv - 0.5 * config["beta"] * (o - inputs["logprobs"][t]) ** 2)
        elif name == "value_mse":
            total += 0.5 * weight * (o - inputs["target_values"][t]) ** 2
    return total


def reference_gradient(name, out, inputs, config):
    """d loss / d (model output at t), derived by hand per token."""
    grads = []
    for t, o in enumerate(out):
        adv = inputs.get("advantages", [0.0] * len(out))[t]
        ratio = math.exp(o - inputs["logprobs"][t]) if "logprobs" in inputs else None
        weight = inputs.get("weights", [1.0] * len(out))[t]
        if name == "cross_entropy":
            grads.append(-weight)
        elif name == "importance_sampling":
            grads.append(-ratio * adv)
        elif name == "ppo":
            # the clipped branch is the min (and has zero gradient) only outside the trust region,
            # whose bounds the backend holds in float32 (a bound of 0.9999999999999999 is 1.0 there:
            # a ratio of exactly 1 is on it, inside, not past it)
            low, high = float(np.float32(config["low"])), float(np.float32(config["high"]))
            clipped = (adv > 0 and ratio > high) or (adv < 0 and ratio < low)
            grads.append(0.0 if clipped else -ratio * adv)
        elif name == "cispo":
            grads.append(-clip(ratio, config["low"], config["high"]) * adv)
        elif name == "dro":
            grads.append(-adv + config["beta"] * (o - inputs["logprobs"][t]))
        elif name == "value_mse":
            grads.append(weight * (o - inputs["target_values"][t]))
    return grads


def evaluate(name, out, inputs, loss_fn_config=None, pad_to=None):
    """loss_sum and the gradient w.r.t. the model output, on one datum padded to `pad_to`."""
    loss = validation.loss_spec(name)
    config = validation.resolve_config(loss, loss_fn_config)
    length = len(out)
    width = pad_to or length
    datum = Datum(ModelInput.from_ints([0] * length),
                  {k: np.asarray(v, dtype=np.float32) for k, v in inputs.items()})
    padded = losses.padded_inputs(loss, [datum], width)
    model_output = torch.zeros(1, width)
    model_output[0, :length] = torch.tensor(out)
    model_output[0, length:] = -3.0  # garbage at pads must not leak into loss or gradient
    model_output.requires_grad_(True)
    mask = torch.arange(width)[None] < length
    total = losses.loss_sum(loss, model_output, padded, mask, config)
    total.backward()
    return total.item(), model_output.grad[0]


def thresholds(name, loss_fn_config):
    config = validation.resolve_config(validation.loss_spec(name), loss_fn_config)
    return {"low": config.get("clip_low_threshold"), "high": config.get("clip_high_threshold"),
            "beta": config.get("beta")}


LP = [-0.5, -1.2, -2.0, -0.1]
SAMPLER_LP = [-0.6, -0.7, -2.5, -0.1]  # ratios: 1.105, 0.607, 1.649, 1.0
CASES = {
    "ce unit weights": ("cross_entropy", LP, {}, None),
    "ce masked weights": ("cross_entropy", LP, {"weights": [1.0, 0.0, 0.5, 2.0]}, None),
    # forward_backward_custom sends the custom loss's gradient as weights: any sign, any size
    "ce negative weights": ("cross_entropy", LP, {"weights": [-1.5, 0.25, -3.0, 7.0]}, None),
    "is mixed advantages": ("importance_sampling", LP, {"logprobs": SAMPLER_LP, "advantages": [1.0, -1.0, 2.0, 0.0]}, None),
    "ppo default clip": ("ppo", LP, {"logprobs": SAMPLER_LP, "advantages": [1.0, -1.0, 2.0, -0.5]}, None),
    "ppo all positive adv": ("ppo", LP, {"logprobs": SAMPLER_LP, "advantages": [1.0, 1.0, 1.0, 1.0]}, None),
    "ppo all negative adv": ("ppo", LP, {"logprobs": SAMPLER_LP, "advantages": [-1.0, -1.0, -1.0, -1.0]}, None),
    "ppo tight clip": ("ppo", LP, {"logprobs": SAMPLER_LP, "advantages": [1.0, -1.0, 2.0, -0.5]},
                       {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}),
    "cispo default clip": ("cispo", LP, {"logprobs": SAMPLER_LP, "advantages": [1.0, -1.0, 2.0, -0.5]}, None),
    "cispo two-sided clip": ("cispo", LP, {"logprobs": SAMPLER_LP, "advantages": [1.0, -1.0, 2.0, -0.5]},
                             {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "dro default beta": ("dro", LP, {"logprobs": SAMPLER_LP, "advantages": [1.0, -1.0, 2.0, -0.5]}, None),
    "dro strong beta": ("dro", LP, {"logprobs": SAMPLER_LP, "advantages": [1.0, -1.0, 2.0, -0.5]}, {"beta": 2.0}),
    "value mse": ("value_mse", [0.3, -1.0, 2.0, 0.0], {"target_values": [0.0, -1.0, 1.0, 1.0]}, None),
    "value mse weighted": ("value_mse", [0.3, -1.0, 2.0, 0.0],
                           {"target_values": [0.0, -1.0, 1.0, 1.0], "weights": [1.0, 1.0, 0.0, 3.0]}, None),
}


@pytest.mark.parametrize("name, out, inputs, config", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("pad_to", [None, 7], ids=["unpadded", "padded"])
def test_loss_and_gradient_match_reference(name, out, inputs, config, pad_to):
    total, grad = evaluate(name, out, inputs, config, pad_to)
    clip_config = thresholds(name, config)
    assert total == pytest.approx(reference_loss(name, out, inputs, clip_config), rel=1e-5, abs=1e-6)
    assert grad[: len(out)].tolist() == pytest.approx(reference_gradient(name, out, inputs, clip_config), rel=1e-5, abs=1e-6)
    assert torch.all(grad[len(out):] == 0), "padded positions must get exactly zero gradient"


GRADIENT_DIRECTIONS = {
    # (loss, ratio, advantage): expected sign of d loss / d lp; 0 where the clip stops the update
    "ppo ratio above high, positive adv: clipped": ("ppo", 1.5, 1.0, 0),
    "ppo ratio above high, negative adv: pushed down": ("ppo", 1.5, -1.0, +1),
    "ppo ratio below low, negative adv: clipped": ("ppo", 0.5, -1.0, 0),
    "ppo ratio below low, positive adv: pushed up": ("ppo", 0.5, 1.0, -1),
    "ppo ratio inside, positive adv: pushed up": ("ppo", 1.0, 1.0, -1),
    "cispo ratio far above high still updates": ("cispo", 10.0, 1.0, -1),
    "cispo negative adv pushes down": ("cispo", 0.5, -1.0, +1),
}


@pytest.mark.parametrize("name, ratio, advantage, sign", GRADIENT_DIRECTIONS.values(), ids=GRADIENT_DIRECTIONS.keys())
def test_gradient_direction_of_clipped_losses(name, ratio, advantage, sign):
    lp = -1.0
    _, grad = evaluate(name, [lp], {"logprobs": [lp - math.log(ratio)], "advantages": [advantage]})
    assert int(np.sign(grad[0].item())) == sign


def test_cispo_coefficient_is_capped_at_high_threshold():
    lp, ratio = -1.0, 10.0
    _, grad = evaluate("cispo", [lp], {"logprobs": [lp - math.log(ratio)], "advantages": [1.0]})
    assert grad[0].item() == pytest.approx(-4.0), "default clip_high_threshold is 4.0 (Tinker's)"


def test_dro_on_a_hand_computed_example():
    # token 0: lp -1, sampler -2, adv 2:  -(-1 * 2 - 0.5 * 0.5 * 1**2)   = 2.25;   grad -2 + 0.5 * 1    = -1.5
    # token 1: lp -3, sampler -1, adv -1: -(-3 * -1 - 0.5 * 0.5 * (-2)**2) = -2.0; grad  1 + 0.5 * (-2) =  0.0
    total, grad = evaluate("dro", [-1.0, -3.0], {"logprobs": [-2.0, -1.0], "advantages": [2.0, -1.0]},
                           {"beta": 0.5}, pad_to=4)
    assert total == pytest.approx(0.25)
    assert grad.tolist() == pytest.approx([-1.5, 0.0, 0.0, 0.0])


DRO_DIRECTIONS = {
    # (lp - sampler lp, advantage, beta): expected sign of d loss / d lp (descent moves lp the other way)
    "on the sampler, positive adv: pushed up": (0.0, 1.0, 0.5, -1),
    "on the sampler, negative adv: pushed down": (0.0, -1.0, 0.5, +1),
    "zero adv, above the sampler: pulled back down": (0.5, 0.0, 0.5, +1),
    "zero adv, below the sampler: pulled back up": (-0.5, 0.0, 0.5, -1),
    "penalty outweighs a positive adv far above the sampler": (4.0, 1.0, 0.5, +1),
    "beta 0 is plain policy gradient however far": (4.0, 1.0, 0.0, -1),
}


@pytest.mark.parametrize("log_ratio, advantage, beta, sign", DRO_DIRECTIONS.values(), ids=DRO_DIRECTIONS.keys())
def test_dro_gradient_direction(log_ratio, advantage, beta, sign):
    lp = -1.0
    _, grad = evaluate("dro", [lp], {"logprobs": [lp - log_ratio], "advantages": [advantage]}, {"beta": beta})
    assert int(np.sign(grad[0].item())) == sign


finite = st.floats(-3.0, 3.0, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["importance_sampling", "ppo", "cispo", "dro"]),
       rows=st.lists(st.tuples(finite, finite, finite), min_size=1, max_size=12),
       low=st.floats(0.0, 1.0), spread=st.floats(0.0, 1.0))
@example(name="ppo", rows=[(0.0, 0.0, 1.0)], low=0.0, spread=0.9999999999999999)  # a bound that is 1.0 in float32
def test_policy_losses_match_reference_on_random_tokens(name, rows, low, spread):
    out, sampler, adv = (list(col) for col in zip(*rows))
    inputs = {"logprobs": sampler, "advantages": adv}
    config = {"importance_sampling": None, "dro": {"beta": spread}}.get(
        name, {"clip_low_threshold": low, "clip_high_threshold": low + spread})
    total, grad = evaluate(name, out, inputs, config, pad_to=len(out) + 2)
    clip_config = {"low": low, "high": low + spread, "beta": spread}
    assert total == pytest.approx(reference_loss(name, out, inputs, clip_config), rel=1e-4, abs=1e-4)
    assert grad[: len(out)].tolist() == pytest.approx(reference_gradient(name, out, inputs, clip_config), rel=1e-4, abs=1e-4)


# ---------------------------------------------------------------- configuration and input errors

def test_unknown_loss_names_it_and_lists_known_ones():
    with pytest.raises(errors.UnknownLossFunction) as raised:
        validation.loss_spec("grpo")
    message = str(raised.value)
    assert "'grpo'" in message and all(name in message for name in validation.BUILTIN_LOSSES)


def test_every_loss_of_the_api_table_has_its_maths():
    assert set(losses.PER_TOKEN) == set(validation.BUILTIN_LOSSES)


def test_config_defaults():
    ppo = validation.resolve_config(validation.loss_spec("ppo"), None)
    cispo = validation.resolve_config(validation.loss_spec("cispo"), {})
    assert ppo == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert cispo == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert validation.resolve_config(validation.loss_spec("dro"), None) == {"beta": 0.01}


BAD_CONFIGS = {
    "unknown key": ("ppo", {"clip_epsilon": 0.2}, "unknown keys ['clip_epsilon']"),
    "key on a loss without config": ("cross_entropy", {"clip_low_threshold": 0.8}, "expected a subset of (none)"),
    "not a number": ("ppo", {"clip_low_threshold": "0.8"}, "expected a finite number"),
    "nan": ("cispo", {"clip_high_threshold": float("nan")}, "expected a finite number"),
    "low above high": ("ppo", {"clip_low_threshold": 1.5}, "expected 0 <= low <= high"),
    "negative low": ("cispo", {"clip_low_threshold": -0.1}, "expected 0 <= low <= high"),
    "negative beta": ("dro", {"beta": -0.1}, "beta=-0.1; expected a number >= 0"),
    "clip key on dro": ("dro", {"clip_low_threshold": 0.8}, "expected a subset of ['beta']"),
}


@pytest.mark.parametrize("name, config, fragment", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_bad_config_is_rejected_with_reason(name, config, fragment):
    with pytest.raises(errors.InvalidInput) as raised:
        validation.resolve_config(validation.loss_spec(name), config)
    assert fragment in str(raised.value)


def test_missing_required_input_names_datum_and_key():
    good = Datum(ModelInput.from_ints([1, 2]), {"target_tokens": [2, 3], "logprobs": [0.0, 0.0], "advantages": [1.0, 1.0]})
    bad = Datum(ModelInput.from_ints([1, 2]), {"target_tokens": [2, 3], "logprobs": [0.0, 0.0]})
    with pytest.raises(errors.DatumShapeError) as raised:
        validation.check_required_inputs(validation.loss_spec("ppo"), [good, bad])
    assert "datum 1" in str(raised.value) and "missing ['advantages']" in str(raised.value)


def test_padded_inputs_fill_defaults_and_zero_pads():
    datums = [Datum(ModelInput.from_ints([1, 2, 3]), {"target_tokens": [1, 1, 1], "weights": [0.5, 0.25, 2.0]}),
              Datum(ModelInput.from_ints([1]), {"target_tokens": [1]})]
    padded = losses.padded_inputs(validation.loss_spec("cross_entropy"), datums, width=4)
    assert padded["weights"].tolist() == [[0.5, 0.25, 2.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
