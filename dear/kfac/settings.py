"""dear.KFAC's settings from its arguments: dear's own names and kfac-pytorch's
(`kfac.preconditioner.KFACPreconditioner`), so that code written for kfac-pytorch keeps its
arguments and their meanings when it changes the import.

  kfac-pytorch                        dear
  factor_update_steps                 factor_update_freq
  inv_update_steps                    inv_update_freq
  compute_method                      method
  update_factors_in_hook              pipeline_factors (False also: one running-average update
                                      per step, at step())
  allreduce_bucket_cap_mb (0: none)   bucket_cap_mb
  grad_worker_fraction                strategy: 1 comm-opt, 1/world mem-opt, between: hybrid-opt
  assignment_strategy                 who decomposes: kfac-pytorch's greedy on d^3 (COMPUTE) or
                                      d^2 (MEMORY); dear's default is its calibrated cost model
  colocate_factors                    a layer's A and G decomposed by the same rank
Passing both names of one setting with different values is an error.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from typing import Any

import torch

from .enums import AssignmentStrategy, ComputeMethod, DistributedStrategy, Strategy, parse


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything dear.KFAC's constructor decides from its arguments (hyperparameters apart)."""

    method: ComputeMethod
    strategy: Strategy
    grad_workers: int | None        # hybrid-opt: ranks per column (KAISA's grad workers)
    pipeline: bool                  # False also: running averages updated once, in step()
    accumulation_steps: int | None  # passes per running-average update (None: all of a step)
    assignment: AssignmentStrategy | None   # None: dear's calibrated cost model
    colocate: bool
    symmetric: bool
    redundancy: bool
    bucket_cap_bytes: int
    factor_dtype: torch.dtype | None
    inv_dtype: torch.dtype | None
    outer_product: bool             # eigen: damping fixed at each decomposition (kfac-pytorch)
    skip_layers: tuple[str | type, ...]


def one_of(what: str, dear_value: Any, dear_default: Any, kfac_name: str, kfac_value: Any) -> Any:
    """The value of a setting that has two names: whichever was passed (not both, unless equal)."""
    if kfac_value is None:
        return dear_value
    if dear_value != dear_default and dear_value != kfac_value:
        raise ValueError(f"dear.KFAC: {what}={dear_value!r} and {kfac_name}={kfac_value!r} "
                         "name the same setting; pass one of them")
    return kfac_value


def strategy_from_fraction(fraction: Any, world: int) -> tuple[Strategy, int | None]:
    """kfac-pytorch's grad_worker_fraction (a DistributedStrategy or a float in [0, 1]) as a
    strategy, and for hybrid-opt the number of gradient workers per layer."""
    if isinstance(fraction, (enum.Enum, str)):          # kfac-pytorch's enum, or dear's
        member = parse(DistributedStrategy, fraction, "grad_worker_fraction")
        fraction = {DistributedStrategy.COMM_OPT: 1.0, DistributedStrategy.HYBRID_OPT: 0.5,
                    DistributedStrategy.MEM_OPT: 1.0 / world}[member]
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
            or not 0 <= fraction <= 1:
        raise ValueError(f"dear.KFAC: grad_worker_fraction must be in [0, 1] or a "
                         f"DistributedStrategy, got {fraction!r}")
    if fraction == 0:
        fraction = 1.0 / world
    exact = max(1.0, world * fraction)            # KAISA's gradient workers per layer
    workers = round(exact)
    if abs(exact - workers) > 1e-9 or world % workers != 0:
        raise ValueError(f"dear.KFAC: grad_worker_fraction={fraction} on {world} ranks does not "
                         "give gradient-worker groups of equal size (world * fraction must be "
                         "an integer that divides the world size)")
    if workers == world:
        return Strategy.COMM_OPT, None
    if workers == 1:
        return Strategy.MEM_OPT, None
    return Strategy.HYBRID_OPT, workers


def _dtype(value: Any, what: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    raise TypeError(f"dear.KFAC: {what} must be a torch.dtype or None, got {value!r}")


def settings(world: int, *, method: Any, strategy: Any, skip_layers: Iterable[str | type] | None,
             pipeline_factors: Any, symmetry_aware: bool, redundancy: bool, bucket_cap_mb: Any,
             compute_method: Any = None, grad_worker_fraction: Any = None,
             update_factors_in_hook: bool | None = None,
             allreduce_bucket_cap_mb: float | None = None,
             accumulation_steps: int | None = None, assignment_strategy: Any = None,
             colocate_factors: bool | None = None, factor_dtype: Any = None,
             inv_dtype: Any = None, compute_eigenvalue_outer_product: bool = True) -> Settings:
    """Settings from dear's and kfac-pytorch's arguments (see the module docstring)."""
    chosen = parse(ComputeMethod, one_of("method", method, "eigen", "compute_method",
                                         compute_method), "compute_method")
    workers = None
    if grad_worker_fraction is None:
        plan_strategy = parse(Strategy, strategy, "strategy")
        if plan_strategy is Strategy.HYBRID_OPT:
            raise ValueError("dear.KFAC: hybrid-opt is chosen with grad_worker_fraction= "
                             "(the fraction of ranks that precondition each layer)")
    else:
        if strategy not in ("auto", Strategy.AUTO):
            raise ValueError("dear.KFAC: strategy= and grad_worker_fraction= both choose the "
                             "distribution; pass one of them")
        plan_strategy, workers = strategy_from_fraction(grad_worker_fraction, world)
    in_hook = one_of("pipeline_factors", pipeline_factors, True, "update_factors_in_hook",
                     update_factors_in_hook)
    cap = one_of("bucket_cap_mb", bucket_cap_mb, 25.0, "allreduce_bucket_cap_mb",
                 allreduce_bucket_cap_mb)
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap < 0 or (
            cap == 0 and allreduce_bucket_cap_mb is None):
        raise ValueError(f"dear.KFAC: bucket_cap_mb must be > 0, got {cap}")
    if accumulation_steps is not None and (isinstance(accumulation_steps, bool) or not isinstance(
            accumulation_steps, int) or accumulation_steps < 1):
        raise ValueError(f"dear.KFAC: accumulation_steps must be an integer >= 1, got "
                         f"{accumulation_steps!r}")
    assignment = None if assignment_strategy is None else parse(
        AssignmentStrategy, assignment_strategy, "assignment_strategy")
    return Settings(
        method=chosen, strategy=plan_strategy, grad_workers=workers,
        pipeline=bool(in_hook),
        accumulation_steps=accumulation_steps if in_hook else None, assignment=assignment,
        colocate=bool(colocate_factors) if colocate_factors is not None else False,
        symmetric=symmetry_aware, redundancy=redundancy and assignment is None,
        # 0 (kfac-pytorch: no bucketing): one factor per message
        bucket_cap_bytes=int(cap * 2**20) if cap > 0 else 1,
        factor_dtype=_dtype(factor_dtype, "factor_dtype"),
        inv_dtype=_dtype(inv_dtype, "inv_dtype"),
        outer_product=bool(compute_eigenvalue_outer_product),
        skip_layers=tuple(skip_layers or ()))
