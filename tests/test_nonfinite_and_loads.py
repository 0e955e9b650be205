"""Poison is refused and a failed load changes nothing (issue 13, defects 6 and 7; docs/design.md §9.7).

Invariants checked, on the local and the process engine:
- a forward_backward or optim_step whose loss, gradients, optimizer parameters or result would
  be non-finite fails with an InvalidInput (NonFiniteUpdate from the runtime; the client may
  refuse non-finite AdamParams first), the weights are bitwise unchanged, and a good step
  afterwards ends bitwise equal to a run that never saw the bad call (so the gradients, the
  moments and the step count were left as they were too);
- a load of a torn checkpoint (truncated optimizer.safetensors or model.safetensors) fails with
  ModelLoadError and leaves the state as it was, checked the same way.
Then the runtime's own line of defence, without a cluster: checkpoint.adam_step refuses bad
AdamParams and non-finite gradients itself, and its backup path (a step no bound proves finite)
has the arithmetic of the ordinary one.
One cluster per engine for the module; the micro model keeps each call cheap.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import types
from pathlib import Path

import cloudpickle
import numpy as np
import pytest
import torch

import plexrl
from plexrl import errors
from tests.helpers import datum

MiB = 1 << 20
TIMEOUT_S = 120
IDS = [5, 6, 7, 8, 9]
N = len(IDS) - 1
GOOD = [datum(IDS)]
GOOD_STEP = plexrl.AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # a device process cannot import a test module


@pytest.fixture(scope="module", params=["local", "process"])
def cluster(request):
    from plexrl import engines

    with engines.engine_class(request.param)(devices=1, device_memory_bytes=8 * MiB,
                                             host_memory_bytes=96 * MiB) as c:
        yield c


def trainer_for(cluster, model_dir, job: str):
    return cluster.service_client(job=job).create_training_client(base_model=model_dir, seed=0)


def good_step(trainer, data=GOOD):
    trainer.forward_backward(data).result(TIMEOUT_S)
    return trainer.optim_step(GOOD_STEP).result(TIMEOUT_S)


def assert_bitwise(a: np.ndarray, b: np.ndarray, what: str) -> None:
    assert a.shape == b.shape and np.array_equal(a.view(np.int32), b.view(np.int32)), what


@pytest.fixture(scope="module")
def one_step(cluster, micro_model) -> np.ndarray:
    """Weights after one good forward_backward + optim_step: what every poisoned run must end at."""
    trainer = trainer_for(cluster, micro_model, "ref-one")
    assert good_step(trainer).metrics["step"] == 1.0
    return cluster.fetch_weights(trainer.state)


# ---------------------------------------------------------------------------- poison

def policy(logprobs, advantages, ids=IDS):
    n = len(ids) - 1
    return [datum(ids, logprobs=np.full(n, logprobs, np.float32), advantages=np.full(n, advantages, np.float32))]


def nan_loss(data, logprobs):
    return sum(lp.sum() for lp in logprobs) * float("nan"), {}


def inf_loss(data, logprobs):
    return -sum(lp.sum() for lp in logprobs) * float("inf"), {}


def sqrt_at_zero(data, logprobs):
    """A finite loss (0) whose gradient is not: d sqrt(x)/dx is inf at 0, times 0 is NaN."""
    return sum((lp * 0).sqrt().sum() for lp in logprobs), {}


# name -> (call on a trainer, which function it poisons, the errors accepted)
POISON = {
    "importance_sampling logprobs=-1e30": (
        lambda t: t.forward_backward(policy(-1e30, 1.0), "importance_sampling"), "fb", errors.NonFiniteUpdate),
    "ppo logprobs=-1e30 (finite loss, NaN gradient)": (
        lambda t: t.forward_backward(policy(-1e30, 1.0), "ppo"), "fb", errors.NonFiniteUpdate),
    "importance_sampling advantages=3e38": (
        lambda t: t.forward_backward(policy(-3.0, 3e38), "importance_sampling"), "fb", errors.NonFiniteUpdate),
    "ppo advantages=3e38": (
        lambda t: t.forward_backward(policy(-3.0, 3e38), "ppo"), "fb", errors.NonFiniteUpdate),
    "importance_sampling advantages=3e38 on one token (finite loss)": (
        lambda t: t.forward_backward(policy(-3.0, 3e38, ids=[5, 6]), "importance_sampling"), "fb",
        errors.NonFiniteUpdate),
    "cross_entropy weights=3e38": (
        lambda t: t.forward_backward([datum(IDS), datum(IDS, weights=np.full(N, 3e38, np.float32))]), "fb",
        errors.NonFiniteUpdate),
    "cross_entropy weights=1e37 on one token (finite gradients, norm overflows)": (
        lambda t: t.forward_backward([datum([5, 6], weights=[1e37])]), "fb", errors.NonFiniteUpdate),
    "custom loss returning nan": (lambda t: t.forward_backward_custom(GOOD, nan_loss), "fb", errors.NonFiniteUpdate),
    "custom loss returning inf": (lambda t: t.forward_backward_custom(GOOD, inf_loss), "fb", errors.NonFiniteUpdate),
    "custom loss with a NaN gradient": (
        lambda t: t.forward_backward_custom(GOOD, sqrt_at_zero), "fb", errors.NonFiniteUpdate),
    "learning_rate=inf": (
        lambda t: t.optim_step(plexrl.AdamParams(learning_rate=math.inf)), "step", errors.InvalidInput),
    "learning_rate=nan": (
        lambda t: t.optim_step(plexrl.AdamParams(learning_rate=math.nan)), "step", errors.InvalidInput),
    "weight_decay=inf": (
        lambda t: t.optim_step(plexrl.AdamParams(weight_decay=math.inf)), "step", errors.InvalidInput),
    "learning_rate=1e38 (finite, weights overflow)": (
        lambda t: t.optim_step(plexrl.AdamParams(learning_rate=1e38)), "step", errors.NonFiniteUpdate),
    "weight_decay=1e300 (finite, 1 - lr*wd overflows float32)": (
        lambda t: t.optim_step(plexrl.AdamParams(learning_rate=1e-2, weight_decay=1e300)), "step",
        errors.NonFiniteUpdate),
}
# A bad forward_backward arrives with the gradients still zero, or onto gradients already pending.
CASES = [(name, pending) for name, (_, fn, _) in POISON.items()
         for pending in ((False, True) if fn == "fb" else (True,))]


@pytest.mark.parametrize("name, pending", CASES, ids=[f"{n} [{'pending' if p else 'zero'} grads]" for n, p in CASES])
def test_poison_is_refused_and_changes_nothing(cluster, micro_model, one_step, name, pending):
    call, fn, expected = POISON[name]
    trainer = trainer_for(cluster, micro_model, f"poison-{CASES.index((name, pending))}")
    if pending:
        trainer.forward_backward(GOOD).result(TIMEOUT_S)
    before = cluster.fetch_weights(trainer.state)
    with pytest.raises(errors.InvalidInput) as info:
        call(trainer).result(TIMEOUT_S)
    assert isinstance(info.value, expected), f"{name}: {type(info.value).__name__}: {info.value}"
    if isinstance(info.value, errors.NonFiniteUpdate):
        assert str(info.value).startswith((f"{'forward_backward' if fn == 'fb' else 'optim_step'} refused: ",))
    assert_bitwise(cluster.fetch_weights(trainer.state), before, f"{name}: the weights changed")
    if not pending:
        trainer.forward_backward(GOOD).result(TIMEOUT_S)
    # Equal to a run without the bad call: gradients, moments and step count were left as they were.
    assert trainer.optim_step(GOOD_STEP).result(TIMEOUT_S).metrics["step"] == 1.0
    assert_bitwise(cluster.fetch_weights(trainer.state), one_step, f"{name}: the next good step differs")


def test_refusal_names_the_loss_and_the_extreme_input(cluster, micro_model):
    trainer = trainer_for(cluster, micro_model, "poison-message")
    with pytest.raises(errors.NonFiniteUpdate) as info:
        trainer.forward_backward(policy(-3.0, 1.0) + policy(-1e30, 1.0), "importance_sampling").result(TIMEOUT_S)
    message = str(info.value)
    for part in ("loss is non-finite", "'importance_sampling'", "logprobs -1e+30 (datum 1)", "exp(lp - logprobs)"):
        assert part in message, f"{part!r} not in {message!r}"


# ---------------------------------------------------------------------------- torn checkpoints

@pytest.fixture(scope="module")
def three_steps(cluster, micro_model) -> np.ndarray:
    """Weights after three good steps (the third on a different datum): a load test's reference."""
    trainer = trainer_for(cluster, micro_model, "ref-three")
    good_step(trainer)
    good_step(trainer, [datum([9, 8, 7, 6])])
    assert good_step(trainer).metrics["step"] == 3.0
    return cluster.fetch_weights(trainer.state)


TORN = [("optimizer.safetensors", True), ("model.safetensors", True), ("model.safetensors", False)]


@pytest.mark.parametrize("file, with_optimizer", TORN,
                         ids=[f"{f} {'with' if o else 'without'} optimizer" for f, o in TORN])
def test_a_torn_checkpoint_load_changes_nothing(cluster, micro_model, three_steps, file, with_optimizer):
    trainer = trainer_for(cluster, micro_model, f"torn-{TORN.index((file, with_optimizer))}")
    good_step(trainer)
    saved = Path(trainer.save_state("ck").result(TIMEOUT_S).path)
    good_step(trainer, [datum([9, 8, 7, 6])])  # moments and step count now differ from the checkpoint's
    trainer.forward_backward(GOOD).result(TIMEOUT_S)  # and gradients are pending
    os.truncate(saved / file, (saved / file).stat().st_size // 2)
    before = cluster.fetch_weights(trainer.state)
    load = trainer.load_state_with_optimizer if with_optimizer else trainer.load_state
    with pytest.raises(errors.ModelLoadError, match="could not"):
        load(saved).result(TIMEOUT_S)
    assert_bitwise(cluster.fetch_weights(trainer.state), before, "the failed load changed the weights")
    # The pending gradients, the moments and the step count are the ones before the failed load.
    assert trainer.optim_step(GOOD_STEP).result(TIMEOUT_S).metrics["step"] == 3.0
    assert_bitwise(cluster.fetch_weights(trainer.state), three_steps, "the step after the failed load differs")


# ---------------------------------------------------------------------------- the runtime's own checks

@pytest.fixture()
def state(micro_model):
    """A trainable state on its own host buffer with one batch of gradients pending."""
    from plexrl.backends import execution
    from plexrl.runtime.state import ModelState, load_module

    s = ModelState("j/p", "j", "p", load_module(micro_model), True, micro_model)
    weights = torch.cat([p.detach().reshape(-1) for p in s.params])
    s.host = torch.zeros(4 * s.numel)
    s.host[:s.numel] = weights
    s.bind(s.host)
    execution.forward_backward(s.module, GOOD, "cross_entropy")
    return s


def params_with(**fields):
    """AdamParams-like, unchecked: what reaches the runtime if a client skipped its checks."""
    return types.SimpleNamespace(**{**dataclasses.asdict(plexrl.AdamParams()), **fields})


@pytest.mark.parametrize("field, value", [
    ("learning_rate", math.inf), ("learning_rate", math.nan), ("learning_rate", "1e-3"), ("weight_decay", math.inf),
    ("beta1", 1.0), ("beta2", -0.1), ("eps", 0.0), ("eps", math.inf), ("grad_clip_norm", math.inf),
])
def test_adam_step_refuses_bad_params_itself(state, field, value):
    from plexrl.runtime.checkpoint import adam_step

    before = state.host.clone()
    with pytest.raises(errors.InvalidAdamParams, match=f"{field}="):
        adam_step(state, params_with(**{field: value}))
    assert torch.equal(state.host.view(torch.int32), before.view(torch.int32)) and state.adam_step == 0


def test_adam_step_refuses_non_finite_gradients(state):
    from plexrl.runtime.checkpoint import adam_step

    state.segment(state.host, 1)[3] = math.nan
    before = state.host.clone()
    with pytest.raises(errors.NonFiniteUpdate, match="non-finite norm"):
        adam_step(state, plexrl.AdamParams(grad_clip_norm=1.0))
    assert torch.equal(state.host.view(torch.int32), before.view(torch.int32)) and state.adam_step == 0


def test_the_backup_path_steps_like_the_ordinary_one(state, micro_model, monkeypatch):
    """A step no bound proves finite is taken on a backed-up state: same arithmetic, same result."""
    from plexrl.runtime import checkpoint

    twin = state.host.clone()
    ordinary = checkpoint.adam_step(state, GOOD_STEP)
    expected = state.host.clone()
    state.host[:] = twin
    state.adam_step = 0
    monkeypatch.setattr(checkpoint, "step_is_finite", lambda *args: False)
    assert checkpoint.adam_step(state, GOOD_STEP) == ordinary
    assert torch.equal(state.host.view(torch.int32), expected.view(torch.int32)) and state.adam_step == 1
