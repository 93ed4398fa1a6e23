"""The code passes ruff's pycodestyle and pyflakes checks (pyproject.toml), as `make lint` runs
them: an unused import or an undefined name left by a refactor fails here, not in a user's run."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINTED = ["dear", "benchmarks", "tests", "examples", "tools", "setup.py"]


@pytest.mark.timeout(120)
def test_ruff_finds_nothing() -> None:
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *LINTED],
                         cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stdout + out.stderr
