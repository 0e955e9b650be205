"""What an operator watches, kept as the event log's records go by: histograms, queues, lanes.

`EventLog.emit` hands every record to its `Activity`, which keeps, in memory bounded by the number
of requests in flight and by `LANE_KEPT` spans a device:
- three histograms (fixed buckets, `BUCKETS_S`), each a cumulative count that never decreases:
  a request's queueing delay (arrival to its dispatch, or to its start for a node call) and its
  latency (arrival to end, failed ones included), by node and job; the time of each device-side
  switch transition (load or offload), by node and device (a job's switch time is its
  `switch_s`: jobs times devices would be too many series for a scrape every second);
- the requests queued on each node group right now (arrived, not dispatched, started or ended);
- per device its recent spans: each function call (start to end) and each load or offload,
  prefetched loads marked as such. A record that reaches the log late (a transition is logged
  when its call returns, with its own start time) lands in time order all the same.

These are derived from the event log alone, so a log read back from a file gives the same figures
(`plexrl dashboard --events`, tested against a running cluster's). Time is the log's.
"""

from __future__ import annotations

import bisect
from collections import deque

# Seconds: the upper bounds of the histogram buckets (+Inf is implied), from a switch of a small
# state on a GPU (milliseconds) to a request that waited minutes behind other tenants.
BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
HISTOGRAMS = ("queueing_delay_s", "request_latency_s", "switch_s")
SWITCH_KINDS = ("load", "offload")
LANE_KEPT = 4096  # spans kept per device: minutes of a busy device's work
IN_FLIGHT_KEPT = 1 << 20  # requests tracked between arrival and end (a request lost before its end is forgotten)


class Histogram:
    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS_S) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS_S, seconds)] += 1
        self.sum += seconds


class Activity:
    def __init__(self) -> None:
        self.histograms: dict[tuple, Histogram] = {}  # (name, node, job, device) -> histogram
        self._arrivals: dict[int, tuple[float, int | None]] = {}  # request id -> (arrival t, group)
        self._queued: dict[int, set[int]] = {}  # group -> request ids queued
        self._starts: dict[int, tuple[float, str, str]] = {}  # request id -> (start t, job, fn) on a device
        self.lanes: dict[int, deque] = {}  # device -> spans (t0, t1, job, what, kind), kind: call|switch|prefetch
        self._nodes: dict[int, int] = {}  # device -> node, as its records say
        self.jobs: dict[str, list[float]] = {}  # job -> [its first arrival, its latest end]

    def observe(self, record: dict) -> None:
        kind = record["event"]
        if kind == "arrival":
            self._arrived(record)
        elif kind == "dispatch" or kind == "start":
            self._left_queue(record)
            if kind == "start" and record.get("device") is not None:
                self._starts[record["request_id"]] = (record["t"], record["job"], record["fn"])
        elif kind == "end":
            self._ended(record)
        elif kind == "transition" and record.get("device") is not None and record["kind"] in SWITCH_KINDS:
            self._switched(record)

    def _arrived(self, r: dict) -> None:
        if len(self._arrivals) >= IN_FLIGHT_KEPT:
            self._arrivals.clear()
            self._queued.clear()
        group = r.get("group")
        self.jobs.setdefault(r["job"], [r["t"], r["t"]])
        self._arrivals[r["request_id"]] = (r["t"], group)
        self._queued.setdefault(group, set()).add(r["request_id"])

    def _left_queue(self, r: dict) -> None:
        arrived = self._arrivals.get(r["request_id"])
        if arrived is None:
            return
        queue = self._queued.get(arrived[1])
        if queue is not None and r["request_id"] in queue:
            queue.discard(r["request_id"])
            self._hist("queueing_delay_s", r.get("node"), r["job"], None).observe(max(0.0, r["t"] - arrived[0]))

    def _ended(self, r: dict) -> None:
        rid = r["request_id"]
        self._left_queue(r)  # a request refused before it ran waited all the same
        arrived = self._arrivals.pop(rid, None)
        seen = self.jobs.get(r["job"])
        if seen is not None:
            seen[1] = max(seen[1], r["t"])
        if arrived is not None:
            self._queued.get(arrived[1], set()).discard(rid)
            latency = max(0.0, r["t"] - arrived[0])
            self._hist("request_latency_s", r.get("node", arrived[1]), r["job"], None).observe(latency)
        started = self._starts.pop(rid, None)
        device = r.get("device")
        if started is not None and device is not None:
            self._span(device, r.get("node"), (started[0], r["t"], started[1], started[2], "call"))

    def _switched(self, r: dict) -> None:
        self._hist("switch_s", r.get("node"), None, r["device"]).observe(r["seconds"])  # per device, not per job
        kind = "prefetch" if "hidden_s" in r else "switch"
        self._span(r["device"], r.get("node"), (r["t"], r["t"] + r["seconds"], r["job"], r["kind"], kind))

    def _hist(self, name: str, node, job: str, device) -> Histogram:
        key = (name, node, job, device)
        found = self.histograms.get(key)
        if found is None:
            found = self.histograms[key] = Histogram()
        return found

    def _span(self, device: int, node, span: tuple) -> None:
        lane = self.lanes.get(device)
        if lane is None:
            lane = self.lanes[device] = deque(maxlen=LANE_KEPT)
        if node is not None:
            self._nodes[device] = node
        if lane and span[0] < lane[-1][0]:  # logged late: put it in its place
            spans = sorted([*lane, span])
            lane.clear()
            lane.extend(spans[-LANE_KEPT:])
        else:
            lane.append(span)

    # -- what the cluster reports ---------------------------------------------------------------
    def summary(self) -> dict:
        """`histograms`: one record per (histogram, node, job, device) with per-bucket counts;
        `queued`: requests queued per node group (`metrics()` documents both)."""
        return {
            "histograms": [{"name": name, "node": node, "job": job, "device": device, "counts": list(h.counts),
                            "sum": h.sum} for (name, node, job, device), h in self.histograms.items()],
            "queued": {group: len(ids) for group, ids in self._queued.items() if group is not None},
        }

    def recent(self, since: float) -> dict:
        """`lanes`: per device, its spans that end at `since` or later, and the node it is on;
        `jobs`: per job, (its first arrival, its latest end)."""
        lanes = {}
        for device, lane in self.lanes.items():
            keep = [s for s in lane if s[1] >= since]
            lanes[device] = {"node": self._nodes.get(device), "spans": keep}
        return {"lanes": lanes, "jobs": {job: tuple(span) for job, span in self.jobs.items()}}


def replay(records) -> Activity:
    """The activity of an event log read back (records in any order: sorted by time first)."""
    activity = Activity()
    for record in sorted(records, key=lambda r: r["t"]):
        activity.observe(record)
    return activity
