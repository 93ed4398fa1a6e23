"""The agreement round every collective starts with: Horovod's coordinator, in one all-gather.

torch.distributed matches collectives by the order they are issued in; a rank that sends a
tensor of another shape, dtype or root gets a hang or wrong numbers. Horovod checks every
collective before running it, so its users get an error naming the difference. Here each rank
first all-gathers a fixed header (kind, op, dtype, device, root, shapes' digest, name's digest,
scale factors) on the set's Gloo control group:

1. every rank compares the headers: if the ranks that have not joined disagree, all of them
   exchange a one-line description of their call and raise the same error naming the ranks, so
   no rank starts a data collective the others will not match and the group stays usable;
2. a rank inside hvd.join() takes part in the rounds as "joined": it mirrors the others'
   allreduces with zeros (Horovod's semantics) and ends when every rank has joined; any other
   collective while a rank has joined raises on the ranks that called it;
3. per-rank facts travel in the same round (`mine`: allgather's first dimension, an object's
   byte count) or, for lists (alltoall's splits, grouped allgather's dimensions), in one more
   all-gather of agreed length.

Cost: one small Gloo all-gather per collective (grouped calls: one per group), as Horovod's own
negotiation; a joined rank mirrors only what the others agreed on.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
import zlib
from typing import TYPE_CHECKING, Any, Optional, Sequence

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


# Header slots. CHECKED must be equal on every rank that has not joined.
KIND, OP, DTYPE, DEVICE, ROOT, COUNT, NUMEL, SHAPES, NAME, PRE, POST, MINE, EXTRA, JOINED = \
    range(14)
CHECKED = (KIND, OP, DTYPE, DEVICE, ROOT, COUNT, NUMEL, SHAPES, NAME, PRE, POST, EXTRA)


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else 100 + zlib.crc32(str(dtype).encode())


def code_dtype(code: int) -> torch.dtype:
    return _DTYPES[code]


def _digest(value: Any) -> int:
    return zlib.crc32(repr(value).encode()) if value is not None else 0


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


def _exchange(ps: ProcessSet, header: list[int]) -> torch.Tensor:
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
    return table.view(n, _WIDTH)


def _needs_extra(ref: torch.Tensor, joined: bool) -> bool:
    kind = int(ref[KIND])
    if kind == Kind.ALLREDUCE:
        return joined and int(ref[EXTRA]) > 0
    return int(ref[EXTRA]) > 0 and not joined


def _outcome(table: torch.Tensor) -> tuple[str, Optional[torch.Tensor], list[int]]:
    """("done" | "mismatch" | "joined" | "ok", the reference header, joined set ranks): the
    same on every member, since every member sees the same table."""
    joined = [r for r in range(table.shape[0]) if int(table[r, KIND]) == Kind.JOIN]
    active = [r for r in range(table.shape[0]) if r not in joined]
    if not active:
        return "done", None, joined
    ref = table[active[0]]
    checked = list(CHECKED)
    if any(not torch.equal(table[r, checked], ref[checked]) for r in active[1:]):
        return "mismatch", ref, joined
    if joined and int(ref[KIND]) not in (Kind.ALLREDUCE, Kind.BARRIER):
        return "joined", ref, joined
    return "ok", ref, joined


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


def negotiate(ps: ProcessSet, call: Call) -> Agreed:
    """One agreement round for `call` on `ps`; raises HorovodInternalError (on every rank that
    called a collective) when the ranks disagree or a rank has joined."""
    table = _exchange(ps, call.header())
    status, ref, joined = _outcome(table)
    assert ref is not None
    if status == "mismatch":
        lines = _describe_all(ps, call.describe())
        ranks = ps.ranks or []
        listing = "; ".join(f"rank {ranks[r]}: {line}" for r, line in enumerate(lines))
        raise HorovodInternalError(
            "dear.horovod: the ranks called different collectives at the same point "
            "(collectives are matched by the order each rank issues them in, not by name): "
            + listing)
    if status == "joined":
        raise HorovodInternalError(
            f"dear.horovod: {call.kind.name.lower()} while rank(s) "
            f"{[(ps.ranks or [])[r] for r in joined]} have called hvd.join(): only allreduce "
            "(and barrier) run once a rank has joined")
    extra: list[list[int]] = []
    if _needs_extra(ref, bool(joined)):
        extra = _extra(ps, call.extra, int(ref[EXTRA]))
    return Agreed(mine=table[:, MINE].tolist(), extra=extra, joined=joined)


def join_rounds(ps: ProcessSet, mirror: Any) -> int:
    """The joined side: take part in every round until all members have joined; `mirror(ref,
    extra)` repeats an agreed allreduce with zeros. Returns the global rank that joined last."""
    header = Call(Kind.JOIN).header()
    header[JOINED] = ps.rounds
    while True:
        table = _exchange(ps, header)
        status, ref, joined = _outcome(table)
        if status == "done":
            last = max(range(table.shape[0]), key=lambda r: (int(table[r, JOINED]), r))
            return (ps.ranks or [])[last]
        assert ref is not None
        if status == "mismatch":
            _describe_all(ps, "join()")
            continue
        if status == "joined":
            continue
        extra = _extra(ps, (), int(ref[EXTRA])) if _needs_extra(ref, True) else []
        if int(ref[KIND]) == Kind.ALLREDUCE:
            first = next(r for r in range(table.shape[0]) if r not in joined)
            mirror(ref, extra[first] if extra else [])
