# Two commands do all the set-up on a fresh machine with Python 3.10+ (see README.md):
#   make demo   installs into .venv and runs the default experiment (4 CPU ranks, digits, WAGMA)
#   make test   installs into .venv and runs the tests (the same as CI: bash .ci/run)
PY ?= python3
VENV := .venv
ARGS ?=

.PHONY: demo test

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q torch==2.13.0  # pinned first: see README
	$(VENV)/bin/python -m pip install -q -e ".[app]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/python train.py $(ARGS)

test:
	bash .ci/run
