"""Clipping by the global norm of the averaged gradient, computed from the reduced shards.

DDP users clip the all-reduced `.grad` with torch.nn.utils.clip_grad_norm_. Under dear the
averaged gradient exists, between the reduce-scatter and the all-gather, only as one shard per
rank; the squares of the shards add up to the square of the whole, so each rank takes the norm of
its own shard, one tiny all-gather shares these partial norms, and each rank scales its shard
before the all-gather spreads it. Clipping costs no extra pass over the full gradient and
no extra full-size collective, and equals clipping the all-reduced gradient (up to the order of
floating-point summation inside the norm).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from ..comm.base import Communicator
from ..fusion.bucket import Bucket
from .shards import agreement_dtype, gather_small, gradient_slices

_EPS = 1e-6                                      # torch.nn.utils.clip_grad_norm_'s


def check_norm_type(norm_type: float) -> float:
    norm_type = float(norm_type)
    if not (norm_type == math.inf or norm_type > 0):
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
    return norm_type


def _partial(pieces: Sequence[torch.Tensor], norm_type: float, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """This rank's share: sum of |g|^p over its pieces (max |g| for the inf-norm)."""
    if not pieces:
        return torch.zeros((), dtype=dtype, device=device)
    norms = torch.stack([torch.linalg.vector_norm(p, norm_type, dtype=dtype) for p in pieces])
    return norms.max() if norm_type == math.inf else norms.pow(norm_type).sum()


def _total(partials: torch.Tensor, norm_type: float) -> torch.Tensor:
    if norm_type == math.inf:
        return partials.max()
    return partials.sum().pow(1.0 / norm_type)


def global_norm(buckets: Sequence[Bucket], comm: Communicator, norm_type: float,
                found_inf: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The norm of the averaged gradient, from every rank's shard; and, if this rank's found-inf
    is given, the sum over ranks (it rides in the same all-gather: AMP plus clipping costs one
    tiny collective)."""
    pieces = gradient_slices(buckets, comm.rank)
    dtype = agreement_dtype(buckets)
    mine = _partial(pieces, norm_type, dtype, buckets[0].shard.device).view(1)
    if found_inf is not None:
        mine = torch.cat([mine, found_inf.to(dtype).view(1)])
    table = gather_small(comm, mine, "the gradient norm (clip_grad_norm_)")
    found = table[:, 1].sum() if found_inf is not None else None
    return _total(table[:, 0], norm_type), found


def coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's clip coefficient, min(1, max_norm / (norm + 1e-6))."""
    return torch.clamp(max_norm / (total + _EPS), max=1.0)


def scale_(buckets: Sequence[Bucket], rank: int, coef: torch.Tensor) -> None:
    """Scale the gradients of this rank's shards by `coef` (torch's clip coefficient, or a
    factor deferred earlier), in place."""
    pieces = gradient_slices(buckets, rank)
    for kind in {p.dtype for p in pieces}:      # the coefficient in the gradient's dtype, as torch
        torch._foreach_mul_([p for p in pieces if p.dtype == kind], coef.to(kind))
