"""The event log's activity (runtime/activity.py): histograms, queues and lanes kept as records go
by, on hand-written records."""

from __future__ import annotations

import pytest

from plexrl.runtime import activity
from plexrl.runtime.activity import BUCKETS_S, Activity


def call(a: Activity, rid: int, job: str, arrival: float, dispatch: float, start: float, end: float,
         device: int = 0) -> None:
    base = {"request_id": rid, "job": job, "model": f"{job}/m", "fn": "forward"}
    a.observe({"t": arrival, "event": "arrival", **base, "group": 0})
    a.observe({"t": dispatch, "event": "dispatch", **base, "device": device, "node": 0})
    a.observe({"t": start, "event": "start", **base, "device": device, "node": 0})
    a.observe({"t": end, "event": "end", **base, "device": device, "node": 0, "ok": True})


def counts(a: Activity, name: str, job=None, device=None) -> list[int]:
    return a.histograms[(name, 0, job, device)].counts


def test_histograms_count_waits_latencies_and_switches():
    a = Activity()
    call(a, 1, "a", 0.0, 0.0005, 0.001, 0.2)
    call(a, 2, "a", 0.0, 3.0, 3.5, 4.0)
    a.observe({"t": 3.0, "event": "transition", "kind": "load", "state": "a/m", "job": "a", "device": 0, "node": 0,
               "bytes": 10, "seconds": 0.5})
    waits, latencies = counts(a, "queueing_delay_s", "a"), counts(a, "request_latency_s", "a")
    assert sum(waits) == sum(latencies) == 2
    assert waits[0] == 1 and waits[BUCKETS_S.index(5.0)] == 1  # 0.5 ms, and 3 s (in (2.5, 5])
    assert latencies[BUCKETS_S.index(0.25)] == 1 and latencies[BUCKETS_S.index(5.0)] == 1
    assert counts(a, "switch_s", None, 0)[BUCKETS_S.index(0.5)] == 1
    assert a.histograms[("queueing_delay_s", 0, "a", None)].sum == pytest.approx(3.0005)
    assert a.summary()["queued"] == {0: 0}


def test_queued_until_dispatched_and_a_refused_request_waited_all_the_same():
    a = Activity()
    a.observe({"t": 0.0, "event": "arrival", "request_id": 1, "job": "a", "fn": "forward", "group": 0})
    a.observe({"t": 0.0, "event": "arrival", "request_id": 2, "job": "b", "fn": "forward", "group": 0})
    assert a.summary()["queued"] == {0: 2}
    a.observe({"t": 2.0, "event": "end", "request_id": 2, "job": "b", "fn": "forward", "device": None, "ok": False})
    assert a.summary()["queued"] == {0: 1}
    assert sum(a.histograms[("queueing_delay_s", None, "b", None)].counts) == 1
    assert a.recent(0.0)["lanes"] == {}  # it never ran: no span


def test_lanes_keep_time_order_and_their_bound(monkeypatch):
    monkeypatch.setattr(activity, "LANE_KEPT", 4)
    a = Activity()
    for rid in range(6):
        call(a, rid, "ab"[rid % 2], float(rid), float(rid), float(rid), rid + 0.5)
    # a prefetch logged after the call that began at 5 had ended: put in its place
    a.observe({"t": 4.2, "event": "transition", "kind": "load", "state": "a/m", "job": "a", "device": 0, "node": 0,
               "bytes": 1, "seconds": 0.1, "hidden_s": 0.1})
    spans = a.recent(0.0)["lanes"][0]["spans"]
    assert len(spans) == 4 and [s[0] for s in spans] == sorted(s[0] for s in spans)
    assert (4.2, 4.3, "a", "load", "prefetch") in [tuple(round(x, 6) if isinstance(x, float) else x for x in s)
                                                   for s in spans]
    assert [s[0] for s in a.recent(4.6)["lanes"][0]["spans"]] == [5.0]
    assert a.recent(0.0)["jobs"] == {"a": (0.0, 4.5), "b": (1.0, 5.5)}
