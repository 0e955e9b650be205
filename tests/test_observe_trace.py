"""`plexrl trace` on a real cluster's event log (two jobs switching on one device): the trace's
slices, flows and controller tracks against the log's own records; and what the dashboard reads
from that log (`plexrl dashboard --events`) against the live cluster's `metrics()` and `recent()`."""

from __future__ import annotations

import json
import threading
from collections import Counter, defaultdict

import pytest

import plexrl
from plexrl import cli
from plexrl.observe import dashboard
from plexrl.observe.perfetto import DEVICES, JOBS, device_tid, transfers_tid
from plexrl.runtime.activity import replay
from tests.helpers import rl_job

MiB = 1 << 20


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model):
    """Two jobs on one device with room for one trainer and a snapshot: they keep switching."""
    root = tmp_path_factory.mktemp("trace")
    with plexrl.LocalCluster(devices=1, device_memory_bytes=64 * MiB, host_memory_bytes=256 * MiB) as alone:
        trainer = rl_job(alone, "probe", tiny_model, seed=1, steps=1)
        state_bytes, reserve = trainer.state.device_bytes, trainer.state.activation_reserve_bytes
    budget = state_bytes + state_bytes // 4 + 4096 + reserve
    log = root / "events.jsonl"
    with plexrl.LocalCluster(devices=1, device_memory_bytes=budget, host_memory_bytes=256 * MiB,
                             event_log=str(log)) as cluster:
        threads = [threading.Thread(target=rl_job, args=(cluster, job, tiny_model, seed), kwargs={"steps": 2})
                   for job, seed in (("job-a", 1), ("job-b", 2))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads)
        metrics, recent, events = cluster.metrics(), cluster.recent(3600.0), cluster.events()
    out = root / "trace.json"
    assert cli.main(["trace", str(log), "-o", str(out)]) == 0
    return {"log": log, "events": events, "metrics": metrics, "recent": recent,
            "trace": json.loads(out.read_text())["traceEvents"]}


def us(t: float, origin: float) -> float:
    return round((t - origin) * 1e6, 3)


def test_every_call_is_a_slice_on_its_device(run):
    events, trace = run["events"], run["trace"]
    origin = min(e["t"] for e in events)
    starts = {e["request_id"]: e for e in events if e["event"] == "start"}
    expected = sorted((e["device"], us(starts[e["request_id"]]["t"], origin), e["fn"], e["job"])
                      for e in events if e["event"] == "end" and e["device"] is not None)
    got = sorted((x["tid"] // 2, x["ts"], x["name"], x["args"]["job"]) for x in trace
                 if x["ph"] == "X" and x["pid"] == DEVICES and x["cat"] == "call")
    assert got == expected and len(got) > 10
    assert {x["args"]["job"] for x in trace if x.get("cat") == "call"} == {"job-a", "job-b"}


def test_switches_and_prefetches_are_slices_of_their_own(run):
    events, trace = run["events"], run["trace"]
    moves = [e for e in events if e["event"] == "transition" and e["kind"] in ("load", "offload")
             and e["device"] is not None]
    switches = Counter((e["job"], e["kind"]) for e in moves if "hidden_s" not in e)
    assert sum(switches.values()) >= 4 and {job for job, _ in switches} == {"job-a", "job-b"}
    got = Counter((x["args"]["job"], x["name"]) for x in trace if x.get("cat") == "switch")
    assert got == switches
    prefetched = sum(1 for e in moves if "hidden_s" in e)
    assert sum(1 for x in trace if x.get("cat") == "prefetch") == prefetched


def test_a_device_thread_never_holds_overlapping_slices(run):
    lanes = defaultdict(list)
    for x in run["trace"]:
        if x["ph"] == "X" and x["pid"] == DEVICES and x["tid"] % 2 == 0:
            lanes[x["tid"]].append((x["ts"], x["ts"] + x["dur"]))
    assert lanes
    for lane in lanes.values():
        lane.sort()
        assert all(a[1] <= b[0] + 1e-3 for a, b in zip(lane, lane[1:]))


def test_queueing_flows_run_from_arrival_to_start(run):
    events, trace = run["events"], run["trace"]
    origin = min(e["t"] for e in events)
    arrivals = {e["request_id"]: e["t"] for e in events if e["event"] == "arrival"}
    starts = {e["request_id"]: e for e in events if e["event"] == "start" and e["device"] is not None}
    flows = {(x["ph"], x["id"]): x for x in trace if x.get("cat") == "queue" and x["ph"] in "sf"}
    assert {i for _, i in flows} == set(starts) & set(arrivals)
    for rid, start in starts.items():
        assert flows[("s", rid)]["ts"] == us(arrivals[rid], origin) and flows[("s", rid)]["pid"] == JOBS
        assert flows[("f", rid)]["ts"] == us(start["t"], origin)
        assert flows[("f", rid)]["tid"] == device_tid(start["device"])


def test_each_controller_has_a_track_with_its_idle_gaps(run):
    trace = run["trace"]
    names = {x["tid"]: x["args"]["name"] for x in trace if x["ph"] == "M" and x["pid"] == JOBS and "tid" in x}
    assert sorted(names.values()) == ["job-a controller", "job-b controller"]
    for tid in names:
        slices = sorted((x["ts"], x["dur"], x["name"]) for x in trace
                        if x["ph"] == "X" and x["pid"] == JOBS and x["tid"] == tid)
        kinds = [name for _, _, name in slices]
        assert kinds[0] == kinds[-1] == "waiting on the cluster" and "idle" in kinds
        assert all(a != b for a, b in zip(kinds, kinds[1:]))  # busy and idle alternate
        steps = [x for x in trace if x["ph"] == "i" and x["tid"] == tid]
        assert len(steps) == 2
    device_names = {x["args"]["name"] for x in trace if x["ph"] == "M" and x["pid"] == DEVICES}
    assert {"device 0", "device 0 transfers"} <= device_names and transfers_tid(0) == 1


def test_the_log_read_back_gives_the_live_clusters_activity(run):
    live = run["recent"]
    again = replay(run["events"]).recent(float("-inf"))
    assert {d: sorted(map(tuple, v["spans"])) for d, v in again["lanes"].items()} == \
           {d: sorted(map(tuple, v["spans"])) for d, v in live["lanes"].items()}
    assert again["jobs"] == live["jobs"]
    hist = lambda records: sorted((h["name"], h["job"], h["device"], tuple(h["counts"])) for h in records)
    assert hist(replay(run["events"]).summary()["histograms"]) == hist(run["metrics"]["histograms"])


def test_the_dashboard_from_the_log_matches_the_clusters_metrics(run):
    m = run["metrics"]
    offline = dashboard.from_events(run["events"], window_s=3600.0)
    online = dashboard.live(m, run["recent"], 3600.0)
    for doc in (offline, online):
        jobs = {j["job"]: j for j in doc["jobs"]}
        assert set(jobs) == {"job-a", "job-b"}
        for job, j in jobs.items():
            assert j["consumed_device_s"] == pytest.approx(m["jobs"][job]["consumed_device_s"], rel=1e-6)
            assert 0 < j["cost_ratio"] < 1
        busy = {d["device"]: d["busy_s"] for d in doc["devices"]}
        assert busy[0] == pytest.approx(m["device_busy_s_per_device"][0], rel=1e-6)
        assert doc["totals"]["switches"] == m["switches"]
    assert [j["states"] for j in offline["jobs"]] == [j["states"] for j in online["jobs"]]
    assert offline["devices"][0]["spans"] == online["devices"][0]["spans"] or \
        sorted(map(tuple, offline["devices"][0]["spans"])) == sorted(map(tuple, online["devices"][0]["spans"]))


def test_metrics_port_serves_metrics_and_dashboard_of_a_running_cluster(tiny_model):
    """What `plexrl run/demo --metrics-port` serves, on a cluster at work (no keys: loopback only)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from plexrl.observe.web import watched

    with plexrl.LocalCluster(devices=1) as cluster, watched(cluster, 0) as server:
        rl_job(cluster, "job-a", tiny_model, seed=1, steps=1)
        with httpx.Client(base_url=server.url, timeout=30) as h:
            text = h.get("/metrics").text
            doc = h.get("/dashboard/data", params={"window": 600}).json()
            assert h.get("/dashboard").status_code == 200
        m = cluster.metrics()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(text) for s in f.samples}
    assert got[("plexrl_job_consumed_device_seconds_total", (("job", "job-a"), ("node", "0")))] == \
        m["jobs"]["job-a"]["consumed_device_s"]
    assert [j["job"] for j in doc["jobs"]] == ["job-a"]
    assert {s[2] for s in doc["devices"][0]["spans"]} == {"job-a"}


def test_dashboard_command_serves_a_log(run, tmp_path):
    """`plexrl dashboard --events FILE`: the page's data is `from_events` of the file, followed as it grows."""
    from fastapi.testclient import TestClient

    from plexrl.observe.cli import build_app, parse

    log = tmp_path / "events.jsonl"
    lines = run["log"].read_text().splitlines(keepends=True)
    log.write_text("".join(lines[: len(lines) // 2]))
    with TestClient(build_app(parse(["--events", str(log)]))) as h:
        first = h.get("/dashboard/data", params={"window": 3600}).json()
        with log.open("a") as f:
            f.write("".join(lines[len(lines) // 2:]))
        whole = h.get("/dashboard/data", params={"window": 3600}).json()
        assert h.get("/metrics").status_code == 404  # a log has no live counters to scrape
    assert first["now"] < whole["now"]
    assert whole == json.loads(json.dumps(dashboard.from_events(run["events"], 3600.0)))
