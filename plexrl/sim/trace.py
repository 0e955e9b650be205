"""A runtime event log read as a replayable trace: what each job asked for, and when.

The real runtime's log (`LocalCluster.write_events`) records each call's `arrival`, `start` and
`end` (with `wall_s`, the function's own run, and `device_s`, what it was charged),
transitions, state sizes and the controllers' `step` marks. Calibration replays it through the
simulator's mechanism, so the trace keeps only what a controller *caused*:

- happens-before: a call (or a step mark) of job J may depend on any call of J that ended before
  it arrived; `after` counts those calls (in J's real end order) and `gap_s` is the controller's
  own time since the last of them ended (tool calls, rewards, Python). A replay releases the call
  `gap_s` after all `after` predecessors have ended in the replay. This is conservative (it
  assumes every earlier end was needed) and exact for a controller that waits on its results;
- execution: per call, the device hold (`wall_s`: from its `start`, after its switch, to its
  `end`) and the charge (`device_s`); the hold is what kept the device from other calls: on the
  local engine the function's run, on the process and Ray engines also the hop to the device's
  process and back and the write-through of a mutated state. A call without a device (weight
  sync, save/load) holds its model's FIFO for the same start-to-end time; the runtime's own
  per-call overhead before a device starts a call (`dispatch_s`);
- memory and transfers: state sizes, which states were retired, which functions leave a state
  dirty (an offload after them copied bytes), the mean time of each (kind, bytes moved) of
  load/offload, and load/offload bandwidth for sizes the run never moved.

Invariant (tested): every call with an `end` is in `calls` exactly once, and for each job the
`after` counts never decrease in arrival order.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import orjson

from plexrl.errors import ConfigError
from plexrl.policy.profile import held_s

DEVICE_SIDE = ("load", "offload")


@dataclass(frozen=True)
class TracedCall:
    id: int
    job: str
    state: str
    fn: str
    arrival: float  # seconds since the trace origin
    start: float
    end: float
    device: int | None  # None: ran on the node's I/O threads
    wall_s: float  # start-to-end: the device's (or, device-less, the model's) hold
    device_s: float  # charged device time; 0 for device-less calls
    after: int  # how many of the job's calls (in real end order) ended before this arrival
    gap_s: float  # arrival minus the latest of those ends (or the origin)


@dataclass(frozen=True)
class TracedStep:
    job: str
    step: int
    t: float
    after: int
    gap_s: float


@dataclass(frozen=True)
class JobTotals:
    """What the real run charged a job: execution (`device_s`) plus its device-side switches."""

    exec_s: float
    switch_s: float

    @property
    def consumed_device_s(self) -> float:
        return self.exec_s + self.switch_s


@dataclass(frozen=True)
class Trace:
    calls: tuple[TracedCall, ...]  # arrival order
    steps: tuple[TracedStep, ...]  # time order
    end_order: dict[str, tuple[int, ...]]  # job -> call ids in real end order
    state_bytes: dict[str, tuple[str, int, int]]  # state -> (job, device bytes, host bytes)
    retired: frozenset[str]  # states the run removed (superseded sampler snapshots)
    devices: tuple[int, ...]
    peak_device_bytes: int  # the most bytes resident on one device at any time
    load_bytes_per_s: float
    offload_bytes_per_s: float
    transfer_s: dict[tuple[str, int], float]  # (kind, bytes moved) -> mean measured seconds
    dirtying_fns: frozenset[str]  # functions after which an offload had to copy the state back
    dispatch_s: float  # mean runtime overhead before a call starts on a device that could take it
    totals: dict[str, JobTotals]
    batches: tuple[tuple[int, int, int, float], ...] = ()  # batched sample calls: (steps, live row-steps, prompt tokens, device s)

    @property
    def jobs(self) -> list[str]:
        return sorted(self.end_order)

    def transfer_seconds(self, kind: str, moved: int) -> float:
        """A load or offload moving `moved` bytes: the run's mean for that size, else by bandwidth."""
        known = self.transfer_s.get((kind, moved))
        if known is not None:
            return known
        return moved / (self.load_bytes_per_s if kind == "load" else self.offload_bytes_per_s)

    def job_start(self, job: str) -> float:
        return min(c.arrival for c in self.calls if c.job == job)


def read_events(path: str | Path) -> list[dict]:
    """An event log's records, a bad line named (orjson: `plexrl trace` reads a million in seconds)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"event log {str(path)!r} does not exist; expected a JSONL file written by the runtime")
    events = []
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    events.append(orjson.loads(line))
                except orjson.JSONDecodeError as exc:
                    raise ConfigError(f"{path}:{n}: not a JSON object: {exc}") from None
    return events


def load_trace(path: str | Path) -> Trace:
    return build_trace(read_events(path))


def build_trace(events: list[dict]) -> Trace:
    events = sorted(events, key=lambda e: e["t"])
    by_kind: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        by_kind[e["event"]].append(e)
    if not by_kind["end"]:
        raise ConfigError("the event log has no 'end' events: expected a runtime log with completed calls")
    origin = events[0]["t"]
    calls = _calls(by_kind, origin)
    end_order = {job: tuple(c.id for c in sorted(cs, key=lambda c: c.end)) for job, cs in _by_job(calls).items()}
    calls = _with_dependencies(calls, end_order)
    steps = _steps(by_kind["step"], calls, origin)
    load_bw, offload_bw = _bandwidths(by_kind["transition"])
    return Trace(
        calls=calls,
        steps=steps,
        end_order=end_order,
        state_bytes={e["state"]: (e["job"], e["device_bytes"], e["host_bytes"]) for e in by_kind["state_added"]},
        retired=frozenset(e["state"] for e in by_kind["state_removed"]),
        devices=tuple(sorted({c.device for c in calls if c.device is not None})),
        peak_device_bytes=_peak_device_bytes(events),
        load_bytes_per_s=load_bw,
        offload_bytes_per_s=offload_bw,
        transfer_s=_transfer_table(by_kind["transition"]),
        dirtying_fns=_dirtying_fns(events),
        dispatch_s=_dispatch_overhead(events),
        totals=_totals(calls, by_kind["transition"]),
        batches=tuple((e["steps"], e["row_steps"], e["prefill_tokens"], e["device_s"]) for e in by_kind["batch"]),
    )


def _calls(by_kind: dict[str, list[dict]], origin: float) -> list[TracedCall]:
    arrivals = {e["request_id"]: e for e in by_kind["arrival"]}
    starts = {e["request_id"]: e for e in by_kind["start"]}
    calls = []
    for end in by_kind["end"]:
        rid = end["request_id"]
        if rid not in arrivals or not end.get("ok", True):
            continue  # failed calls did no work worth replaying
        arrival = arrivals[rid]["t"] - origin
        start = starts[rid]["t"] - origin if rid in starts else arrival
        device = end.get("device")
        wall = end["t"] - origin - start  # the device's hold: on remote engines more than the function's own time
        calls.append(TracedCall(rid, end["job"], end["model"], end["fn"], arrival, start, end["t"] - origin,
                                device, float(wall), float(end.get("device_s", 0.0) if device is not None else 0.0),
                                0, 0.0))
    return sorted(calls, key=lambda c: (c.arrival, c.id))


def _by_job(calls) -> dict[str, list[TracedCall]]:
    out: dict[str, list[TracedCall]] = defaultdict(list)
    for c in calls:
        out[c.job].append(c)
    return out


def _ended_before(ends: list[float], t: float) -> tuple[int, float]:
    """(how many of the sorted `ends` are <= t, the latest of them or 0.0)."""
    k = bisect.bisect_right(ends, t)
    return k, ends[k - 1] if k else 0.0


def _with_dependencies(calls: list[TracedCall], end_order: dict[str, tuple[int, ...]]) -> tuple[TracedCall, ...]:
    by_id = {c.id: c for c in calls}
    ends = {job: [by_id[i].end for i in ids] for job, ids in end_order.items()}
    out = []
    for c in calls:
        k, last = _ended_before(ends[c.job], c.arrival)
        out.append(TracedCall(**{**c.__dict__, "after": k, "gap_s": c.arrival - last}))
    return tuple(out)


def _steps(marks: list[dict], calls: tuple[TracedCall, ...], origin: float) -> tuple[TracedStep, ...]:
    ends: dict[str, list[float]] = defaultdict(list)
    for c in sorted(calls, key=lambda c: c.end):
        ends[c.job].append(c.end)
    out = []
    for e in marks:
        t = e["t"] - origin
        k, last = _ended_before(ends[e["job"]], t)
        out.append(TracedStep(e["job"], e["step"], t, k, t - last))
    return tuple(out)


def _bandwidths(transitions: list[dict]) -> tuple[float, float]:
    """Bytes per second of the loads and of the offloads that copied bytes."""
    out = []
    for kind in DEVICE_SIDE:
        moves = [t for t in transitions if t["kind"] == kind and t["bytes"] > 0 and t["seconds"] > 0]
        seconds = sum(t["seconds"] for t in moves)
        out.append(sum(t["bytes"] for t in moves) / seconds if seconds > 0 else float("inf"))
    return out[0], out[1]


def _transfer_table(transitions: list[dict]) -> dict[tuple[str, int], float]:
    """Mean seconds per (kind, bytes moved): model states come in a few sizes, and a transfer's
    fixed costs (a clean offload moves nothing but still takes time; a first load touches fresh
    arena pages) are part of what a switch costs."""
    seconds: dict[tuple[str, int], list[float]] = defaultdict(list)
    for t in transitions:
        if t["kind"] in DEVICE_SIDE:
            seconds[(t["kind"], t["bytes"])].append(t["seconds"])
    return {key: sum(v) / len(v) for key, v in seconds.items()}


def _dispatch_overhead(events: list[dict]) -> float:
    """Mean of dispatch time minus max(arrival, the device's previous end): the scheduler's and
    worker thread's own time per call (lock and interpreter handoffs), which no latency model of
    the device includes. Calls that waited for a busy or parked state are left out."""
    arrival: dict[int, float] = {}
    device_free: dict[int, float] = {}
    gaps = []
    for e in events:
        if e["event"] == "arrival":
            arrival[e["request_id"]] = e["t"]
        elif e["event"] == "dispatch" and e["request_id"] in arrival:
            ready = max(arrival[e["request_id"]], device_free.get(e["device"], 0.0))
            gaps.append(e["t"] - ready)
        elif e["event"] == "end" and e.get("device") is not None:
            device_free[e["device"]] = e["t"]
    gaps = [g for g in gaps if g >= 0]
    if not gaps:
        return 0.0
    cut = sorted(gaps)[int(0.9 * (len(gaps) - 1))]  # the slowest tenth waited for something else
    kept = [g for g in gaps if g <= cut]
    return sum(kept) / len(kept)


def _dirtying_fns(events: list[dict]) -> frozenset[str]:
    """Functions that left a state dirty: some offload right after them copied bytes."""
    last_fn: dict[str, str] = {}
    dirtying = set()
    for e in events:
        if e["event"] == "end" and e.get("device") is not None:
            last_fn[e["model"]] = e["fn"]
        elif e["event"] == "transition" and e["kind"] == "offload" and e["bytes"] > 0 and e["state"] in last_fn:
            dirtying.add(last_fn[e["state"]])
    return frozenset(dirtying)


def _peak_device_bytes(events: list[dict]) -> int:
    use: dict[int, int] = defaultdict(int)
    where: dict[str, int] = {}
    peak = 0
    for e in events:
        if e["event"] == "transition" and e["kind"] == "load":
            use[e["device"]] += e["state_bytes"]
            where[e["state"]] = e["device"]
        elif e["event"] == "transition" and e["kind"] == "offload" and e["state"] in where:
            use[where.pop(e["state"])] -= e["state_bytes"]
        elif e["event"] == "state_removed" and e["state"] in where:
            use[where.pop(e["state"])] -= e["device_bytes"]
        peak = max(peak, max(use.values(), default=0))
    return peak


def _totals(calls: tuple[TracedCall, ...], transitions: list[dict]) -> dict[str, JobTotals]:
    exec_s: dict[str, float] = defaultdict(float)
    switch_s: dict[str, float] = defaultdict(float)
    for c in calls:
        exec_s[c.job] += c.device_s
    for t in transitions:
        if t["kind"] in DEVICE_SIDE and t.get("device") is not None:
            switch_s[t["job"]] += held_s(t)
    return {job: JobTotals(exec_s[job], switch_s[job]) for job in exec_s}
