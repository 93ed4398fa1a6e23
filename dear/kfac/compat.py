"""`KFACPreconditioner`: dear.KFAC with kfac-pytorch's signature AND its defaults, so that
`from kfac.preconditioner import KFACPreconditioner` becomes
`from dear.kfac import KFACPreconditioner` and nothing else changes. dear.KFAC itself keeps
dear's defaults; docs/kfac.md lists where they differ."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .enums import AllreduceMethod, AssignmentStrategy, ComputeMethod, DistributedStrategy, parse
from .preconditioner import KFAC

# kfac-pytorch keeps each hyperparameter as given (a value or a callable of the step) in these
# attributes, which its LambdaParamScheduler reads and writes; here they are views of dear's.
_KFAC_PRIVATE = {"_factor_update_steps": "factor_update_freq",
                 "_inv_update_steps": "inv_update_freq", "_damping": "damping",
                 "_factor_decay": "factor_decay", "_kl_clip": "kl_clip", "_lr": "lr"}


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
        method = parse(ComputeMethod, compute_method, "compute_method")
        if method is ComputeMethod.EIGEN and compute_eigenvalue_outer_product \
                and not colocate_factors:
            raise ValueError("colocate_factors must be True to use "
                             "compute_eigenvalue_outer_product (kfac-pytorch's rule: the "
                             "outer product of the two eigenvalue vectors needs both on one rank)")
        if not colocate_factors and _fraction_and_strategy(
                grad_worker_fraction, _world())[1] is DistributedStrategy.MEM_OPT:
            warnings.warn("grad_worker_frac=1/world_size (MEM_OPT) requires "
                          "colocate_factors=True. Enabling colocate_factors.", stacklevel=2)
            colocate_factors = True
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

        # kfac-pytorch's read-only description of the choices made.
        self.compute_method = method
        self.assignment_strategy = parse(AssignmentStrategy, assignment_strategy,
                                         "assignment_strategy")
        self.allreduce_bucket_cap_mb = allreduce_bucket_cap_mb
        self.allreduce_method = (AllreduceMethod.ALLREDUCE_BUCKETED if allreduce_bucket_cap_mb > 0
                                 else AllreduceMethod.ALLREDUCE)
        self.colocate_factors = colocate_factors
        self.compute_eigenvalue_outer_product = compute_eigenvalue_outer_product
        self.grad_worker_fraction, self.distributed_strategy = _fraction_and_strategy(
            grad_worker_fraction, self.size)
        self.symmetry_aware = symmetry_aware
        self.factor_dtype, self.inv_dtype = factor_dtype, inv_dtype
        self.skip_layers = list(skip_layers or [])
        self.grad_scaler = grad_scaler

    @staticmethod
    def _summary_level(loglevel: int) -> int:
        return loglevel                        # kfac-pytorch logs nothing above loglevel

    def __getattr__(self, name: str) -> Any:
        source = _KFAC_PRIVATE.get(name)
        if source is not None:                 # as given: a value or a callable
            return self._sources[source]
        if name == "_steps":
            return self.steps
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        source = _KFAC_PRIVATE.get(name)
        if source is not None:
            # Unchecked, as kfac-pytorch's own attributes: its LambdaParamScheduler multiplies
            # them step after step (a callable's results are still checked when read).
            self._sources[source] = value
            self._step_cache = (-1, False, 0.0)
        elif name == "_steps":
            super().__setattr__("steps", value)
        else:
            super().__setattr__(name, value)


def _world() -> int:
    """The world K-FAC will run in, before its transport exists (kfac-pytorch's get_world_size)."""
    from ..comm import runtime
    if runtime.is_initialized():
        return runtime.size()
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _fraction_and_strategy(fraction: Any, world: int) -> tuple[float, DistributedStrategy]:
    """kfac-pytorch's grad_worker_fraction (a float) and distributed_strategy attributes."""
    try:
        member = parse(DistributedStrategy, fraction, "grad_worker_fraction")
    except ValueError:
        member = None
    if member is not None:
        value = {DistributedStrategy.COMM_OPT: 1.0, DistributedStrategy.HYBRID_OPT: 0.5,
                 DistributedStrategy.MEM_OPT: 1.0 / world}[member]
        return value, member
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise ValueError(f"grad_worker_fraction must be in [0, 1] or a DistributedStrategy, "
                         f"got {fraction!r}")
    value = float(fraction) if fraction else 1.0 / world
    if value == 1.0:
        return 1.0, DistributedStrategy.COMM_OPT
    if value <= 1.0 / world:
        return value, DistributedStrategy.MEM_OPT
    return value, DistributedStrategy.HYBRID_OPT
