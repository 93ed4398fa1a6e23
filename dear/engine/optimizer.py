"""dear.DistributedOptimizer: hvd.DistributedOptimizer's signature, DeAR's schedule.

This module checks the arguments, settles the configuration (arguments first, then DEAR_*
variables: dear/config.py) and turns the user's optimizer into an instance of a subclass of
its own class mixed with `_DistributedOptimizer` (dear/engine/wrapper.py), whose one attribute,
the engine (dear/engine/engine.py), holds the data path:
hook -> bucket -> reduce-scatter -> step() -> all-gather -> update in the next forward.
"""

from __future__ import annotations

import functools
import logging
import sys
import weakref
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from ..comm import runtime
from ..comm.base import Communicator, ReduceOp, resolve_op
from ..comm.compression import Compression
from ..comm.compression import resolve as resolve_compression
from ..config import Autotune, auto_threshold, parse_autotune
from ..fusion import fusion_config as fusion_file
from ..fusion.fusion_config import FusionConfig
from ..guards.validation import (
    autotune_output_problem,
    broadcast_model,
    check_not_wrapped,
    check_optimizer,
    check_same_across_ranks,
    check_settings_match,
    collective_knobs,
    explicit_groups,
    horovod_groups,
    model_settings,
    named_params_of,
    process_set_communicator,
    warn_if_ddp,
)
from ..sharding.state import check_shardable
from .buffers import BufferBroadcast
from .options import EngineOptions
from .sparse import SparseGradients, sparse_parameters
from .wrapper import _DistributedOptimizer, attach

log = logging.getLogger("dear")


def _fusion_settings(named: list[tuple[str, torch.nn.Parameter]],
                     fusion_threshold: Optional[int], autotune: Optional[Autotune],
                     fusion_config: Any, groups: Any) -> tuple[FusionConfig, Autotune]:
    """The starting layout and how to tune it: a saved config (argument, then
    DEAR_FUSION_CONFIG) wins and skips tuning; else the threshold (argument, then
    DEAR_FUSION_THRESHOLD) for both collectives, tuned as autotune= (then DEAR_AUTOTUNE) says."""
    cfg = runtime.config()
    tune = cfg.autotune if autotune is None else autotune
    if isinstance(fusion_config, FusionConfig):
        return fusion_config, Autotune.OFF
    path = fusion_config if fusion_config is not None else (cfg.fusion_config or None)
    if path:
        loaded = fusion_file.load(str(path), fusion_file.model_fingerprint(named))
        if tune:
            log.warning("dear: using the tuned layout in %s (%s); autotune skipped",
                        path, loaded.describe())
        return loaded, Autotune.OFF
    threshold = cfg.fusion_threshold if fusion_threshold is None else fusion_threshold
    if threshold is None:
        threshold = auto_threshold(fusion_file.gradient_bytes(named))
    if tune and groups is not None:
        raise ValueError(f"autotune={tune.value!r} tunes the bucket layout, but groups= fixes "
                         "it; pass one or the other")
    # A small first bucket by default: it is reduced last and gathered first, so its size is
    # what stays exposed at both ends of the iteration (docs/benchmarks.md#the-first-bucket).
    first = min(cfg.first_bucket, threshold) if cfg.first_bucket else None
    return FusionConfig(threshold, threshold, first), tune


_classes: dict[type, type] = {}


def _dear_class(base: type) -> type:
    """The dear subclass of an optimizer class (one per class, so isinstance, pickling of
    state and torch's per-class step patching see one stable type)."""
    cls = _classes.get(base)
    if cls is None:
        cls = type(base.__name__, (_DistributedOptimizer, base), {})
        _classes[base] = cls
    return cls


def _count_steps(optimizer: torch.optim.Optimizer) -> None:
    """What torch's LRScheduler does to an optimizer it is given (counts step() calls so it can
    warn about a scheduler stepped first), redone for dear's class: the scheduler's own patch
    calls the class's step() it saw, which is no longer the optimizer's."""
    step = type(optimizer).step
    ref = weakref.ref(optimizer)

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt: Any = ref()
        opt._opt_called = True  # torch's LR scheduler flags  # noqa: SLF001
        return step(opt, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True        # type: ignore[attr-defined]  # noqa: SLF001 (torch's LR scheduler flags)
    optimizer.step = wrapper                   # type: ignore[method-assign]


def _refuse_with_sharding(compressor: Any, views: bool, sparse_named: list[Any],
                          row_sparse: Any) -> None:
    """What shard_optimizer_state=True cannot do, said before anything is converted."""
    if compressor.name != "none" and not compressor.quantizes:
        raise ValueError(f"shard_optimizer_state=True all-gathers updated parameters, which "
                         f"{compressor!r} would round: pass compression=dear.Compression.none "
                         "or a quantized one (dear.Compression.int8, .int4: their reduce-"
                         "scatter is quantized and the parameters are gathered in fp32), or "
                         "wrap without shard_optimizer_state")
    if views:
        raise ValueError("gradient_as_bucket_view=True with shard_optimizer_state=True: the "
                         "buckets carry parameters after the all-gather, not gradients; drop "
                         "one of the two")
    if sparse_named:
        raise ValueError(
            "shard_optimizer_state=True with sparse gradients ("
            + ", ".join(n for n, _ in sparse_named) + "): they are updated whole on every "
            "rank; use nn.Embedding(sparse=False), or sparse_as_dense=True")
    if row_sparse not in (None, False, "off", "auto"):
        raise ValueError("row_sparse= with shard_optimizer_state=True: each rank updates a "
                         "slice of every table, so the table is sent whole; drop row_sparse=")


def _horovod_is_initialized() -> bool:
    hvd = sys.modules.get("horovod.torch")
    try:
        return bool(hvd is not None and hvd.is_initialized())
    except Exception:
        return False


NamedParameters = Iterable[tuple[str, torch.nn.Parameter]]


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[NamedParameters] = None,
                         compression: Any = Compression.none,
                         backward_passes_per_step: int = 1, op: Any = ReduceOp.Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Optional[Any] = None, sparse_as_dense: bool = False,
                         process_set: Any = None, *, model: Optional[torch.nn.Module] = None,
                         broadcast_buffers: bool = True, init_sync: bool = True,
                         fusion_threshold: Optional[int] = None,
                         overlap_allgather: bool = True,
                         autotune: Optional[Union[bool, str]] = None,
                         fusion_config: Optional[Any] = None,
                         schedule: Optional[str] = None,
                         row_sparse: Union[bool, str, Sequence[str], None] = None,
                         gradient_as_bucket_view: Optional[bool] = None,
                         shard_optimizer_state: Optional[bool] = None
                         ) -> torch.optim.Optimizer:
    """Wrap `optimizer` so its gradients are averaged with DeAR's decoupled all-reduce.

    Accepts everything hvd.DistributedOptimizer accepts, in the same positions. Returns the
    same object, converted in place into a dear subclass of its own class: whatever held it
    (LR schedulers made before or after, GradScaler, resume code) sees dear's, and isinstance
    checks keep working.
    `model`: the model it trains. dear hooks its forward pass (each bucket's update lands just
    before its first module runs) and, as DDP's constructor does, broadcasts rank 0's weights.
    `process_set`: Horovod's; a set of some ranks averages over those ranks only.
    `fusion_threshold`: bytes of gradient per bucket (None: DEAR_FUSION_THRESHOLD, else 25 MB
    or an eighth of the model's gradient). `fusion_config`: a saved layout (dear_fusion.json).
    `overlap_allgather` (with model=): False completes the all-gathers inside step().
    `autotune`: True or "online" tunes the fusion layout on measured iterations, "offline" on
    the simulator's predictions from a traced window, then confirms the best few (None:
    DEAR_AUTOTUNE).
    `init_sync` (with model=): DDP's: rank 0's parameters and buffers are broadcast to every
    rank now, as DDP's constructor does (False: the script broadcasts them itself).
    Every setting that must match across ranks (these arguments, the DEAR_* knobs that change
    collectives, the model's buffers) is compared once here: a mismatch raises on every rank.
    `broadcast_buffers` (with model=): DDP's; rank 0's buffers go to every rank in each step()
    (dear/engine/buffers.py).
    `schedule`: "planned" (default, DEAR_SCHEDULE) also gathers in backward's idle link time
    by a plan made on rank 0 from the first iterations; "dear" keeps DeAR's order
    (dear/fusion/schedule.py).
    `row_sparse`: embedding tables sent as the rows some rank's batch used, not whole (exact;
    dear/fusion/rows.py): True / "auto" (the model's dense nn.Embedding tables of 1 MB or
    more that no other module shares), parameter names, or False (None: DEAR_ROW_SPARSE,
    default "auto": on for such tables when model= is given).
    `gradient_as_bucket_view`: DDP's: each .grad is a view of its bucket's buffer, so backward
    accumulates the gradients where the reduce-scatter reads them (no second copy in memory);
    .grad is then never None and holds the averaged gradient after the update (None:
    DEAR_GRADIENT_AS_BUCKET_VIEW, default False; dear/fusion/views.py).
    `shard_optimizer_state`: each rank keeps the optimizer state of, and updates, only its
    1/N shard of each bucket; the all-gathers carry the updated parameters (ZeRO-2's memory
    on DeAR's schedule). Exact for elementwise optimizers (SGD, Adam, AdamW, RMSprop, ...;
    others are refused); state_dict() gathers the whole state: call it on every rank (None:
    DEAR_SHARD_OPTIMIZER_STATE, default False; docs/sharding.md).
    """
    if schedule is not None and schedule not in ("planned", "dear"):
        raise ValueError(f"schedule must be 'planned' or 'dear', got {schedule!r}")
    # The arguments first, as Horovod's optimizer checks them: a script that builds it before
    # hvd.init() gets the ValueError about its arguments, not "not initialised".
    check_optimizer(optimizer)
    check_not_wrapped(optimizer)               # dear or hvd over dear / hvd: clear errors
    op = resolve_op(op)
    compressor = resolve_compression(compression)
    groups = horovod_groups(num_groups, groups)
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    if gradient_predivide_factor <= 0:
        raise ValueError("gradient_predivide_factor must be > 0")
    if gradient_predivide_factor != 1.0 and op is not ReduceOp.Average:
        raise ValueError("gradient_predivide_factor only applies to op=dear.Average")
    if fusion_threshold is not None and fusion_threshold < 0:
        raise ValueError(f"fusion_threshold must be >= 0 bytes, got {fusion_threshold}")
    mode = None if autotune is None else parse_autotune(autotune)
    named = named_params_of(optimizer, named_parameters, model, sparse_as_dense)
    if not runtime.is_initialized() and _horovod_is_initialized():
        runtime.init(backend="horovod")        # hvd.init() was called: the one-line swap
    comm = runtime.communicator()              # fails clearly before dear.init()
    # A Horovod process set of some ranks: the optimizer averages over those ranks only.
    set_comm = process_set_communicator(process_set, runtime.config().timeout)
    if set_comm is not None:
        comm = set_comm
    for dtype in {p.dtype for _, p in named}:
        comm.check_dtype(compressor.wire_dtype(dtype))
    if compressor.quantizes and comm.size > 1 and not comm.supports_all_to_all:
        raise ValueError(f"{compressor!r} needs an all-to-all, which dear's {comm.name} backend "
                         "does not have: use the torch.distributed backend (dear.init("
                         "backend='torch'), NCCL or Gloo) or Horovod's, or compression="
                         "dear.Compression.fp16")
    # Under Horovod Elastic a rank that joins a running job wraps while the others wait in
    # Horovod's sync: the cross-rank checks run when every rank (re)joins (Engine.rejoin).
    elastic = comm.elastic
    if elastic and set_comm is not None:
        raise ValueError("process_set= under Horovod Elastic: the set's ranks would change with "
                         "the world; average over the whole world (leave process_set out)")
    if not elastic:
        check_same_across_ranks(named, comm)
    views = bool(runtime.config().gradient_as_bucket_view
                 if gradient_as_bucket_view is None else gradient_as_bucket_view)
    sharded = bool(runtime.config().shard_optimizer_state
                   if shard_optimizer_state is None else shard_optimizer_state)
    warn_if_ddp(model, named)
    sparse_ids = sparse_parameters(named, model)   # kept out of the dense buckets
    named_index = {id(p): i for i, (_, p) in enumerate(named)}
    sparse_named = [(n, p) for n, p in named if id(p) in sparse_ids]
    if sharded:
        check_shardable(optimizer)
        _refuse_with_sharding(compressor, views, sparse_named, row_sparse)
    named = [(n, p) for n, p in named if id(p) not in sparse_ids]
    # A fusion config file that one rank cannot read must fail every rank, not that one alone.
    fusion_error: Optional[BaseException] = None
    try:
        fusion, tune = _fusion_settings(named, fusion_threshold, mode, fusion_config, groups)
    except (OSError, ValueError) as exc:
        fusion_error = exc
    # Only rank 0 writes the autotuner's files: a place it cannot write must stop every rank
    # now, not rank 0 alone after the first trial.
    output_problem = (autotune_output_problem(runtime.config())
                      if fusion_error is None and tune and comm.rank == 0 else None)
    settings = {
        **collective_knobs(runtime.config()), **model_settings(model),
        "autotune output (written by rank 0)": output_problem or "writable",
        "op": op.name, "gradient_predivide_factor": repr(float(gradient_predivide_factor)),
        "compression": repr(compressor),
        "backward_passes_per_step": str(backward_passes_per_step),
        "fusion layout": (repr(fusion) if fusion_error is None
                          else f"<not loaded: {fusion_error}>"),
        "autotune": "?" if fusion_error is not None else tune.value,
        "overlap_allgather": str(overlap_allgather), "model= given": str(model is not None),
        "schedule": repr(schedule), "row_sparse": repr(row_sparse),
        "gradient_as_bucket_view": str(views), "sparse_as_dense": str(sparse_as_dense),
        "shard_optimizer_state": str(sharded),
        "groups": repr(groups if groups is None or isinstance(groups, int) else
                       [[named_index.get(id(p), -1) for p in g]
                        for g in groups]),  # type: ignore[attr-defined]
        "broadcast_buffers": str(broadcast_buffers), "init_sync": str(init_sync),
    }

    def cross_rank_checks(world: Communicator) -> None:
        check_same_across_ranks(named, world)
        check_settings_match(settings, world)
        if buffer_sync is not None:
            buffer_sync.check_same(world)

    if not elastic:
        check_settings_match(settings, comm)
    if fusion_error is not None:
        raise fusion_error
    if output_problem is not None:             # a world of one: no exchange raised it
        raise ValueError(f"dear: autotune output on rank 0: {output_problem}")
    if model is not None and init_sync and not elastic:   # elastic: Horovod's sync does it
        broadcast_model(model, comm)
    if overlap_allgather and model is None:
        log.info("dear: no model= given, so all-gathers complete inside step(); pass "
                 "model= to overlap them with the next forward pass")
    cfg = runtime.config()
    options = EngineOptions(
        fusion=fusion, compression=compressor, passes=backward_passes_per_step,
        prescale=1.0 / gradient_predivide_factor,
        average=op is ReduceOp.Average, predivide=gradient_predivide_factor,
        overlap=overlap_allgather and model is not None, views=views, sharded=sharded,
        sparse_as_dense=sparse_as_dense,
        groups=explicit_groups(groups, {p: i for i, (_, p) in enumerate(named)}),
        # sharded: each rank updates a slice of every table, so tables are sent whole
        row_sparse="off" if sharded else (cfg.row_sparse if row_sparse is None else row_sparse),
        row_sparse_explicit=row_sparse is not None,
        planned=(cfg.schedule if schedule is None else schedule) == "planned",
        autotune=tune, check_every=cfg.check_every, elastic=elastic,
        rejoin_checks=cross_rank_checks if elastic else None)
    # One object: the user's optimizer becomes dear's in place (its class is swapped for a
    # subclass mixing in the data path), so every holder (LR schedulers made before or after,
    # GradScaler, resume code, kfac-pytorch's scheduler) sees the same param_groups and state.
    original_class = type(optimizer)
    instance_step = optimizer.__dict__.get("step")
    if instance_step is not None and not getattr(instance_step, "_wrapped_by_lr_sched", False):
        raise TypeError(
            f"optimizer.step was replaced on the instance ({instance_step!r}); dear turns the "
            "optimizer into a dear.DistributedOptimizer in place, and that replacement would "
            "bypass it. Wrap the plain optimizer before patching its step()")
    cls: Any = _dear_class(original_class)
    wrapped: Any = optimizer
    wrapped.__class__ = cls
    try:
        buffer_sync = (BufferBroadcast(model, comm)  # type: ignore[arg-type]
                       if BufferBroadcast.wanted(model, broadcast_buffers) else None)
        sparse = (SparseGradients(wrapped, sparse_named, comm, sparse_as_dense)
                  if sparse_named else None)
        attach(wrapped, named, model, options, comm, frozenset(sparse_ids),
               owned_comm=set_comm, buffer_sync=buffer_sync, sparse=sparse)
    except BaseException:
        wrapped.__class__ = original_class     # nothing half-converted is left behind
        wrapped.__dict__.pop("dear_engine", None)
        raise
    if instance_step is not None:              # an LR scheduler made before the wrap
        _count_steps(wrapped)
    if getattr(runtime.config(), "trace", ""):  # DEAR_TRACE=dir: dear.diagnose records the run
        from ..diagnose.trace import attach_from_config
        attach_from_config(wrapped, model)
    return wrapped


__all__ = ["DistributedOptimizer"]
