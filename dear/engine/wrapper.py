"""The class dear.DistributedOptimizer mixes into the wrapped optimizer's own class
(dear/engine/optimizer.py builds it): torch's and Horovod's optimizer API over the engine, which is
the instance's one attribute of dear's (`dear_engine`), so dear's names cannot collide with those of
the user's optimizer class."""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch

from ..comm import runtime
from ..comm.base import Communicator
from ..fusion.rows import RowSparseBucket
from ..fusion.schedule import scope
from ..guards.validation import refuse_construction
from ..interfaces import DearOptimizer
from ..sharding import checkpoint as sharded_checkpoint
from ..sharding.state import tensor_bytes
from . import amp_clip, feedback, steps
from .buffers import BufferBroadcast
from .engine import Engine
from .extension import ExtensionPoints
from .hooks import weak_method
from .options import EngineOptions
from .params import ParameterSet
from .sparse import SparseGradients
from .state import hyperparameters

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
        with self.dear_engine.skipping_synchronize():
            yield

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Horovod's: reduce after `passes` backward passes from the next step on; call it
        between step() and the next backward, on every rank."""
        self.dear_engine.set_passes(passes)

    def discard_pending_updates(self) -> int:
        """After a collective failed (a peer died or stalled): forget the pending update whose
        all-gathers cannot arrive, so that the model and this optimizer hold the last whole
        step and `state_dict()`, an emergency checkpoint and `dear.shutdown()` work again.
        Local, no collective. Returns how many buckets' updates were dropped. Refused when
        part of that step was already applied (the model would mix two steps): then no whole
        step exists to save. On healthy ranks it would throw away a step's work: use
        flush_updates() there."""
        return self.dear_engine.forget_pending()

    def dear_synchronize_for_preconditioner(self) -> None:
        """dear.KFAC on a step that preconditions .grad: synchronize(), and the step() that
        follows applies .grad as after Horovod's skip_synchronize(), without a warning."""
        engine = self.dear_engine
        if engine.had_gradients and not engine.iteration.synchronized:
            self.synchronize()
            engine.iteration.preconditioner_synced = engine.iteration.synchronized

    # ------------------------------------------------ clipping and GradScaler (amp_clip.py)
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
        state = engine.updates.state_dict(engine, super().state_dict)
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
        engine.updates.loaded(engine)

    # ------------------------------------------------------------ Horovod Elastic's state
    def dear_elastic_commit(self) -> dict[str, Any]:
        """What hvd.elastic's commit keeps of this optimizer, every pending update applied
        first (a commit sees the applied update, never a pending one). Sharded state stays in
        pieces, this rank's and a copy of another rank's (a collective, every rank:
        dear/sharding/commit.py), with the hyperparameters beside them here; else
        state_dict(), copied."""
        engine = self.dear_engine
        engine.flush()
        if engine.updates.make_commit(engine):
            return {_SHARDED_COMMIT: True, "param_groups": copy.deepcopy(
                [hyperparameters(g) for g in self.param_groups])}
        return copy.deepcopy(self.state_dict())

    def dear_elastic_restore(self, saved: dict[str, Any]) -> None:
        """After a failed collective, before Horovod re-forms the world: drop what waited on
        the old one and go back to the last commit, with no collective (sharded: its pieces
        are put together in the new world, at `dear_elastic_rejoin`)."""
        self.dear_engine.abandon_world(keep_state=False)
        if saved.get(_SHARDED_COMMIT):
            for group, hyper in zip(self.param_groups, saved["param_groups"]):
                group.update(copy.deepcopy(hyper))
        else:
            self.load_state_dict(saved)

    def dear_elastic_rejoin(self, saved: dict[str, Any]) -> bool:
        """Horovod's sync after the world changed (every rank, the same point): start over in
        the new world. Sharded state comes back from the last commit's pieces, wherever the
        ranks hold them, cut for the new size and never whole anywhere, with rank 0's
        hyperparameters: then True (the state is in sync). False: the state is whole in the
        optimizer, for the caller to broadcast. `saved`: the commit (the engine keeps its own
        part of a sharded one)."""
        if not self.dear_engine.rejoin():
            return False
        runtime.broadcast_optimizer_state(self, 0)     # sharded: the hyperparameters only
        return True

    def dear_feedback_state(self) -> Optional[dict[str, Any]]:
        """Quantized compression's state on this rank (its warm-up count and its residuals,
        which are per rank), with no collective: what a per-rank commit keeps beside a sharded
        one, whose sharded_state_dict() holds no residuals. None without error feedback."""
        engine = self.dear_engine
        engine.flush()
        return None if engine.feedback is None else engine.feedback.state(engine)

    def dear_load_feedback_state(self, state: dict[str, Any]) -> None:
        """Put back what dear_feedback_state() returned: the residuals if they are this rank's
        of the same world size (else they start from zero, said once)."""
        engine = self.dear_engine
        engine.flush()
        self._reload_feedback(lambda fb: fb.load(engine, state))

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
        sharded_checkpoint.load_sharded_state_dict(self, state_dict, self._trained_names(),
                                                   engine.comm.rank, engine.comm.size)

    def _reload_feedback(self, load: Callable[[feedback.ErrorFeedback], None]) -> None:
        """Quantized compression: `load` its state, then lay the buckets out again if that
        moved the run into or out of its warm-up (fp32 buckets until it ends)."""
        engine = self.dear_engine
        if engine.feedback is None:
            return
        warm = engine.feedback.warm
        load(engine.feedback)
        if engine.buckets is not None and engine.feedback.warm != warm:
            engine.relayout(engine.fusion)

    def _trained_names(self) -> dict[Any, str]:
        engine = self.dear_engine
        return {p: n for n, p in engine.trained.trainable_named(self, engine.model)}

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
           model: Optional[torch.nn.Module], options: EngineOptions, comm: Communicator,
           sparse_ids: frozenset[int], owned_comm: Optional[Communicator] = None,
           buffer_sync: Optional[BufferBroadcast] = None,
           sparse: Optional[SparseGradients] = None) -> Engine:
    """The engine of `opt` (already converted to the dear class): built, registered."""
    step = super(_DistributedOptimizer, type(opt)).step
    # The wrapped class's step minus its profiling/step-hook layer: step hooks run once, in
    # our step(), not once per bucket. The inner layer keeps torch's no_grad handling.
    inner_step = getattr(step, "__wrapped__") if getattr(step, "hooked", False) else step
    trained = ParameterSet.build(opt, named, model, sparse_ids, options.row_sparse,
                                 options.row_sparse_explicit, comm.size)
    engine = Engine(opt, comm, options, trained, model, inner_step, owned_comm=owned_comm,
                    buffer_sync=buffer_sync, sparse=sparse)
    recorder = getattr(comm, "recorder", None)   # the flight record (dear/comm/flight.py)
    if recorder is not None:
        recorder.describers.append(weak_method(engine.describe_buffer))
    if model is not None:
        from ..guards import model_guard
        model_guard.guard(model, opt)
    opt.dear_engine = engine
    runtime.register_optimizer(opt)
    return engine


if TYPE_CHECKING:
    def _offers_the_extension_points(opt: _DistributedOptimizer) -> DearOptimizer:
        return opt                             # mypy checks the class against the Protocol


_DistributedOptimizer.step.hooked = True  # type: ignore[attr-defined]  # torch must not re-wrap


_SHARDED_COMMIT = "dear_sharded_commit"

