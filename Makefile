# Every target does its own set-up on a fresh machine: `make demo`, `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
TORCH  ?= torch==2.13.0

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.py pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install "$(TORCH)"
	$(PIP) install -e ".[dev]"
	touch $@

demo: setup
	$(PY) -m benchmarks.demo

test: setup
	$(PY) -m pytest -q -rs tests

clean:
	rm -rf $(VENV) build *.egg-info
