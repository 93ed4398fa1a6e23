"""Put every rank's trace on rank 0's clock.

Each rank's clock (a monotonic counter) has its own origin on another machine. With
torch.distributed on Gloo, rank 0 plays ping-pong with each rank (NTP's method): it sends its time
t0, the peer stamps arrival t1 and reply t2, rank 0 stamps t3; the peer's clock is ahead by
((t1 - t0) + (t2 - t3)) / 2, with an error of at most half the round trip minus the peer's turn
around, and the round with the shortest round trip of a few is kept. Elsewhere (NCCL, Horovod)
every rank leaves a barrier, reads its clock and all-gathers it: the error is the barrier's exit
skew, about one message latency. Rank 0 then shares a reading of its clock: the trace's time zero.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any, Callable, Optional

import torch

from .recorder import Clock

ROUNDS = 8
_TAG = (1 << 22) + 11                 # apart from dear's own point-to-point tags (< 2**20)


class Group:
    """A barrier and an all-gather of one integer over whatever launched the ranks; `p2p`:
    torch.distributed point-to-point on the default group works (Gloo)."""

    def __init__(self, rank: int, size: int, barrier: Callable[[], None],
                 gather: Callable[[int], list[int]], p2p: bool = False) -> None:
        self.rank, self.size, self.barrier, self.gather, self.p2p = rank, size, barrier, gather, p2p


def current_group(comm: Optional[Any] = None) -> Group:
    """torch.distributed's default group if it is up, else dear's communicator, else Horovod,
    else a world of one."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        def gather(value: int) -> list[int]:
            out: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(out, value)
            return out
        from ..comm.torch_dist import carries_cpu_on_gloo
        gloo = carries_cpu_on_gloo(str(dist.get_backend()))   # CPU point to point
        return Group(dist.get_rank(), dist.get_world_size(), dist.barrier, gather, p2p=gloo)
    if comm is not None:
        return Group(comm.rank, comm.size, comm.barrier, comm.all_gather_object)
    hvd = sys.modules.get("horovod.torch")
    if hvd is not None and getattr(hvd, "is_initialized", lambda: False)():
        return Group(hvd.rank(), hvd.size(), hvd.barrier,
                     lambda value: list(hvd.allgather_object(value, name="dear.trace.clock")))
    return Group(0, 1, lambda: None, lambda value: [value])


def clock_offset(group: Group, clock: Clock, rounds: int = ROUNDS
                 ) -> tuple[int, int, Optional[int]]:
    """(offset, origin, error): nanoseconds to add to this rank's clock to read rank 0's (0 on
    rank 0), a reading of rank 0's clock that every rank shares (the trace's time zero), and a
    bound on the offset's error where the method gives one (point to point: half the best
    round trip; None after barriers). Collective."""
    if group.size == 1:
        return 0, clock(), 0
    offset, error = (_ping_pong(group, clock, rounds) if group.p2p
                     else (_barrier_offset(group, clock, rounds), None))
    group.barrier()
    origin = int(group.gather(clock())[0])
    return offset, origin, error


def _barrier_offset(group: Group, clock: Clock, rounds: int) -> int:
    offsets = []
    for _ in range(rounds):
        group.barrier()
        mine = clock()
        offsets.append(int(group.gather(mine)[0]) - mine)
    return int(statistics.median(offsets))


def _ping_pong(group: Group, clock: Clock, rounds: int) -> tuple[int, int]:
    """NTP's estimate from the round with the shortest round trip: the peer's offset is off by
    at most half that round trip (each one-way delay is at least zero)."""
    import torch.distributed as dist
    buf = torch.zeros(2, dtype=torch.int64)
    offsets = torch.zeros(2, group.size, dtype=torch.int64)    # offset, error bound
    if group.rank == 0:
        for peer in range(1, group.size):
            best: Optional[tuple[int, int]] = None
            for _ in range(rounds):
                t0 = clock()
                dist.send(torch.tensor([t0, 0]), peer, tag=_TAG)
                dist.recv(buf, peer, tag=_TAG)
                t3 = clock()
                t1, t2 = (int(v) for v in buf)
                rtt = (t3 - t0) - (t2 - t1)
                ahead = ((t1 - t0) + (t2 - t3)) // 2          # peer's clock minus ours
                if best is None or rtt < best[0]:
                    best = (rtt, ahead)
            assert best is not None
            offsets[0, peer], offsets[1, peer] = -best[1], (best[0] + 1) // 2 + 1
    else:
        for _ in range(rounds):
            dist.recv(buf, 0, tag=_TAG)
            t1 = clock()
            dist.send(torch.tensor([t1, clock()]), 0, tag=_TAG)
    dist.broadcast(offsets, 0)
    return int(offsets[0, group.rank]), int(offsets[1, group.rank])
