"""The class dear.DistributedOptimizer mixes into the wrapped optimizer's own class
(dear/engine/optimizer.py builds it): torch's and Horovod's optimizer API over the engine, which is
the instance's one attribute of dear's (`dear_engine`), so dear's names cannot collide with those of
the user's optimizer class."""

from __future__ import annotations

import collections
import contextlib
import logging
import weakref
from typing import Any, Callable, Iterator, Optional

import torch

from ..autotune.factory import make_autotuner
from ..comm import runtime
from ..comm.base import Communicator, ReduceOp
from ..comm.compression import Compressor
from ..config import Autotune
from ..fusion.fusion_config import FusionConfig
from ..fusion.rows import RowSparseBucket, resolve_row_sparse
from ..fusion.schedule import ScheduleDriver, issue_mode, scope
from ..fusion.views import GradientViews
from ..guards.stream import parameter_digest
from ..guards.validation import explicit_groups, refuse_construction
from ..sharding import checkpoint as sharded_checkpoint
from ..sharding.state import ShardedState, tensor_bytes
from . import amp_clip, feedback, layout, steps
from .engine import Engine
from .extension import ExtensionPoints
from .hooks import remove_hooks, weak_method
from .updates import ShardedUpdates, Updates

log = logging.getLogger("dear")


class _DistributedOptimizer(ExtensionPoints, torch.optim.Optimizer):
    """Mixed into the wrapped optimizer's own class (dear/engine/optimizer.py's
    `DistributedOptimizer`). One object on purpose, like Horovod's: whatever held the
    optimizer before the wrap (schedulers, GradScaler, resume code) holds dear's."""

    # GradScaler.step() then calls step(grad_scaler=scaler) and leaves the inf check to the
    # optimizer: see dear/shardops/amp.py for why it must look at the reduced gradient.
    _step_supports_amp_scaling = True
    dear_engine: Engine

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        refuse_construction(self)              # e.g. hvd.DistributedOptimizer(dear's optimizer)

    @torch.optim.Optimizer.profile_hook_step
    def step(self, closure: Optional[Callable[[], float]] = None,  # type: ignore[override]
             grad_scaler: Optional[Any] = None) -> None:
        """Finish averaging and start the all-gathers; the update lands in the next forward.
        `scaler.step(optimizer)` passes its GradScaler as `grad_scaler` (see
        dear/shardops/amp.py)."""
        with scope("dear::step"):
            steps.step(self.dear_engine, closure, grad_scaler)

    def flush_updates(self) -> int:
        """Apply every pending update now; returns how many buckets it applied. Issues no
        collective, so it is safe on one rank alone (e.g. rank 0 saving a checkpoint); reads
        through the model (dear/guards/model_guard.py), eval forwards and shutdown call it."""
        return self.dear_engine.flush()

    def synchronize(self) -> None:
        """Horovod's meaning. After backward: finish averaging now and put the averaged gradients
        in .grad (then `with optimizer.skip_synchronize(): optimizer.step()`), e.g. to clip or
        precondition them. After step(): apply the pending updates. Call it on every rank."""
        steps.synchronize(self.dear_engine)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Horovod's: step() inside applies the gradients synchronize() averaged."""
        self.dear_engine.skip_sync = True
        try:
            yield
        finally:
            self.dear_engine.skip_sync = False

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Horovod's: reduce after `passes` backward passes from the next step on; call it
        between step() and the next backward, on every rank."""
        engine = self.dear_engine
        if passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        if engine.had_gradients or any(engine.iteration.passes):
            raise RuntimeError("set_backward_passes_per_step() between backward and step(): "
                               "call it after step(), before the next backward")
        engine.passes_needed = passes
        engine.arm_hooks()

    def discard_pending_updates(self) -> int:
        """After a collective failed (a peer died or stalled): forget the pending update whose
        all-gathers cannot arrive, so that the model and this optimizer hold the last whole
        step and `state_dict()`, an emergency checkpoint and `dear.shutdown()` work again.
        Local, no collective. Returns how many buckets' updates were dropped. Refused when
        part of that step was already applied (the model would mix two steps): then no whole
        step exists to save. On healthy ranks it would throw away a step's work: use
        flush_updates() there."""
        return steps.discard_pending_updates(self.dear_engine)

    def dear_synchronize_for_preconditioner(self) -> None:
        """dear.KFAC on a step that preconditions .grad: synchronize(), and the step() that
        follows applies .grad as after Horovod's skip_synchronize(), without a warning."""
        engine = self.dear_engine
        if engine.had_gradients and not engine.iteration.synchronized:
            self.synchronize()
            engine.iteration.preconditioner_synced = engine.iteration.synchronized

    # ------------------------------------------------- clipping and GradScaler (reduced.py)
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, *,
                        grad_scaler: Optional[Any] = None) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ applied to the AVERAGED gradient (what DDP users clip),
        computed from the reduced shards; returns the total norm. Call it on every rank after the
        last backward and before step(). With a GradScaler pass grad_scaler=scaler instead of
        calling scaler.unscale_(optimizer): the reduced gradient is unscaled first."""
        return amp_clip.clip_grad_norm_(self.dear_engine, max_norm, norm_type,
                                       error_if_nonfinite, grad_scaler=grad_scaler)

    def grad_norm(self, norm_type: float = 2.0, *, grad_scaler: Optional[Any] = None
                  ) -> torch.Tensor:
        """The norm of the AVERAGED gradient, the same bits on every rank (what DDP users log
        from the all-reduced `.grad`; under dear `.grad` holds each rank's local gradient until
        the next forward). From the reduced shards, one tiny all-gather; changes nothing. Call
        it on every rank after the last backward and before step()."""
        return self.clip_grad_norm_(float("inf"), norm_type, grad_scaler=grad_scaler)

    # ------------------------------------------------------------------- .grad and views
    @property
    def gradient_as_bucket_view(self) -> bool:
        """Whether each .grad is a view of its bucket's buffer (DDP's option)."""
        return self.dear_engine.views is not None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's, except that with gradient_as_bucket_view the views are zeroed in place (once
        a pending update has read them); see dear/fusion/views.py."""
        engine = self.dear_engine
        views = engine.views
        if views is None or engine.buckets is None:
            super().zero_grad(set_to_none)
            return
        if engine.had_gradients:
            raise RuntimeError(
                "optimizer.zero_grad() between backward and step() with "
                "gradient_as_bucket_view=True: the gradients are in the bucket buffers that "
                "this iteration's reduce-scatters are sending. Call zero_grad() before the "
                "forward pass or after step()")
        for group in self.param_groups:
            for p in group["params"]:
                if views.owns(p) and views.zero_grad(p, set_to_none):
                    continue
                if p.grad is not None:         # torch's own rule
                    if set_to_none:
                        p.grad = None
                    else:
                        if p.grad.grad_fn is not None:
                            p.grad.detach_()
                        else:
                            p.grad.requires_grad_(False)
                        p.grad.zero_()

    # --------------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """torch's; with shard_optimizer_state the whole (unsharded) state, gathered from every
        rank: call it on every rank."""
        engine = self.dear_engine
        engine.flush()
        updates = engine.updates
        if not isinstance(updates, ShardedUpdates) or not updates.state.buckets:
            state = super().state_dict()
            if engine.feedback is not None:    # quantized compression: this rank's residuals
                state[feedback.STATE_KEY] = engine.feedback.state(engine)
            return state
        full = updates.gather_full(engine, "optimizer.state_dict()")
        kept = self.state
        merged: Any = collections.defaultdict(dict, kept)
        merged.update(full)
        self.state = merged
        try:
            state = super().state_dict()
        finally:
            self.state = kept
        if engine.feedback is not None:        # quantized compression: this rank's residuals
            state[feedback.STATE_KEY] = engine.feedback.state(engine)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's; with shard_optimizer_state this rank keeps only its shards of it."""
        engine = self.dear_engine
        engine.flush()
        engine.updates.undo_early(engine)
        saved = state_dict.get(feedback.STATE_KEY)
        if saved is not None:
            state_dict = {k: v for k, v in state_dict.items() if k != feedback.STATE_KEY}
        super().load_state_dict(state_dict)
        self._reload_feedback(lambda fb: fb.load(engine, saved))
        for bucket in engine.buckets or ():
            bucket.group_members = None  # type: ignore[attr-defined]
        updates = engine.updates
        if isinstance(updates, ShardedUpdates) and updates.state.buckets:
            updates.state.state.clear()
            updates.state.absorb(self.state)

    def sharded_state_dict(self) -> dict[str, Any]:
        """With shard_optimizer_state: this rank's pieces of the state as ShardedTensors, for
        torch.distributed.checkpoint.save / .load on any world size
        (dear/sharding/checkpoint.py). No collective."""
        engine = self.dear_engine
        engine.flush()
        if not engine.updates.sharded:
            raise RuntimeError("sharded_state_dict() needs shard_optimizer_state=True; "
                               "without it, state_dict() is the whole state on every rank")
        state = sharded_checkpoint.sharded_state_dict(self, self._trained_names(),
                                                      engine.comm.rank, engine.comm.size)
        if engine.feedback is not None:        # the residuals are per rank and do not reshard
            state[feedback.STATE_KEY] = {"steps": engine.feedback.steps}
        return state

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """What torch.distributed.checkpoint.load filled into sharded_state_dict()'s template."""
        engine = self.dear_engine
        engine.flush()
        if not engine.updates.sharded:
            raise RuntimeError("load_sharded_state_dict() needs shard_optimizer_state=True")
        saved = state_dict.get(feedback.STATE_KEY)
        if saved is not None:
            steps = int(saved.get("steps", 0))
            self._reload_feedback(lambda fb: fb.load_without_residuals(engine, steps))
        sharded_checkpoint.load_sharded_state_dict(self, state_dict, self._trained_names())

    def _reload_feedback(self, load: Callable[[feedback.ErrorFeedback], None]) -> None:
        """Quantized compression: `load` its state, then lay the buckets out again if that
        moved the run into or out of its warm-up (fp32 buckets until it ends)."""
        engine = self.dear_engine
        if engine.feedback is None:
            return
        warm = engine.feedback.warm
        load(engine.feedback)
        if engine.buckets is not None and engine.feedback.warm != warm:
            layout.relayout(engine, engine.fusion)

    def _trained_names(self) -> dict[Any, str]:
        return {p: n for n, p in layout.trainable_named(self.dear_engine)}

    # ------------------------------------------------------------------------ reading back
    @property
    def shard_optimizer_state(self) -> bool:
        """Whether each rank keeps and updates only its shards of the optimizer state."""
        return self.dear_engine.updates.sharded

    @property
    def autotuner(self) -> Any:
        """The fusion autotuner (autotune="online" or "offline"), else None. Read-only for
        callers: `.finished`, `.current` (the thresholds in force), `.plan`."""
        return self.dear_engine.autotuner

    @property
    def _parameter_names(self) -> dict[torch.nn.Parameter, str]:
        """Horovod's name for the parameters' names (its tests read it)."""
        return self.dear_engine.name_of

    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds beside the model's parameters and gradients, for capacity
        planning: `buffers` (the buckets' flat gradients and shards, their wire copies and, with
        int8/int4, messages and error-feedback residuals; with sharding the shards' parameter
        values), `state` (the optimizer state held here: all of it, or this rank's shards) and
        `peak_saved` (with sharding: the most state saved at once to undo updates applied
        early)."""
        engine = self.dear_engine
        buffers = sum(tensor_bytes({id(t): t for t in (b.buffer, b.shard, *b.wires,
                                                       getattr(b, "residual", None))
                                    if t is not None}.values())
                      for b in engine.buckets or ())
        state = sum(tensor_bytes(s.values()) for s in self.state.values())
        more_buffers, more_state, saved = engine.updates.memory()
        return {"buffers": buffers + more_buffers, "state": state + more_state,
                "peak_saved": saved}

    def row_sparse_stats(self) -> dict[str, tuple[int, int]]:
        """Per embedding table sent by rows (row_sparse): (its rows, the rows the last
        iteration sent: the union of every rank's)."""
        engine = self.dear_engine
        return {engine.names[b.spec.params[0]]: (b.rows, b.sent_rows)
                for b in engine.buckets or () if isinstance(b, RowSparseBucket)}


def attach(opt: Any, named: list[tuple[str, torch.nn.Parameter]],
           model: Optional[torch.nn.Module], backward_passes_per_step: int, op: ReduceOp,
           gradient_predivide_factor: float, fusion: FusionConfig, overlap_allgather: bool,
           compression: Compressor, groups: Any, sparse_as_dense: bool, autotune: Autotune,
           schedule: Optional[str] = None, row_sparse: Any = None,
           gradient_as_bucket_view: bool = False, comm: Optional[Communicator] = None,
           owns_comm: bool = False, shard_optimizer_state: bool = False,
           buffer_sync: Any = None, sparse: Any = None) -> Engine:
    """The engine of `opt` (already converted to the dear class): built, hooked, registered."""
    comm = runtime.communicator() if comm is None else comm   # a process set's, or dear's
    step = super(_DistributedOptimizer, type(opt)).step
    # The wrapped class's step minus its profiling/step-hook layer: step hooks run once, in
    # our step(), not once per bucket. The inner layer keeps torch's no_grad handling.
    inner_step = getattr(step, "__wrapped__") if getattr(step, "hooked", False) else step
    cfg = runtime.config()
    params = [p for _, p in named]
    updates: Updates = (ShardedUpdates(ShardedState(comm)) if shard_optimizer_state
                        else Updates())
    postscale = gradient_predivide_factor / comm.size if op is ReduceOp.Average else 1.0
    engine = Engine(opt, comm, named, model, updates, inner_step, backward_passes_per_step,
                    1.0 / gradient_predivide_factor, postscale)
    # Which collective goes on the link when (dear/fusion/schedule.py): DeAR's order, or a
    # plan that also fills backward's idle link time with all-gather chunks. It reads the
    # engine's communicator, which a tracer may swap for its recording proxy.
    planned = (cfg.schedule if schedule is None else schedule) == "planned"
    engine.schedule = ScheduleDriver(_comm_of(engine), planned, cfg.plan_after,
                                     cfg.chunk_bytes, issue_mode(params, comm), cfg.plan_slack,
                                     cfg.plan_verify, cfg.plan_contention)
    driver = engine.schedule
    engine.owned_comm = comm if owns_comm else None
    engine.buffer_sync, engine.sparse = buffer_sync, sparse
    recorder = getattr(comm, "recorder", None)   # the flight record (dear/comm/flight.py)
    if recorder is not None:
        recorder.describers.append(weak_method(engine.describe_buffer))
    engine.fusion = fusion
    engine.compression = compression
    if compression.quantizes:
        engine.feedback = feedback.ErrorFeedback(compression)
    engine.sparse_as_dense = sparse_as_dense
    engine.groups = explicit_groups(groups, engine.index)
    engine.overlap = overlap_allgather and model is not None
    if overlap_allgather and model is None:
        log.info("dear: no model= given, so all-gathers complete inside step(); pass "
                 "model= to overlap them with the next forward pass")
    # gradient_as_bucket_view: .grad lives in the bucket buffers (dear/fusion/views.py)
    engine.views = GradientViews() if gradient_as_bucket_view else None
    engine.order = []                          # rank 0's parameter order, for re-layouts
    if isinstance(updates, ShardedUpdates):
        # Each rank updates its shards and the all-gathers carry parameters, so a chunk
        # gathered in backward needs its bucket's update first: run early, undone at step()
        # unless nothing it assumed changed (ShardedUpdates.settle). On the executor thread
        # (CPU tensors) or, on a GPU, on the chunks' side stream, ordered before step() by
        # the schedule's drain().
        if driver.mode is None:
            driver.paused = True
        driver.before_gather = _early_updater(engine, updates)
        row_sparse = "off"
    # Embedding tables sent as the rows some rank used (dear/fusion/rows.py).
    engine.row_sparse_setting = cfg.row_sparse if row_sparse is None else row_sparse
    engine.row_sparse_explicit = row_sparse is not None
    engine.row_sparse = resolve_row_sparse(engine.row_sparse_setting, named, model,
                                           explicit=engine.row_sparse_explicit,
                                           world_size=engine.comm.size)
    if engine.row_sparse:
        log.info("dear: sent as the rows some rank used (row_sparse; DEAR_ROW_SPARSE=off "
                 "sends them whole): %s", ", ".join(engine.names[i]
                                                   for i in sorted(engine.row_sparse)))
    engine.autotuner = (make_autotuner(opt, named, autotune, cfg, comm, fusion, driver,
                                       overlap=engine.overlap,
                                       passes_per_step=backward_passes_per_step)
                        if autotune else None)
    engine.relayout_wanted = False             # new ties: re-plan when nothing is in flight
    if model is not None:
        from ..guards import model_guard
        model_guard.guard(model, opt)
    engine.sparse_ids = {id(p) for p in (sparse.params if sparse else ())}
    engine.param_key = tuple(id(p) for p in params)
    engine.param_digest = parameter_digest(named)
    layout.note_parameter_set(engine)
    opt.dear_engine = engine
    engine.hooks.register(engine)
    weakref.finalize(engine, remove_hooks, engine.hooks.handles)
    runtime.register_optimizer(opt)
    return engine


def _comm_of(engine: Engine) -> Callable[[], Communicator]:
    ref = weakref.ref(engine)                  # the engine holds the schedule
    return lambda: ref().comm  # type: ignore[union-attr]


def _early_updater(engine: Engine, updates: ShardedUpdates) -> Callable[[Any], None]:
    ref = weakref.ref(engine)

    def before_gather(bucket: Any) -> None:
        live = ref()
        if live is not None:
            updates.before_gather(live, bucket)
    return before_gather


_DistributedOptimizer.step.hooked = True  # type: ignore[attr-defined]  # torch must not re-wrap
