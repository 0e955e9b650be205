#!/usr/bin/env bash
# `make gpu-check` on a GPU machine that has a CUDA torch but no package registry (the image's
# python3 holds torch, transformers, peft, numpy, pytest, hypothesis, rich, ...; it lacks pydantic,
# fastapi, uvicorn and the Tinker SDK, which the package and its test files import).
#   scripts/gpu_offline.sh fetch [DIR]   here, with a registry: download those wheels (CPython 3.12,
#                                        x86-64 Linux) into DIR (default .gpu-wheels, git-ignored)
#   scripts/gpu_offline.sh run [DIR]     there: install them into a folder of their own (the image's
#                                        python3 may be a venv, which a new venv would not see
#                                        through), put it and the checkout on PYTHONPATH, and run
#                                        the checks, all under make gpu-check's one deadline
#                                        (GPU_CHECK_DEADLINE_S, the install's time taken off it);
#                                        $GPU_CHECK_OUT (default gpu-check/) as make gpu-check writes it.
# Ray and vLLM stay out (the Ray wheel alone is ~65 MB); their tests skip and bench sample records
# vLLM as skipped. Versions are the ones the CPU suite runs with.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=(pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        typing_extensions==4.16.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 opentelemetry-api==1.45.2
        tinker==0.38.0 orjson==3.13.0 pyqwest==0.12.0 zstandard==0.25.0 distro==1.9.0 sniffio==1.3.1
        anyio==4.16.0 httpx==0.29.0 httpcore==1.0.9 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
        h11==0.16.0 idna==3.20 protobuf==7.36.2 click==8.5.1 annotated-doc==0.0.7 certifi==2026.10.19.post1)
cmd=${1:-}; dir=${2:-.gpu-wheels}
case "$cmd" in
  fetch)
    PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
    mkdir -p "$dir"
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        -d "$dir" "${WHEELS[@]}" || exit 1
    echo "$(ls "$dir"/*.whl | wc -l) wheels in $dir ($(du -sh "$dir" | cut -f1))"
    ;;
  run)
    extra=${TMPDIR:-/tmp}/plexrl-gpu-extra
    deadline=${GPU_CHECK_DEADLINE_S:-420}
    timeout 120 python3 -m pip install --quiet --no-index --no-deps --target "$extra" "$dir"/*.whl || exit 1
    export PYTHONPATH="$PWD:$extra${PYTHONPATH:+:$PYTHONPATH}"
    timeout 60 python3 -c "import plexrl, pydantic, fastapi, tinker, torch; print('python3:', torch.__version__, 'cuda', torch.cuda.is_available())"
    GPU_CHECK_DEADLINE_S=$((deadline - SECONDS)) PY=python3 exec bash scripts/gpu_check.sh
    ;;
  *)
    echo "usage: scripts/gpu_offline.sh fetch|run [WHEEL_DIR]" >&2
    exit 2
    ;;
esac
