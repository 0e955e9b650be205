"""The operator's figures of every report (issue 11): steps, job completion time, cluster
GPU-hours per completed step, capacity against colocated, slack honoured, and the placer's
predicted inflation next to the realised one. Checked against their definitions on the small
workload of test_sim_modes, whose jobs must share and queue."""

from __future__ import annotations

import pytest

from plexrl.sim.report import bounds, completion_times, gain_captured, summarize
from plexrl.sim.simulate import bound_figures, simulate
from tests.test_sim_modes import CLUSTER, workload


@pytest.fixture(scope="module")
def out():
    return simulate(workload(), CLUSTER, ("colocated", "plexrl"))


def test_completion_time_is_queueing_plus_run(out):
    for mode, run in out["runs"].items():
        for r, jct in zip(run.records, completion_times(run)):
            assert jct == pytest.approx(r.finished - r.arrival)
            assert jct == pytest.approx(r.queue_delay + (r.finished - r.started))
        mean = sum(completion_times(run)) / len(run.records)
        assert out["results"][mode]["jct_mean_s"] == pytest.approx(mean)


def test_cluster_cost_and_capacity_follow_their_definitions(out):
    base = out["results"]["colocated"]
    assert base["capacity_vs_colocated"] == 1.0
    for mode, run in out["runs"].items():
        s = out["results"][mode]
        steps = sum(r.steps for r in run.records)
        assert s["steps"] == steps
        assert s["cluster_gpu_hours_per_step"] == pytest.approx(CLUSTER.gpus * run.end_s / 3600 / steps)
        assert s["capacity_vs_colocated"] == pytest.approx(base["cluster_gpu_hours_per_step"] / s["cluster_gpu_hours_per_step"])


def test_slack_share_counts_jobs_within_their_slack(out):
    base = {r.name: r.mean_step_s for r in out["runs"]["colocated"].records}
    run = out["runs"]["plexrl"]
    ok = [r.mean_step_s / base[r.name] - 1 <= r.slack + 1e-9 for r in run.records]
    assert out["results"]["plexrl"]["within_slack"] == pytest.approx(sum(ok) / len(ok))


def test_plexrl_reports_predicted_and_realised_inflation_per_job(out):
    jobs = out["results"]["plexrl"]["jobs"]
    assert all(j["inflation_predicted"] is not None and j["inflation_realised"] is not None for j in jobs.values())
    for r in out["runs"]["plexrl"].records:
        # realised: the steps' time over their solo time; a step is never faster than alone
        assert r.realised_inflation == pytest.approx(sum(r.step_times) / r.solo_s - 1)
        assert r.realised_inflation >= -1e-9
    assert "inflation_mae" not in out["results"]["colocated"], "the baselines place nothing, predict nothing"


def test_summaries_are_a_pure_function_of_the_runs(out):
    """The mode's own figures, and the bounds of the whole run beside them (`bound_figures`)."""
    runs, results = out["runs"], out["results"]
    limits = bounds(runs["colocated"], list(runs.values()), workload().horizon_s)
    expected = summarize(runs["plexrl"], runs["colocated"])
    expected.update(bound_figures(limits, gain_captured(expected, results["colocated"], limits)))
    assert workload().horizon_s is None and expected == results["plexrl"]


def test_the_delay_injected_into_a_step_is_its_time_beyond_solo():
    """What the slack term of the priority reads: per step, each phase's end minus its start
    minus its slowest call; summed, exactly the steps' time over their solo time."""
    from plexrl.policy import Policy
    from plexrl.sim.plexrl_mode import PlexRLMode

    mode = PlexRLMode(workload(), CLUSTER, Policy.PLEXRL)
    delays: dict[str, float] = {}
    measure = mode.service.on_step

    def on_step(job):
        delays[job.name] = delays.get(job.name, 0.0) + job.clock.delay_s
        measure(job)

    mode.service.on_step = on_step
    result = mode.run()
    for r in result.records:
        assert delays[r.name] == pytest.approx(sum(r.step_times) - r.solo_s, abs=1e-6)
        assert delays[r.name] >= -1e-9


def test_stranded_gpus_count_the_cluster_left_unheld_while_jobs_wait():
    """16 GPUs. `a` holds 0-7 over [0, 10); `b` arrives at 2 and waits until 10, then holds 0-7;
    `c` shares 4-11 with it over [10, 20) (a GPU shared counts once); `d` arrives at 12 and never
    gets a place. Waiting: [2, 10) with 8 GPUs held (8 free) and [12, 30) with 12 held (4 free)."""
    from plexrl.sim.report import stranded_gpus
    from plexrl.sim.runner import SimJobRecord, ModeResult

    def record(name, arrival, placed, finished, devices):
        return SimJobRecord(name, len(devices), arrival, placed, finished, 1, [1.0], 0.0, 0.0, 0, 0,
                         placed=placed, devices=tuple(devices))

    result = ModeResult("m", 16, [record("a", 0.0, 0.0, 10.0, range(8)), record("b", 2.0, 10.0, 25.0, range(8)),
                                  record("c", 10.0, 10.0, 20.0, range(4, 12)), record("d", 12.0, None, None, ())],
                        30.0, 0, 0.0, 0.0, 0.0)
    stranded = 8 * 8 + 4 * (20 - 12) + 8 * (25 - 20) + 16 * (30 - 25)
    hours, share = stranded_gpus(result)
    assert hours == pytest.approx(stranded / 3600)
    assert share == pytest.approx(stranded / (16 * (8 + 18)))
    nobody_waits = ModeResult("m", 16, [record("a", 0.0, 0.0, 10.0, range(8))], 10.0, 0, 0.0, 0.0, 0.0)
    assert stranded_gpus(nobody_waits) == (0.0, None)


def test_stranded_gpus_of_a_run_match_a_sampled_count(out):
    """On the small workload (its jobs queue): the report's figure against counting held GPUs
    and waiting jobs at 2,000 instants; a placed PlexRL job holds its GPUs from its placement,
    so its phase shift is no wait."""
    import numpy as np

    for mode, run in out["runs"].items():
        times = (np.arange(2000) + 0.5) * run.end_s / 2000
        free, waiting = [], []
        for t in times:
            held = {d for r in run.records if r.placed is not None and r.placed <= t
                    < (r.finished if r.finished is not None else run.end_s) for d in r.devices}
            free.append(run.cluster_gpus - len(held))
            waiting.append(any(r.arrival <= t and (r.placed is None or t < r.placed) for r in run.records))
        free, waiting = np.array(free), np.array(waiting)
        assert waiting.any(), f"{mode}: the workload must queue"
        sampled = (free * waiting).sum() / (run.cluster_gpus * waiting.sum())
        assert out["results"][mode]["stranded_gpu_share"] == pytest.approx(sampled, abs=0.02)
        assert all(r.placed <= r.started for r in run.records if r.started is not None)
