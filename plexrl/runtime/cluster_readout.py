"""What a cluster reports of itself: events, metrics, residency, the dashboard's spans.

One readout for every engine and every front: it asks the control plane (its events, its
summary: lost groups, recovery counts, placements, the clock) and every node not lost (their
telemetry summaries and events), and merges them. Invariants: lost nodes are never asked (their
calls would hang or fail); events are on one time axis, sorted by time; counters of the nodes
add up (`merge_summaries`) and `metrics()` has one layout on every engine (docs/reference/metrics.md).
"""

from __future__ import annotations

from pathlib import Path

from plexrl.runtime import remote
from plexrl.runtime.control_plane import ControlPlane
from plexrl.runtime.events import write_jsonl

SUMMED = ("switches", "device_busy_s", "transition_bytes", "transition_s",
          "writebacks", "writeback_bytes", "writeback_zeroed_bytes", "writeback_s",
          "prefetches", "prefetch_bytes", "prefetch_s", "prefetch_exposed_s")


class ClusterReadout:
    """`identity`: what metrics() says of the cluster itself (policy, devices, nodes, engine,
    read_replicas), in that order."""

    def __init__(self, plane: ControlPlane, nodes: list, identity: dict):
        self.plane, self.nodes, self.identity = plane, nodes, identity

    def live_nodes(self, lost: dict | None = None) -> list:
        """The nodes not lost (`lost`: the control plane's lost groups, asked for when not given)."""
        lost = self.plane.lost_groups() if lost is None else lost
        return [node for group, node in enumerate(self.nodes) if group not in lost]

    def node_states(self) -> list[list[str]]:
        """The state ids each node's StateManager holds (affinity checks)."""
        lost = self.plane.lost_groups()
        return [[] if g in lost else remote.get(n.state_ids.remote()) for g, n in enumerate(self.nodes)]

    def residency(self) -> dict[str, str]:
        """Where each state is: 'device:N', 'host' or 'disk'."""
        return {sid: tier for n in self.live_nodes() for sid, tier in remote.get(n.summary.remote())["residency"].items()}

    def events(self, job: str | None = None, since: float | None = None) -> list[dict]:
        """The cluster's events on one time axis (only `job`'s when given: filtered where they live;
        with `since`, only what a profile of its steps from `since` on reads: `EventLog.snapshot`)."""
        merged = self.plane.events(job, since)
        for part in remote.get([n.events.remote(job, since) for n in self.live_nodes()]):
            merged += part
        return sorted(merged, key=lambda e: e["t"])

    def recent(self, window_s: float) -> dict:
        """What the dashboard draws (plexrl/observe): per device, its spans of the last `window_s`
        seconds (calls, switches, prefetches); per job, its first arrival and latest end; the clock."""
        now = self.plane.summary()["now"]
        lanes, jobs = {}, {}
        for part in remote.get([n.recent.remote(now - window_s) for n in self.live_nodes()]):
            lanes.update(part["lanes"])
            for job, (first, last) in part["jobs"].items():  # a job that moved has records on two nodes
                seen = jobs.get(job, (first, last))
                jobs[job] = (min(seen[0], first), max(seen[1], last))
        return {"now": now, "lanes": lanes, "jobs": jobs}

    def write_events(self, path: str | Path) -> Path:
        """Every node's events and the control plane's, on one time axis, as JSON lines."""
        return write_jsonl(self.events(), path)

    def metrics(self) -> dict:
        """One layout on every engine: the nodes' counters summed, per job usage with its
        placement, admission (jobs waiting), recovery counts, migrations."""
        control = self.plane.summary()
        out = merge_summaries(remote.get([n.summary.remote() for n in self.live_nodes(control["lost"])]))
        out["recovery"] = _add_counts([out["recovery"], control["recovery"]])
        placements = control["placements"]
        for job, usage in out["jobs"].items():
            placed = placements.get(job, {})
            usage["placement"] = {**placed, "node": placed.get("group")}
            usage["phase_shift_s"] = placed.get("phase_shift_s")
            usage["queueing_delay_s"] = placed.get("queueing_delay_s", 0.0)
        out.update(**self.identity, uptime_s=control["now"], placement=placements, migrations=control["migrations"],
                   admission={job: p for job, p in placements.items() if p["group"] is None})
        return out


def merge_summaries(parts: list[dict]) -> dict:
    """One cluster-wide summary from the nodes' telemetry summaries (counters add up)."""
    out: dict = {key: sum(p[key] for p in parts) for key in SUMMED}
    out["device_busy_s_per_device"] = {d: s for p in parts for d, s in p["device_busy_s_per_device"].items()}
    out["transitions"] = _add_counts([p["transitions"] for p in parts])
    out["jobs"] = {}
    for part in parts:
        for job, usage in part["jobs"].items():
            out["jobs"][job] = _add_counts([out["jobs"].get(job, {}), usage])
    out["recovery"] = _add_counts([p["recovery"] for p in parts])
    out["histograms"] = [h for p in parts for h in p["histograms"]]  # each node's carry its node label
    out["queued"] = {group: n for p in parts for group, n in p["queued"].items()}
    out["residency"] = {sid: tier for p in parts for sid, tier in p["residency"].items()}
    out["device_budget"] = {d: split for p in parts for d, split in p["device_budget"].items()}
    out["activation_reserves"] = {src: max(p["activation_reserves"].get(src, 0) for p in parts)
                                  for p0 in parts for src in p0["activation_reserves"]}
    out["bandwidth_gbps"] = parts[0]["bandwidth_gbps"] if len(parts) == 1 else {
        k: max(p["bandwidth_gbps"][k] for p in parts) for k in parts[0]["bandwidth_gbps"]}
    return out


def _add_counts(dicts: list[dict]) -> dict:
    total: dict = {}
    for d in dicts:
        for key, value in d.items():
            total[key] = total.get(key, 0) + value
    return total
