"""RL jobs on the Ray engine: `plexrl run --engine ray` and `plexrl demo --engine ray`.

The same jobs give the same reward curves on Ray as on the local engine (every sample has an
explicit seed, and the runtime is transparent), and the demo's own comparison holds on Ray
(run without `--repeat`: one pair of runs; tests/test_demo.py runs it with `--repeat 2`).
One Ray instance for the module; the commands join it instead of starting their own.
"""

from __future__ import annotations

import json

import pytest

from plexrl.rl import demo, jobs_file

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

JOBS = {
    "cluster": {"devices": 2, "device_memory_mb": 64},
    "jobs": [
        {"name": "grpo-kl", "algorithm": "grpo", "task": "addition", "steps": 2, "kl_coef": 0.05,
         "problems_per_step": 4, "group_size": 4},
        {"name": "ppo-critic", "algorithm": "ppo", "task": "countdown", "steps": 2, "problems_per_step": 4,
         "group_size": 2},
    ],
}


def test_jobs_file_on_ray_equals_local(ray_node, tmp_path):
    spec = jobs_file.JobsFile.model_validate(JOBS)
    on_ray = jobs_file.run(spec, engine="ray")
    local = jobs_file.run(spec, engine="local")
    assert [j["rewards"] for j in on_ray["jobs"]] == [j["rewards"] for j in local["jobs"]]
    assert all(j["consumed_device_s"] > 0 for j in on_ray["jobs"])
    assert ray.is_initialized(), "a command must not shut down a Ray instance it joined"


def test_demo_on_ray(ray_node, tmp_path, capsys):
    assert demo.main(["--engine", "ray", "--steps", "2", "--json", "--out", str(tmp_path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["engine"] == "ray" and summary["identical_rewards"] is True
    assert [j["steps"] for j in summary["jobs"]] == [2, 2, 2]
    assert all(j["consumed_device_s"] > 0 and j["reserved_device_s"] > 0 for j in summary["jobs"])
    assert [run["makespan_mux_vs_exclusive"] for run in summary["repeats"]] == [summary["makespan_mux_vs_exclusive"]]
    assert summary["makespan_mux_vs_exclusive_median"] == summary["makespan_mux_vs_exclusive"]  # no --repeat: one pair
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["t"] for e in events] == sorted(e["t"] for e in events), "one time axis across node actors"
    assert {e["device"] for e in events if e["event"] == "start" and e.get("device") is not None} == {0, 1}
    assert (tmp_path / "timeline.png").stat().st_size > 0
