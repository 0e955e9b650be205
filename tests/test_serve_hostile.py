"""`plexrl serve` probed as a hostile but fair tenant would: bodies past every limit, bombs that are
small on the wire and large once decoded, values a listing cannot show, ids far ahead, generated
bodies on every route. Whatever a client sends gets a 4xx (or a failed request of category user)
naming the field and the limit, quickly, without a traceback, a key or a large echo in its body,
and without stalling or changing another tenant's work. The server runs in this process on a free
loopback port; every loop is bounded in count and time."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from urllib.parse import quote

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402
from tinker import types  # noqa: E402
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402

from plexrl.engines.local import LocalCluster  # noqa: E402
from plexrl.serve.edge import EdgeLimits  # noqa: E402
from plexrl.serve.limits import Limits  # noqa: E402
from plexrl.serve.service import TinkerService  # noqa: E402
from plexrl.serve.store import Run, RunExists, Store  # noqa: E402
from plexrl.serve.tenants import Tenants  # noqa: E402
from tests.helpers import reserve_bytes  # noqa: E402
from tests.serve_helpers import T, create_model, result, served, session, tenants  # noqa: E402

ALICE = "tml-alice-0123456789abcdef"
BOB = "tml-bob-0123456789abcdefgh"
KEYS = (ALICE, BOB)
EDGE = EdgeLimits(max_body_bytes=1 << 20, max_json_bytes=256 << 10, max_string_chars=1024,
                  max_request_values=1 << 16)


@pytest.fixture(scope="module")
def world(tmp_path_factory, micro_model):
    root = tmp_path_factory.mktemp("hostile")
    cluster = LocalCluster(devices=2, checkpoint_dir=str(root / "scratch"))
    service = TinkerService(cluster, Store(root / "state"), {"micro": micro_model}, tenants(root, alice=ALICE, bob=BOB),
                      Limits(poll_hold_s=0.5, sessions_per_tenant=8, seq_window=64), edge=EDGE)
    with served(service) as server, httpx.Client(base_url=server.url, headers={"X-API-Key": ALICE},
                                                 timeout=30) as h:
        sid = session(h)
        model_id = create_model(h, sid, "micro")
        yield {"url": server.url, "service": service, "h": h, "session": sid, "model": model_id, "root": root,
               "micro": micro_model}
    cluster.close()


def proto(model_id: str, seq_id: int = 1, tensors: dict | None = None, length: int = 2) -> bytes:
    """A one-datum ForwardBackwardRequest (cross_entropy) of `length` tokens; `tensors` replace
    its loss_fn_inputs (a well-formed target_tokens when None)."""
    tokens = np.arange(length, dtype=np.int32) % 50 + 1
    if tensors is None:
        tensors = {"target_tokens": pb.Tensor(dtype=pb.DTYPE_INT64, shape=[length],
                                              dense=np.roll(tokens, -1).astype(np.int64).tobytes())}
    message = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = tokens.tobytes()
    for name, tensor in tensors.items():
        datum.loss_fn_inputs[name].CopyFrom(tensor)
    return message.SerializeToString()


def sparse(columns: int) -> pb.Tensor:
    """A [1, columns] float32 tensor of no values: a few bytes on the wire, `columns` once dense."""
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, columns], sparse_csr=pb.SparseCsr(
        values=b"", crow_indices=np.array([0, 0], dtype=np.int64).tobytes(), col_indices=b""))


def deep(levels: int) -> bytes:
    return b'{"session_id": ' + b"[" * levels + b"]" * levels + b"}"


def assert_clean(answer: httpx.Response) -> None:
    """A 4xx (or a 200), with a body, and nothing in it a client should not see."""
    assert answer.status_code < 500, (answer.status_code, answer.text[:500])
    assert answer.content, "an empty body (the SDK takes it for a proxy's and retries)"
    text = answer.text
    assert "Traceback" not in text and not any(key in text for key in KEYS), text[:500]


def assert_refused(answer: httpx.Response, status: int, fragments: list[str]) -> None:
    assert_clean(answer)
    assert answer.status_code == status, (answer.status_code, answer.text[:500])
    detail = answer.json()["detail"]
    assert len(detail) < 2500, f"a refusal echoes {len(detail)} characters"
    missing = [f for f in fragments if f not in detail]
    assert not missing, f"{detail!r} lacks {missing}"


def user_failure(h: httpx.Client, answer: httpx.Response, fragments: list[str]) -> str:
    """A future-type POST accepted as a request that failed as the user's: its error."""
    assert answer.status_code == 200, answer.text[:500]
    failed = result(h, answer.json()["request_id"]).json()
    assert failed.get("category") == "user", failed
    missing = [f for f in fragments if f not in failed["error"]]
    assert not missing, f"{failed['error']!r} lacks {missing}"
    assert len(failed["error"]) < 2500
    return failed["error"]


# ---------------------------------------------------------------------------- refused at the edge

PROTOBUF = {"content-type": "application/x-protobuf"}
EDGE_CASES = {  # route, the request's body, the status and what its message names
    "JSON body over its limit": ("create_model", lambda w: b'{"a": "' + b"x" * (300 << 10) + b'"}', 413,
                                 ["at most 262,144"]),
    "protobuf body over its limit": ("forward_backward", lambda w: b"\x00" * (2 << 20), 413, ["at most 1,048,576"]),
    "JSON nested 2,000 levels": ("create_model", lambda w: deep(2000), 400, ["nest", "32 levels"]),
    "JSON nested 40 levels": ("asample", lambda w: deep(40), 400, ["nests deeper than 32 levels at $.session_id"]),
    "a string over its limit": ("create_model", lambda w: json.dumps({"session_id": w["session"], "model_seq_id": 5,
                                                                      "base_model": "m" * 2000}).encode(),
                                413, ["$.base_model", "2,000", "1,024"]),
    "a lone surrogate": ("create_session", lambda w: b'{"user_metadata": {"k": "\\ud800"}}', 400,
                         ["$.user_metadata.k", "lone surrogate"]),
    "an integer past 64 bits": ("create_model", lambda w: json.dumps({"model_seq_id": 10 ** 30}).encode(), 400,
                                ["$.model_seq_id", "64 bits"]),
    "NaN is not JSON": ("optim_step", lambda w: b'{"seq_id": NaN}', 400, ["not valid JSON", "NaN"]),
    "a number that overflows to inf": ("optim_step", lambda w: b'{"seq_id": 1e999}', 400,
                                       ["$.seq_id=inf", "finite"]),
    "a JSON list, not an object": ("retrieve_future", lambda w: b"[1, 2]", 400, ["JSON list", "object"]),
    "not JSON": ("session_heartbeat", lambda w: b"{not json", 400, ["not valid JSON"]),
}


@pytest.mark.parametrize("route, body, status, fragments", EDGE_CASES.values(), ids=EDGE_CASES.keys())
def test_a_body_past_a_limit_is_refused_naming_it(world, route, body, status, fragments):
    headers = PROTOBUF if route == "forward_backward" else {"content-type": "application/json"}
    assert_refused(world["h"].post(f"/api/v1/{route}", content=body(world), headers=headers), status, fragments)


def test_an_id_that_is_a_slash_is_not_found_with_a_body(world):
    """training_runs/%2F decodes to a path ending in "//": a 404 naming it, never a redirect with an
    empty body (found by the property test below)."""
    for path in ("/api/v1/training_runs/%2F", "/api/v1/training_runs/%2F/checkpoints", "/api/v1/samplers/%2F"):
        answer = world["h"].get(path)
        assert_clean(answer)
        assert answer.status_code == 404 and answer.json()["detail"]


def test_query_numbers_out_of_range_are_refused(world):
    h = world["h"]
    for query, fragment in (({"offset": str(2 ** 63)}, "offset="), ({"limit": "many"}, "limit='many'"),
                            ({"offset": "-1"}, "offset='-1'")):
        assert_refused(h.get("/api/v1/training_runs", params=query), 400, [fragment, "from 0 to 2147483647"])
    assert h.get("/api/v1/training_runs", params={"offset": "5", "limit": "2000"}).status_code == 200


def test_a_sparse_tensor_bomb_is_refused_from_its_shapes(world):
    """Three tensors, each under the per-tensor cap, a few hundred bytes on the wire: the request
    is refused from the sum of their shapes, before any is densified."""
    body = proto(world["model"], tensors={f"w{i}": sparse(1 << 15) for i in range(3)})
    assert len(body) < 500
    answer = world["h"].post("/api/v1/forward_backward", content=body, headers=PROTOBUF)
    assert_refused(answer, 400, ["98,306 tokens and tensor values", "at most 65,536"])


def test_num_samples_is_bounded_before_anything_is_built_for_it(world):
    h = world["h"]
    sampler = h.post("/api/v1/create_sampling_session", json={"session_id": world["session"],
                                                              "sampling_session_seq_id": 900, "base_model": "micro"})
    sampler_id = sampler.json()["sampling_session_id"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    started = time.monotonic()
    answer = h.post("/api/v1/asample", json={"sampling_session_id": sampler_id, "num_samples": 10 ** 7,
                                             "prompt": prompt, "sampling_params": {"max_tokens": 5}})
    assert answer.json()["sample_sequence_ids"] == []
    user_failure(h, answer, ["num_samples=10000000", "from 1 to 8,192", "max_sampled_tokens=65,536"])
    assert time.monotonic() - started < 10, "refusing it took as long as building it"
    huge = h.post("/api/v1/asample", json={"sampling_session_id": sampler_id, "num_samples": 10 ** 30,
                                           "prompt": prompt, "sampling_params": {"max_tokens": 5}})
    assert_refused(huge, 400, ["$.num_samples", "64 bits"])


def test_a_seq_id_far_ahead_is_refused_naming_the_next_one(world):
    h = world["h"]
    sid = session(h)
    model_id = create_model(h, sid, "micro")
    far = h.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 2 ** 31 - 1, "adam_params": {}})
    user_failure(h, far, ["seq_id=2147483647", "next call is seq_id=1", "below 65"])
    ok = h.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": {}})
    assert "metrics" in result(h, ok.json()["request_id"]).json()  # the model is not wedged
    h.post(f"/api/v1/sessions/{sid}/finish", json={})


@pytest.mark.parametrize("name, fragment", [("a\x00b", "'a\\x00b'"), ("n" * 201, "at most 200 bytes"),
                                            ("é" * 101, "at most 200 bytes"), ("../up", "without '/'")])
def test_checkpoint_names_that_cannot_be_folders_are_user_errors(world, name, fragment):
    h = world["h"]
    answer = h.post("/api/v1/save_weights", json={"model_id": world["model"], "path": name})
    user_failure(h, answer, ["checkpoint name", fragment])


def test_metadata_past_its_size_is_a_user_error(world):
    h = world["h"]
    big = {f"k{i}": "v" * 1000 for i in range(20)}
    answer = h.post("/api/v1/create_model", json={"session_id": world["session"], "model_seq_id": 77,
                                                  "base_model": "micro", "user_metadata": big})
    user_failure(h, answer, ["user_metadata is", "at most 16,384"])


# ---------------------------------------------------------------------------- limits of a tenant

def test_refusals_count_against_the_tenants_records_and_never_echo_a_large_value(tmp_path, micro_model):
    cluster = LocalCluster(devices=1, checkpoint_dir=str(tmp_path / "scratch"))
    service = TinkerService(cluster, Store(tmp_path / "state"), {"micro": micro_model}, tenants(tmp_path, alice=ALICE, bob=BOB),
                      Limits(poll_hold_s=0.3, kept_per_tenant=4), edge=EdgeLimits(max_string_chars=5000))
    try:
        with served(service) as server, httpx.Client(base_url=server.url, headers={"X-API-Key": ALICE},
                                                     timeout=30) as alice, \
                httpx.Client(base_url=server.url, headers={"X-API-Key": BOB}, timeout=30) as bob:
            bad = {"session_id": session(alice), "model_seq_id": 0, "base_model": "m" * 4900}
            ids = [alice.post("/api/v1/create_model", json=bad) for _ in range(4)]
            assert all(a.status_code == 200 for a in ids)
            assert_refused(alice.post("/api/v1/create_model", json=bad), 429,
                           ["holds 4 requests", "most this server keeps (4)"])
            error = result(alice, ids[0].json()["request_id"]).json()["error"]
            assert "not served" in error and len(error) < 200, error  # the 4,900 characters are not echoed
            assert bob.post("/api/v1/create_session", json={}).status_code == 200  # bob's records are his own
            assert alice.post("/api/v1/create_model", json=bad).status_code == 200  # a retrieved one made room
    finally:
        cluster.close()


def test_a_tenants_queued_bytes_are_bounded(tmp_path, micro_model):
    cluster = LocalCluster(devices=1, checkpoint_dir=str(tmp_path / "scratch"))
    service = TinkerService(cluster, Store(tmp_path / "state"), {"micro": micro_model}, Tenants(),
                      Limits(poll_hold_s=0.3, queued_bytes_per_tenant=3000))
    try:
        with served(service) as server, httpx.Client(base_url=server.url, timeout=30) as h:
            model_id = create_model(h, session(h), "micro")
            held = [h.post("/api/v1/forward", content=proto(model_id, seq, length=100), headers=PROTOBUF)
                    for seq in (2, 3)]  # both wait for seq_id 1
            assert [a.status_code for a in held] == [200, 200]
            over = h.post("/api/v1/forward", content=proto(model_id, 4, length=100), headers=PROTOBUF)
            assert_refused(over, 429, ["bytes of requests queued", "(3,000)"])
            first = h.post("/api/v1/forward", content=proto(model_id, 1), headers=PROTOBUF)
            assert first.status_code == 200  # the one they wait for is let in past the limit
            for answer in (first, *held):
                assert result(h, answer.json()["request_id"]).headers["content-type"] == "application/x-protobuf"
    finally:
        cluster.close()


# ---------------------------------------------------------------------------- records

def test_a_surrogate_stored_by_an_older_server_never_breaks_a_listing(world):
    """A record written before metadata was checked (a lone surrogate, a torn JSON) is listed, its
    text escaped: never a 500 for every later listing of the tenant."""
    h = world["h"]
    db = sqlite3.connect(world["root"] / "state" / "plexrl.sqlite")
    now = time.time()
    for run_id, metadata in (("old-1", json.dumps({"k": "\ud800"})), ("old-2", "{torn")):
        db.execute("INSERT INTO runs VALUES (?,?,?,?,?,?,?,?,?,?)",
                   (run_id, "alice", "micro", 0, 1, 1, 0, metadata, now, now))
    db.commit()
    db.close()
    listing = h.get("/api/v1/training_runs", params={"limit": 100})
    assert listing.status_code == 200
    runs = {r["training_run_id"]: r for r in listing.json()["training_runs"]}
    assert runs["old-1"]["user_metadata"] == {"k": "\ud800"} and runs["old-2"]["user_metadata"] is None
    assert h.get("/api/v1/training_runs/old-1").status_code == 200
    assert h.get("/api/v1/training_runs/old-1/checkpoints").status_code == 200


def test_ids_are_unique_across_restarts_and_a_run_is_never_overwritten(tmp_path):
    first = Store(tmp_path)
    numbers = [first.next_number("session") for _ in range(3)]
    first.close()
    again = Store(tmp_path)  # a restarted server (or a second one on the same state directory)
    assert again.next_number("session") == numbers[-1] + 1 and numbers == [1, 2, 3]
    run = Run("s1-ab:train:0", "alice", "micro", 0, user_metadata={"a": "1"})
    again.add_run(run)
    with pytest.raises(RunExists, match="never reused"):
        again.add_run(Run("s1-ab:train:0", "bob", "micro", 0, user_metadata={"b": "2"}))
    assert again.run("alice", "s1-ab:train:0").user_metadata == {"a": "1"}
    assert again.run("bob", "s1-ab:train:0") is None
    again.close()


def test_lora_sampler_checkpoints_load_after_syncs_and_after_a_restart(tmp_path, micro_model):
    ids = [3, 4, 5, 6, 7]
    prompt = types.ModelInput.from_ints(ids)
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})

    def serve():
        cluster = LocalCluster(devices=1, checkpoint_dir=str(tmp_path / "scratch"))
        service = TinkerService(cluster, Store(tmp_path / "state"), {"micro": micro_model}, Tenants(),
                          Limits(poll_hold_s=0.5))
        return cluster, served(service)

    cluster, context = serve()
    with context as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=ALICE)
        training = client.create_lora_training_client("micro", rank=2, seed=1).result(T)
        training.forward_backward([datum], "cross_entropy").result(T)
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result(T)
        path = training.save_weights_for_sampler("early").result(T).path
        early = client.create_sampling_client(model_path=path).result(T).compute_logprobs(prompt).result(T)
        for _ in range(3):  # both snapshot slots rewritten since
            training.forward_backward([datum], "cross_entropy").result(T)
            training.optim_step(types.AdamParams(learning_rate=5e-2)).result(T)
            training.save_weights_and_get_sampling_client().result(T)
        later = client.create_sampling_client(model_path=path).result(T).compute_logprobs(prompt).result(T)
        assert later == early
        client.close("success").result(T)
    cluster.close()
    cluster, context = serve()
    with context as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=ALICE)
        restarted = client.create_sampling_client(model_path=path).result(T).compute_logprobs(prompt).result(T)
        assert restarted == early
        client.close("success").result(T)
    cluster.close()


def test_a_sessions_models_wait_together_and_say_since_when(tmp_path, tiny_model):
    """The cluster is full: a session's two models wait for admission as one job (the second
    joins the first's wait instead of failing), their polls say for what and since when, and both
    are created once room is made."""
    from plexrl.models.tiny import parameter_count

    room = parameter_count(tiny_model) * 16 * 3 // 2  # a trainer is 16 bytes a parameter
    with LocalCluster(devices=1, device_memory_bytes=room + reserve_bytes(tiny_model), host_memory_bytes=room,
                      checkpoint_dir=str(tmp_path / "scratch")) as cluster:
        service = TinkerService(cluster, Store(tmp_path / "state"), {"tiny": tiny_model}, Tenants(), Limits(poll_hold_s=0.3))
        with served(service) as server, httpx.Client(base_url=server.url, timeout=30) as h:
            holder = session(h)
            create_model(h, holder, "tiny")
            waiting = session(h)
            asked = [h.post("/api/v1/create_model", json={"session_id": waiting, "model_seq_id": seq,
                                                          "base_model": "tiny", "lora_config": {"rank": 0}})
                     for seq in (0, 1)]
            for answer in asked:
                poll = h.post("/api/v1/retrieve_future", json={"request_id": answer.json()["request_id"]}).json()
                assert poll["type"] == "try_again" and poll["queue_state"] == "paused_capacity", poll
                assert "room" in poll["queue_state_reason"] and "since" in poll["queue_state_reason"]
            h.post(f"/api/v1/sessions/{holder}/finish", json={})
            created = [result(h, a.json()["request_id"]).json() for a in asked]
            assert [c.get("model_id") for c in created] == [f"{waiting}:train:0", f"{waiting}:train:1"], created


# ---------------------------------------------------------------------------- anything on any route

ROUTES = [("POST", p) for p in ("client/config", "create_session", "session_heartbeat", "create_model", "get_info",
                                "optim_step", "save_weights", "load_weights", "save_weights_for_sampler",
                                "create_sampling_session", "asample", "retrieve_future", "weights_info",
                                "forward_backward", "forward", "sessions/{id}/finish")] + \
         [("GET", p) for p in ("healthz", "get_server_capabilities", "samplers/{id}", "training_runs",
                               "training_runs/{id}", "training_runs/{id}/checkpoints")] + \
         [("GET", f"/{p}") for p in ("metrics", "dashboard", "dashboard/data", "dashboard/static/{id}")] + \
         [("DELETE", "training_runs/{id}/checkpoints/{id}")]
FIELDS = ["session_id", "model_id", "model_seq_id", "seq_id", "base_model", "path", "request_id",
          "sampling_session_id", "sampling_session_seq_id", "prompt", "sampling_params", "adam_params",
          "lora_config", "num_samples", "optimizer", "tinker_path", "model_path", "user_metadata", "loss_fn"]
_text = st.text(max_size=12) | st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1,
                                        max_size=2) | st.just("\x00") | st.integers(0, 3000).map(lambda n: "x" * n)
_url = st.text(max_size=12) | st.just("\x00") | st.integers(0, 3000).map(lambda n: "x" * n)  # no surrogate: httpx cannot send one
_scalar = (st.none() | st.booleans() | st.integers() | st.integers(-10, 10) | st.floats() | _text
           | st.sampled_from(["micro", "tinker://x/weights/y", "encoded_text"]))
_json = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(FIELDS) | _text, inner, max_size=4), max_leaves=10)


@st.composite
def requests(draw, ids):
    method, path = draw(st.sampled_from(ROUTES))
    path = path.replace("{id}", quote(draw(st.sampled_from(ids) | _url.filter(str.strip)), safe=""))
    kind = draw(st.sampled_from(["json", "json", "raw", "deep", "proto"]))
    if kind == "json":
        fields = draw(st.dictionaries(st.sampled_from(FIELDS), st.sampled_from(ids) | _json, max_size=6) | _json)
        return method, path, {"content": json.dumps(fields).encode(), "params": draw(
            st.dictionaries(st.sampled_from(["limit", "offset"]), st.integers().map(str) | _url, max_size=2))}
    if kind == "deep":
        return method, path, {"content": b"[" * draw(st.integers(1, 5000))}
    if kind == "proto":
        tensors = draw(st.dictionaries(st.sampled_from(["weights", "target_tokens", "advantages"]),
                                       st.integers(0, 1 << 20).map(sparse), max_size=3))
        body = proto(draw(st.sampled_from(ids)), draw(st.integers(-5, 40) | st.integers(-2 ** 31, 2 ** 31 - 1)), tensors)
        cut = draw(st.integers(0, len(body)))
        return method, path, {"content": body[:cut] if draw(st.booleans()) else body, "headers": PROTOBUF}
    return method, path, {"content": draw(st.binary(max_size=256))}


class Probe:
    """Another tenant's light calls, one after another in a thread while the fuzzing runs: each
    must be answered, and answered within `deadline_s` (a hang bound, not a speed target)."""

    def __init__(self, url: str, deadline_s: float = 10.0):
        self.url, self.deadline_s = url, deadline_s
        self.slowest, self.answered, self.failures = 0.0, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, headers={"X-API-Key": BOB}, timeout=self.deadline_s) as h:
            sid = session(h)
            while not self._stop.is_set() and self.answered < 100_000:
                started = time.monotonic()
                try:
                    answers = [h.post("/api/v1/session_heartbeat", json={"session_id": sid}),
                               h.get("/api/v1/training_runs")]
                    if any(a.status_code != 200 for a in answers):
                        self.failures.append([a.text[:200] for a in answers])
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                self.slowest = max(self.slowest, time.monotonic() - started)
                self.answered += 1
                self._stop.wait(0.02)

    def __enter__(self) -> "Probe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(self.deadline_s * 3)


@pytest.fixture(scope="module")
def probe(world):
    with Probe(world["url"]) as running:
        yield running
    assert not running.failures, running.failures[:3]
    assert running.answered > 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_anything_on_any_route_gets_a_clean_4xx_and_never_stalls_another_tenant(world, probe, data):
    h = world["h"]
    ids = [world["session"], world["model"], f"{world['session']}:sample:0", "r1-000000000000"]
    method, path, kwargs = data.draw(requests(ids))
    answer = h.request(method, path if path.startswith("/") else f"/api/v1/{path}", **kwargs)
    assert_clean(answer)
    assert not probe.failures, probe.failures[:3]
