"""The loss scale under mixed precision (torch.amp.GradScaler), which K-FAC must undo.

Gradients w.r.t. layer outputs arrive multiplied by the scale s, so G = g^T g / n comes out s^2
too large. As kfac-pytorch does, the output gradient is divided by s before G is formed; s comes
from `grad_scaler=` (a GradScaler, or a callable returning the current scale).

With dear.DistributedOptimizer the scaler is also picked up when the optimizer is stepped
through it: `scaler.step(optimizer)` calls `optimizer.step(grad_scaler=scaler)`, and
dear/shardops/amp.py tells the listeners registered here. That comes AFTER precond.step() in the
  iteration, so: * from the second step on, the scaler seen at the previous optimizer step gives
    the scale (GradScaler.update() ran since, so its scale is the one this backward used);
  * the first step cannot know whether the gradients are scaled. In dear's plain loop
    (backward(); precond.step(); optimizer.step()) nothing reads the gradients in between, so
    it is deferred: the hooks keep the raw factors, precond.step() returns, and the step runs
    at the start of optimizer.step() with the scale known (or known to be 1). GradScaler's
    powers of two divide exactly: the same bits as with grad_scaler=. If something reduced or
    synchronized the gradients in between (clip_grad_norm_, Horovod's loop), the first step
    runs unscaled and optimizer.step() raises if a GradScaler then turns up, before the update
    is applied: pass grad_scaler= in those loops.
In dear's loop the gradients themselves are still scaled when K-FAC preconditions them (the
optimizer unscales the reduced gradient afterwards). Preconditioning is linear in the gradient,
but the KL clip is not: <P(s g), s g> = s^2 <P(g), g>, so it is divided by s^2. Without dear's
optimizer, kfac-pytorch's loop (scaler.unscale_(optimizer) before precond.step()) applies.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from ..shardops import amp


def as_scale_source(grad_scaler: Any) -> Callable[[], float] | None:
    """A callable returning the current scale, from a GradScaler or a callable (or None)."""
    if grad_scaler is None:
        return None
    if hasattr(grad_scaler, "get_scale"):
        return grad_scaler.get_scale
    if callable(grad_scaler):
        return grad_scaler
    raise TypeError(f"dear.KFAC: grad_scaler must be a torch.amp.GradScaler or a callable "
                    f"returning the current loss scale, got {grad_scaler!r}")


class LossScale:
    """The scale of the current iteration's gradients, as far as dear.KFAC can know it."""

    def __init__(self, grad_scaler: Any) -> None:
        self._explicit = as_scale_source(grad_scaler)
        self._scaler = grad_scaler if hasattr(grad_scaler, "get_scale") else None
        self._seen: Any = None            # the GradScaler dear's optimizer was last stepped with
        self._listening: set[int] = set()
        self.stepped = False              # a dear optimizer step() was seen (scaler or not)
        self._cached: tuple[int, float] | None = None
        self.pending: Callable[[], None] | None = None   # the deferred first step
        self._assumed_unscaled = False    # a first step ran taking the gradients as unscaled

    def known(self) -> bool:
        """Whether the scale of this iteration is known (explicit, or a dear step was seen)."""
        return self._explicit is not None or self.stepped

    def value(self, step: int) -> float:
        """The current scale (1.0 without a scaler), read once per K-FAC step."""
        if self._cached is not None and self._cached[0] == step:
            return self._cached[1]
        source = self._explicit or (self._seen.get_scale if self._seen is not None else None)
        scale = 1.0 if source is None else float(source())
        if not scale > 0:
            raise ValueError(f"dear.KFAC: the loss scale must be > 0, got {scale}")
        self._cached = (step, scale)
        return scale

    def listen(self, optimizer: Any) -> None:
        """Hear of every step() of this dear.DistributedOptimizer (and its GradScaler)."""
        if id(optimizer) in self._listening:
            return
        self._listening.add(id(optimizer))
        me, opt = weakref.ref(self), weakref.ref(optimizer)

        def heard(grad_scaler: Any) -> None:
            scale = me()
            if scale is not None:
                scale.on_optimizer_step(grad_scaler, opt())
        amp.add_step_listener(optimizer, heard)

    def defer_or_assume(self, optimizer: Any, run: Callable[[], None]) -> bool:
        """First step with dear's optimizer and no grad_scaler=: True if `run` was deferred to
        the optimizer's step(); False: run it now, taking the gradients as unscaled."""
        if optimizer.dear_synchronized:
            self._assumed_unscaled = True
            return False
        self.pending = run
        return True

    def on_optimizer_step(self, grad_scaler: Any, optimizer: Any) -> None:
        self._seen, self.stepped, self._cached = grad_scaler, True, None
        pending, self.pending = self.pending, None
        assumed, self._assumed_unscaled = self._assumed_unscaled, False
        if pending is not None and optimizer is not None and (
                optimizer.dear_synchronized or optimizer.dear_iteration.reduced):
            raise RuntimeError(
                "dear.KFAC: the gradients were reduced (e.g. optimizer.clip_grad_norm_) between "
                "precond.step() and optimizer.step() on the first step, which dear.KFAC had "
                "deferred to optimizer.step() to learn the loss scale; preconditioning them now "
                "would change the order of the two. This update was not applied. Pass "
                "grad_scaler=scaler to dear.KFAC (grad_scaler=lambda: 1.0 without a GradScaler)")
        if pending is not None:
            pending()
        if assumed and grad_scaler is not None:
            raise RuntimeError(
                "dear.KFAC: this optimizer is stepped through a GradScaler, but dear.KFAC's "
                "first step ran on gradients already synchronized (Horovod's loop) without "
                "knowing the loss scale, so its G factors and KL clip used scaled gradients. "
                "This update was not applied. Pass grad_scaler=scaler to dear.KFAC")

    def gradients_scaled(self, optimizer: Any) -> bool:
        """Whether the gradients dear.KFAC preconditions now are still multiplied by the scale.
        Without dear's optimizer: no (kfac-pytorch's loop unscales before precond.step()). In
        dear's loop: yes until the optimizer unscales them, unless optimizer.clip_grad_norm_(
        grad_scaler=) (on the shards) or scaler.unscale_() (after synchronize()) already did."""
        if optimizer is None or not (self._explicit is not None or self._seen is not None):
            return False
        scaler = self._seen if self._seen is not None else self._scaler
        if optimizer.dear_synchronized:
            return scaler is None or not amp.unscaled_by_user(scaler, optimizer)
        return optimizer.dear_iteration.amp_found_inf is None
