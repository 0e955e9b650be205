"""The figures of `make gpu-check` (scripts/gpu_check.sh), written to OUT/figures.json from the
check's step folder, after every step and once more when the check ends or is stopped: a check
cut off at any point leaves what it measured so far.

    python scripts/gpu_figures.py STEP_FOLDER OUT

The step folder holds, per step NAME: NAME.cmd (its command), NAME.limit (its seconds), NAME.started,
then NAME.log, NAME.s and NAME.rc when it ended, or NAME.skipped (why it was not run); and
preflight.txt, the checks made before any step. The environment gives GPU_CHECK_STEPS (the steps
planned), GPU_CHECK_DEVICE, GPU_CHECK_DEVICE_NAME, GPU_CHECK_DEADLINE_S, GPU_CHECK_STOPPED (why
the check stopped early) and VLLM_SKIPPED (why vLLM was not measured).

Every figure is a ratio to a reference measured in the same run with the same clock, the two
measurements beside it (`references`), and its bound where it has one. A vLLM figure is "skipped"
whenever vLLM was (never "fail" because its step failed or was cut off); any other figure not
measured fails. Exits 1 when a figure or a step failed, else 0. Standard library only: it runs
where the package itself cannot be imported.
"""

from __future__ import annotations

import json
import operator
import os
import pathlib
import sys

# name, step, key in the step's JSON, comparison, target, the keys measured beside it
FIGURES = [
    # the load's own time (CUDA events) against a page-locked copy of the same bytes timed by events
    ("switch_load_vs_copy", "bench-switch", "ratio", ">=", 0.8, ("load_s", "copy_event_s", "bytes_per_switch")),
    # a whole switching call as a job sees it (host clock) against the same copy by the host clock
    ("switch_wall_vs_copy", "bench-switch", "wall_ratio", ">=", 0.5,
     ("switch_wall_s", "copy_wall_s", "noop_wall_s", "bytes_per_switch")),
    # the hidden fraction of the loads against its bound, min(1, call time / load time)
    ("prefetch_hidden_of_bound", "bench-prefetch", "hidden_of_bound", ">=", 0.5,
     ("hidden_fraction", "hidden_fraction_bound", "exec_s_per_call", "load_s_per_load")),
    # vLLM's decode against the HF loop's, same model, same batch, same run
    ("vllm_vs_hf_decode", "bench-sample", "vllm_vs_hf", ">=", 5.0, ("vllm_tokens_per_s", "hf_tokens_per_s")),
    # a vLLM state's switch-in against its bytes over the page-locked copy speed (it moves them twice)
    ("vllm_switch_in_vs_copy", "bench-sample", "vllm_switch_in_vs_copy", "<=", 4.0,
     ("vllm_switch_in_s", "vllm_push_copy_s", "vllm_push_bytes")),
    # batched decode (captured CUDA graph steps) at a batch of 64 against the memory-bound limit of the same run
    ("batched_decode_of_bound", "bench-sample", "batched_of_bound", ">=", 0.4,
     ("batched_tokens_per_s", "bound_tokens_per_s")),
]
VLLM_FIGURES = {"vllm_vs_hf_decode", "vllm_switch_in_vs_copy"}
COMPARE = {">=": operator.ge, "<=": operator.le}
CUT_OFF_RCS = {124, 137}  # timeout's: the step ran past its limit


def read(path: pathlib.Path, default=None):
    return path.read_text().strip() if path.is_file() else default


def last_json(log: str | None) -> dict | None:
    """The last line of a step's log that is a JSON object (a bench's --json result)."""
    for line in reversed((log or "").splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def step_record(steps: pathlib.Path, name: str, stopped: str | None) -> dict:
    record = {"command": read(steps / f"{name}.cmd"), "log": f"{name}.log (in logs.tar.gz)"}
    rc, limit, seconds = read(steps / f"{name}.rc"), read(steps / f"{name}.limit"), read(steps / f"{name}.s")
    if limit is not None:
        record["limit_s"] = int(limit)
    if seconds is not None:
        record["seconds"] = int(seconds)
    if rc is not None:
        record["rc"] = int(rc)
        record["status"] = ("passed" if rc == "0" else
                            f"cut off by its {limit} s limit" if int(rc) in CUT_OFF_RCS else "failed")
    elif (steps / f"{name}.started").is_file():
        record["status"] = f"cut off: {stopped}" if stopped else "running"
    elif (steps / f"{name}.skipped").is_file():
        record["status"] = read(steps / f"{name}.skipped")
    else:
        record["status"] = f"not run: {stopped}" if stopped else "not run yet"
    return record


def figure(name: str, step: str, key: str, op: str, target: float, references: tuple, bench: dict | None,
           record: dict, prefix: str, vllm_skipped: str | None) -> dict:
    entry = {"step": step, "key": prefix + key, "target": f"{op} {target}"}
    if name in VLLM_FIGURES and vllm_skipped:
        return {**entry, "status": "skipped", "reason": vllm_skipped}
    if bench is None:
        return {**entry, "status": "fail", "reason": f"{step} wrote no figures ({record['status']})"}
    if prefix + key in bench:
        value = bench[prefix + key]
        found = {k: bench[prefix + k] for k in references if prefix + k in bench}
        return {**entry, "value": value, "references": found,
                "status": "pass" if COMPARE[op](value, target) else "fail"}
    if name in VLLM_FIGURES and "vllm_skipped" in bench:
        return {**entry, "status": "skipped", "reason": bench["vllm_skipped"]}
    return {**entry, "status": "fail", "reason": f"{step}'s JSON has no {prefix + key!r}"}


def summarise(steps: pathlib.Path, env) -> dict:
    planned = env.get("GPU_CHECK_STEPS", "").split()
    stopped = env.get("GPU_CHECK_STOPPED") or None
    device = env.get("GPU_CHECK_DEVICE", "cuda")
    records = {name: step_record(steps, name, stopped) for name in planned}
    benches = {name: last_json(read(steps / f"{name}.log")) for name in planned if name.startswith("bench-")}
    figures = {}
    for name, step, key, op, target, references in FIGURES:
        if step in planned:
            prefix = "cuda_" if step == "bench-switch" and device == "cuda" else ""  # bench switch's CUDA keys
            figures[name] = figure(name, step, key, op, target, references, benches.get(step), records[step], prefix,
                                   env.get("VLLM_SKIPPED") or None)
    failed_steps = sorted(n for n, r in records.items() if r["status"] != "passed")
    return {"device": device, "device_name": env.get("GPU_CHECK_DEVICE_NAME"),
            "deadline_s": int(env.get("GPU_CHECK_DEADLINE_S", "0")), "stopped": stopped,
            "preflight": (read(steps / "preflight.txt") or "").splitlines(),
            "steps": records, "benches": benches, "figures": figures,
            "failed_figures": sorted(n for n, f in figures.items() if f["status"] == "fail"),
            "failed_steps": failed_steps}


def main(argv: list[str]) -> int:
    steps, out = pathlib.Path(argv[1]), pathlib.Path(argv[2])
    summary = summarise(steps, os.environ)
    partial = out / "figures.json.partial"  # then renamed: a check killed while writing keeps the last whole one
    partial.write_text(json.dumps(summary, indent=1, sort_keys=True))
    partial.replace(out / "figures.json")
    for name, f in summary["figures"].items():
        shown = f"{f['value']:.4g}" if "value" in f else f.get("reason", "")
        print(f"{name}: {f['status']} ({f['key']} {f['target']}): {shown}")
    return 1 if summary["failed_figures"] or summary["failed_steps"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
