"""A commit of sharded optimizer state that outlives a lost rank, kept in memory (Horovod
Elastic keeps the processes): each rank keeps its own pieces and a copy of one other rank's,
its `buddy`'s, on another host where there is one (a host is what fails), so the state of any
rank whose buddy survives can be put together again, in a new cut, without ever being whole on
one rank (dear/sharding/reshard.py). Each rank holds 2/N of the state (all of it at N = 2:
surviving the loss of the other rank in memory needs it).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Sequence

from ..comm.base import Communicator, recoverable_errors
from .reshard import Piece, StateLost, redistribute

log = logging.getLogger("dear")


@dataclasses.dataclass
class ShardCommit:
    """What one rank holds of one commit: pieces by the rank (of the committing world) whose
    they are. `tag` names the commit the same on every rank: (world generation, number)."""
    world: int
    tag: tuple[int, int]
    held: dict[int, list[Piece]]


def buddies(hosts: Sequence[str]) -> list[int]:
    """Per rank, the rank that keeps a copy of its pieces: the rank with the same place on the
    next host (cyclically, modulo that host's ranks); with one host, the next rank."""
    names = list(dict.fromkeys(hosts))
    ranks = {h: [r for r, x in enumerate(hosts) if x == h] for h in names}
    if len(names) == 1:
        return [(r + 1) % len(hosts) for r in range(len(hosts))]
    out = []
    for r, h in enumerate(hosts):
        nxt = ranks[names[(names.index(h) + 1) % len(names)]]
        out.append(nxt[ranks[h].index(r) % len(nxt)])
    return out


def make(comm: Communicator, own: list[Piece], hosts: Sequence[str],
         tag: tuple[int, int], device_of: Any) -> ShardCommit:
    """Every rank, at the same point: this rank's pieces, and copies of the pieces of the ranks
    whose buddy it is. A failed copy (a rank died during the commit) leaves the commit with
    this rank's own pieces only; whether the lost rank's can be found is decided at resume."""
    world, rank = comm.size, comm.rank
    held = {rank: own}
    if world == 1:
        return ShardCommit(world, tag, held)
    buddy = buddies(hosts)
    try:
        ranges = comm.all_gather_object([(p.param, p.lo, p.hi) for p in own])
        backed = [r for r in range(world) if buddy[r] == rank and r != rank]
        wanted = [tuple(x) for r in backed for x in ranges[r]]
        copies = redistribute(comm, own, wanted, device_of)
    except recoverable_errors() as exc:
        log.warning("dear: rank %d: the copy of sharded optimizer state at this commit failed "
                    "(%s); resuming needs the lost rank's pieces from its buddy", rank, exc)
        return ShardCommit(world, tag, held)
    by_range = {(p.param, p.lo, p.hi): p for p in copies}
    for r in backed:
        held[r] = [by_range[(param, lo, hi)] for param, lo, hi in ranges[r]
                   if (param, lo, hi) in by_range]
    return ShardCommit(world, tag, held)


def agree(comm: Communicator, commit: Optional[ShardCommit], generation: int
          ) -> tuple[int, Optional[list[Piece]]]:
    """Every rank of a new world, at the same point: the new world's generation, and the pieces
    of the last commit this rank holds, if the ranks together hold every old rank's (None: no
    rank holds a sharded commit). Raises StateLost, naming the ranks, on every rank alike when
    some old rank's pieces left with it and its buddy."""
    rows = comm.all_gather_object(
        (generation, None if commit is None else (commit.world, commit.tag, sorted(commit.held))))
    new_generation = max(g for g, _ in rows) + 1
    present = [row for _, row in rows if row is not None]
    if not present:
        return new_generation, None
    if len({(w, tuple(t)) for w, t, _ in present}) > 1:
        seen = "; ".join(f"rank {r}: {row[1] if row else 'none'}" for r, row in enumerate(
            row for _, row in rows))
        raise StateLost(
            "dear: the ranks hold different commits of the sharded optimizer state "
            f"({seen}): a rank failed in a step that another completed and committed. Resume "
            "from a checkpoint")
    world = present[0][0]
    covered = {r for _, _, ranks in present for r in ranks}
    lost = sorted(set(range(world)) - covered)
    if lost:
        raise StateLost(
            f"dear: the sharded optimizer state of rank(s) {lost} of the {world}-rank world "
            "at the last commit left with them: each rank's pieces are copied to one other "
            "rank (on another host where there is one) at each commit, and that rank left too "
            "(or the rank died during the commit, before its copy was made). Resume from a "
            "checkpoint; a job that must survive such losses can commit to disk with "
            "dear.elastic under torchrun, or wrap without shard_optimizer_state")
    held = [] if commit is None else [p for r in sorted(commit.held) for p in commit.held[r]]
    return new_generation, held


__all__ = ["ShardCommit", "agree", "buddies", "make"]
