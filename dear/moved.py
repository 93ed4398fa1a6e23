"""Old import paths of modules that moved into the layer packages (docs/ARCHITECTURE.md):
`import dear.runtime` still gives `dear.comm.runtime`, the same module object (so a script's
monkeypatch or isinstance check acts on the real one). Nothing inside dear imports through
these names; tests/test_architecture.py checks each. `dear.join` is not among them: it names
the function dear.join(), which an alias module would replace on import."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Optional, Sequence

MOVED: dict[str, str] = {
    "dear.amp": "dear.shardops.amp",
    "dear.buffers": "dear.engine.buffers",
    "dear.clip": "dear.shardops.clip",
    "dear.compiled": "dear.engine.compiled",
    "dear.compression": "dear.comm.compression",
    "dear.extension": "dear.engine.extension",
    "dear.fusion.autotune": "dear.autotune.factory",
    "dear.fusion.offline": "dear.autotune.offline",
    "dear.fusion.tuner": "dear.autotune.online",
    "dear.hang": "dear.comm.hang",
    "dear.iteration": "dear.engine.state",
    "dear.launch": "dear.comm.launch",
    "dear.model_guard": "dear.guards.model_guard",
    "dear.optimizer": "dear.engine.optimizer",
    "dear.reduced": "dear.engine.amp_clip",
    "dear.runtime": "dear.comm.runtime",
    "dear.sharded": "dear.sharding.state",
    "dear.sharded_checkpoint": "dear.sharding.checkpoint",
    "dear.shards": "dear.shardops.shards",
    "dear.sparse": "dear.engine.sparse",
    "dear.stream": "dear.guards.stream",
    "dear.validation": "dear.guards.validation",
    "dear.written": "dear.guards.written"
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name and hands back the module under its new name."""

    def __init__(self) -> None:
        self._specs: dict[str, Optional[importlib.machinery.ModuleSpec]] = {}

    def find_spec(self, fullname: str, path: Optional[Sequence[str]],
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(MOVED[spec.name])
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system set the alias's spec on the real module: give it its own back.
        alias = module.__spec__.name if module.__spec__ is not None else ""
        if alias in self._specs:
            module.__spec__ = self._specs.pop(alias)


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
