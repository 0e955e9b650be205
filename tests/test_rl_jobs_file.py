"""`plexrl run`: bad files are reported field by field, with the value and the expectation."""

from __future__ import annotations

import pytest

from plexrl.rl import jobs_file

GOOD_JOB = "{name: a, algorithm: grpo, task: addition, steps: 2}"


@pytest.mark.parametrize("text, expected", [
    (f"jobs: [{GOOD_JOB}]", None),
    ("jobs: []", "jobs = []: expected a list with at least 1 item"),
    ("jobs: [{name: a, algorithm: grpo, task: addition, steps: 0}]", "jobs[0].steps = 0: expected greater than or equal to 1"),
    ("jobs: [{name: a, algorithm: sgd, task: addition, steps: 2}]", "jobs[0].algorithm = 'sgd': expected 'grpo', 'ppo'"),
    ("jobs: [{name: a, algorithm: grpo, task: chess, steps: 2}]", "jobs[0].task = 'chess': expected 'addition'"),
    ("jobs: [{name: a, algorithm: grpo, task: addition, steps: 2, lr: 1}]", "jobs[0].lr = 1: expected no such field"),
    ("jobs: [{algorithm: grpo, task: addition, steps: 2}]", "jobs[0].name: missing; expected a value"),
    ("jobs: [{name: a, algorithm: grpo, task: addition, steps: 2, group_size: 1}]", "group_size=1 for grpo (expected >= 2"),
    ("jobs: [{name: a, algorithm: grpo, task: addition, steps: 2, model: {hidden_size: 30}}]",
     "hidden_size=30 is not a multiple of num_heads=4"),
    (f"jobs: [{GOOD_JOB}, {GOOD_JOB}]", "job names ['a'] appear more than once"),
    (f"cluster: {{policy: fastest}}\njobs: [{GOOD_JOB}]", "unknown scheduling policy 'fastest'"),
    (f"cluster: {{devices: 0}}\njobs: [{GOOD_JOB}]", "cluster.devices = 0: expected greater than or equal to 1"),
    ("- just a list", "got a list at the top level"),
    ("jobs: [unclosed", "not valid YAML"),
], ids=["valid", "no-jobs", "zero-steps", "bad-algorithm", "bad-task", "unknown-field", "missing-name",
        "group-of-one", "heads-divide-hidden", "duplicate-names", "bad-policy", "zero-devices", "not-a-mapping", "yaml-syntax"])
def test_jobs_file_validation(tmp_path, text, expected):
    path = tmp_path / "jobs.yaml"
    path.write_text(text)
    if expected is None:
        assert jobs_file.load(path).jobs[0].name == "a"
        return
    with pytest.raises(jobs_file.JobsFileError) as raised:
        jobs_file.load(path)
    assert expected in str(raised.value)


def test_main_prints_problems_without_traceback(tmp_path, capsys):
    path = tmp_path / "jobs.yaml"
    path.write_text("jobs: [{name: a, algorithm: grpo, task: addition, steps: -1}]")
    assert jobs_file.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert "jobs[0].steps = -1" in err and "Traceback" not in err


def test_missing_file_is_named(capsys):
    assert jobs_file.main(["/nonexistent/jobs.yaml"]) == 2
    assert "/nonexistent/jobs.yaml: no such file" in capsys.readouterr().err


@pytest.mark.parametrize("example", ["examples/three_jobs.yaml", "examples/all_algorithms.yaml"])
def test_examples_are_valid(example):
    assert jobs_file.load(example).jobs
