"""Bad input gets a clear exception naming what was wrong and what was expected, through the
caller's future (or at once, for synchronous calls); the cluster and every other job carry on."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import plexrl
from tests.helpers import datum, reserve_bytes, weights
from plexrl import errors
from plexrl.runtime.checkpoint import adam_step

MiB = 1 << 20


@pytest.fixture(scope="module")
def cluster():
    with plexrl.LocalCluster(devices=2, device_memory_bytes=16 * MiB, host_memory_bytes=128 * MiB) as c:
        yield c


@pytest.fixture(scope="module")
def bystander(cluster, tiny_model):
    """Another job that must keep working whatever the bad calls do."""
    return cluster.service_client("bystander").create_training_client(base_model=tiny_model)


def still_works(client):
    assert client.forward_backward([datum([5, 6, 7, 8])]).result(timeout=60).metrics["loss:sum"] > 0


def test_missing_model_folder(cluster, bystander, tmp_path):
    with pytest.raises(errors.ModelLoadError, match="does not exist"):
        cluster.service_client("job").create_training_client(base_model=tmp_path / "nope")
    still_works(bystander)


def test_broken_model_folder(cluster, bystander, tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(errors.ModelLoadError, match="could not load"):
        cluster.service_client("job").create_training_client(base_model=tmp_path)
    still_works(bystander)


def test_unknown_loss(cluster, bystander, tiny_model):
    trainer = cluster.service_client("job-loss").create_training_client(base_model=tiny_model, name="p")
    with pytest.raises(errors.UnknownLossFunction, match="'bogus'.*expected one of"):
        trainer.forward_backward([datum([5, 6, 7])], loss_fn="bogus").result(timeout=10)
    still_works(bystander)
    still_works(trainer)


@pytest.mark.parametrize("bad", [
    {"target_tokens": [6, 7]},  # input has 3 tokens
    {"target_tokens": [6, 7, 8], "weights": [1.0]},
    {"target_tokens": [6, 7, 100000]},
])
def test_mismatched_datum(cluster, bystander, tiny_model, bad):
    trainer = cluster.service_client("job-shape").create_training_client(base_model=tiny_model, name=f"p{len(bad)}{bad['target_tokens'][-1]}")
    d = plexrl.Datum(plexrl.ModelInput.from_ints([5, 6, 7]), bad)
    with pytest.raises(errors.InvalidInput) as info:
        trainer.forward_backward([d]).result(timeout=10)
    assert "datum 0" in str(info.value)
    still_works(bystander)


@pytest.mark.parametrize("params, field", [
    (plexrl.SamplingParams(max_tokens=0), "max_tokens"),
    (plexrl.SamplingParams(temperature=-1.0), "temperature"),
    (plexrl.SamplingParams(top_p=1.5), "top_p"),
    (plexrl.SamplingParams(top_k=0), "top_k"),
    (plexrl.SamplingParams(max_tokens=10_000), "max"),
])
def test_sampling_params_out_of_range(cluster, bystander, tiny_model, params, field):
    sampler = cluster.service_client("job-sample").create_sampling_client(base_model=tiny_model, name=f"s-{field}-{params.top_k}")
    with pytest.raises(errors.InvalidInput, match=field):
        sampler.sample(plexrl.ModelInput.from_ints([5, 6]), 2, params).result(timeout=10)
    still_works(bystander)


def test_adam_params_out_of_range(cluster, bystander):
    with pytest.raises(errors.InvalidAdamParams, match="learning_rate=-1"):
        bystander.optim_step(plexrl.AdamParams(learning_rate=-1)).result(timeout=10)
    still_works(bystander)


def test_state_that_cannot_fit_the_device_budget(tiny_model):
    budget = 1 * MiB + reserve_bytes(tiny_model)  # states get 1 MiB beside the activation reserve
    with plexrl.LocalCluster(devices=1, device_memory_bytes=budget, host_memory_bytes=64 * MiB) as c:
        with pytest.raises(errors.StateTooLarge, match="device budget.*expected device_memory_bytes >="):
            c.service_client("job").create_training_client(base_model=tiny_model)
        # A weights-only sampler of the same model fits (a quarter of the bytes) and runs.
        sampler = c.service_client("job").create_sampling_client(base_model=tiny_model)
        assert len(sampler.compute_logprobs(plexrl.ModelInput.from_ints([5, 6, 7])).result(timeout=60)) == 3


def test_bad_cluster_settings():
    with pytest.raises(errors.ConfigError, match="unknown scheduling policy 'lifo'"):
        plexrl.LocalCluster(policy="lifo")
    with pytest.raises(errors.ConfigError, match="devices=0"):
        plexrl.LocalCluster(devices=0)


def test_load_state_of_a_missing_checkpoint(cluster, bystander, tmp_path):
    with pytest.raises(errors.ModelLoadError, match="does not exist"):
        bystander.load_state(tmp_path / "missing").result(timeout=10)
    still_works(bystander)


def test_adam_step_matches_torch_adamw_on_a_plain_module(tiny_model):
    """The flat-buffer optimizer equals torch's AdamW applied to the module's own parameters."""
    params = plexrl.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)
    with plexrl.LocalCluster(devices=1, device_memory_bytes=64 * MiB, host_memory_bytes=256 * MiB) as c:
        trainer = c.service_client("job").create_training_client(base_model=tiny_model)
        reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                                      weight_decay=0.01, foreach=False)
        batch = [datum([5, 6, 7, 8, 9]), datum([9, 8, 7])]
        from plexrl.backends.execution import forward_backward

        for _ in range(3):
            trainer.forward_backward(batch).result()
            trainer.optim_step(params).result()
            optimizer.zero_grad()
            forward_backward(reference, batch, "cross_entropy")
            optimizer.step()
        ours = weights(c, trainer)
        theirs = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
