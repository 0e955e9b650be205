"""`plexrl demo --quick --json`: one run, the JSON the issue asks for, and the files it writes.

The warm-started models come from the user's cache (built on the first run, like `make demo`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-m", "plexrl.cli", "demo", "--quick", "--json", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout), out  # stdout must be exactly one JSON object


def test_json_has_the_final_table(demo):
    summary, _ = demo
    for key in ("jobs", "cost_reduction", "identical_rewards", "makespan_mux_s", "makespan_sequential_s", "switches"):
        assert key in summary
    assert len(summary["jobs"]) == 3 and summary["engine"] == "process"  # the default
    for job in summary["jobs"]:
        for key in ("name", "algorithm", "steps", "reward_first", "reward_last", "consumed_device_s", "reserved_device_s"):
            assert key in job
        assert len(job["rewards_mux"]) == job["steps"]
        assert job["consumed_device_s"] > 0 and job["reserved_device_s"] > 0


def test_multiplexed_rewards_equal_dedicated(demo):
    summary, _ = demo
    assert summary["identical_rewards"] is True
    assert all(job["rewards_mux"] == job["rewards_dedicated"] for job in summary["jobs"])


def test_jobs_really_shared_the_devices(demo):
    summary, _ = demo
    assert summary["switches"] > 0, "the device budget is meant to force state swaps"
    total = sum(j["consumed_device_s"] for j in summary["jobs"]) / sum(j["reserved_device_s"] for j in summary["jobs"])
    assert summary["cost_reduction"] == pytest.approx(1 - total)


def test_outputs_written(demo):
    _, out = demo
    for name in ("rewards.png", "timeline.png", "cost.png", "events.jsonl", "summary.json"):
        assert (out / name).stat().st_size > 0, name
