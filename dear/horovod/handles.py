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
    """One collective: torch's works, and what turns their buffers into the output. A named
    collective the other ranks have not called yet has no works until it is matched;
    `until_issued` takes part in agreement rounds until then."""

    def __init__(self, name: Optional[str], cuda: bool) -> None:
        self.name, self.cuda = name, cuda
        self.works: Optional[list[Any]] = None
        self.finish: Callable[[], Any] = lambda: None
        self.until_issued: Callable[[], None] = lambda: None
        self.released: Callable[[], bool] = lambda: False

    def issued(self) -> list[Any]:
        if self.works is None:
            self.until_issued()
        assert self.works is not None
        return self.works

    def done(self) -> bool:
        return all(w.is_completed() for w in self.issued())

    def wait(self) -> Any:
        works = self.issued()
        timeout = datetime.timedelta(seconds=runtime.config().timeout)
        for work in works:
            if self.cuda:
                work.wait()                    # orders the current stream after it (NCCL)
            else:
                work.wait(timeout)
        return self.finish()


_handles: dict[int, _Pending] = {}
_in_flight: dict[str, int] = {}
_ids = itertools.count(1)


def claim_name(name: Optional[str]) -> None:
    """Refuse `name` while a collective of that name waits for the other ranks or has been
    issued with no agreement round since (Horovod refuses it until its background thread has
    started the first one: here that is deterministic)."""
    pending = _handles.get(_in_flight.get(name, 0)) if name is not None else None
    if pending is not None and not pending.released():
        raise ValueError(f"a collective named {name!r} is still in flight: synchronize() it "
                         "before reusing the name (Horovod refuses duplicate names too)")


def reserve(name: Optional[str], tensors: Sequence[torch.Tensor]) -> int:
    """A handle for a collective about to be agreed on; its name counts as in flight."""
    claim_name(name)
    handle = next(_ids)
    _handles[handle] = _Pending(name, any(t.is_cuda for t in tensors))
    if name is not None:
        _in_flight[name] = handle
    return handle


def filler(handle: int) -> Callable[[list[Any], Callable[[], Any], Callable[[], bool]], None]:
    """What records that the collective behind `handle` is issued (torch's works, how to finish
    it, and when its name is free again before synchronize()); it may run while synchronize()
    of that handle waits for the other ranks."""
    pending = _handles[handle]

    def fill(works: list[Any], finish: Callable[[], Any], released: Callable[[], bool]) -> None:
        pending.works, pending.finish, pending.released = works, finish, released
    return fill


def wait_with(handle: int, until_issued: Callable[[], None]) -> None:
    """`handle` was deferred: synchronize() and poll() run `until_issued` first."""
    _handles[handle].until_issued = until_issued


def discard(handle: int) -> None:
    """Forget a handle whose agreement failed (its name is free again)."""
    pending = _handles.pop(handle, None)
    if pending is not None:
        _free(pending.name, handle)


def _free(name: Optional[str], handle: int) -> None:
    if name is not None and _in_flight.get(name) == handle:
        del _in_flight[name]


def synchronize(handle: int) -> Any:
    """Wait for `handle` and return its output (a tuple for grouped calls and alltoall); None
    for a handle already synchronized, as Horovod."""
    pending = _handles.pop(handle, None)
    if pending is None:
        return None
    _free(pending.name, handle)
    try:
        return pending.wait()
    except HorovodInternalError:
        raise
    except RuntimeError as exc:
        raise HorovodInternalError(f"dear.horovod: collective failed: {exc}") from exc


def poll(handle: int) -> bool:
    """Whether `handle` has completed (synchronize() then returns without waiting). A named
    collective deferred until the other ranks call it first waits for that (agreement rounds
    block, as every collective's do)."""
    pending = _handles.get(handle)
    return True if pending is None else pending.done()


def forget_handles() -> None:
    _handles.clear()
    _in_flight.clear()
