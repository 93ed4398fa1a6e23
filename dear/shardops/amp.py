"""torch.amp.GradScaler with dear.DistributedOptimizer.

GradScaler's own inf check and unscale read the optimizer's `.grad`, which under dear are each
rank's LOCAL gradients, already copied into the buckets. Checking those would let ranks disagree
about skipping (an overflow on one rank only), miss overflows that only the reduction produces
(fp16 on the wire), and unscaling them would not reach the buckets. So the optimizer declares
`_step_supports_amp_scaling`: `scaler.step(optimizer)` then calls `optimizer.step(grad_scaler=
scaler)` and leaves the check to the optimizer (the contract in torch/amp/grad_scaler.py, torch
2.x). dear checks and unscales the REDUCED shards, agrees on found-inf with one tiny all-gather,
skips the update on every rank when any rank's shard overflowed, and puts the agreed found-inf
where `scaler.update()` reads it, so every rank's scale moves the same way.

Every use of GradScaler's private state is in this module.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any, Sequence

import torch
from torch.amp.grad_scaler import OptState

from ..comm.base import Communicator
from ..fusion.bucket import Bucket
from ..interfaces import DearOptimizer
from .shards import gather_small, gradient_slices

# GradScaler warns, once per call site, that it will stop passing itself to such optimizers. The
# warning is for us, not for the user calling scaler.step(); tests/test_amp.py fails if the
# contract changes.
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself",
                        category=FutureWarning)


def inverse_scale(scaler: Any) -> torch.Tensor:
    """1 / scale in float32, as GradScaler.unscale_ multiplies by it."""
    scale = scaler._get_scale_async()  # torch's GradScaler  # noqa: SLF001
    if scale is None:
        raise RuntimeError("scaler.step(optimizer) before scaler.scale(loss): there is no scale "
                           "to undo; call scaler.scale(loss).backward() first")
    return scale.double().reciprocal().float()   # as GradScaler.unscale_ does


def unscale_local(buckets: Sequence[Bucket], rank: int, scaler: Any,
                  in_place: bool = True) -> torch.Tensor:
    """Unscale this rank's reduced shards in place; return 1.0 if any is inf/NaN, else 0.0.
    `in_place=False` only checks (chunks already gathered get the factor after the gather,
    dear/fusion/schedule.py; the others must match them)."""
    if any(b.spec.dtype == torch.float16 for b in buckets):
        # Same rule as GradScaler.unscale_: fp16 master gradients lose too much when unscaled.
        raise ValueError("GradScaler cannot unscale float16 gradients (torch refuses them too: "
                         "'Attempting to unscale FP16 gradients'); keep the parameters in "
                         "float32 and run the forward under torch.autocast, or use bfloat16")
    device = buckets[0].shard.device
    found = torch.zeros((), dtype=torch.float32, device=device)
    inv_scale = (inverse_scale(scaler) if in_place else torch.ones((), dtype=torch.float32)
                 ).to(device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for piece in gradient_slices(buckets, rank):
        by_dtype[piece.dtype].append(piece)
    for pieces in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(pieces, found, inv_scale)
    return found


def agree(comm: Communicator, found: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of each rank's local found-inf (> 0: skip on every rank)."""
    return gather_small(comm, found.view(1), "the inf/NaN check (GradScaler)").sum()


def record(scaler: Any, optimizer: Any, found: torch.Tensor) -> None:
    """Make `scaler.update()` see the agreed found-inf (it sums these per-device tensors)."""
    per_device = scaler._found_inf_per_device(optimizer)  # torch's GradScaler  # noqa: SLF001
    per_device.clear()
    per_device[found.device] = found.float()


def unscaled_by_user(scaler: Any, optimizer: Any) -> bool:
    """Whether the user called scaler.unscale_(optimizer) in this iteration."""
    # torch's GradScaler: no public API for this
    return scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.UNSCALED  # noqa: SLF001


def unscale_averaged_grads(scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """After optimizer.synchronize() `.grad` holds the averaged gradient, the same bits on every
    rank, so GradScaler's own unscale_ is right as it is. Return whether to skip the update."""
    if not unscaled_by_user(scaler, optimizer):
        scaler.unscale_(optimizer)
    found = scaler._found_inf_per_device(optimizer)  # torch's GradScaler  # noqa: SLF001
    return bool(sum(v.item() for v in found.values()))


def add_step_listener(optimizer: DearOptimizer, listener: Any) -> None:
    """dear.KFAC (dear/kfac/scaling.py) learns the loss scale from here: `listener(grad_scaler)`
    is called at the start of every step() of this optimizer, before anything is unscaled."""
    optimizer.dear_on_step(listener)


def check_contract(optimizer: torch.optim.Optimizer, grad_scaler: Any) -> None:
    """A GradScaler that sets optimizer.found_inf instead of passing itself (the protocol torch
    announces) would bypass dear's check of the reduced gradient: refuse rather than mis-step.
    step() calls this first (after dear.KFAC's listeners, add_step_listener)."""
    if grad_scaler is None and getattr(optimizer, "found_inf", None) is not None:
        raise RuntimeError("this torch's GradScaler no longer passes itself to optimizer.step("
                           "grad_scaler=...); dear's GradScaler support "
                           "(dear/shardops/amp.py) must be updated for it")
