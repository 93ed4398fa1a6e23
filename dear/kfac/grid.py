"""KAISA's HYBRID-OPT grid (kfac-pytorch's grad_worker_fraction strictly between 1/world and 1).

The ranks, in row-major order, form grad_workers rows x C columns (C = world / grad_workers).
A layer belongs to one column: the column's ranks receive its decompositions from the rank that
computed them and precondition its gradient; every other rank gets the result from the member
of its row that is in the layer's column. Rank r is in column r % C (at index r // C there)
and in row r // C (at index r % C there). One process group per column and per row, made by
every rank in the same order (torch.distributed only).
"""

from __future__ import annotations

import torch.distributed as dist

from .comm import Transport, group_timeout


def grid_transports(world: Transport, columns: int) -> tuple[Transport, Transport]:
    """This rank's column and row transports."""
    if not world.on_torch_distributed:
        raise NotImplementedError(
            "dear.KFAC: hybrid-opt (0 < grad_worker_fraction < 1 other than 1/world) needs "
            f"torch.distributed; this run uses the {world.name} backend. Use comm-opt "
            "(grad_worker_fraction=1) or mem-opt (1/world)")
    n, rank = world.size, world.rank
    column = row = None
    for c in range(columns):                  # same order on every rank: collective
        group = dist.new_group([world.peer(r) for r in range(c, n, columns)],
                               timeout=group_timeout())
        if rank % columns == c:
            column = group
    for r in range(n // columns):
        group = dist.new_group([world.peer(x) for x in range(r * columns, (r + 1) * columns)],
                               timeout=group_timeout())
        if rank // columns == r:
            row = group
    assert column is not None and row is not None
    return Transport(group=column, torch_dist=True), Transport(group=row, torch_dist=True)
