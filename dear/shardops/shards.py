"""This rank's reduced shards, between the reduce-scatter and the all-gather.

Once a bucket's reduce-scatter is finished and averaged, `bucket.shard` holds this rank's slice of
the averaged bucket `[gradients | usage flags | padding]`, and the all-gather that follows copies
it out. Whatever must change the reduced gradient before the update (GradScaler's unscale, clipping
by the global norm) edits the gradient part of these slices: each rank touches 1/N of the gradient,
and the few numbers that every rank must agree on (found-inf, the norm) travel in one tiny
all-gather, combined in rank order so every rank computes the same bits.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..comm.base import Communicator, collective_error
from ..fusion.bucket import Bucket


def gradient_slices(buckets: Sequence[Bucket], rank: int) -> list[torch.Tensor]:
    """Views of the gradients in this rank's shard of each bucket (no flags, no padding)."""
    slices = []
    for bucket in buckets:
        length = bucket.spec.shard_numel
        start = rank * length
        end = min(start + length, bucket.spec.flags_offset)
        if end > start:
            slices.append(bucket.shard[:end - start])
    return slices


def gather_small(comm: Communicator, values: torch.Tensor, what: str) -> torch.Tensor:
    """Every rank's `values` (a few numbers, 1-D) as a (size, k) matrix in rank order."""
    out = values.new_empty(comm.size * values.numel())
    try:
        comm.all_gather(values.contiguous(), out).wait()
    except Exception as exc:
        raise collective_error(f"dear: all-gather of {what} failed; another rank probably "
                               f"died or stalled: {exc}", exc) from exc
    return out.view(comm.size, -1)


def agreement_dtype(buckets: Sequence[Bucket]) -> torch.dtype:
    """float64 if any bucket is float64 (its norm would not fit float32's range), else float32."""
    return torch.float64 if any(b.spec.dtype == torch.float64 for b in buckets) else torch.float32
