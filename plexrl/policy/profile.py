"""A job's demand profile: what it asks of a node group over one step, and how to measure it.

A `JobProfile` is periodic: one step lasts `period_s` and is cut into `len(demand)` equal
slots; `demand[i]` is how many of the job's devices are busy in slot i (fractional when a
device is busy for part of the slot). Memory is per model and per device the job runs on:
`device_bytes` while the model's state is resident in a device arena, `host_bytes` for its
persistent host buffer while offloaded. A job on n devices holds n such copies (or shards),
one per device, each with its host buffer on that device's node.

Online profiling (`profile_from_events`) turns the runtime's event log into a profile:
- busy = from a request's "start" to its "end" on a device, plus the device-side transitions
  (load, offload) made for the job, because the ledger charges those to the job as well;
- step boundaries come from the job's {"event": "step"} records; each complete step is
  stretched onto the median step period (keeping the order and proportion of its phases) and
  the demand is the mean over steps;
- the job as it runs alone: a stretch in which a call of the job was ready (its model's
  earlier calls done) and waited for a device while nothing of the job ran is time its
  co-tenants took from it, not part of its profile, and is cut out of the timeline before
  the steps are folded (a job measured while sharing is otherwise measured with the
  inflation that sharing gave it, and then judged against it: the closed loop would see 0);
  a step that then takes no time (or whose two marks are at one moment) is left out;
- its calls, for the co-tenancy model (`JobProfile.barriers`, `residual_s`): a phase is a set
  of the job's device calls that overlap in time (a job whose calls run one at a time has a
  phase per call); a call lasts from its dispatch (its own loads included) to its end.
`drifted` says when a measured profile has moved far enough from the one a job was placed
with that the runtime should re-place it.

Invariants (tests/test_profile.py): 0 <= demand <= devices; the busy device-time of a
measured profile equals the busy time in the events it was built from (when each step lasts
the period); a profile compared with itself never drifts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Mapping, Sequence

import numpy as np

DEFAULT_SLACK = 0.10
_DEVICE_TRANSITIONS = ("load", "offload")


@dataclass(frozen=True)
class ModelMemory:
    """One model of a job: bytes per device while resident, and while offloaded to host.

    `shared` names frozen weights that other jobs may use too (a reference model, a LoRA base
    of one base checkpoint): such a model's host buffer is one read-only copy per node, used
    by every device and every job on the node that names the same key, and `host_bytes` is the
    bytes of that one copy. A model whose host copy is another model's (a sampler whose
    weights are its trainer's) declares `host_bytes` = 0.
    """

    name: str
    device_bytes: int
    host_bytes: int
    shared: str = ""

    def __post_init__(self) -> None:
        for field_name in ("device_bytes", "host_bytes"):
            value = getattr(self, field_name)
            if value < 0:
                raise ValueError(f"model {self.name!r}: {field_name} must be >= 0, got {value}")


@dataclass(frozen=True)
class JobProfile:
    job: str
    period_s: float
    demand: tuple[float, ...]
    devices: int
    models: tuple[ModelMemory, ...]
    slack: float = DEFAULT_SLACK
    replica_devices: int = 1  # devices that must share a node (one tensor-parallel model replica)
    # Its calls, for the co-tenancy model (`placement/cotenancy.py: wait_inflation`); 0 = not known.
    barriers: int = 0  # phases per step: call groups that must all end before the step moves on
    residual_s: float = 0.0  # per device: sum of its calls' seconds^2 / (2 * period_s)
    # Its elastic rollouts (the simulator's, `sim/rollout.py`), 0 = none known: of `barriers`, the
    # rollout turns, which share a co-tenant's rollouts' replicas instead of waiting for them;
    # of `residual_s`, the part from its rollout segments (what a co-tenant's rollout does not
    # wait for); and the seconds per step its rollouts want all its replicas (before their
    # consolidation cut), in which a co-tenant's rollout shares them (`placement/cotenancy.py: wait_s`).
    rollout_barriers: int = 0
    rollout_residual_s: float = 0.0
    rollout_s: float = 0.0
    # Its run has a known end (it declared its steps): placement may judge it by less than its
    # slack ("Packing when it pays", placement/judgement.py). False: open-ended (a service session).
    ends: bool = False
    # The steps of its run when it declared them (0: not known): with `period_s`, the run the placer
    # weighs a shared placement's effect by ("Packing by effect", placement/judgement.py).
    steps: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "demand", tuple(float(d) for d in self.demand))
        object.__setattr__(self, "models", tuple(self.models))
        where = f"profile of job {self.job!r}"
        if not (self.period_s > 0 and math.isfinite(self.period_s)):
            raise ValueError(f"{where}: period_s must be a positive number of seconds, got {self.period_s}")
        if self.devices < 1:
            raise ValueError(f"{where}: devices must be >= 1, got {self.devices}")
        if not self.demand:
            raise ValueError(f"{where}: demand needs at least one slot")
        bad = [d for d in self.demand if not (0.0 <= d <= self.devices + 1e-9)]
        if bad:
            raise ValueError(
                f"{where}: every demand slot must lie in [0, devices={self.devices}], got {bad[0]}"
            )
        if not self.models:
            raise ValueError(f"{where}: needs at least one model (its memory is what gets placed)")
        if not self.slack >= 0:
            raise ValueError(f"{where}: slack must be >= 0 (a fraction of the step), got {self.slack}")
        if self.barriers < 0 or not self.residual_s >= 0:
            raise ValueError(f"{where}: barriers and residual_s must be >= 0, got {self.barriers} and {self.residual_s}")
        if not 0 <= self.rollout_barriers <= self.barriers:
            raise ValueError(f"{where}: rollout_barriers must lie in [0, barriers={self.barriers}], "
                             f"got {self.rollout_barriers}")
        if not 0.0 <= self.rollout_residual_s <= self.residual_s * (1 + 1e-9):
            raise ValueError(f"{where}: rollout_residual_s must lie in [0, residual_s={self.residual_s}], "
                             f"got {self.rollout_residual_s}")
        if not 0.0 <= self.rollout_s <= self.period_s * (1 + 1e-9):
            raise ValueError(f"{where}: rollout_s must lie in [0, period_s={self.period_s}], got {self.rollout_s}")
        if self.steps < 0:
            raise ValueError(f"{where}: steps must be >= 0 (0: not known), got {self.steps}")
        if self.replica_devices < 1 or self.devices % self.replica_devices:
            raise ValueError(
                f"{where}: replica_devices = {self.replica_devices} must be >= 1 and divide "
                f"devices = {self.devices}"
            )

    @property
    def slot_s(self) -> float:
        return self.period_s / len(self.demand)

    @property
    def device_bytes(self) -> int:
        """The largest single resident state: what one device arena must be able to hold."""
        return max(m.device_bytes for m in self.models)

    @property
    def host_bytes_per_device(self) -> int:
        """Host buffers of the job's own (not shared) models, for one of its devices."""
        return sum(m.host_bytes for m in self.models if not m.shared)

    @property
    def shared_host_bytes(self) -> dict[str, int]:
        """Host bytes of each shared model's one copy per node, by key (`ModelMemory.shared`)."""
        return {m.shared: m.host_bytes for m in self.models if m.shared}

    @cached_property
    def busy_device_s(self) -> float:
        """Device-seconds the job is busy over one step (computed once: placement asks it of
        every tenant in every decision)."""
        return sum(self.demand) * self.slot_s

    @property
    def run_s(self) -> float:
        """Its whole run alone, when it declared its steps (`steps` periods); 0.0 when not known."""
        return self.steps * self.period_s if self.ends else 0.0

    def cumulative(self) -> np.ndarray:
        """Busy device-seconds from the step start to each slot edge (len(demand) + 1 values)."""
        return np.concatenate(([0.0], np.cumsum(np.asarray(self.demand) * self.slot_s)))


def average_demand(profile: JobProfile, edges_s: np.ndarray) -> np.ndarray:
    """Mean busy devices between consecutive times in `edges_s` (seconds since a step start).

    The profile repeats every period, so any times work, negative ones included. Exact for the
    piecewise-constant demand: it differences the cumulative busy time at the edges.
    """
    cum = profile.cumulative()
    per_step = cum[-1]
    steps, within = np.divmod(np.asarray(edges_s, dtype=float), profile.period_s)
    grid = np.linspace(0.0, profile.period_s, len(profile.demand) + 1)
    busy = steps * per_step + np.interp(within, grid, cum)
    return np.diff(busy) / np.diff(edges_s)


def resample(profile: JobProfile, slots: int) -> np.ndarray:
    """The profile's demand averaged onto `slots` equal slots of one step."""
    return average_demand(profile, np.linspace(0.0, profile.period_s, slots + 1))


def profile_from_events(
    events: Iterable[Mapping],
    job: str,
    slot_s: float,
    models: Sequence[ModelMemory],
    devices: int | None = None,
    slack: float = DEFAULT_SLACK,
    last_steps: int | None = None,
    ends: bool = False,
) -> JobProfile:
    """Measure `job`'s profile from event-log records (see the module docstring).

    `devices` defaults to the most devices the job's calls kept busy at once (at least 1): a runtime's
    group scheduler runs a job's states on whichever device of the group is free, so the devices
    it visited say nothing of how many it needs (three demo jobs, each one call at a time,
    visited both devices of their group and were measured as 2-device jobs). `last_steps`
    keeps only the most recent complete steps (all by default). The slot width is `slot_s`
    rounded so that a whole number of slots makes one period. `ends`: the job declared its
    length (`JobProfile.ends`).
    """
    if slot_s <= 0:
        raise ValueError(f"slot_s must be > 0 seconds, got {slot_s}")
    records = _job_records(events, job)
    raw_bounds = _step_bounds(records, job, last_steps)
    records = window(records, raw_bounds[0])
    calls = _device_calls(records)
    spans = _busy_intervals(records, end_s=raw_bounds[-1])
    alone = _without_waits(calls, spans, _node_calls(records))
    bounds = alone(raw_bounds)
    moved = alone(np.asarray([(a, b) for a, b, _, _ in spans], dtype=float).reshape(-1, 2))
    intervals = [(a, b, d) for (a, b), (_, _, d, _) in zip(moved.tolist(), spans)]
    starts, ends_s = _timed_steps(job, bounds)
    n_steps = len(starts)
    period = float(np.median(ends_s - starts))
    slots = max(1, round(period / slot_s))
    busy = np.zeros(slots)
    for start, end in zip(starts, ends_s):
        busy += _fold_step(intervals, start, end, period, slots)
    # its calls at once: a transition of its state on another device is the runtime's doing
    requests = [interval for interval, (_, _, _, request) in zip(intervals, spans) if request]
    n_devices = devices if devices is not None else max(1, _most_at_once(requests, bounds[0], bounds[-1]))
    demand = np.minimum(busy / n_steps / (period / slots), n_devices)
    within = [(a, b) for _, a, b in calls if raw_bounds[0] <= a < raw_bounds[-1]]
    squares = sum((b - a) ** 2 for a, b in within)
    return JobProfile(job, period, tuple(demand), n_devices, tuple(models), slack,
                      barriers=max(1, round(_phases(within) / n_steps)) if within else 0,
                      residual_s=squares / n_steps / (2 * period) / n_devices, ends=ends)


def _timed_steps(job: str, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of the steps between `bounds` that took time. A step that took none (two
    marks at one moment, or nothing but waits, cut out) has no shape to stretch onto the
    period: it is left out; a job with none is an error."""
    timed = np.diff(bounds) > 0
    if not timed.any():
        raise ValueError(f"job {job!r}: profiling needs a step that took time; its {len(timed)} complete "
                         f"step(s) took none (their 'step' records at one moment, or nothing but waits "
                         f"for devices between them)")
    return bounds[:-1][timed], bounds[1:][timed]


def _job_records(events: Iterable[Mapping], job: str) -> list[Mapping]:
    """`job`'s records, sorted by time (what every helper below reads)."""
    return sorted((e for e in events if e.get("job") == job), key=lambda r: float(r["t"]))


def window(records: list[Mapping], start_s: float) -> list[Mapping]:
    """The records from `start_s` on, and the earlier ones of requests that have records from
    then on (requests still going then), in their order: what steps from `start_s` on are
    measured from. Waits cut out before it move every time alike, so they change nothing.
    Profiling the steps from `start_s` on from `window(records)` is profiling them from
    `records` (tested), so a runtime sends only the window."""
    later = {e.get("request_id") for e in records if float(e["t"]) >= start_s} - {None}
    return [e for e in records if float(e["t"]) >= start_s or e.get("request_id") in later]


def _device_calls(records: list[Mapping]) -> list[tuple[float, float, float]]:
    """(ready, dispatched, ended) of each of the job's device calls that ended (records sorted by
    time): ready when it had arrived and its model's previous call had ended (a model runs its
    calls in order)."""
    arrived: dict[object, tuple[float, object]] = {}
    dispatched: dict[object, float] = {}
    last_end: dict[object, float] = {}
    calls = []
    for e in records:
        kind, rid = e.get("event"), e.get("request_id")
        if kind == "arrival":
            arrived[rid] = float(e["t"]), e.get("model")
        elif kind == "dispatch":
            dispatched[rid] = float(e["t"])
        elif kind == "end" and rid in arrived:
            t_arrived, model = arrived.pop(rid)
            if rid in dispatched:
                calls.append((max(t_arrived, last_end.get(model, t_arrived)), dispatched.pop(rid), float(e["t"])))
            last_end[model] = float(e["t"])
    return calls


def _without_waits(calls: list[tuple[float, float, float]], spans: list[tuple[float, float, int, bool]],
                   node_calls: list[tuple[float, float]]):
    """t -> t less the time before t in which the job waited for a device held by others: some
    call of it ready and undispatched (`_device_calls`) while nothing of it ran (no call, node
    function or transition of it); a monotone map of times (numpy arrays of them)."""
    cut = np.asarray(_waits(calls, spans, node_calls), dtype=float).reshape(-1, 2)
    starts, lengths = cut[:, 0], cut[:, 1] - cut[:, 0]
    before = np.concatenate(([0.0], np.cumsum(lengths)))[:-1]  # cut out before each cut starts

    def alone(t: np.ndarray) -> np.ndarray:
        if not len(cut):
            return t
        last = np.searchsorted(starts, t, side="right") - 1  # the last cut starting at or before t
        k = np.maximum(last, 0)
        return t - np.where(last >= 0, before[k] + np.clip(t - starts[k], 0.0, lengths[k]), 0.0)
    return alone


def _waits(calls: list[tuple[float, float, float]], spans: list[tuple[float, float, int, bool]],
           node_calls: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The stretches in which the job waited for a device held by others (`_without_waits`)."""
    waiting = _union((ready, sent) for ready, sent, _ in calls)
    running = _union([(sent, end) for _, sent, end in calls] + [(a, b) for a, b, _, _ in spans] + node_calls)
    return _minus(waiting, running)


def waited_s(events: Iterable[Mapping], job: str) -> float:
    """Seconds in which `job` waited for a device held by others, over the whole log: what
    `profile_from_events` cuts out of its steps (a runtime also waits so alone, for a few
    microseconds of dispatch per call)."""
    records = _job_records(events, job)
    if not records:
        return 0.0
    spans = _busy_intervals(records, float(records[-1]["t"]))
    return sum(b - a for a, b in _waits(_device_calls(records), spans, _node_calls(records)))


def _node_calls(records: list[Mapping]) -> list[tuple[float, float]]:
    """(start, end) of the job's node functions (they run on the host: no device event)."""
    started, out = {}, []
    for e in records:
        if e.get("event") == "start" and e.get("device") is None:
            started[e.get("request_id")] = float(e["t"])
        elif e.get("event") == "end" and e.get("request_id") in started:
            out.append((started.pop(e.get("request_id")), float(e["t"])))
    return out


def _union(intervals) -> list[tuple[float, float]]:
    """Sorted, disjoint union of (start, end) intervals (empty ones dropped)."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of union `a` outside union `b` (both sorted and disjoint)."""
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        cur, k = start, j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def _phases(calls: list[tuple[float, float]]) -> int:
    """How many groups of calls overlapping in time (a chain of overlaps is one group)."""
    phases, reach = 0, -math.inf
    for a, b in sorted(calls):
        if a >= reach:
            phases += 1
        reach = max(reach, b)
    return phases


def _step_bounds(records: list[Mapping], job: str, last_steps: int | None) -> np.ndarray:
    times = sorted(float(e["t"]) for e in records if e.get("event") == "step")
    if len(times) < 2:
        raise ValueError(
            f"job {job!r}: profiling needs at least two 'step' records (one complete step), "
            f"found {len(times)}"
        )
    if last_steps is not None:
        if last_steps < 1:
            raise ValueError(f"last_steps must be >= 1, got {last_steps}")
        times = times[-(last_steps + 1):]
    return np.asarray(times)


def _most_at_once(intervals: list[tuple[float, float, int]], start: float, end: float) -> int:
    """The most distinct devices busy at the same moment within [start, end)."""
    edges = []
    for t0, t1, device in intervals:
        a, b = max(t0, start), min(t1, end)
        if b > a:
            edges += [(a, 1, device), (b, -1, device)]
    busy: dict[int, int] = {}  # device -> its intervals open now
    most = 0
    for _, step, device in sorted(edges):  # at one moment, ends (-1) before starts
        busy[device] = busy.get(device, 0) + step
        if busy[device] == 0:
            del busy[device]
        most = max(most, len(busy))
    return most


def held_s(transition: Mapping) -> float:
    """Seconds a transition event held its device: a prefetched load (`hidden_s` set) only the
    part its function did not hide. Every reader of the event log charges a transition so."""
    return float(transition.get("seconds", 0.0)) - float(transition.get("hidden_s", 0.0))


def _busy_intervals(records: list[Mapping], end_s: float) -> list[tuple[float, float, int, bool]]:
    """(start, end, device, whether a request) of every busy period (records sorted by time);
    a request still running is busy until `end_s`."""
    started: dict[object, tuple[float, int]] = {}
    intervals: list[tuple[float, float, int, bool]] = []
    for e in records:
        kind, device = e.get("event"), e.get("device")
        if kind == "start" and device is not None:
            started[e.get("request_id")] = (float(e["t"]), int(device))
        elif kind == "end" and e.get("request_id") in started:
            t0, dev = started.pop(e.get("request_id"))
            intervals.append((t0, float(e["t"]), dev, True))
        elif kind == "transition" and device is not None and e.get("kind") in _DEVICE_TRANSITIONS:
            t0 = float(e["t"])
            intervals.append((t0, t0 + held_s(e), int(device), False))
    intervals.extend((t0, max(t0, end_s), dev, True) for t0, dev in started.values())
    return intervals


def _fold_step(
    intervals: list[tuple[float, float, int]], start: float, end: float, period: float, slots: int
) -> np.ndarray:
    """Busy device-seconds per slot of one step [start, end), stretched onto `period`."""
    scale = period / (end - start)
    edges = np.linspace(0.0, period, slots + 1)
    busy = np.zeros(slots)
    for t0, t1, _ in intervals:
        a, b = (max(t0, start) - start) * scale, (min(t1, end) - start) * scale
        if b > a:
            busy += np.clip(np.minimum(b, edges[1:]) - np.maximum(a, edges[:-1]), 0.0, None)
    return busy


def drift(placed: JobProfile, measured: JobProfile) -> float:
    """How far `measured` has moved from `placed`, as a fraction.

    The larger of the relative change of the period and the L1 distance between the two
    demand shapes (both resampled onto a common grid of one step) relative to the placed busy
    time. A different device count is infinite drift: the job needs another kind of group.
    """
    if placed.devices != measured.devices:
        return math.inf
    period_change = abs(measured.period_s - placed.period_s) / placed.period_s
    slots = max(len(placed.demand), len(measured.demand))
    a, b = resample(placed, slots), resample(measured, slots)
    scale = max(a.sum(), 1e-12)
    return max(period_change, float(np.abs(a - b).sum() / scale))


def drifted(placed: JobProfile, measured: JobProfile, tolerance: float = 0.2) -> bool:
    """True when the runtime should re-place the job at its next step boundary."""
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    return drift(placed, measured) > tolerance
