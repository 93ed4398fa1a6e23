"""The code passes ruff's pycodestyle and pyflakes checks and dear/ passes mypy (pyproject.toml),
as `make lint` runs them: an unused import, an undefined name or a wrong type left by a refactor
fails here, not in a user's run (dear ships py.typed: users' type checkers read these hints)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
def test_ruff_finds_nothing() -> None:
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache"],
                         cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.timeout(300)
def test_mypy_finds_nothing_in_dear() -> None:
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install -e '.[dev]')")
    out = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental"],
                         cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("module", ["dear.engine.engine", "tests.test_x", "benchmarks.bench"])
def test_a_deprecated_call_in_our_code_fails_the_suite(module: str) -> None:
    """pyproject's filters: a DeprecationWarning raised in our modules (dear calling a
    deprecated torch API, say) is an error; third-party code's own stay quiet."""
    with pytest.raises(DeprecationWarning):
        warnings.warn_explicit("old API", DeprecationWarning, "x.py", 1, module=module)
    warnings.warn_explicit("old API", DeprecationWarning, "x.py", 1, module="torch.nn")
