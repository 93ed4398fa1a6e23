"""From a parameter order and a FusionConfig to live buckets and all-gather groups."""

from __future__ import annotations

import dataclasses
from typing import Collection, Optional, Sequence

import torch

from ..comm.compression import Compressor, QuantizedCompressor
from .bucket import Bucket
from .fusion_config import FusionConfig
from .gather import GatherGroup, make_groups
from .planner import BucketSpec, first_bucket_index, plan_buckets, plan_gather_groups
from .quantized import QuantizedBucket
from .rows import RowSparseBucket


@dataclasses.dataclass
class Layout:
    buckets: list[Bucket]                      # forward order
    where: list[tuple[Bucket, int]]            # parameter index -> (its bucket, slot)
    gather_groups: list[GatherGroup]           # forward order

    def describe(self) -> str:
        sizes = [round(b.buffer.numel() * b.buffer.element_size() / 2**20, 2)
                 for b in self.buckets]
        rows = sum(isinstance(b, RowSparseBucket) for b in self.buckets)
        return (f"{len(self.buckets)} buckets (MB) {sizes}, "
                f"{len(self.gather_groups)} all-gathers"
                + (f", {rows} embedding table(s) sent by rows" if rows else ""))

    def signature(self) -> list[list[int]]:
        """Parameter indices per bucket and bucket indices per all-gather: compared across
        ranks by tests (every rank must hold the same layout)."""
        return ([list(b.spec.params) for b in self.buckets]
                + [[-1 - b.spec.index for b in g.buckets] for g in self.gather_groups])


def plan_layout(params: Sequence[torch.Tensor], order: Sequence[int], fusion: FusionConfig,
                world_size: int, explicit: Optional[Sequence[Sequence[int]]] = None,
                tied: Sequence[Sequence[int]] = (), row_sparse: Collection[int] = ()
                ) -> tuple[list[BucketSpec], list[list[int]]]:
    """Bucket specs and all-gather groups (bucket indices) without allocating anything: the
    one place the rules are applied, for the optimizer and for dear.diagnose's simulator
    (which passes meta tensors). `row_sparse` parameters get a bucket and a group each."""
    specs = plan_buckets(params, order, fusion.rs_threshold, world_size, explicit,
                         first_bucket_bytes=fusion.first_bucket, tied=tied, alone=row_sparse)
    alone = [s.index for s in specs if len(s.params) == 1 and s.params[0] in row_sparse]
    if fusion.first_bucket is not None:
        alone.append(first_bucket_index(specs, fusion.rs_threshold, fusion.first_bucket))
    groups = plan_gather_groups(specs, fusion.ag_threshold, alone=alone)
    return specs, groups


def build_layout(params: Sequence[torch.nn.Parameter], order: Sequence[int],
                 fusion: FusionConfig, world_size: int,
                 explicit: Optional[Sequence[Sequence[int]]], compression: Compressor,
                 sparse_as_dense: bool, tied: Sequence[Sequence[int]] = (),
                 row_sparse: Collection[int] = (), rank: int = 0, views: bool = False,
                 sharded: bool = False, shard_in_buffer: bool = False) -> Layout:
    """`row_sparse`: parameters (2-D, no wire compression) sent as their used rows
    (dear/fusion/rows.py); `rank`: this process's, for their shards; `views`: .grad may be a
    view of the dense buckets' buffers (gradient_as_bucket_view, dear/fusion/views.py);
    `sharded`: the all-gathers carry updated parameters (shard_optimizer_state), so a
    quantized bucket gathers them in fp32; `shard_in_buffer`: a dense bucket's shard is its
    buffer (a world of one, see Bucket)."""
    row_sparse = {i for i in row_sparse if params[i].dim() == 2 and not compression.quantizes
                  and compression.wire_dtype(params[i].dtype) in (None, params[i].dtype)}
    specs, plan = plan_layout(params, order, fusion, world_size, explicit, tied, row_sparse)
    buckets = [_bucket(s, [params[i] for i in s.params], row_sparse, compression, fusion,
                       sparse_as_dense, rank, views, sharded, shard_in_buffer) for s in specs]
    where: list[tuple[Bucket, int]] = [None] * len(params)  # type: ignore[list-item]
    for bucket in buckets:
        for j, i in enumerate(bucket.spec.params):
            where[i] = (bucket, j)
    return Layout(buckets, where, make_groups(buckets, plan, world_size))


def _bucket(spec: BucketSpec, params: list[torch.nn.Parameter], row_sparse: Collection[int],
            compression: Compressor, fusion: FusionConfig, sparse_as_dense: bool, rank: int,
            views: bool, sharded: bool, shard_in_buffer: bool) -> Bucket:
    if len(spec.params) == 1 and spec.params[0] in row_sparse:
        return RowSparseBucket(spec, params, rank, sparse_as_dense)
    if compression.quantizes and spec.dtype == torch.float32:
        assert isinstance(compression, QuantizedCompressor)
        return QuantizedBucket(spec, params, compression, rank, sparse_as_dense, views=views,
                               sharded=sharded)
    return Bucket(spec, params, compression.wire_dtype(spec.dtype), sparse_as_dense,
                  views=views, piece_bytes=fusion.rs_threshold,
                  shard_in_buffer=shard_in_buffer and not sharded)
