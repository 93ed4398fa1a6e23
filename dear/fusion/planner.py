"""Which parameters share a fusion bucket.

Buckets are contiguous runs of parameters in the order their modules execute in the forward pass,
so the all-gather of bucket 0 (issued first) is the one the next forward needs first, and the
reduce-scatters run from the last bucket to the first, the order backward produces gradients in.
"""

from __future__ import annotations

import dataclasses
from typing import Collection, Optional, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class BucketSpec:
    """Layout of one flat bucket buffer: gradients, then one usage flag per parameter, then
    padding to a multiple of the world size (every rank's shard has the same length)."""

    index: int
    params: tuple[int, ...]          # indices into the optimizer's parameter list
    offsets: tuple[int, ...]         # element offset of each parameter's gradient
    numels: tuple[int, ...]
    flags_offset: int                # first usage flag (1 = this rank produced a gradient)
    padded_numel: int
    dtype: torch.dtype
    device: torch.device
    world_size: int

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size


def _padded(numel: int, world_size: int) -> int:
    return -(-numel // world_size) * world_size


def plan_buckets(params: Sequence[torch.Tensor], order: Sequence[int], threshold_bytes: int,
                 world_size: int, explicit: Optional[Sequence[Sequence[int]]] = None,
                 first_bucket_bytes: Optional[int] = None,
                 tied: Sequence[Sequence[int]] = (),
                 alone: Collection[int] = ()) -> list[BucketSpec]:
    """Group `params` (visited in `order`) into buckets of at most `threshold_bytes` of gradient.

    A bucket never mixes dtypes or devices; a parameter larger than the threshold gets a bucket
    of its own; a threshold of 0 gives one bucket per parameter. `explicit` groups (Horovod's
    `groups=`) become one bucket each, placed where their first member comes in `order`.
    `first_bucket_bytes`, if given, is the threshold of the first bucket instead. A parameter
    larger than both thresholds at the very front (BERT's word embedding) takes a bucket of its
    own and does not count as the first bucket: what follows it is also ready last in backward
    and needed first in forward, so it is the small first bucket (`first_bucket_index`).
    `tied` parameters (dear.KFAC's weight and bias of one layer) are never split between
    buckets: they join the bucket of the first of them in `order`, as one unit.
    `alone` parameters (row-sparse embedding tables, dear/fusion/rows.py) get a bucket each.
    """
    if sorted(order) != list(range(len(params))):
        raise ValueError("order must be a permutation of the parameter indices")
    position = {idx: k for k, idx in enumerate(order)}
    group_of = {idx: g for g, members in enumerate(explicit or ()) for idx in members}
    tie_of = {idx: sorted(members, key=position.__getitem__)
              for members in tied if not any(m in group_of for m in members)
              and len({(params[m].dtype, params[m].device) for m in members}) == 1
              for idx in members}
    groups: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for idx in order:
        if idx in group_of:
            members = sorted((explicit or ())[group_of[idx]], key=position.__getitem__)
            if members[0] != idx:
                continue                        # emitted with its first member
            if len({(params[m].dtype, params[m].device) for m in members}) > 1:
                raise ValueError(f"fusion group {group_of[idx]} mixes dtypes or devices; "
                                 "a group must hold one dtype on one device")
            if current:
                groups.append(current)
                current, current_bytes = [], 0
            groups.append(members)
            continue
        if idx in alone and idx not in tie_of:
            if current:
                groups.append(current)
                current, current_bytes = [], 0
            groups.append([idx])
            continue
        unit = tie_of.get(idx, [idx])
        if unit[0] != idx:
            continue                            # placed with the first of its tie
        p = params[idx]
        nbytes = _nbytes(params, unit)
        same_kind = bool(current) and (params[current[0]].dtype == p.dtype
                                       and params[current[0]].device == p.device)
        # The first bucket's threshold holds until a bucket that is not a lone oversize
        # parameter is closed (all() stops at that bucket).
        limit = threshold_bytes
        if first_bucket_bytes is not None and all(
                len(g) == 1 and _oversize(_nbytes(params, g), threshold_bytes, first_bucket_bytes)
                for g in groups):
            limit = first_bucket_bytes
        if current and (not same_kind or current_bytes + nbytes > limit):
            groups.append(current)
            current, current_bytes = [], 0
        current.extend(unit)
        current_bytes += nbytes
    if current:
        groups.append(current)

    specs = []
    for b, members in enumerate(groups):
        offsets, numels, cursor = [], [], 0
        for idx in members:
            offsets.append(cursor)
            numels.append(params[idx].numel())
            cursor += params[idx].numel()
        flags_offset = cursor
        specs.append(BucketSpec(
            index=b, params=tuple(members), offsets=tuple(offsets), numels=tuple(numels),
            flags_offset=flags_offset,
            padded_numel=_padded(flags_offset + len(members), world_size),
            dtype=params[members[0]].dtype, device=params[members[0]].device,
            world_size=world_size))
    return specs


def _nbytes(params: Sequence[torch.Tensor], members: Sequence[int]) -> int:
    return sum(params[m].numel() * params[m].element_size() for m in members)


def _oversize(nbytes: int, threshold_bytes: int, first_bucket_bytes: int) -> bool:
    """A lone parameter that no threshold could have shared a bucket with."""
    return nbytes > max(threshold_bytes, first_bucket_bytes)


def first_bucket_index(specs: Sequence[BucketSpec], threshold_bytes: int,
                       first_bucket_bytes: int) -> int:
    """The bucket plan_buckets sized with `first_bucket_bytes`: the first one that is not a
    lone oversize parameter."""
    for spec in specs:
        if not (len(spec.params) == 1 and _oversize(spec.numels[0] * spec.dtype.itemsize,
                                                    threshold_bytes, first_bucket_bytes)):
            return spec.index
    return len(specs)


def plan_gather_groups(specs: Sequence[BucketSpec], threshold_bytes: int,
                       alone: Collection[int] = ()) -> list[list[int]]:
    """Consecutive buckets (forward order) all-gathered together, up to `threshold_bytes` of
    buffer per group; one dtype and device per group. Every bucket in `alone` is gathered on
    its own (the first bucket: its size was chosen for the critical path; row-sparse tables)."""
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    for spec in specs:
        nbytes = spec.padded_numel * spec.dtype.itemsize
        same_kind = bool(current) and (specs[current[0]].dtype == spec.dtype
                                       and specs[current[0]].device == spec.device)
        close = current and (not same_kind or size + nbytes > threshold_bytes
                             or spec.index in alone or current[-1] in alone)
        if close:
            groups.append(current)
            current, size = [], 0
        current.append(spec.index)
        size += nbytes
    if current:
        groups.append(current)
    return groups
