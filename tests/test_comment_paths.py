"""Every file a comment or docstring names exists: the `dear/...py`, `csrc/...`, `docs/...md`
(with its `#anchor`), `benchmarks/...`, `tools/...` and `tests/...` paths (string literals too:
messages point users at docs/), a bare `name.py` (some file of the repository has that name),
and every dotted `dear.x.y` name, in the sources of dear/, benchmarks/, tools/ and csrc/. A file
moved or deleted (dear/moved.py, the flat dear.runtime, reduced.py) leaves no pointer to where
it was."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PY_DIRS = ("dear", "benchmarks", "tools")
C_SUFFIXES = {".h", ".cpp", ".cu", ".cuh", ".sh"}
FILE_SUFFIX = r"\.(?:py|md|h|cpp|cu|cuh|sh|json|toml|cfg|txt)"
# Bare names of files outside this repository that a comment may name.
EXTERNAL = {"goodput.py"}                      # AdaptDL's, which dear.diagnose.pollux follows

# A path from the repository root: a top folder, then path characters (`{a,b}` alternatives),
# ending in a file name with a suffix or in "/" (a folder).
_PATH = re.compile(r"(?<![\w./-])((?:dear|csrc|docs|benchmarks|tools|tests|examples)/"
                   r"(?:[\w.-]*/)*(?:[\w.-]*\{[\w.-]*,[\w.,-]*\}[\w.-]*"
                   r"|[\w.-]*" + FILE_SUFFIX + r"\b|))(#[\w-]+)?(?![\w/*{])")
_BARE = re.compile(r"(?<![\w./{}-])([A-Za-z_]\w*\.py)\b")
_PLACEHOLDER = re.compile(r"/[A-Z]+(\.\w+)?$")          # benchmarks/results/NAME.json
_DOTTED = re.compile(r"(?<![\w./-])dear(?:\.[A-Za-z_]\w*)+")


def python_texts(source: str) -> list[tuple[str, str]]:
    """(kind, text) for each comment ("comment"), docstring ("docstring") and other string
    literal ("string") of a Python source."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                docstrings.add(body[0].value.lineno)
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append(("comment", tok.string))
        elif tok.type == tokenize.STRING:
            out.append(("docstring" if tok.start[0] in docstrings else "string", tok.string))
    return out


def _expand(name: str) -> list[str]:
    """'csrc/grad_ready.{h,cpp}' -> both names; a path without braces is itself."""
    m = re.search(r"\{([^{}]*)\}", name)
    if m is None:
        return [name]
    return [n for alt in m.group(1).split(",")
            for n in _expand(name[:m.start()] + alt + name[m.end():])]


def _slug(heading: str) -> str:
    """The anchor mkdocs' toc gives a heading (its default slugify)."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[-\s]+", "-", text).strip("-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)   # not code's "#"
    return {_slug(h) for h in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M)}


def stale_paths(text: str, root: Path = ROOT) -> list[str]:
    """The repository paths `text` names that do not exist (or whose #anchor the page lacks)."""
    stale = []
    for m in _PATH.finditer(text):
        name, anchor = m.group(1), m.group(2)
        for path in _expand(name):
            target = root / path
            if not target.exists():
                if not _PLACEHOLDER.search(path):
                    stale.append(path)
            elif anchor and target.suffix == ".md" and anchor[1:] not in _anchors(target):
                stale.append(path + anchor)
    return stale


def _file_names(root: Path) -> set[str]:
    skip = {".git", ".venv", "site", "build", "node_modules"}
    return {p.name for p in root.rglob("*")
            if not skip.intersection(p.relative_to(root).parts)} | EXTERNAL


def stale_names(text: str, names: set[str]) -> list[str]:
    """The bare Python file names (`amp_clip.py`) in `text` that no file has (a bare .md may
    be an output: results.md)."""
    return [m.group(1) for m in _BARE.finditer(text) if m.group(1) not in names]


def _module_names(path: Path) -> set[str]:
    """What `module.NAME` may name: the module's top-level definitions, assignments, imports."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def stale_modules(text: str, root: Path = ROOT) -> list[str]:
    """The dotted `dear.x.y` names in `text` that name neither a module of dear/ (or the
    extension setup.py builds, dear._native) nor a name one defines or imports (a plural,
    "dear.DistributedOptimizers", counts as its singular; attributes of that name are not
    followed)."""
    built = set(re.findall(r'"(dear\.[\w.]+)"', (root / "setup.py").read_text()))
    stale = []
    for m in _DOTTED.finditer(text):
        parts = m.group(0).split(".")
        here = root / "dear"
        for i, part in enumerate(parts[1:], start=1):
            if ".".join(parts[:i + 1]) in built:
                break
            if (here / part / "__init__.py").exists():
                here = here / part
                continue
            if (here / f"{part}.py").exists():
                here = here / f"{part}.py"
                continue
            defined = _module_names(here / "__init__.py" if here.is_dir() else here)
            if part not in defined and part.removesuffix("s") not in defined:
                stale.append(".".join(parts[:i + 1]))
            break
    return stale


def _sources() -> list[Path]:
    files = [p for d in PY_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    files += [p for p in sorted((ROOT / "csrc").rglob("*")) if p.suffix in C_SUFFIXES]
    return [p for p in files if "results" not in p.relative_to(ROOT).parts]


def stale_in(path: Path, names: set[str], root: Path = ROOT) -> list[str]:
    """Every stale path or name in a source: paths in any text, bare names and dotted names in
    comments and docstrings only (a string may hold a store key, "dear.gloo", or a user's
    "script.py"). Outside Python the whole file counts as comment."""
    source = path.read_text()
    texts = python_texts(source) if path.suffix == ".py" else [("comment", source)]
    bad = []
    for kind, text in texts:
        bad += stale_paths(text, root)
        if kind != "string":
            bad += stale_names(text, names) + stale_modules(text, root)
    return bad


@pytest.mark.parametrize("folder", PY_DIRS + ("csrc",))
def test_every_named_path_exists(folder: str) -> None:
    names = _file_names(ROOT)
    bad = [f"{path.relative_to(ROOT)}: {name}" for path in _sources()
           if path.relative_to(ROOT).parts[0] == folder for name in stale_in(path, names)]
    assert not bad, "named but not in the repository:\n" + "\n".join(sorted(set(bad)))


def test_the_scan_finds_a_stale_name(tmp_path: Path) -> None:
    source = tmp_path / "planted.py"
    source.write_text(
        '"""The engine (dear/engine/setup.py; csrc/grad_hook.{h,cpp}, reduced.py)."""\n'
        "x = 1  # now dear/deferred.py, docs/benchmarks.md#no-such-heading, dear.runtime.init\n"
        "# fine: dear/engine/engine.py, dear/fusion/, docs/benchmarks.md#host-cost, amp_clip.py,\n"
        "# dear.comm.runtime, dear.DistributedOptimizers, dear._native, dear/**/*.py, results.md,\n"
        "# benchmarks/results/bench_emulated{.md,.json}, benchmarks/results/NAME.json\n"
        "y = ('dear/job/7', 'dear/flight/rank{}', 'dear.gloo', 'script.py', 'docs/missing.md',\n"
        "     'csrc/pack.{h,cc}')\n")
    found = stale_in(source, _file_names(ROOT))
    assert found == ["dear/engine/setup.py", "csrc/grad_hook.h", "csrc/grad_hook.cpp",
                     "reduced.py", "dear/deferred.py", "docs/benchmarks.md#no-such-heading",
                     "dear.runtime", "docs/missing.md", "csrc/pack.cc"]
    assert _slug("`make bench`'s shorter table") == "make-benchs-shorter-table"
