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
# why that is safe), then the few that must run alone; TEST_JOBS=1: one process. Default: the
# cores, at most 4. On the 2-core machine, quiet (2026-11-27): one process 910 s, 2 workers
# 744 s, and 550 s once the ranks' forkserver preloaded torch._dynamo (tests/conftest.py): one
# process keeps 1.26 of the 2 cores busy on average (tools/suite_cpu.py), the rest is ranks
# waiting on each other, deadlines and subprocesses starting, which a second worker fills. Each
# worker gets one BLAS/OpenMP thread, so N workers do not start 2N threads.
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
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
