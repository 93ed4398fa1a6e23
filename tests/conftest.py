"""Tiers of the suite, as markers set here from measured durations (`pytest --durations=0`):

- `distributed`: spawns ranks or subprocesses (tests/distributed.py, tests/subprocesses.py);
- `slow`: a module whose tests together took more than SLOW_SECONDS in CI on the 2-core machine
  (SLOW, below, with the measurement it came from);
- `serial`: a module whose assertions read a shaped link's measured rate or how fast a kill
  or a stall is noticed (SERIAL): with TEST_JOBS > 1, `make test` runs it alone, after the rest.

`make test` runs the rest on TEST_JOBS workers (default: the cores, at most 4; pytest-xdist,
`--dist loadgroup`): each module is one group, so a module's tests run in order in one process,
as they would alone (module fixtures built once, files a module writes not shared), and modules
run side by side: nothing a test starts is named after anything but its own process (ports from
the kernel, namespaces after the launcher's pid, temporary directories). Measured on the 2-core
machine, quiet (2026-11-27): one process 910 s of tests and 1133 CPU-s (tools/suite_cpu.py: 1.26
cores busy; the rest is ranks waiting on each other, deadlines, subprocesses starting), 2 workers
744 s. Then the forkserver that forks the ranks (dear/testing/ranks.py) began to preload
torch._dynamo, which each rank had imported for about 1 CPU-s at its first optimizer, a few tests
stopped sleeping past their point and the demo's test runs one round: 2 workers, 533 s + 17 s
alone, 888 CPU-s for the whole `make test`. The 2-core machine of the earlier sessions was slower:
1440 s in one process (fresh clones, 2026-11-27) where this one took 910 s.

`pytest -m "not slow"` (`make test-fast`) is the developer's check; `make test` runs everything.
"""

from __future__ import annotations

import inspect
import os
import re
from typing import Any

import pytest

# The planned schedule keeps DeAR's order where its chunks would take their link time from
# backward's compute (Config.plan_contention), which on loopback with CPU compute depends on how
# busy the machine is. The suite's planned runs plan regardless, so no test depends on timing;
# test_schedule's contention tests set the knob themselves.
os.environ.setdefault("DEAR_PLAN_CONTENTION", "1")

SLOW_SECONDS = 20
# Modules over SLOW_SECONDS in a fresh clone's CI run with PYTEST_ADDOPTS=--durations=0
# (2026-12-07 at ffd6063, 2 cores, 2 workers: 1411 + 27 passed, 686 s + 95 s; these 23 modules
# took 1070 s of the 1394 s of tests, the other 51 at most 16 s each).
SLOW: frozenset[str] = frozenset({
    "test_elastic_torchrun", "test_sharded", "test_horovod_elastic", "test_fault_timing",
    "test_user_commands", "test_elastic_faults", "test_lightning", "test_sharded_early",
    "test_horovod", "test_lint", "test_optimizer", "test_mpi", "test_tuner", "test_kfac_replicas",
    "test_comm", "test_grad_views", "test_launch", "test_hang_report", "test_quantized",
    "test_huggingface", "test_autotune_offline", "test_clip", "test_schedule"})


# test_fault_timing: a rank of a 2-rank fault test descheduled for DEAR_TIMEOUT (3 s) beside
# another module's ranks timed out in the optimizer's setup before any fault (CI, 2026-11-28).
SERIAL: frozenset[str] = frozenset({"test_cluster", "test_fault_timing"})


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    spawns: dict[Any, bool] = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is None:
            continue
        if module not in spawns:
            try:
                source = inspect.getsource(module)
            except (OSError, TypeError):
                source = ""
            spawns[module] = any(s in source for s in (
                "run_distributed(", "tests.subprocesses", "subprocess.", "run_ranks("))
        if spawns[module]:
            item.add_marker(pytest.mark.distributed)
        name = module.__name__.rsplit(".", 1)[-1]
        if name in SLOW:
            item.add_marker(pytest.mark.slow)
        if name in SERIAL:
            item.add_marker(pytest.mark.serial)
        item.add_marker(pytest.mark.xdist_group(name))


# With DEAR_REQUIRE_EXTRAS=1 (.ci/run: CI's `make setup` installs every extra but nccl4py, which
# needs a GPU), a test skipped because an optional package is missing fails instead: a broken
# install step must not pass as a skip.
REQUIRE_EXTRAS = os.environ.get("DEAR_REQUIRE_EXTRAS") == "1"
MISSING = re.compile(r"could not import|not installed|No module named", re.IGNORECASE)
NOT_REQUIRED = re.compile(r"nccl4py|nccl\.core|\bnccl\b", re.IGNORECASE)


def missing_extra(reason: str) -> bool:
    """Whether a skip's reason says an optional package that CI installs is missing."""
    return bool(MISSING.search(reason)) and not NOT_REQUIRED.search(reason)


def _fail_missing_extra(report: Any) -> None:
    if REQUIRE_EXTRAS and report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2])
        if missing_extra(reason):
            report.outcome = "failed"
            report.longrepr = (f"{reason}\nDEAR_REQUIRE_EXTRAS=1: every optional package but "
                               "nccl4py must be installed (make setup installs them)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Any:
    outcome = yield
    _fail_missing_extra(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: Any) -> Any:
    outcome = yield
    _fail_missing_extra(outcome.get_result())
