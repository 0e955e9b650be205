"""Calibration: replay a real run's jobs through the simulator and compare with what really happened.

`calibrate(trace)` replays the runtime's event log (`trace.py`) on a simulated node group with
the runtime's scheduling rules and the same policy code (`replay.py`), twice:
- `profile`: every call takes the *mean* measured time of its (model, function) — the profile a
  user would feed the simulator — so the error covers the profile, the mechanism and the policy;
- `exact`: every call takes its own measured time, isolating the mechanism and policy.
Per job it reports mean step time (between the controller's `step` marks; the first step from
the job's first call) and device-seconds (execution charge + switch-in), simulated vs real, and
the relative error. The target (issue 5) is |error| <= 15%. It also fits the decode model
(policy/decode.py) to the run's batched sample calls (`batch` events: decode steps, live
row-steps, prompt tokens, device seconds): `decode`.

The device budget is not in the log: pass it (`device_bytes`) or it is taken as the peak bytes
the run held on one device, the tightest budget the log is consistent with.
"""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np

from plexrl.errors import ConfigError
from plexrl.policy import DecodeModel, Policy
from plexrl.sim.replay import GroupReplay, ReplayResult
from plexrl.sim.trace import Trace

TARGET = 0.15
PROFILES = ("profile", "exact")


def call_times(trace: Trace, profile: str) -> tuple[dict[int, float], dict[int, float]]:
    """(device hold, charge) per call id: its own measurement, or the mean of its (model, fn),
    a model being a job's state with sampler snapshot versions pooled (`policy@sampler`)."""
    if profile not in PROFILES:
        raise ConfigError(f"profile {profile!r}; expected one of {PROFILES}")
    if profile == "exact":
        return {c.id: c.wall_s for c in trace.calls}, {c.id: c.device_s for c in trace.calls}
    groups: dict[tuple[str, str, bool], list] = defaultdict(list)
    for c in trace.calls:
        groups[(model_of(c.state), c.fn, c.device is None)].append(c)
    hold, charge = {}, {}
    for cs in groups.values():
        mean_hold, mean_charge = float(np.mean([c.wall_s for c in cs])), float(np.mean([c.device_s for c in cs]))
        for c in cs:
            hold[c.id], charge[c.id] = mean_hold, mean_charge
    return hold, charge


def model_of(state: str) -> str:
    """`job/policy@sampler.v3` -> `job/policy@sampler`: every version of a snapshot is one model."""
    return re.sub(r"\.v\d+$", "", state)


def step_times(trace: Trace, marks: dict[tuple[str, int], float], job: str) -> list[float]:
    """Durations of the job's steps: between consecutive marks, the first from its first call."""
    steps = sorted(s.step for s in trace.steps if s.job == job)
    times = [trace.job_start(job)] + [marks[(job, s)] for s in steps]
    return list(np.diff(times))


def replay(trace: Trace, profile: str = "profile", device_bytes: int | None = None,
           host_bytes: int | None = None, policy: Policy = Policy.PLEXRL) -> ReplayResult:
    missing = sorted({c.state for c in trace.calls} - set(trace.state_bytes))
    if missing:
        raise ConfigError(f"the event log never adds states {missing[:3]}; expected a 'state_added' event for each")
    budget = device_bytes or trace.peak_device_bytes
    biggest = max(d for _, d, _ in trace.state_bytes.values())
    if budget < biggest:
        raise ConfigError(f"device budget {budget} bytes is smaller than the largest state ({biggest} bytes)")
    host = host_bytes or 2 * sum(h for _, _, h in trace.state_bytes.values())
    hold, charge = call_times(trace, profile)
    return GroupReplay(trace, hold, charge, budget, host, policy).run()


def relative_error(sim: float, real: float) -> float:
    return (sim - real) / real if real > 0 else float("nan")


def compare(trace: Trace, result: ReplayResult) -> dict:
    jobs = {}
    for job in trace.jobs:
        real_steps = step_times(trace, {(s.job, s.step): s.t for s in trace.steps}, job)
        sim_steps = step_times(trace, result.step_t, job)
        real_dev = trace.totals[job].consumed_device_s
        usage = result.ledger.jobs.get(job)
        sim_dev = usage.consumed_device_s if usage is not None else 0.0
        real_step = float(np.mean(real_steps)) if real_steps else float("nan")
        sim_step = float(np.mean(sim_steps)) if sim_steps else float("nan")
        jobs[job] = {
            "steps": len(real_steps),
            "step_s_real": real_step, "step_s_sim": sim_step,
            "step_s_error": relative_error(sim_step, real_step),
            "device_s_real": real_dev, "device_s_sim": sim_dev,
            "device_s_error": relative_error(sim_dev, real_dev),
            "switch_s_real": trace.totals[job].switch_s,
            "switch_s_sim": usage.switch_s if usage is not None else 0.0,
        }
    errors = [abs(j[k]) for j in jobs.values() for k in ("step_s_error", "device_s_error") if np.isfinite(j[k])]
    return {
        "jobs": jobs,
        "max_abs_error": max(errors, default=float("nan")),
        "within_target": bool(errors) and max(errors) <= TARGET,
        "served": result.served,
        "events": result.events,
    }


def calibrate(trace: Trace, device_bytes: int | None = None, policy: Policy = Policy.PLEXRL) -> dict:
    """{"calls", "devices", "device_bytes", "bandwidth", "target", "profile": {...}, "exact": {...}}."""
    out = {
        "calls": len(trace.calls),
        "devices": len(trace.devices),
        "device_bytes": device_bytes or trace.peak_device_bytes,
        "device_bytes_inferred": device_bytes is None,
        "load_gb_s": trace.load_bytes_per_s / 1e9,
        "offload_gb_s": trace.offload_bytes_per_s / 1e9,
        "dirtying_fns": sorted(trace.dirtying_fns),
        "policy": policy.value,
        "target": TARGET,
    }
    for profile in PROFILES:
        out[profile] = compare(trace, replay(trace, profile, device_bytes, policy=policy))
    out["decode"] = decode_fit(trace)
    return out


def decode_fit(trace: Trace) -> dict:
    """The decode model (policy.DecodeModel: step time against live rows) fitted by least squares
    to the run's batched sample calls, and how far its seconds are from each call's: the
    function the runtime's scheduler and the simulator decode with, calibrated on this run."""
    fitted = DecodeModel.fit(trace.batches)
    if fitted is None:
        return {"batches": 0}
    data = np.asarray(trace.batches, dtype=np.float64)
    predicted = fitted.seconds(data[:, 0], data[:, 1], data[:, 2])
    errors = np.abs(predicted - data[:, 3]) / np.maximum(data[:, 3], 1e-12)
    return {"batches": len(data), "step_s": fitted.step_s, "row_s": fitted.row_s,
            "prefill_token_s": fitted.prefill_token_s, "median_abs_error": float(np.median(errors)),
            "max_abs_error": float(errors.max())}
