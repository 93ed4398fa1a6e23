"""What the tracer records while an iteration runs: flat tuples appended to a list.

Recording must cost next to nothing inside the training loop, so hooks append small tuples
(`(code, iteration, t_ns, ...)`) and everything else (spans, names, Chrome events) is built once,
when the trace is written (`dear.diagnose.chrome`). Times are nanoseconds of the tracer's clock.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Optional

Clock = Callable[[], int]


class Ev(enum.IntEnum):
    """Kinds of raw event, each a tuple (kind, iteration, t_ns, *payload)."""

    FORWARD_START = 0   # payload: module index
    FORWARD_END = 1     # payload: module index
    BACKWARD_START = 2  # payload: module index (gradient w.r.t. its output arrived)
    GRAD_READY = 3      # payload: parameter index (after accumulation into .grad)
    STEP = 4            # payload: end_ns
    UPDATE = 5          # payload: end_ns, bucket index (dear's per-bucket update)
    WAIT = 6            # payload: end_ns, collective sequence number (training thread blocked)


class CollectiveKind(str, enum.Enum):
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"


class CollectiveRecord:
    """One collective: issued by the training thread, completed as seen by `end_source`:
    "watcher" (a helper thread waited on the transport), "callback" (a future's callback),
    "issue" (done when issued), or "wait" (only known when the training thread's wait() returned,
    an upper bound)."""

    __slots__ = ("seq", "kind", "nbytes", "bucket", "iteration", "issue_ns", "end_ns",
                 "end_source", "buffer_bytes")

    def __init__(self, seq: int, kind: CollectiveKind, nbytes: int, bucket: Optional[int],
                 iteration: int, issue_ns: int) -> None:
        self.seq = seq
        self.kind = kind
        self.nbytes = nbytes
        self.bucket = bucket
        self.iteration = iteration
        self.issue_ns = issue_ns
        self.end_ns: Optional[int] = None
        self.end_source = ""
        self.buffer_bytes: Optional[int] = None   # a compressed wire: its bucket's bytes

    def complete(self, t_ns: int, source: str) -> None:
        if self.end_ns is None or t_ns < self.end_ns:
            self.end_ns, self.end_source = t_ns, source


class Recorder:
    """Raw events of the traced iterations of one rank."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.events: list[tuple[Any, ...]] = []
        self.collectives: list[CollectiveRecord] = []
        self.iteration_starts: dict[int, int] = {}    # iteration -> start (previous step's end)
        self.iteration_ends: dict[int, int] = {}
        self._seq = 0

    def collective(self, kind: CollectiveKind, nbytes: int, bucket: Optional[int],
                   iteration: int) -> CollectiveRecord:
        self._seq += 1
        rec = CollectiveRecord(self._seq, kind, nbytes, bucket, iteration, self.clock())
        self.collectives.append(rec)
        return rec
