"""Tiers of the suite, as markers set here from measured durations (`pytest --durations=0`):

- `distributed`: spawns ranks or subprocesses (tests/distributed.py, tests/subprocesses.py);
- `slow`: a module whose tests together took more than SLOW_SECONDS on the quiet 2-core machine
  (SLOW, below, with the measurement it came from).

`pytest -m "not slow"` is the developer's check (a few minutes); `make test` runs everything.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

SLOW_SECONDS = 30
# Modules over SLOW_SECONDS in the full suite's --durations=0 (see the commit adding a module).
SLOW: frozenset[str] = frozenset()


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
        if module.__name__.rsplit(".", 1)[-1] in SLOW:
            item.add_marker(pytest.mark.slow)
