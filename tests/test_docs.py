"""The documentation: the site builds with no warning (`make docs`: broken links and anchors
between pages, docstrings the API reference cannot render), README.md's relative links point at
files that exist, and docs/configuration.md's table lists exactly the DEAR_* variables that
dear.config.Config reads, each with Config's default."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dear.config import Config

ROOT = Path(__file__).resolve().parent.parent
CONFIG_PAGE = ROOT / "docs" / "configuration.md"


@pytest.mark.timeout(180)
def test_site_builds_without_warnings(tmp_path: Path) -> None:
    needed = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
    missing = [name for name in needed if _missing(name)]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (pip install -e '.[docs]', part of "
                    "make setup)")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                          "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=150,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "WARNING" not in out.stderr, out.stderr
    api = (tmp_path / "api" / "index.html").read_text()
    import dear
    # Every public name has its entry in the reference: `dear.NAME`.
    missing = [name for name in dear.__all__ if f'id="dear.{name}"' not in api]
    assert not missing, f"docs/api.md documents none of {missing}"


def test_readme_relative_links_exist() -> None:
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text)
    assert targets, "README.md has no links"
    broken = []
    for target in targets:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue                          # http(s):, mailto:, an anchor in README itself
        path = target.split("#", 1)[0]
        if not (ROOT / path).exists():
            broken.append(target)
    assert not broken, f"README.md links to files that do not exist: {broken}"


def _documented_variables() -> dict[str, str]:
    """docs/configuration.md's table: variable -> its default cell."""
    rows = re.findall(r"^\| `(DEAR_[A-Z0-9_]+)` \| ([^|]*) \|", CONFIG_PAGE.read_text(), re.M)
    documented: dict[str, str] = {}
    for variable, default in rows:
        assert variable not in documented, f"{variable} has two rows in {CONFIG_PAGE.name}"
        documented[variable] = default.strip()
    return documented


def _declared_variables() -> dict[str, str]:
    """Config's fields as from_env reads them: variable -> field name."""
    return {variable: field for field, variable in Config.variables().items()}


def test_configuration_table_lists_every_variable_config_reads() -> None:
    documented, declared = _documented_variables(), _declared_variables()
    missing = sorted(set(declared) - set(documented))
    stale = sorted(set(documented) - set(declared))
    assert not missing, f"Config reads {missing}, not in {CONFIG_PAGE.name}'s table"
    assert not stale, f"{CONFIG_PAGE.name}'s table lists {stale}, which Config no longer reads"


def test_configuration_table_defaults_are_configs() -> None:
    """A default cell is `unset...` for a field whose default means "not set" (None, ""), else
    its first `code` span is the value: parsed as the variable would be, it gives the default."""
    documented, declared = _documented_variables(), _declared_variables()
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    wrong = []
    for variable, field in declared.items():
        cell = documented.get(variable)
        if cell is None:
            continue                          # reported by the test above
        default = defaults[field]
        if cell.startswith("unset"):
            if default not in (None, ""):
                wrong.append(f"{variable}: documented unset, Config's default {default!r}")
            continue
        code = re.match(r"`([^`]*)`", cell)
        if code is None:
            wrong.append(f"{variable}: default cell {cell!r} starts with neither `value` nor "
                         "unset")
            continue
        value = getattr(Config.from_env({variable: code.group(1)}), field)
        if value != getattr(Config(), field):
            wrong.append(f"{variable}: documented {code.group(1)!r} reads as {value!r}, "
                         f"Config's default is {getattr(Config(), field)!r}")
    assert not wrong, "\n".join(wrong)


def test_docs_name_only_variables_that_exist() -> None:
    """Every DEAR_* name in README.md and docs/ is one Config reads, one setup.py reads while
    building (DEAR_BUILD_*), or one the test suite reads (tests/conftest.py)."""
    known = set(_declared_variables())
    for path in (ROOT / "setup.py", ROOT / "tests" / "conftest.py"):
        known |= set(re.findall(r"\b(DEAR_[A-Z0-9_]+)\b", path.read_text()))
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    unknown = {f"{page.relative_to(ROOT)}: {name}" for page in pages
               for name in re.findall(r"\b(DEAR_[A-Z0-9]+(?:_[A-Z0-9]+)*)\b", page.read_text())
               if name not in known}
    assert not unknown, sorted(unknown)


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:               # the parent package is not there
        return True
