"""All-gather of several consecutive buckets as one collective.

Each rank holds one shard of every bucket after the reduce-scatters. A group sends the
concatenation of its buckets' shards in one all-gather and copies each rank's piece back into
every bucket's buffer when the result is first waited for, so the buckets then look exactly as if
each had been gathered alone (numerics do not depend on the grouping). A group of one bucket is
that bucket's own all-gather, with no copy.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..comm.base import Communicator, Work
from .bucket import Bucket


class _OnceWork(Work):
    """Waits for the fused collective, then runs `finish` (the copy-out) exactly once."""

    def __init__(self, work: Work, finish: Callable[[], None]) -> None:
        self._work: Optional[Work] = work
        self._finish = finish

    def wait(self) -> None:
        if self._work is None:
            return
        self._work.wait()
        self._work = None
        self._finish()


class GatherGroup:
    def __init__(self, buckets: Sequence[Bucket], world_size: int) -> None:
        self.buckets = list(buckets)
        self._world = world_size
        self._send: Optional[torch.Tensor] = None
        if len(self.buckets) > 1 and world_size > 1:
            first = self.buckets[0].wire_shard
            self._sizes = [b.wire_shard.numel() for b in self.buckets]
            total = sum(self._sizes)
            self._send = torch.empty(total, dtype=first.dtype, device=first.device)
            self._recv = torch.empty(total * world_size, dtype=first.dtype, device=first.device)
            self._send_parts = self._send.split(self._sizes)

    @property
    def nbytes(self) -> int:
        return sum(b.wire.numel() * b.wire.element_size() for b in self.buckets)

    @property
    def send_buffer(self) -> Optional[torch.Tensor]:
        """The message a fused group sends (its buckets' shards, copied); None when the
        group's one bucket sends its own shard."""
        return self._send

    def start(self, comm: Communicator) -> None:
        send = self._send
        if send is None:                       # alone: nothing to fuse, no copies
            for bucket in self.buckets:
                bucket.start_all_gather(comm)
            return
        for bucket, part in zip(self.buckets, self._send_parts):
            part.copy_(bucket.outgoing_shard())
        shared = _OnceWork(comm.all_gather(send, self._recv), self._scatter)
        for bucket in self.buckets:
            bucket.gathering(shared)

    def _scatter(self) -> None:
        pieces = self._recv.view(self._world, -1).split(self._sizes, dim=1)
        for bucket, piece in zip(self.buckets, pieces):
            bucket.wire.view(self._world, -1).copy_(piece)


def make_groups(buckets: Sequence[Bucket], plan: Sequence[Sequence[int]],
                world_size: int) -> list[GatherGroup]:
    return [GatherGroup([buckets[i] for i in members], world_size) for members in plan]
