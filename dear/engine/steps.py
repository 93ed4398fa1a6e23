"""step() and synchronize(): which path an iteration's end takes, and the checks before it.

The ordinary step() is `refuse_edited_grads` -> `engine.reduce` -> `engine.gather`. The other
paths: a step() with no backward before it (Horovod's broadcast_optimizer_state), a step that
finds the trained parameters changed (dear/engine/layout.py), Horovod's
synchronize()/skip_synchronize() loop, and a step a GradScaler skips (dear/engine/amp_clip.py).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from ..comm import flight
from ..shardops import amp
from . import amp_clip, checks

if TYPE_CHECKING:
    from .engine import Engine


def step(engine: "Engine", closure: Optional[Callable[[], float]] = None,
         grad_scaler: Optional[Any] = None) -> None:
    """Finish averaging and start the all-gathers; the update lands in the next forward."""
    if closure is not None:
        raise ValueError("dear.DistributedOptimizer.step() does not take a closure: the "
                         "update is applied later, in the next forward pass")
    if engine.options.elastic and engine.comm.moved:
        engine.rejoin()                        # Horovod re-formed the world since the backward
    flight.mark("step", engine.step_number)
    for listener in engine.listeners.steps:    # dear.KFAC learns the loss scale (amp.py)
        listener(grad_scaler)
    amp.check_contract(engine.opt, grad_scaler)
    it = engine.iteration
    if not it.synchronized and engine.had_gradients:
        if grad_scaler is not None and amp.unscaled_by_user(grad_scaler, engine.opt):
            engine.abandon_iteration()
            raise RuntimeError(
                "scaler.unscale_(optimizer) does not work with dear.DistributedOptimizer: "
                "dear took the local gradients during backward, so unscale_ changes nothing "
                "that is reduced and the step would be unscaled twice. Drop "
                "scaler.unscale_(optimizer); to clip, call optimizer.clip_grad_norm_("
                "max_norm, grad_scaler=scaler) instead, or use Horovod's pattern: "
                "optimizer.synchronize(); scaler.unscale_(optimizer); <clip>; with "
                "optimizer.skip_synchronize(): scaler.step(optimizer)")
        checks.refuse_edited_grads(engine)
    elif not it.synchronized and _zero_grads_only(engine):
        # Horovod's broadcast_optimizer_state: on ranks whose state is empty it sets every
        # .grad to zeros and calls step() (rank 0 does not). Averaging zeros gives zeros, so
        # the wrapped optimizer's own step is the same update, with no collective to hang.
        engine.flush()
        engine.updates.check_step_without_backward()
        engine.inner_step(engine.opt)
        return
    if not it.synchronized and engine.trained.changed(engine.opt, it.check_contents):
        step_with_new_parameters(engine, grad_scaler)
        return
    if it.synchronized:                        # Horovod loop: .grad already holds the average
        if not engine.skip_sync and not it.preconditioner_synced:
            # Horovod's wording first: scripts filter this warning by its message.
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                          "context after optimizer.synchronize(): the gradients are "
                          "already averaged and are applied as they are")
        engine.end_iteration()                 # its synchronize() flags with it
        engine.updates.unshard(engine)         # the step reads whole tensors (every rank)
        if grad_scaler is None or not amp.unscale_averaged_grads(grad_scaler, engine.opt):
            engine.inner_step(engine.opt)
        warmed = engine.feedback is not None and engine.feedback.after_step(engine)
        engine.relayout_if_wanted(also=warmed)   # nothing is in flight after a synchronized step
        return
    if engine.skip_sync:
        raise RuntimeError("step() inside skip_synchronize() needs optimizer.synchronize() "
                           "after backward, as in Horovod")
    communicate(engine, grad_scaler)
    if engine.sparse is not None:              # their update is applied now (dear/engine/sparse.py)
        engine.stream.settle()
        engine.sparse.apply(engine.opt, grad_scaler)
    layout = engine.layout
    if not engine.options.overlap or layout is None or layout.provisional:
        engine.flush()
    engine.discard_provisional_layout()
    if engine.autotuner is not None and engine.layout is not None:
        switch = engine.autotuner.on_step()
        if switch is not None:                 # same step() on every rank
            engine.flush()                     # no bucket may be in flight while re-planned
            engine.relayout(switch)
    if engine.feedback is not None and engine.feedback.after_step(engine):
        engine.flush()                         # the warm-up is over: quantized buckets now
        engine.relayout(engine.fusion)


def communicate(engine: "Engine", grad_scaler: Optional[Any] = None,
                gradients: bool = False) -> None:
    """Finish averaging, run GradScaler's check on the reduced shards, and start the
    all-gathers in forward order; a step the scaler skips gathers nothing, on every rank.
    With shard_optimizer_state each rank first updates its shards, and the all-gathers
    carry parameters (`gradients`: the averaged gradients all the same, synchronize())."""
    engine.reduce(at_step=not gradients)
    engine.updates.settle(engine, grad_scaler, gradients)
    if engine.buffer_sync is not None:         # dear/engine/buffers.py: DDP's broadcast_buffers
        engine.buffer_sync(rescan=engine.iteration.check_contents)
    # dear/engine/sparse.py: Embedding(sparse=True) weights
    if engine.sparse is not None:
        engine.sparse.reduce(engine.options.prescale, engine.postscale)
    skip = grad_scaler is not None and amp_clip.amp_skips(engine, grad_scaler)
    engine.gather(skip=skip, gradients=gradients)


def _zero_grads_only(engine: "Engine") -> bool:
    """Every .grad is None or all zeros (no backward ran since the last step())."""
    return all(p.grad is None or (not p.grad.is_sparse and not p.grad.any())
               for p in engine.params)


def step_with_new_parameters(engine: "Engine", grad_scaler: Optional[Any]) -> None:
    """add_param_group, or requires_grad flipped (gradual unfreezing, freezing): this step
    runs synchronously, the layout's buckets averaging what they hold, one all-reduce the
    gradients of parameters outside the layout, the wrapped optimizer updating everything
    now (as single-process training); the layout is rebuilt for the next iteration, its
    order learnt again in the next forward. The stream check inside makes sure every rank
    changed the same way."""
    if engine.options.groups is not None or engine.transform is not None \
            or engine.autotuner is not None:
        what = ("groups=" if engine.options.groups is not None else
                "dear.KFAC" if engine.transform is not None else "autotune")
        raise RuntimeError(
            "dear: the optimizer's trained parameters changed (add_param_group or "
            f"requires_grad), which {what} does not support: freeze nothing after the "
            "wrap, or wrap again with the final parameter set")
    synchronize_now(engine)               # checks every rank's new parameter set
    engine.iteration.synchronized = False
    engine.updates.unshard(engine)
    _average_outside_layout(
        engine, [p for p in engine.trained.trainable(engine.opt) if p not in engine.index])
    if grad_scaler is None or not amp.unscale_averaged_grads(grad_scaler, engine.opt):
        engine.inner_step(engine.opt)
    engine.adopt_parameter_set()


def _average_outside_layout(engine: "Engine", params: list[torch.nn.Parameter]) -> None:
    """Average the gradients of parameters the layout does not hold (one all-reduce per
    dtype); a parameter no rank produced a gradient for keeps None."""
    comm = engine.comm
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            raise RuntimeError("dear: a sparse gradient on a parameter added after the "
                               "wrap; wrap with every sparse parameter from the start")
        by_kind.setdefault((p.dtype, p.device), []).append(p)
    for (dtype, device), group in by_kind.items():
        comm.check_dtype(dtype)
        numel = sum(p.numel() for p in group)
        flat = torch.zeros(numel + len(group), dtype=dtype, device=device)
        offset = 0
        for k, p in enumerate(group):
            if p.grad is not None:
                flat[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
                flat[numel + k] = 1
            offset += p.numel()
        flat[:numel].mul_(engine.options.prescale)
        if comm.size > 1:
            comm.all_reduce(flat).wait()
        flat[:numel].mul_(engine.postscale)
        offset = 0
        for k, p in enumerate(group):
            if flat[numel + k].item() > 0:
                p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()


# ------------------------------------------------------------------ Horovod's synchronize()
def synchronize(engine: "Engine") -> None:
    """Horovod's meaning. After backward: finish averaging now and put the averaged gradients
    in .grad. After step(): apply the pending updates."""
    if engine.pending.count or not engine.had_gradients:
        engine.flush()
        return
    synchronize_now(engine)


def synchronize_now(engine: "Engine") -> None:
    """Averaged gradients in .grad now (synchronize() after a backward)."""
    checks.refuse_edited_grads(engine)
    communicate(engine, gradients=True)
    if engine.sparse is not None:              # averaged sparse gradients in .grad, as Horovod
        engine.sparse.to_grad()
    assert engine.buckets is not None
    for bucket in engine.buckets:
        used = engine.finish_all_gather(bucket)
        engine.apply_deferred(bucket)
        for p, view, u in zip(bucket.params, bucket.grad_views, used):
            if not u:
                if engine.views is not None and engine.views.owns(p):
                    p.grad = None              # as single-process training: no gradient
                continue
            if p.grad is None:
                p.grad = view.clone()
            elif p.grad.data_ptr() != view.data_ptr():   # a view of the buffer: in place
                p.grad.copy_(view)
        bucket.reset()
    engine.gathered_by_hand()
    engine.iteration.synchronized = True
    engine.discard_provisional_layout()


__all__ = ["communicate", "step",
           "synchronize", "synchronize_now"]

