"""`make gpu-check` itself (scripts/gpu_check.sh, scripts/gpu_figures.py), on the CPU: the check
brings its figures back however it ends, and no figure passes or fails for a reason it does not
measure.

Invariants checked:
- a check stopped midway (SIGTERM while a step runs) leaves figures.json with every step that
  ended, its figures measured and compared with their references, the running step cut off
  (its processes gone) and the logs of both in one tarball: OUT holds those two files only;
- the deadline caps each step: a step that would run past it is cut off at its limit, and the
  check ends by itself with the figures so far;
- /dev/shm too small for the check refuses it at once, saying what to change;
- the cuda tests are named by file: the script's list is exactly the test files marked cuda;
- vLLM's figures are skipped, not failed, when vLLM was skipped, whatever became of bench sample;
  a vLLM push is judged against its bytes over the copy speed measured in the same run;
- the host allocator's statistic test_cuda reads is one torch reports.

The runs use GPU_CHECK_DEVICE=cpu (the script's CPU mode, reported as device "cpu") and the
real benches at a small size: no figure is made up.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tarfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
ROUNDS = "99991"  # bench prefetch's rounds: far more than a test waits for, and a mark to find its process by
BOUND_S = 300  # the most a test waits for the check (never reached when it works)


def check(out: pathlib.Path, **env) -> subprocess.Popen:
    """The check on the CPU, writing to `out`."""
    variables = {**os.environ, "PY": sys.executable, "PYTHONPATH": str(ROOT), "GPU_CHECK_OUT": str(out),
                 "GPU_CHECK_DEVICE": "cpu", "GPU_CHECK_SIZE_MB": "2", "GPU_CHECK_ROUNDS": ROUNDS,
                 "GPU_CHECK_SHM_MB": "1", **env}
    return subprocess.Popen(["bash", str(SCRIPT)], env=variables, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def figures(out: pathlib.Path) -> dict | None:
    try:
        return json.loads((out / "figures.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def bench_processes() -> list[int]:
    """Processes still running a bench of these tests (found by their unusual --rounds)."""
    found = []
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if ROUNDS.encode() in args and b"prefetch" in args:
            found.append(int(cmdline.parent.name))
    return found


def logs(out: pathlib.Path) -> set[str]:
    with tarfile.open(out / "logs.tar.gz") as tar:
        return {pathlib.Path(name).name for name in tar.getnames()}


def test_a_check_stopped_midway_leaves_the_figures_so_far(tmp_path):
    proc = check(tmp_path, GPU_CHECK_STEPS="bench-switch bench-prefetch")
    try:
        for _ in range(BOUND_S * 2):  # until bench switch has ended and bench prefetch runs
            seen = figures(tmp_path)
            if seen and seen["steps"]["bench-prefetch"]["status"] == "running" or proc.poll() is not None:
                break
            time.sleep(0.5)
        assert proc.poll() is None, f"the check ended before it was stopped:\n{proc.stdout.read()}"
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=BOUND_S)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert "stopped by SIGTERM" in output, output
    found = figures(tmp_path)
    assert found["stopped"].startswith("stopped by SIGTERM") and found["device"] == "cpu"
    assert found["steps"]["bench-switch"]["status"] == "passed"
    assert found["steps"]["bench-prefetch"]["status"].startswith("cut off: stopped by SIGTERM")
    for name in ("switch_load_vs_copy", "switch_wall_vs_copy"):  # measured, with their references
        figure = found["figures"][name]
        assert figure["status"] in ("pass", "fail") and figure["value"] > 0, figure
        assert all(value > 0 for value in figure["references"].values()) and len(figure["references"]) >= 3, figure
    switch = found["benches"]["bench-switch"]
    assert found["figures"]["switch_wall_vs_copy"]["value"] == switch["copy_wall_s"] / switch["switch_wall_s"]
    prefetch = found["figures"]["prefetch_hidden_of_bound"]
    assert prefetch["status"] == "fail" and "cut off" in prefetch["reason"], prefetch
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figures.json", "logs.tar.gz"]
    assert {"bench-switch.log", "bench-switch.cmd", "bench-prefetch.log", "bench-prefetch.cmd"} <= logs(tmp_path)
    assert bench_processes() == [], "the cut-off step's bench is still running"


def test_the_deadline_caps_each_step_and_the_check_ends_with_its_figures(tmp_path):
    # 30 s less the 20 s kept back for the end: bench prefetch (endless rounds) gets at most 10 s of its 50
    proc = check(tmp_path, GPU_CHECK_STEPS="bench-prefetch", GPU_CHECK_DEADLINE_S="30")
    try:
        output, _ = proc.communicate(timeout=BOUND_S)
    finally:
        proc.kill()
    assert proc.returncode != 0, output
    step = figures(tmp_path)["steps"]["bench-prefetch"]
    assert step["limit_s"] <= 10 and step["rc"] == 124 and step["status"] == f"cut off by its {step['limit_s']} s limit"
    assert figures(tmp_path)["stopped"] is None and "bench-prefetch.log" in logs(tmp_path)
    assert bench_processes() == []


def test_a_small_dev_shm_refuses_the_check_with_what_to_change(tmp_path):
    proc = check(tmp_path, GPU_CHECK_STEPS="bench-switch", GPU_CHECK_SHM_MB=str(1 << 40))
    output, _ = proc.communicate(timeout=BOUND_S)
    assert proc.returncode == 1
    assert "/dev/shm has" in output and "SIGBUS" in output and "--shm-size" in output, output
    found = figures(tmp_path)
    assert found["steps"]["bench-switch"]["status"].startswith("not run: refused before any step: /dev/shm has")
    assert found["benches"]["bench-switch"] is None


def test_the_cuda_tests_are_named_by_file_and_are_every_file_marked_cuda():
    """`pytest -m cuda tests` imports every test module: on a GPU image without the server's or
    the Tinker SDK's packages, those fail at import and no cuda test runs."""
    line = next(line for line in SCRIPT.read_text().splitlines() if line.startswith("CUDA_TESTS=("))
    named = set(line[len("CUDA_TESTS=("):-1].split())
    marked = {f"tests/{path.name}" for path in (ROOT / "tests").glob("test_*.py")
              if re.search(r"pytest\.mark\.cuda[,\])\s]", path.read_text())}
    assert named == marked
    pytest_cuda = next(line for line in SCRIPT.read_text().splitlines() if "pytest-cuda) step" in line)
    assert '"${CUDA_TESTS[@]}"' in pytest_cuda and " tests " not in pytest_cuda + " "


def summarise(tmp_path, logs_by_step: dict, rcs: dict, **env) -> dict:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_figures
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    for name, log in logs_by_step.items():
        (tmp_path / f"{name}.log").write_text(log)
        (tmp_path / f"{name}.started").touch()
    for name, rc in rcs.items():
        (tmp_path / f"{name}.rc").write_text(str(rc))
        (tmp_path / f"{name}.limit").write_text("150")
    return gpu_figures.summarise(tmp_path, {"GPU_CHECK_STEPS": " ".join(logs_by_step), **env})


@pytest.mark.parametrize("log, rc", [("", 124), ("Traceback ...\nRuntimeError: no room", 1)],
                         ids=["bench sample cut off", "bench sample failed"])
def test_vllm_figures_are_skipped_when_vllm_was_skipped(tmp_path, log, rc):
    found = summarise(tmp_path, {"bench-sample": log}, {"bench-sample": rc},
                      VLLM_SKIPPED="PLEXRL_VLLM_PYTHON is unset")
    for name in ("vllm_vs_hf_decode", "vllm_switch_in_vs_copy"):
        assert found["figures"][name] == {"step": "bench-sample", "key": name.replace("_decode", ""),
                                          "target": found["figures"][name]["target"], "status": "skipped",
                                          "reason": "PLEXRL_VLLM_PYTHON is unset"}
    # the step's own figure (batched decode) fails with it: it wrote none; only vLLM's were skipped
    assert found["failed_figures"] == ["batched_decode_of_bound"] and found["failed_steps"] == ["bench-sample"]
    assert "wrote no figures" in found["figures"]["batched_decode_of_bound"]["reason"]


def test_the_vllm_push_is_judged_against_its_bytes_over_the_copy_speed(tmp_path):
    measured = {"vllm_vs_hf": 6.0, "vllm_tokens_per_s": 600.0, "hf_tokens_per_s": 100.0, "vllm_push_bytes": 2 << 30,
                "vllm_switch_in_s": 0.9, "vllm_push_copy_s": 0.1, "vllm_switch_in_vs_copy": 9.0}
    found = summarise(tmp_path, {"bench-sample": json.dumps(measured)}, {"bench-sample": 0})
    push = found["figures"]["vllm_switch_in_vs_copy"]
    # under a second, which the old absolute target passed, yet 9 copies' time: a slow push
    assert push["status"] == "fail" and push["value"] == 9.0 and push["target"] == "<= 4.0"
    assert push["references"] == {"vllm_switch_in_s": 0.9, "vllm_push_copy_s": 0.1, "vllm_push_bytes": 2 << 30}
    assert found["figures"]["vllm_vs_hf_decode"]["status"] == "pass"


def test_the_pinned_bytes_test_cuda_reads_are_a_key_torch_reports():
    """test_cuda compared host_memory_stats().get("allocated_bytes.all.current", 0), a key the host
    allocator has not: 0 == 0 whatever it held. The key read now is one torch documents."""
    import torch

    from tests.test_cuda import PINNED_BYTES_KEY

    stat, kind = PINNED_BYTES_KEY.split(".")
    assert f'"{stat}.{{current,' in torch.cuda.host_memory_stats.__doc__ and kind == "current"
