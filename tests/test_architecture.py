"""The package layout is the architecture (docs/ARCHITECTURE.md), and these checks keep it so:

- no import circle among dear's modules (function-local imports included, `if TYPE_CHECKING:`
  blocks left out: they never run);
- imports go only down the layers (LAYERS, bottom first), never up;
- the documented import paths work;
- the module map in docs/ARCHITECTURE.md names every module and package, and nothing else;
- the torch private names that ruff's SLF001 lets through (pyproject.toml) are not attributes any
  dear class defines, so the exemption cannot hide a read of dear's own privates.
"""

from __future__ import annotations

import ast
import importlib
import re
import tomllib
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Bottom first. A module may import from its own layer and the layers below it.
LAYERS: list[tuple[str, ...]] = [
    ("dear.config", "dear.native", "dear.checkpoint", "dear.interfaces"),
    ("dear.comm",),                       # backends, dear.init(), the launcher, the hang report
    ("dear.fusion",),                     # buckets, layouts, the planned schedule
    ("dear.diagnose",),                   # tracer, report, replay simulator, scaling curves
    ("dear.autotune",),                   # above fusion and diagnose
    ("dear.guards",),                     # the contract's checks
    ("dear.shardops",),                   # work on the reduced shards
    ("dear.sharding",),                   # shard_optimizer_state
    ("dear.engine",),                     # the optimizer and its data path
    ("dear.kfac", "dear.horovod", "dear.lightning", "dear.huggingface", "dear.elastic"),
    ("dear", "dear.info", "dear.testing", "dear.cluster"),
]

#: The import paths users are told about (README, docs/): each must keep importing.
DOCUMENTED = ["dear", "dear.lightning", "dear.huggingface", "dear.horovod", "dear.kfac",
              "dear.diagnose", "dear.cluster", "dear.testing", "dear.info", "dear.config"]

#: dear.__all__ as documented in docs/api.md: the public API a refactor must not change.
PUBLIC = {"Average", "Compression", "DistributedOptimizer", "KFAC", "ReduceOp", "Sum",
          "allreduce", "atomic_save", "broadcast_optimizer_state", "broadcast_parameters",
          "diagnose", "init", "is_initialized", "join", "local_rank", "native_available", "rank",
          "shutdown", "size"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted((ROOT / "dear").rglob("*.py"))}


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(module: str) -> Iterator[tuple[str, int]]:
    """(imported dear module, line) for every import that runs, at any depth."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]

    def resolve(node: ast.ImportFrom) -> list[str]:
        if node.level:
            base = package[:len(package) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        return [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in MODULES else prefix
                for a in node.names]

    def walk(node: ast.AST) -> Iterator[tuple[str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                yield from (x for branch in child.orelse for x in walk(branch))
                continue
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                targets = resolve(child)
            for target in targets:
                while target and target not in MODULES:
                    target = target.rpartition(".")[0]
                if target.startswith("dear") and target != module:
                    yield target, child.lineno
            yield from walk(child)

    yield from walk(ast.parse(path.read_text()))


GRAPH = {m: {t for t, _ in _imports(m)} for m in MODULES}


def _layer(module: str) -> int:
    best = (-1, -1)                            # (length of the matching prefix, layer)
    for index, layer in enumerate(LAYERS):
        for prefix in layer:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best[0]:
                best = (len(prefix), index)
    assert best[1] >= 0, f"{module} is in no layer of tests/test_architecture.py's LAYERS"
    return best[1]


def test_no_import_circle() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:                  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in GRAPH:
        if module not in index:
            visit(module)
    assert not circles, f"import circles: {circles}"


def test_imports_only_go_down_the_layers() -> None:
    upward = [f"{m}:{line} imports {t} (layer {_layer(t)} above {_layer(m)})"
              for m in MODULES for t, line in _imports(m) if _layer(t) > _layer(m)]
    assert not upward, "\n".join(upward)


def test_the_layers_name_only_what_exists() -> None:
    for layer in LAYERS:
        for prefix in layer:
            assert prefix in MODULES, f"LAYERS names {prefix}, which is no module or package"


def test_documented_import_paths_and_the_public_api() -> None:
    for name in DOCUMENTED:
        importlib.import_module(name)
    import dear
    assert set(dear.__all__) == PUBLIC
    assert callable(dear.join) and callable(dear.DistributedOptimizer)
    from dear.lightning import DeARStrategy  # noqa: F401
    from dear.huggingface import DeARAccelerator, DeARTrainer  # noqa: F401


def _mapped() -> set[str]:
    """The `dear/...` paths in the first column of docs/ARCHITECTURE.md's module map."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    cells = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `dear")]
    return {p for cell in cells for p in re.findall(r"`(dear/[\w/.]*)`", cell)}


def test_the_module_map_names_every_module_and_nothing_else() -> None:
    mapped = _mapped()
    missing = []
    for path in MODULES.values():
        rel = path.relative_to(ROOT).as_posix()
        folders = {"/".join(rel.split("/")[:k]) + "/" for k in range(2, rel.count("/") + 1)}
        folder = rel.rpartition("/")[0] + "/"
        if path.name == "__init__.py" and rel != "dear/__init__.py" \
                and any(m.startswith(folder) for m in mapped):
            continue                           # a package whose modules the map names
        if rel not in mapped and not folders & mapped:
            missing.append(rel)
    assert not missing, f"docs/ARCHITECTURE.md's module map lacks {missing}"
    stale = [p for p in mapped if not (ROOT / p).exists()]
    assert not stale, f"docs/ARCHITECTURE.md's module map names what does not exist: {stale}"


def test_the_slf001_exemptions_are_not_dear_attributes() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names = set(config["tool"]["ruff"]["lint"]["flake8-self"]["ignore-names"])
    defined = set()
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                defined.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.add(node.name)
    clash = names & defined
    assert not clash, f"dear defines {clash}, which ruff's SLF001 exempts as torch's names"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.count(".") >= 1))
def test_every_module_is_in_a_layer(module: str) -> None:
    _layer(module)


# ------------------------------------------------------------------- the engine owns its state
ENGINE_MODULE = ROOT / "dear" / "engine" / "engine.py"


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if ROOT in path.parents else path.name
#: The most fields an Engine may hold (each set in its constructor).
ENGINE_FIELDS_AT_MOST = 27


def _stored_attributes(node: ast.AST, owner: str) -> Iterator[tuple[str, int]]:
    """(attribute, line) of every `<owner>.<attribute> = ...` (also in tuples, augmented)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) \
                and isinstance(sub.value, ast.Name) and sub.value.id == owner:
            yield sub.attr, sub.lineno


def _engine_class() -> ast.ClassDef:
    tree = ast.parse(ENGINE_MODULE.read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")


def engine_fields() -> tuple[set[str], list[str], list[str]]:
    """(fields set in Engine.__init__, fields only declared in the class body, fields first set
    by another method)."""
    cls = _engine_class()
    declared = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)
                and n.value is None and isinstance(n.target, ast.Name)]
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef)]
    init = next(m for m in methods if m.name == "__init__")
    built = {name for name, _ in _stored_attributes(init, "self")}
    later = sorted({f"{name} (line {line})" for m in methods if m is not init
                    for name, line in _stored_attributes(m, "self") if name not in built})
    return built, declared, later


def test_the_engine_is_built_complete_in_its_constructor() -> None:
    built, declared, later = engine_fields()
    assert not declared, f"Engine declares fields its constructor does not set: {declared}"
    assert not later, f"Engine's methods create fields its constructor does not: {later}"
    assert len(built) <= ENGINE_FIELDS_AT_MOST, \
        f"Engine holds {len(built)} fields (at most {ENGINE_FIELDS_AT_MOST}): {sorted(built)}"


def _engine_expression(node: ast.AST) -> bool:
    """`engine`, or anything's `.dear_engine`."""
    return (isinstance(node, ast.Name) and node.id == "engine") or \
        (isinstance(node, ast.Attribute) and node.attr == "dear_engine")


def outside_writes() -> list[str]:
    """Assignments to an engine's fields (`engine.x = ...`, `opt.dear_engine.x = ...`,
    setattr) anywhere in dear/ but the engine's own module."""
    found = []
    for path in MODULES.values():
        if path == ENGINE_MODULE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and _engine_expression(node.value):
                found.append(f"{_rel(path)}:{node.lineno} sets .{node.attr}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("setattr", "delattr") and node.args \
                    and _engine_expression(node.args[0]):
                found.append(f"{_rel(path)}:{node.lineno} {node.func.id}")
    return found


def test_nothing_outside_the_engine_module_assigns_its_fields() -> None:
    found = outside_writes()
    assert not found, "\n".join(found)


# ------------------------------------------------------------------------------- one door
#: Private names of other libraries that dear reads by name, and why.
THIRD_PARTY_PRIVATES = {
    "_allreduce_grad_async": "horovod.torch's optimizer: the tracer times its all-reduces",
    "_handles": "horovod.torch's optimizer: how the tracer recognises it",
    "_comm_hooks": "DDP's registered communication hooks: the tracer will not trace over one",
    "_orig_mod": "torch.compile's OptimizedModule: the module it compiled",
    "_wrapped_by_lr_sched": "torch's LRScheduler marks an optimizer's step it patched",
    "_fields": "collections.namedtuple's field names (public API despite the underscore)",
}
#: Attributes a user sets on their own optimizer class, read by name on purpose.
USER_MARKERS = {"dear_elementwise": "the class's author vouches that its update is elementwise "
                                    "(dear/sharding/state.py)"}


def by_name_reads() -> list[str]:
    """getattr/hasattr/setattr/delattr of a dear_ name (the Protocol in dear/interfaces.py
    names those) or of a private name that is not a listed third party's."""
    found = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str)):
                continue
            name = node.args[1].value
            private = name.startswith("_") and not name.startswith("__")
            if (name.startswith("dear_") and name not in USER_MARKERS) or \
                    (private and name not in THIRD_PARTY_PRIVATES):
                found.append(f"{_rel(path)}:{node.lineno} {node.func.id} {name!r}")
    return found


def test_no_attribute_of_dear_is_read_by_name() -> None:
    found = by_name_reads()
    assert not found, "\n".join(found)


def back_doors() -> list[str]:
    """`.dear_engine` reached from outside dear/engine/: the engine's collaborators use the
    extension points (dear/engine/extension.py, typed by dear/interfaces.py)."""
    inside = ROOT / "dear" / "engine"
    return [f"{_rel(path)}:{node.lineno}"
            for path in MODULES.values() if inside not in path.parents
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr == "dear_engine"]


def test_only_the_engine_package_reaches_the_engine() -> None:
    found = back_doors()
    assert not found, "\n".join(found)


def test_the_checks_above_catch_what_they_look_for(tmp_path: Path) -> None:
    """Each check finds a planted instance (so an empty answer means none, not a blind check)."""
    source = ("def f(opt, engine):\n    engine.layout = None\n    opt.dear_engine.phase = 1\n"
              "    getattr(opt, 'dear_layout')\n    getattr(opt, '_mine')\n")
    tree = ast.parse(source)
    writes = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
              and isinstance(n.ctx, ast.Store) and _engine_expression(n.value)]
    assert writes == ["layout", "phase"]
    planted = tmp_path / "planted.py"
    planted.write_text(source)
    MODULES["planted"] = planted
    try:
        found = [by_name_reads(), back_doors(), outside_writes()]
    finally:
        del MODULES["planted"]
    assert [sum(x.startswith("planted.py") for x in f) for f in found] == [2, 1, 2], found
