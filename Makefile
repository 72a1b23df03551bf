# Two commands do all the set-up on a fresh machine with Python 3.10+ (see README.md):
#   make demo   installs into .venv and runs the default experiment (4 CPU ranks, digits, WAGMA)
#   make test   installs into .venv (with the test tools) and runs the quick tests (README's test command)
#   make docs   builds the documentation site into site/ (mkdocs build --strict); make serve-docs serves it
#   make ci     what CI runs on a clean clone: bash .ci/run (install, the quick tests, then the slow ones)
PY ?= python3
VENV := .venv
ARGS ?=

.PHONY: demo test ci docs serve-docs

$(VENV)/bin/python:
	$(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q torch==2.13.0  # pinned first: see README

$(VENV)/.installed-app: pyproject.toml | $(VENV)/bin/python
	$(VENV)/bin/python -m pip install -q -e ".[app]"
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(VENV)/bin/python
	$(VENV)/bin/python -m pip install -q -e ".[dev]"
	touch $@

demo: $(VENV)/.installed-app
	$(VENV)/bin/python train.py $(ARGS)

test: $(VENV)/.installed-dev
	$(VENV)/bin/python -m pytest -q -m "not slow"

ci:
	bash .ci/run

$(VENV)/.installed-docs: pyproject.toml | $(VENV)/bin/python
	$(VENV)/bin/python -m pip install -q -e ".[docs]"
	touch $@

docs: $(VENV)/.installed-docs
	$(VENV)/bin/python -m mkdocs build --strict

serve-docs: $(VENV)/.installed-docs
	$(VENV)/bin/python -m mkdocs serve
