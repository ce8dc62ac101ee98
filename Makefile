# Two entry points a fresh machine needs: `make serve` (the main job) and `make test`.
# Both create the virtual environment on first use and install jaxserve into it from scratch.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
EXTRAS ?= test

.PHONY: setup serve test lint bench-throughput clean

$(VENV)/.installed-$(EXTRAS): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

setup: $(VENV)/.installed-$(EXTRAS)

serve: setup
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

clean:
	rm -rf $(VENV) build *.egg-info
