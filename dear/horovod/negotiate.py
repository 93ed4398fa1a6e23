"""The agreement round every collective starts with: Horovod's coordinator, in one all-gather.

torch.distributed matches collectives by the order they are issued in; a rank that sends a
tensor of another shape, dtype or root gets a hang or wrong numbers. Horovod checks every
collective before running it, so its users get an error naming the difference, and it matches
named collectives by name, whatever order each rank issues them in. Here each rank first
all-gathers a fixed header (kind, op, dtype, device, root, shapes' digest, name's digest, scale
factors, how many named calls it holds back) on the set's Gloo control group:

1. calls that agree run now; if the ranks that have not joined disagree, a named call that
   another rank has deferred (or is calling now) runs first, matched by name (one more
   all-gather of the deferred headers, only while a rank holds some); failing that, a rank
   calling a named collective defers it (its handle returns; synchronize() takes part in
   rounds until the others call it) and the others call again; with nothing to defer, all of
   them exchange a one-line description of their calls and raise the same error naming the
   ranks, so no rank starts a data collective the others will not match and the group stays
   usable;
2. a rank inside hvd.join() takes part in the rounds as "joined": it mirrors the others'
   allreduces with zeros (Horovod's semantics) and ends when every rank has joined; any other
   collective while a rank has joined raises on the ranks that called it;
3. per-rank facts travel in the same round (`mine`: allgather's first dimension, an object's
   byte count) or, for lists (alltoall's splits, grouped allgather's dimensions), in one more
   all-gather of agreed length.

Cost: one small Gloo all-gather per collective (grouped calls: one per group), as Horovod's own
negotiation; a deferred call costs two more rounds when it is matched; a joined rank mirrors
only what the others agreed on.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
import zlib
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from .control import HorovodInternalError, all_gather_flat, allgather_bytes

if TYPE_CHECKING:
    from .basics import ProcessSet

_WIDTH = 16
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
           torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
_OP_NAMES = {0: "Average", 1: "Sum", 2: "Adasum", 3: "Min", 4: "Max", 5: "Product"}


class Kind(enum.IntEnum):
    ALLREDUCE = 1
    ALLGATHER = 2
    BROADCAST = 3
    ALLTOALL = 4
    REDUCESCATTER = 5
    BARRIER = 6
    JOIN = 7
    BROADCAST_OBJECT = 8
    ALLGATHER_OBJECT = 9
    PROCESS_SET = 10
    WAIT = 11                        # synchronize() of a deferred named collective


_BY_NAME = (Kind.ALLREDUCE, Kind.ALLGATHER, Kind.BROADCAST, Kind.ALLTOALL, Kind.REDUCESCATTER)


# Header slots. CHECKED must be equal on every rank that has not joined.
KIND, OP, DTYPE, DEVICE, ROOT, COUNT, NUMEL, SHAPES, NAME, PRE, POST, MINE, EXTRA, JOINED, \
    OFFERS, DEFER = range(_WIDTH)
CHECKED = (KIND, OP, DTYPE, DEVICE, ROOT, COUNT, NUMEL, SHAPES, NAME, PRE, POST, EXTRA)


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else 100 + zlib.crc32(str(dtype).encode())


def code_dtype(code: int) -> torch.dtype:
    return _DTYPES[code]


def _digest(value: Any) -> int:
    return (zlib.crc32(repr(value).encode()) or 1) if value is not None else 0


def _bits(x: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", float(x)))[0])


@dataclasses.dataclass
class Call:
    """What one rank asks for. `first_dim_free`: ranks may differ in dim 0 (allgather,
    alltoall); `mine` and `extra` are per-rank values every rank receives."""

    kind: Kind
    tensors: Sequence[torch.Tensor] = ()
    op: int = -1
    root: int = -1
    name: Optional[str] = None
    prescale: float = 1.0
    postscale: float = 1.0
    first_dim_free: bool = False
    mine: int = 0
    extra: Sequence[int] = ()
    shape_key: Any = None            # what else must agree (a process set's ranks)

    def header(self) -> list[int]:
        h = [0] * _WIDTH
        shapes = [(dtype_code(t.dtype), t.device.type,
                   tuple(t.shape[1:]) if self.first_dim_free else tuple(t.shape), t.dim())
                  for t in self.tensors]
        first = self.tensors[0] if self.tensors else None
        h[KIND], h[OP], h[ROOT], h[COUNT] = int(self.kind), self.op, self.root, len(self.tensors)
        h[DTYPE] = dtype_code(first.dtype) if first is not None else -1
        h[DEVICE] = -1 if first is None else (1 if first.is_cuda else 0)
        h[NUMEL] = first.numel() if first is not None and not self.first_dim_free else -1
        h[SHAPES] = _digest((shapes, self.shape_key))
        h[NAME] = _digest(self.name)
        h[PRE], h[POST] = _bits(self.prescale), _bits(self.postscale)
        h[MINE], h[EXTRA], h[JOINED] = self.mine, len(self.extra), -1
        return h

    def describe(self) -> str:
        parts = [self.kind.name.lower()]
        if self.name is not None:
            parts.append(f"name={self.name!r}")
        if self.op >= 0:
            parts.append(f"op={_OP_NAMES.get(self.op, self.op)}")
        if self.root >= 0:
            parts.append(f"root_rank={self.root}")
        if self.prescale != 1.0 or self.postscale != 1.0:
            parts.append(f"prescale={self.prescale}, postscale={self.postscale}")
        parts += [f"{str(t.dtype).removeprefix('torch.')}{tuple(t.shape)} on {t.device}"
                  for t in self.tensors]
        if self.shape_key is not None:
            parts.append(repr(self.shape_key))
        return parts[0] + "(" + ", ".join(parts[1:]) + ")"


@dataclasses.dataclass
class Agreed:
    """The round's outcome on a rank that called a collective."""

    mine: list[int]                  # each member's `mine`, in set-rank order
    extra: list[list[int]]           # each member's `extra` (empty when not exchanged)
    joined: list[int]                # set ranks inside hvd.join()


@dataclasses.dataclass(eq=False)
class Deferred:
    """A named collective whose ranks have not all called it yet: this rank's call, waiting to
    be matched by name in a later round; `issue` runs it once matched."""

    call: Call
    issue: Callable[[Agreed], None]
    header: list[int] = dataclasses.field(default_factory=list)
    issued: bool = False
    error: Optional[str] = None


def _exchange(ps: ProcessSet, header: list[int]) -> list[list[int]]:
    n = len(ps.ranks or ())
    table = torch.empty(n * _WIDTH, dtype=torch.int64)
    try:
        all_gather_flat(table, torch.tensor(header, dtype=torch.int64),
                                    group=ps.control)
    except RuntimeError as exc:
        raise HorovodInternalError(f"dear.horovod: the agreement round on {ps} failed ({exc}); "
                                   "a rank may have stopped or not called this collective "
                                   "(DEAR_TIMEOUT bounds the wait)") from exc
    ps.rounds += 1
    return table.view(n, _WIDTH).tolist()


def _offers(ps: ProcessSet, rows: list[list[int]], mine: Sequence[Deferred]
            ) -> list[list[list[int]]]:
    """Every member's deferred headers (one more all-gather, only when some member has any)."""
    most = max(row[OFFERS] for row in rows)
    if most == 0:
        return [[] for _ in rows]
    flat = torch.zeros(most * _WIDTH, dtype=torch.int64)
    for i, entry in enumerate(mine):
        flat[i * _WIDTH:(i + 1) * _WIDTH] = torch.tensor(entry.header, dtype=torch.int64)
    table = torch.empty(len(rows) * most * _WIDTH, dtype=torch.int64)
    all_gather_flat(table, flat, group=ps.control)
    listed = table.view(len(rows), most, _WIDTH).tolist()
    return [listed[r][:row[OFFERS]] for r, row in enumerate(rows)]


def _matchable(h: list[int]) -> bool:
    return h[KIND] in _BY_NAME and h[NAME] != 0


def _joined(rows: list[list[int]]) -> list[int]:
    """The members inside hvd.join() (set ranks)."""
    return [r for r, row in enumerate(rows) if row[KIND] == Kind.JOIN]


def _agree(rows: list[list[int]], active: list[int]) -> bool:
    ref = rows[active[0]]
    return ref[KIND] != Kind.WAIT and all(
        all(rows[r][c] == ref[c] for c in CHECKED) for r in active[1:])


def _decide(rows: list[list[int]], offers: list[list[list[int]]]) -> tuple[str, int]:
    """The round's verdict, the same on every member (every member sees the same tables):
    ("done" | "ok" | "joined" | "match" | "defer" | "mismatch", the matched name's digest).

    Calls that agree run now (the order rule, all that unnamed collectives have). Otherwise named
    collectives are matched by name, whatever order the ranks issued them in (Horovod's rule):
    the first name, in the lowest active rank's order, that every active rank has deferred or is
    calling now runs next; failing that, ranks calling a named collective defer it and the others
    call again; with nothing to defer, the ranks disagree."""
    joined = _joined(rows)
    active = [r for r in range(len(rows)) if r not in joined]
    if not active:
        return "done", 0
    if _agree(rows, active):
        if joined and rows[active[0]][KIND] not in (Kind.ALLREDUCE, Kind.BARRIER):
            return "joined", 0
        return "ok", 0
    entries = {r: offers[r] + ([rows[r]] if _matchable(rows[r]) else []) for r in active}
    for first in entries[active[0]]:
        found = [next((e for e in entries[r] if e[NAME] == first[NAME]), None) for r in active]
        if all(e is not None for e in found):
            if any(e[c] != first[c] for e in found if e is not None for c in CHECKED):
                return "mismatch", first[NAME]
            return "match", first[NAME]
    if any(rows[r][DEFER] for r in active):
        return "defer", 0
    return "mismatch", 0


def _needs_extra(ref: list[int], joined: bool) -> bool:
    kind = ref[KIND]
    if kind == Kind.ALLREDUCE:
        return joined and ref[EXTRA] > 0
    return ref[EXTRA] > 0 and not joined


def _describe_all(ps: ProcessSet, mine: str) -> list[str]:
    return [b.decode() for b in allgather_bytes(mine.encode(), ps.control)]


def _extra(ps: ProcessSet, values: Sequence[int], length: int) -> list[list[int]]:
    n = len(ps.ranks or ())
    mine = torch.zeros(length, dtype=torch.int64)
    if values:
        mine[:len(values)] = torch.tensor(list(values), dtype=torch.int64)
    table = torch.empty(n * length, dtype=torch.int64)
    all_gather_flat(table, mine, group=ps.control)
    return table.view(n, length).tolist()


def _round(ps: ProcessSet, call: Call, deferrable: bool, offer: bool = True,
           header: Optional[list[int]] = None) -> tuple[str, int, list[list[int]]]:
    header = list(header or call.header())
    header[OFFERS], header[DEFER] = len(ps.deferred) if offer else 0, int(deferrable)
    rows = _exchange(ps, header)
    status, name = _decide(rows, _offers(ps, rows, ps.deferred))
    return status, name, rows


def _run_matched(ps: ProcessSet, call: Call, header: list[int],
                 issue: Callable[[Agreed], None]) -> None:
    """The round that runs a call every active member holds under the same name (the header
    it was matched with: what it was called with, whatever its tensors became since)."""
    status, _, rows = _round(ps, call, False, offer=False, header=header)
    if status == "joined":
        raise _joined_error(ps, call, rows)
    if status != "ok":
        raise _disagree(ps, call)
    issue(_agreed(ps, call, rows))


def _agreed(ps: ProcessSet, call: Call, rows: list[list[int]]) -> Agreed:
    joined = _joined(rows)
    ref = rows[next(r for r in range(len(rows)) if r not in joined)]
    extra = _extra(ps, call.extra, ref[EXTRA]) if _needs_extra(ref, bool(joined)) else []
    return Agreed(mine=[row[MINE] for row in rows], extra=extra, joined=joined)


def _disagree(ps: ProcessSet, call: Call, what: Optional[str] = None) -> HorovodInternalError:
    """Every member's description of its call; the deferred calls are cancelled everywhere
    (every member raises), so the group stays usable."""
    mine = what or call.describe()
    if ps.deferred:
        mine += "; waiting by name: " + ", ".join(e.call.describe() for e in ps.deferred)
    lines = _describe_all(ps, mine)
    ranks = ps.ranks or []
    listing = "; ".join(f"rank {ranks[r]}: {line}" for r, line in enumerate(lines))
    error = HorovodInternalError(
        "dear.horovod: the ranks called different collectives (unnamed collectives are matched "
        "by the order each rank issues them in, named ones by name): " + listing)
    for entry in ps.deferred:
        entry.error = str(error)
    ps.deferred.clear()
    return error


def _run_match(ps: ProcessSet, name: int) -> None:
    """Run this rank's deferred call named `name` (all active members do, in one plain round)."""
    entry = next(e for e in ps.deferred if e.header[NAME] == name)
    ps.deferred.remove(entry)
    try:
        _run_matched(ps, entry.call, entry.header, entry.issue)
    except BaseException as exc:
        entry.error = f"dear.horovod: {entry.call.describe()} failed when it was matched: {exc}"
        raise
    entry.issued = True


def _joined_error(ps: ProcessSet, call: Call, rows: list[list[int]]) -> HorovodInternalError:
    joined = [(ps.ranks or [])[r] for r in _joined(rows)]
    return HorovodInternalError(
        f"dear.horovod: {call.kind.name.lower()} while rank(s) {joined} have called hvd.join(): "
        "only allreduce (and barrier) run once a rank has joined")


def submit(ps: ProcessSet, call: Call, issue: Callable[[Agreed], None],
           deferrable: bool = False) -> Optional[Deferred]:
    """Agree on `call` with the other members and `issue` it (None), or, for a named call that
    the others have not reached, keep it in `ps.deferred` to be matched by name later (returned:
    `wait_matched` waits for it).
    Raises HorovodInternalError (on every member that called a collective) when the ranks
    disagree or a rank has joined."""
    deferrable = deferrable and call.name is not None and call.kind in _BY_NAME
    header = call.header()
    while True:
        status, name, rows = _round(ps, call, deferrable, header=header)
        if status == "ok":
            issue(_agreed(ps, call, rows))
            return None
        if status == "match":
            if deferrable and header[NAME] == name:
                _run_matched(ps, call, header, issue)
                return None
            _run_match(ps, name)
        elif status == "defer":
            if deferrable:
                entry = Deferred(call, issue, header)
                ps.deferred.append(entry)
                return entry
        elif status == "joined":
            raise _joined_error(ps, call, rows)
        else:
            raise _disagree(ps, call)


def negotiate(ps: ProcessSet, call: Call) -> Agreed:
    """One agreement for a call that is not matched by name (barrier, objects, process sets)."""
    box: list[Agreed] = []
    submit(ps, call, box.append)
    return box[0]


def wait_matched(ps: ProcessSet, entry: Deferred) -> None:
    """Take part in rounds until `entry` (deferred on this rank) has been matched and issued:
    synchronize() of a named collective that other ranks have not called yet."""
    wait = Call(Kind.WAIT, name=entry.call.name)
    while not entry.issued:
        if entry.error is not None:
            raise HorovodInternalError(entry.error)
        status, name, rows = _round(ps, wait, False)
        if status == "match":
            _run_match(ps, name)
        elif status in ("mismatch", "ok"):        # "ok" cannot be: a WAIT never agrees
            raise _disagree(ps, wait, f"synchronize() of {entry.call.describe()}")
        elif status == "joined":
            raise _joined_error(ps, wait, rows)


def join_rounds(ps: ProcessSet, mirror: Any) -> int:
    """The joined side: take part in every round until all members have joined; `mirror(ref,
    extra)` repeats an agreed allreduce with zeros. Returns the global rank that joined last."""
    for entry in list(ps.deferred):        # what this rank still owes by name goes first
        wait_matched(ps, entry)
    header = Call(Kind.JOIN).header()
    header[JOINED] = ps.rounds
    while True:
        rows = _exchange(ps, header)
        status, _ = _decide(rows, _offers(ps, rows, ()))
        if status == "done":
            last = max(range(len(rows)), key=lambda r: (rows[r][JOINED], r))
            return (ps.ranks or [])[last]
        if status == "mismatch":
            _describe_all(ps, "join()")
            continue
        if status != "ok":
            continue
        joined = _joined(rows)
        first = next(r for r in range(len(rows)) if r not in joined)
        ref = rows[first]
        extra = _extra(ps, (), ref[EXTRA]) if _needs_extra(ref, True) else []
        if ref[KIND] == Kind.ALLREDUCE:
            mirror(ref, extra[first] if extra else [])
