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
    # per parameter, its keys as the first piece with elements has them (else the first piece)
    keys_of: dict[int, dict[str, tuple[Any, ...]]] = {}
    for rank, (pieces, _) in enumerate(rows):
        for index, (param, lo, hi, keys) in enumerate(pieces):
            if hi > lo:
                if param not in holders:
                    keys_of[param] = keys
                holders.setdefault(param, []).append(_Held(rank, index, lo, hi))
            else:
                keys_of.setdefault(param, keys)
    # (src, its piece, dst, its wanted index, lo, hi) in one order that every rank computes
    transfers: list[tuple[int, int, int, int, int, int]] = []
    for dst, (_, wants) in enumerate(rows):
        for w, (param, lo, hi) in enumerate(wants):
            found = holders.get(param, [])
            at = lo
            while at < hi and found:
                cover = [h for h in found if h.lo <= at < h.hi]
                if not cover:
                    raise StateLost(
                        f"dear: elements [{at}, ...) of trained parameter {param}'s optimizer "
                        "state are held by no rank")
                h = min(cover, key=lambda c: (c.rank != dst, c.rank, c.index))
                end = min(hi, h.hi)
                transfers.append((h.rank, h.index, dst, w, at, end))
                at = end
    target: list[Optional[Piece]] = []         # per wanted range (None: no state)
    for param, lo, hi in wanted:
        keys = keys_of.get(param)
        device = device_of(param)
        target.append(None if keys is None else Piece(param, lo, hi, {
            k: (torch.empty(hi - lo, dtype=getattr(torch, info[1]), device=device)
                if info[0] == "elementwise" else rebuild(info, device))
            for k, info in keys.items()}))
    dtypes = sorted({info[1] for keys in keys_of.values() for info in keys.values()
                     if info[0] == "elementwise"})
    for dtype_name in dtypes:
        _move(comm, held, target, transfers, keys_of, rows, dtype_name)
    return [p for p in target if p is not None]


def _move(comm: Communicator, held: Sequence[Piece], target: Sequence[Optional[Piece]],
          transfers: Sequence[tuple[int, int, int, int, int, int]],
          keys_of: dict[int, dict[str, tuple[Any, ...]]], rows: list[Any],
          dtype_name: str) -> None:
    """The elements of one dtype: each transfer's slice of each elementwise key of that dtype,
    in transfer order then key order, from its holder to its asker (on one rank: a copy)."""
    me, world = comm.rank, comm.size

    def keys(src: int, index: int) -> list[str]:
        param = rows[src][0][index][0]
        return sorted(k for k, info in keys_of[param].items()
                      if info[0] == "elementwise" and info[1] == dtype_name)

    sizes = [[0] * world for _ in range(world)]
    sends: list[list[torch.Tensor]] = [[] for _ in range(world)]
    receives: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for src, index, dst, w, lo, hi in transfers:
        names = keys(src, index)
        sizes[src][dst] += (hi - lo) * len(names)
        if src == me:
            piece = held[index]
            sends[dst] += [piece.state[k][lo - piece.lo:hi - piece.lo] for k in names]
        if dst == me:
            into = target[w]
            assert into is not None
            receives[src] += [into.state[k][lo - into.lo:hi - into.lo] for k in names]
    exchange(comm, sends, receives, sizes)


def exchange(comm: Communicator, sends: Sequence[Sequence[torch.Tensor]],
             receives: Sequence[Sequence[torch.Tensor]], sizes: Sequence[Sequence[int]]) -> None:
    """Every rank: the tensors `sends[d]`, one after another, go to rank d, where they land in
    its `receives[me]` (the same sizes in the same order). `sizes[s][d]`: how many elements
    rank s sends rank d (every rank knows them all). In all-to-alls of at most ROUND_BYTES per
    rank, or, on a backend without one, a broadcast from each rank in turn."""
    me, world = comm.rank, comm.size
    for part, into in zip(sends[me], receives[me]):
        into.copy_(part)
    others = [sizes[s][d] for s in range(world) for d in range(world) if s != d]
    biggest = max(others, default=0)
    if biggest == 0:
        return
    like = next(t for ts in (*sends, *receives) for t in ts)
    if comm.supports_all_to_all:
        block = max(1, min(biggest, ROUND_BYTES // (world * like.element_size())))
        out = torch.empty(world * block, dtype=like.dtype, device=like.device)
        into = torch.empty_like(out)
        for k in range(math.ceil(biggest / block)):
            for d in range(world):
                if d != me:
                    _copy_span(sends[d], k * block, out[d * block:(d + 1) * block], True)
            comm.all_to_all(out, into).wait()
            for s in range(world):
                if s != me:
                    _copy_span(receives[s], k * block, into[s * block:(s + 1) * block], False)
        return
    for root in range(world):
        total = sum(sizes[root][d] for d in range(world) if d != root)
        if total == 0:
            continue
        buf = (torch.cat([t.reshape(-1) for d in range(world) if d != root for t in sends[d]])
               if root == me else torch.empty(total, dtype=like.dtype, device=like.device))
        comm.broadcast(buf, root).wait()
        if root != me:
            at = sum(sizes[root][d] for d in range(me) if d != root)
            _copy_span(receives[root], 0, buf[at:at + sizes[root][me]], False)


def _copy_span(parts: Sequence[torch.Tensor], start: int, flat: torch.Tensor,
               outgoing: bool) -> None:
    """Between `flat` and elements [start, start + len(flat)) of `parts` laid end to end:
    into `flat` (`outgoing`) or out of it."""
    at, end = 0, start + flat.numel()
    for part in parts:
        n = part.numel()
        lo, hi = max(start, at), min(end, at + n)
        if hi > lo:
            a, b = flat[lo - start:hi - start], part[lo - at:hi - at]
            (a.copy_(b) if outgoing else b.copy_(a))
        at += n
        if at >= end:
            break


__all__ = ["Piece", "StateLost", "describe", "exchange", "interim", "rebuild", "redistribute"]
