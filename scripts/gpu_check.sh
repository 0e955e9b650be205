#!/usr/bin/env bash
# `make gpu-check`: every check that needs a GPU, in one command, under one deadline
# (GPU_CHECK_DEADLINE_S, default 420 s; each step's limit is its own cap or the time left, the
# smaller). First /dev/shm and the GPU's free memory, each with a message saying what is short; then:
#   pytest-cuda       pytest -m cuda on the files that hold cuda tests (CUDA_TESTS below: named, so
#                     collecting them needs only what they import): transparency on CUDA on the
#                     local and process engines, page-locked host buffers, event-timed device time,
#                     budgets refused with clear errors, the precisions, the activation reserve
#                     beside an arena at the net budget, a snapshot's read replicas;
#   pytest-writeback  tests/test_writeback.py on CUDA (write-back bytes per call);
#   bench-switch      a switch's load (events) and a whole switching call (wall) against a
#                     page-locked copy of the same bytes timed each way;
#   bench-prefetch    the part of the loads hidden behind the running function, against its bound;
#   bench-sample      vLLM's decode against the HF loop at a batch of 64 on a ~1B model, and a vLLM
#                     state's switch-in against its bytes over the measured copy speed; vLLM only
#                     when PLEXRL_VLLM_PYTHON names an environment with vLLM and a CUDA torch; and
#                     batched sampling (captured CUDA graph steps) at a batch of 64 against the
#                     memory-bound limit measured in the same run (the sweep 1..256 in its log).
# Output: $GPU_CHECK_OUT (default gpu-check/) holds two files, figures.json (every step's status
# and every figure with the references measured beside it, its target and pass/fail/skipped:
# scripts/gpu_figures.py) and logs.tar.gz (each step's command and log). Both are rewritten when a
# step starts and ends and when the check exits or is stopped (TERM, INT, HUP): a check cut off at
# any point brings back what it measured. Exits non-zero when a step fails or a figure misses its
# target; a skipped figure fails nothing.
# To test this script itself on a CPU (tests/test_gpu_check.py): GPU_CHECK_DEVICE=cpu, a shorter
# GPU_CHECK_STEPS and smaller GPU_CHECK_SIZE_MB; figures.json then says device "cpu".
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${GPU_CHECK_OUT:-gpu-check}
export GPU_CHECK_DEADLINE_S=${GPU_CHECK_DEADLINE_S:-420}
export GPU_CHECK_DEVICE=${GPU_CHECK_DEVICE:-cuda}
export GPU_CHECK_STEPS=${GPU_CHECK_STEPS:-pytest-cuda pytest-writeback bench-switch bench-prefetch bench-sample}
SIZE_MB=${GPU_CHECK_SIZE_MB:-512}           # a bench's state
ROUNDS=${GPU_CHECK_ROUNDS:-6}               # bench prefetch's
MODEL_SIZE=${GPU_CHECK_MODEL_SIZE:-1b}      # bench sample's
SHM_MB=${GPU_CHECK_SHM_MB:-8192}            # host buffers the benches map at once (bench sample's 1B model: ~6 GiB)
GPU_MB=${GPU_CHECK_GPU_MB:-24576}           # device memory the steps use at most (bench sample's budget and vLLM's)
CUDA_TESTS=(tests/test_cuda.py tests/test_device_budget.py tests/test_read_replicas.py tests/test_slot_decode.py)
FINISH_S=20  # kept back from the deadline: a step's kill grace (10 s), the figures and the tarball
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false GPU_CHECK_STOPPED="" GPU_CHECK_DEVICE_NAME="" VLLM_SKIPPED=""
mkdir -p "$OUT" && rm -f "$OUT/figures.json" "$OUT/logs.tar.gz" || exit 2
STEPS_DIR=$(mktemp -d "${TMPDIR:-/tmp}/plexrl-gpu-check.XXXXXX") || exit 2
START=$SECONDS
RUNNING=""  # the running step's timeout process (the leader of its process group)
status=0

figures() {  # OUT/figures.json and OUT/logs.tar.gz from what the steps left so far; its status
    "$PY" scripts/gpu_figures.py "$STEPS_DIR" "$OUT" >"$STEPS_DIR/figures.txt" 2>&1
    local rc=$?
    tar -czf "$OUT/logs.tar.gz.partial" -C "$STEPS_DIR" . 2>/dev/null && mv -f "$OUT/logs.tar.gz.partial" "$OUT/logs.tar.gz"
    return $rc
}

stop() {  # a signal: the running step is cut off (its processes too), the figures so far written
    trap - TERM INT HUP
    export GPU_CHECK_STOPPED="stopped by SIG$1 after $((SECONDS - START)) s"
    local pids
    pids=$(jobs -p)  # the running step's timeout, even when the signal came before RUNNING was set
    pids="$pids $RUNNING"
    for pid in $pids; do kill -TERM "$pid" 2>/dev/null; done
    for pid in $pids; do
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL -- "-$pid" 2>/dev/null  # what is left of its process group
    done
    figures
    echo "gpu-check: $GPU_CHECK_STOPPED; the figures so far in $OUT/figures.json" >&2
    exit 1
}
trap 'stop TERM' TERM
trap 'stop INT' INT
trap 'stop HUP' HUP
trap 'figures >/dev/null' EXIT  # whatever ends the script (set -u, a failed check): the figures so far

refuse() {  # a check made before any step failed: say so, in figures.json too, and stop
    echo "gpu-check: $*" >&2
    echo "refused: $*" >>"$STEPS_DIR/preflight.txt"
    export GPU_CHECK_STOPPED="refused before any step: $*"
    exit 1
}

KNOWN_STEPS=" pytest-cuda pytest-writeback bench-switch bench-prefetch bench-sample "
for name in $GPU_CHECK_STEPS; do
    [[ "$KNOWN_STEPS" == *" $name "* ]] || refuse "unknown step $name in GPU_CHECK_STEPS; expected some of$KNOWN_STEPS"
done

# 1) /dev/shm: the runtime's host buffers are files there; a full one kills a process with SIGBUS,
# no Python error
shm_free_mb=$(df -Pm /dev/shm 2>/dev/null | awk 'NR == 2 {print $4}')
if [ -z "$shm_free_mb" ]; then
    refuse "/dev/shm is not mounted: the runtime keeps its host buffers there (runtime/host_buffers.py)"
elif [ "$shm_free_mb" -lt "$SHM_MB" ]; then
    refuse "/dev/shm has $shm_free_mb MiB free and the check maps up to $SHM_MB MiB of host buffers there; a full" \
           "/dev/shm kills the process with SIGBUS and no Python error. Give the machine more (docker run" \
           "--shm-size=16g) or check smaller states (GPU_CHECK_SIZE_MB, GPU_CHECK_SHM_MB)"
fi
echo "/dev/shm: $shm_free_mb MiB free (needs $SHM_MB)" >>"$STEPS_DIR/preflight.txt"

# 2) the GPU: a CUDA torch that sees one, with the memory the steps use free
if [ "$GPU_CHECK_DEVICE" = cuda ]; then
    probe=$(timeout 60 "$PY" -c "import torch
if not torch.cuda.is_available(): raise SystemExit(3)
free, total = torch.cuda.mem_get_info()
print(torch.cuda.get_device_name(0), '|', free >> 20, '|', total >> 20, sep='')" 2>&1)
    rc=$?
    if [ $rc -ne 0 ]; then
        if command -v nvidia-smi >/dev/null 2>&1 && timeout 20 nvidia-smi -L >/dev/null 2>&1; then
            refuse "nvidia-smi lists a GPU but $PY's torch cannot use it (a CPU build?): install a CUDA build of torch" \
                   "in its environment. $(echo "$probe" | tail -1)"
        fi
        refuse "no CUDA device: nothing to check"
    fi
    IFS='|' read -r GPU_CHECK_DEVICE_NAME gpu_free_mb gpu_total_mb <<<"$probe"
    export GPU_CHECK_DEVICE_NAME
    if [ "$gpu_free_mb" -lt "$GPU_MB" ]; then
        refuse "$GPU_CHECK_DEVICE_NAME has $gpu_free_mb MiB free of $gpu_total_mb and the steps use up to $GPU_MB MiB;" \
               "another process holds the rest (nvidia-smi names it)"
    fi
    echo "GPU: $GPU_CHECK_DEVICE_NAME, $gpu_free_mb MiB free of $gpu_total_mb (needs $GPU_MB)" >>"$STEPS_DIR/preflight.txt"
else
    echo "GPU_CHECK_DEVICE=$GPU_CHECK_DEVICE: a test of this script, not of a GPU" >>"$STEPS_DIR/preflight.txt"
fi

# 3) vLLM on CUDA needs its own environment (make test-vllm builds a CPU one, which cannot serve here)
SAMPLERS=hf,vllm
if [[ " $GPU_CHECK_STEPS " == *" bench-sample "* ]]; then
    if [ -z "${PLEXRL_VLLM_PYTHON:-}" ]; then
        VLLM_SKIPPED="PLEXRL_VLLM_PYTHON is unset: no CUDA vLLM environment configured"
    elif ! timeout 20 "$PLEXRL_VLLM_PYTHON" -c "import importlib.util as u, sys, torch
sys.exit(0 if u.find_spec('vllm') and torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
        VLLM_SKIPPED="PLEXRL_VLLM_PYTHON=$PLEXRL_VLLM_PYTHON has no vllm package or no CUDA torch (a CPU build?), or did not answer within 20 s"
    fi
    [ -z "$VLLM_SKIPPED" ] || { SAMPLERS=hf; echo "bench-sample: vLLM skipped: $VLLM_SKIPPED"; }
fi
export VLLM_SKIPPED
figures

step() {  # step NAME CAP COMMAND...: run under min(CAP, the time left), then the figures so far
    local name=$1 cap=$2; shift 2
    local left=$((GPU_CHECK_DEADLINE_S - (SECONDS - START) - FINISH_S))
    echo "$*" >"$STEPS_DIR/$name.cmd"
    if [ "$left" -lt 10 ]; then
        echo "not run: $((SECONDS - START)) s of the ${GPU_CHECK_DEADLINE_S} s deadline gone" >"$STEPS_DIR/$name.skipped"
        echo "$name: not run (deadline)"
        status=1
        figures
        return
    fi
    local limit=$((cap < left ? cap : left)) t0=$SECONDS
    echo "$limit" >"$STEPS_DIR/$name.limit"
    : >"$STEPS_DIR/$name.log"  # before the figures say "running": a stop in between still leaves the step's log
    touch "$STEPS_DIR/$name.started"
    figures
    timeout --kill-after=10 "$limit" "$@" >"$STEPS_DIR/$name.log" 2>&1 &
    RUNNING=$!
    wait "$RUNNING"
    local rc=$?
    RUNNING=""
    echo $((SECONDS - t0)) >"$STEPS_DIR/$name.s"
    echo "$rc" >"$STEPS_DIR/$name.rc"
    echo "$name: rc=$rc in $((SECONDS - t0)) s (limit $limit s)"
    [ $rc -eq 0 ] || { status=1; tail -20 "$STEPS_DIR/$name.log"; }
    figures
}

for name in $GPU_CHECK_STEPS; do
    case $name in
        pytest-cuda) step "$name" 120 "$PY" -m pytest -q -rs -m cuda "${CUDA_TESTS[@]}" ;;
        pytest-writeback) step "$name" 40 "$PY" -m pytest -q -rs tests/test_writeback.py ;;
        bench-switch) step "$name" 60 "$PY" -m plexrl.cli bench switch --device "$GPU_CHECK_DEVICE" \
            --size-mb "$SIZE_MB" --repeats 6 --rl-steps 2 --json ;;
        bench-prefetch) step "$name" 50 "$PY" -m plexrl.cli bench prefetch --device "$GPU_CHECK_DEVICE" \
            --size-mb "$SIZE_MB" --rounds "$ROUNDS" --json ;;
        bench-sample) step "$name" 300 "$PY" -m plexrl.cli bench sample --device "$GPU_CHECK_DEVICE" \
            --model-size "$MODEL_SIZE" --samplers "$SAMPLERS" --repeats 2 --switches 6 --rollout none --json ;;
    esac
done

figures || status=1
cat "$STEPS_DIR/figures.txt"
echo "gpu-check: $([ $status -eq 0 ] && echo passed || echo FAILED) in $((SECONDS - START)) s;" \
     "figures in $OUT/figures.json, logs in $OUT/logs.tar.gz"
exit $status
