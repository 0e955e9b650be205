"""The operator's figures of every report (issue 11): steps, job completion time, cluster
GPU-hours per completed step, capacity against colocated, slack honoured, and the placer's
predicted inflation next to the realised one. Checked against their definitions on the small
workload of test_sim_modes, whose jobs must share and queue."""

from __future__ import annotations

import pytest

from plexrl.sim.report import completion_times, summarize
from plexrl.sim.simulate import simulate
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
    runs = out["runs"]
    assert summarize(runs["plexrl"], runs["colocated"]) == out["results"]["plexrl"]


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
