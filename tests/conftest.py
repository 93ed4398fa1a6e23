"""Tiers of the suite, as markers set here from measured durations (`pytest --durations=0`):

- `distributed`: spawns ranks or subprocesses (tests/distributed.py, tests/subprocesses.py);
- `slow`: a module whose tests together took more than SLOW_SECONDS in CI on the 2-core machine
  (SLOW, below, with the measurement it came from);
- `serial`: a module whose assertions read a shaped link's measured rate or how fast a kill
  lands (SERIAL): with TEST_JOBS > 1, `make test` runs it alone, after the rest.

`make test TEST_JOBS=N` runs the rest on N workers (pytest-xdist, `--dist loadgroup`): each
module is one group, so a module's tests run in order in one process, as they would alone
(module fixtures built once, files a module writes not shared), and modules run side by side:
nothing a test starts is named after anything but its own process (ports from the kernel,
namespaces after the launcher's pid, temporary directories). Measured on the 2-core machine
(2026-11-27): one process 1573 s, 3 workers 1349 s, where mypy and the tuner's Gaussian
processes ran 3-6x slower; so the default stays one process there, and workers pay where there
are cores to spare. The suite is CPU-bound on 2 cores: tools/suite_cpu.py (the machine's
counters, which see the forked ranks) put it at 1.5-1.7 cores busy on average in one process,
about 2300-2700 CPU-seconds (two runs with other work beside them); `time` had shown 0.55
cores, as it does not count the ranks the forkserver forks.

`pytest -m "not slow"` is the developer's check (about 4 minutes of the 21); `make test` runs
everything.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

SLOW_SECONDS = 20
# Modules over SLOW_SECONDS in a fresh clone's CI run with PYTEST_ADDOPTS=--durations=0
# (2026-11-26, 2 cores, 677 passed in 1291 s; these 23 modules took 1036 s of it).
SLOW: frozenset[str] = frozenset({
    "test_user_commands", "test_faults", "test_sharded", "test_kfac_replicas", "test_contract",
    "test_tuner", "test_horovod_api", "test_lint", "test_grad_contract", "test_horovod",
    "test_row_sparse", "test_autotune_offline", "test_lightning", "test_mpi", "test_optimizer",
    "test_schedule", "test_hang_report", "test_huggingface", "test_grad_views",
    "test_kfac_distributed", "test_comm", "test_launch", "test_join"})


SERIAL: frozenset[str] = frozenset({"test_cluster"})


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
