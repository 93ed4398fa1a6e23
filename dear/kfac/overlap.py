"""dear.KFAC inside dear.DistributedOptimizer's schedule, keeping both of DeAR's overlaps.

With method="eigen", P(g) = QG [(QG^T g QA) / D] QA^T with D = dG dA^T + damping, and when every
rank holds every decomposition (comm-opt, or one rank) the preconditioning splits into three
parts that each fit one stage of a fusion bucket's life (dear/fusion/bucket.py):

  backward  a full bucket's layers are rotated in place, V = QG^T g QA (`before_reduce`); the
            rotation is linear, so the reduce-scatter averages V exactly.
  step()    each rank multiplies its shard by 1/D, element by element; rotations keep inner
            products, so <P(g), g> = sum V^2 / D: per-shard partial sums and one scalar
            all-gather give the KL-clip factor nu, applied to the same shards
            (`precondition_shards`).
  forward   after the bucket's all-gather, each layer is rotated back, QG X QA^T
            (`after_gather`), just before the wrapped optimizer's update.

No layer-aligned shards are needed, only a layer's weight and bias in one bucket (the optimizer's
planner keeps them together: `ties`). Steps that refresh the decompositions need this step's
factors, which exist only after backward: dear.KFAC takes the synchronous path on those.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import weakref
from typing import Any

import torch
from torch import Tensor

from ..comm import runtime
from ..fusion.bucket import Bucket
from ..sharding.state import KFAC_REFUSED
from ..shardops.shards import gather_small
from .state import LayerState

log = logging.getLogger("dear")


@dataclasses.dataclass(frozen=True)
class Rotation:
    """The eigenbases one backward pass rotates with. A bucket rotated with it is rotated back
    with the same tensors, whatever the preconditioner holds by then (a load_state_dict)."""

    bases: dict[int, tuple[Tensor, Tensor | None, Tensor, Tensor]]  # QG, QA, dG, dA


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One layer's weight (and bias) slots in a bucket."""

    layer: LayerState
    weight: int
    bias: int | None


class EigenbasisOverlap:
    """Attached to one dear.DistributedOptimizer; the optimizer calls `before_reduce` and
    `after_gather` for every bucket, dear.KFAC calls the rest."""

    def __init__(self, layers: list[LayerState], optimizer: Any) -> None:
        self._layers = layers
        self._optimizer = weakref.ref(optimizer)
        index = optimizer.dear_parameter_index
        self._params = [(s, index[s.layer.weight],
                         None if s.layer.bias is None else index[s.layer.bias]) for s in layers]
        self.armed: Rotation | None = None
        self._layout: Any = None
        self._fits = False
        self._slots: dict[int, list[_Slot]] = {}
        self._scales: dict[int, tuple[Tensor, Tensor]] = {}
        self._scale_key: Any = None

    @staticmethod
    def covers(layers: list[LayerState], optimizer: Any) -> bool:
        """Whether the optimizer trains every weight and bias of these layers."""
        return all(p in optimizer.dear_parameter_index for s in layers
                   for p in (s.layer.weight, s.layer.bias) if p is not None)

    def ties(self) -> list[list[int]]:
        """Parameter indices the optimizer must keep in one bucket: each layer's weight and bias."""
        return [[w, b] for _, w, b in self._params if b is not None]

    def layout_fits(self) -> bool:
        """Every layer's weight and bias share a bucket in the optimizer's current layout: not
        yet when the buckets were planned before dear.KFAC came (re-planned at the next step()),
        never when an explicit groups= splits them."""
        opt = self._optimizer()
        if opt is None or opt.dear_layout is None:
            return opt is not None
        self._refresh(opt)
        return self._fits

    def arm(self, rotation: Rotation | None) -> None:
        """Rotate the buckets reduced from now on with `rotation` (None: leave them alone)."""
        self.armed = rotation

    # ------------------------------------------------------------ called by the optimizer
    def before_reduce(self, bucket: Bucket) -> None:
        rotation = self.armed
        if rotation is not None and self.layout_fits() and self._slots_of(bucket):
            self._rotate(bucket, rotation, back=False)
            bucket.transformed = rotation

    def after_gather(self, bucket: Bucket) -> None:
        rotation = bucket.transformed
        if isinstance(rotation, Rotation):
            self._rotate(bucket, rotation, back=True)
            bucket.transformed = None

    def _rotate(self, bucket: Bucket, rotation: Rotation, back: bool) -> None:
        """In the bucket, each layer's [g_W | g_b] to QG^T . QA, or (back) QG . QA^T."""
        for slot in self._slots_of(bucket):
            bases = rotation.bases.get(slot.layer.index)
            if bases is None:
                continue
            q_g, q_a = bases[0], bases[1]
            weight, bias = _slot_views(bucket.buffer, bucket, slot)
            m = slot.layer.layer.matrix_of(weight, bias).to(q_g.dtype)
            m = (q_g if back else q_g.t()) @ m
            if q_a is not None:
                m = m @ (q_a.t() if back else q_a)
            slot.layer.layer.write_matrix(m, weight, bias)

    # ------------------------------------------------------------ called by dear.KFAC
    def precondition_shards(self, damping: float, lr: float, kl_clip: float | None,
                            grad_scale: float = 1.0) -> None:
        """Finish the reduce-scatters, divide this rank's shards by D, KL-clip with the global
        scale. Collectives: one scalar all-gather (when kl_clip), the same on every rank.
        `grad_scale`: the loss scale the shards still carry (the KL sum is divided by its
        square; dear/kfac/scaling.py)."""
        opt = self._optimizer()
        assert opt is not None and self.armed is not None
        opt.dear_finish_reduce()
        rank, rotation = opt.dear_communicator.rank, self.armed
        mine = [b for b in opt.dear_layout.buckets if self._slots_of(b)]
        for bucket in mine:
            if bucket.transformed is not rotation:
                raise RuntimeError(
                    f"dear.KFAC: bucket {bucket.spec.index} was reduced without the eigenbasis "
                    "rotation this step; this is a bug in dear, please report it")
        scales = self._scales_for(mine, rotation, damping, rank)
        nu = 1.0
        if kl_clip:
            partial = torch.zeros(1, dtype=torch.float64, device=mine[0].shard.device)
            for bucket in mine:
                inv_d, _ = scales[bucket.spec.index]
                partial += (bucket.shard.double().square() * inv_d).sum()
            sums = gather_small(opt.dear_communicator, partial, "K-FAC's KL-clip sums")
            vg = float(sums.sum()) * lr ** 2
            vg /= grad_scale ** 2
            if vg != 0 and math.isfinite(vg):
                nu = min(1.0, math.sqrt(kl_clip / abs(vg)))
        for bucket in mine:
            inv_d, keep = scales[bucket.spec.index]
            bucket.shard.mul_((inv_d * nu + keep).to(bucket.shard.dtype))

    # ------------------------------------------------------------ layout
    def _slots_of(self, bucket: Bucket) -> list[_Slot]:
        opt = self._optimizer()
        if opt is None:
            return []
        self._refresh(opt)
        return self._slots.get(bucket.spec.index, [])

    def _refresh(self, opt: Any) -> None:
        if opt.dear_layout is self._layout:
            return
        # built, or re-planned (new ties, autotune): where each layer's slots are now
        self._layout, self._slots, self._scales = opt.dear_layout, {}, {}
        self._scale_key = None
        where = opt.dear_layout.where
        self._fits = all(b is None or where[w][0] is where[b][0] for _, w, b in self._params)
        for state, w, b in self._params:
            home, j = where[w]
            self._slots.setdefault(home.spec.index, []).append(
                _Slot(state, j, None if b is None else where[b][1]))

    def _scales_for(self, buckets: list[Bucket], rotation: Rotation, damping: float,
                    rank: int) -> dict[int, tuple[Tensor, Tensor]]:
        """Per bucket, this rank's shard of 1/D (zero outside preconditioned layers, in float64
        for the KL sum) and of the pass-through mask (one outside them). Rebuilt when the
        decompositions or the damping change."""
        key = self._scale_key
        if key is not None and key[0] is rotation and key[1] == damping:
            return self._scales
        self._scales = {}
        for bucket in buckets:
            inv_d = torch.zeros(bucket.spec.padded_numel, dtype=torch.float64,
                                device=bucket.buffer.device)
            keep = torch.ones_like(inv_d)
            for slot in self._slots_of(bucket):
                bases = rotation.bases.get(slot.layer.index)
                if bases is None:
                    continue
                d_g, d_a = bases[2], bases[3]
                inv = 1.0 / (d_g.double().unsqueeze(1) * d_a.double().unsqueeze(0) + damping)
                layer = slot.layer.layer
                layer.write_matrix(inv, *_slot_views(inv_d, bucket, slot))
                layer.write_matrix(torch.zeros_like(inv), *_slot_views(keep, bucket, slot))
            length = bucket.spec.shard_numel
            self._scales[bucket.spec.index] = (inv_d[rank * length:(rank + 1) * length].clone(),
                                               keep[rank * length:(rank + 1) * length].clone())
        self._scale_key = (rotation, damping)
        return self._scales


def _slot_views(flat: Tensor, bucket: Bucket, slot: _Slot) -> tuple[Tensor, Tensor | None]:
    """A layer's weight and bias places in a tensor laid out like the bucket's buffer."""
    spec = bucket.spec

    def view(j: int) -> Tensor:
        return flat[spec.offsets[j]:spec.offsets[j] + spec.numels[j]].view(bucket.params[j].shape)
    return view(slot.weight), None if slot.bias is None else view(slot.bias)


def rotation_of(layers: list[LayerState], previous: Rotation | None = None) -> Rotation | None:
    """The eigenbases of every layer that has both factors and both decompositions (the others
    are left to the optimizer unpreconditioned, as in the synchronous path); None if none has.
    `previous` when nothing changed, so what was derived from it (1/D) is kept."""
    bases = {}
    for s in layers:
        if s.a is None or s.g is None or s.a_dec is None or s.g_dec is None:
            continue
        assert s.g_dec.q is not None and s.g_dec.d is not None and s.a_dec.d is not None
        bases[s.index] = (s.g_dec.q, s.a_dec.q, s.g_dec.d, s.a_dec.d)
    if previous is not None and previous.bases.keys() == bases.keys() and all(
            x is y for i in bases for x, y in zip(bases[i], previous.bases[i])):
        return previous
    return Rotation(bases) if bases else None


class DearLink:
    """dear.KFAC's side of working with dear.DistributedOptimizer: on each step, either the
    eigenbasis path above, or the synchronous one (the optimizer's synchronize(), then .grad)."""

    def __init__(self, layers: list[LayerState], eigen_everywhere: bool) -> None:
        self._layers = layers
        self._params = {p for s in layers for p in s.layer.module.parameters(recurse=False)}
        self._eigen_everywhere = eigen_everywhere   # method eigen, every rank every basis
        self.overlap: EigenbasisOverlap | None = None
        self._last: Rotation | None = None          # the bases armed last
        self._decided = False

    def optimizers(self) -> list[Any]:
        """The dear.DistributedOptimizers that train these layers (none without dear.init())."""
        if not runtime.is_initialized():
            return []
        return [opt for opt in runtime.optimizers()
                if any(p in self._params for p in opt.dear_parameters)]

    def begin_step(self, decompose: bool) -> bool:
        """True: precondition the reduced shards (`precondition_shards`); False: .grad holds the
        averaged gradient (synchronized here if a dear optimizer had not done it)."""
        optimizers = self.optimizers()
        if not optimizers:
            return False
        if not self._decided:
            self._decided = True
            self._attach(optimizers)
        opt = optimizers[0]
        overlap = self.overlap
        if (overlap is not None and overlap.armed is not None and not decompose
                and opt.dear_had_gradients and not opt.dear_synchronized and overlap.layout_fits()):
            return True
        if overlap is not None:
            overlap.arm(None)
        for each in optimizers:
            each.dear_synchronize_for_preconditioner()
        return False

    def end_step(self, keeps_bases: bool) -> None:
        """Arm the next backward's rotation when the next step keeps this step's eigenbases."""
        if self.overlap is not None:
            self._last = rotation_of(self._layers, self._last) if keeps_bases else None
            self.overlap.arm(self._last)

    def disarm(self) -> None:
        if self.overlap is not None:
            self.overlap.arm(None)

    def _attach(self, optimizers: list[Any]) -> None:
        opt = optimizers[0]
        if any(getattr(o, "shard_optimizer_state", False) for o in optimizers):
            raise ValueError(KFAC_REFUSED)
        why = None
        if len(optimizers) > 1:
            why = "the layers are split between several dear optimizers"
        elif opt.gradient_as_bucket_view:
            why = "gradient_as_bucket_view=True (the rotation would rewrite .grad in place)"
        elif opt.dear_synchronized:
            why = "the loop calls optimizer.synchronize() itself (Horovod's K-FAC loop)"
        elif opt.dear_compression.quantizes:
            why = ("quantized compression (its residuals would carry from one eigenbasis into "
                   "the next)")
        elif not self._eigen_everywhere:
            why = "it needs method='eigen' with strategy='comm-opt' (every rank every eigenbasis)"
        elif not EigenbasisOverlap.covers(self._layers, opt):
            why = "the optimizer does not train every weight and bias of the K-FAC layers"
        if why is not None:
            log.info("dear.KFAC: preconditioning after dear.DistributedOptimizer.synchronize() "
                     "(the all-gathers do not overlap the next forward pass): %s", why)
            return
        self.overlap = EigenbasisOverlap(self._layers, opt)
        opt.dear_attach_transform(self.overlap, self.overlap.ties())
        log.info("dear.KFAC: preconditioning in the eigenbasis on dear.DistributedOptimizer's "
                 "reduced shards: both overlaps kept except on steps that refresh the "
                 "decompositions")
