"""Sharded optimizer state moved from one cut of the parameters to another without being put
together whole on any rank.

A `Piece` is the state of elements [lo, hi) of one flattened parameter (the parameter by its
index among the engine's trained parameters, the same on every rank). `redistribute` takes the
pieces each rank holds (any cut, overlapping copies allowed) and gives each rank the pieces it
asks for: every rank learns who holds what (one small all-gather of descriptions), every rank
works out the same transfers (each wanted element from one holder: the asking rank itself if it
has it, else the lowest rank that does), and the values travel in all-to-alls of bounded size.
A rank receives only what it asked for, so the most any rank holds at once is what it had plus
what it wanted.

Used where the world changes under sharded state (Horovod Elastic, dear/sharding/commit.py): the
last commit's pieces held by the survivors go to an `interim` cut of the new world (each rank
1/N of every parameter), and from there to the shards of the new layout when the first step
at the new size lays the buckets out (ShardedState.layout). A resumed checkpoint (torchrun's
elastic agent) is read straight into the interim cut.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import torch

from ..comm.base import Communicator

#: the most bytes one round of the exchange sends from a rank (all destinations together)
ROUND_BYTES = 32 << 20


@dataclasses.dataclass
class Piece:
    """The optimizer state of elements [lo, hi) of parameter `param` (flattened): elementwise
    entries as 1-D tensors of hi - lo elements, scalars (step counts) as they are."""
    param: int
    lo: int
    hi: int
    state: dict[str, Any]

    @property
    def numel(self) -> int:
        return self.hi - self.lo


class StateLost(RuntimeError):
    """Some element of the state is held by no rank (its holders left)."""


def interim(numel: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank`'s elements of a parameter of `numel` elements in the interim cut."""
    return rank * numel // world, (rank + 1) * numel // world


def describe(value: Any) -> tuple[Any, ...]:
    """How one state entry crosses ranks: elementwise (moved by the exchange) or a scalar
    (carried in the description)."""
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return ("elementwise", str(value.dtype).removeprefix("torch."))
    if isinstance(value, torch.Tensor):
        return ("tensor", value.detach().cpu().clone(), value.device.type != "cpu")
    return ("value", value)


def rebuild(info: Sequence[Any], device: torch.device) -> Any:
    """A scalar entry from describe()'s description, on `device` if it was off the CPU."""
    if info[0] == "tensor":
        return info[1].to(device) if info[2] else info[1]
    return info[1]


@dataclasses.dataclass
class _Held:
    rank: int
    index: int                  # in that rank's list of pieces
    lo: int
    hi: int


def redistribute(comm: Communicator, held: Sequence[Piece],
                 wanted: Sequence[tuple[int, int, int]],
                 device_of: Callable[[int], torch.device]) -> list[Piece]:
    """Every rank, at the same point: the pieces `wanted` ((param, lo, hi) each) filled from
    whatever pieces the ranks hold. A wanted parameter no rank holds any state of comes back
    absent (it has none yet); one whose state some element lacks raises StateLost on every
    rank. An empty wanted range comes back with the keys and scalars and no elements."""
    rows = comm.all_gather_object(
        ([(p.param, p.lo, p.hi, {k: describe(v) for k, v in p.state.items()}) for p in held],
         [tuple(w) for w in wanted]))
    holders: dict[int, list[_Held]] = {}
    for rank, (pieces, _) in enumerate(rows):
        for index, (param, lo, hi, _) in enumerate(pieces):
            if hi > lo:
                holders.setdefault(param, []).append(_Held(rank, index, lo, hi))
    # (src, its piece, dst, its wanted index, lo, hi) in one order that every rank computes
    transfers: list[tuple[int, int, int, int, int, int]] = []
    keys_of: dict[int, dict[str, tuple[Any, ...]]] = {}
    for dst, (_, wants) in enumerate(rows):
        for w, (param, lo, hi) in enumerate(wants):
            found = holders.get(param)
            if not found:
                any_row = next(((r, i) for r, (pieces, _) in enumerate(rows)
                                for i, piece in enumerate(pieces) if piece[0] == param), None)
                if any_row is not None:
                    keys_of.setdefault(param, rows[any_row[0]][0][any_row[1]][3])
                continue
            first = found[0]
            keys_of.setdefault(param, rows[first.rank][0][first.index][3])
            at = lo
            while at < hi:
                cover = [h for h in found if h.lo <= at < h.hi]
                if not cover:
                    raise StateLost(
                        f"dear: elements [{at}, ...) of trained parameter {param}'s optimizer "
                        "state are held by no rank")
                h = min(cover, key=lambda c: (c.rank != dst, c.rank, c.index))
                end = min(hi, h.hi)
                transfers.append((h.rank, h.index, dst, w, at, end))
                at = end
    out = []
    for param, lo, hi in wanted:
        keys = keys_of.get(param)
        if keys is None:
            continue
        device = device_of(param)
        state: dict[str, Any] = {}
        for k, info in keys.items():
            state[k] = (torch.empty(hi - lo, dtype=getattr(torch, info[1]), device=device)
                        if info[0] == "elementwise" else rebuild(info, device))
        out.append(Piece(param, lo, hi, state))
    placed = {(p.param, p.lo, p.hi): p for p in out}
    target = [placed.get((param, lo, hi)) for param, lo, hi in wanted]
    dtypes = sorted({info[1] for keys in keys_of.values() for info in keys.values()
                     if info[0] == "elementwise"})
    for dtype_name in dtypes:
        _move(comm, held, target, transfers, keys_of, rows, dtype_name)
    return out


def _move(comm: Communicator, held: Sequence[Piece], target: Sequence[Optional[Piece]],
          transfers: Sequence[tuple[int, int, int, int, int, int]],
          keys_of: dict[int, dict[str, tuple[Any, ...]]], rows: list[Any],
          dtype_name: str) -> None:
    """The elements of one dtype: each transfer's slice of each elementwise key of that dtype,
    in transfer order then key order, sent from its holder to its asker."""
    me, world = comm.rank, comm.size
    dtype = getattr(torch, dtype_name)

    def keys(src: int, index: int) -> list[str]:
        param = rows[src][0][index][0]
        return sorted(k for k, info in keys_of[param].items()
                      if info[0] == "elementwise" and info[1] == dtype_name)

    sizes = [[0] * world for _ in range(world)]
    for src, index, dst, _, lo, hi in transfers:
        sizes[src][dst] += (hi - lo) * len(keys(src, index))
    device = next((v.device for p in held for v in p.state.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0), None)
    device = device or next((v.device for p in target if p is not None
                             for v in p.state.values() if isinstance(v, torch.Tensor)),
                            torch.device("cpu"))
    sends = []
    for dst in range(world):
        parts = [held[index].state[k][lo - held[index].lo:hi - held[index].lo]
                 for src, index, d, _, lo, hi in transfers if src == me and d == dst
                 for k in keys(src, index)]
        sends.append(torch.cat(parts).to(device) if parts
                     else torch.empty(0, dtype=dtype, device=device))
    received = exchange(comm, sends, sizes)
    offsets = [0] * world
    for src, index, dst, w, lo, hi in transfers:
        if dst != me:
            continue
        piece = target[w]
        assert piece is not None
        for k in keys(src, index):
            n = hi - lo
            piece.state[k][lo - piece.lo:hi - piece.lo].copy_(
                received[src][offsets[src]:offsets[src] + n])
            offsets[src] += n


def exchange(comm: Communicator, sends: Sequence[torch.Tensor],
             sizes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Every rank: `sends[d]` goes to rank d; returns what each rank sent here. `sizes[s][d]`:
    how many elements rank s sends rank d (every rank knows them all). In all-to-alls of at
    most ROUND_BYTES per rank, or, on a backend without one, a broadcast from each rank."""
    me, world = comm.rank, comm.size
    like = sends[me]
    received = [torch.empty(sizes[s][me], dtype=like.dtype, device=like.device)
                for s in range(world)]
    received[me].copy_(sends[me])
    others = [sizes[s][d] for s in range(world) for d in range(world) if s != d]
    biggest = max(others, default=0)
    if biggest == 0:
        return received
    if comm.supports_all_to_all:
        block = max(1, min(biggest, ROUND_BYTES // (world * like.element_size())))
        for k in range(math.ceil(biggest / block)):
            lo = k * block
            out = torch.zeros(world * block, dtype=like.dtype, device=like.device)
            for d in range(world):
                part = sends[d][lo:lo + block]
                if d != me and part.numel():
                    out[d * block:d * block + part.numel()].copy_(part)
            into = torch.empty_like(out)
            comm.all_to_all(out, into).wait()
            for s in range(world):
                n = max(0, min(block, sizes[s][me] - lo))
                if s != me and n:
                    received[s][lo:lo + n].copy_(into[s * block:s * block + n])
        return received
    for root in range(world):
        total = sum(sizes[root][d] for d in range(world) if d != root)
        if total == 0:
            continue
        buf = (torch.cat([sends[d] for d in range(world) if d != root]) if root == me
               else torch.empty(total, dtype=like.dtype, device=like.device))
        comm.broadcast(buf, root).wait()
        if root != me:
            at = sum(sizes[root][d] for d in range(me) if d != root)
            received[root].copy_(buf[at:at + sizes[root][me]])
    return received


__all__ = ["Piece", "StateLost", "describe", "exchange", "interim", "rebuild", "redistribute"]
