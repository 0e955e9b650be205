"""`plexrl demo --quick --json --jobs 4 --repeat 2`: one run (more jobs than devices), the JSON the
issue asks for, and the files it writes; a multiplexed run alone with `--read-replicas off`; the
exclusive schedule computed and the job list, pure; the exclusive schedule run. (`plexrl demo`
without `--repeat` reports one pair: tests/test_ray_rl.py.)

The warm-started models come from the user's cache (built on the first run, like `make demo`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from plexrl.policy import ModelMemory, profile_from_events
from plexrl.policy.placement.cotenancy import pooled_inflation
from plexrl.rl import demo as demo_cli
from plexrl.rl.demo_experiment import MUX_DEVICES, DedicatedRun, DemoRuns, ExclusiveRun, demo_jobs, run_multiplexed
from plexrl.rl.demo_figures import exclusive_schedule, mux_floor, predicted_from_alone, repeated, summarise
from plexrl.rl.demo_view import Progress
from plexrl.rl.warm_start import warm_model
from plexrl.runtime.config import ClusterConfig
from plexrl.runtime.cuda import resolve_device
from test_profile import call
from test_profile import steps as step_marks


def run_demo(out, *options) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-m", "plexrl.cli", "demo", "--quick", "--json", "--out", str(out), *options],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)  # stdout must be exactly one JSON object


JOBS = 4  # more jobs than devices: the demo cycles through its three


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """One demo run for the module: each of its runs opens clusters whose start-up dominates it."""
    out = tmp_path_factory.mktemp("demo")
    return run_demo(out, "--jobs", str(JOBS), "--repeat", "2"), out


@pytest.mark.parametrize("durations, devices, expected", [
    ([("a", 3.0), ("b", 2.0), ("c", 4.0)], 2, [(0, 0.0, 3.0), (1, 0.0, 2.0), (1, 2.0, 6.0)]),
    ([("a", 1.0), ("b", 1.0)], 2, [(0, 0.0, 1.0), (1, 0.0, 1.0)]),               # ties: the lower device
    ([("a", 1.0), ("b", 2.0), ("c", 1.0)], 1, [(0, 0.0, 1.0), (0, 1.0, 3.0), (0, 3.0, 4.0)]),  # one after another
], ids=["three-on-two", "tie", "one-device"])
def test_exclusive_schedule_is_list_scheduling_in_arrival_order(durations, devices, expected):
    rows = exclusive_schedule(durations, devices)
    assert [(r["device"], r["start_s"], r["end_s"]) for r in rows] == expected
    assert [r["name"] for r in rows] == [name for name, _ in durations]


def test_more_jobs_cycle_through_the_three_with_new_names_and_seeds():
    three, six = demo_jobs(quick=True), demo_jobs(quick=True, jobs=6)
    assert six[:3] == three  # the default jobs, unchanged
    assert [s.name for s in six[3:]] == [f"{s.name}-2" for s in three]
    assert [s.task for s in six[3:]] == [s.task for s in three]
    assert len({s.name for s in six}) == 6 and len({s.seed for s in six}) == 6
    assert [s.name for s in demo_jobs(quick=True, jobs=2)] == [s.name for s in three[:2]]


def test_what_prints_after_the_live_progress_starts_a_line_of_its_own(capsys):
    """Off a terminal (`make demo | tee log`) rich ends a live display's last render without a
    newline; the final table's title used to join its last line."""
    progress = Progress(demo_jobs(quick=True), enabled=True)
    with progress:
        progress.cluster_line = "utilisation 50%  switches 3\ntools-rpp/policy: device:0"
    progress.say("after")
    assert "\nafter\n" in capsys.readouterr().out


@pytest.mark.slow
def test_json_has_the_final_table(demo):
    summary, _ = demo
    for key in ("jobs", "cost_reduction", "identical_rewards", "makespan_mux_s", "makespan_sequential_s", "switches",
                "makespan_exclusive_s", "makespan_mux_vs_exclusive", "exclusive_schedule", "device_s_held_mux",
                "makespan_exclusive_computed_s", "makespan_mux_vs_exclusive_computed", "exclusive_schedule_computed",
                "device_s_held_exclusive", "device_s_held_exclusive_jobs", "makespan_exclusive_longest_first_s",
                "host_cpu_s_mux"):
        assert key in summary
    assert [job["name"] for job in summary["jobs"]] == [s.name for s in demo_jobs(quick=True, jobs=JOBS)]
    assert summary["engine"] == "process"  # the default
    assert summary["read_replicas"] is True  # --read-replicas auto: on for the process engine
    for job in summary["jobs"]:
        for key in ("name", "algorithm", "steps", "reward_first", "reward_last", "consumed_device_s", "reserved_device_s"):
            assert key in job
        assert len(job["rewards_mux"]) == job["steps"]
        assert job["consumed_device_s"] > 0 and job["reserved_device_s"] > 0


@pytest.mark.slow
def test_exclusive_baseline_is_run_on_the_same_devices(demo):
    """The exclusive schedule is run: each job holds one device from its start to its end, a
    device runs one job at a time, jobs start in arrival order, and a device takes the next job
    as soon as its last one ends (list scheduling); its rewards are the dedicated ones."""
    summary, _ = demo
    rows = summary["exclusive_schedule"]
    assert [row["name"] for row in rows] == [job["name"] for job in summary["jobs"]]
    assert len(rows) == JOBS and summary["makespan_exclusive_s"] > 0
    assert sorted({row["device"] for row in rows}) == list(range(MUX_DEVICES))  # more jobs than devices: both used
    starts = [row["start_s"] for row in rows]
    assert starts == sorted(starts) and all(row["start_s"] < row["end_s"] for row in rows)
    for device in range(MUX_DEVICES):
        runs = sorted((row["start_s"], row["end_s"]) for row in rows if row["device"] == device)
        assert runs[0][0] < 0.5  # every device starts a job at once (more jobs than devices)
        for (_, end), (start, _) in zip(runs, runs[1:]):
            assert end <= start < end + 0.5  # one at a time, the next taken as the last one ends
    assert summary["makespan_exclusive_s"] == max(row["end_s"] for row in rows)
    assert summary["makespan_mux_vs_exclusive"] == pytest.approx(summary["makespan_mux_s"] / summary["makespan_exclusive_s"])
    assert summary["device_s_held_mux"] == pytest.approx(MUX_DEVICES * summary["makespan_mux_s"])
    assert summary["device_s_held_exclusive"] == pytest.approx(MUX_DEVICES * summary["makespan_exclusive_s"])
    assert summary["device_s_held_exclusive_jobs"] == pytest.approx(sum(r["end_s"] - r["start_s"] for r in rows))
    assert all(job["step_s_exclusive"] > 0 for job in summary["jobs"])


@pytest.mark.slow
def test_the_exclusive_schedule_computed_from_the_dedicated_runs_is_reported_too(demo):
    summary, _ = demo
    walls = [job["reserved_device_s"] for job in summary["jobs"]]
    computed = summary["exclusive_schedule_computed"]
    assert computed == exclusive_schedule([(job["name"], job["reserved_device_s"]) for job in summary["jobs"]], MUX_DEVICES)
    assert summary["makespan_exclusive_computed_s"] == max(row["end_s"] for row in computed)
    assert max(walls) <= summary["makespan_exclusive_computed_s"] <= summary["makespan_sequential_s"] == pytest.approx(sum(walls))
    assert max(walls) <= summary["makespan_exclusive_longest_first_s"] <= summary["makespan_sequential_s"]
    assert summary["makespan_mux_vs_exclusive_computed"] == pytest.approx(
        summary["makespan_mux_s"] / summary["makespan_exclusive_computed_s"])


@pytest.mark.slow
def test_each_schedules_device_time_and_the_multiplexed_runs_floor_are_reported(demo):
    """The runs happen one after another on a machine whose speed moves: each run's device time for
    the same calls says how fast its devices computed, and the floor what the multiplexed run's own
    work needed of its devices and cores."""
    summary, _ = demo
    jobs = summary["jobs"]
    assert summary["device_busy_s_dedicated"] == pytest.approx(sum(job["dedicated_busy_s"] for job in jobs))
    assert summary["device_busy_s_mux"] == pytest.approx(sum(job["consumed_device_s"] for job in jobs))
    assert summary["device_busy_s_exclusive"] > 0 and summary["host_cpu_s_exclusive"] > 0
    assert summary["device_busy_mux_vs_exclusive"] == pytest.approx(
        summary["device_busy_s_mux"] / summary["device_busy_s_exclusive"])
    on_devices = summary["device_busy_s_mux"] / MUX_DEVICES
    on_cores = (summary["device_busy_s_mux"] + summary["host_cpu_s_mux"]) / summary["cpu_cores"]
    floor = summary["makespan_mux_floor_s"]
    assert floor == pytest.approx(max(on_devices, on_cores) if resolve_device("auto") == "cpu" else on_devices)
    assert floor <= summary["makespan_mux_s"] * 1.02  # what the run computed fits in the time it took


@pytest.mark.parametrize("engine, expected", [("process", 3.0), ("ray", 3.0), ("local", 2.0)])
def test_the_floor_counts_the_local_engines_devices_once(engine, expected, monkeypatch):
    """Device time 4 s on 2 devices (2 s each), this process's CPU 2 s, on 2 cores: the devices'
    processes and this one need 3 s of both cores; the local engine's devices are this process's
    threads, whose CPU holds theirs already (so its floor is the devices' 2 s)."""
    monkeypatch.setattr("plexrl.rl.demo_figures.usable_cpus", lambda: 2)
    assert mux_floor(4.0, 2.0, "cpu", engine) == pytest.approx(expected)


@pytest.mark.slow
def test_job_completion_times_are_reported_for_both_schedules(demo):
    summary, _ = demo
    names = [job["name"] for job in summary["jobs"]]
    assert summary["jct_exclusive_s"] == {row["name"]: row["end_s"] for row in summary["exclusive_schedule"]}
    assert sorted(summary["jct_mux_s"]) == sorted(names)
    assert all(0 < jct <= summary["makespan_mux_s"] for jct in summary["jct_mux_s"].values())
    assert max(summary["jct_mux_s"].values()) == pytest.approx(summary["makespan_mux_s"], abs=0.5)
    assert summary["jct_mean_exclusive_s"] == pytest.approx(sum(summary["jct_exclusive_s"].values()) / len(names))
    assert summary["jct_mean_mux_vs_exclusive"] == pytest.approx(
        summary["jct_mean_mux_s"] / summary["jct_mean_exclusive_s"])


@pytest.mark.slow
def test_each_jobs_slowdown_is_judged_by_its_slack(demo):
    summary, _ = demo
    for job in summary["jobs"]:
        assert job["slack"] == 0.10  # the JobSpec default: the demo's jobs declare none
        assert job["slowdown"] == pytest.approx(job["step_s_mux"] / job["step_s_dedicated"] - 1)
        assert job["within_slack"] == (job["slowdown"] <= job["slack"])
    assert summary["within_slack"] == pytest.approx(
        sum(job["within_slack"] for job in summary["jobs"]) / len(summary["jobs"]))


@pytest.mark.slow
def test_the_placers_prediction_is_reported_against_the_realised_slowdown(demo):
    """Each job's predicted inflation is the placer's, averaged over its time with a measured
    profile (None only for a job never measured), and the mean error is taken against the
    slowdown the demo measured and against its part spent waiting for devices."""
    summary, _ = demo
    predicted = [j for j in summary["jobs"] if j["inflation_predicted"] is not None]
    for job in summary["jobs"]:
        assert isinstance(job["placement_provisional"], bool)
        assert job["slowdown_waiting"] + job["slowdown_other"] == pytest.approx(job["slowdown"])
    for job in predicted:
        assert job["inflation_predicted"] >= 0
    assert summary["profiles_unmeasured"] == len(summary["jobs"]) - len(predicted)
    if predicted:
        assert summary["inflation_mae"] == pytest.approx(
            sum(abs(j["inflation_predicted"] - j["slowdown"]) for j in predicted) / len(predicted))
        assert summary["inflation_mae_waiting"] == pytest.approx(
            sum(abs(j["inflation_predicted"] - j["slowdown_waiting"]) for j in predicted) / len(predicted))
    assert summary["placements_provisional"] == sum(j["placement_provisional"] for j in summary["jobs"])


@pytest.mark.slow
def test_the_model_on_the_profiles_measured_alone_is_reported_too(demo):
    """Beside the runtime's prediction (profiles measured while sharing), the same model on the
    profiles of the dedicated runs, from the event log the demo wrote, with the co-tenants each
    job had (the jobs not yet done), and the devices the jobs keep busy alone."""
    summary, out = demo
    with open(out / "events-dedicated.jsonl") as f:
        dedicated = [json.loads(line) for line in f]
    alone = predicted_from_alone(demo_jobs(quick=True, jobs=JOBS), dedicated, summary["jct_mux_s"])
    for job in summary["jobs"]:
        assert job["inflation_predicted_alone"] == pytest.approx(alone[job["name"]]["inflation_predicted"])
        assert job["busy_share_dedicated"] == pytest.approx(alone[job["name"]]["busy_share"])
        assert 0 < job["busy_share_dedicated"] <= 1  # one device, alone
    assert summary["inflation_mae_waiting_alone"] == pytest.approx(
        sum(abs(j["inflation_predicted_alone"] - j["slowdown_waiting"]) for j in summary["jobs"]) / len(summary["jobs"]))
    assert summary["busy_shares_dedicated"] == pytest.approx(sum(j["busy_share_dedicated"] for j in summary["jobs"]))


def dedicated_log(jobs: dict[str, float], steps: int = 10) -> list[dict]:
    """Each job alone on device 0: steps of 1 s, one call per step busy for `jobs[name]` of it."""
    events = []
    for k, (name, busy) in enumerate(jobs.items()):
        t0 = 100.0 * k  # one after another
        events += step_marks([t0 + i for i in range(steps + 1)], job=name)
        for i in range(steps):
            events += call(1000 * k + i, 0, t0 + i, t0 + i, t0 + i + busy, job=name)
    return events


def test_the_prediction_from_alone_counts_the_co_tenants_each_job_had():
    """Three jobs that each keep one device busy 90% of the time, on two devices: two of them
    never wait for each other (one call at a time each), three do (at least 35%: 2.7 devices of
    work on 2). A job that outlives the third is predicted the three-job figure until the third
    ends and nothing after, weighted by steps as `Forecast` weighs them."""
    specs = demo_jobs(quick=True)
    names = [s.name for s in specs]
    log = dedicated_log({name: 0.9 for name in names})
    ends = {names[0]: 20.0, names[1]: 20.0, names[2]: 10.0}
    alone = predicted_from_alone(specs, log, ends)
    assert [alone[n]["busy_share"] for n in names] == pytest.approx([0.9] * 3)
    profiles = {n: profile_from_events(log, n, ClusterConfig.slot_s, [ModelMemory(n, 0, 0)]) for n in names}
    three = pooled_inflation(profiles[names[2]], [profiles[names[0]], profiles[names[1]]], MUX_DEVICES)
    assert three >= 0.35 and alone[names[2]]["inflation_predicted"] == pytest.approx(three)
    assert pooled_inflation(profiles[names[0]], [profiles[names[1]]], MUX_DEVICES) == 0.0
    first = pooled_inflation(profiles[names[0]], [profiles[names[1]], profiles[names[2]]], MUX_DEVICES)
    weight = 10.0 / (1 + first)  # its first 10 s hold that many seconds' worth of its steps alone
    assert alone[names[0]]["inflation_predicted"] == pytest.approx(first * weight / (weight + 10.0))


def test_no_prediction_from_alone_without_a_complete_step():
    """`plexrl demo --steps 1`: one step mark per job, nothing to profile; nothing is predicted."""
    specs = demo_jobs(quick=True)
    log = [e for e in dedicated_log({s.name: 0.9 for s in specs}, steps=1) if not (e["event"] == "step" and e["step"])]
    ends = {s.name: 1.0 for s in specs}
    assert predicted_from_alone(specs, log, ends) == {s.name: {"busy_share": None, "inflation_predicted": None}
                                                      for s in specs}


@pytest.mark.slow
def test_repeat_runs_both_schedules_again_and_reports_each_pair(demo):
    """`--repeat 2`: the exclusive and multiplexed schedules twice; each pair's makespans and
    ratio, the first pair's the summary's own figures, and their median."""
    summary, _ = demo
    runs = summary["repeats"]
    assert len(runs) == 2
    assert runs[0]["makespan_mux_s"] == summary["makespan_mux_s"]
    assert runs[0]["makespan_exclusive_s"] == summary["makespan_exclusive_s"]
    assert runs[0]["device_busy_mux_vs_exclusive"] == summary["device_busy_mux_vs_exclusive"]
    for run in runs:
        assert run["makespan_mux_vs_exclusive"] == pytest.approx(run["makespan_mux_s"] / run["makespan_exclusive_s"])
        assert run["device_busy_mux_vs_exclusive"] > 0
        assert run["identical_rewards"] is True
    assert summary["makespan_mux_vs_exclusive_median"] == pytest.approx(
        sum(run["makespan_mux_vs_exclusive"] for run in runs) / 2)


@pytest.mark.parametrize("ratios, identical, median", [
    ([0.9], [True], 0.9), ([0.9, 0.7], [True, True], 0.8), ([1.0, 0.8, 0.9], [True, False, True], 0.9)])
def test_the_median_of_the_repeated_pairs_and_rewards_identical_only_if_in_all(ratios, identical, median):
    runs = [{"makespan_mux_s": r, "makespan_exclusive_s": 1.0, "makespan_mux_vs_exclusive": r,
             "device_busy_mux_vs_exclusive": 1.0, "identical_rewards": same} for r, same in zip(ratios, identical)]
    out = repeated(runs[0], runs[1:])
    assert out["repeats"] == runs and out["makespan_mux_vs_exclusive_median"] == pytest.approx(median)
    assert out["identical_rewards"] is all(identical)


@pytest.mark.slow
def test_read_replicas_off_runs_no_call_on_a_replica_and_the_same_rewards(demo, tmp_path):
    """`--read-replicas off`: the multiplexed cluster runs every call on a state's primary (no
    model named `<state>#<n>`), the summary says so, and the job's rewards are its dedicated run's.
    The multiplexed run alone, of the demo's first job, whose dedicated run the module's demo has
    (the same run with read replicas on put calls on a replica: 28 of its events, by hand); the
    dedicated and exclusive runs the summary also needs stand in by its own results (only the
    setting is under test there)."""
    args = demo_cli.parse_args(["--quick", "--json", "--read-replicas", "off", "--out", str(tmp_path)])
    specs = demo_jobs(quick=True, jobs=1)
    models = {s.name: str(warm_model(s.task, s.model)) for s in specs}
    mux = run_multiplexed(specs, models, args, 1 << 30, Progress(specs, enabled=False), tmp_path / "events.jsonl")
    with open(tmp_path / "events.jsonl") as f:
        assert not any("#" in (json.loads(line).get("model") or "") for line in f)
    dedicated = {job["name"]: job["rewards_dedicated"] for job in demo[0]["jobs"]}
    assert {s.name: mux.results[s.name].rewards for s in specs} == {s.name: dedicated[s.name] for s in specs}
    rows = [{"name": s.name, "device": 0, "start_s": 0.0, "end_s": mux.metrics["jct_s"][s.name]} for s in specs]
    stand_in = DemoRuns(specs, DedicatedRun({s.name: (mux.results[s.name], 1.0) for s in specs}, {}, mux.events),
                        [(ExclusiveRun([(row, mux.results[row["name"]]) for row in rows], 1.0, 1.0), mux)])
    assert summarise(stand_in, args).as_json()["read_replicas"] is False


@pytest.mark.slow
def test_multiplexed_rewards_equal_dedicated(demo):
    summary, _ = demo
    assert summary["identical_rewards"] is True
    assert all(job["rewards_mux"] == job["rewards_dedicated"] for job in summary["jobs"])


@pytest.mark.slow
def test_jobs_really_shared_the_devices(demo):
    summary, out = demo
    assert summary["switches"] > 0, "the device budget is meant to force state swaps"
    with open(out / "events.jsonl") as f:  # read replicas ran some of the snapshots' calls
        ran = {e["model"] for e in map(json.loads, f) if e["event"] == "start" and e.get("device") is not None}
    assert any("#" in model for model in ran)
    total = sum(j["consumed_device_s"] for j in summary["jobs"]) / sum(j["reserved_device_s"] for j in summary["jobs"])
    assert summary["cost_reduction"] == pytest.approx(1 - total)


@pytest.mark.slow
def test_outputs_written(demo):
    _, out = demo
    for name in ("rewards.png", "timeline.png", "cost.png", "events.jsonl", "summary.json"):
        assert (out / name).stat().st_size > 0, name
