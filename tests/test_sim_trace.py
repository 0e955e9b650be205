"""`plexrl sim W --trace DIR`: the simulator's runs as event logs and traces in the runtime's
format. On the hand-computed three-job timeline of test_sim_timeline.py the trace is exact; on a
shipped workload recording changes no result and accounts for every GPU-second of every call."""

from __future__ import annotations

import json

import numpy as np
import pytest

from plexrl import cli
from plexrl.observe.perfetto import DEVICES, write_trace
from plexrl.policy import Policy
from plexrl.sim.modes import make_mode
from plexrl.sim.recorder import SimRecorder
from plexrl.sim.report import summarize
from plexrl.sim.workload import load_cluster, load_workload
from tests.test_sim_timeline import run_three_jobs


def three_jobs_recorded() -> list[dict]:
    """test_sim_timeline's three jobs under the plexrl policy, recorded: J1 [0,10], J2 (arrived at 1)
    [10,14], J3 (arrived at 2) offloads J1's state [14,16], loads its own [16,18], runs [18,20]."""
    _, service, _ = run_three_jobs(Policy.PLEXRL, SimRecorder())
    return service.record.sorted_records()


def test_the_hand_computed_timeline_as_a_trace(tmp_path):
    records = three_jobs_recorded()
    counts = write_trace(records, tmp_path / "trace.json")
    assert counts["calls"] == 3 and counts["switches"] == 2 and counts["flows"] == 3
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    slices = sorted((x["ts"] / 1e6, x["dur"] / 1e6, x["name"], x["args"]["job"]) for x in trace
                    if x["ph"] == "X" and x["pid"] == DEVICES and x["tid"] == 0)
    assert slices == [(0.0, 10.0, "update", "J1"), (10.0, 4.0, "update", "J2"), (14.0, 2.0, "offload", "J3"),
                      (16.0, 2.0, "load", "J3"), (18.0, 2.0, "update", "J3")]
    flows = sorted((x["ph"], x["ts"] / 1e6) for x in trace if x.get("cat") == "queue")  # J2 waited 1 -> 10, J3 2 -> 18
    assert flows == [("f", 0.0), ("f", 10.0), ("f", 18.0), ("s", 0.0), ("s", 1.0), ("s", 2.0)]
    steps = [x for x in trace if x["ph"] == "i"]
    assert sorted(x["ts"] / 1e6 for x in steps) == [10.0, 14.0, 20.0]


@pytest.fixture(scope="module")
def paper_mix():
    workload = load_workload("paper-mix")
    return workload, load_cluster(workload.cluster)


@pytest.mark.parametrize("name", ["plexrl", "colocated"])
def test_recording_changes_nothing_and_accounts_for_every_call(paper_mix, name):
    workload, cluster = paper_mix
    plain = make_mode(name, workload, cluster).run()
    mode = make_mode(name, workload, cluster)
    mode.service.record = SimRecorder()
    recorded = mode.run()
    baseline = make_mode("colocated", workload, cluster).run()
    figures = lambda run: {k: v for k, v in summarize(run, baseline).items() if k != "wall_s"}  # noqa: E731
    assert figures(recorded) == figures(plain)
    records = mode.service.record.records
    ends = [r for r in records if r["event"] == "end"]
    starts = {r["request_id"]: r["t"] for r in records if r["event"] == "dispatch"}
    gpu_s = sum((r["t"] - starts[r["request_id"]]) * len(r.get("devices", [r["device"]])) for r in ends)
    start, stop, gpus = np.frombuffer(mode.service.busy, dtype=np.float64).reshape(-1, 3).T
    assert gpu_s == pytest.approx(float(((stop - start) * gpus).sum()), rel=1e-9)
    assert len(ends) == len(start)


def test_sim_trace_flag_writes_a_log_and_a_trace_per_mode(tmp_path):
    assert cli.main(["sim", "paper-mix", "--modes", "plexrl", "--processes", "1", "--json",
                     "--trace", str(tmp_path)]) == 0
    for mode in ("colocated", "plexrl"):
        trace = json.loads((tmp_path / f"{mode}.trace.json").read_text())["traceEvents"]
        log = [json.loads(line) for line in (tmp_path / f"{mode}.events.jsonl").read_text().splitlines()]
        calls = sum(len(r.get("devices", [r["device"]])) for r in log if r["event"] == "end")
        assert sum(1 for x in trace if x.get("cat") == "call") == calls > 0
        lanes: dict[int, list] = {}
        for x in trace:
            if x["ph"] == "X" and x["pid"] == DEVICES and x["tid"] % 2 == 0:
                lanes.setdefault(x["tid"], []).append((x["ts"], x["ts"] + x["dur"]))
        for lane in lanes.values():  # a GPU runs one call at a time, and its switches between them
            lane.sort()
            assert all(a[1] <= b[0] + 1e-3 for a, b in zip(lane, lane[1:]))
