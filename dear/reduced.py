"""What a training loop does to the averaged gradient between backward and step(), under DeAR.

Between the reduce-scatter and the all-gather the averaged gradient exists only as one shard per
rank (dear/shards.py). GradScaler's unscale and inf check (dear/amp.py) and clipping by the global
norm (dear/clip.py) are applied there, so they see exactly what DDP users see in the all-reduced
`.grad`, cost no extra pass over the full gradient, and take effect before the deferred update.
After `optimizer.synchronize()` (Horovod's loop) `.grad` holds the average itself and torch's own
GradScaler.unscale_ and clip_grad_norm_ apply as they are.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

import torch

from . import amp, clip


class ReducedGradientMixin:
    """Methods of dear.DistributedOptimizer; they use its bucket state (see dear/deferred.py:
    `_finish_reduce`, `_end_iteration`, `_buckets`, `_comm`, `_iteration`, `_params`)."""

    # GradScaler.step() then calls step(grad_scaler=scaler) and leaves the inf check to the
    # optimizer: see dear/amp.py for why it must look at the reduced gradient.
    _step_supports_amp_scaling = True

    if TYPE_CHECKING:
        _buckets: Any
        _comm: Any
        _params: list
        _iteration: Any
        _schedule: Any

        def _finish_reduce(self, verify: bool = True) -> None: ...
        def _gathered_early(self) -> bool: ...
        def _refuse_edited_grads(self) -> None: ...
        def _end_iteration(self) -> None: ...

    def _amp_skips(self, grad_scaler: Any) -> bool:
        """GradScaler's unscale and inf check, on the reduced shards; True: skip on every rank."""
        if self._iteration.amp_found_inf is None:
            if self._iteration.clipped_scaled and amp.unscaled_by_user(grad_scaler, self):
                self._end_iteration()
                raise RuntimeError(
                    "scaler.unscale_(optimizer) does not reach dear's reduced gradients, so "
                    "optimizer.clip_grad_norm_() clipped them still scaled; this step was "
                    "dropped. Pass the scaler instead: optimizer.clip_grad_norm_(max_norm, "
                    "grad_scaler=scaler), without scaler.unscale_(optimizer)")
            assert self._buckets is not None
            try:
                found = self._unscale_shards(grad_scaler)
            except ValueError:                 # e.g. fp16 gradients: the same on every rank
                self._end_iteration()
                raise
            self._iteration.amp_found_inf = amp.agree(self._comm, found)
        amp.record(grad_scaler, self, self._iteration.amp_found_inf)
        return bool(self._iteration.amp_found_inf.item() > 0)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, *,
                        grad_scaler: Optional[Any] = None) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ applied to the AVERAGED gradient (what DDP users clip),
        computed from the reduced shards; returns the total norm. Call it on every rank after the
        last backward and before step(). With a GradScaler pass grad_scaler=scaler instead of
        calling scaler.unscale_(optimizer): the reduced gradient is unscaled first."""
        norm_type = clip.check_norm_type(norm_type)
        if self._iteration.synchronized:       # .grad holds the average, the same on every rank
            if grad_scaler is not None and not amp.unscaled_by_user(grad_scaler, self):
                grad_scaler.unscale_(self)
            return torch.nn.utils.clip_grad_norm_(
                [p for p in self._params if p.grad is not None], max_norm, norm_type,
                error_if_nonfinite)
        self._refuse_edited_grads()
        self._finish_reduce()
        assert self._buckets is not None
        found = None
        if grad_scaler is not None and self._iteration.amp_found_inf is None:
            found = self._unscale_shards(grad_scaler)
        total, agreed = clip.global_norm(self._buckets, self._comm, norm_type, found)
        if self._gathered_early():    # the shards are still scaled by what was deferred
            for factor in self._iteration.deferred:
                total = total * factor.to(total.dtype)
        if agreed is not None:
            self._iteration.amp_found_inf = agreed
            amp.record(grad_scaler, self, agreed)
        it = self._iteration
        it.clipped_scaled |= grad_scaler is None and it.amp_found_inf is None
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"the total norm of order {norm_type} of the averaged gradients "
                               "is non-finite, so it cannot be clipped; set "
                               "error_if_nonfinite=False to scale them by it anyway")
        if max_norm != math.inf:
            coef = clip.coefficient(total, max_norm)
            if self._gathered_early():
                self._iteration.deferred.append(coef)
            else:
                clip.scale_(self._buckets, self._comm.rank, coef)
                self._iteration.scaled.append(coef)
        return total

    def _unscale_shards(self, grad_scaler: Any) -> torch.Tensor:
        """GradScaler's check (and unscale) of this rank's shards; with chunks already
        gathered in backward the unscale is deferred to after the gather, for every bucket."""
        if self._gathered_early():
            found = amp.unscale_local(self._buckets, self._comm.rank, grad_scaler, in_place=False)
            self._iteration.deferred.append(amp.inverse_scale(grad_scaler))
            return found
        return amp.unscale_local(self._buckets, self._comm.rank, grad_scaler)

    def grad_norm(self, norm_type: float = 2.0, *, grad_scaler: Optional[Any] = None
                  ) -> torch.Tensor:
        """The norm of the AVERAGED gradient, the same bits on every rank (what DDP users log
        from the all-reduced `.grad`; under dear `.grad` holds each rank's local gradient until
        the next forward). From the reduced shards, one tiny all-gather; changes nothing. Call
        it on every rank after the last backward and before step()."""
        return self.clip_grad_norm_(math.inf, norm_type, grad_scaler=grad_scaler)
