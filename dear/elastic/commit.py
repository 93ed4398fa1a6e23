"""Commits that outlive the processes: one torch.distributed.checkpoint (DCP) directory per
commit, under DEAR_ELASTIC_DIR.

A commit is `<dir>/<scope>/commit-<n>/`. Every rank calls `write()`: DCP plans on every rank,
each rank writes its own files (replicated tensors and objects once, by one rank; the pieces of
a sharded optimizer state by their owners), then rank 0 writes `.metadata` (a temporary file
renamed into place). So a commit is complete exactly when its `.metadata` exists, and a process
that dies during a commit leaves the previous one as the newest complete one. The newest two
complete commits are kept. Loading reads whatever each rank needs from whichever files hold it:
no rank depends on a file only the old rank 0 could read, and a sharded state saved on N ranks
loads on M (dear/sharding/checkpoint.py).

The directory must be storage that every node reads (a shared file system on a real cluster);
the default, a folder of the temporary directory named after torchrun's run id, only serves
nodes on one machine.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from ..config import Config

_COMMIT = re.compile(r"^commit-(\d+)$")
METADATA = ".metadata"
FINISHED = "finished"
KEEP = 2


def default_directory(run_id: str) -> Path:
    """DEAR_ELASTIC_DIR, else `<tmp>/dear-elastic-<run id>` (one machine only)."""
    given = Config.from_env().elastic_dir
    if given:
        return Path(given)
    if run_id in ("", "none"):
        raise RuntimeError(
            "dear.elastic: torchrun's --rdzv-id is not set (it is 'none'), so this job's commits "
            "cannot be told from another job's: pass --rdzv-id with a value unique to the job, "
            "or set DEAR_ELASTIC_DIR to a directory of its own (on storage every node reads)")
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)
    return Path(tempfile.gettempdir()) / f"dear-elastic-{safe}"


def pack(obj: Any) -> bytes:
    """An object DCP stores whole (one bytes item): torch.save's bytes."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def unpack(data: Any) -> Any:
    if not isinstance(data, (bytes, bytearray)):
        raise ValueError(f"dear.elastic: a commit item is {type(data).__name__}, not bytes: "
                         "the commit was written by another version")
    return torch.load(io.BytesIO(bytes(data)), weights_only=False)


def nested_template(keys: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """What DCP fills back for every item under `prefix` (`prefix.a.b` -> out["a"]["b"]):
    empty tensors of the committed size and dtype, placeholders for objects. So a template
    needs nothing from the live object: an optimizer without state yet reads its state."""
    out: dict[str, Any] = {}
    for key, meta in keys.items():
        if not key.startswith(prefix + "."):
            continue
        *path, leaf = key[len(prefix) + 1:].split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        size = getattr(meta, "size", None)
        node[leaf] = b"" if size is None else torch.empty(
            tuple(size), dtype=meta.properties.dtype)
    return out


class CommitDir:
    """One scope's commits (each decorated function gets its own scope)."""

    def __init__(self, root: Path, scope: str) -> None:
        self.root = Path(root)
        self.path = self.root / re.sub(r"[^A-Za-z0-9_.-]", "_", scope)

    def commit_path(self, n: int) -> Path:
        return self.path / f"commit-{n:08d}"

    def listed(self) -> tuple[list[int], list[int]]:
        """(every commit number present, the complete ones), ascending."""
        if not self.path.is_dir():
            return [], []
        seen, complete = [], []
        for entry in os.listdir(self.path):
            match = _COMMIT.match(entry)
            if match is None:
                continue
            n = int(match.group(1))
            seen.append(n)
            if (self.path / entry / METADATA).exists():
                complete.append(n)
        return sorted(seen), sorted(complete)

    def finished(self) -> bool:
        return (self.path / FINISHED).exists()

    def mark_finished(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / FINISHED).write_text("the decorated function returned on every rank\n")

    def keys(self, n: int) -> dict[str, Any]:
        """Commit n's items by (flattened) key, each with what DCP knows of it (a tensor's size
        and dtype, or that it is an object), from its metadata alone (no collective)."""
        from torch.distributed.checkpoint import FileSystemReader
        metadata = FileSystemReader(str(self.commit_path(n))).read_metadata()
        return dict(metadata.state_dict_metadata)

    def write(self, n: int, state: dict[str, Any]) -> None:
        """Every rank: commit `state` as number n (complete once this returns anywhere)."""
        import torch.distributed.checkpoint as dcp
        path = self.commit_path(n)
        path.mkdir(parents=True, exist_ok=True)
        dcp.save(state, checkpoint_id=str(path))

    def read(self, n: int, template: dict[str, Any]) -> dict[str, Any]:
        """Every rank: fill `template` (tensors in place, other items replaced) from commit n."""
        import torch.distributed.checkpoint as dcp
        dcp.load(template, checkpoint_id=str(self.commit_path(n)))
        return template

    def prune(self, keep: int = KEEP) -> None:
        """Delete all but the newest `keep` complete commits and the incomplete ones older than
        the newest complete one (a commit in progress is newer than every complete one)."""
        seen, complete = self.listed()
        if not complete:
            return
        kept = set(complete[-keep:])
        newest = complete[-1]
        for n in seen:
            if n not in kept and n < newest:
                shutil.rmtree(self.commit_path(n), ignore_errors=True)

    def newest(self) -> Optional[int]:
        complete = self.listed()[1]
        return complete[-1] if complete else None


__all__ = ["CommitDir", "default_directory", "nested_template", "pack", "unpack"]
