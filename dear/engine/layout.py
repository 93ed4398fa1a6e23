"""The engine's layout, built: the fusion layout (dear/fusion/layout.py) bound to the model
(which module applies which bucket's update) with what it was planned from. Pure builders: the
engine adopts what they return (Engine.build_layout, Engine.relayout)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch

from ..comm.base import Communicator
from ..comm.compression import Compressor
from ..fusion.bucket import Bucket
from ..fusion.fusion_config import FusionConfig
from ..fusion.layout import Layout, build_layout
from .options import EngineOptions
from .state import ForwardOrder


@dataclasses.dataclass
class ModelLayout(Layout):
    fusion: FusionConfig                       # the thresholds it was built with
    order: list[int]                           # rank 0's parameter order it was planned from
    provisional: bool                          # built before any forward: thrown away after
    #: each module applies the pending buckets holding its parameters
    triggers: dict[torch.nn.Module, list[Bucket]]
    #: each bucket's first module in the first forward's order (and the root): in eager mode
    #: only these stay hooked once the modules were seen to run in that order (hooks.py)
    first_module: dict[int, torch.nn.Module]
    order_varies: bool = False                 # a module ran before its bucket's first module
    steps: int = 0                             # step()s since it was built (checks.py)


def first_order(learned: ForwardOrder, count: int, overlap: bool) -> tuple[list[int], bool]:
    """The order to plan the first layout from, and whether that layout is provisional (a
    step before any forward, e.g. Horovod's broadcast_optimizer_state initialising the state,
    has no execution order yet: it runs synchronously on a throwaway layout)."""
    order = learned.params if overlap else list(reversed(learned.grads))
    order = list(dict.fromkeys(order))
    seen = set(order)
    unseen = [i for i in range(count) if i not in seen]
    # Parameters no module claimed in the forward (used directly by a parent, e.g. BERT's
    # token_type.weight[0]) are applied before the root's forward: put them in bucket 0,
    # which is reduced last anyway. At the end they would be in the first bucket to
    # reduce, and since their gradient can come last, no reduce-scatter could start
    # before backward ends.
    order = unseen + order if overlap else order + unseen
    return order, overlap and not learned.params


def build(params: Sequence[torch.nn.Parameter], order: list[int], provisional: bool,
          fusion: FusionConfig, options: EngineOptions, comm: Communicator,
          ties: Sequence[Sequence[int]], compression: Compressor, row_sparse: Any,
          model: Optional[torch.nn.Module], learned: ForwardOrder,
          index: dict[torch.nn.Parameter, int]) -> ModelLayout:
    """Buckets and all-gather groups from rank 0's order: deterministic given the order, so
    every rank builds the same layout. `compression`: the buckets' (fp32 during quantization's
    warm-up); `row_sparse`: the tables sent as rows (none under dear.KFAC)."""
    explicit = options.groups
    if isinstance(explicit, int):          # Horovod: N groups of consecutive parameters
        size = -(-len(order) // explicit)
        explicit = [order[k:k + size] for k in range(0, len(order), size)]
    plain = build_layout(params, order, fusion, comm.size, explicit, compression,
                         options.sparse_as_dense, ties, row_sparse, comm.rank,
                         views=options.views, sharded=options.sharded,
                         shard_in_buffer=comm.size == 1 and comm.in_place_alone)
    triggers: dict[torch.nn.Module, list[Bucket]] = {}
    first: dict[int, torch.nn.Module] = {}
    if model is not None:
        triggers, first = _triggers(model, plain, learned, index, len(params))
    return ModelLayout(plain.buckets, plain.where, plain.gather_groups, fusion, order,
                       provisional, triggers, first)


def _triggers(model: torch.nn.Module, plain: Layout, learned: ForwardOrder,
              index: dict[torch.nn.Parameter, int], count: int
              ) -> tuple[dict[torch.nn.Module, list[Bucket]], dict[int, torch.nn.Module]]:
    """Each module applies the pending buckets holding its parameters; parameters whose
    module never ran (used directly by a parent) are applied before the root's forward. Each
    bucket's first module in the first forward's order is where its update lands when only
    those are hooked (Engine.hook_modules)."""
    where = plain.where
    triggers: dict[torch.nn.Module, list[Bucket]] = {}
    for module in model.modules():
        mine = [where[index[p]][0] for p in module.parameters(recurse=False) if p in index]
        if mine:
            triggers[module] = list(dict.fromkeys(mine))
    unseen = [where[i][0] for i in range(count) if i not in learned.seen]
    if unseen:
        triggers[model] = list(dict.fromkeys(triggers.get(model, []) + unseen))
    first: dict[int, torch.nn.Module] = {}
    for module in [model, *learned.modules]:
        for bucket in triggers.get(module, ()):
            first.setdefault(bucket.spec.index, module)
    for bucket in plain.buckets:               # held by modules that never ran: the root's
        first.setdefault(bucket.spec.index, model)
    return triggers, first


__all__ = ["ModelLayout", "build", "first_order"]
