"""`plexrl serve` driven by the real Tinker SDK (tinker==0.38.0) over loopback: every core endpoint,
futures and retries, ordering of chunked forward_backward, tenants kept apart, malformed input,
restart and resume. The server runs in this process on a free port, on a local cluster of two
devices; every request loop here is bounded in count and time (the SDK's own retries are bounded
by the timeouts given to `.result()`)."""

from __future__ import annotations

import contextlib
import os
import threading

import httpx
import numpy as np
import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from plexrl.engines.local import LocalCluster  # noqa: E402
from plexrl.serve.app import create_app  # noqa: E402
from plexrl.serve.edge import EdgeLimits  # noqa: E402
from plexrl.serve.limits import Limits  # noqa: E402
from plexrl.serve.server import Server  # noqa: E402
from plexrl.serve.service import TinkerService  # noqa: E402
from plexrl.serve.store import Store  # noqa: E402
from plexrl.serve.tenants import Tenants  # noqa: E402
from tests.helpers import reserve_bytes  # noqa: E402
from tests.serve_helpers import result, session as open_session, tenants  # noqa: E402

ALICE = "tml-alice-0123456789abcdef"
BOB = "tml-bob-0123456789abcdefgh"
T = 120  # seconds any one result may take


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("serve")
    cluster = LocalCluster(devices=2, checkpoint_dir=str(root / "scratch"))
    state = root / "state"
    service = TinkerService(cluster, Store(state), {tiny_model: tiny_model}, tenants(root, alice=ALICE, bob=BOB),
                      Limits(poll_hold_s=1.0, sessions_per_tenant=6), client_flags={"fwdbwd_max_chunk_len": 2},
                      edge=EdgeLimits(max_body_bytes=1 << 20, max_json_bytes=1 << 20))
    server = Server(create_app(service)).start()
    yield {"url": server.url, "service": service, "cluster": cluster, "model": tiny_model, "state": state}
    server.stop()
    service.close()
    cluster.close()


@contextlib.contextmanager
def sdk(world, key=ALICE, **kwargs):
    client = tinker.ServiceClient(base_url=world["url"], api_key=key, **kwargs)
    try:
        yield client
    finally:
        client.close("success").result(T)


def encode(world, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(world["model"]).encode(text)


def datum(ids: list[int], weights=None) -> types.Datum:
    weights = [1.0] * (len(ids) - 1) if weights is None else weights
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": weights})


def logprobs_of(training, data) -> list[np.ndarray]:
    out = training.forward(data, "cross_entropy").result(T)
    return [np.asarray(o["logprobs"].data, dtype=np.float32) for o in out.loss_fn_outputs]


def http(world, key=ALICE) -> httpx.Client:
    return httpx.Client(base_url=world["url"], headers={"X-API-Key": key} if key else {}, timeout=30)


# ---------------------------------------------------------------------------- service endpoints

def test_health_capabilities_and_unknown_endpoints(world):
    with http(world) as h:
        assert h.get("/api/v1/healthz").json() == {"status": "ok"}
        models = h.get("/api/v1/get_server_capabilities").json()["supported_models"]
        assert [m["model_name"] for m in models] == [world["model"]]
        assert models[0]["max_context_length"] > 0
        for method, path in (("GET", "/api/v1/billing/usage/events"), ("POST", "/api/v1/copy_weights"),
                             ("POST", "/api/v1/create_custom_loss")):
            answer = h.request(method, path, json={})
            assert answer.status_code == 404
            assert path in answer.json()["detail"]


def test_missing_or_unknown_key_is_401_with_a_body(world):
    for key in (None, "tml-mallory-0123456789abcdef"):
        with http(world, key) as h:
            answer = h.post("/api/v1/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "x"})
            assert answer.status_code == 401
            assert "X-API-Key" in answer.json()["detail"]
            assert ALICE not in answer.text and BOB not in answer.text


def test_train_sample_and_checkpoints_through_the_sdk(world):
    with sdk(world, user_metadata={"purpose": "test"}) as client:
        rest = tinker.RestClient(base_url=world["url"], api_key=ALICE)
        caps = rest.get_server_capabilities().result(T)
        assert caps.supported_models[0].model_name == world["model"]
        training = client.create_lora_training_client(world["model"], rank=0, seed=3).result(T)
        info = training.get_info()
        assert info.model_data.tokenizer_id == world["model"] and not info.is_lora
        tokenizer = training.get_tokenizer()
        ids = tokenizer.encode("12+34=46")
        assert tokenizer.decode(ids) == "12+34=46"
        fb = training.forward_backward([datum(ids)], "cross_entropy").result(T)
        assert set(fb.metrics) >= {"loss:sum"} and all(k.count(":") == 1 for k in fb.metrics)
        logprobs = np.asarray(fb.loss_fn_outputs[0]["logprobs"].data)
        assert logprobs.shape == (len(ids) - 1,) and np.isclose(-logprobs.sum(), fb.metrics["loss:sum"], rtol=1e-5)
        step = training.optim_step(types.AdamParams(learning_rate=1e-2)).result(T)
        assert all(k.count(":") == 1 for k in step.metrics)
        after = logprobs_of(training, [datum(ids)])[0]
        assert after.sum() > logprobs.sum()  # one step on this datum makes it likelier

        # sampling: a named sampler checkpoint, string and token stops, prompt log-probs, sequence ids
        saved = training.save_weights_for_sampler("step1").result(T)
        assert saved.path.endswith("/sampler_weights/step1")
        sampler = client.create_sampling_client(model_path=saved.path).result(T)
        prompt = types.ModelInput.from_ints(tokenizer.encode("1+2="))
        greedy = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, temperature=0.0)).result(T)
        text = tokenizer.decode(greedy.sequences[0].tokens)
        stopped = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=8, temperature=0.0, stop=text[2])).result(T)
        for seq in stopped.sequences:
            assert seq.stop_reason == "stop" and tokenizer.decode(seq.tokens).endswith(text[2])
            assert isinstance(seq.sequence_id, str)
        assert stopped.sequences[0].sequence_id != stopped.sequences[1].sequence_id
        tokens = greedy.sequences[0].tokens
        by_token = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, temperature=0.0,
                                                                  stop=[tokens[1]])).result(T)
        assert by_token.sequences[0].tokens == tokens[: tokens.index(tokens[1]) + 1]
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result(T)
        assert scored[0] is None and np.allclose(scored[1:], after, atol=1e-5)  # the synced weights are the trained ones

        # unnamed sampler: the weights now, without a checkpoint
        quick = training.save_weights_and_get_sampling_client().result(T)
        assert np.allclose(quick.compute_logprobs(types.ModelInput.from_ints(ids)).result(T)[1:], after, atol=1e-5)

        # checkpoints: save, list, info, load back into the same model, delete
        ckpt = training.save_state("ck1").result(T)
        listed = rest.list_checkpoints(training.model_id).result(T).checkpoints
        assert {c.checkpoint_id for c in listed} == {"sampler_weights/step1", "weights/ck1"}
        run = rest.get_training_run(training.model_id).result(T)
        assert run.base_model == world["model"] and run.model_owner == "alice" and run.last_checkpoint.tinker_path == ckpt.path
        assert rest.get_weights_info_by_tinker_path(ckpt.path).result(T).base_model == world["model"]
        training.forward_backward([datum(ids)], "cross_entropy").result(T)
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result(T)
        assert not np.array_equal(logprobs_of(training, [datum(ids)])[0], after)
        training.load_state_with_optimizer(ckpt.path).result(T)
        assert np.array_equal(logprobs_of(training, [datum(ids)])[0], after)
        rest.delete_checkpoint(training.model_id, "weights/ck1").result(T)
        assert {c.checkpoint_id for c in rest.list_checkpoints(training.model_id).result(T).checkpoints} == {
            "sampler_weights/step1"}


def test_a_bad_call_fails_its_future_as_a_user_error_and_the_client_goes_on(world):
    with sdk(world) as client:
        training = client.create_lora_training_client(world["model"], rank=0).result(T)
        ids = encode(world, "7+8=15")
        with pytest.raises(tinker.RequestFailedError) as failed:
            training.forward_backward([datum(ids)], "no_such_loss").result(T)
        assert "no_such_loss" in str(failed.value) and failed.value.category.value == "user"
        huge = types.Datum(model_input=types.ModelInput.from_ints([10**6, 5]),
                           loss_fn_inputs={"target_tokens": [5, 6], "weights": [1.0, 1.0]})
        with pytest.raises(tinker.RequestFailedError, match="vocab"):
            training.forward_backward([huge], "cross_entropy").result(T)
        assert training.forward_backward([datum(ids)], "cross_entropy").result(T).metrics["loss:sum"] > 0


def test_chunked_forward_backward_runs_in_order(world, tiny_model):
    """The server tells the SDK to send at most 2 datums a request, so 5 datums go as 3 chunks
    posted in parallel (the first one last). The result equals 3 calls in that order on a
    local job of the same model, bitwise."""
    texts = ["1+1=2", "2+3=5", "9+9=18", "4+4=8", "12+1=13"]
    data = [datum(encode(world, t)) for t in texts]
    with sdk(world) as client:
        training = client.create_lora_training_client(world["model"], rank=0, seed=1).result(T)
        out = training.forward_backward(data, "cross_entropy").result(T)
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result(T)
        remote = logprobs_of(training, data)
    import plexrl

    with LocalCluster(devices=1) as local:
        trainer = local.service_client(job="reference").create_training_client(tiny_model, seed=0)
        for chunk in (data[0:2], data[2:4], data[4:5]):
            trainer.forward_backward([_plexrl(d) for d in chunk], "cross_entropy").result(T)
        trainer.optim_step(plexrl.AdamParams(learning_rate=1e-2, beta2=0.95, eps=1e-12)).result(T)
        local_out = [o for chunk in (data[0:2], data[2:4], data[4:5])  # the forward is chunked the same way
                     for o in trainer.forward([_plexrl(d) for d in chunk], "cross_entropy").result(T).loss_fn_outputs]
    assert len(out.loss_fn_outputs) == 5
    for mine, theirs in zip(remote, local_out):
        assert np.array_equal(mine, theirs["logprobs"].to_numpy())


def _plexrl(d: types.Datum):
    import plexrl

    return plexrl.Datum(plexrl.ModelInput.from_ints(d.model_input.to_ints()),
                        {k: np.asarray(v.data) for k, v in d.loss_fn_inputs.items()})


# ---------------------------------------------------------------------------- raw protocol

def test_duplicate_submissions_return_the_same_request(world):
    with http(world) as h:
        session = open_session(h)
        create = {"session_id": session, "model_seq_id": 0, "base_model": world["model"],
                  "lora_config": {"rank": 0}}
        first = h.post("/api/v1/create_model", json=create).json()["request_id"]
        assert h.post("/api/v1/create_model", json=create).json()["request_id"] == first
        model_id = result(h, first).json()["model_id"]
        assert model_id == f"{session}:train:0"
        step = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}
        one = h.post("/api/v1/optim_step", json=step).json()["request_id"]
        again = h.post("/api/v1/optim_step", json=step, headers={"X-Idempotency-Key": "another"}).json()["request_id"]
        assert one == again
        assert "metrics" in result(h, one).json()
        h.post(f"/api/v1/sessions/{session}/finish", json={})


def test_malformed_input_gets_a_4xx_with_a_message(world):
    with http(world) as h:
        session = open_session(h)
        cases = [
            h.post("/api/v1/create_model", content=b"{not json", headers={"content-type": "application/json"}),
            h.post("/api/v1/create_model", json=[1, 2]),
            h.post("/api/v1/forward_backward", content=b"\xff\x00garbage\x12\x34",
                   headers={"content-type": "application/x-protobuf"}),
            h.post("/api/v1/optim_step", content=b"x" * (2 << 20)),
            h.post("/api/v1/retrieve_future", json={"request_id": 5}),
            h.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": -1, "base_model": "x"}),
            h.get("/api/v1/training_runs", params={"limit": "many"}),
        ]
        for answer in cases:
            assert 400 <= answer.status_code < 500, (answer.status_code, answer.text)
            assert answer.json()["detail"], answer.text
        assert cases[3].status_code == 413
        unserved = h.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                         "base_model": "/not/served", "lora_config": {"rank": 0}})
        failed = result(h, unserved.json()["request_id"]).json()
        assert failed["category"] == "user" and "not served" in failed["error"]
        h.post(f"/api/v1/sessions/{session}/finish", json={})


def test_another_tenants_things_are_not_found(world):
    with sdk(world, ALICE) as alice:
        training = alice.create_lora_training_client(world["model"], rank=0).result(T)
        ckpt = training.save_state("mine").result(T)
        sampler_path = training.save_weights_for_sampler("mine").result(T).path
        future = httpx.post(f"{world['url']}/api/v1/optim_step", headers={"X-API-Key": ALICE},
                            json={"model_id": training.model_id, "seq_id": 99, "adam_params": {}}).json()
        session = training.model_id.split(":")[0]
        with http(world, BOB) as bob:
            probes = [
                bob.post("/api/v1/get_info", json={"model_id": training.model_id}),
                bob.post("/api/v1/optim_step", json={"model_id": training.model_id, "seq_id": 1, "adam_params": {}}),
                bob.post("/api/v1/retrieve_future", json={"request_id": future["request_id"]}),
                bob.post("/api/v1/session_heartbeat", json={"session_id": session}),
                bob.post(f"/api/v1/sessions/{session}/finish", json={}),
                bob.get(f"/api/v1/training_runs/{training.model_id}"),
                bob.get(f"/api/v1/training_runs/{training.model_id}/checkpoints"),
                bob.delete(f"/api/v1/training_runs/{training.model_id}/checkpoints/weights/mine"),
                bob.post("/api/v1/weights_info", json={"tinker_path": ckpt.path}),
            ]
            for answer in probes:
                assert answer.status_code == 404, (answer.request.url, answer.status_code, answer.text)
                assert answer.json()["detail"]
            assert bob.get("/api/v1/training_runs").json()["training_runs"] == [] or all(
                r["model_owner"] == "bob" for r in bob.get("/api/v1/training_runs").json()["training_runs"])
            bob_session = open_session(bob)
            loaded = bob.post("/api/v1/load_weights", json={"session_id": bob_session, "model_seq_id": 0,
                                                            "path": ckpt.path, "optimizer": True})
            assert loaded.status_code == 404 and "mine" in loaded.json()["detail"]
            sampled = bob.post("/api/v1/create_sampling_session",
                               json={"session_id": bob_session, "sampling_session_seq_id": 0, "model_path": sampler_path})
            assert sampled.status_code == 404
            bob.post(f"/api/v1/sessions/{bob_session}/finish", json={})
        # alice's model is untouched by all of that
        assert training.get_info().model_id == training.model_id


def test_tenant_limits_answer_429(world):
    with http(world, BOB) as h:
        sessions = [open_session(h) for _ in range(6)]
        answer = h.post("/api/v1/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "x"})
        assert answer.status_code == 429 and "6" in answer.json()["detail"]
        for session in sessions:
            h.post(f"/api/v1/sessions/{session}/finish", json={})
        assert h.post("/api/v1/session_heartbeat", json={"session_id": sessions[0]}).status_code == 410
        open_session(h)  # room again


def test_tenants_at_once_are_isolated_and_transparent(world):
    """Two tenants train at the same time on the two devices; each gets what it gets alone."""
    ids = encode(world, "3+4=7")

    def job(key, seed, out):
        with sdk(world, key) as client:
            training = client.create_lora_training_client(world["model"], rank=0, seed=seed).result(T)
            for _ in range(3):
                training.forward_backward([datum(ids)], "cross_entropy").result(T)
                training.optim_step(types.AdamParams(learning_rate=1e-2)).result(T)
            out[key] = logprobs_of(training, [datum(ids)])[0]

    alone: dict = {}
    job(ALICE, 0, alone)
    together: dict = {}
    threads = [threading.Thread(target=job, args=(key, 0, together)) for key in (ALICE, BOB)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(4 * T)
    assert np.array_equal(together[ALICE], alone[ALICE]) and np.array_equal(together[BOB], alone[ALICE])


def test_a_session_without_heartbeats_is_finished(world, tiny_model):
    service = TinkerService(world["cluster"], Store(world["state"]), {tiny_model: tiny_model}, Tenants(),
                      Limits(session_timeout_s=1.0, poll_hold_s=0.5))
    with Server(create_app(service)) as server, httpx.Client(base_url=server.url, timeout=30) as h:
        session = open_session(h)
        created = h.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                       "base_model": tiny_model, "lora_config": {"rank": 0}})
        result(h, created.json()["request_id"])
        job_states = lambda: [s for s in world["cluster"].residency() if s.startswith(session)]  # noqa: E731
        assert job_states()
        for _ in range(100):  # no heartbeats from here on: the reaper finishes it after 1 s
            # `finished` is set as finishing starts (no new calls get in), its states go right after
            if service.sessions[session].finished and not job_states():
                break
            threading.Event().wait(0.1)
        assert service.sessions[session].finished
        assert not job_states()
        assert h.post("/api/v1/session_heartbeat", json={"session_id": session}).status_code == 410
    service.close()


def test_restart_keeps_runs_and_resume_is_bitwise(world, tmp_path, tiny_model):
    """Save with the optimizer, stop the server, start a new one on the same state directory:
    the run, its checkpoints and metadata are there, and training resumed from the checkpoint
    equals training continued from it without the restart."""
    ids = encode(world, "5+5=10")
    state = tmp_path / "state"

    def serve():
        cluster = LocalCluster(devices=2, checkpoint_dir=str(tmp_path / "scratch"))
        service = TinkerService(cluster, Store(state), {tiny_model: tiny_model}, Tenants(), Limits(poll_hold_s=1.0))
        return cluster, service, Server(create_app(service)).start()

    def steps(training, n):
        for _ in range(n):
            training.forward_backward([datum(ids)], "cross_entropy").result(T)
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result(T)
        return logprobs_of(training, [datum(ids)])[0]

    cluster, service, server = serve()
    client = tinker.ServiceClient(base_url=server.url, api_key="tml-anyone-0123456789abcdef")
    training = client.create_lora_training_client(tiny_model, rank=0, seed=5,
                                                  user_metadata={"renderer_name": "role_colon"}).result(T)
    steps(training, 2)
    path = training.save_state("resume-here").result(T).path
    uninterrupted = steps(training, 2)
    client.close("success").result(T)
    server.stop(), service.close(), cluster.close()

    cluster, service, server = serve()
    try:
        client = tinker.ServiceClient(base_url=server.url, api_key="tml-anyone-0123456789abcdef")
        rest = tinker.RestClient(base_url=server.url, api_key="tml-anyone-0123456789abcdef")
        run_id = path.split("/")[2]
        run = rest.get_training_run(run_id).result(T)
        assert run.user_metadata == {"renderer_name": "role_colon"} and run.last_checkpoint.tinker_path == path
        resumed = client.create_training_client_from_state_with_optimizer(path).result(T)
        assert np.array_equal(steps(resumed, 2), uninterrupted)
        client.close("success").result(T)
    finally:
        server.stop(), service.close(), cluster.close()


def test_lora_training_clients_share_the_base(world):
    """rank > 0: a LoRA adapter on the served base (peft); a fresh adapter computes the base's
    log-probs, training changes them, and its checkpoints say what they are."""
    ids = encode(world, "6+7=13")
    with sdk(world) as client:
        base = client.create_sampling_client(base_model=world["model"]).result(T)
        base_lp = base.compute_logprobs(types.ModelInput.from_ints(ids)).result(T)[1:]
        lora = client.create_lora_training_client(world["model"], rank=4, seed=2).result(T)
        info = lora.get_info()
        assert info.is_lora and info.lora_rank == 4
        assert np.allclose(logprobs_of(lora, [datum(ids)])[0], base_lp, atol=1e-5)
        for _ in range(3):
            lora.forward_backward([datum(ids)], "cross_entropy").result(T)
            lora.optim_step(types.AdamParams(learning_rate=1e-2)).result(T)
        trained = logprobs_of(lora, [datum(ids)])[0]
        assert trained.sum() > np.sum(base_lp)
        sampler = lora.save_weights_and_get_sampling_client().result(T)
        assert np.allclose(sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result(T)[1:], trained, atol=1e-5)
        path = lora.save_state("lora-ck").result(T).path
        rest = tinker.RestClient(base_url=world["url"], api_key=ALICE)
        weights = rest.get_weights_info_by_tinker_path(path).result(T)
        assert weights.is_lora and weights.lora_rank == 4
        again = client.create_training_client_from_state_with_optimizer(path).result(T)
        assert again.get_info().is_lora
        assert np.array_equal(logprobs_of(again, [datum(ids)])[0], trained)


def test_forward_backward_custom_runs_its_loss_client_side(world):
    """The SDK's custom loss: a forward, the loss and its gradient in the caller's process, then
    a cross_entropy backward with the gradient as (possibly negative) per-token weights. A custom
    loss of -sum(logprobs) must update the weights exactly as cross_entropy does."""
    import torch

    ids = encode(world, "8+8=16")

    def neg_sum(data, logprobs):
        loss = -sum(lp.sum() for lp in logprobs)
        return loss, {"custom_loss:sum": float(loss.detach())}

    results = []
    with sdk(world) as client:
        for custom in (True, False):
            training = client.create_lora_training_client(world["model"], rank=0).result(T)
            if custom:
                out = training.forward_backward_custom([datum(ids)], neg_sum).result(T)
                assert "custom_loss:sum" in out.metrics
            else:
                training.forward_backward([datum(ids)], "cross_entropy").result(T)
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result(T)
            results.append(logprobs_of(training, [datum(ids)])[0])
    assert torch.allclose(torch.from_numpy(results[0]), torch.from_numpy(results[1]), atol=1e-6)


def test_a_request_waiting_for_room_says_so_and_runs_when_room_is_made(tmp_path, tiny_model):
    """One device with room for one trainer: a second session's model waits for admission; its
    polls answer try-again with a reason that says so, and it is created once the first session
    finishes."""
    from plexrl.models.tiny import parameter_count

    room = parameter_count(tiny_model) * 16 * 3 // 2  # a trainer is 16 bytes a parameter
    with LocalCluster(devices=1, device_memory_bytes=room + reserve_bytes(tiny_model), host_memory_bytes=room,
                      checkpoint_dir=str(tmp_path / "scratch")) as cluster:
        service = TinkerService(cluster, Store(tmp_path / "state"), {tiny_model: tiny_model}, Tenants(),
                          Limits(poll_hold_s=0.3))
        with Server(create_app(service)) as server, httpx.Client(base_url=server.url, timeout=30) as h:
            body = lambda s: {"session_id": s, "model_seq_id": 0, "base_model": tiny_model,  # noqa: E731
                              "lora_config": {"rank": 0}}
            first, second = open_session(h), open_session(h)
            assert "model_id" in result(h, h.post("/api/v1/create_model", json=body(first)).json()["request_id"]).json()
            waiting = h.post("/api/v1/create_model", json=body(second)).json()["request_id"]
            poll = h.post("/api/v1/retrieve_future", json={"request_id": waiting}).json()
            assert poll["type"] == "try_again" and poll["queue_state"] == "paused_capacity"
            assert "room" in poll["queue_state_reason"]
            h.post(f"/api/v1/sessions/{first}/finish", json={})
            assert result(h, waiting).json()["model_id"] == f"{second}:train:0"
        service.close()


def test_queued_requests_past_the_tenant_limit_answer_429(world, tmp_path, tiny_model):
    service = TinkerService(world["cluster"], Store(tmp_path), {tiny_model: tiny_model}, Tenants(),
                      Limits(queued_per_tenant=3, poll_hold_s=0.3))
    with Server(create_app(service)) as server, httpx.Client(base_url=server.url, timeout=30) as h:
        session = open_session(h)
        created = h.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                       "base_model": tiny_model, "lora_config": {"rank": 0}})
        model_id = result(h, created.json()["request_id"]).json()["model_id"]
        step = lambda n: h.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": n,  # noqa: E731
                                                            "adam_params": {}})
        held = [step(n) for n in (2, 3, 4)]  # all wait for seq_id 1
        assert all(a.status_code == 200 for a in held)
        refused = step(5)
        assert refused.status_code == 429 and "3 requests queued" in refused.json()["detail"]
        first = step(1)  # the call the held ones wait for is let in past the limit, or they would stall
        assert first.status_code == 200 and "metrics" in result(h, first.json()["request_id"]).json()
        assert "metrics" in result(h, held[-1].json()["request_id"]).json()
        h.post(f"/api/v1/sessions/{session}/finish", json={})
    service.close()


def test_retrieved_results_are_dropped_after_the_retention_time(world, tmp_path, tiny_model):
    now = [0.0]
    service = TinkerService(world["cluster"], Store(tmp_path), {tiny_model: tiny_model}, Tenants(),
                      Limits(retention_s=60, session_timeout_s=1e9, poll_hold_s=0.3), clock=lambda: now[0])
    with Server(create_app(service)) as server, httpx.Client(base_url=server.url, timeout=30) as h:
        session = open_session(h)
        created = h.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                       "base_model": tiny_model, "lora_config": {"rank": 0}})
        request_id = created.json()["request_id"]
        assert "model_id" in result(h, request_id).json()
        now[0] = 59.0
        threading.Event().wait(1.5)  # a reaper round
        assert "model_id" in result(h, request_id).json()  # a second poll (after a lost answer) still gets it
        now[0] = 61.0
        for _ in range(50):
            if request_id not in service.pending:
                break
            threading.Event().wait(0.1)
        assert h.post("/api/v1/retrieve_future", json={"request_id": request_id}).status_code == 404
        h.post(f"/api/v1/sessions/{session}/finish", json={})
    service.close()


def test_a_sampler_keeps_its_weights_after_later_syncs_reuse_its_slot(world):
    """Snapshots live in two slots a model, rewritten in place: a sampler of an older named
    checkpoint then samples that checkpoint (loaded from its folder); an unnamed one fails clearly."""
    ids = encode(world, "2+2=4")
    prompt = types.ModelInput.from_ints(ids)
    with sdk(world) as client:
        training = client.create_lora_training_client(world["model"], rank=0).result(T)
        path = training.save_weights_for_sampler("early").result(T).path
        named = client.create_sampling_client(model_path=path).result(T)
        unnamed = training.save_weights_and_get_sampling_client().result(T)
        before = named.compute_logprobs(prompt).result(T)
        for _ in range(3):  # three more syncs: both slots rewritten
            training.forward_backward([datum(ids)], "cross_entropy").result(T)
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result(T)
            training.save_weights_and_get_sampling_client().result(T)
        assert np.allclose(named.compute_logprobs(prompt).result(T)[1:], before[1:], atol=1e-6)
        with pytest.raises(tinker.RequestFailedError, match="replaced"):
            unnamed.compute_logprobs(prompt).result(T)
