"""Job profiles: validation, exact slot averaging, online profiling from event logs, drift."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plexrl.policy.profile import (
    JobProfile,
    ModelMemory,
    average_demand,
    drift,
    drifted,
    profile_from_events,
    resample,
    waited_s,
    window,
)

GiB = 2**30
MODELS = (ModelMemory("policy", 4 * GiB, 4 * GiB),)


def profile(demand, period_s=None, devices=2, **kw) -> JobProfile:
    return JobProfile("j", period_s or float(len(demand)), tuple(demand), devices, MODELS, **kw)


# -- validation ----------------------------------------------------------------------------------

BAD_PROFILES = {
    "zero period": (dict(period_s=0.0), "period_s"),
    "no devices": (dict(devices=0), "devices must be >= 1"),
    "no slots": (dict(demand=()), "at least one slot"),
    "demand above devices": (dict(demand=(1.0, 3.0)), "[0, devices=2]"),
    "negative demand": (dict(demand=(-0.5,)), "[0, devices=2]"),
    "no models": (dict(models=()), "at least one model"),
    "negative slack": (dict(slack=-0.1), "slack must be >= 0"),
}


@pytest.mark.parametrize("name", BAD_PROFILES)
def test_bad_profiles_are_refused_with_the_field_named(name):
    overrides, message = BAD_PROFILES[name]
    fields = dict(job="j", period_s=4.0, demand=(1.0, 0.0), devices=2, models=MODELS) | overrides
    with pytest.raises(ValueError, match=re.escape(message)):
        JobProfile(**fields)


def test_negative_model_bytes_are_refused():
    with pytest.raises(ValueError, match="device_bytes must be >= 0"):
        ModelMemory("critic", -1, 0)


def test_memory_needs_are_the_largest_state_and_the_sum_of_host_buffers():
    p = JobProfile("j", 2.0, (1.0,), 1, (ModelMemory("a", 5, 7), ModelMemory("b", 9, 3)))
    assert (p.device_bytes, p.host_bytes_per_device) == (9, 10)


# -- exact averaging -----------------------------------------------------------------------------


def reference_average(p: JobProfile, t0: float, t1: float, samples: int = 20000) -> float:
    """Midpoint-rule integral of the periodic step function: the plain way to average it."""
    t = t0 + (np.arange(samples) + 0.5) * (t1 - t0) / samples
    slot = np.floor((t % p.period_s) / p.slot_s).astype(int)
    return float(np.asarray(p.demand)[np.minimum(slot, len(p.demand) - 1)].mean())


AVERAGE_CASES = {
    "aligned slot": ((2.0, 0.0, 1.0), 2.0, 3.0, 1.0),
    "half of two slots": ((2.0, 0.0, 1.0), 0.5, 1.5, 1.0),
    "wraps the period": ((2.0, 0.0, 1.0), 2.5, 3.5, 1.5),
    "negative times": ((2.0, 0.0, 1.0), -1.0, 0.0, 1.0),
    "several periods": ((2.0, 0.0, 1.0), 0.0, 30.0, 1.0),
}


@pytest.mark.parametrize("name", AVERAGE_CASES)
def test_average_demand_table(name):
    demand, t0, t1, expected = AVERAGE_CASES[name]
    p = profile(demand, devices=2)
    assert average_demand(p, np.array([t0, t1]))[0] == pytest.approx(expected)
    assert expected == pytest.approx(reference_average(p, t0, t1), abs=1e-3)


@settings(max_examples=40, deadline=None)
@given(
    demand=st.lists(st.floats(0.0, 4.0), min_size=1, max_size=12),
    period=st.floats(0.5, 50.0),
    t0=st.floats(-100.0, 100.0),
    width=st.floats(0.1, 20.0),
)
def test_average_demand_matches_numerical_integration(demand, period, t0, width):
    p = profile(demand, period_s=period, devices=4)
    fast = average_demand(p, np.array([t0, t0 + width]))[0]
    # the midpoint rule misses at most one sample's worth of each jump inside the interval
    jumps = width / p.slot_s + 2
    assert fast == pytest.approx(reference_average(p, t0, t0 + width), abs=2 * 4.0 * jumps / 20000 + 1e-9)


def test_resample_keeps_busy_time():
    p = profile((2.0, 1.0, 0.0, 0.5, 0.0), period_s=10.0)
    for slots in (1, 3, 5, 7, 20):
        assert resample(p, slots).sum() * (p.period_s / slots) == pytest.approx(p.busy_device_s)


# -- profiling from events -----------------------------------------------------------------------


def request(rid: int, device: int, start: float, end: float, job: str = "j") -> list[dict]:
    base = {"job": job, "model": "policy", "fn": "sample", "device": device, "request_id": rid}
    return [{"t": start, "event": "start", **base}, {"t": end, "event": "end", **base}]


def steps(times, job: str = "j") -> list[dict]:
    return [{"t": t, "event": "step", "job": job, "step": i} for i, t in enumerate(times)]


def square_wave_log(n_steps: int = 3, period: float = 10.0) -> list[dict]:
    """Device 0 busy [0, 5) of each step, device 1 busy [5, 7): rollout, then training."""
    events = steps([k * period for k in range(n_steps + 1)])
    for k in range(n_steps):
        events += request(2 * k, 0, k * period, k * period + 5.0)
        events += request(2 * k + 1, 1, k * period + 5.0, k * period + 7.0)
    return events


def test_profile_of_a_square_wave():
    p = profile_from_events(square_wave_log(), "j", slot_s=1.0, models=MODELS)
    # it visited two devices, one at a time (the runtime runs a state where a device is free): one device's need
    assert p.period_s == 10.0 and p.devices == 1
    assert p.demand == pytest.approx((1, 1, 1, 1, 1, 1, 1, 0, 0, 0))


@pytest.mark.parametrize("name, events, devices", [
    ("one at a time on two devices", steps([0, 4]) + request(1, 0, 0, 2) + request(2, 1, 2, 4), 1),
    ("two at once", steps([0, 4]) + request(1, 0, 0, 3) + request(2, 1, 1, 2), 2),
    ("two on one device count once", steps([0, 4]) + request(1, 0, 0, 3) + request(2, 0, 1, 2), 1),
    ("three at once before the first step do not count", steps([2, 6]) + request(1, 0, 0, 1) + request(4, 3, 0, 1)
     + request(5, 4, 0, 1) + request(2, 1, 2, 5) + request(3, 2, 3, 4), 2),
])
def test_a_measured_job_needs_the_devices_it_kept_busy_at_once(name, events, devices):
    assert profile_from_events(events, "j", slot_s=1.0, models=MODELS).devices == devices, name


PROFILING_CASES = {
    # name: (events, slot_s, expected demand)
    "other jobs are ignored": (
        steps([0, 4]) + request(1, 0, 0, 2) + request(9, 1, 0, 4, job="other"), 1.0, (1, 1, 0, 0)),
    "sub-slot requests count fractionally": (
        steps([0, 4]) + request(1, 0, 0.25, 0.75) + request(2, 0, 2.0, 2.5), 2.0, (0.25, 0.25)),
    "a request across a step boundary is split": (
        steps([0, 4, 8]) + request(1, 0, 3, 5), 1.0, (0.5, 0, 0, 0.5)),
    "a request still running is busy until the last step": (
        steps([0, 4]) + request(1, 0, 2, 3)[:1], 1.0, (0, 0, 1, 1)),
    "device-side transitions are busy time": (
        steps([0, 4]) + [{"t": 1.0, "event": "transition", "job": "j", "kind": "load", "device": 0,
                          "seconds": 2.0}], 1.0, (0, 1, 1, 0)),
    "host-side transitions are not": (
        steps([0, 4]) + [{"t": 1.0, "event": "transition", "job": "j", "kind": "spill", "device": None,
                          "seconds": 2.0}], 1.0, (0, 0, 0, 0)),
    "a longer step is stretched onto the median period": (
        steps([0, 4, 8, 16]) + request(1, 0, 0, 2) + request(2, 0, 4, 6) + request(3, 0, 8, 12),
        1.0, (1, 1, 0, 0)),
}


@pytest.mark.parametrize("name", PROFILING_CASES)
def test_profiling_table(name):
    events, slot_s, expected = PROFILING_CASES[name]
    p = profile_from_events(events, "j", slot_s=slot_s, models=MODELS, devices=1)
    assert p.demand == pytest.approx(expected)


def test_last_steps_keeps_the_recent_ones():
    events = steps([0, 4, 8]) + request(1, 0, 0, 4)  # busy through step 0 only
    assert profile_from_events(events, "j", 1.0, MODELS, devices=1).demand == pytest.approx((0.5,) * 4)
    assert profile_from_events(events, "j", 1.0, MODELS, devices=1, last_steps=1).demand == pytest.approx((0,) * 4)


def test_profiling_needs_a_complete_step():
    with pytest.raises(ValueError, match="at least two 'step' records"):
        profile_from_events(steps([0.0]) + request(1, 0, 0, 1), "j", 1.0, MODELS)


def test_a_step_that_took_no_time_is_left_out():
    """Two step marks at one moment (a client reporting a step it did no work in) make a step
    of no length: it has no shape to stretch onto the period, so it neither dilutes the demand
    nor is divided by zero (the runtime saw that warning while serving Tinker clients)."""
    import warnings

    events = square_wave_log(n_steps=2)
    doubled = events + [{"t": 10.0, "event": "step", "job": "j", "step": 99}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        measured = profile_from_events(doubled, "j", slot_s=1.0, models=MODELS)
    assert measured == profile_from_events(events, "j", slot_s=1.0, models=MODELS)
    with pytest.raises(ValueError, match="a step that took time"):
        profile_from_events(steps([3.0, 3.0]) + request(1, 0, 0, 1), "j", 1.0, MODELS)


@settings(max_examples=30, deadline=None)
@given(
    n_steps=st.integers(1, 4),
    period=st.integers(2, 12),
    busy=st.lists(st.tuples(st.integers(0, 3), st.floats(0.0, 1.0), st.floats(0.0, 1.0)), max_size=4),
)
def test_profiled_busy_time_equals_the_busy_time_in_the_log(n_steps, period, busy):
    """Steps of exactly one period are not stretched, so busy device-time is conserved."""
    events = steps([k * period for k in range(n_steps + 1)])
    total = 0.0
    for rid, (device, a, b) in enumerate(busy):
        start, end = sorted((a * n_steps * period, b * n_steps * period))
        events += request(rid, device, start, end)
        total += end - start
    p = profile_from_events(events, "j", slot_s=1.0, models=MODELS, devices=4)
    assert all(0.0 <= d <= 4.0 for d in p.demand)
    assert p.busy_device_s * n_steps == pytest.approx(total, abs=1e-6)


def call(rid: int, device: int, arrival: float, dispatch: float, end: float, job: str = "j",
         model: str = "policy") -> list[dict]:
    """A device call as the runtime logs it: arrival, dispatch (a device took it), start, end."""
    base = {"job": job, "model": model, "fn": "sample", "request_id": rid}
    return [{"t": arrival, "event": "arrival", **base}, {"t": dispatch, "event": "dispatch", "device": device, **base},
            {"t": dispatch, "event": "start", "device": device, **base}, {"t": end, "event": "end", "device": device, **base}]


def test_waiting_for_a_device_held_by_others_is_cut_from_the_profile():
    """Steps of 2 s: each call arrives at the step's start, waits 1 s for a device another job
    holds, then runs 1 s. Alone the job would run 1 s steps, busy all the time: that is its
    profile (measured as it ran, it would carry the 100% inflation sharing gave it)."""
    events = steps([0, 2, 4, 6])
    for k in range(3):
        events += call(k, 0, 2 * k, 2 * k + 1, 2 * k + 2)
    events += request(99, 0, 0, 5, job="other")
    p = profile_from_events(events, "j", slot_s=0.5, models=MODELS)
    assert p.period_s == pytest.approx(1.0) and p.demand == pytest.approx((1.0, 1.0))
    # one phase per step, its call 1 s long: residual 1^2 / (2 x 1 s period)
    assert p.barriers == 1 and p.residual_s == pytest.approx(0.5)
    assert waited_s(events, "j") == pytest.approx(3.0)


@pytest.mark.parametrize("name, events, waited", [
    # its own model's earlier call runs: the next one is not ready yet, so it does not wait
    ("behind its own call", call(1, 0, 0, 0, 2) + call(2, 1, 0.5, 2, 3), 0.0),
    # another model of the job runs meanwhile: the job is not held up
    ("while another of its models runs", call(1, 0, 0, 0, 2, model="critic") + call(2, 1, 0.5, 1.5, 3), 0.0),
    ("ready and nothing running", call(1, 0, 0, 0, 1) + call(2, 0, 1.5, 2.5, 3), 1.0),
])
def test_only_ready_calls_with_nothing_of_the_job_running_wait(name, events, waited):
    assert waited_s(events + steps([0, 3]), "j") == pytest.approx(waited), name


def test_phases_are_calls_that_overlap():
    # step 0: two calls at once (one phase), then one alone: 2 phases; calls 1 s, 1 s, 2 s
    events = steps([0, 4]) + call(1, 0, 0, 0, 1) + call(2, 1, 0, 0, 1, model="critic") + call(3, 0, 1, 1, 3)
    p = profile_from_events(events, "j", slot_s=1.0, models=MODELS)
    assert p.devices == 2 and p.barriers == 2
    assert p.residual_s == pytest.approx((1 + 1 + 4) / (2 * 4.0) / 2)  # per device


def test_a_transition_on_another_device_does_not_make_a_second_device():
    """The runtime lets go of a state's copy on the device it left while its call runs on another."""
    events = steps([0, 4]) + request(1, 1, 0, 3) + [
        {"t": 1.0, "event": "transition", "job": "j", "kind": "offload", "device": 0, "seconds": 0.5}]
    assert profile_from_events(events, "j", slot_s=1.0, models=MODELS).devices == 1


# -- drift ---------------------------------------------------------------------------------------

DRIFT_CASES = {
    # name: (measured, drifted at tolerance 0.2?)
    "same profile": (profile((2, 2, 0, 0)), False),
    "finer slots, same shape": (profile((2, 2, 2, 2, 0, 0, 0, 0), period_s=4.0), False),
    "period 10% longer": (profile((2, 2, 0, 0), period_s=4.4), False),
    "period 30% longer": (profile((2, 2, 0, 0), period_s=5.2), True),
    "busy phase moved": (profile((0, 2, 2, 0)), True),
    "other device count": (profile((1, 1, 0, 0), devices=1), True),
}


@pytest.mark.parametrize("name", DRIFT_CASES)
def test_drift_table(name):
    measured, expected = DRIFT_CASES[name]
    assert drifted(profile((2, 2, 0, 0)), measured, tolerance=0.2) is expected


def test_drift_of_a_shape_change_is_the_moved_busy_fraction():
    # one of two busy slots moved: half the busy time is elsewhere, counted at both ends
    assert drift(profile((2, 2, 0, 0)), profile((0, 2, 2, 0))) == pytest.approx(1.0)
    assert drift(profile((2, 0)), profile((2, 0), devices=3)) == math.inf


# -- the window a runtime sends ------------------------------------------------------------------


def long_call_log() -> list[dict]:
    """Six 2 s steps; each step's calls, and one 5 s call of another model that spans steps 1-3."""
    events = steps([0, 2, 4, 6, 8, 10, 12])
    for k in range(6):
        events += call(k, 0, 2 * k, 2 * k, 2 * k + 1)
    events += call(99, 1, 2.5, 2.5, 7.5, model="critic")
    return sorted(events, key=lambda e: e["t"])


def test_a_window_keeps_the_earlier_records_of_requests_still_going():
    events = long_call_log()
    kept = window(events, 6.0)
    assert all(e["t"] >= 6.0 or e["request_id"] == 99 for e in kept)
    assert [e["event"] for e in kept if e.get("request_id") == 99] == ["arrival", "dispatch", "start", "end"]
    assert not any(e.get("request_id") == 1 for e in kept)  # ended before the window
    assert kept == [e for e in events if e in kept]  # in their order


@pytest.mark.parametrize("last_steps", [1, 2, 3, 6])
def test_profiling_the_last_steps_from_their_window_is_profiling_them_from_the_whole_log(last_steps):
    events = long_call_log()
    marks = sorted(e["t"] for e in events if e["event"] == "step")
    since = marks[-(last_steps + 1)]
    whole = profile_from_events(events, "j", 0.5, MODELS, last_steps=last_steps)
    assert profile_from_events(window(events, since), "j", 0.5, MODELS, last_steps=last_steps) == whole
    if last_steps < 6:
        assert len(window(events, since)) < len(events)
