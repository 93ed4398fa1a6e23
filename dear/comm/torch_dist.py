"""torch.distributed backend: NCCL's own collectives on GPU, a pairwise exchange on Gloo.

Gloo's reduce_scatter_tensor and all_gather_into_tensor move as many bytes as a whole all-reduce
(see ENVIRONMENT.md), which would make DeAR slower than DDP on CPU. The pairwise schedule posts
every send and receive at once with isend/irecv: each rank sends (N-1)/N of the buffer and
receives as much, which is the bandwidth-optimal volume, and Gloo's transport threads make the
progress, so the training thread only pays for the final local sum.

Gloo drives all of a process group's sockets from one transport thread, so on one group a rank's
outgoing and incoming halves of an exchange are copied through the kernel by the same thread, one
after the other. On the default group the communicator therefore opens a twin Gloo group and
sends every message from a higher to a lower rank on it: on 2 ranks, sending and receiving then
run on two threads. Measured on 2 ranks, loopback, 100 MB fp32 (benchmarks/collectives.py): the
exchange took 15-25% less time than on one group (reduce-scatter 0.34-0.42 x an all_reduce's
time instead of 0.43-0.51 x); the final sum (~10 ms at 100 MB) did not need pipelining.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional

import torch
import torch.distributed as dist

from .base import CallbackWork, Communicator, Work, check_shard_sizes

_TAG_SPACE = 1 << 20


class TorchCommunicator(Communicator):
    """Collectives over a torch.distributed process group.

    With Gloo and gloo_collectives="pairwise" on the default group (group=None), constructing it
    creates a second process group, so every rank must construct it, in the same order relative
    to its other new_group calls (dear.init() does). For an explicit subgroup no twin is made
    (dist.new_group would need every rank of the world) and all messages use that group.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, *,
                 gloo_collectives: str = "pairwise") -> None:
        self._group = group
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)
        self._backend = str(dist.get_backend(group)).lower()
        self._pairwise = self._backend == "gloo" and gloo_collectives == "pairwise"
        self._tag = 0
        self._reverse: Optional[dist.ProcessGroup] = None
        if self._pairwise and group is None and self._size > 1:
            self._reverse = dist.new_group(backend="gloo", timeout=_timeout_of(group),
                                           group_desc="dear_pairwise_reverse")
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

    def _exchange(self, recvs: list[tuple[int, torch.Tensor]],
                  sends: list[tuple[int, torch.Tensor]]) -> list[Any]:
        """Post every receive (from group rank src into a buffer), then every send.

        A message from rank a to rank b travels on the default group if a < b, else on the twin:
        sender and receiver pick the same group, and a rank's sends and receives to one peer
        are driven by different Gloo threads."""
        tag, me, works = self._next_tag(), self._rank, []
        for src, buffer in recvs:
            group = self._group if src < me or self._reverse is None else self._reverse
            works.append(dist.irecv(buffer, self._peer(src), group, tag))
        for dst, buffer in sends:
            group = self._group if me < dst or self._reverse is None else self._reverse
            works.append(dist.isend(buffer, self._peer(dst), group, tag))
        return works

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
        chunks = input.split(shard)
        # The first peer's shard lands in `output` itself: on 2 ranks no scratch memory at all.
        received = {(me - step) % n: output if step == 1 else torch.empty_like(output)
                    for step in range(1, n)}
        works = self._exchange(list(received.items()),
                               [((me + step) % n, chunks[(me + step) % n]) for step in range(1, n)])

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
        peers = [(me + step) % n for step in range(1, n)]
        return CallbackWork(self._exchange(
            [(src, output[src * shard:(src + 1) * shard]) for src in peers],
            [(dst, own) for dst in peers]))

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

    def shutdown(self) -> None:
        """Release the twin group (the caller owns `group` and the default group)."""
        reverse, self._reverse = self._reverse, None
        if reverse is not None and dist.is_initialized():
            dist.destroy_process_group(reverse)


def _timeout_of(group: Optional[dist.ProcessGroup]) -> Optional[datetime.timedelta]:
    """The group's collective timeout (DEAR_TIMEOUT via init_process_group), so the twin fails
    as fast as the group it doubles; None (torch's default) if torch hides it."""
    try:
        pg = group if group is not None else dist.group.WORLD
        return pg._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None


def init_process_group_from_env(timeout: float) -> None:
    """Start the default group from torchrun's variables: NCCL with CUDA, Gloo otherwise."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout))
