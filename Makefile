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

.PHONY: setup setup-runtime serve test lint bench-throughput bench-startup clean

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

# Lint and import order (ruff), types (mypy), and the direction of imports.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) scripts/check_layers.py

bench-throughput: setup
	$(VENV)/bin/jaxserve bench throughput $(ARGS)

bench-startup: setup-runtime
	$(VENV)/bin/jaxserve bench startup $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
