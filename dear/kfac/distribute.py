"""Who decomposes, who preconditions, and what is broadcast, once the plan is made.

  COMM_OPT    each factor decomposed by its owner (or everywhere), decompositions broadcast to
              every rank; every rank preconditions every layer.
  MEM_OPT/PAD the layer's owner decomposes both factors and preconditions; the result is
              broadcast from it to every rank.
  HYBRID_OPT  KAISA's grid (dear/kfac/grid.py): decompositions broadcast within the layer's
              column, whose ranks precondition; each row gets the result from its member in
              that column.
Preconditioning and the KL clip are the same arithmetic on every rank, on the same bits in the
same layout (dear/kfac/linalg.py), so replicas stay bitwise equal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .assignment import EVERYWHERE
from .comm import Transport
from .enums import ComputeMethod, Strategy
from .exchange import BroadcastExchange
from .grid import grid_transports
from .linalg import flat_size, flatten, precondition, unflatten
from .planner import Plan
from .state import LayerState


class Distribution:
    def __init__(self, layers: Sequence[LayerState], order: Sequence[int], plan: Plan,
                 transport: Transport, method: ComputeMethod, cap_bytes: int) -> None:
        self.layers, self.plan, self.method = layers, plan, method
        self.rank = transport.rank
        self.decs: BroadcastExchange | None = None     # decompositions
        self.grads: BroadcastExchange | None = None    # preconditioned gradients
        if transport.size == 1:
            return
        device = layers[0].device
        cap = max(1, cap_bytes // layers[0].inv_dtype.itemsize)
        dec_items: list[tuple[tuple[Any, ...], int, int]] = []    # (key, size, root)
        grad_items: list[tuple[tuple[Any, ...], int, int]] = []
        dec_transport = grad_transport = transport
        columns = plan.columns
        if plan.strategy is Strategy.HYBRID_OPT:
            dec_transport, grad_transport = grid_transports(transport, columns)
        for i in order:
            s = self.layers[i]
            # hybrid: only the layers of this rank's column are held here
            held = not columns or self.column(i) == self.rank % columns
            if plan.strategy in (Strategy.COMM_OPT, Strategy.HYBRID_OPT) and held:
                for which, owner in (("A", plan.a_owner[i]), ("G", plan.g_owner[i])):
                    if owner != EVERYWHERE:
                        diagonal = which == "A" and s.layer.diagonal_a
                        dim = s.layer.a_dim if which == "A" else s.layer.g_dim
                        root = owner // columns if columns else owner  # index in the column
                        dec_items.append(((which, i), flat_size(method, dim, diagonal), root))
            if plan.strategy is Strategy.COMM_OPT or plan.layer_owner[i] == EVERYWHERE:
                continue
            root = self.column(i) if columns else plan.layer_owner[i]
            grad_items.append(((i,), s.layer.a_dim * s.layer.g_dim, root))
        if dec_items:
            self.decs = BroadcastExchange(dec_items, [self.layers[k[1]].inv_dtype
                                                      for k, _, _ in dec_items],
                                          dec_transport, cap, device)
        if grad_items:
            self.grads = BroadcastExchange(grad_items, [self.layers[k[0]].inv_dtype
                                                        for k, _, _ in grad_items],
                                           grad_transport, cap, device)

    def column(self, i: int) -> int:
        return self.plan.layer_owner[i] % self.plan.columns

    def _mine(self, owner: int) -> bool:
        return owner == EVERYWHERE or owner == self.rank

    def preconditions(self, i: int) -> bool:
        """Whether this rank computes layer i's preconditioned gradient itself."""
        plan = self.plan
        if plan.strategy is Strategy.COMM_OPT or self.grads is None:
            return True
        if plan.columns:
            return self.rank % plan.columns == self.column(i)
        return self._mine(plan.layer_owner[i])

    # ------------------------------------------------------------------ decompositions
    def decompose(self, damping: float) -> None:
        """Decompose what this rank owns and share it as the plan says."""
        plan, decs = self.plan, self.decs
        for s in self.layers:
            for which, owner in (("A", plan.a_owner[s.index]), ("G", plan.g_owner[s.index])):
                if self._mine(owner):
                    dec = s.decompose(which, self.method, damping)
                    setattr(s, "a_dec" if which == "A" else "g_dec", dec)
                    key = (which, s.index)
                    if decs is not None and key in decs:
                        flatten(dec, decs.slot(key))
                        decs.mark(key)
        if decs is None:
            return
        decs.run()
        for s in self.layers:
            for which, owner in (("A", plan.a_owner[s.index]), ("G", plan.g_owner[s.index])):
                key = (which, s.index)
                if key in decs and not self._mine(owner):
                    diagonal = which == "A" and s.layer.diagonal_a
                    dim = s.layer.a_dim if which == "A" else s.layer.g_dim
                    flat = decs.get(key)
                    assert flat is not None
                    setattr(s, "a_dec" if which == "A" else "g_dec",
                            unflatten(flat, self.method, dim, diagonal))
        decs.reset()

    # ------------------------------------------------------------------ gradients
    def precondition(self, damping: float, lr: float, kl_clip: float | None,
                     grad_scale: float = 1.0) -> None:
        """Replace each layer's .grad by its KL-clipped preconditioned gradient. `grad_scale`:
        the loss scale the gradients still carry (the KL sum is divided by its square)."""
        grads = {s.index: s.layer.grad_matrix() for s in self.layers}
        done: dict[int, Tensor] = {}
        exchange = self.grads
        for s in self.layers:
            if self.preconditions(s.index):
                p = _precondition_layer(s, grads[s.index], damping)
                if p is not None:
                    done[s.index] = p
                    if exchange is not None and (s.index,) in exchange:
                        exchange.put((s.index,), p)
        if exchange is not None:
            exchange.run()
            for s in self.layers:
                if not self.preconditions(s.index):
                    flat = exchange.get((s.index,))
                    if flat is not None:
                        done[s.index] = flat.view(s.layer.g_dim, s.layer.a_dim)
        nu = 1.0
        if kl_clip:
            # in float64: a float32 product can overflow long before nu becomes tiny
            vg = 0.0
            for i in sorted(done):
                grad = grads[i]
                if grad is not None:
                    vg += float(torch.dot(done[i].reshape(-1).double(), grad.reshape(-1).double()))
            vg *= lr ** 2 / grad_scale ** 2
            if vg != 0 and math.isfinite(vg):
                nu = min(1.0, math.sqrt(kl_clip / abs(vg)))
        for i in sorted(done):
            layer = self.layers[i].layer
            if layer.weight.grad is None:
                layer.weight.grad = torch.zeros_like(layer.weight)
            layer.set_grad(done[i] * nu)
        if exchange is not None:
            exchange.reset()


def _precondition_layer(s: LayerState, grad: Tensor | None, damping: float) -> Tensor | None:
    if grad is None or s.a is None or s.g is None or s.a_dec is None or s.g_dec is None:
        return None
    out = precondition(grad, s.a_dec, s.g_dec, damping)
    if not torch.isfinite(out).all():
        s.warn_once("nonfinite-grad", "dear.KFAC: layer %s: the preconditioned gradient is "
                    "not finite (is the gradient?); its gradient is left unpreconditioned",
                    s.name)
        return None
    return out
