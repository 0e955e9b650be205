"""Precision (runtime/precision.py): bf16 snapshots and frozen models, mixed-precision trainers.

Invariants checked (CPU lane, precision="bf16" set explicitly; tests/test_cuda.py checks that
bf16 is what "auto" picks on CUDA):
- a sampler snapshot and a frozen reference model hold bfloat16 weights: 2 B/param in their
  size (device_bytes, host_bytes, rounded up to whole float32 words) and in their host buffer's file;
- sampling and log-probs from a bf16 snapshot are bitwise those of the same weights cast to
  bfloat16 and run directly through plexrl.backends.execution (a switch moves bytes; the arena
  and host views compute nothing of their own); a sync rounds the trainer's weights to nearest;
- a trainer keeps float32 master weights, gradients and Adam moments (16 B/param) and runs
  forward_backward under bf16 autocast: its loss is bitwise that of execution.forward_backward
  with autocast=bfloat16, close to float32's and not equal to it; the same job gives bitwise
  equal weights on the local and process engines (transparency);
- spill/restore and checkpoint save/load of a bf16 state are exact, and a checkpoint keeps the dtype;
- "fp32" and "auto" on CPU are float32 everywhere (the existing suite checks they are bitwise
  what the runtime always did); a bad precision is a ConfigError naming the field and the choices.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

import plexrl
from plexrl import errors
from plexrl.backends import execution
from plexrl.models.tiny import parameter_count
from plexrl.runtime import precision
from plexrl.runtime.state import ModelState, load_module
from tests.helpers import datum, rl_job

TIMEOUT_S = 120
PROMPT = [5, 6, 7]
PARAMS = plexrl.SamplingParams(max_tokens=6, seed=3)


def bf16_module(model: str) -> torch.nn.Module:
    """The model's weights cast to bfloat16 (round to nearest), its buffers as loaded."""
    module = load_module(model)
    for p in module.parameters():
        p.data = p.data.to(torch.bfloat16)
    return module


def node_state(cluster, state_id: str) -> ModelState:
    return cluster.nodes[0].target.sm.states[state_id]


def host_file_bytes(cluster, state_id: str) -> int:
    node = cluster.nodes[0].target
    return node.buffers.path_of(node.sm.states[state_id].host).stat().st_size


def sample(client) -> plexrl.SampleResponse:
    return client.sample(plexrl.ModelInput.from_ints(PROMPT), num_samples=2, sampling_params=PARAMS,
                         include_prompt_logprobs=True).result(TIMEOUT_S)


# ---------------------------------------------------------------------------- what each setting means

@pytest.mark.parametrize("value", ["bf32", "BF16", "fp16", None, 16])
def test_a_bad_precision_is_refused_naming_the_field_and_the_choices(value):
    with pytest.raises(errors.ConfigError, match=r"precision=.*expected one of \['auto', 'fp32', 'bf16'\]"):
        plexrl.LocalCluster(devices=1, precision=value)


@pytest.mark.parametrize("setting, torch_device, expected", [
    ("auto", "cpu", "fp32"),
    ("auto", "cuda", "bf16"),
    ("auto", "cuda:1", "bf16"),
    ("auto", "auto", "auto"),  # a Ray front: its nodes ask their workers
    ("fp32", "cuda", "fp32"),
    ("bf16", "cpu", "bf16"),
])
def test_auto_is_bf16_on_cuda_and_fp32_on_cpu(setting, torch_device, expected):
    assert precision.resolve(setting, torch_device) == expected


@pytest.mark.parametrize("name, resolved, trainable, lora, expected", [
    ("fp32 trainer", "fp32", True, None, (torch.float32, None)),
    ("fp32 frozen", "fp32", False, None, (torch.float32, None)),
    ("bf16 trainer: fp32 master weights, autocast", "bf16", True, None, (torch.float32, torch.bfloat16)),
    ("bf16 frozen: bf16 weights", "bf16", False, None, (torch.bfloat16, None)),
    ("bf16 LoRA stays fp32", "bf16", True, plexrl.LoraConfig(rank=2), (torch.float32, None)),
])
def test_what_a_state_holds_and_runs_in(name, resolved, trainable, lora, expected):
    assert precision.state_dtypes(resolved, trainable, lora) == expected, name


@pytest.mark.parametrize("name, resolved, trainable, lora, tf32", [
    ("fp32 trainer", "fp32", True, None, False),
    ("fp32 frozen", "fp32", False, None, False),
    ("bf16 trainer under autocast", "bf16", True, None, True),
    ("bf16 frozen weights", "bf16", False, None, True),
    ("bf16 LoRA: float32 only", "bf16", True, plexrl.LoraConfig(rank=2), False),
])
def test_tf32_follows_the_precision_a_state_computes_in(name, resolved, trainable, lora, tf32):
    """A CUDA worker allows TF32 once it holds a state that computes in bfloat16, never for an
    fp32 cluster (the user asked for IEEE float32); `set_tf32` sets both flags, and on CPU none."""
    assert precision.computes_in_bf16(*precision.state_dtypes(resolved, trainable, lora)) is tf32, name
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        precision.set_tf32("cpu", not flags[0])
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == flags
        for allowed in (True, False):
            precision.set_tf32("cuda:0", allowed)
            assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (allowed, allowed)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def test_a_bf16_state_is_rounded_up_to_whole_float32_words():
    module = torch.nn.Linear(2, 1)  # 3 parameters: 6 bytes in bfloat16
    state = ModelState("j/m", "j", "m", module, False, "", dtype=torch.bfloat16)
    assert (state.device_bytes, state.host_bytes) == (8, 8)
    assert state.spans([0]) == [slice(0, 2)]  # float32 words of its flat buffer
    flat = torch.zeros(2)
    state.bind(flat)
    assert module.weight.dtype == torch.bfloat16 and module.weight.data_ptr() == flat.data_ptr()
    with pytest.raises(ValueError, match="expected float32"):
        ModelState("j/t", "j", "t", torch.nn.Linear(2, 1), True, "", dtype=torch.bfloat16)


# ---------------------------------------------------------------------------- bf16 snapshots and references

@pytest.fixture(scope="module")
def bf16_cluster():
    with plexrl.LocalCluster(devices=1, precision="bf16") as cluster:
        yield cluster


def test_snapshots_and_reference_models_take_2_bytes_per_parameter(bf16_cluster, tiny_model):
    n = parameter_count(tiny_model)
    service = bf16_cluster.service_client("sizes")
    reference = service.create_sampling_client(tiny_model, name="reference")
    trainer = service.create_training_client(tiny_model)
    snapshot = trainer.save_weights_and_get_sampling_client()
    for client in (reference, snapshot):
        expected = -(-2 * n // 4) * 4
        assert (client.state.device_bytes, client.state.host_bytes) == (expected, expected)
        assert host_file_bytes(bf16_cluster, client.state.state_id) == expected
        assert node_state(bf16_cluster, client.state.state_id).dtype == torch.bfloat16
    assert trainer.state.device_bytes == 16 * n, "a trainer keeps float32 weights, gradients and moments"
    assert host_file_bytes(bf16_cluster, trainer.state.state_id) == 16 * n


def test_a_bf16_snapshot_samples_the_bf16_weights_bit_for_bit(bf16_cluster, tiny_model):
    service = bf16_cluster.service_client("samples")
    trainer = service.create_training_client(tiny_model)
    trainer.forward_backward([datum([5, 6, 7, 8, 9])]).result(TIMEOUT_S)
    trainer.optim_step(plexrl.AdamParams(learning_rate=1e-2)).result(TIMEOUT_S)
    snapshot = trainer.save_weights_and_get_sampling_client()
    master = torch.from_numpy(bf16_cluster.fetch_weights(trainer.state))
    synced = torch.from_numpy(bf16_cluster.fetch_weights(snapshot.state))
    assert synced.dtype == torch.float32, "read_weights returns float32 whatever the state's dtype"
    assert torch.equal(synced, master.bfloat16().float()), "a sync rounds the trainer's weights to nearest"
    # the reference: the synced weights in a bf16 module, run directly
    module = bf16_module(tiny_model)
    offset = 0
    for p in module.parameters():
        p.data.copy_(synced[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    direct = execution.sample(module, PROMPT, 2, PARAMS, seed=PARAMS.seed, include_prompt_logprobs=True)
    assert sample(snapshot) == direct
    tokens = PROMPT + direct.sequences[0].tokens
    assert (snapshot.compute_logprobs(plexrl.ModelInput.from_ints(tokens)).result(TIMEOUT_S)
            == execution.compute_logprobs(module, tokens))


def test_a_bf16_reference_model_samples_the_cast_weights_bit_for_bit(bf16_cluster, tiny_model):
    reference = bf16_cluster.service_client("reference").create_sampling_client(tiny_model, name="reference")
    direct = execution.sample(bf16_module(tiny_model), PROMPT, 2, PARAMS, seed=PARAMS.seed,
                              include_prompt_logprobs=True)
    assert sample(reference) == direct
    fp32 = execution.sample(load_module(tiny_model), PROMPT, 2, PARAMS, seed=PARAMS.seed, include_prompt_logprobs=True)
    assert direct.prompt_logprobs != fp32.prompt_logprobs, "bf16 computed what fp32 does: the test tests nothing"


# ---------------------------------------------------------------------------- mixed-precision trainers

def test_a_mixed_precision_trainer_keeps_float32_master_weights_and_moments(bf16_cluster, tiny_model, tmp_path):
    data = [datum([5, 6, 7, 8, 9, 10]), datum([11, 12, 13])]
    trainer = bf16_cluster.service_client("mixed").create_training_client(tiny_model)
    loss = trainer.forward_backward(data).result(TIMEOUT_S).metrics["loss:sum"]
    direct = execution.forward_backward(load_module(tiny_model), data, "cross_entropy", autocast=torch.bfloat16)
    assert loss == direct.metrics["loss:sum"], "the trainer's forward_backward is not execution's under bf16 autocast"
    fp32 = execution.forward_backward(load_module(tiny_model), data, "cross_entropy").metrics["loss:sum"]
    assert loss != fp32, "autocast changed nothing: the trainer did not run in bf16"
    assert loss == pytest.approx(fp32, rel=1e-2), "bf16 autocast's loss is far from float32's"
    trainer.optim_step(plexrl.AdamParams(learning_rate=1e-3)).result(TIMEOUT_S)
    weights = torch.from_numpy(bf16_cluster.fetch_weights(trainer.state))
    assert not torch.equal(weights, weights.bfloat16().float()), "the master weights were rounded to bf16"
    saved = trainer.save_state("step1").result(TIMEOUT_S).path
    with safe_open(f"{saved}/optimizer.safetensors", framework="pt") as f:
        moments = {key: f.get_tensor(key) for key in f.keys()}
    assert all(m.dtype == torch.float32 and m.numel() == parameter_count(tiny_model) for m in moments.values())
    assert bool(moments["exp_avg_sq"].gt(0).any())


def test_a_mixed_precision_job_is_the_same_on_the_local_and_process_engines(tiny_model):
    from plexrl.engines.process import ProcessCluster

    results = []
    for engine in (plexrl.LocalCluster, ProcessCluster):
        with engine(devices=1, precision="bf16") as cluster:
            trainer = rl_job(cluster, "a", tiny_model, seed=0, steps=2)
            results.append(cluster.fetch_weights(trainer.state))
    np.testing.assert_array_equal(results[0], results[1], err_msg="bf16 on the process engine differs from local")


# ---------------------------------------------------------------------------- spill, restore, checkpoints

def test_a_bf16_state_spills_and_restores_exactly(tiny_model, tmp_path):
    size = -(-2 * parameter_count(tiny_model) // 4) * 4
    with plexrl.LocalCluster(devices=1, precision="bf16", host_memory_bytes=size * 3 // 2, workdir=tmp_path) as c:
        service = c.service_client("job")  # one job: spilling is within a job
        a = service.create_sampling_client(tiny_model, name="a")
        before = c.fetch_weights(a.state)
        service.create_sampling_client(tiny_model, name="b", seed=1)  # spills a
        assert c.metrics()["residency"]["job/a"] == "disk"
        (spill,) = (tmp_path / "node0" / "spill").glob("*.safetensors")
        with safe_open(str(spill), framework="pt") as f:
            assert f.get_tensor("flat").dtype == torch.bfloat16, "the spill file lost the state's dtype"
        assert sample(a) == execution.sample(bf16_module(tiny_model), PROMPT, 2, PARAMS, seed=PARAMS.seed,
                                             include_prompt_logprobs=True)
        assert c.metrics()["transitions"].get("restore", 0) >= 1
        np.testing.assert_array_equal(c.fetch_weights(a.state), before)


def test_a_bf16_checkpoint_keeps_its_dtype_and_loads_back_exactly(bf16_cluster, tiny_model):
    service = bf16_cluster.service_client("ckpt")
    trainer = service.create_training_client(tiny_model)
    trainer.forward_backward([datum([5, 6, 7, 8])]).result(TIMEOUT_S)
    trainer.optim_step(plexrl.AdamParams(learning_rate=1e-2)).result(TIMEOUT_S)
    snapshot = trainer.save_weights_and_get_sampling_client()
    path = str(bf16_cluster.checkpoint_path(snapshot.state, "bf16"))
    bf16_cluster.submit(snapshot.state, "save_state", {"path": path, "with_optimizer": False}).result(TIMEOUT_S)
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        assert {f.get_tensor(key).dtype for key in f.keys()} == {torch.bfloat16}
    assert json.loads(open(f"{path}/config.json").read())["dtype"] == "bfloat16"
    weights = bf16_cluster.fetch_weights(snapshot.state)
    back = service.create_sampling_client(path, name="back")  # a bf16 state from a bf16 checkpoint
    np.testing.assert_array_equal(bf16_cluster.fetch_weights(back.state), weights)
    trainer.load_state(path).result(TIMEOUT_S)  # into float32 master weights: exact
    np.testing.assert_array_equal(bf16_cluster.fetch_weights(trainer.state), weights)


# ---------------------------------------------------------------------------- fp32 and auto on CPU

@pytest.mark.parametrize("setting", ["fp32", "auto"])
def test_fp32_and_auto_on_cpu_are_float32_everywhere(setting, tiny_model):
    n = parameter_count(tiny_model)
    with plexrl.LocalCluster(devices=1, precision=setting, torch_device="cpu") as cluster:
        service = cluster.service_client("fp32")
        reference = service.create_sampling_client(tiny_model, name="reference")
        snapshot = service.create_training_client(tiny_model).save_weights_and_get_sampling_client()
        assert reference.state.device_bytes == snapshot.state.device_bytes == 4 * n
        assert node_state(cluster, snapshot.state.state_id).autocast is None
        assert sample(reference) == execution.sample(load_module(tiny_model), PROMPT, 2, PARAMS, seed=PARAMS.seed,
                                                     include_prompt_logprobs=True)
