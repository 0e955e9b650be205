"""LoRA training clients (`create_lora_training_client`): peft adapters over one frozen base that
every LoRA state of that base shares (runtime/lora.py).

Invariants checked:
- a fresh adapter computes exactly the base's outputs (B starts at zero);
- training changes only the adapter: the shared base (and a frozen model of it) is untouched;
- a LoRA state's own memory is its adapter (x4 when trainable); the base counts once per device,
  so two LoRA tenants fit where two full trainers would not, and stay independent there;
- checkpoints are peft's format, resume bitwise, migrate between node groups, and refuse the
  other kind of model with a clear error;
- the same calls give bitwise the same results on the local, process and Ray engines, next to
  other tenants of the same base or alone.
One cluster per engine for the module where a test needs no budget of its own.
"""

from __future__ import annotations

import numpy as np
import pytest

import plexrl
from plexrl import errors
from tests.helpers import datum, reserve_bytes

MiB = 1 << 20
TIMEOUT_S = 120
IDS = [5, 6, 7, 8, 9, 10, 11]
ADAM = plexrl.AdamParams(learning_rate=1e-2)


def logprobs(client, ids=IDS):
    return client.compute_logprobs(plexrl.ModelInput.from_ints(ids)).result(TIMEOUT_S)


def train(trainer, steps: int, ids=IDS) -> list[float]:
    """`steps` cross-entropy steps on one datum; the loss before each."""
    losses = []
    for _ in range(steps):
        losses.append(trainer.forward_backward([datum(ids)]).result(TIMEOUT_S).metrics["loss:sum"])
        trainer.optim_step(ADAM).result(TIMEOUT_S)
    return losses


def sizes(tiny_model, rank: int = 4) -> tuple[int, int]:
    """(bytes of a full trainer, bytes of a rank-`rank` LoRA trainer's adapter state), as the node measures them."""
    from plexrl.api.types import LoraConfig
    from plexrl.runtime.lora import lora_module
    from plexrl.runtime.state import ModelState, load_module

    base = load_module(tiny_model)
    full = ModelState("x/p", "x", "p", base, True, tiny_model).device_bytes
    config = LoraConfig(rank)
    return full, ModelState("x/l", "x", "l", lora_module(base, config), True, tiny_model, lora=config).device_bytes


@pytest.fixture(scope="module", params=["local", "process"])
def cluster(request):
    from plexrl import engines

    with engines.open_cluster(request.param, 1, device_memory_bytes=64 * MiB, host_memory_bytes=256 * MiB) as c:
        yield c


def test_a_fresh_adapter_computes_the_base_and_training_changes_only_the_adapter(cluster, tiny_model):
    job = cluster.service_client(job="fresh")
    base = job.create_sampling_client(tiny_model)
    trainer = job.create_lora_training_client(tiny_model, rank=4, seed=1)
    before = logprobs(base)
    assert trainer.state.lora_rank == 4
    assert logprobs(trainer.save_weights_and_get_sampling_client()) == before, "B starts at zero: base outputs exactly"
    adapter = cluster.fetch_weights(trainer.state)
    losses = train(trainer, 4)
    assert losses[-1] < losses[0], f"training on one datum must lower its loss: {losses}"
    assert not np.array_equal(cluster.fetch_weights(trainer.state), adapter)
    assert logprobs(base) == before, "the shared base must not change when an adapter trains"
    assert logprobs(trainer.save_weights_and_get_sampling_client()) != before
    job.close()


def test_adapter_state_is_small_and_its_snapshot_samples(cluster, tiny_model):
    full, adapter = sizes(tiny_model)
    job = cluster.service_client(job="small")
    trainer = job.create_lora_training_client(tiny_model, rank=4, seed=2)
    assert trainer.state.device_bytes == trainer.state.host_bytes == adapter < full / 10
    train(trainer, 1)
    sampler = trainer.save_weights_and_get_sampling_client("s")
    assert sampler.state.lora_rank == 4 and sampler.state.device_bytes == adapter // 4, "weights only: no grads, no moments"
    np.testing.assert_array_equal(cluster.fetch_weights(sampler.state), cluster.fetch_weights(trainer.state))
    params = plexrl.SamplingParams(max_tokens=5, seed=11, temperature=1.0)
    out = sampler.sample(plexrl.ModelInput.from_ints(IDS), num_samples=3, sampling_params=params).result(TIMEOUT_S)
    assert len(out.sequences) == 3 and all(1 <= len(s.tokens) <= 5 for s in out.sequences)
    seq = out.sequences[0]
    scored = logprobs(sampler, IDS + seq.tokens)[len(IDS):]
    np.testing.assert_allclose(seq.logprobs, scored, rtol=1e-5, atol=1e-5,
                               err_msg="sample's log-probs at T=1 are the snapshot's own (adapter applied)")
    job.close()


def test_rank_zero_is_a_full_model(cluster, tiny_model):
    full, _ = sizes(tiny_model)
    job = cluster.service_client(job="rank0")
    trainer = job.create_lora_training_client(tiny_model, rank=0)
    assert trainer.state.lora_rank == 0 and trainer.state.lora is None and trainer.state.device_bytes == full
    job.close()


def run_steps(cluster, job: str, tiny_model, seed: int, steps: int):
    """A LoRA job: `steps` updates, then a seeded sample from its snapshot. (weights, sampled tokens)."""
    trainer = cluster.service_client(job=job).create_lora_training_client(tiny_model, rank=4, seed=seed)
    train(trainer, steps, ids=[5 + seed, 6, 7, 8, 9])
    sampler = trainer.save_weights_and_get_sampling_client()
    out = sampler.sample(plexrl.ModelInput.from_ints(IDS), num_samples=2,
                         sampling_params=plexrl.SamplingParams(max_tokens=4, seed=5)).result(TIMEOUT_S)
    return cluster.fetch_weights(trainer.state), [s.tokens for s in out.sequences]


def test_two_tenants_share_one_device_and_stay_independent(tiny_model):
    full, adapter = sizes(tiny_model)
    base_bytes = full // 4
    reserve = reserve_bytes(tiny_model)  # kept beside the states for activations
    budget = base_bytes + 4 * adapter + reserve  # two trainers and their snapshots; two full trainers need 2 x full
    assert 2 * full + reserve > budget and full + base_bytes + reserve > budget, "the budget must refuse two full trainers"
    with plexrl.LocalCluster(devices=1, device_memory_bytes=64 * MiB, host_memory_bytes=256 * MiB) as alone:
        solo = run_steps(alone, "a", tiny_model, seed=1, steps=3)
    with plexrl.LocalCluster(devices=1, device_memory_bytes=budget, host_memory_bytes=256 * MiB) as c:
        a = c.service_client(job="a").create_lora_training_client(tiny_model, rank=4, seed=1)
        b = c.service_client(job="b").create_lora_training_client(tiny_model, rank=4, seed=2)
        for _ in range(3):  # interleaved: b's steps run between a's
            a.forward_backward([datum([6, 6, 7, 8, 9])]).result(TIMEOUT_S)
            b.forward_backward([datum([7, 6, 7, 8, 9])]).result(TIMEOUT_S)
            a.optim_step(ADAM).result(TIMEOUT_S)
            b.optim_step(ADAM).result(TIMEOUT_S)
        assert c.residency() == {"a/policy": "device:0", "b/policy": "device:0"}, "both adapters resident at once"
        sampler = a.save_weights_and_get_sampling_client()
        out = sampler.sample(plexrl.ModelInput.from_ints(IDS), num_samples=2,
                             sampling_params=plexrl.SamplingParams(max_tokens=4, seed=5)).result(TIMEOUT_S)
        np.testing.assert_array_equal(c.fetch_weights(a.state), solo[0], err_msg="b's steps changed a's adapter")
        assert [s.tokens for s in out.sequences] == solo[1]
        assert not np.array_equal(c.fetch_weights(b.state), solo[0])
        with pytest.raises(errors.StateTooLarge, match="weights, gradients and Adam moments, float32"):
            c.service_client(job="full").create_training_client(tiny_model)
    with plexrl.LocalCluster(devices=1, device_memory_bytes=base_bytes + adapter + reserve - 4096) as c:
        with pytest.raises(errors.StateTooLarge, match=f"{base_bytes:,} of shared frozen LoRA base weights"):
            c.service_client(job="tight").create_lora_training_client(tiny_model, rank=4)
    with plexrl.LocalCluster(devices=1, device_memory_bytes=base_bytes + adapter + reserve + 4096) as c:
        job = c.service_client(job="ref")
        job.create_sampling_client(tiny_model)  # a frozen model of its own: not the LoRA base
        with pytest.raises(errors.StateTooLarge, match="model 'frozen:tiny' of job 'ref' already here needs .* once it is added"):
            job.create_lora_training_client(tiny_model, rank=4)


@pytest.fixture(scope="module")
def alone(tiny_model):
    """The reference run: a LoRA job alone on a fresh one-device local cluster."""
    with plexrl.LocalCluster(devices=1, device_memory_bytes=64 * MiB, host_memory_bytes=256 * MiB) as c:
        return run_steps(c, "eq", tiny_model, seed=3, steps=2)


def test_every_engine_gives_the_bits_of_the_job_alone(cluster, tiny_model, alone):
    """On the module's cluster, whatever other tests left there (other tenants of the same base)."""
    weights, tokens = run_steps(cluster, "eq", tiny_model, seed=3, steps=2)
    np.testing.assert_array_equal(weights, alone[0], err_msg=f"the {cluster.engine} engine changed the adapter")
    assert tokens == alone[1]


def test_save_then_load_with_optimizer_resumes_bitwise(cluster, tiny_model):
    uninterrupted = cluster.service_client(job="straight").create_lora_training_client(tiny_model, rank=4, seed=4)
    train(uninterrupted, 4)
    first = cluster.service_client(job="resume")
    trainer = first.create_lora_training_client(tiny_model, rank=4, seed=4, name="p")
    train(trainer, 2)
    path = trainer.save_state("half").result(TIMEOUT_S).path
    saved = logprobs(trainer.save_weights_and_get_sampling_client())
    first.close()
    second = cluster.service_client(job="resume")  # a fresh job of the same name: its checkpoints are its own
    again = second.create_lora_training_client(tiny_model, rank=4, seed=99, name="p")
    again.load_state_with_optimizer(path).result(TIMEOUT_S)
    train(again, 2)
    np.testing.assert_array_equal(cluster.fetch_weights(again.state), cluster.fetch_weights(uninterrupted.state))
    weights_only = second.create_lora_training_client(tiny_model, rank=4, seed=7, name="w")
    weights_only.load_state(path).result(TIMEOUT_S)
    assert logprobs(weights_only.save_weights_and_get_sampling_client()) == saved
    weights_only.forward_backward([datum(IDS)]).result(TIMEOUT_S)
    assert weights_only.optim_step(ADAM).result(TIMEOUT_S).metrics["step"] == 1.0, "weights only: Adam restarts"


def test_a_lora_checkpoint_is_peft_format(cluster, tiny_model):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = cluster.service_client(job="peft").create_lora_training_client(tiny_model, rank=4, seed=5)
    train(trainer, 2)
    path = trainer.save_state("ckpt").result(TIMEOUT_S).path
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), path).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([IDS])).logits[0]
    theirs = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(IDS[1:])[:, None]).squeeze(-1).tolist()
    np.testing.assert_allclose(logprobs(trainer.save_weights_and_get_sampling_client())[1:], theirs, rtol=1e-5, atol=1e-6)


def test_a_checkpoint_of_the_other_kind_is_refused(cluster, tiny_model):
    job = cluster.service_client(job="kinds")
    lora_trainer = job.create_lora_training_client(tiny_model, rank=4, name="lora")
    full_trainer = job.create_training_client(tiny_model, name="full")
    lora_path = lora_trainer.save_state("l").result(TIMEOUT_S).path
    full_path = full_trainer.save_state("f").result(TIMEOUT_S).path
    with pytest.raises(errors.ModelLoadError, match="is a LoRA adapter .* expected a full model folder"):
        full_trainer.load_state(lora_path).result(TIMEOUT_S)
    with pytest.raises(errors.ModelLoadError, match="not a LoRA adapter, but model 'lora' is a LoRA model"):
        lora_trainer.load_state(full_path).result(TIMEOUT_S)
    other_rank = job.create_lora_training_client(tiny_model, rank=2, name="rank2")
    with pytest.raises(errors.ModelLoadError, match=r"expects float32 \(2, 64\)"):
        other_rank.load_state_with_optimizer(lora_path).result(TIMEOUT_S)
    job.close()


def test_a_lora_model_migrates_between_node_groups(tiny_model):
    def run(migrate: bool):
        with plexrl.LocalCluster(nodes=2, devices_per_node=1, device_memory_bytes=64 * MiB,
                                 host_memory_bytes=256 * MiB, profile_steps=1000) as c:
            trainer = c.service_client("job").create_lora_training_client(tiny_model, rank=4, seed=6)
            for step in range(4):
                if migrate and step == 2:
                    c.migrate("job", 1 - c.metrics()["placement"]["job"]["group"])
                train(trainer, 1)
            return c.fetch_weights(trainer.state), c.metrics()["migrations"]

    still, _ = run(False)
    moved, migrations = run(True)
    assert migrations == 1
    np.testing.assert_array_equal(still, moved, err_msg="a migration must not change a LoRA job's results")


BAD_CONFIGS = [
    ("negative rank", dict(rank=-1), "rank=-1 (expected an integer >= 1"),
    ("float rank", dict(rank=2.5), "rank=2.5 (expected an integer >= 1"),
    ("bool rank", dict(rank=True), "rank=True (a bool) (expected an integer >= 1"),
    ("string seed", dict(rank=4, seed="x"), "seed='x'; expected an integer"),
    ("non-bool flag", dict(rank=4, train_mlp=1), "train_mlp=1 (expected True or False)"),
    ("nothing to train", dict(rank=4, train_mlp=False, train_attn=False),
     "train_mlp, train_attn and train_unembed are all False"),
]


@pytest.mark.parametrize("case, kwargs, message", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_bad_lora_configs_are_refused_clearly(cluster, tiny_model, case, kwargs, message):
    job = cluster.service_client(job="bad")
    with pytest.raises(errors.InvalidInput) as caught:
        job.create_lora_training_client(tiny_model, **kwargs)
    assert message in str(caught.value), str(caught.value)
    assert not any(state.startswith("bad/") for state in cluster.residency()), "a refused config adds no model"


def test_the_cluster_checks_a_lora_config_itself(cluster, tiny_model):
    """A caller of `Cluster.add_model` other than ServiceClient (a network edge) is checked too."""
    from plexrl.api.types import LoraConfig

    with pytest.raises(errors.InvalidInput, match=r"rank=0 \(expected an integer >= 1"):
        cluster.add_model("edge", "m", tiny_model, True, lora=LoraConfig(rank=0))
    with pytest.raises(errors.InvalidInput, match="lora=4; expected None or a plexrl.LoraConfig"):
        cluster.add_model("edge", "m", tiny_model, True, lora=4)


@pytest.mark.ray
def test_the_ray_engine_gives_the_bits_of_the_job_alone(request, tiny_model, alone):
    from plexrl import engines

    request.getfixturevalue("ray_node")
    with engines.open_cluster("ray", 1, device_memory_bytes=64 * MiB, host_memory_bytes=256 * MiB) as c:
        weights, tokens = run_steps(c, "eq", tiny_model, seed=3, steps=2)
    np.testing.assert_array_equal(weights, alone[0])
    assert tokens == alone[1]
