"""The thread that issues backward's collectives in the planned schedule on CPU tensors, and
the process-wide state that keeps every optimizer's collectives in one order: the executor
(`CommExecutor`, one per process: `shared_executor`) and which drivers run a plan
(`mark_planned`, `planned_somewhere`). Why a thread: dear/fusion/schedule.py."""

from __future__ import annotations

import atexit
import collections
import contextlib
import threading
import weakref
from typing import Any, Callable, ContextManager, Optional

import torch

from ..comm import runtime
from ..comm.base import Work, collective_error

__all__ = ["CommExecutor", "FutureWork", "close_shared", "issue_pending", "mark_planned",
           "planned_somewhere", "register_driver", "scope", "shared_executor"]


def scope(name: str) -> ContextManager[Any]:
    """A profiler scope `name` (dear::<phase>), only while a profiler records (its cost
    otherwise). The engine's phases and the collective thread use it."""
    return (torch.autograd.profiler.record_function(name)
            if torch.autograd.profiler._is_profiler_enabled else contextlib.nullcontext())


# ------------------------------------------------------------------ the issuing thread
class FutureWork(Work):
    """A collective submitted to the executor: issued by its thread, waited for by anyone."""

    def __init__(self) -> None:
        self._issued = threading.Event()
        self._work: Optional[Work] = None
        self._error: Optional[BaseException] = None

    def resolve(self, work: Optional[Work], error: Optional[BaseException]) -> None:
        self._work, self._error = work, error
        self._issued.set()

    def wait(self) -> None:
        self._issued.wait()
        if self._error is not None:
            raise RuntimeError(f"dear: a collective could not be issued: {self._error}") \
                from self._error
        assert self._work is not None
        self._work.wait()


class CommExecutor:
    """Issues collectives from one thread, strictly in submission order. A task may first wait
    for its input (`before`, e.g. the reduce-scatter a chunk's shard comes from)."""

    def __init__(self) -> None:
        self._tasks: collections.deque[tuple[Callable[[], Work], Optional[Callable[[], None]],
                                             FutureWork]] = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def submit(self, issue: Callable[[], Work],
               before: Optional[Callable[[], None]] = None) -> FutureWork:
        future = FutureWork()
        with self._cond:
            if self._closed:
                raise RuntimeError("dear: the collective executor was closed (dear.shutdown())")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dear-collectives",
                                                daemon=True)
                self._thread.start()
            self._tasks.append((issue, before, future))
            self._cond.notify_all()
        return future

    def drain(self) -> None:
        """Return once every submitted collective is issued (not necessarily complete)."""
        with self._cond:
            while self._tasks or self._busy:
                self._cond.wait()
            error, self._error = self._error, None
        if error is not None:
            raise collective_error(f"dear: a collective failed in the executor: {error}",
                                   error) from error

    @property
    def idle(self) -> bool:
        with self._cond:
            return not self._tasks and not self._busy

    def close(self, timeout: float = 60.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._tasks and not self._closed:
                    self._cond.wait()
                if not self._tasks:
                    return
                issue, before, future = self._tasks.popleft()
                self._busy = True
            try:
                if self._error is not None:
                    raise self._error
                with scope("dear::collective_thread"):
                    if before is not None:
                        before()
                    work: Optional[Work] = issue()
                future.resolve(work, None)
            except BaseException as exc:    # a dead rank: every later task fails the same way
                self._error = self._error or exc
                future.resolve(None, exc)
            with self._cond:
                self._busy = False
                self._cond.notify_all()


# --------------------------------------------------------------- one per process
_shared: Optional[CommExecutor] = None
_shared_lock = threading.Lock()
_planners: set[int] = set()     # the drivers of this process running a plan: all go threaded
_drivers: "weakref.WeakSet[Any]" = weakref.WeakSet()   # every live driver of this process


def planned_somewhere() -> bool:
    return bool(_planners)


def mark_planned(driver: object, planned: bool = True) -> None:
    """A plan runs in this process (or, `planned` False, `driver`'s stopped): while any runs,
    every optimizer's backward collectives go through the shared executor, so they keep one
    order. Every rank starts and stops plans at the same step (rank 0 decides, broadcast),
    after the executor was drained."""
    if planned:
        _planners.add(id(driver))
    else:
        _planners.discard(id(driver))


def shared_executor() -> CommExecutor:
    """One executor per process: every optimizer's backward collectives go through the same
    FIFO, so two optimizers on one model keep one order (each rank submits in the same order;
    two threads issuing at once would not)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = CommExecutor()
            # Never leave its thread inside a collective while the interpreter (and Gloo's or
            # MPI's teardown) finalizes, e.g. in a script that does not call dear.shutdown().
            atexit.register(_shared.close, 5.0)
        return _shared


def register_driver(driver: Any) -> None:
    """A schedule driver of this process (one per optimizer), for `issue_pending`."""
    _drivers.add(driver)


def issue_pending() -> None:
    """Before a collective issued from the training thread inside dear (the stream check,
    buffers, sparse gradients, dear.join): every optimizer's backward collectives are issued
    (drained here, or on a GPU ordered before the stream's next work), so this one keeps its
    place in the order on every rank (as runtime.flush_all does for the user's collectives)."""
    for driver in list(_drivers):
        driver.drain()


def close_shared() -> None:
    """dear.shutdown(): stop the executor's thread (a later dear.init() starts a new one)."""
    global _shared
    with _shared_lock:
        executor, _shared = _shared, None
        _planners.clear()
    if executor is not None:
        executor.drain()
        executor.close()


runtime.at_shutdown(close_shared)
