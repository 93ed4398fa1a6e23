"""The engine's layout: built at the first step() from rank 0's forward order, rebuilt when the
autotuner or dear.KFAC asks, and when the trained parameters change (add_param_group,
requires_grad flipped), whose step then runs synchronously (`step_with_new_parameters`)."""

from __future__ import annotations

import logging
import operator
import weakref
from typing import TYPE_CHECKING

import torch

from ..fusion.fusion_config import FusionConfig
from ..fusion.layout import build_layout
from ..fusion.rows import resolve_row_sparse
from ..fusion.views import GradientViews
from ..guards import model_guard
from ..guards.stream import parameter_digest
from .state import VIEW, Iteration

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("dear")


def build_buckets(engine: "Engine") -> None:
    """The first step(): the layout from the order the first forward showed (rank 0's)."""
    order = engine.forward_order if engine.overlap else list(reversed(engine.grad_order))
    order = list(dict.fromkeys(order))
    seen = set(order)
    unseen = [i for i in range(len(engine.params)) if i not in seen]
    # Parameters no module claimed in the forward (used directly by a parent, e.g. BERT's
    # token_type.weight[0]) are applied before the root's forward: put them in bucket 0,
    # which is reduced last anyway. At the end they would be in the first bucket to
    # reduce, and since their gradient can come last, no reduce-scatter could start
    # before backward ends.
    order = unseen + order if engine.overlap else order + unseen
    # A step before any forward (e.g. Horovod's broadcast_optimizer_state initialising the
    # state) has no execution order yet: it runs synchronously on a throwaway plan.
    provisional = engine.overlap and not engine.forward_order
    # Ranks may have run different branches: everyone adopts rank 0's decision.
    order, engine.provisional = engine.comm.broadcast_object((order, provisional), 0)
    engine.order = order
    relayout(engine, engine.fusion)
    for i, p in enumerate(engine.params):
        if engine.iteration.passes[i] > 0 or p.grad is not None:
            bucket, j = engine.where[i]
            bucket.pack(j, p.grad)


def relayout(engine: "Engine", fusion: FusionConfig) -> None:
    """(Re)build buckets and all-gather groups from rank 0's order; nothing may be in flight.
    Deterministic given the order, so every rank builds the same layout."""
    explicit = engine.groups
    order = engine.order
    if isinstance(explicit, int):          # Horovod: N groups of consecutive parameters
        size = -(-len(order) // explicit)
        explicit = [order[k:k + size] for k in range(0, len(order), size)]
    engine.updates.unshard(engine)         # the state follows the new shards (absorb)
    row_sparse = engine.row_sparse if engine.transform is None else ()  # K-FAC rotates rows
    feedback = engine.feedback             # quantized: residuals follow their parameters
    if feedback is not None:
        feedback.collect(engine)
    compression = engine.compression if feedback is None else feedback.wire_compression()
    layout = build_layout(engine.params, order, fusion, engine.comm.size, explicit,
                          compression, engine.sparse_as_dense, engine.ties,
                          row_sparse, engine.comm.rank, views=engine.views is not None,
                          sharded=engine.updates.sharded,
                          shard_in_buffer=engine.comm.size == 1 and engine.comm.in_place_alone)
    engine.fusion = fusion
    engine.layout = layout
    engine.buckets, engine.where = layout.buckets, layout.where
    engine.pending.writes.forget()         # keyed by bucket: nothing is pending now
    engine.gather_groups = layout.gather_groups
    if feedback is not None:
        feedback.restore(engine)
    engine.layout_steps = 0                # the checks compare contents again for a while
    engine.iteration.check_contents = True
    views = engine.views
    if views is not None:                  # .grad moves into the new buffers
        views.attach(layout.buckets)
        for i in engine.iteration.taken:   # taken before the buckets existed
            p = engine.params[i]
            if views.owns(p) and p.grad is not None:
                engine.iteration.taken[i] = (weakref.ref(p.grad), VIEW)
                engine.iteration.fingerprints.pop(i, None)   # dear writes the buffer
                bucket = engine.where[i][0]
                bucket.taken_version = bucket.user_version()
    engine.triggers = {}
    engine.schedule.reset(layout.buckets, fusion.chunk_bytes)   # re-planned with its chunks
    engine.updates.layout(layout.buckets)
    if engine.model is not None:
        map_triggers(engine, engine.model)
    engine.bind_hooks()
    engine.hook_modules()
    log.info("dear: %s (%s)", layout.describe(), fusion.describe())


def discard_provisional_plan(engine: "Engine") -> None:
    if engine.provisional:
        engine.updates.unshard(engine)
        engine.updates.clear()
        engine.buckets, engine.where, engine.triggers = None, [], {}
        engine.gather_groups = []
        engine.grad_order = []
        engine.first_module = {}
        engine.bind_hooks()
        engine.hook_modules()


def map_triggers(engine: "Engine", model: torch.nn.Module) -> None:
    """Each module applies the pending buckets holding its parameters; parameters whose
    module never ran (used directly by a parent) are applied before the root's forward. Each
    bucket's first module in the first forward's order is where its update lands when only
    those are hooked (Engine.hook_modules)."""
    assert engine.buckets is not None
    for module in model.modules():
        mine = [engine.where[engine.index[p]][0] for p in module.parameters(recurse=False)
                if p in engine.index]
        if mine:
            engine.triggers[module] = list(dict.fromkeys(mine))
    unseen = [engine.where[i][0] for i in range(len(engine.params))
              if i not in engine.forward_seen]
    if unseen:
        engine.triggers[model] = list(dict.fromkeys(engine.triggers.get(model, []) + unseen))
    engine.first_module = {}
    for module in [model, *engine.forward_modules]:
        for bucket in engine.triggers.get(module, ()):
            engine.first_module.setdefault(bucket.spec.index, module)
    for bucket in engine.buckets:              # held by modules that never ran: the root's
        engine.first_module.setdefault(bucket.spec.index, model)
    engine.order_varies = False


# ------------------------------------------------------------ a parameter set that may change
def trainable(engine: "Engine") -> list[torch.nn.Parameter]:
    """What the optimizer trains now: its parameters with requires_grad, sparse ones aside."""
    return [p for g in engine.opt.param_groups for p in g["params"]
            if p.requires_grad and id(p) not in engine.sparse_ids]


def trainable_named(engine: "Engine") -> list[tuple[str, torch.nn.Parameter]]:
    if engine.model is not None and any(p not in engine.name_of for p in trainable(engine)):
        with model_guard.quiet():
            for n, p in engine.model.named_parameters():
                engine.name_of.setdefault(p, n)
    return [(engine.name_of.get(p) or f"group{k}.param{j}", p)
            for k, g in enumerate(engine.opt.param_groups) for j, p in enumerate(g["params"])
            if p.requires_grad and id(p) not in engine.sparse_ids]


def trainable_digest(engine: "Engine") -> int:
    """The stream check's digest of the trained parameters (recomputed when they change)."""
    if not _maybe_changed(engine):
        return engine.param_digest
    key = tuple(id(p) for p in trainable(engine))
    if key != engine.param_key:
        engine.param_key = key
        engine.param_digest = parameter_digest(trainable_named(engine))
    return engine.param_digest


def parameter_set_changed(engine: "Engine") -> bool:
    """The trained parameters are not those of the layout (add_param_group, requires_grad
    flipped): compared tensor by tensor where the cheap test cannot rule it out."""
    if not _maybe_changed(engine):
        return False
    params = engine.params
    now = trainable(engine)
    return len(now) != len(params) or any(a is not b for a, b in zip(now, params))


def note_parameter_set(engine: "Engine") -> None:
    """What `_maybe_changed` compares against: each param group's list (identity, length)
    and the parameters that are not trained (frozen, and not sparse)."""
    groups = engine.opt.param_groups
    engine.groups_key = [(id(g["params"]), len(g["params"])) for g in groups]
    trained = set(engine.params)
    engine.untrained = [p for g in groups for p in g["params"]
                        if p not in trained and id(p) not in engine.sparse_ids]


def _maybe_changed(engine: "Engine") -> bool:
    """Whether the trained set may have changed since `note_parameter_set`: a param group
    added or its list replaced or resized, a trained parameter frozen, an untrained one
    unfrozen; and in the iterations that compare contents (checks.py) always (a list edited in
    place at the same length). A few attribute reads instead of a walk over every group."""
    if engine.iteration.check_contents:
        return True
    groups = engine.opt.param_groups
    return (len(groups) != len(engine.groups_key)
            or any((id(g["params"]), len(g["params"])) != key
                   for g, key in zip(groups, engine.groups_key))
            or not all(map(_REQUIRES_GRAD, engine.params))      # C-level loops: ~201 reads
            or any(map(_REQUIRES_GRAD, engine.untrained)))


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def average_outside_layout(engine: "Engine", params: list[torch.nn.Parameter]) -> None:
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
        flat[:numel].mul_(engine.prescale)
        if comm.size > 1:
            comm.all_reduce(flat).wait()
        flat[:numel].mul_(engine.postscale)
        offset = 0
        for k, p in enumerate(group):
            if flat[numel + k].item() > 0:
                p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()


def adopt_parameter_set(engine: "Engine") -> None:
    """Hooks, names and indices for the parameters trained now; buckets built at the next
    step() from the order the next forward shows."""
    named = trainable_named(engine)
    engine.hooks.remove()
    engine.names = [n for n, _ in named]
    engine.params = [p for _, p in named]
    engine.index = {p: i for i, p in enumerate(engine.params)}
    engine.iteration = Iteration.start(len(engine.params))
    engine.buckets, engine.where, engine.gather_groups, engine.triggers = None, [], [], {}
    engine.order, engine.forward_order, engine.grad_order = [], [], []
    engine.forward_seen, engine.forward_modules, engine.first_module = set(), {}, {}
    if engine.views is not None:
        engine.views = GradientViews()
    engine.row_sparse = resolve_row_sparse(engine.row_sparse_setting, named, engine.model,
                                           explicit=engine.row_sparse_explicit,
                                           world_size=engine.comm.size)
    engine.param_key = tuple(id(p) for p in engine.params)
    engine.param_digest = parameter_digest(named)
    note_parameter_set(engine)
    engine.hooks.register(engine)
    engine.bind_hooks()
    log.info("dear: the trained parameters changed (%d now); the layout is rebuilt at the "
             "next step", len(engine.params))
