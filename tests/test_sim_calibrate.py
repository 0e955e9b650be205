"""Calibration against the real runtime: a tiny LocalCluster run's event log, replayed by the simulator.

The log comes from a real run in this test (two jobs multiplexed on two logical devices whose
budget forces switches), never from a stored file. Checks: the trace keeps every completed call
once with a monotone happens-before; its per-job charges equal the runtime ledger's; the replay
serves every call once within the device budget; with each call's own measured time the replay
charges each call exactly its own measured time; a log that the mechanism itself could have
written (a hand-made timeline of two jobs sharing one device) is replayed to the same times, so
the calibration error there is exactly zero; the CLI prints the errors.

How close a replay comes to a *timing run* (steps of ~0.1 s on shared cores, where the runtime's
own Python overhead and interpreter-lock waits vary with machine load) is a benchmark, measured
and reported by `plexrl sim calibrate` on the demo's log, never asserted here.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import numpy as np
import pytest

import plexrl
from plexrl.errors import ConfigError
from plexrl.sim import cli
from plexrl.sim.calibrate import calibrate, replay
from plexrl.sim.trace import build_trace, load_trace

MiB = 1 << 20
STEPS = 5


def controller(cluster, job: str, model_dir: str, seed: int) -> None:
    """sample -> (controller time) -> cross-entropy update on the samples -> sync, per step."""
    trainer = cluster.service_client(job=job).create_training_client(base_model=model_dir, seed=seed)
    prompt = [5 + seed, 6, 7]
    for step in range(STEPS):
        sampler = trainer.save_weights_and_get_sampling_client()
        out = sampler.sample(plexrl.ModelInput.from_ints(prompt), num_samples=4,
                             sampling_params=plexrl.SamplingParams(max_tokens=8, seed=10 * seed + step)).result()
        time.sleep(0.02)  # a reward / tool call: the device is idle for this job
        data = [plexrl.Datum(plexrl.ModelInput.from_ints((prompt + s.tokens)[:-1]),
                             {"target_tokens": (prompt + s.tokens)[1:]}) for s in out.sequences]
        trainer.forward_backward(data, loss_fn="cross_entropy")
        trainer.optim_step(plexrl.AdamParams(learning_rate=1e-3)).result()
        cluster.report_step(job, step)


@pytest.fixture(scope="module")
def real_run(tiny_model, tmp_path_factory):
    """(events path, runtime metrics, device budget) of two jobs sharing two devices."""
    path = tmp_path_factory.mktemp("calib") / "events.jsonl"
    with plexrl.LocalCluster(devices=1, device_memory_bytes=64 * MiB) as probe:
        trainer = probe.service_client(job="probe").create_training_client(base_model=tiny_model, seed=0)
        state_bytes, reserve = trainer.state.device_bytes, trainer.state.activation_reserve_bytes
    budget = state_bytes + state_bytes // 2  # one trainer and a snapshot: jobs must switch
    with plexrl.LocalCluster(devices=2, device_memory_bytes=budget + reserve, host_memory_bytes=256 * MiB) as cluster:
        threads = [threading.Thread(target=controller, args=(cluster, f"job-{i}", tiny_model, i)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        metrics = cluster.metrics()
        cluster.write_events(path)
    return path, metrics, budget


def test_trace_keeps_every_call_once_with_monotone_dependencies(real_run):
    path, _, _ = real_run
    events = [json.loads(line) for line in path.read_text().splitlines()]
    trace = load_trace(path)
    ended = {e["request_id"] for e in events if e["event"] == "end" and e.get("ok", True)}
    assert sorted(c.id for c in trace.calls) == sorted(ended)
    for job in trace.jobs:
        afters = [c.after for c in trace.calls if c.job == job]
        assert afters == sorted(afters), f"{job}: happens-before counts must not decrease in arrival order"
        assert all(c.gap_s >= 0 for c in trace.calls if c.job == job)
    assert len(trace.steps) == 3 * STEPS
    assert trace.devices == (0, 1)


def test_trace_charges_equal_the_runtime_ledger(real_run):
    path, metrics, _ = real_run
    trace = load_trace(path)
    for job, totals in trace.totals.items():
        real = metrics["jobs"][job]
        assert totals.consumed_device_s == pytest.approx(real["consumed_device_s"], rel=1e-9, abs=1e-9), job
        assert totals.switch_s == pytest.approx(real["switch_s"], rel=1e-9, abs=1e-9), job


@pytest.mark.parametrize("profile", ["profile", "exact"])
def test_replay_serves_every_call_once_within_budget(real_run, profile):
    path, _, budget = real_run
    trace = load_trace(path)
    result = replay(trace, profile, device_bytes=budget)
    assert result.served == len(trace.calls)
    assert sorted(result.call_end) == sorted(c.id for c in trace.calls)
    assert result.peak_device_bytes <= budget
    assert len(result.step_t) == len(trace.steps)


def test_exact_replay_charges_each_call_its_own_time(real_run):
    """With each call's own time, a job's execution charge is the real one, whatever the order
    of dispatch; what differs is the simulated mechanism (switches), never negative or missing."""
    path, _, budget = real_run
    trace = load_trace(path)
    result = replay(trace, "exact", device_bytes=budget)
    for job, totals in trace.totals.items():
        usage = result.ledger.jobs[job]
        assert usage.exec_s == pytest.approx(totals.exec_s, rel=1e-9, abs=1e-12), job
        assert usage.switch_s >= 0.0
        assert usage.requests == sum(1 for c in trace.calls if c.job == job and c.device is not None)
    doc = calibrate(trace, device_bytes=budget)
    for profile in ("profile", "exact"):
        for row in doc[profile]["jobs"].values():
            assert np.isfinite(row["step_s_error"]) and np.isfinite(row["device_s_error"])
            assert row["step_s_sim"] > 0 and row["device_s_sim"] > 0


# A timeline the runtime's mechanism could have written: jobs A and B, one device whose budget
# holds one state. A's forward_backward leaves its state dirty (the offload after it copies 100
# bytes, 0.2 s); B's sample does not (its offload copies nothing, 0.01 s); a load takes 0.1 s.
#   t=0     a1 arrives; dispatched at once: load A (0.1), run 0.5        -> ends 0.6
#   t=0.05  b1 arrives; waits for the device
#   t=0.6   b1 dispatched: offload A dirty (0.2), load B (0.1), run 0.3  -> ends 1.2
#   t=0.65  a2 arrives (A's controller: 0.05 s after a1 ended); waits
#   t=1.2   a2 dispatched: offload B clean (0.01), load A (0.1), run 0.2 -> ends 1.51
#   B marks step 0 at 1.25 (0.05 after b1), A at 1.52 (0.01 after a2).
HAND_CALLS = [  # id, job, fn, arrival, dispatch, transitions [(kind, state, seconds, bytes)], run seconds
    (1, "A", "forward_backward", 0.0, 0.0, [("load", "A/p", 0.1, 100)], 0.5),
    (2, "B", "sample", 0.05, 0.6, [("offload", "A/p", 0.2, 100), ("load", "B/p", 0.1, 100)], 0.3),
    (3, "A", "forward_backward", 0.65, 1.2, [("offload", "B/p", 0.01, 0), ("load", "A/p", 0.1, 100)], 0.2),
]
HAND_ENDS = {1: 0.6, 2: 1.2, 3: 1.51}
HAND_STEPS = {"A": 1.52, "B": 1.25}


def hand_events() -> list[dict]:
    events = [{"t": 0.0, "event": "state_added", "state": f"{j}/p", "job": j, "device_bytes": 100, "host_bytes": 100}
              for j in ("A", "B")]
    for rid, job, fn, arrival, dispatch, moves, run_s in HAND_CALLS:
        ids = {"request_id": rid, "job": job, "model": f"{job}/p", "fn": fn, "device": 0}
        events += [{"t": arrival, "event": "arrival", **ids}, {"t": dispatch, "event": "dispatch", **ids}]
        t = dispatch
        for kind, state, seconds, nbytes in moves:
            events.append({"t": t, "event": "transition", "kind": kind, "state": state, "job": job, "device": 0,
                           "bytes": nbytes, "seconds": seconds, "state_bytes": 100})
            t += seconds
        events += [{"t": t, "event": "start", **ids},
                   {"t": t + run_s, "event": "end", **ids, "ok": True, "wall_s": run_s, "device_s": run_s}]
    events += [{"t": t, "event": "step", "job": job, "step": 0} for job, t in HAND_STEPS.items()]
    return events


def test_a_timeline_the_mechanism_could_write_is_replayed_exactly():
    trace = build_trace(hand_events())
    assert trace.dispatch_s == pytest.approx(0.0, abs=1e-12) and trace.dirtying_fns == {"forward_backward"}
    result = replay(trace, "exact", device_bytes=100)
    assert result.call_end == pytest.approx(HAND_ENDS, abs=1e-9)
    assert {job: t for (job, _), t in result.step_t.items()} == pytest.approx(HAND_STEPS, abs=1e-9)
    charged = {"A": 0.5 + 0.1 + 0.2 + 0.01 + 0.1, "B": 0.3 + 0.2 + 0.1}  # execution + the switches it forced
    assert {j: u.consumed_device_s for j, u in result.ledger.jobs.items()} == pytest.approx(charged, abs=1e-9)
    doc = calibrate(trace, device_bytes=100)
    errors = [row[k] for row in doc["exact"]["jobs"].values() for k in ("step_s_error", "device_s_error")]
    assert errors == pytest.approx([0.0] * 4, abs=1e-9)
    assert doc["exact"]["within_target"]


@pytest.mark.parametrize("dispatch_s", [0.0, 0.02])
def test_a_slower_device_lengthens_the_replayed_steps(dispatch_s):
    """The replay is driven by the calls' times, not the log's clock: doubling every call's hold
    (and adding dispatch overhead) moves every end later by exactly the added device time."""
    trace = build_trace(hand_events())
    calls = tuple(dataclasses.replace(c, wall_s=2 * c.wall_s, device_s=2 * c.device_s) for c in trace.calls)
    trace = dataclasses.replace(trace, calls=calls, dispatch_s=dispatch_s)
    result = replay(trace, "exact", device_bytes=100)
    added = {1: 0.5 + dispatch_s, 2: 0.5 + 0.3 + 2 * dispatch_s, 3: 0.5 + 0.3 + 0.2 + 3 * dispatch_s}
    assert result.call_end == pytest.approx({k: HAND_ENDS[k] + added[k] for k in HAND_ENDS}, abs=1e-9)


def test_the_hold_is_start_to_end_not_the_function_alone():
    """On the process and Ray engines a device is held for the hop to its process and back and
    for the write-through, beyond the function's own `wall_s`: the trace keeps the whole hold."""
    events = hand_events()
    for e in events:
        if e["event"] == "end":
            e["wall_s"] /= 2  # the function took half of what held the device
    trace = build_trace(events)
    assert {c.id: c.wall_s for c in trace.calls} == pytest.approx({1: 0.5, 2: 0.3, 3: 0.2}, abs=1e-9)
    assert replay(trace, "exact", device_bytes=100).call_end == pytest.approx(HAND_ENDS, abs=1e-9)


def test_replay_is_deterministic(real_run):
    path, _, budget = real_run
    trace = load_trace(path)
    a, b = replay(trace, "profile", budget), replay(trace, "profile", budget)
    assert a.call_end == b.call_end and a.step_t == b.step_t


@pytest.mark.parametrize("events", [
    [{"t": 0.0, "event": "step", "job": "j", "step": 0}],
    [{"t": 0.0, "event": "arrival", "request_id": 1, "job": "j", "model": "j/m", "fn": "f", "group": 0}],
], ids=["only-a-step", "no-ends"])
def test_logs_without_completed_calls_fail_clearly(events):
    with pytest.raises(ConfigError, match="no 'end' events"):
        build_trace(events)


def test_a_line_that_is_not_json_is_named(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"t": 0.0, "event": "step", "job": "j", "step": 0}\nnot json\n')
    with pytest.raises(ConfigError, match="events.jsonl:2: not a JSON object"):
        load_trace(path)


def test_budget_below_the_largest_state_fails_clearly(real_run):
    path, _, _ = real_run
    with pytest.raises(ConfigError, match="smaller than the largest state"):
        replay(load_trace(path), "exact", device_bytes=1)


def test_cli_prints_per_job_errors(real_run, capsys):
    path, _, budget = real_run
    assert cli.main(["calibrate", str(path), "--device-bytes", str(budget), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["profile"]["jobs"]) == {"job-0", "job-1", "job-2"}
    assert {"step_s_error", "device_s_error", "step_s_real", "device_s_sim"} <= set(doc["exact"]["jobs"]["job-0"])
    assert cli.main(["calibrate", str(path.parent / "missing.jsonl")]) == 2
