# Both targets set themselves up on a fresh machine: a virtual environment with the CPU build of PyTorch,
# then optstack and its extras. Needed beforehand: Python 3.11+ with its venv module, and make (Debian / Ubuntu:
# apt install make python3-venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.optstack-installed

CORE_VENV ?= .venv-core
CORE_PY := $(CORE_VENV)/bin/python

.PHONY: demo test lint setup check-core clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,demo,hf]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/optstack train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

# The core install, without extras, runs everything but plots. The suite cannot show that (the demo extra's
# matplotlib brings numpy in), so: a fresh venv each time (a non-editable install would go stale), with no
# numpy in it, running 2 ranks of ZeRO-1 and a checkpoint save and load. pip builds the wheel in ./build,
# whose leftovers (a module since deleted) could end up in the install: it goes too.
check-core:
	rm -rf $(CORE_VENV) build
	$(PYTHON) -m venv $(CORE_VENV)
	$(CORE_PY) -m pip install --quiet --upgrade pip
	$(CORE_PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(CORE_PY) -m pip install --quiet -c constraints.txt .
	@if $(CORE_PY) -c "import numpy" 2>/dev/null; then \
		echo "check-core: numpy is importable in $(CORE_VENV): the core install must not pull it in" >&2; exit 1; fi
	$(CORE_PY) .ci/core_install_check.py

clean:
	rm -rf $(VENV) $(CORE_VENV) runs .pytest_cache
