"""Checkpoints that are never partially written.

A rank killed while writing must leave the previous checkpoint intact: `atomic_save` writes to a
temporary file in the same directory, flushes it to disk, and renames it over the target
(`os.replace` is atomic on POSIX). No dear-specific state needs saving: `model.state_dict()` and
`optimizer.state_dict()` apply pending updates first, so they always hold whole steps.
"""

from __future__ import annotations

import os
import socket
import tempfile
from typing import Any, Union

import torch

PathLike = Union[str, "os.PathLike[str]"]


def atomic_save(obj: Any, path: PathLike) -> None:
    """torch.save(obj, path), all or nothing: readers see the old file or the new one. The file
    gets the mode torch.save would give it (0666 less the umask). A temporary file left by a
    process killed mid-write (named after its host and pid) is removed by the next save."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    prefix = f"{os.path.basename(path)}.{_HOST}.{os.getpid()}."
    _remove_orphans(directory, os.path.basename(path))
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=_SUFFIX, dir=directory)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
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


_HOST = socket.gethostname().replace(".", "_") or "host"
_SUFFIX = ".dear-tmp"


def _remove_orphans(directory: str, name: str) -> None:
    """Temporary files of `name` written on this host by processes that no longer exist."""
    head = f"{name}.{_HOST}."
    try:
        entries = os.listdir(directory)
    except OSError:
        return
    for entry in entries:
        if not (entry.startswith(head) and entry.endswith(_SUFFIX)):
            continue
        pid_text = entry[len(head):].split(".", 1)[0]
        if not pid_text.isdigit() or _alive(int(pid_text)):
            continue
        try:
            os.unlink(os.path.join(directory, entry))
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:                    # another user's live process
        return True
    return True


def _umask() -> int:
    """The process's umask, read without changing it where /proc says it (Linux 4.7+)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
