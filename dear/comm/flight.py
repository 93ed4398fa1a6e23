"""A small record of the collectives this rank issued, kept beside every communicator dear.init()
makes, so that a collective that fails can say which rank did not take part (dear/comm/hang.py).

PyTorch's Flight Recorder is the model: a ring of the last collectives (sequence number, kind,
size, the iteration and phase that issued it, whether it completed), cheap enough to be always
on. The sequence number is what lines the ranks up: every rank issues dear's collectives in the
same order, so collective #n is the same one everywhere, and a rank whose last issued number is
below the one that failed never issued it.

`RecordedCommunicator` wraps the backend and forwards every call unchanged (the same tensors,
the same Work underneath): a record is one tuple appended to a bounded deque per collective.
When a wait fails, `on_failure` (set by dear.init: the hang report) turns the error into one
that names the ranks; the first failure does that, later ones repeat its text at once.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Any, Callable, Optional

import torch

from .base import REFUSED_AT_ISSUE, Communicator, Work, WrappedCommunicator

#: collectives kept per rank: enough to see the last iteration of a model with many buckets
DEPTH = 64

# Where the training thread is (set by the optimizer's phases and dear's user collectives):
# [phase, iteration]. One list, so a reader never sees half of an update.
_where: list[Any] = ["setup", 0]


def mark(phase: str, iteration: int) -> None:
    """Label the collectives issued from now on (cheap: one list assignment)."""
    _where[:] = (phase, iteration)


def mark_phase(phase: str) -> None:
    """Label what follows with a phase, in the same iteration (dear.allreduce, ...)."""
    _where[0] = phase


class FlightRecord:
    """One collective as this rank issued it."""

    __slots__ = ("seq", "kind", "nbytes", "ptr", "phase", "iteration", "issued_at", "done")

    def __init__(self, seq: int, kind: str, tensor: Optional[torch.Tensor]) -> None:
        self.seq = seq
        self.kind = kind
        self.nbytes = 0 if tensor is None else tensor.numel() * tensor.element_size()
        self.ptr = 0 if tensor is None else tensor.data_ptr()
        self.phase, self.iteration = _where
        self.issued_at = time.monotonic()
        self.done = False

    def as_dict(self, describe: Callable[[int], Optional[str]]) -> dict[str, Any]:
        return {"seq": self.seq, "kind": self.kind, "bytes": self.nbytes,
                "phase": self.phase, "iteration": self.iteration, "done": self.done,
                "what": describe(self.ptr) if self.ptr else None}


class FlightRecorder:
    """The ring of recent collectives and the two counters a report compares across ranks."""

    def __init__(self, depth: int = DEPTH) -> None:
        self._records: collections.deque[FlightRecord] = collections.deque(maxlen=depth)
        self._seq = itertools.count(1)       # thread-safe under the GIL
        self.issued = 0                      # highest sequence number issued
        self.completed = 0                   # highest sequence number whose wait returned
        # Maps a tensor's address to what it is ("bucket 3 of optimizer 0"); set by whoever
        # owns the buffers (the optimizers), read only when a report is made.
        self.describers: list[Callable[[int], Optional[str]]] = []

    def restart(self) -> None:
        """Sequence numbers from 1 again (every rank of a new world restarts them together)."""
        self._records.clear()
        self._seq = itertools.count(1)
        self.issued = self.completed = 0

    def record(self, kind: str, tensor: Optional[torch.Tensor]) -> FlightRecord:
        rec = FlightRecord(next(self._seq), kind, tensor)
        self._records.append(rec)
        self.issued = max(self.issued, rec.seq)
        return rec

    def completed_one(self, rec: FlightRecord) -> None:
        rec.done = True
        self.completed = max(self.completed, rec.seq)

    def describe(self, ptr: int) -> Optional[str]:
        for describer in list(self.describers):
            try:
                what = describer(ptr)
            except Exception:                # noqa: BLE001 - a report must not fail on this
                what = None
            if what:
                return what
        return None

    def snapshot(self, last: int = DEPTH) -> dict[str, Any]:
        """What this rank publishes: its counters and its `last` collectives (only those are
        described: the bucket lookup runs in the publishing thread)."""
        records = list(self._records)[-last:]
        return {"issued": self.issued, "completed": self.completed,
                "phase": _where[0], "iteration": _where[1],
                "recent": [r.as_dict(self.describe) for r in records]}


class RecordedWork(Work):
    """The backend's Work; a failure of its wait goes through its channel's report."""

    __slots__ = ("backend_work", "_rec", "_owner")

    def __init__(self, work: Work, rec: FlightRecord, owner: "FlightChannel") -> None:
        self.backend_work = work               # the tracer watches this one (diagnose/comm.py)
        self._rec = rec
        self._owner = owner

    def wait(self) -> None:
        try:
            self.backend_work.wait()
        except Exception as exc:
            raise self._owner.failed(self._rec, exc) from exc
        self._owner.recorder.completed_one(self._rec)


FailureHandler = Callable[[FlightRecord, BaseException], str]


def _with_text(exc: BaseException, text: str) -> Exception:
    """`exc` with the report appended, of the same type where it can be built from a message
    (TimeoutError stays a TimeoutError), else a RuntimeError."""
    message = f"{exc}\n{text}" if text else str(exc)
    try:
        error = type(exc)(message)
    except Exception:                          # noqa: BLE001 - a constructor of its own
        return RuntimeError(message)
    return error if isinstance(error, Exception) else RuntimeError(message)


#: the channel of dear's own communicator (the optimizers, dear.allreduce, ...)
MAIN = "dear"


class FlightChannel:
    """One stream of collectives that every member issues in the same order: dear's
    communicator (MAIN), or a process group of dear.KFAC's own. Each has its own sequence
    numbers (collectives of two groups interleave differently on different ranks, so only
    within one stream does #n name the same collective everywhere). `members`: the global
    ranks taking part."""

    def __init__(self, name: str, members: list[int],
                 recorder: Optional[FlightRecorder] = None) -> None:
        self.name = name
        self.members = list(members)
        self.recorder = recorder or FlightRecorder()
        #: builds the text a failed collective raises with (dear/comm/hang.py)
        self.on_failure: Optional[FailureHandler] = None
        self._failure: Optional[str] = None
        self._lock = threading.Lock()

    def restart(self, members: list[int]) -> None:
        """A new world (Horovod Elastic): sequence numbers from 1 again, no failure yet."""
        with self._lock:
            self.members = list(members)
            self._failure = None
            self.recorder.restart()

    @property
    def has_failed(self) -> bool:
        """A collective of this channel failed (every later one is its consequence)."""
        return self._failure is not None

    def failed(self, rec: FlightRecord, exc: BaseException) -> Exception:
        """The error a failed collective raises: the backend's, and once per channel the report
        of who did not issue it (later failures are its consequences and repeat it)."""
        with self._lock:
            if self._failure is None:
                text = ""
                if self.on_failure is not None:
                    try:
                        text = self.on_failure(rec, exc)
                    except Exception as report_error:   # noqa: BLE001 - the fault comes first
                        text = f"(no report of the other ranks: {report_error!r})"
                self._failure = text
            text = self._failure
        return _with_text(exc, text)

    def recorded(self, kind: str, tensor: Optional[torch.Tensor],
                 issue: Callable[[], Work]) -> Work:
        """Issue a collective and record it. Recorded once issued: a call refused on this rank
        (bad arguments) issues nothing, and must not shift this rank's sequence numbers. A
        call the backend fails at issue (a peer already gone) is recorded and fails with the
        report, as a failed wait does."""
        try:
            issued = issue()
        except REFUSED_AT_ISSUE:
            raise
        except Exception as exc:
            raise self.failed(self.recorder.record(kind, tensor), exc) from exc
        return RecordedWork(issued, self.recorder.record(kind, tensor), self)

    def blocking(self, kind: str, call: Callable[[], Any]) -> Any:
        """A collective that returns when done (objects, barriers), recorded."""
        rec = self.recorder.record(kind, None)
        try:
            result = call()
        except REFUSED_AT_ISSUE:
            raise
        except Exception as exc:
            raise self.failed(rec, exc) from exc
        self.recorder.completed_one(rec)
        return result


class RecordedCommunicator(WrappedCommunicator):
    """`inner` with every collective recorded on the MAIN channel; nothing else changes."""

    def __init__(self, inner: Communicator, recorder: Optional[FlightRecorder] = None) -> None:
        super().__init__(inner)
        self.channel = FlightChannel(MAIN, list(range(inner.size)), recorder)
        self.issue_from_any_thread = inner.issue_from_any_thread
        self.stream_ordered = inner.stream_ordered

    @property
    def recorder(self) -> FlightRecorder:
        return self.channel.recorder

    @property
    def moved(self) -> bool:
        return self.channel.has_failed or self.inner.moved

    def rejoin(self) -> None:
        """The world changed (Horovod Elastic): the backend's collectives start over, and so
        do the record's sequence numbers and its failure, over the new ranks."""
        self.inner.rejoin()
        self.channel.restart(list(range(self.inner.size)))

    # -- the collectives, recorded -------------------------------------------------------
    def _recorded(self, kind: str, tensor: torch.Tensor, work: Callable[[], Work]) -> Work:
        return self.channel.recorded(kind, tensor, work)

    def _blocking(self, kind: str, call: Callable[[], Any]) -> Any:
        return self.channel.blocking(kind, call)

    def reduce_scatter(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        return self._recorded("reduce_scatter", input,
                              lambda: self.inner.reduce_scatter(input, output))

    def reduce_scatter_columns(self, input: torch.Tensor, output: torch.Tensor, start: int,
                               length: int) -> Work:
        return self._recorded("reduce_scatter", input, lambda: self.inner.reduce_scatter_columns(
            input, output, start, length))

    def pieces_in_place(self, tensor: torch.Tensor) -> bool:
        return self.inner.pieces_in_place(tensor)

    def all_gather(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        return self._recorded("all_gather", output,
                              lambda: self.inner.all_gather(input, output))

    def all_gather_columns(self, input: torch.Tensor, output: torch.Tensor, start: int,
                           length: int) -> Work:
        return self._recorded("all_gather", output, lambda: self.inner.all_gather_columns(
            input, output, start, length))

    def all_to_all(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        return self._recorded("all_to_all", input, lambda: self.inner.all_to_all(input, output))

    def all_reduce(self, tensor: torch.Tensor) -> Work:
        return self._recorded("all_reduce", tensor, lambda: self.inner.all_reduce(tensor))

    def broadcast(self, tensor: torch.Tensor, root: int) -> Work:
        return self._recorded("broadcast", tensor, lambda: self.inner.broadcast(tensor, root))

    def broadcast_object(self, obj: Any, root: int) -> Any:
        return self._blocking("broadcast_object",
                              lambda: self.inner.broadcast_object(obj, root))

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self._blocking("all_gather_object", lambda: self.inner.all_gather_object(obj))

    def barrier(self) -> None:
        self._blocking("barrier", self.inner.barrier)


def backend_of(comm: Communicator) -> Communicator:
    """The backend under dear's wrappers (the flight record, a tracer)."""
    while isinstance(getattr(comm, "__dict__", {}).get("inner"), Communicator):
        comm = comm.inner  # type: ignore[attr-defined]
    return comm
