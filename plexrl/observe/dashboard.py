"""What the dashboard shows, as one JSON document: from a running cluster (`live`) or from an event
log read back (`from_events`), in the same layout, so the page cannot tell them apart.

    now, window_s        the clock (seconds since the cluster started) and the lanes' width
    devices[]            per device: node, busy_s (all time), spans [t0, t1, job, what, kind] of
                         the window, kind one of call | switch | prefetch, what a function or a
                         transition kind
    queues[]             per node group: requests queued now
    jobs[]               per job: consumed_device_s, dedicated_device_s (its node group's devices
                         held from its first arrival to its latest end, what owning them would
                         cost), cost_ratio (consumed / dedicated), slowdown (measured step
                         slowdown, null until measured), slack, states {device, host, disk},
                         requests, queue_wait_s, tenant (serve only)
    totals               uptime_s, switches, device_busy_s, queued
"""

from __future__ import annotations

from collections import defaultdict

from plexrl.observe.prometheus import device_node, state_job
from plexrl.policy.profile import held_s
from plexrl.runtime.activity import SWITCH_KINDS, replay

WINDOW_S = 120.0  # the lanes show the last two minutes unless asked otherwise


def live(metrics: dict, recent: dict, window_s: float = WINDOW_S, tenants: dict[str, str] | None = None) -> dict:
    """From `cluster.metrics()` and `cluster.recent(window_s)`."""
    per_node = max(1, metrics["devices"] // max(1, metrics["nodes"]))
    states = _tiers({sid: where.split(":", 1)[0] for sid, where in metrics["residency"].items()})
    jobs = []
    for job, usage in sorted(metrics["jobs"].items()):
        placed = metrics["placement"].get(job, {})
        first, last = recent["jobs"].get(job, (recent["now"], recent["now"]))
        jobs.append(_job(job, usage["consumed_device_s"], per_node * max(0.0, last - first), placed.get("slack"),
                         placed.get("measured_inflation"), states.get(job, {}), usage.get("requests", 0),
                         usage.get("queue_wait_s", 0.0), (tenants or {}).get(job)))
    busy = metrics["device_busy_s_per_device"]
    devices = [{"device": d, "node": int(device_node(metrics, d)), "busy_s": busy.get(d, 0.0),
                "spans": [list(s) for s in recent["lanes"].get(d, {}).get("spans", [])]}
               for d in sorted(set(range(metrics["devices"])) | set(busy))]  # an idle device: an empty lane
    queues = [{"node": g, "queued": metrics["queued"].get(g, 0)} for g in range(metrics["nodes"])]
    return _document(recent["now"], window_s, devices, queues, jobs, metrics["uptime_s"], metrics["switches"],
                     metrics["device_busy_s"])


def from_events(records: list[dict], window_s: float = WINDOW_S, devices_per_node: int | None = None) -> dict:
    """From an event log (a finished run's, or one still being written): the lanes end at its last
    record. A device's node is the one its records name; `devices_per_node` (default: as many as
    the log shows on one node) sizes what a job would have held dedicated."""
    records = sorted(records, key=lambda r: r["t"])
    now = records[-1]["t"] if records else 0.0
    activity = replay(records)
    seen = activity.recent(now - window_s)
    exec_s, switch_s, busy, requests, waited = (defaultdict(float), defaultdict(float), defaultdict(float),
                                                defaultdict(int), defaultdict(float))
    tiers: dict[str, str] = {}
    node_devices: dict[int, set] = defaultdict(set)
    dispatched: dict[int, float] = {}
    arrivals: dict[int, float] = {}
    for r in records:
        kind, device = r["event"], r.get("device")
        if device is not None and r.get("node") is not None:
            node_devices[r["node"]].add(device)
        if kind == "arrival":
            arrivals[r["request_id"]] = r["t"]
        elif kind in ("dispatch", "start") and r["request_id"] in arrivals and r["request_id"] not in dispatched:
            dispatched[r["request_id"]] = r["t"]
            waited[r["job"]] += r["t"] - arrivals[r["request_id"]]
            requests[r["job"]] += 1
        elif kind == "end" and device is not None and r.get("ok", True):
            exec_s[r["job"]] += r.get("device_s", 0.0)
            busy[device] += r.get("device_s", 0.0)
        elif kind == "transition":
            _moved(tiers, r)
            if device is not None and r["kind"] in SWITCH_KINDS:
                switch_s[r["job"]] += held_s(r)
                busy[device] += held_s(r)
        elif kind == "state_added":
            tiers[r["state"]] = "host"
        elif kind == "state_removed":
            tiers.pop(r["state"], None)
    per_node = devices_per_node or max([len(d) for d in node_devices.values()] or [1])
    states = _tiers(tiers)
    jobs = [_job(job, exec_s[job] + switch_s[job], per_node * max(0.0, last - first), None, None,
                 states.get(job, {}), requests[job], waited[job], None)
            for job, (first, last) in sorted(seen["jobs"].items())]
    node_of = {d: node for node, ds in node_devices.items() for d in ds}
    devices = [{"device": d, "node": node_of.get(d, 0), "busy_s": busy[d],
                "spans": [list(s) for s in seen["lanes"].get(d, {}).get("spans", [])]}
               for d in sorted(set(busy) | set(seen["lanes"]))]
    queued = activity.summary()["queued"]
    queues = [{"node": g, "queued": queued.get(g, 0)} for g in sorted(set(node_devices) | set(queued))]
    switches = sum(1 for r in records if r["event"] == "transition" and r["kind"] == "load")
    return _document(now, window_s, devices, queues, jobs, now, switches, sum(busy.values()))


def _moved(tiers: dict[str, str], r: dict) -> None:
    kind = r["kind"]
    if kind == "load":
        tiers[r["state"]] = "device"
    elif kind in ("offload", "restore"):
        tiers[r["state"]] = "host"
    elif kind == "spill":
        tiers[r["state"]] = "disk"


def _tiers(where: dict[str, str]) -> dict[str, dict[str, int]]:
    """job -> {device, host, disk: states there}."""
    out: dict[str, dict[str, int]] = {}
    for state_id, tier in where.items():
        counts = out.setdefault(state_job(state_id), {"device": 0, "host": 0, "disk": 0})
        counts[tier] = counts.get(tier, 0) + 1
    return out


def _job(job: str, consumed: float, dedicated: float, slack, slowdown, states: dict, requests: int,
         queue_wait_s: float, tenant) -> dict:
    return {"job": job, "consumed_device_s": consumed, "dedicated_device_s": dedicated,
            "cost_ratio": consumed / dedicated if dedicated > 0 else None, "slack": slack, "slowdown": slowdown,
            "states": {tier: states.get(tier, 0) for tier in ("device", "host", "disk")}, "requests": requests,
            "queue_wait_s": queue_wait_s, "tenant": tenant}


def _document(now: float, window_s: float, devices: list, queues: list, jobs: list, uptime_s: float,
              switches: int, busy_s: float) -> dict:
    return {"now": now, "window_s": window_s, "devices": devices, "queues": queues, "jobs": jobs,
            "totals": {"uptime_s": uptime_s, "switches": switches, "device_busy_s": busy_s,
                       "queued": sum(q["queued"] for q in queues)}}
