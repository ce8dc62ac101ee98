# Two entry points a fresh machine needs: `make serve` (the main job) and `make test`.
# Both create the virtual environment on first use and install jaxserve into it: `serve` the
# runtime only (no torch, pytest or Jupyter), `test` and `lint` the test extras. Flags go in ARGS:
#   make serve ARGS="--port 9000"
#   make serve ARGS="Qwen/Qwen3-0.6B --max-model-len 4096"
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# One stamp per set of extras, so that `make serve` after `make test` installs nothing new.
EXTRAS ?= test

.PHONY: setup setup-runtime serve test test-matrix support-matrix lint bench-throughput bench-startup gpu-aot-check clean

$(VENV)/.installed-runtime: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-%: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$*]"
	touch $@

setup: $(VENV)/.installed-$(EXTRAS)

setup-runtime: $(if $(wildcard $(VENV)/.installed-test),$(VENV)/.installed-test,$(VENV)/.installed-runtime)

serve: setup-runtime
	$(VENV)/bin/jaxserve serve $(ARGS)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# The support matrix alone (tests/matrix, part of `make test` too), then its page rewritten from
# that run (docs/support-matrix.md; the suite fails while the page disagrees with a run).
test-matrix: setup
	$(PY) -m pytest tests/matrix $(PYTEST_ARGS)

support-matrix: setup
	-$(PY) -m pytest tests/matrix -q
	$(VENV)/bin/jaxserve support-matrix --write docs/support-matrix.md

# Lint and import order (ruff), types (mypy), and the direction of imports.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) scripts/check_layers.py
	$(PY) scripts/check_sizes.py

bench-throughput: setup
	$(VENV)/bin/jaxserve bench throughput $(ARGS)

bench-startup: setup-runtime
	$(VENV)/bin/jaxserve bench startup $(ARGS)

# Compile every step variant for an H200 on this CPU (no GPU needed) and check the programs. It
# builds its own virtual environment with the CUDA 12 plugin (a large install), so it is not part
# of `make test` nor of CI. ARGS go to the script, e.g. ARGS="--models qwen3-0.6b --jobs 2".
GPU_AOT_VENV ?= .venv-gpu-aot
GPU_AOT_PY := $(GPU_AOT_VENV)/bin/python

$(GPU_AOT_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(GPU_AOT_VENV)
	$(GPU_AOT_PY) -m pip install --quiet --upgrade pip
	$(GPU_AOT_PY) -m pip install --quiet -e ".[cuda12,triton]"
	touch $@

gpu-aot-check: $(GPU_AOT_VENV)/.installed
	$(GPU_AOT_PY) scripts/gpu_aot_check.py $(ARGS)

clean:
	rm -rf $(VENV) $(GPU_AOT_VENV) build *.egg-info
