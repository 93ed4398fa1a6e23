"""Horovod's integer handles: what each issued collective waits on and how its output is made;
synchronize() and poll() as Horovod's, and the names in flight (a second collective with the
name of one still in flight is refused, as Horovod refuses it)."""

from __future__ import annotations

import datetime
import itertools
from typing import Any, Callable, Optional, Sequence

import torch

from ..comm import runtime
from .control import HorovodInternalError


class _Pending:
    """One issued collective: torch's works, and what turns their buffers into the output."""

    def __init__(self, works: list[Any], finish: Callable[[], Any], name: Optional[str],
                 cuda: bool) -> None:
        self.works, self.finish, self.name, self.cuda = works, finish, name, cuda

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> Any:
        timeout = datetime.timedelta(seconds=runtime.config().timeout)
        for work in self.works:
            if self.cuda:
                work.wait()                    # orders the current stream after it (NCCL)
            else:
                work.wait(timeout)
        return self.finish()


_handles: dict[int, _Pending] = {}
_in_flight: dict[str, int] = {}
_ids = itertools.count(1)


def claim_name(name: Optional[str]) -> None:
    if name is not None and name in _in_flight:
        raise ValueError(f"a collective named {name!r} is still in flight: synchronize() it "
                         "before reusing the name (Horovod refuses duplicate names too)")


def register(works: list[Any], finish: Callable[[], Any], name: Optional[str],
              tensors: Sequence[torch.Tensor]) -> int:
    handle = next(_ids)
    _handles[handle] = _Pending(works, finish, name, any(t.is_cuda for t in tensors))
    if name is not None:
        _in_flight[name] = handle
    return handle


def synchronize(handle: int) -> Any:
    """Wait for `handle` and return its output (a tuple for grouped calls and alltoall); None
    for a handle already synchronized, as Horovod."""
    pending = _handles.pop(handle, None)
    if pending is None:
        return None
    if pending.name is not None:
        _in_flight.pop(pending.name, None)
    try:
        return pending.wait()
    except HorovodInternalError:
        raise
    except RuntimeError as exc:
        raise HorovodInternalError(f"dear.horovod: collective failed: {exc}") from exc


def poll(handle: int) -> bool:
    """Whether `handle` has completed (synchronize() then returns without waiting)."""
    pending = _handles.get(handle)
    return True if pending is None else pending.done()


def forget_handles() -> None:
    _handles.clear()
    _in_flight.clear()
