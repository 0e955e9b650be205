"""A true device budget (runtime/activation.py, state_manager.py, node.py): device_memory_bytes is
everything PlexRL may use on a device; states get the budget less the activation reserve of the
largest model hosted, the vLLM engines' shares and the shared LoRA bases.

- the reserve is measured (> 0) by running the backend on a reference batch, the same figure every
  time, and it grows with the batch and with the model; a bf16 cluster's under its trainers'
  autocast, the bf16 weight copies included;
- the policy's view, the placer's model sizes and the arenas see the net figure;
- a state that fits the raw budget but not the net one is refused, naming the reserve;
- a reserve set by hand is used as it is;
- a state sampled on vLLM keeps its engine's share of the device (no engine is started for that);
- a model with a larger reserve added later shrinks the arenas: device copies are dropped, the
  results stay bitwise those of before;
- a plan for a state already resident on the device asked for (made without the view of every
  state) is the one `plan_load` gives from that view;
- a closed cluster's workers hold no host mapping, state or arena (on CUDA its memory is the
  device's again); the CUDA reserve is activations, not a copy of the gradients.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import torch

import plexrl
from plexrl import errors
from plexrl.models.tiny import make_tiny_model
from plexrl.runtime.activation import batch_shape, measure_reserve
from plexrl.runtime.memory_estimates import kv_bytes_per_token
from plexrl.runtime.state import ModelState, load_module
from tests.helpers import datum, reserve_bytes

MiB = 1 << 20
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> str:
    """Twice the tiny model's hidden size: a larger reserve."""
    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "wide", hidden_size=128))


def trainer_bytes(model: str) -> int:
    return ModelState("x/p", "x", "p", load_module(model), True, model).device_bytes


def node_of(cluster):
    return cluster.nodes[0].target  # LocalCluster: the Node itself


def test_the_reserve_is_measured_and_grows_with_the_batch_and_the_model(tiny_model, wide_model):
    module = load_module(tiny_model)
    config = module.config
    small, default, large = (measure_reserve(module, tokens, "cpu") for tokens in (64, None, 2 * config.max_position_embeddings))
    assert measure_reserve(module, None, "cpu") == default, "the CPU figure is the same on every run"
    assert 0 < small < default < large
    rows, length = batch_shape(config, None)
    assert (rows, length) == (1, config.max_position_embeddings), "default probe: one sequence of the model's positions"
    logits = rows * length * config.vocab_size * 4
    kv = rows * length * kv_bytes_per_token(config)
    assert default >= 2 * logits + kv, (
        f"the reserve {default:,} must hold at least the probe's logits and their log-softmax ({2 * logits:,}) "
        f"beside its KV cache ({kv:,})")
    assert large >= 1.9 * default, "twice the tokens (two sequences) need about twice the activations"
    assert measure_reserve(load_module(wide_model), None, "cpu") > default, "a wider model needs a larger reserve"


def test_a_bf16_cluster_measures_the_reserve_under_its_trainers_autocast(tiny_model):
    """A bf16 trainer runs under autocast, whose forward keeps a bf16 copy of every weight it
    multiplies for backward: on a short probe those copies outweigh the activations, and a probe
    run in float32 (as it was) sized the reserve below what the trainer takes."""
    with plexrl.LocalCluster(devices=1, precision="bf16", activation_probe_tokens=8,
                             device_memory_bytes=64 * MiB) as cluster:
        cluster.service_client("bf16").create_training_client(tiny_model)
        reserve = cluster.metrics()["device_budget"][0]["activation_reserve_bytes"]
    module = load_module(tiny_model)
    copies = 2 * sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))
    assert reserve == measure_reserve(module, 8, "cpu", autocast=torch.bfloat16)
    assert reserve >= copies > measure_reserve(module, 8, "cpu"), (
        f"the bf16 reserve {reserve:,} must hold the weights' bf16 copies ({copies:,} bytes)")


def test_the_views_see_the_budget_less_the_reserve(tiny_model):
    budget, reserve = 16 * MiB, reserve_bytes(tiny_model)
    with plexrl.LocalCluster(devices=2, device_memory_bytes=budget, host_memory_bytes=128 * MiB) as c:
        trainer = c.service_client(job="a").create_training_client(tiny_model)
        assert trainer.state.activation_reserve_bytes == reserve
        node = node_of(c)
        view = node.sm.view(node.scheduler.pending)
        assert view.device_capacity == {0: budget - reserve, 1: budget - reserve}
        assert [w.target.arena.capacity_bytes for w in c.workers.values()] == [budget - reserve] * 2
        split = c.metrics()["device_budget"][0]
        assert split == {"device_memory_bytes": budget, "activation_reserve_bytes": reserve,
                         "activation_reserve_of": tiny_model, "engine_bytes": 0, "shared_bytes": 0,
                         "state_bytes": budget - reserve}
        memory = c.models.memory([trainer.state])
        assert [m.device_bytes for m in memory] == [trainer.state.device_bytes + reserve], "the placer counts it too"
        trainer.forward_backward([datum([5, 6, 7, 8])]).result(TIMEOUT_S)
        assert c.metrics()["activation_reserves"] == {tiny_model: reserve}


def test_a_state_that_fits_the_raw_budget_but_not_the_net_one_is_refused(tiny_model):
    state, reserve = trainer_bytes(tiny_model), reserve_bytes(tiny_model)
    with plexrl.LocalCluster(devices=1, device_memory_bytes=state + reserve // 2, host_memory_bytes=64 * MiB) as c:
        with pytest.raises(errors.StateTooLarge) as refused:
            c.service_client(job="big").create_training_client(tiny_model)
    message = str(refused.value)
    assert f"{reserve:,} activation reserve of model folder {tiny_model!r}" in message
    assert f"expected device_memory_bytes >= {state + reserve:,}" in message
    with plexrl.LocalCluster(devices=1, device_memory_bytes=state + reserve, host_memory_bytes=64 * MiB) as c:
        trainer = c.service_client(job="fits").create_training_client(tiny_model)
        trainer.forward_backward([datum([5, 6, 7, 8])]).result(TIMEOUT_S)


def test_a_reserve_set_by_hand_is_used_as_it_is(tiny_model):
    budget, by_hand = 8 * MiB, 3 * MiB
    with plexrl.LocalCluster(devices=1, device_memory_bytes=budget, host_memory_bytes=64 * MiB,
                             activation_reserve_bytes=by_hand) as c:
        trainer = c.service_client(job="a").create_training_client(tiny_model)
        assert trainer.state.activation_reserve_bytes == by_hand != reserve_bytes(tiny_model)
        node = node_of(c)
        assert node.sm.view(node.scheduler.pending).device_capacity == {0: budget - by_hand}
        assert [e["measured"] for e in c.events() if e["event"] == "activation_reserve"] == [False]
    with pytest.raises(errors.ConfigError, match="activation_reserve_bytes=-1; expected None"):
        plexrl.LocalCluster(devices=1, activation_reserve_bytes=-1)
    with plexrl.LocalCluster(devices=1, device_memory_bytes=trainer_bytes(tiny_model) + MiB,
                             activation_reserve_bytes=2 * MiB) as c:
        with pytest.raises(errors.StateTooLarge, match=f"{2 * MiB:,} activation reserve"):
            c.service_client(job="big").create_training_client(tiny_model)


def test_a_state_sampled_on_vllm_keeps_its_engines_share(tiny_model, monkeypatch):
    # The accounting needs no engine: none starts until a call loads the state, and none does here.
    # sampler="vllm" only asks for an executable to start one with.
    vllm_python = os.path.abspath(".venv-vllm/bin/python")
    monkeypatch.setenv("PLEXRL_VLLM_PYTHON", vllm_python if os.path.exists(vllm_python) else sys.executable)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.0078125")  # 8 MiB
    weights = trainer_bytes(tiny_model) // 4
    share = 8 * MiB + weights
    reserve = reserve_bytes(tiny_model)
    budget = weights + reserve + share + 2 * MiB
    with plexrl.LocalCluster(devices=2, device_memory_bytes=budget, host_memory_bytes=64 * MiB) as c:
        service = c.service_client(job="a")
        plain = service.create_sampling_client(base_model=tiny_model)
        node = node_of(c)
        assert node.sm.view(node.scheduler.pending).device_capacity[0] == budget - reserve
        on_vllm = service.create_sampling_client(base_model=tiny_model, name="rollouts", sampler="vllm")
        assert (on_vllm.state.engine_bytes, plain.state.engine_bytes) == (share, 0)
        assert node.sm.view(node.scheduler.pending).device_capacity == {0: budget - reserve - share,
                                                                    1: budget - reserve - share}
        assert c.metrics()["device_budget"][1]["engine_bytes"] == share
        assert [w.target.arena.capacity_bytes for w in c.workers.values()] == [budget - reserve - share] * 2
    with plexrl.LocalCluster(devices=1, device_memory_bytes=weights + reserve + share // 2) as c:
        with pytest.raises(errors.StateTooLarge, match=f"{share:,} for vLLM engines"):
            c.service_client(job="b").create_sampling_client(base_model=tiny_model, sampler="vllm")


def test_a_larger_reserve_added_later_shrinks_the_arena_and_keeps_the_bits(tiny_model, wide_model):
    small, large = reserve_bytes(tiny_model), reserve_bytes(wide_model)
    budget = trainer_bytes(wide_model) + large + MiB
    batch = [datum([5, 6, 7, 8, 9])]
    with plexrl.LocalCluster(devices=1, device_memory_bytes=budget, host_memory_bytes=128 * MiB) as c:
        service = c.service_client(job="a")
        trainer = service.create_training_client(tiny_model)
        before = trainer.forward(batch, "cross_entropy").result(TIMEOUT_S)
        assert c.residency() == {"a/policy": "device:0"}
        assert c.workers[0].target.arena.capacity_bytes == budget - small
        service.create_training_client(wide_model, name="wide")
        assert c.workers[0].target.arena.capacity_bytes == budget - large
        assert c.residency()["a/policy"] == "host", "its device copy went with the old arena"
        after = trainer.forward(batch, "cross_entropy").result(TIMEOUT_S)
        np.testing.assert_array_equal(after.loss_fn_outputs[0]["logprobs"].to_numpy(),
                                      before.loss_fn_outputs[0]["logprobs"].to_numpy())
        assert c.metrics()["device_budget"][0]["activation_reserve_of"] == wide_model


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)")
def test_on_cuda_the_reserve_covers_a_forward_backward_of_the_probe_next_to_a_full_arena(tiny_model):
    """The budget is set to nearly all the GPU's free memory: the arena takes budget - reserve, and
    a forward_backward of the probe's batch must still run in what is left."""
    from plexrl.engines.local import LocalCluster

    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    budget = free - 1024 * MiB  # the CUDA context and cuBLAS workspaces sit outside torch's allocator
    config = load_module(tiny_model).config
    rows, length = batch_shape(config, None)
    ids = [[(3 * i + r) % config.vocab_size for i in range(length + 1)] for r in range(rows)]
    with LocalCluster(devices=1, torch_device="cuda", device_memory_bytes=budget) as cluster:
        trainer = cluster.service_client("big").create_training_client(tiny_model)
        reserve = trainer.state.activation_reserve_bytes
        assert reserve > 0
        trainer.forward_backward([datum(row, weights=[1.0] * length) for row in ids]).result(TIMEOUT_S)
        arena = cluster.workers[0].target.arena
        assert arena.capacity_bytes == budget - reserve - (budget - reserve) % 4
        assert math.isfinite(trainer.optim_step(plexrl.AdamParams()).result(TIMEOUT_S).metrics.get("grad_norm", 0.0))
    # closed, the arena's memory is the device's again, not PyTorch's cache in this process: a
    # process engine's workers started next (tests/test_read_replicas.py) ran out of memory beside it
    assert torch.cuda.memory_reserved() < 1024 * MiB


@pytest.mark.parametrize("precision, itemsize", [("fp32", 4), ("bf16", 2)])
def test_a_sample_is_refused_when_its_kv_cache_cannot_fit_beside_its_model(tiny_model, precision, itemsize):
    """The front sizes a sample call's KV cache in the dtype the model computes in: a call that
    fits in bfloat16 is not refused for the float32 cache it would need in fp32."""
    config = load_module(tiny_model).config
    budget = 16 * MiB
    with plexrl.LocalCluster(devices=1, device_memory_bytes=budget, precision=precision,
                             max_sampled_tokens=10**6) as c:
        sampler = c.service_client("s").create_sampling_client(base_model=tiny_model)
        room = budget - sampler.state.device_bytes
        num = room // (2 * kv_bytes_per_token(config, 4)) + 1  # prompt 1 + max_tokens 1: 2 tokens each
        assert num * 2 * kv_bytes_per_token(config, 2) <= room  # in bfloat16 the same call fits
        call = sampler.sample(plexrl.ModelInput.from_ints([5]), int(num), plexrl.SamplingParams(max_tokens=1, seed=0))
        if itemsize == 4:
            with pytest.raises(errors.InvalidInput, match=f"num_samples={num} needs a .*-byte KV cache"):
                call.result(5)
        else:
            assert len(call.result(120).sequences) == num


def test_a_plan_for_a_resident_state_is_the_one_the_full_view_gives(tiny_model):
    """`StateManager.prepare` answers a state resident on the device asked for without building the
    view of every state (the dispatcher's common case): its plan is the one `plan_load` gives from
    that view, for every state and device, and so is its refusal once the arena is too small."""
    from plexrl.policy import NoFit, plan_load

    with plexrl.LocalCluster(devices=2, device_memory_bytes=16 * MiB, host_memory_bytes=128 * MiB) as c:
        trainer = c.service_client(job="a").create_training_client(tiny_model)
        trainer.forward_backward([datum([5, 6, 7, 8])]).result(TIMEOUT_S)
        sampler = trainer.save_weights_and_get_sampling_client()
        sampler.sample(plexrl.ModelInput.from_ints([5, 6]), 1,
                       plexrl.SamplingParams(max_tokens=2, seed=1)).result(TIMEOUT_S)
        node = node_of(c)
        sm, pending = node.sm, node.scheduler.pending
        resident = {sid: s.device for sid, s in sm.states.items() if s.device is not None}
        assert resident, "the calls left states resident"
        with node.lock:
            for sid in sorted(sm.states):
                for device in (0, 1):
                    expected = plan_load(sm.view(pending), sid, device)
                    plan = sm.prepare(sid, device, sm.states[sid].job, pending)
                    assert plan == expected, (sid, device)
                    sm.release(plan, 0.0)
            sid, device = next(iter(resident.items()))
            arena = sm.arenas[device]
            capacity, arena.capacity_bytes = arena.capacity_bytes, sm.states[sid].device_bytes - 4
            try:
                expected = plan_load(sm.view(pending), sid, device)
                assert isinstance(expected, NoFit) and expected == sm.prepare(sid, device, "a", pending)
            finally:
                arena.capacity_bytes = capacity


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_the_reserve_is_activations_not_a_copy_of_the_gradients(tmp_path):
    """The probe runs twice (the first run's one-off workspaces are not the model's); the second
    forward_backward must start from zero gradients as the first did, or it counts the copy of
    them that adding onto non-zero gradients keeps: a model's size, not its activations."""
    model = make_tiny_model(tmp_path / "m", hidden_size=1024, num_layers=4, num_heads=16)
    gradient_bytes = 4 * sum(p.numel() for p in load_module(str(model)).parameters())
    reserve = measure_reserve(load_module(str(model)), 32, "cuda")
    assert 0 < reserve < gradient_bytes, f"reserve {reserve:,} of a 32-token probe; gradients {gradient_bytes:,}"


def test_a_closed_cluster_s_workers_hold_no_mapping_state_or_arena(tiny_model):
    with plexrl.LocalCluster(devices=2, device_memory_bytes=16 * MiB, host_memory_bytes=128 * MiB) as c:
        trainer = c.service_client(job="a").create_training_client(tiny_model)
        trainer.forward_backward([datum([5, 6, 7, 8])]).result(TIMEOUT_S)
        workers = [w.target for w in c.workers.values()]
        assert any(w._mapped for w in workers) and any(w.arena._buffer is not None for w in workers)
    for worker in workers:
        assert not worker._mapped and not worker.states and worker.arena._buffer is None
