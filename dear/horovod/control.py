"""The bottom of dear.horovod: its error type and the raw all-gathers that the agreement rounds
(negotiate.py) and the process sets (basics.py) run on a set's Gloo control group."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

# torch 2.13 renamed these two (the old names warn); older torch has only the old names.
all_gather_flat = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class HorovodInternalError(RuntimeError):
    """A collective failed or the ranks disagreed about it (Horovod's name, so that scripts
    catching it keep working)."""


def allgather_bytes(payload: bytes, group: Optional[dist.ProcessGroup],
                    lengths: Optional[list[int]] = None) -> list[bytes]:
    """Every member's bytes, in set-rank order: the lengths (unless known), then the bytes
    padded to the longest (Gloo all-gathers on CPU, bounded by the group's timeout)."""
    n = dist.get_world_size(group)
    if lengths is None:
        sizes = torch.empty(n, dtype=torch.int64)
        all_gather_flat(sizes, torch.tensor([len(payload)], dtype=torch.int64),
                                    group=group)
        lengths = sizes.tolist()
    width = max(lengths)
    if width == 0:
        return [b""] * n
    mine = torch.zeros(width, dtype=torch.uint8)
    if payload:
        mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    table = torch.empty(n * width, dtype=torch.uint8)
    all_gather_flat(table, mine, group=group)
    rows = table.view(n, width)
    return [rows[r, :lengths[r]].numpy().tobytes() for r in range(n)]
