#!/usr/bin/env bash
# `make gpu-check`: every check that needs a GPU, in one command, under 8 minutes on one H200.
#   1) pytest -m cuda (tests/test_cuda.py: transparency on CUDA on the local and process engines,
#      page-locked host buffers registered and unregistered, event-timed device time, budgets
#      refused with clear errors) and tests/test_writeback.py on CUDA (write-back bytes per call);
#   2) plexrl bench switch --device cuda: a switch's load through the runtime against a
#      page-locked host-to-device copy_ of the same bytes in the same run (ratio >= 0.8 expected),
#      and an RL loop's write-back bytes and seconds per step against the whole state's.
# Figures go to $GPU_CHECK_OUT (default gpu-check/): figures.json, pytest logs, the bench's JSON.
# Without a usable GPU it fails at once: "no CUDA device: nothing to check".
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${GPU_CHECK_OUT:-gpu-check}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if ! timeout 60 "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    if command -v nvidia-smi >/dev/null 2>&1 && timeout 20 nvidia-smi -L >/dev/null 2>&1; then
        echo "gpu-check: nvidia-smi lists a GPU but $("$PY" -c 'import torch; print("torch", torch.__version__)') cannot" \
             "use it (a CPU build?); install a CUDA build of torch in $PY's environment" >&2
        exit 2
    fi
    echo "no CUDA device: nothing to check" >&2
    exit 1
fi

status=0
step() {  # step NAME SECONDS COMMAND...: run with a deadline, log, remember a failure
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc in $((SECONDS - t0)) s (log: $OUT/$name.log)"
    [ $rc -eq 0 ] || { status=1; tail -20 "$OUT/$name.log"; }
    echo "$rc" >"$OUT/$name.rc"
}

step pytest-cuda 240 "$PY" -m pytest -q -rs -m cuda tests/test_cuda.py
step pytest-writeback 120 "$PY" -m pytest -q -rs tests/test_writeback.py
step bench-switch 180 "$PY" -m plexrl.cli bench switch --device cuda --size-mb 1024 --repeats 8 --rl-steps 4 --json

"$PY" - "$OUT" <<'PY' || status=1
import json, pathlib, sys, torch
out = pathlib.Path(sys.argv[1])
figures = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "steps": {p.stem: int(p.read_text()) for p in out.glob("*.rc")}}
bench = [line for line in (out / "bench-switch.log").read_text().splitlines() if line.startswith("{")]
if bench:
    figures["bench_switch"] = json.loads(bench[-1])
    ratio = figures["bench_switch"].get("cuda_ratio", 0.0)
    figures["switch_at_least_0.8x_copy"] = ratio >= 0.8
(out / "figures.json").write_text(json.dumps(figures, indent=1, sort_keys=True))
print(json.dumps(figures, sort_keys=True))
sys.exit(0 if figures.get("switch_at_least_0.8x_copy") else 1)
PY
echo "gpu-check: $([ $status -eq 0 ] && echo passed || echo FAILED); figures in $OUT/figures.json"
exit $status
