"""torch.distributed backend: NCCL's own collectives on GPU, a pairwise exchange on Gloo.

Gloo's reduce_scatter_tensor and all_gather_into_tensor move as many bytes as a whole all-reduce
(see ENVIRONMENT.md), which would make DeAR slower than DDP on CPU. The pairwise schedule posts
every send and receive at once with isend/irecv: each rank sends (N-1)/N of the buffer and
receives as much, which is the bandwidth-optimal volume, and Gloo's transport threads make the
progress, so the training thread only pays for the final local sum.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional

import torch
import torch.distributed as dist

from .base import CallbackWork, Communicator, Work, check_shard_sizes

_TAG_SPACE = 1 << 20


class TorchCommunicator(Communicator):
    """Collectives over a torch.distributed process group."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None, *,
                 gloo_collectives: str = "pairwise") -> None:
        self._group = group
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)
        self._backend = str(dist.get_backend(group)).lower()
        self._pairwise = self._backend == "gloo" and gloo_collectives == "pairwise"
        self._tag = 0
        self.name = f"{self._backend}-pairwise" if self._pairwise else self._backend

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        return self._group

    def _next_tag(self) -> int:
        # Every rank issues collectives in the same order, so the counters agree and a tag
        # pairs each send with its receive even when several exchanges are in flight.
        self._tag = (self._tag + 1) % _TAG_SPACE
        return self._tag

    def _peer(self, index: int) -> int:
        return dist.get_global_rank(self._group, index) if self._group is not None else index

    def reduce_scatter(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        check_shard_sizes(input, output, self._size)
        if self._size == 1:
            output.copy_(input)
            return CallbackWork([])
        if not self._pairwise:
            return CallbackWork([dist.reduce_scatter_tensor(
                output, input, op=dist.ReduceOp.SUM, group=self._group, async_op=True)])
        return self._pairwise_reduce_scatter(input, output)

    def _pairwise_reduce_scatter(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        n, me, shard = self._size, self._rank, output.numel()
        tag = self._next_tag()
        chunks = input.split(shard)
        received: list[Optional[torch.Tensor]] = [None] * n
        works = []
        for step in range(1, n):
            src = (me - step) % n
            received[src] = output if step == 1 else torch.empty_like(output)
            works.append(dist.irecv(received[src], self._peer(src), self._group, tag))
        for step in range(1, n):
            dst = (me + step) % n
            works.append(dist.isend(chunks[dst], self._peer(dst), self._group, tag))

        def finish() -> None:
            # `output` already holds the shard sent by rank me-1; add ours and the rest in a
            # fixed order. Each shard is summed on one rank only, so all ranks agree bitwise
            # after the all-gather.
            output.add_(chunks[me])
            for step in range(2, n):
                output.add_(received[(me - step) % n])

        return CallbackWork(works, finish)

    def all_gather(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        check_shard_sizes(output, input, self._size)
        n, me, shard = self._size, self._rank, input.numel()
        own = output[me * shard:(me + 1) * shard]
        if own.data_ptr() != input.data_ptr():
            own.copy_(input)
        if n == 1:
            return CallbackWork([])
        if not self._pairwise:
            return CallbackWork([dist.all_gather_into_tensor(
                output, own, group=self._group, async_op=True)])
        tag = self._next_tag()
        works = []
        for step in range(1, n):
            src = (me - step) % n
            works.append(dist.irecv(output[src * shard:(src + 1) * shard], self._peer(src),
                                    self._group, tag))
        for step in range(1, n):
            dst = (me + step) % n
            works.append(dist.isend(own, self._peer(dst), self._group, tag))
        return CallbackWork(works)

    def all_reduce(self, tensor: torch.Tensor) -> Work:
        return CallbackWork([dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._group,
                                             async_op=True)])

    def broadcast(self, tensor: torch.Tensor, root: int) -> Work:
        if not 0 <= root < self._size:
            raise ValueError(f"root rank {root} does not exist in a world of size {self._size}")
        return CallbackWork([dist.broadcast(tensor, self._peer(root), group=self._group,
                                            async_op=True)])

    def broadcast_object(self, obj: Any, root: int) -> Any:
        if not 0 <= root < self._size:
            raise ValueError(f"root rank {root} does not exist in a world of size {self._size}")
        box = [obj]
        dist.broadcast_object_list(box, src=self._peer(root), group=self._group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self._size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self._group)


def init_process_group_from_env(timeout: float) -> None:
    """Start the default group from torchrun's variables: NCCL with CUDA, Gloo otherwise."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout))
