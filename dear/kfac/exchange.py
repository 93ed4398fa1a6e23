"""The two exchanges of a K-FAC step, on fused flat buckets.

`FactorExchange`: this step's batch factors, A buckets in forward order then G buckets in
backward order. With pipelining (SPD) a layer's factor goes into its bucket from the hook that
completes it, and each bucket's all-reduce (or, for PAD, reduce to its owner) starts as soon as
the bucket is full and every bucket before it has started: the same order on every rank, while
the forward and backward passes go on. Without pipelining everything starts in step().

`BroadcastExchange`: results sent by their owner (decompositions for COMM_OPT, preconditioned
gradients for MEM_OPT and PAD), one broadcast per bucket of one owner.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from .comm import FlatBucket, Transport, pack, packed_size, split_into_buckets, unpack
from .planner import Plan
from .state import LayerState


class FactorExchange:
    def __init__(self, states: Sequence[LayerState], order: Sequence[int], plan: Plan,
                 transport: Transport, symmetric: bool, cap_numel: int) -> None:
        self.states, self.transport, self.symmetric = states, transport, symmetric
        self.plan = plan

        def item(which: str, i: int) -> tuple[Hashable, int, Any]:
            s = states[i]
            dim = s.layer.a_dim if which == "A" else s.layer.g_dim
            diagonal = which == "A" and s.layer.diagonal_a
            root = plan.layer_owner[i] if plan.reduce_to_owner else None
            return (which, i), packed_size(dim, diagonal, symmetric), (root, s.dtype)

        items_a = [item("A", i) for i in order]
        items_g = [item("G", i) for i in reversed(order)]
        self.buckets: list[FlatBucket] = []
        for slots, (root, dtype) in (split_into_buckets(items_a, cap_numel)
                                     + split_into_buckets(items_g, cap_numel)):
            self.buckets.append(FlatBucket(slots, dtype, root, states[0].device))
        self.where = {key: b for b in self.buckets for key in b.keys}
        self.next = 0

    def put(self, which: str, i: int, factor: Tensor, launch: bool = True) -> None:
        """This rank's batch factor of layer i; starts whatever became ready if `launch`."""
        key = (which, i)
        bucket = self.where[key]
        diagonal = which == "A" and self.states[i].layer.diagonal_a
        pack(factor, bucket.view(key), diagonal, self.symmetric)
        bucket.mark(key)
        if launch:
            self.launch_ready()

    def is_put(self, which: str, i: int) -> bool:
        key = (which, i)
        return self.where[key].count(key) > 0

    def launch_ready(self, force: bool = False) -> None:
        while self.next < len(self.buckets):
            bucket = self.buckets[self.next]
            if not (force or bucket.full):
                return
            if bucket.root is None:
                bucket.work = self.transport.all_reduce(bucket.buffer)
            else:
                bucket.work = self.transport.reduce(bucket.buffer, bucket.root)
            self.next += 1

    def finish(self) -> dict[tuple[str, int], Tensor]:
        """Start what has not started, wait for everything, and return the factors averaged over
        the ranks that computed them, for the layers this rank needs (all with all-reduce, its
        own with reduce). A factor no rank computed is absent."""
        self.launch_ready(force=True)
        out: dict[tuple[str, int], Tensor] = {}
        me = self.transport.rank
        for bucket in self.buckets:
            bucket.wait()
            if bucket.root is None or bucket.root == me:
                for key in bucket.keys:
                    count = bucket.count(key)
                    if count > 0:
                        which, i = cast(tuple[str, int], key)
                        layer = self.states[i].layer
                        dim = layer.a_dim if which == "A" else layer.g_dim
                        out[(which, i)] = unpack(bucket.view(key) / count, dim,
                                          which == "A" and layer.diagonal_a, self.symmetric)
            bucket.reset()
        self.next = 0
        return out


class BroadcastExchange:
    """Results keyed by `key`, each sent from its owner to every rank."""

    def __init__(self, items: Sequence[tuple[Hashable, int, int]], dtypes: Sequence[torch.dtype],
                 transport: Transport, cap_numel: int, device: torch.device) -> None:
        grouped = [(key, numel, (root, dtype)) for (key, numel, root), dtype in zip(items, dtypes)]
        grouped.sort(key=lambda x: x[2][0])           # stable: by owner, then layer order
        self.transport = transport
        self.buckets = [FlatBucket(slots, dtype, root, device)
                        for slots, (root, dtype) in split_into_buckets(grouped, cap_numel)]
        self.where = {key: b for b in self.buckets for key in b.keys}

    def __contains__(self, key: Hashable) -> bool:
        return key in self.where

    def put(self, key: Hashable, value: Tensor) -> None:
        bucket = self.where[key]
        bucket.view(key).copy_(value.reshape(-1))
        bucket.mark(key)

    def slot(self, key: Hashable) -> Tensor:
        return self.where[key].view(key)

    def mark(self, key: Hashable) -> None:
        self.where[key].mark(key)

    def run(self) -> None:
        """Every bucket's broadcast from its owner, in the same order on every rank."""
        for bucket in self.buckets:
            assert bucket.root is not None
            bucket.work = self.transport.broadcast(bucket.buffer, bucket.root)
        for bucket in self.buckets:
            bucket.wait()

    def get(self, key: Hashable) -> Tensor | None:
        """The owner's result (a view, valid until reset), or None if the owner had none."""
        bucket = self.where[key]
        return bucket.view(key) if bucket.count(key) > 0 else None

    def reset(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
