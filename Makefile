# Set-up on a fresh machine: `make demo` and `make test` (both create .venv and install first).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export RAY_USAGE_STATS_ENABLED := 0
export RAY_AUTH_MODE := disabled
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test bench clean

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
	touch $(STAMP)

demo: install
	$(BIN)/plexrl demo

# pytest exits 5 when it collected nothing: that is a failure, not a pass.
test: install
	$(BIN)/python -m pytest -q; status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest ran no tests" >&2; exit 1; fi; exit $$status

bench: install
	$(BIN)/plexrl bench switch
	$(BIN)/plexrl bench dispatch
	$(BIN)/plexrl bench placement

clean:
	rm -rf $(VENV) plexrl-demo .pytest_cache
