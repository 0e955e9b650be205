"""`/metrics` of `plexrl serve` read as Prometheus reads it (prometheus_client's parser), against
`cluster.metrics()` and the event log of the same quiet cluster; who may read it; the operator
key's line in the key file."""

from __future__ import annotations

import os
from collections import Counter

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tinker import types  # noqa: E402

from plexrl.api import errors  # noqa: E402
from plexrl.engines.local import LocalCluster  # noqa: E402
from plexrl.runtime.activity import BUCKETS_S  # noqa: E402
from plexrl.serve.app import create_app  # noqa: E402
from plexrl.serve.limits import Limits  # noqa: E402
from plexrl.serve.server import Server  # noqa: E402
from plexrl.serve.service import TinkerService  # noqa: E402
from plexrl.serve.store import Store  # noqa: E402
from plexrl.serve.tenants import Tenants  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")

ALICE = "tml-alice-0123456789abcdef"
BOB = "tml-bob-0123456789abcdefgh"
OPERATOR = "tml-operator-0123456789abcd"
T = 120


def key_file(folder, *lines: str) -> Tenants:
    path = folder / "keys.txt"
    path.write_text("# tenants and the operator\n" + "".join(f"{line}\n" for line in lines))
    return Tenants.from_file(path)


def train(url: str, key: str, model: str, steps: int) -> None:
    """`steps` forward_backward + optim_step of a fresh session (a job of its own)."""
    client = tinker.ServiceClient(base_url=url, api_key=key)
    try:
        training = client.create_lora_training_client(model, rank=0, seed=1).result(T)
        ids = training.get_tokenizer().encode("12+34=46")
        datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
        for _ in range(steps):
            training.forward_backward([datum], "cross_entropy").result(T)
            training.optim_step(types.AdamParams(learning_rate=1e-3)).result(T)
    finally:
        client.close("success").result(T)


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("observe")
    cluster = LocalCluster(devices=2, checkpoint_dir=str(root / "scratch"))
    tenants = key_file(root, f"alice {ALICE}", f"bob {BOB}", f"@operator {OPERATOR}")
    service = TinkerService(cluster, Store(root / "state"), {tiny_model: tiny_model}, tenants, Limits(poll_hold_s=1.0))
    server = Server(create_app(service)).start()
    for key in (ALICE, BOB):
        train(server.url, key, tiny_model, steps=2)
    yield {"url": server.url, "service": service, "cluster": cluster}
    server.stop()
    service.close()
    cluster.close()


def scrape(world, key: str | None = OPERATOR) -> httpx.Response:
    with httpx.Client(base_url=world["url"], timeout=30) as h:
        return h.get("/metrics", headers={"X-API-Key": key} if key else {})


def samples(text: str) -> dict[tuple, float]:
    """(sample name, sorted labels) -> value, every sample of the exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_match_the_clusters_own(world):
    answer = scrape(world)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    got = samples(answer.text)
    m = world["cluster"].metrics()
    events = world["cluster"].events()
    assert set(m["jobs"]) == {s.job for s in world["service"].sessions.values()} and len(m["jobs"]) == 2
    for job, usage in m["jobs"].items():
        node = str(usage["placement"]["node"])
        for key, name in (("consumed_device_s", "plexrl_job_consumed_device_seconds_total"),
                          ("switch_s", "plexrl_job_switch_seconds_total"), ("requests", "plexrl_job_requests_total"),
                          ("queue_wait_s", "plexrl_job_queue_wait_seconds_total")):
            assert got[(name, (("job", job), ("node", node)))] == usage[key], (name, job)
    for device, busy in m["device_busy_s_per_device"].items():
        assert got[("plexrl_device_busy_seconds_total", (("device", str(device)), ("node", "0")))] == busy
    for kind, n in m["transitions"].items():
        assert got[("plexrl_transitions_total", (("kind", kind),))] == n
    assert got[("plexrl_switches_total", ())] == m["switches"] > 0
    assert got[("plexrl_uptime_seconds", ())] > 0 and got[("plexrl_devices", ())] == 2
    tenants = {s.job: s.tenant for s in world["service"].sessions.values()}
    for job, tenant in tenants.items():
        assert got[("plexrl_job_info", (("job", job), ("tenant", tenant)))] == 1
    # the histograms count what the event log holds
    ends = Counter(e["job"] for e in events if e["event"] == "end")
    for job, n in ends.items():
        assert got[("plexrl_request_latency_seconds_count", (("job", job), ("node", "0")))] == n
        assert got[("plexrl_request_latency_seconds_bucket", (("job", job), ("le", "+Inf"), ("node", "0")))] == n
        assert got[("plexrl_queueing_delay_seconds_count", (("job", job), ("node", "0")))] == n
    switches = Counter(e["device"] for e in events
                       if e["event"] == "transition" and e["kind"] in ("load", "offload") and e["device"] is not None)
    assert switches
    for device, n in switches.items():
        labels = (("device", str(device)), ("node", "0"))
        assert got[("plexrl_switch_seconds_count", labels)] == n
        seconds = sum(e["seconds"] for e in events if e["event"] == "transition"
                      and e["device"] == device and e["kind"] in ("load", "offload"))
        assert got[("plexrl_switch_seconds_sum", labels)] == pytest.approx(seconds)
    bucket = f"{BUCKETS_S[0]:g}"  # cumulative buckets never decrease
    for (name, labels), value in got.items():
        if name.endswith("_bucket") and ("le", bucket) in labels:
            rest = dict(labels)
            rest["le"] = "+Inf"
            assert value <= got[(name, tuple(sorted(rest.items())))]


def test_only_the_operator_reads_metrics_and_dashboard_data(world):
    jobs = list(world["cluster"].metrics()["jobs"])
    for path in ("/metrics", "/dashboard/data"):
        with httpx.Client(base_url=world["url"], timeout=30) as h:
            for key, status in ((None, 401), ("tml-mallory-0123456789abcdef", 401), (ALICE, 403), (BOB, 403)):
                answer = h.get(path, headers={"X-API-Key": key} if key else {})
                assert answer.status_code == status, (path, key)
                assert "operator" in answer.json()["detail"]
                assert not any(job in answer.text for job in jobs)
            assert h.get(path, headers={"Authorization": f"Bearer {OPERATOR}"}).status_code == 200
            assert h.get(path, headers={"X-API-Key": OPERATOR}).status_code == 200
    # the operator's key is nobody's tenant key: it opens no session
    with httpx.Client(base_url=world["url"], timeout=30, headers={"X-API-Key": OPERATOR}) as h:
        answer = h.post("/api/v1/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "0.38.0"})
        assert answer.status_code == 401


def test_the_page_and_its_files_are_served_here(world):
    with httpx.Client(base_url=world["url"], timeout=30) as h:
        page = h.get("/dashboard")
        assert page.status_code == 200 and "<script src=\"/dashboard/static/dashboard.js\">" in page.text
        assert "http" not in page.text.replace("http://www.w3.org", "")  # nothing from elsewhere
        for name in ("dashboard.js", "dashboard.css"):
            answer = h.get(f"/dashboard/static/{name}")
            assert answer.status_code == 200 and answer.text
            assert "https://" not in answer.text
        assert h.get("/dashboard/static/..%2Fweb.py").status_code == 404
        assert h.get("/dashboard/data?window=-1", headers={"X-API-Key": OPERATOR}).status_code == 400


@pytest.mark.parametrize("lines, message", [
    (["alice tml-alice-0123456789abcdef", "@operator tml-alice-0123456789abcdef"], "earlier line"),
    (["alice tml-alice-0123456789abcdef", "@operator short"], "at least 16"),
    (["@operator tml-operator-0123456789abcd"], "no 'TENANT KEY' lines"),
    (["@boss tml-operator-0123456789abcd"], "@operator"),
])
def test_operator_key_lines_refused_naming_the_line(tmp_path, lines, message):
    with pytest.raises(errors.ConfigError, match=message):
        key_file(tmp_path, *lines)


def test_operator_keys_and_tenant_keys_are_apart(tmp_path):
    tenants = key_file(tmp_path, f"alice {ALICE}", f"@operator {OPERATOR}")
    assert tenants.is_operator(OPERATOR) and not tenants.is_operator(ALICE) and not tenants.is_operator(None)
    assert tenants.tenant_of(OPERATOR) is None and tenants.tenant_of(ALICE) == "alice"
    assert Tenants().is_operator(None)  # a server without keys binds loopback only: its operator is whoever is there


def test_shipped_grafana_dashboard_reads_metrics_that_exist(world):
    """Every `plexrl_` series the Grafana dashboard's queries name is one the server exports."""
    import json
    import re
    from pathlib import Path

    board = json.loads((Path(__file__).parents[1] / "docs" / "observe" / "grafana-dashboard.json").read_text())
    exported = {s.name for family in text_string_to_metric_families(scrape(world).text) for s in family.samples}
    exported |= {f.name for f in text_string_to_metric_families(scrape(world).text)}
    named = {name for panel in board["panels"] for target in panel["targets"]
             for name in re.findall(r"plexrl_\w+", target["expr"])}
    assert len(named) >= 10
    assert named <= exported, sorted(named - exported)


def test_dashboard_command_shows_a_running_server(world, tmp_path):
    """`plexrl dashboard --url URL --key-file FILE`: the server's data, through the operator's key."""
    from fastapi.testclient import TestClient

    from plexrl.observe.cli import build_app, parse

    (tmp_path / "operator.key").write_text(OPERATOR + "\n")
    (tmp_path / "tenant.key").write_text(ALICE + "\n")
    with httpx.Client(base_url=world["url"], timeout=30, headers={"X-API-Key": OPERATOR}) as h:
        direct = h.get("/dashboard/data", params={"window": 600}).json()
    with TestClient(build_app(parse(["--url", world["url"], "--key-file", str(tmp_path / "operator.key")]))) as h:
        relayed = h.get("/dashboard/data", params={"window": 600}).json()
    assert relayed["jobs"] == direct["jobs"] and len(relayed["jobs"]) == 2
    assert [d["device"] for d in relayed["devices"]] == [0, 1]
    with TestClient(build_app(parse(["--url", world["url"], "--key-file", str(tmp_path / "tenant.key")]))) as h:
        refused = h.get("/dashboard/data")
    assert refused.status_code == 403 and "operator" in refused.json()["detail"]
