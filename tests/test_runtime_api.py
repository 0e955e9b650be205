"""The job-facing API end to end on a local cluster (issue 2's example, and what it promises)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
import transformers

import plexrl
from tests.helpers import datum, weights
from plexrl import errors

MiB = 1 << 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("cluster")
    with plexrl.LocalCluster(devices=2, device_memory_bytes=16 * MiB, host_memory_bytes=128 * MiB,
                             workdir=workdir, event_log=workdir / "events.jsonl") as c:
        yield c


def test_the_issue_example_runs(cluster, tiny_model):
    trainer = cluster.service_client(job="job-a").create_training_client(base_model=tiny_model, seed=0)
    ids = [5, 6, 7, 8, 9, 10, 11]
    fb = trainer.forward_backward([datum(ids)], loss_fn="cross_entropy")
    st = trainer.optim_step(plexrl.AdamParams(learning_rate=1e-3))
    out_fb, out_st = fb.result(), st.result()
    assert out_fb.metrics["loss:sum"] > 0 and len(out_fb.loss_fn_outputs[0]["logprobs"].tolist()) == 6
    assert out_st.metrics["step"] == 1
    sampler = trainer.save_weights_and_get_sampling_client()
    out = sampler.sample(prompt=plexrl.ModelInput.from_ints(ids), num_samples=4,
                         sampling_params=plexrl.SamplingParams(max_tokens=8, temperature=1.0, seed=7)).result()
    assert len(out.sequences) == 4
    for seq in out.sequences:
        assert len(seq.tokens) == len(seq.logprobs) <= 8 and seq.stop_reason in ("stop", "length")
    lp = sampler.compute_logprobs(plexrl.ModelInput.from_ints(ids)).result()
    assert lp[0] is None and len(lp) == len(ids)
    saved = trainer.save_state("step-5").result()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(saved.path)
    flat = torch.cat([p.detach().reshape(-1) for p in reloaded.parameters()])
    assert torch.equal(flat, weights(cluster, trainer))
    trainer.load_state(saved.path).result()
    metrics = cluster.metrics()
    for key in ("switches", "device_busy_s", "transition_bytes", "transition_s"):
        assert key in metrics
    job = metrics["jobs"]["job-a"]
    assert job["consumed_device_s"] > 0 and job["queue_wait_s"] >= 0


def test_sampling_is_reproducible_and_sampler_snapshots_weights(cluster, tiny_model):
    trainer = cluster.service_client(job="job-snap").create_training_client(base_model=tiny_model, seed=3)
    prompt = plexrl.ModelInput.from_ints([5, 6, 7])
    params = plexrl.SamplingParams(max_tokens=6, seed=11)
    sampler = trainer.save_weights_and_get_sampling_client()
    first = sampler.sample(prompt, 3, params).result()
    assert sampler.sample(prompt, 3, params).result() == first
    trainer.forward_backward([datum([5, 6, 7, 8, 9])]).result()
    trainer.optim_step(plexrl.AdamParams(learning_rate=0.05)).result()
    before = sampler.compute_logprobs(prompt).result()
    after = trainer.save_weights_and_get_sampling_client().compute_logprobs(prompt).result()
    assert before != after, "weight sync must make the trained weights the sampling weights"


def test_calls_on_one_model_run_in_submission_order(cluster, tiny_model):
    trainer = cluster.service_client(job="job-order").create_training_client(base_model=tiny_model)
    futures = []
    for i in range(4):
        futures.append(trainer.forward_backward([datum([5, 6, 7, 8])]))
        futures.append(trainer.optim_step(plexrl.AdamParams(learning_rate=1e-3)))
    steps = [f.result().metrics["step"] for f in futures[1::2]]
    assert steps == [1, 2, 3, 4]
    ids = [f.request_id for f in futures]
    starts = [e["request_id"] for e in cluster.events() if e["event"] == "start" and e["request_id"] in ids]
    assert starts == ids


def test_futures_are_awaitable(cluster, tiny_model):
    sampler = cluster.service_client(job="job-async").create_sampling_client(base_model=tiny_model)

    async def main():
        futures = [sampler.compute_logprobs(plexrl.ModelInput.from_ints([5, 6, 7 + i])) for i in range(3)]
        return await asyncio.gather(*futures)

    results = asyncio.run(main())
    assert [len(r) for r in results] == [3, 3, 3]


def test_every_loss_runs_through_the_service(cluster, tiny_model):
    trainer = cluster.service_client(job="job-loss").create_training_client(base_model=tiny_model)
    ids = [5, 6, 7, 8, 9]
    n = len(ids) - 1
    rl = {"logprobs": np.full(n, -3.0, dtype=np.float32), "advantages": np.ones(n, dtype=np.float32)}
    for loss in ("importance_sampling", "ppo", "cispo"):
        assert np.isfinite(trainer.forward_backward([datum(ids, **rl)], loss_fn=loss).result().metrics["loss:sum"])
    value = plexrl.Datum(plexrl.ModelInput.from_ints(ids[:-1]), {"target_values": np.zeros(n, dtype=np.float32)})
    out = trainer.forward([value], loss_fn="value_mse").result()
    assert len(out.loss_fn_outputs[0]["values"].tolist()) == n

    def custom(data, logprobs):
        loss = -sum(lp.sum() for lp in logprobs)
        return loss, {"custom": 1.0}

    assert trainer.forward_backward_custom([datum(ids)], custom).result().metrics["custom"] == 1.0


def test_event_log_records_every_request_and_transition(cluster, tiny_model):
    events = cluster.events()
    ended = {e["request_id"] for e in events if e["event"] == "end"}
    arrived = {e["request_id"] for e in events if e["event"] == "arrival"}
    assert arrived and arrived <= ended, "every call made here was awaited, so every arrival has an end"
    for e in events:
        if e["event"] == "transition":
            assert {"kind", "job", "device", "bytes", "seconds", "state"} <= set(e)
        if e["event"] in ("dispatch", "start", "end"):
            assert {"job", "device", "request_id", "fn"} <= set(e)
    on_disk = [json.loads(line) for line in (cluster.workdir / "events.jsonl").read_text().splitlines()]
    written = {json.dumps(e, sort_keys=True) for e in on_disk}
    assert all(json.dumps(e, sort_keys=True) in written for e in events), "every event is in the log file"


def test_measured_bandwidth_feeds_the_estimates(cluster):
    summary = cluster.metrics()
    assert summary["transitions"].get("load", 0) > 0
    assert summary["bandwidth_gbps"]["load"] != pytest.approx(10.0), "still the prior: no measurement fed it"


def test_a_sampler_follows_the_latest_sync_of_its_name(cluster, tiny_model):
    trainer = cluster.service_client(job="job-follow").create_training_client(base_model=tiny_model, seed=5)
    prompt = plexrl.ModelInput.from_ints([5, 6, 7, 8])
    old = trainer.save_weights_and_get_sampling_client()
    queued = [old.compute_logprobs(prompt) for _ in range(3)]  # submitted before the next sync
    trainer.forward_backward([datum([5, 6, 7, 8, 9])]).result()
    trainer.optim_step(plexrl.AdamParams(learning_rate=0.05)).result()
    new = trainer.save_weights_and_get_sampling_client()
    before = [f.result() for f in queued]
    assert before[0] == before[1] == before[2], "calls made before the sync saw the old weights"
    after_old, after_new = old.compute_logprobs(prompt).result(), new.compute_logprobs(prompt).result()
    assert after_old == after_new != before[0]


def test_a_lone_job_stays_on_the_device_that_holds_its_state(tmp_path, tiny_model):
    """Two idle devices, one job calling one at a time: its state is loaded once and every call
    runs where it is resident (affinity), instead of bouncing between the devices."""
    with plexrl.LocalCluster(devices=2, device_memory_bytes=16 * MiB, host_memory_bytes=128 * MiB,
                             workdir=tmp_path) as c:
        trainer = c.service_client(job="lone").create_training_client(base_model=tiny_model, seed=0)
        for _ in range(20):
            trainer.forward_backward([datum([5, 6, 7, 8])], loss_fn="cross_entropy").result()
        devices = {e["device"] for e in c.events() if e["event"] == "start" and e.get("fn") == "forward_backward"}
        assert len(devices) == 1
        moved = c.metrics()["transitions"]
        assert moved["load"] == 1 and "offload" not in moved, moved  # materialize: the write-through of each call
