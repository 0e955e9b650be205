"""`plexrl trace EVENTS.jsonl -o trace.json`: an event log as a Chrome trace-event JSON file, which
ui.perfetto.dev and chrome://tracing open. The simulator writes the same (`plexrl sim W --trace DIR`).

Tracks (times in microseconds from the log's origin, as the log's seconds are):
- process "devices", per device two threads: `device N` holds one slice per function call, named
  after the function, from its start to its end (args: job, model, request), and the switch
  transitions (load, offload) the device waited for, each a slice of its own (category `switch`);
  `device N transfers` holds prefetched loads (category `prefetch`: they overlap a call) and any
  transition that would overlap a slice on the device's own thread;
- process "jobs", one thread per job controller: a slice `waiting on the cluster` while the job
  has a request in flight, a slice `idle` for each gap between (the controller's own work: tools,
  rewards), an instant `step N` at each step mark; each request's queueing is a flow (category
  `queue`, an arrow) from the controller's slice at its arrival to the call's slice on its device;
- process "node I/O": calls that run on a node's threads (weight syncs, saves, loads), as async
  slices per node.
A record may name its devices as `devices` (the simulator's gangs: one call holding several GPUs):
the call's slice is on each of them. Invariant (tested): on each `device N` thread slices never
overlap, so every viewer nests them as they are.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import gc
import sys
import time
from collections import defaultdict
from operator import itemgetter
from pathlib import Path

import orjson

from plexrl.errors import ConfigError
from plexrl.sim.trace import read_events

DEVICES, JOBS, NODES = 1, 2, 3
SWITCH_KINDS = ("load", "offload")


def _us(t: float) -> float:
    return round(t * 1e6, 3)


def device_tid(device: int) -> int:
    return 2 * device


def transfers_tid(device: int) -> int:
    return 2 * device + 1


class _Writer:
    """Trace events written as they are made, in chunks (orjson: a million records in seconds)."""

    CHUNK = 1 << 14

    def __init__(self, out):
        self.out, self.first, self._buffer = out, True, []

    def raw(self, event: dict) -> None:
        self._buffer.append(event)
        if len(self._buffer) >= self.CHUNK:
            self.flush()

    def flush(self) -> None:
        if self._buffer:  # one orjson call a chunk: its list's brackets off, the chunks joined by commas
            self.out.write((b"" if self.first else b",\n") + orjson.dumps(self._buffer)[1:-1])
            self.first, self._buffer = False, []

    def meta(self, pid: int, tid: int | None, kind: str, name: str) -> None:
        event = {"ph": "M", "pid": pid, "name": kind, "args": {"name": name}}
        if tid is not None:
            event["tid"] = tid
        self.raw(event)

    def slice(self, pid: int, tid: int, ts: float, dur: float, name: str, cat: str, args: dict | None = None) -> None:
        self.raw({"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name, "cat": cat,
                  "args": args or {}})


@contextlib.contextmanager
def no_collection():
    """The cyclic garbage collector off: the records and events are plain acyclic data, and with a
    million records alive each full collection walks them all (half the conversion's time)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def write_trace(records: list[dict], path: str | Path) -> dict:
    """Write `records` (an event log, any order) as a Chrome trace to `path`; what was written, counted."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as out, no_collection():
        out.write(b'{"displayTimeUnit":"ms","traceEvents":[\n')
        writer = _Writer(out)
        counts = _events(sorted(records, key=itemgetter("t")), writer)
        writer.flush()
        out.write(b"\n]}\n")
    return counts


def _events(records: list[dict], w: _Writer) -> dict:
    origin = records[0]["t"] if records else 0.0
    arrivals: dict[int, dict] = {}
    starts: dict[int, dict] = {}
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)  # job -> (arrival, end) of its requests
    steps: list[dict] = []
    calls: dict[int, list[tuple[float, float]]] = defaultdict(list)  # device -> its calls' (begin, end), in us
    pending_moves: list[dict] = []
    devices, nodes, jobs = set(), set(), {}
    counts = {"calls": 0, "switches": 0, "prefetches": 0, "flows": 0, "node_calls": 0}
    for r in records:
        kind = r["event"]
        if kind == "arrival":
            arrivals[r["request_id"]] = r
            jobs.setdefault(r["job"], len(jobs))
        elif kind == "start":
            starts[r["request_id"]] = r
        elif kind == "end":
            _ended(w, r, arrivals, starts, spans, calls, devices, nodes, jobs, origin, counts)
        elif kind == "transition" and r["kind"] in SWITCH_KINDS and r.get("device") is not None:
            pending_moves.append(r)
        elif kind == "step":
            steps.append(r)
            jobs.setdefault(r["job"], len(jobs))
    for lane in calls.values():
        lane.sort()
    last_switch: dict[int, float] = defaultdict(lambda: float("-inf"))
    for r in pending_moves:  # after the calls: a switch goes beside them where it would overlap one
        _moved(w, r, calls, last_switch, devices, origin, counts)
    _controllers(w, spans, steps, jobs, origin)
    for device in sorted(devices):
        w.meta(DEVICES, device_tid(device), "thread_name", f"device {device}")
        w.meta(DEVICES, transfers_tid(device), "thread_name", f"device {device} transfers")
    for node in sorted(nodes):
        w.meta(NODES, node, "thread_name", f"node {node}")
    for pid, name in ((DEVICES, "devices"), (JOBS, "jobs"), (NODES, "node I/O")):
        w.meta(pid, None, "process_name", name)
    return counts


def _ended(w: _Writer, r: dict, arrivals, starts, spans, calls, devices, nodes, jobs, origin, counts) -> None:
    rid = r["request_id"]
    arrived, started = arrivals.pop(rid, None), starts.pop(rid, None)
    job = r["job"]
    jobs.setdefault(job, len(jobs))
    if arrived is not None:
        spans[job].append((arrived["t"], r["t"]))
    if started is None:
        return  # refused before it ran
    begin, end = _us(started["t"] - origin), _us(r["t"] - origin)
    fn = r.get("fn", "call")
    args = {"job": job, "model": r.get("model", ""), "request": rid}
    on = r.get("devices") or ([r["device"]] if r.get("device") is not None else [])
    if not on:
        node = r.get("node", started.get("node", 0))
        nodes.add(node)
        w.raw({"ph": "b", "pid": NODES, "tid": node, "ts": begin, "id": rid, "cat": "node", "name": fn, "args": args})
        w.raw({"ph": "e", "pid": NODES, "tid": node, "ts": end, "id": rid, "cat": "node", "name": fn})
        counts["node_calls"] += 1
        return
    for device in on:
        devices.add(device)
        w.slice(DEVICES, device_tid(device), begin, round(end - begin, 3), fn, "call", args)
        calls[device].append((begin, end))
        counts["calls"] += 1
    if arrived is not None:
        w.raw({"ph": "s", "pid": JOBS, "tid": jobs[job], "ts": _us(arrived["t"] - origin), "id": rid, "cat": "queue",
               "name": "queueing"})
        w.raw({"ph": "f", "bp": "e", "pid": DEVICES, "tid": device_tid(on[0]), "ts": begin, "id": rid, "cat": "queue",
               "name": "queueing"})
        counts["flows"] += 1


def _moved(w: _Writer, r: dict, calls, last_switch, devices, origin, counts) -> None:
    device = r["device"]
    devices.add(device)
    begin, dur = _us(r["t"] - origin), round(r["seconds"] * 1e6, 3)
    args = {"job": r["job"], "state": r["state"], "bytes": int(r.get("bytes", 0))}
    if "hidden_s" in r:
        w.slice(DEVICES, transfers_tid(device), begin, dur, f"prefetch {r['kind']}", "prefetch", args)
        counts["prefetches"] += 1
        return
    counts["switches"] += 1
    if _overlaps(calls[device], begin, begin + dur) or begin < last_switch[device]:
        w.slice(DEVICES, transfers_tid(device), begin, dur, r["kind"], "switch", args)
        return
    last_switch[device] = begin + dur
    w.slice(DEVICES, device_tid(device), begin, dur, r["kind"], "switch", args)


def _overlaps(lane: list[tuple[float, float]], begin: float, end: float) -> bool:
    """Whether [begin, end) overlaps a slice of `lane` (sorted, not overlapping each other)."""
    k = bisect.bisect_right(lane, (begin, float("inf")))
    return (k > 0 and lane[k - 1][1] > begin) or (k < len(lane) and lane[k][0] < end)


def _controllers(w: _Writer, spans, steps, jobs, origin) -> None:
    """Per job: `waiting on the cluster` while a request is in flight, `idle` between."""
    for job, tid in jobs.items():
        w.meta(JOBS, tid, "thread_name", f"{job} controller")
        busy = _merged(sorted(spans.get(job, ())))
        for k, (a, b) in enumerate(busy):
            w.slice(JOBS, tid, _us(a - origin), round(_us(b - origin) - _us(a - origin), 3), "waiting on the cluster",
                    "controller")
            if k + 1 < len(busy):
                gap = busy[k + 1][0]
                w.slice(JOBS, tid, _us(b - origin), round(_us(gap - origin) - _us(b - origin), 3), "idle", "controller")
    for r in steps:
        w.raw({"ph": "i", "s": "t", "pid": JOBS, "tid": jobs[r["job"]], "ts": _us(r["t"] - origin),
               "name": f"step {r.get('step')}", "cat": "step"})


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in intervals:
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="plexrl trace", description="an event log as a Chrome trace-event JSON file "
                                "(open it in ui.perfetto.dev or chrome://tracing)")
    p.add_argument("events", type=Path, help="events.jsonl written by the runtime (event_log=PATH, plexrl demo --out) "
                                              "or by plexrl sim --trace")
    p.add_argument("-o", "--output", type=Path, default=Path("trace.json"),
                   help="the trace to write (default trace.json)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    try:
        with no_collection():
            records = read_events(args.events)
    except ConfigError as exc:
        print(f"plexrl trace: {exc}", file=sys.stderr)
        return 2
    counts = write_trace(records, args.output)
    print(f"{args.output}: {counts['calls']:,} calls, {counts['switches']:,} switches, {counts['prefetches']:,} "
          f"prefetches, {counts['flows']:,} queueing flows from {len(records):,} records in "
          f"{time.perf_counter() - t0:.2f} s; open it in ui.perfetto.dev", file=sys.stderr)
    return 0
