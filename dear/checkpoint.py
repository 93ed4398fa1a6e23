"""Checkpoints that are never partially written.

A rank killed while writing must leave the previous checkpoint intact: `atomic_save` writes to a
temporary file in the same directory, flushes it to disk, and renames it over the target
(`os.replace` is atomic on POSIX). No dear-specific state needs saving: `model.state_dict()` and
`optimizer.state_dict()` apply pending updates first, so they always hold whole steps.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Union

import torch

PathLike = Union[str, "os.PathLike[str]"]


def atomic_save(obj: Any, path: PathLike) -> None:
    """torch.save(obj, path), all or nothing: readers see the old file or the new one."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)                       # the rename itself survives a power cut
    finally:
        os.close(dir_fd)
