"""What a training loop does to the averaged gradient between backward and step(), under DeAR.

Between the reduce-scatter and the all-gather the averaged gradient exists only as one shard per
rank (dear/shardops/shards.py). GradScaler's unscale and inf check (dear/shardops/amp.py) and
clipping by the global norm (dear/shardops/clip.py) are applied there, so they see exactly what DDP
users see in the all-reduced `.grad`, cost no extra pass over the full gradient, and take effect
before the deferred update. After `optimizer.synchronize()` (Horovod's loop) `.grad` holds the
average itself and torch's own GradScaler.unscale_ and clip_grad_norm_ apply as they are.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..shardops import amp, clip

if TYPE_CHECKING:
    from .engine import Engine


def amp_skips(engine: "Engine", grad_scaler: Any) -> bool:
    """GradScaler's unscale and inf check, on the reduced shards; True: skip on every rank."""
    it = engine.iteration
    if it.amp_found_inf is None:
        if it.clipped_scaled and amp.unscaled_by_user(grad_scaler, engine.opt):
            engine.end_iteration()
            raise RuntimeError(
                "scaler.unscale_(optimizer) does not reach dear's reduced gradients, so "
                "optimizer.clip_grad_norm_() clipped them still scaled; this step was "
                "dropped. Pass the scaler instead: optimizer.clip_grad_norm_(max_norm, "
                "grad_scaler=scaler), without scaler.unscale_(optimizer)")
        assert engine.buckets is not None
        try:
            found = _unscale_shards(engine, grad_scaler)
        except ValueError:                     # e.g. fp16 gradients: the same on every rank
            engine.end_iteration()
            raise
        it.amp_found_inf = amp.agree(engine.comm, found)
    amp.record(grad_scaler, engine.opt, it.amp_found_inf)
    # A host read (GradScaler's own step() makes the same one): whether to issue the
    # all-gathers at all must be the same decision on every rank.
    return bool(it.amp_found_inf.item() > 0)


def clip_grad_norm_(engine: "Engine", max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, *,
                    grad_scaler: Optional[Any] = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ applied to the AVERAGED gradient (what DDP users clip),
    computed from the reduced shards; returns the total norm (the optimizer's method)."""
    norm_type = clip.check_norm_type(norm_type)
    it = engine.iteration
    if it.synchronized:                        # .grad holds the average, the same on every rank
        if grad_scaler is not None and not amp.unscaled_by_user(grad_scaler, engine.opt):
            grad_scaler.unscale_(engine.opt)
        return torch.nn.utils.clip_grad_norm_(
            [p for p in engine.params if p.grad is not None], max_norm, norm_type,
            error_if_nonfinite)
    from .checks import refuse_edited_grads
    refuse_edited_grads(engine)
    engine.reduce()
    it = engine.iteration                      # (a refused edit starts a new one)
    assert engine.buckets is not None
    found = None
    if grad_scaler is not None and it.amp_found_inf is None:
        found = _unscale_shards(engine, grad_scaler)
    total, agreed = clip.global_norm(engine.buckets, engine.comm, norm_type, found)
    if engine.gathered_early():    # the shards are still scaled by what was deferred
        for factor in it.deferred:
            total = total * factor.to(total.dtype)
    if agreed is not None:
        it.amp_found_inf = agreed
        amp.record(grad_scaler, engine.opt, agreed)
    it.clipped_scaled |= grad_scaler is None and it.amp_found_inf is None
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the averaged gradients "
                           "is non-finite, so it cannot be clipped; set "
                           "error_if_nonfinite=False to scale them by it anyway")
    if max_norm != math.inf:
        coef = clip.coefficient(total, max_norm)
        if engine.gathered_early():
            it.deferred.append(coef)
        else:
            clip.scale_(engine.buckets, engine.comm.rank, coef)
            it.scaled.append(coef)
    return total


def _unscale_shards(engine: "Engine", grad_scaler: Any) -> torch.Tensor:
    """GradScaler's check (and unscale) of this rank's shards; with chunks already
    gathered in backward the unscale is deferred to after the gather, for every bucket."""
    assert engine.buckets is not None
    if engine.gathered_early():
        found = amp.unscale_local(engine.buckets, engine.comm.rank, grad_scaler, in_place=False)
        engine.iteration.deferred.append(amp.inverse_scale(grad_scaler))
        return found
    return amp.unscale_local(engine.buckets, engine.comm.rank, grad_scaler)
