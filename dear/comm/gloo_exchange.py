"""Bandwidth-optimal reduce-scatter and all-gather as point-to-point messages over Gloo.

Gloo's own reduce_scatter_tensor and all_gather_into_tensor (and Horovod's reducescatter and
allgather over Gloo) move as many bytes as a whole all-reduce or more (see ENVIRONMENT.md and
benchmarks/results/collectives*.md), which would make DeAR slower than an all-reduce on CPU. The
pairwise schedule posts every send and receive at once: each rank sends (N-1)/N of the buffer and
receives as much, which is the bandwidth-optimal volume, and Gloo's transport threads make the
progress, so the training thread only pays for the final local sum.

Gloo drives all of a process group's sockets from one transport thread, so on one group a rank's
outgoing and incoming halves of an exchange are copied through the kernel by the same thread, one
after the other. Given a twin group, every message from a higher to a lower rank travels on the
twin: on 2 ranks, sending and receiving then run on two threads. Measured on 2 ranks, loopback,
100 MB fp32 (benchmarks/collectives.py): the exchange took 15-25% less time than on one group
(reduce-scatter 0.34-0.42 x an all_reduce's time instead of 0.43-0.51 x); the final sum (~10 ms at
100 MB) did not need pipelining.

The groups are anything with Gloo's `send([tensor], dst, tag)` / `recv([tensor], src, tag)`:
torch.distributed's ProcessGroup objects (TorchCommunicator) or bare ProcessGroupGloo backends that
no torch.distributed registry knows of (the Horovod backend's private data plane). Ranks are the
group's own; messages are plain bytes, so every dtype works.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .base import CallbackWork, Work, check_shard_sizes

_TAG_SPACE = 1 << 20


class PairwiseExchange:
    """Reduce-scatter and all-gather of flat buffers between the `size` ranks of `group`."""

    def __init__(self, rank: int, size: int, group: Any, reverse: Optional[Any] = None,
                 timeout: Optional[float] = None) -> None:
        self.rank, self.size = rank, size
        self._timeout = timeout                # DEAR_TIMEOUT on every wait
        self._group, self._reverse = group, reverse
        self._tag = 0

    def _next_tag(self) -> int:
        # Every rank issues collectives in the same order, so the counters agree and a tag
        # pairs each send with its receive even when several exchanges are in flight.
        self._tag = (self._tag + 1) % _TAG_SPACE
        return self._tag

    def _exchange(self, recvs: list[tuple[int, torch.Tensor]],
                  sends: list[tuple[int, torch.Tensor]]) -> list[Any]:
        """Post every receive (from rank src into a buffer), then every send.

        A message from rank a to rank b travels on the first group if a < b, else on the twin:
        sender and receiver pick the same group, and a rank's sends and receives to one peer
        are driven by different Gloo threads. Receives first: a peer's "ready to receive" then
        never queues behind our own outgoing data (cluster.py measured the difference)."""
        tag, me, works = self._next_tag(), self.rank, []
        for src, buffer in recvs:
            group = self._group if src < me or self._reverse is None else self._reverse
            works.append(group.recv([buffer], src, tag))
        for dst, buffer in sends:
            group = self._group if me < dst or self._reverse is None else self._reverse
            works.append(group.send([buffer], dst, tag))
        return works

    def reduce_scatter(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        """Sum `input` over ranks; this rank keeps shard `rank` in `output`."""
        check_shard_sizes(input, output, self.size)
        n, me, shard = self.size, self.rank, output.numel()
        if n == 1:
            output.copy_(input)
            return CallbackWork([])
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

        return CallbackWork(works, finish, self._timeout)

    def all_gather_columns(self, input: torch.Tensor, output: torch.Tensor, start: int,
                           length: int) -> Work:
        """Elements [start, start + length) of every rank's shard `input`, received straight
        into their place in `output` (size x input.numel()): a chunk of an all-gather."""
        check_shard_sizes(output, input, self.size)
        n, me, shard = self.size, self.rank, input.numel()
        own = output[me * shard + start:me * shard + start + length]
        if own.data_ptr() != input.data_ptr() + start * input.element_size():
            own.copy_(input[start:start + length])
        if n == 1:
            return CallbackWork([])
        peers = [(me + step) % n for step in range(1, n)]
        return CallbackWork(self._exchange(
            [(src, output[src * shard + start:src * shard + start + length]) for src in peers],
            [(dst, own) for dst in peers]), timeout=self._timeout)

    def all_gather(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        """Every rank's `input` into `output`, in rank order (`input` may be our own slice)."""
        check_shard_sizes(output, input, self.size)
        n, me, shard = self.size, self.rank, input.numel()
        own = output[me * shard:(me + 1) * shard]
        if own.data_ptr() != input.data_ptr():
            own.copy_(input)
        if n == 1:
            return CallbackWork([])
        peers = [(me + step) % n for step in range(1, n)]
        return CallbackWork(self._exchange(
            [(src, output[src * shard:(src + 1) * shard]) for src in peers],
            [(dst, own) for dst in peers]), timeout=self._timeout)
