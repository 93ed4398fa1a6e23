"""Where the suite's CPU goes: a pytest plugin that records, per test, its wall time and the CPU
the whole machine spent meanwhile (/proc/stat), and prints the modules by CPU at the end.

    PYTHONPATH=tools .venv/bin/python -m pytest -p suite_cpu tests    [SUITE_CPU_OUT=file.jsonl]

The machine's counters, not the test process's: a rank forked by the forkserver, a horovodrun or
torchrun child is nobody's child that `time` or getrusage would count (they showed 0.55 cores
where /proc/stat shows 1.5-1.7). So run it on a quiet machine: anything else running is charged
to the test it overlaps.
"""

from __future__ import annotations

import collections
import json
import os
import time
from typing import Any, Generator

import pytest

_rows: list[dict[str, Any]] = []


def _busy_seconds() -> float:
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    idle = fields[3] + fields[4]                      # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Generator[None, None, None]:
    busy, start = _busy_seconds(), time.monotonic()
    yield
    row = {"id": item.nodeid, "wall": time.monotonic() - start, "cpu": _busy_seconds() - busy}
    _rows.append(row)
    out = os.environ.get("SUITE_CPU_OUT")
    if out:
        with open(out, "a") as fh:
            fh.write(json.dumps(row) + "\n")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _rows:
        return
    modules: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for row in _rows:
        entry = modules[row["id"].split("::")[0]]
        entry[0] += row["wall"]
        entry[1] += row["cpu"]
    wall = sum(w for w, _ in modules.values())
    cpu = sum(c for _, c in modules.values())
    write = terminalreporter.write_line
    write(f"suite_cpu: {wall:.0f} s of tests, {cpu:.0f} CPU-s on the machine "
          f"({cpu / max(wall, 1e-9):.2f} cores busy on average, {os.cpu_count()} cores)")
    for name, (w, c) in sorted(modules.items(), key=lambda kv: -kv[1][1])[:20]:
        write(f"  {c:7.1f} CPU-s {w:7.1f} s  {name}")
