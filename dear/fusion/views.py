"""gradient_as_bucket_view (DDP's name): each parameter's .grad is a view of its bucket's buffer.

Backward then accumulates straight into the memory the reduce-scatter sends, so the gradients
cost no memory beside the buckets and dear copies nothing (autograd adds each new gradient into
its view instead, on the backward thread, as under DDP's views). After the update (applied in
the next forward, or by flush_updates() / synchronize()) .grad holds the averaged gradient, as
in DDP and Horovod.

What changes for the user, and why:
- .grad is never None for a parameter dear manages: zero_grad() zeroes the views in place (a
  zero_grad(set_to_none=True) still leaves out, as single-process training would, the
  parameters that get no gradient before the next step()). A pending update still needs the
  gathered gradients, so their zeroing waits until it has been applied.
- Between backward handing a gradient to dear and the update, the buffer belongs to the
  collectives: an edit of .grad then is refused at step(), as without views. dear's own writes
  go through an alias with its own version counter (`Tensor.data`), so the views' version
  counter moves only when autograd or the user writes.
- A .grad replaced by another tensor (model.zero_grad(), create_graph=True) is copied into the
  view when backward hands it over and .grad points at the view again, as DDP does.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from .bucket import Bucket, Stage


class GradientViews:
    """The optimizer's side of gradient_as_bucket_view: which .grad is which view, deferred
    zeroing, and the edit check. One instance per optimizer; rebuilt with every layout."""

    def __init__(self) -> None:
        self._where: dict[torch.nn.Parameter, tuple[Bucket, int]] = {}
        self._absent: set[torch.nn.Parameter] = set()     # zero_grad(set_to_none=True) since

    def attach(self, buckets: Iterable[Bucket]) -> None:
        """Point every managed parameter's .grad at its view in the new buckets, carrying over
        what .grad held (nothing is in flight during a re-layout)."""
        self._where = {}
        for bucket in buckets:
            if not bucket.exposes_views:
                continue
            for j, (p, view) in enumerate(zip(bucket.params, bucket.expose_views())):
                self._where[p] = (bucket, j)
                if p.grad is not None and p.grad is not view:
                    if p.grad.is_sparse or p.grad.shape != view.shape:
                        continue               # refused when backward hands it over
                    view.copy_(p.grad)
                    p.grad = view

    def owns(self, p: torch.nn.Parameter) -> bool:
        return p in self._where

    def adopt(self, p: torch.nn.Parameter) -> Optional[torch.Tensor]:
        """The gradient backward just handed over, as p's view (copied there if autograd made a
        new tensor); records the bucket's version so that a later edit is seen."""
        self._absent.discard(p)
        bucket, j = self._where[p]
        view = bucket.user_views[j]
        grad = p.grad
        if grad is not None and grad is not view and not grad.is_sparse \
                and grad.numel() == view.numel():
            view.copy_(grad.view(view.shape))
            p.grad = grad = view
        bucket.taken_version = bucket.user_version()
        return grad

    def absent(self, p: torch.nn.Parameter) -> bool:
        """Zeroed with set_to_none=True and no gradient since: counts as None."""
        return p in self._absent

    def zero_grad(self, p: torch.nn.Parameter, set_to_none: bool) -> bool:
        """Zero p's view (False: .grad is not the view, torch's own rule applies)."""
        bucket, j = self._where[p]
        if p.grad is not bucket.user_views[j]:
            return False
        if bucket.stage is Stage.GATHERING:    # its update still reads the gathered buffer
            bucket.zero_after_update.add(j)
        else:
            bucket.grad_views[j].zero_()         # dear's alias: not an edit
        if set_to_none:
            self._absent.add(p)
        return True

    def edited(self, buckets: Iterable[Bucket]) -> Optional[int]:
        """A parameter (global index) of a bucket whose views were written after backward
        handed its last gradient over, or None."""
        for bucket in buckets:
            if (bucket.exposes_views and bucket.taken_version is not None
                    and bucket.stage is not Stage.GATHERING
                    and bucket.user_version() != bucket.taken_version):
                return bucket.spec.params[0]
        return None
