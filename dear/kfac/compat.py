"""`KFACPreconditioner`: dear.KFAC with kfac-pytorch's signature AND its defaults, so that
`from kfac.preconditioner import KFACPreconditioner` becomes
`from dear.kfac import KFACPreconditioner` and nothing else changes. dear.KFAC itself keeps
dear's defaults; README.md ("Second-order") lists where they differ."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .enums import AssignmentStrategy, ComputeMethod, DistributedStrategy
from .preconditioner import KFAC


class KFACPreconditioner(KFAC):
    """kfac-pytorch 0.4's KFACPreconditioner: keyword-only arguments, its defaults (inverses
    every step, comm-opt, colocated factors, a running-average update per pass, float32
    decompositions, no symmetry-aware communication); dear's own options may be added."""

    def __init__(self, model: nn.Module, *,
                 factor_update_steps: Callable[[int], int] | int = 1,
                 inv_update_steps: Callable[[int], int] | int = 1,
                 damping: Callable[[int], float] | float = 0.001,
                 factor_decay: Callable[[int], float] | float = 0.95,
                 kl_clip: Callable[[int], float] | float | None = 0.001,
                 lr: Callable[[int], float] | float = 0.1,
                 accumulation_steps: int = 1,
                 allreduce_bucket_cap_mb: float = 25.0,
                 assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
                 colocate_factors: bool = True,
                 compute_method: ComputeMethod | str = ComputeMethod.EIGEN,
                 compute_eigenvalue_outer_product: bool = True,
                 grad_worker_fraction: DistributedStrategy | float = DistributedStrategy.COMM_OPT,
                 symmetry_aware: bool = False,
                 grad_scaler: Any = None,
                 factor_dtype: torch.dtype | None = None,
                 inv_dtype: torch.dtype = torch.float32,
                 skip_layers: list[str] | None = None,
                 update_factors_in_hook: bool = True,
                 loglevel: int = logging.DEBUG,
                 **dear_options: Any) -> None:
        super().__init__(
            model, lr=lr, damping=damping, factor_decay=factor_decay, kl_clip=kl_clip,
            factor_update_steps=factor_update_steps, inv_update_steps=inv_update_steps,
            accumulation_steps=accumulation_steps,
            allreduce_bucket_cap_mb=allreduce_bucket_cap_mb,
            assignment_strategy=assignment_strategy, colocate_factors=colocate_factors,
            compute_method=compute_method,
            compute_eigenvalue_outer_product=compute_eigenvalue_outer_product,
            grad_worker_fraction=grad_worker_fraction, symmetry_aware=symmetry_aware,
            grad_scaler=grad_scaler, factor_dtype=factor_dtype, inv_dtype=inv_dtype,
            skip_layers=skip_layers, update_factors_in_hook=update_factors_in_hook,
            loglevel=loglevel, **dear_options)
