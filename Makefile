# Every target does its own set-up on a fresh machine: `make demo`, `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
TORCH  ?= torch==2.13.0

.PHONY: setup horovod demo test test-fast lint docs bench kfac-bench autotune clean

setup: $(VENV)/.installed

# --no-build-isolation: setup.py builds dear's C++ extension (csrc/) against the torch installed
# here; in an isolated build there is no torch and dear would install as pure Python.
$(VENV)/.installed: setup.py pyproject.toml Makefile $(wildcard csrc/*.* csrc/cuda/*.*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install "$(TORCH)"
	$(PIP) install "setuptools>=64,<81" wheel
	$(PIP) install --no-build-isolation -e ".[dev,lightning,mpi,docs,huggingface]"
	$(PY) -m dear.info
	PYTHON=$(PY) tools/install_horovod.sh
	touch $@

# Horovod 0.28.1 against torch 2.x needs C++17 and a few build flags (tools/install_horovod.sh).
horovod:
	PYTHON=$(PY) tools/install_horovod.sh

demo: setup
	$(PY) -m benchmarks.demo

# TEST_JOBS=N (N > 1): modules side by side on N workers (pytest-xdist; tests/conftest.py says
# why that is safe), then the few that must run alone. Default 1, one process: on the 2-core CI
# machine the suite is CPU-bound (1.5-1.7 cores busy in one process: tools/suite_cpu.py), so
# 3 workers saved only 14% (1349 s vs 1573 s) and
# made its CPU-heavy tests (mypy, the tuner's Gaussian processes) 3-6x slower; the workers now
# get one BLAS/OpenMP thread each, so N workers do not start 2N threads on the cores.
TEST_JOBS ?= 1
define run_tests
	if [ "$(TEST_JOBS)" = 1 ]; then $(PY) -m pytest -q -rs $(1) tests; else \
	  OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 \
	  $(PY) -m pytest -q -rs -n $(TEST_JOBS) --dist loadgroup -m "not serial$(2)" tests && \
	  { $(PY) -m pytest -q -rs -m "serial$(2)" tests; s=$$?; [ $$s = 0 ] || [ $$s = 5 ]; }; fi
endef

test: setup
	$(call run_tests,,)

# The developer's check: everything but the slow modules (tests/conftest.py), a few minutes.
test-fast: setup
	$(call run_tests,-m "not slow", and not slow)

# pycodestyle + pyflakes (pyproject.toml's [tool.ruff]) and mypy on dear/ (it ships py.typed);
# tests/test_lint.py runs the same.
lint: setup
	$(PY) -m ruff check
	$(PY) -m mypy

# The documentation site (mkdocs.yml: README's docs/ pages and an API reference generated from the
# docstrings) into site/; --strict: a warning (a broken link or anchor, a docstring the handler
# cannot parse) fails the build.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# DeAR vs DDP/FSDP2/Horovod/WFBP on an emulated cluster (root for network namespaces).
bench: setup
	$(PY) -m benchmarks.bench

# dear.KFAC: naive D-KFAC vs SPD vs PAD vs SGD on the emulated cluster, and digits convergence.
kfac-bench: setup
	$(PY) -m benchmarks.kfac

# Fusion autotuner vs grid search on the emulated cluster (root for network namespaces).
autotune: setup
	$(PY) -m benchmarks.autotune

clean:
	rm -rf $(VENV) build *.egg-info site
