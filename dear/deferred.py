"""The DeAR schedule around any torch optimizer: the class `dear.DistributedOptimizer` mixes
into the wrapped optimizer's own class (dear/optimizer.py builds it).

Life of one gradient, phase by phase (each a method with a profiler scope `dear::<phase>`):
  1. `_post_backward` (backward): a post-accumulate-grad hook copies it into its bucket
     (`Bucket.pack`, dear/fusion/bucket.py).
  2. `_launch`: when the bucket is full and every bucket before it in reduce order has started,
     its reduce-scatter starts (dear/fusion/schedule.py issues it on the communicator, whose
     backend is one file: dear/comm/torch_dist.py for torch.distributed), so every rank issues
     reduce-scatters in the same order.
  3. `step()`: finishes the reduce-scatters, averages each shard, starts the all-gathers in
     forward order, and returns: the update is now pending.
  4. `_pre_forward` (next forward; under torch.compile an op of the graph, dear/compiled.py):
     each module holding parameters waits for the all-gathers of its buckets, and
  5. `_finalize` lends those parameters the averaged gradients (`Bucket.swap_grads`) and runs
     the WRAPPED optimizer's own update on them only, just before the module reads them.
Those four files are the whole path of one gradient (docs/ARCHITECTURE.md).
What one iteration accumulates lives in one `Iteration` object (dear/iteration.py), replaced
when the iteration ends (`_end_iteration`).
`flush_updates()` applies whatever is still pending; it runs before state_dict(),
load_state_dict(), dear.shutdown() and an eval-mode forward, so nobody reads half-updated
parameters. `synchronize()` / `skip_synchronize()` keep Horovod's meaning for loops that edit the
averaged gradients (K-FAC, clipping) before the update.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import warnings
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from . import amp, clip, model_guard, native, runtime
from .buffers import BufferBroadcast, issue_pending
from .comm import flight
from .comm.base import Communicator, ReduceOp
from .compiled import PreForwardHook
from .compression import Compressor
from .config import Autotune
from .extension import ExtensionPoints
from .fusion.autotune import make_autotuner
from .fusion.bucket import Bucket, Stage
from .fusion.fusion_config import FusionConfig
from .fusion.layout import GatherGroup, build_layout
from .fusion.rows import RowSparseBucket, resolve_row_sparse
from .fusion.schedule import ScheduleDriver, issue_mode
from .fusion.views import GradientViews
from .iteration import Iteration
from .reduced import ReducedGradientMixin
from . import sharded_checkpoint
from .sharded import KFAC_REFUSED, ShardedState, meet_every_rank, tensor_bytes
from .sparse import SparseGradients
from .stream import StreamCheck, parameter_digest
from .validation import explicit_groups, held_by_ddp, refuse_construction
from .written import PendingWrites, fingerprint, fingerprints, first_changed

log = logging.getLogger("dear")


class _DistributedOptimizer(ExtensionPoints, ReducedGradientMixin, torch.optim.Optimizer):
    """Mixed into the wrapped optimizer's own class (dear/optimizer.py's `DistributedOptimizer`);
    GradScaler and clip_grad_norm_ support come from `ReducedGradientMixin` (dear/reduced.py).
    One class on purpose, like Horovod's: the life of a gradient above reads top to bottom."""

    # Set by DistributedOptimizer() before _dear_setup (they need the wrapped instance).
    _buffer_sync: Optional[BufferBroadcast]    # dear/buffers.py
    _sparse: Optional[SparseGradients]         # dear/sparse.py

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        refuse_construction(self)              # e.g. hvd.DistributedOptimizer(dear's optimizer)

    def _dear_setup(self, named: list[tuple[str, torch.nn.Parameter]],
                    model: Optional[torch.nn.Module], backward_passes_per_step: int,
                    op: ReduceOp, gradient_predivide_factor: float,
                    fusion: FusionConfig, overlap_allgather: bool,
                    compression: Compressor, groups: Any, sparse_as_dense: bool,
                    autotune: Autotune, schedule: Optional[str] = None,
                    row_sparse: Any = None, gradient_as_bucket_view: bool = False,
                    comm: Optional[Communicator] = None, owns_comm: bool = False,
                    shard_optimizer_state: bool = False) -> None:
        comm = runtime.communicator() if comm is None else comm   # a process set's, or dear's
        self._comm = comm
        self._owned_comm = comm if owns_comm else None
        recorder = getattr(comm, "recorder", None)   # the flight record (dear/comm/flight.py)
        if recorder is not None:
            recorder.describers.append(_weak_method(self._describe_buffer))
        step = super(_DistributedOptimizer, type(self)).step
        # The wrapped class's step minus its profiling/step-hook layer: step hooks run once, in
        # our step(), not once per bucket. The inner layer keeps torch's no_grad handling.
        self._inner_step = getattr(step, "__wrapped__") if getattr(step, "hooked", False) else step
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._index = {p: i for i, p in enumerate(self._params)}
        self._passes_needed = backward_passes_per_step
        self._iteration = Iteration.start(len(self._params))   # dear/iteration.py
        self._prescale = 1.0 / gradient_predivide_factor
        self._postscale = (gradient_predivide_factor / comm.size
                           if op is ReduceOp.Average else 1.0)
        self._fusion = fusion
        self._model = model
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._groups = explicit_groups(groups, self._index)
        self._overlap = overlap_allgather and model is not None
        if overlap_allgather and model is None:
            log.info("dear: no model= given, so all-gathers complete inside step(); pass "
                     "model= to overlap them with the next forward pass")
        self._buckets: Optional[list[Bucket]] = None
        # gradient_as_bucket_view: .grad lives in the bucket buffers (dear/fusion/views.py)
        self._views = GradientViews() if gradient_as_bucket_view else None
        self._gather_groups: list[GatherGroup] = []
        self._order: list[int] = []            # rank 0's parameter order, for re-layouts
        # Which collective goes on the link when (dear/fusion/schedule.py): DeAR's order, or a
        # plan that also fills backward's idle link time with all-gather chunks.
        cfg = runtime.config()
        planned = (cfg.schedule if schedule is None else schedule) == "planned"
        self._schedule = ScheduleDriver(lambda: self._comm, planned, cfg.plan_after,
                                        cfg.chunk_bytes, issue_mode(self._params, comm),
                                        cfg.plan_slack)
        # shard_optimizer_state (dear/sharded.py): each rank updates its shards and the
        # all-gathers carry parameters, so a chunk gathered in backward needs its bucket's
        # update first: run early, undone at step() unless nothing it assumed changed
        # (_settle_early_updates). On the executor thread (CPU tensors) or, on a GPU, on the
        # chunks' side stream, ordered before step() by the schedule's drain().
        self._sharded = ShardedState(comm) if shard_optimizer_state else None
        if self._sharded is not None:
            if self._schedule.mode is None:
                self._schedule.paused = True
            self._schedule.before_gather = _weak_method(self._update_early)
            row_sparse = "off"
        # Embedding tables sent as the rows some rank used (dear/fusion/rows.py).
        self._row_sparse_setting = cfg.row_sparse if row_sparse is None else row_sparse
        self._row_sparse_explicit = row_sparse is not None
        self._row_sparse = resolve_row_sparse(self._row_sparse_setting, named, model,
                                              explicit=self._row_sparse_explicit)
        if self._row_sparse:
            log.info("dear: sent as the rows some rank used (row_sparse; DEAR_ROW_SPARSE=off "
                     "sends them whole): %s", ", ".join(self._names[i]
                                                       for i in sorted(self._row_sparse)))
        self._autotuner = (make_autotuner(self, named, autotune, cfg, self._comm, self._fusion,
                                          self._schedule, overlap=self._overlap,
                                          passes_per_step=backward_passes_per_step)
                           if autotune else None)
        self._deferred_at_step: list[torch.Tensor] = []
        self._provisional = False              # plan built before any forward: thrown away
        self._where: list[tuple[Bucket, int]] = []
        self._num_pending = 0                  # buckets whose update waits to be applied
        self._pending_writes = PendingWrites()  # parameters written before their update ran
        self._forward_order: list[int] = []    # parameters in first-execution order
        self._forward_seen: set[int] = set()
        self._grad_order: list[int] = []       # parameters in first-gradient order
        self._triggers: dict[torch.nn.Module, list[Bucket]] = {}
        self._skip_sync = False
        # dear.KFAC's eigenbasis path (dear/kfac/overlap.py): it edits buckets before the
        # reduce-scatter and after the all-gather, and needs `_ties` kept in one bucket each.
        self._transform: Any = None
        self._ties: list[list[int]] = []
        self._relayout_wanted = False          # new ties: re-plan when nothing is in flight
        self._hooks: list[Any] = []
        self._update_observers: list[Callable[[Bucket], Any]] = []   # dear_observe_updates
        if model is not None:
            model_guard.guard(model, self)
        # One tiny all-gather per iteration checks that the ranks' collectives still pair up
        # (dear/stream.py); it also carries a digest of the trained parameters, which may change
        # (add_param_group, requires_grad): the layout is then rebuilt (_adopt_parameter_set).
        self._stream = StreamCheck(comm)
        self._name_of = {p: n for n, p in named}
        self._parameter_names = self._name_of  # Horovod's name for it (its tests read it)
        self._sparse_ids = {id(p) for p in (self._sparse.params if self._sparse else ())}
        self._param_key: tuple[int, ...] = tuple(id(p) for p in self._params)
        self._param_digest = parameter_digest(named)
        self._register_hooks()
        weakref.finalize(self, _remove_hooks, self._hooks)
        runtime.register_optimizer(self)

    def _register_hooks(self) -> None:
        """A gradient hook on each parameter, a forward pre-hook on each module holding one."""
        # Parameters' hooks live where the garbage collector cannot follow them: they hold the
        # optimizer weakly, or a dropped optimizer would keep itself and the model alive forever.
        on_grad = _weak_method(self._post_backward)
        # Native path: a C++ hook per parameter records gradients without a Python frame and
        # falls back to _post_backward whenever _arm_hooks() says the iteration is not a plain one.
        ext = native.extension() if native.enabled(runtime.config().native) else None
        self._hook_switch = ext.HookSwitch() if ext is not None else None
        self._native_hooks: list[Any] = []
        for i, p in enumerate(self._params):
            if ext is not None:
                hook = ext.GradHook(self._hook_switch, i, self._names[i], on_grad,
                                    _weak_method(self._launch))
                self._native_hooks.append(hook)
            else:
                hook = functools.partial(on_grad, i)
            self._hooks.append(p.register_post_accumulate_grad_hook(hook))
        if self._model is not None:
            self._hook_model(self._model)

    # ----------------------------------------------------------------- backward: pack & reduce
    def _post_backward(self, i: int, param: torch.nn.Parameter) -> None:
        """Phase 1, in backward: take parameter i's gradient into its bucket; launch full ones."""
        with _scope("dear::post_backward"):
            it = self._iteration
            if it.reduced:
                raise RuntimeError(
                    f"gradient of {self._names[i]} arrived after optimizer.clip_grad_norm_() "
                    "had reduced this iteration's gradients; call clip_grad_norm_ after the last "
                    "backward and before step(), never after step()")
            it.passes[i] += 1
            if it.passes[i] < self._passes_needed:
                return
            if it.passes[i] > self._passes_needed:
                raise RuntimeError(
                    f"gradient of {self._names[i]} was computed {it.passes[i]} times since "
                    f"this optimizer's last step(), but backward_passes_per_step="
                    f"{self._passes_needed}. dear reduces each gradient as backward produces "
                    "it, so a backward that reaches these parameters counts even if its "
                    "gradients are meant to be thrown away: typically another model's loss "
                    "backpropagating through this one (a GAN's generator loss through the "
                    "discriminator). Keep that backward away from these parameters (e.g. "
                    "p.requires_grad_(False) for them around it, or detach the input), call "
                    "step() after each backward, or raise backward_passes_per_step if the "
                    "passes are meant to accumulate")
            it.grads_since_step = True
            if self._buckets is None:          # first iteration: the plan is built in step()
                self._take(i, param.grad)
                self._grad_order.append(i)
                return
            bucket, j = self._where[i]
            if bucket.stage is Stage.GATHERING:    # its module did not run in this forward
                if bucket.exposes_views and param.grad is bucket.user_views[j]:
                    raise RuntimeError(
                        f"dear: backward wrote the gradient of {self._names[i]} into its bucket "
                        "while the bucket's update was still pending (gradient_as_bucket_view): "
                        "its module did not run and the model's own forward did not end (a "
                        "submodule called directly?). Call optimizer.flush_updates() before "
                        "such a forward, or wrap without gradient_as_bucket_view")
                self._finalize(bucket)
            if self._views is not None and self._views.owns(param):
                grad = self._views.adopt(param)    # a view: its bucket's version is checked
                it.taken[i] = (None if grad is None else weakref.ref(grad), _VIEW)
            else:
                grad = param.grad
                self._take(i, grad)
            bucket.pack(j, grad)
            if bucket.full:
                self._launch()

    def _take(self, i: int, grad: Optional[torch.Tensor]) -> None:
        """Record what parameter i's gradient is as dear takes it, for step()'s edit check."""
        it = self._iteration
        if grad is None:
            it.taken[i] = (None, -1)
            return
        it.taken[i] = (weakref.ref(grad), grad._version)
        if not grad.is_sparse:
            it.fingerprints[i] = fingerprint(grad)

    def _arm_hooks(self) -> None:
        """Let the C++ hooks take gradients only in a plain iteration: buckets built for good,
        one backward pass per step, nothing reduced early (clip_grad_norm_). Buckets with a
        pending update send their gradients to _post_backward themselves (GradReady.pending)."""
        if self._hook_switch is not None:
            self._hook_switch.fast = (self._buckets is not None and not self._provisional
                                      and not self._iteration.reduced and self._passes_needed == 1)

    def _bind_hooks(self) -> None:
        for i, hook in enumerate(self._native_hooks):
            ready = self._where[i][0]._ready if self._buckets is not None else None
            if ready is None:
                hook.unbind()
            else:
                hook.bind(ready, self._where[i][1])
        self._arm_hooks()

    @property
    def _had_gradients(self) -> bool:
        """A backward ran since the last step() (through either kind of hook)."""
        return (self._iteration.grads_since_step
                or bool(self._hook_switch and self._hook_switch.any))

    def _launch(self) -> None:
        """Phase 2: start the reduce-scatters of the full buckets, in reduce order."""
        with _scope("dear::launch"):
            flight.mark("backward", self._step_number)
            buckets = self._buckets
            assert buckets is not None
            while self._iteration.next_launch < len(buckets):
                bucket = buckets[len(buckets) - 1 - self._iteration.next_launch]
                # A bucket whose module skipped this forward still holds last step's pending update
                # (and last step's "full"): it waits for step(), which applies it first.
                if bucket.stage is not Stage.IDLE or not bucket.full:
                    return
                if isinstance(bucket, RowSparseBucket):   # a Tracer's replay models dense buckets
                    bucket.send_dense = self._schedule.paused
                if self._transform is not None:     # it rotates the packed gradients
                    bucket.fill()
                    self._transform.before_reduce(bucket)
                if self._sharded is not None and self._iteration.hyper_at_backward is None:
                    self._iteration.hyper_at_backward = [_hyperparameters(g)
                                                         for g in self.param_groups]
                    self._sharded.attributes = dict(self.__dict__)   # read on that thread
                if self._sharded is not None:
                    self._sharded.launched(bucket, self._schedule.updates_early)
                bucket.start_reduce_scatter(self._comm, self._prescale, self._schedule.submitter())
                self._schedule.reduce_scatter_submitted(bucket, self._postscale)
                self._iteration.next_launch += 1

    # ----------------------------------------------------------------------- step: all-gather
    @torch.optim.Optimizer.profile_hook_step
    def step(self, closure: Optional[Callable[[], float]] = None,  # type: ignore[override]
             grad_scaler: Optional[Any] = None) -> None:
        """Finish averaging and start the all-gathers; the update lands in the next forward.
        `scaler.step(optimizer)` passes its GradScaler as `grad_scaler` (see dear/amp.py)."""
        if closure is not None:
            raise ValueError("dear.DistributedOptimizer.step() does not take a closure: the "
                             "update is applied later, in the next forward pass")
        flight.mark("step", self._step_number)
        amp.check_contract(self, grad_scaler)
        if not self._iteration.synchronized and self._had_gradients:
            if grad_scaler is not None and amp.unscaled_by_user(grad_scaler, self):
                self._abandon_iteration()
                raise RuntimeError(
                    "scaler.unscale_(optimizer) does not work with dear.DistributedOptimizer: "
                    "dear took the local gradients during backward, so unscale_ changes nothing "
                    "that is reduced and the step would be unscaled twice. Drop "
                    "scaler.unscale_(optimizer); to clip, call optimizer.clip_grad_norm_("
                    "max_norm, grad_scaler=scaler) instead, or use Horovod's pattern: "
                    "optimizer.synchronize(); scaler.unscale_(optimizer); <clip>; with "
                    "optimizer.skip_synchronize(): scaler.step(optimizer)")
            self._refuse_edited_grads()
        elif not self._iteration.synchronized and self._zero_grads_only():
            # Horovod's broadcast_optimizer_state: on ranks whose state is empty it sets every
            # .grad to zeros and calls step() (rank 0 does not). Averaging zeros gives zeros, so
            # the wrapped optimizer's own step is the same update, with no collective to hang.
            self.flush_updates()
            if self._sharded is not None and self._sharded.buckets:
                raise RuntimeError(
                    "dear: step() without a backward on this rank, after training began, with "
                    "shard_optimizer_state=True: each rank updates only its own shard, so every "
                    "rank must call step() after a backward")
            self._inner_step(self)
            return
        if not self._iteration.synchronized and self._parameter_set_changed():
            self._step_with_new_parameters(grad_scaler)
            return
        if self._iteration.synchronized:       # Horovod loop: .grad already holds the average
            if not self._skip_sync and not self._iteration.preconditioner_synced:
                # Horovod's wording first: scripts filter this warning by its message.
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(): the gradients are "
                              "already averaged and are applied as they are")
            self._end_iteration()              # its synchronize() flags with it
            self._unshard_state()              # the step reads whole tensors (every rank)
            if grad_scaler is None or not amp.unscale_averaged_grads(grad_scaler, self):
                self._inner_step(self)
            if self._relayout_wanted:          # nothing is in flight after a synchronized step
                self._relayout_wanted = False
                self._relayout(self._fusion)
            return
        if self._skip_sync:
            raise RuntimeError("step() inside skip_synchronize() needs optimizer.synchronize() "
                               "after backward, as in Horovod")
        self._communicate(grad_scaler)
        if self._sparse is not None:           # their update is applied now (dear/sparse.py)
            self._stream.settle()
            self._sparse.apply(self, grad_scaler)
        if not self._overlap or self._provisional:
            self.flush_updates()
        self._discard_provisional_plan()
        if self._autotuner is not None and self._buckets is not None:
            switch = self._autotuner.on_step()
            if switch is not None:             # same step() on every rank
                self.flush_updates()           # no bucket may be in flight while re-planned
                self._relayout(switch)

    def _zero_grads_only(self) -> bool:
        """Every .grad is None or all zeros (no backward ran since the last step())."""
        return all(p.grad is None or (not p.grad.is_sparse and not p.grad.any())
                   for p in self._params)

    def _edited_parameter(self) -> Optional[int]:
        """A parameter whose .grad changed since dear took it this iteration, or None."""
        for i, (ref, version) in self._iteration.taken.items():
            grad = self._params[i].grad
            if ref is None:
                if grad is not None:
                    return i
            elif grad is None or (version != _VIEW and grad._version != version) \
                    or grad is not ref():
                return i
        by_contents = self._edited_contents()
        if by_contents is not None:
            return by_contents
        if self._views is not None and self._buckets is not None:
            edited = self._views.edited(self._buckets)
            if edited is not None:
                return edited
        for bucket in self._buckets or ():
            if bucket._ready is not None and bucket.stage is not Stage.GATHERING:
                j = bucket._ready.first_edited(bucket.params)
                if j >= 0:
                    return bucket.spec.params[j]
        return None

    def _edited_contents(self) -> Optional[int]:
        """A parameter whose .grad is the tensor dear took, at its version, but holds other
        values (written through .data), or None. One comparison for all: a GPU syncs once."""
        taken = self._iteration.fingerprints
        if not taken:
            return None
        grads = [self._params[i].grad for i in taken]
        assert all(g is not None for g in grads), "the caller checked it is the gradient dear took"
        now = fingerprints(grads)       # type: ignore[arg-type]
        k = first_changed(list(taken.values()), now)
        return None if k is None else list(taken)[k]

    def _written_error(self, name: str, how: str) -> RuntimeError:
        return RuntimeError(
            f"dear: parameter {name} was written {how} after optimizer.step() and before the "
            "forward that applies its update: dear applies each update in the next forward, so "
            "it would land on the written values, while under DDP the write comes after the "
            "update. Write the parameters through the model (model.parameters(), "
            "model.state_dict() and the like apply pending updates first), or call "
            "optimizer.flush_updates() after step() and before writing (docs/deferred-update.md)")

    def _refuse_edited_grads(self) -> None:
        """Refuse, the same way in every iteration, an edit of .grad made after backward handed
        it to dear: the reduce-scatter already took the old values. A parameter written through
        .data before the last update ran shows here too (its contents are compared now)."""
        written = self._pending_writes.written_since_step()
        if written is not None:
            self._abandon_iteration()
            raise self._written_error(
                self._names[self._index[written]], "through .data (seen now: the update of the "
                "last step landed on the written values; this step was dropped on this rank)")
        i = self._edited_parameter()
        if i is None:
            return
        self._abandon_iteration()
        name = self._names[i]
        if self._views is not None and self._views.owns(self._params[i]):
            name += " (or of another parameter in its bucket: .grad is a view of it)"
        if held_by_ddp(self._params[i]):    # the usual writer: DDP (Accelerate's prepare())
            raise RuntimeError(
                f"dear: the gradient of {name} was overwritten after backward handed it to "
                "dear.DistributedOptimizer: the model is wrapped in DistributedDataParallel "
                "(by your script, or by Accelerate's prepare(), which Hugging Face's Trainer "
                "calls), and DDP all-reduces into .grad while dear averages the gradients "
                "itself. Train the plain model, not a DDP wrapper: with Hugging Face's Trainer "
                "use dear.huggingface.DeARTrainer in place of transformers.Trainer; with "
                "Accelerate, dear.huggingface.DeARAccelerator in place of Accelerator "
                "(docs/huggingface.md). This step was dropped on this rank.")
        raise RuntimeError(
            f"dear: the gradient of {name} was changed after backward handed it to "
            "dear.DistributedOptimizer (edited in place, also through .data as in "
            "p.grad.data.clamp_(-1, 1), replaced or set to None), e.g. by "
            "torch.nn.utils.clip_grad_norm_ or scaler.unscale_(optimizer). dear reduces each "
            "gradient as soon as backward produces it, so the change would be silently "
            "ignored; this step was dropped on this rank. To clip, call "
            "optimizer.clip_grad_norm_(max_norm) (with a GradScaler: "
            "optimizer.clip_grad_norm_(max_norm, grad_scaler=scaler), without "
            "scaler.unscale_); to edit the averaged gradients in any other way, use Horovod's "
            "pattern: optimizer.synchronize(); <edit .grad>; with "
            "optimizer.skip_synchronize(): optimizer.step(). Hugging Face's Trainer clips, "
            "and measures the norm it logs, with torch's clip_grad_norm_ at every step: use "
            "dear.huggingface.DeARTrainer (docs/huggingface.md).")

    def _abandon_iteration(self) -> None:
        """Drop this iteration's gradients: finish the reduce-scatters already issued (every
        rank issued the same ones), reset the buckets; parameters and pending updates are kept."""
        self._undo_early_updates()
        for bucket in self._buckets or ():
            if bucket.stage is not Stage.GATHERING:   # a pending update of the last step stays
                bucket.drop()
        self._schedule.drain()
        if self._buckets is None:
            self._grad_order = []
        self._end_iteration()

    def _communicate(self, grad_scaler: Optional[Any] = None, gradients: bool = False) -> None:
        """Finish averaging, run GradScaler's check on the reduced shards, and start the
        all-gathers in forward order; a step the scaler skips gathers nothing, on every rank.
        With shard_optimizer_state each rank first updates its shards, and the all-gathers
        carry parameters (`gradients`: the averaged gradients all the same, synchronize())."""
        self._finish_reduce(at_step=not gradients)
        self._settle_early_updates(grad_scaler, gradients)
        if self._buffer_sync is not None:      # dear/buffers.py: DDP's broadcast_buffers
            self._buffer_sync()
        if self._sparse is not None:           # dear/sparse.py: Embedding(sparse=True) weights
            self._sparse.reduce(self._prescale, self._postscale)
        buckets = self._buckets
        assert buckets is not None
        if grad_scaler is None or not self._amp_skips(grad_scaler):
            flight.mark_phase("step")
            update = (self._shard_updater() if self._sharded is not None and not gradients
                      else None)
            self._schedule.maybe_plan([b.wire.element_size() for b in buckets])
            # forward order, 0 needed first; sharded: each group's update right before its
            # all-gather, so the link starts after the first group's, not after all of them
            self._schedule.gather_rest(self._gather_groups, update)
            if self._sharded is not None:
                self._sharded.end_step()
            # The update runs later, after e.g. an LR scheduler has moved on: it must use the
            # hyperparameters that were in force when step() was called.
            self._hyper_at_step = [_hyperparameters(g) for g in self.param_groups]
            self._deferred_at_step = self._iteration.deferred
            self._num_pending = len(buckets)
            if not gradients:                  # else synchronize() applies them right away
                for bucket in buckets:
                    k = bucket.spec.index
                    self._pending_writes.note_step(k, bucket.params,
                                                   self._iteration.param_prints.get(k))
        self._schedule.end_step()
        self._end_iteration()

    def _finish_reduce(self, verify: bool = True, at_step: bool = False) -> None:
        """Finish the reduce-scatters and average each shard, once per iteration; then (once,
        here or at the next call) the stream check, the first collective after them. `at_step`
        (step() without shards): the parameters' fingerprints for PendingWrites are taken
        while the last reduce-scatters run, not after: nothing writes a parameter from here
        to the end of step()."""
        if self._iteration.reduced:
            if verify:
                self._verify_stream()
            return
        if self._buckets is None:
            self._build_buckets()
        buckets = self._buckets
        assert buckets is not None
        self.flush_updates()                   # buffers are about to be reused
        for bucket in buckets:
            if self._views is not None:        # zero_grad(set_to_none=True): no gradient
                for j, p in enumerate(bucket.params):
                    if bucket.exposes_views and not bucket.packed[j] and self._views.absent(p):
                        bucket.pack(j, None)
            bucket.pack_missing()              # unused parameters count as zero
        self._launch()
        if at_step and self._sharded is None:
            self._iteration.param_prints = {b.spec.index: fingerprints(b.params)
                                            for b in buckets}
        self._schedule.drain()                 # what backward submitted is issued: our turn
        flight.mark_phase("reduced")           # the stream check, clipping's all-reduce
        for bucket in reversed(buckets):
            bucket.finish_reduce_scatter(self._postscale)
        self._schedule.reduced()
        self._iteration.reduced = True
        self._arm_hooks()
        if verify:
            self._verify_stream()

    def _verify_stream(self) -> None:
        """dear/stream.py's check, once per iteration, right after its reduce-scatters (the
        same place in every rank's stream, whether the next collective is clipping's, a
        GradScaler's or step()'s)."""
        if self._iteration.stream_verified:
            return
        self._iteration.stream_verified = True
        issue_pending()                        # every optimizer's backward: ours goes after
        count = len(self._buckets or ())
        self._stream.issue(self._had_gradients, self._trainable_digest(),
                           f"the reduce-scatters of buckets 0-{count - 1}" if count else "",
                           all(b.all_used_here for b in self._buckets or ()))

    def _end_iteration(self) -> None:
        self._undo_early_updates()             # none left after a step() that kept them
        for bucket in self._buckets or ():
            if bucket.stage is Stage.REDUCING:  # a skipped step: nothing to gather or apply
                bucket.drop()
        self._iteration = Iteration.start(len(self._params))
        if self._hook_switch is not None:
            self._hook_switch.any = False
        self._arm_hooks()

    def flush_updates(self) -> int:
        """Apply every pending update now; returns how many buckets it applied. Issues no
        collective, so it is safe on one rank alone (e.g. rank 0 saving a checkpoint); reads
        through the model (dear/model_guard.py), eval forwards and shutdown call it."""
        if not self._num_pending or self._buckets is None:
            return 0
        applied = 0
        for bucket in self._buckets:
            if bucket.stage is Stage.GATHERING:
                self._finalize(bucket)
                applied += 1
        return applied

    @property
    def gradient_as_bucket_view(self) -> bool:
        """Whether each .grad is a view of its bucket's buffer (DDP's option)."""
        return self._views is not None

    def discard_pending_updates(self) -> int:
        """After a collective failed (a peer died or stalled): forget the pending update whose
        all-gathers cannot arrive, so that the model and this optimizer hold the last whole
        step and `state_dict()`, an emergency checkpoint and `dear.shutdown()` work again.
        Local, no collective. Returns how many buckets' updates were dropped. Refused when
        part of that step was already applied (the model would mix two steps): then no whole
        step exists to save. On healthy ranks it would throw away a step's work: use
        flush_updates() there."""
        buckets = self._buckets or []
        if not self._num_pending:
            return 0
        if self._sharded is not None:
            raise RuntimeError(
                "dear: with shard_optimizer_state=True each rank updated its optimizer state "
                "for the last step in step(), before the all-gathers that failed, so no whole "
                "step can be saved here; resume from the last checkpoint instead")
        if self._num_pending != len(buckets):
            applied = len(buckets) - self._num_pending
            raise RuntimeError(
                f"dear: {applied} of the {len(buckets)} buckets of the last step were already "
                "applied when its collectives failed, so the model mixes two steps and no whole "
                "step can be saved; resume from the last checkpoint instead")
        for bucket in buckets:
            bucket.reset()                     # the failed collectives are not waited for
        self._pending_writes.forget()
        self._num_pending = 0
        self._end_iteration()                  # nothing is REDUCING now: it waits for nothing
        return len(buckets)

    def _shutdown(self) -> None:
        """dear.shutdown(): apply what is pending; an offline autotune still tracing detaches
        its tracer (its hooks would otherwise stay on the model)."""
        self.flush_updates()
        self._schedule.close()
        if self._autotuner is not None:
            self._autotuner.close()
        if self._owned_comm is not None:       # a process set's communicator
            self._owned_comm.shutdown()
            self._owned_comm = None

    def synchronize(self) -> None:
        """Horovod's meaning. After backward: finish averaging now and put the averaged gradients
        in .grad (then `with optimizer.skip_synchronize(): optimizer.step()`), e.g. to clip or
        precondition them. After step(): apply the pending updates. Call it on every rank."""
        if self._num_pending or not self._had_gradients:
            self.flush_updates()
            return
        self._synchronize_now()

    def _synchronize_now(self) -> None:
        """Averaged gradients in .grad now (synchronize() after a backward)."""
        self._refuse_edited_grads()
        self._communicate(gradients=True)
        if self._sparse is not None:           # averaged sparse gradients in .grad, as Horovod
            self._sparse.to_grad()
        assert self._buckets is not None
        for bucket in self._buckets:
            used = self._finish_all_gather(bucket)
            self._apply_deferred(bucket)
            for p, view, u in zip(bucket.params, bucket.grad_views, used):
                if not u:
                    if self._views is not None and self._views.owns(p):
                        p.grad = None          # as single-process training: no gradient
                    continue
                if p.grad is None:
                    p.grad = view.clone()
                elif p.grad.data_ptr() != view.data_ptr():   # a view of the buffer: in place
                    p.grad.copy_(view)
            bucket.reset()
        self._num_pending = 0
        self._iteration.synchronized = True
        self._discard_provisional_plan()

    def dear_synchronize_for_preconditioner(self) -> None:
        """dear.KFAC on a step that preconditions .grad: synchronize(), and the step() that
        follows applies .grad as after Horovod's skip_synchronize(), without a warning."""
        if self._had_gradients and not self._iteration.synchronized:
            self.synchronize()
            self._iteration.preconditioner_synced = self._iteration.synchronized

    def _attach_transform(self, transform: Any, ties: list[list[int]]) -> None:
        """dear.KFAC's eigenbasis path; with buckets already planned, `ties` take effect at the
        next synchronized step() (dear.KFAC synchronizes until the layout fits)."""
        assert self._views is None, "dear.KFAC preconditions after synchronize() with views"
        if self._sharded is not None:
            raise ValueError(KFAC_REFUSED)
        self._transform, self._ties = transform, ties
        self._schedule.paused = True           # it edits the shards between the collectives
        self._relayout_wanted = self._buckets is not None and not transform.layout_fits()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Horovod's: step() inside applies the gradients synchronize() averaged."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Horovod's: reduce after `passes` backward passes from the next step on; call it
        between step() and the next backward, on every rank."""
        if passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        if self._had_gradients or any(self._iteration.passes):
            raise RuntimeError("set_backward_passes_per_step() between backward and step(): "
                               "call it after step(), before the next backward")
        self._passes_needed = passes
        self._arm_hooks()

    # ---------------------------------------------------------------- next forward: the update
    def _finalize(self, bucket: Bucket) -> None:
        """Run the wrapped optimizer's update on this bucket's parameters only, with the averaged
        gradient as .grad (a view into the gathered buffer); the user's .grad is put back."""
        j = self._pending_writes.before_update(bucket.spec.index, bucket.params)
        if j is not None:                      # said once: the updates stay pending
            self._pending_writes.forget()
            raise self._written_error(self._names[bucket.spec.params[j]], "in place")
        if self._sharded is not None:          # the all-gather carried the new parameters
            with _scope("dear::finalize"), _observed(self._update_observers, bucket):
                try:
                    self._finish_all_gather(bucket)
                    self._sharded.install(bucket)
                finally:
                    bucket.reset()
                    self._num_pending -= 1
            return
        with _scope("dear::finalize"), _observed(self._update_observers, bucket):
            used = self._finish_all_gather(bucket)
            self._apply_deferred(bucket)
            saved = bucket.swap_grads([view if u else None
                                       for view, u in zip(bucket.grad_views, used)])
            groups = self.param_groups
            originals = [dict(g) for g in groups]
            try:
                members_of = self._group_members(bucket)
                for k, g in enumerate(groups):
                    if k < len(self._hyper_at_step) and k < len(members_of):
                        g.update(self._hyper_at_step[k])
                        g["params"] = members_of[k]
                    else:                          # added after step(): not in this update
                        g["params"] = []
                self._inner_step(self)
            finally:
                for g, original in zip(groups, originals):
                    g.update(original)
                bucket.swap_grads(saved)
                bucket.zero_pending_views()        # zero_grad() while it was pending
                bucket.reset()
                self._num_pending -= 1

    def _gathered_early(self) -> bool:
        """Some bucket already holds gathered gradients before step() (chunks of the planned
        schedule, row-sparse tables): scale factors of step() are deferred to the update."""
        return self._schedule.gathered_early() or any(
            isinstance(b, RowSparseBucket) for b in self._buckets or ())

    def _apply_deferred(self, bucket: Bucket) -> None:
        """Unscale / clip factors of step() that chunks gathered in backward missed."""
        grads = bucket.buffer[:bucket.spec.flags_offset]
        for factor in self._deferred_at_step:
            grads.mul_(factor.to(grads.dtype))

    def _finish_all_gather(self, bucket: Bucket) -> list[bool]:
        """The averaged gradients in the bucket's buffer (dear.KFAC's rotation undone); which
        parameters any rank produced a gradient for. Nothing is applied before the stream check
        of its step has passed (issued before the all-gathers, so already arrived)."""
        self._stream.settle()
        used = bucket.finish_all_gather()
        if self._transform is not None:
            self._transform.after_gather(bucket)
        return used

    def _group_members(self, bucket: Bucket) -> list[list[torch.nn.Parameter]]:
        members = getattr(bucket, "group_members", None)
        if members is None:
            owner = {p: gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
            members = [[] for _ in self.param_groups]
            for p in bucket.params:
                members[owner[p]].append(p)
            bucket.group_members = members  # type: ignore[attr-defined]
        return members

    # ------------------------------------------------ a parameter set that may change
    def _trainable(self) -> list[torch.nn.Parameter]:
        """What the optimizer trains now: its parameters with requires_grad, sparse ones aside."""
        return [p for g in self.param_groups for p in g["params"]
                if p.requires_grad and id(p) not in self._sparse_ids]

    def _trainable_named(self) -> list[tuple[str, torch.nn.Parameter]]:
        if self._model is not None and any(p not in self._name_of for p in self._trainable()):
            with model_guard.quiet():
                for n, p in self._model.named_parameters():
                    self._name_of.setdefault(p, n)
        return [(self._name_of.get(p) or f"group{k}.param{j}", p)
                for k, g in enumerate(self.param_groups) for j, p in enumerate(g["params"])
                if p.requires_grad and id(p) not in self._sparse_ids]

    def _trainable_digest(self) -> int:
        """The stream check's digest of the trained parameters (recomputed when they change)."""
        key = tuple(id(p) for p in self._trainable())
        if key != self._param_key:
            self._param_key = key
            self._param_digest = parameter_digest(self._trainable_named())
        return self._param_digest

    def _parameter_set_changed(self) -> bool:
        params = self._params
        trainable = self._trainable()
        return len(trainable) != len(params) or any(a is not b for a, b in zip(trainable, params))

    def _step_with_new_parameters(self, grad_scaler: Optional[Any]) -> None:
        """add_param_group, or requires_grad flipped (gradual unfreezing, freezing): this step
        runs synchronously, the layout's buckets averaging what they hold, one all-reduce the
        gradients of parameters outside the layout, the wrapped optimizer updating everything
        now (as single-process training); the layout is rebuilt for the next iteration, its
        order learnt again in the next forward. The stream check inside makes sure every rank
        changed the same way."""
        if self._groups is not None or self._transform is not None or self._autotuner is not None:
            what = ("groups=" if self._groups is not None else
                    "dear.KFAC" if self._transform is not None else "autotune")
            raise RuntimeError(
                "dear: the optimizer's trained parameters changed (add_param_group or "
                f"requires_grad), which {what} does not support: freeze nothing after the "
                "wrap, or wrap again with the final parameter set")
        self._synchronize_now()               # checks every rank's new parameter set
        self._iteration.synchronized = False
        self._unshard_state()
        self._average_outside_layout([p for p in self._trainable() if p not in self._index])
        if grad_scaler is None or not amp.unscale_averaged_grads(grad_scaler, self):
            self._inner_step(self)
        self._adopt_parameter_set()

    def _average_outside_layout(self, params: list[torch.nn.Parameter]) -> None:
        """Average the gradients of parameters the layout does not hold (one all-reduce per
        dtype); a parameter no rank produced a gradient for keeps None."""
        comm = self._comm
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
            flat[:numel].mul_(self._prescale)
            if comm.size > 1:
                comm.all_reduce(flat).wait()
            flat[:numel].mul_(self._postscale)
            offset = 0
            for k, p in enumerate(group):
                if flat[numel + k].item() > 0:
                    p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()

    def _adopt_parameter_set(self) -> None:
        """Hooks, names and indices for the parameters trained now; buckets built at the next
        step() from the order the next forward shows."""
        named = self._trainable_named()
        _remove_hooks(self._hooks)
        self._hooks.clear()
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._index = {p: i for i, p in enumerate(self._params)}
        self._iteration = Iteration.start(len(self._params))
        self._buckets, self._where, self._gather_groups, self._triggers = None, [], [], {}
        self._order, self._forward_order, self._grad_order = [], [], []
        self._forward_seen = set()
        if self._views is not None:
            self._views = GradientViews()
        self._row_sparse = resolve_row_sparse(self._row_sparse_setting, named, self._model,
                                              explicit=self._row_sparse_explicit)
        self._param_key = tuple(id(p) for p in self._params)
        self._param_digest = parameter_digest(named)
        self._register_hooks()
        self._bind_hooks()
        log.info("dear: the trained parameters changed (%d now); the layout is rebuilt at the "
                 "next step", len(self._params))

    # ------------------------------------------------------------------- plan (first step)
    def _build_buckets(self) -> None:
        order = self._forward_order if self._overlap else list(reversed(self._grad_order))
        order = list(dict.fromkeys(order))
        seen = set(order)
        unseen = [i for i in range(len(self._params)) if i not in seen]
        # Parameters no module claimed in the forward (used directly by a parent, e.g. BERT's
        # token_type.weight[0]) are applied before the root's forward: put them in bucket 0,
        # which is reduced last anyway. At the end they would be in the first bucket to
        # reduce, and since their gradient can come last, no reduce-scatter could start
        # before backward ends.
        order = unseen + order if self._overlap else order + unseen
        # A step before any forward (e.g. Horovod's broadcast_optimizer_state initialising the
        # state) has no execution order yet: it runs synchronously on a throwaway plan.
        provisional = self._overlap and not self._forward_order
        # Ranks may have run different branches: everyone adopts rank 0's decision.
        order, self._provisional = self._comm.broadcast_object((order, provisional), 0)
        self._order = order
        self._relayout(self._fusion)
        for i, p in enumerate(self._params):
            if self._iteration.passes[i] > 0 or p.grad is not None:
                bucket, j = self._where[i]
                bucket.pack(j, p.grad)

    def _relayout(self, fusion: FusionConfig) -> None:
        """(Re)build buckets and all-gather groups from rank 0's order; nothing may be in
        flight. Deterministic given the order, so every rank builds the same layout."""
        explicit = self._groups
        order = self._order
        if isinstance(explicit, int):          # Horovod: N groups of consecutive parameters
            size = -(-len(order) // explicit)
            explicit = [order[k:k + size] for k in range(0, len(order), size)]
        self._unshard_state()                  # the state follows the new shards (absorb)
        row_sparse = self._row_sparse if self._transform is None else ()  # K-FAC rotates rows
        layout = build_layout(self._params, order, fusion, self._comm.size, explicit,
                              self._compression, self._sparse_as_dense, self._ties,
                              row_sparse, self._comm.rank, views=self._views is not None)
        self._fusion = fusion
        self._layout = layout
        self._buckets, self._where = layout.buckets, layout.where
        self._pending_writes.forget()          # keyed by bucket: nothing is pending now
        self._gather_groups = layout.gather_groups
        if self._views is not None:            # .grad moves into the new buffers
            self._views.attach(layout.buckets)
            for i in self._iteration.taken:    # taken before the buckets existed
                p = self._params[i]
                if self._views.owns(p) and p.grad is not None:
                    self._iteration.taken[i] = (weakref.ref(p.grad), _VIEW)
                    self._iteration.fingerprints.pop(i, None)   # dear writes the buffer
                    bucket = self._where[i][0]
                    bucket.taken_version = bucket.user_version()
        self._triggers = {}
        self._schedule.reset(layout.buckets, fusion.chunk_bytes)   # re-planned with its chunks
        if self._sharded is not None:
            self._sharded.layout(layout.buckets)
        if self._model is not None:
            self._map_triggers(self._model)
        self._bind_hooks()
        log.info("dear: %s (%s)", layout.describe(), fusion.describe())

    def _discard_provisional_plan(self) -> None:
        if self._provisional:
            self._unshard_state()
            if self._sharded is not None:
                self._sharded.clear()
            self._buckets, self._where, self._triggers = None, [], {}
            self._gather_groups = []
            self._grad_order = []
            self._bind_hooks()

    # ------------------------------------------------------------------------- module hooks
    @property
    def _step_number(self) -> int:
        """The step() this iteration ends, counted from 1 (labels in the hang report)."""
        return self._stream.steps + (0 if self._iteration.stream_verified else 1)

    def _describe_buffer(self, ptr: int) -> Optional[str]:
        """Which bucket a collective's tensor belongs to, for the hang report (dear/hang.py)."""
        for bucket in self._buckets or ():
            if bucket.holds(ptr):
                return f"bucket {bucket.spec.index} ({len(bucket.params)} parameters)"
        return None

    def _hook_model(self, model: torch.nn.Module) -> None:
        for module in model.modules():
            if module is model or any(p in self._index for p in module.parameters(recurse=False)):
                # eager, or an op of the graph under torch.compile (dear/compiled.py)
                self._hooks.append(model_guard.track(
                    PreForwardHook(module, _weak_method(self._pre_forward))))
        if self._views is not None:
            # Backward writes into the buffers at once: an update still pending when the
            # forward ends (its module did not run) must read them first.
            self._hooks.append(model_guard.track(
                model.register_forward_hook(_eager(self._after_forward))))
        # Loading into the model through a container that holds it (parent.load_state_dict)
        # reaches it here, not through its own load_state_dict (dear/model_guard.py): a
        # pending update applied after the load would overwrite what was loaded.
        flush = _weak_method(self.flush_updates)
        self._hooks.append(model_guard.track(model.register_load_state_dict_pre_hook(
            lambda *args: flush())))

    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        """Phase 4: before `module` runs, apply the pending buckets holding its parameters."""
        with _scope("dear::pre_forward"):
            tuner = self._autotuner
            if tuner is not None and tuner.samples_per_iteration is None and module is self._model:
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                tuner.samples_per_iteration = (0 if first is None
                                               else first.shape[0] * self._comm.size)
            if module is self._model and self._buffer_sync is not None:
                self._buffer_sync.apply_staged()   # DDP's broadcast_buffers point (buffers.py)
            if module is self._model and not module.training:
                self.flush_updates()               # evaluation reads every parameter
            elif self._num_pending:
                for bucket in self._triggers.get(module, ()):
                    if bucket.stage is Stage.GATHERING:
                        self._finalize(bucket)
            elif self._buckets is None:            # first iteration: learn the execution order
                for p in module.parameters(recurse=False):
                    i = self._index.get(p)
                    if i is not None and i not in self._forward_seen:
                        self._forward_seen.add(i)
                        self._forward_order.append(i)

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._num_pending:
            self.flush_updates()

    def _map_triggers(self, model: torch.nn.Module) -> None:
        """Each module applies the pending buckets holding its parameters; parameters whose
        module never ran (used directly by a parent) are applied before the root's forward."""
        assert self._buckets is not None
        for module in model.modules():
            mine = [self._where[self._index[p]][0] for p in module.parameters(recurse=False)
                    if p in self._index]
            if mine:
                self._triggers[module] = list(dict.fromkeys(mine))
        unseen = [self._where[i][0] for i in range(len(self._params))
                  if i not in self._forward_seen]
        if unseen:
            self._triggers[model] = list(dict.fromkeys(self._triggers.get(model, []) + unseen))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's, except that with gradient_as_bucket_view the views are zeroed in place (once
        a pending update has read them); see dear/fusion/views.py."""
        views = self._views
        if views is None or self._buckets is None:
            super().zero_grad(set_to_none)
            return
        if self._had_gradients:
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
        self.flush_updates()
        if self._sharded is None or not self._sharded.buckets:
            return super().state_dict()
        full = self._gather_sharded_state("optimizer.state_dict()")
        kept = self.state
        merged: Any = collections.defaultdict(dict, kept)
        merged.update(full)
        self.state = merged
        try:
            return super().state_dict()
        finally:
            self.state = kept

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's; with shard_optimizer_state this rank keeps only its shards of it."""
        self.flush_updates()
        self._undo_early_updates()
        super().load_state_dict(state_dict)
        for bucket in self._buckets or ():
            bucket.group_members = None  # type: ignore[attr-defined]
        if self._sharded is not None and self._sharded.buckets:
            self._sharded.state.clear()
            self._sharded.absorb(self.state)

    # ------------------------------------------------------------ shard_optimizer_state
    def sharded_state_dict(self) -> dict[str, Any]:
        """With shard_optimizer_state: this rank's pieces of the state as ShardedTensors, for
        torch.distributed.checkpoint.save / .load on any world size
        (dear/sharded_checkpoint.py). No collective."""
        self.flush_updates()
        if self._sharded is None:
            raise RuntimeError("sharded_state_dict() needs shard_optimizer_state=True; "
                               "without it, state_dict() is the whole state on every rank")
        return sharded_checkpoint.sharded_state_dict(self, self._trained_names(),
                                                     self._comm.rank, self._comm.size)

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """What torch.distributed.checkpoint.load filled into sharded_state_dict()'s template."""
        self.flush_updates()
        if self._sharded is None:
            raise RuntimeError("load_sharded_state_dict() needs shard_optimizer_state=True")
        sharded_checkpoint.load_sharded_state_dict(self, state_dict, self._trained_names())

    def _trained_names(self) -> dict[Any, str]:
        return {p: n for n, p in self._trainable_named()}

    @property
    def shard_optimizer_state(self) -> bool:
        """Whether each rank keeps and updates only its shards of the optimizer state."""
        return self._sharded is not None

    @property
    def autotuner(self) -> Any:
        """The fusion autotuner (autotune="online" or "offline"), else None. Read-only for
        callers: `.finished`, `.current` (the thresholds in force), `.plan`."""
        return self._autotuner

    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds beside the model's parameters and gradients, for capacity
        planning: `buffers` (the buckets' flat gradients and shards, and with sharding the
        shards' parameter values), `state` (the optimizer state held here: all of it, or this
        rank's shards) and `peak_saved` (with sharding: the most state saved at once to undo
        updates applied early)."""
        buffers = sum(tensor_bytes((b.buffer, b.shard)) for b in self._buckets or ())
        state = sum(tensor_bytes(s.values()) for s in self.state.values())
        saved = 0
        if self._sharded is not None:
            buffers += tensor_bytes(self._sharded._values)
            state += sum(tensor_bytes(s.values()) for s in self._sharded.state.values())
            saved = self._sharded.peak_saved_bytes
        return {"buffers": buffers, "state": state, "peak_saved": saved}

    def row_sparse_stats(self) -> dict[str, tuple[int, int]]:
        """Per embedding table sent by rows (row_sparse): (its rows, the rows the last
        iteration sent: the union of every rank's)."""
        return {self._names[b.spec.params[0]]: (b.rows, b.sent_rows)
                for b in self._buckets or () if isinstance(b, RowSparseBucket)}

    def _shard_updater(self) -> Callable[[Sequence[Bucket]], None]:
        """step(), sharded: the wrapped optimizer's update on this rank's shards of some
        buckets (those not updated early), called for each all-gather group before it is
        issued. After the stream check: nothing of a step is applied before it passed; which
        parameters some rank had a gradient for is learnt once, here (maybe a collective)."""
        sharded = self._sharded
        assert sharded is not None and self._buckets is not None
        self._stream.settle()
        used = self._used_anywhere()
        hyper = [_hyperparameters(g) for g in self.param_groups]

        def update(buckets: Sequence[Bucket]) -> None:
            with _scope("dear::update_shards"):
                sharded.update(self, self._inner_step, used, hyper, only=buckets)
        return update

    def _update_early(self, bucket: Bucket) -> None:
        """Before the first chunk of `bucket` is gathered in backward (on the collective
        thread): this rank's update of its shard, with the hyperparameters of the start of
        backward, undoable until step() keeps it. A bucket some parameter of which had no
        gradient here is left alone: then not every rank had them all, and every rank undoes."""
        sharded = self._sharded
        hyper = self._iteration.hyper_at_backward
        if sharded is None or hyper is None or not bucket.all_used_here:
            return
        with _scope("dear::update_early"):
            sharded.update_early(self, self._inner_step, bucket, hyper)

    def _settle_early_updates(self, grad_scaler: Optional[Any], gradients: bool) -> None:
        """step(), sharded, every reduce-scatter done: keep the updates run early only if
        step() would run the same ones: no GradScaler, clipping that scaled by exactly 1,
        every parameter with a gradient on some rank (on every rank, as each
        assumed), the same hyperparameters and no parameter written since. Else undo them
        (the same decision on every rank: these are global facts). Whether the next iteration
        may run them early follows from the same test. The parameters' fingerprints that test
        takes go into the iteration's param_prints (step() writes no parameter, and undoing
        touches only the optimizer state: note_step reuses them)."""
        sharded = self._sharded
        if sharded is None:
            return
        it = self._iteration
        self._stream.settle()                  # everyone_used
        kept = (grad_scaler is None and not gradients and self._stream.everyone_used
                and all(bool((f == 1).all()) for f in it.deferred + it.scaled)
                and it.hyper_at_backward is not None
                and _same_hyperparameters(it.hyper_at_backward,
                                          [_hyperparameters(g) for g in self.param_groups])
                and sharded.unwritten(it.param_prints))
        self._schedule.held = not kept
        if not kept:
            self._undo_early_updates()
        it.deferred = []                       # each was 1 (or was applied to the shards)

    def _undo_early_updates(self) -> None:
        """The early updates of this iteration are undone and their chunks forgotten: step()
        updates and gathers every bucket as in DeAR's order; factors deferred for the chunks
        (clipping, unscaling) are applied to the shards instead, the same multiplications."""
        sharded = self._sharded
        if sharded is None or not (sharded.early or self._schedule.gathered_early()):
            return
        self._schedule.drain()
        sharded.undo_early()
        for bucket in self._buckets or ():
            if bucket.stage is Stage.REDUCING:
                bucket.forget_early_gathers()
        self._schedule.forget_early()
        it = self._iteration
        if it.deferred and self._buckets:
            for factor in it.deferred:
                clip.scale_(self._buckets, self._comm.rank, factor)
            it.deferred = []

    def _used_anywhere(self) -> list[list[bool]]:
        """Per bucket, which parameters some rank had a gradient for: known without a
        collective when every rank had them all (the stream check says), else one all-reduce
        of the usage flags."""
        buckets = self._buckets or []
        if self._stream.everyone_used:
            return [[True] * len(b.params) for b in buckets]
        flags = torch.tensor([u for b in buckets for u in b.local_used()], dtype=torch.float32)
        if self._comm.size > 1:
            self._comm.all_reduce(flags).wait()
        used = (flags > 0).tolist()
        out, k = [], 0
        for b in buckets:
            out.append(used[k:k + len(b.params)])
            k += len(b.params)
        return out

    def _gather_sharded_state(self, what: str) -> dict[Any, dict[str, Any]]:
        """Every rank's shards of the state, unsharded (a collective, after the ranks met through
        the rendezvous store so that a rank calling it alone gets an error, not a hang)."""
        assert self._sharded is not None
        self._undo_early_updates()
        meet_every_rank(what, self._comm.size)
        return self._sharded.gather_full()

    def _unshard_state(self) -> None:
        """Before a step on whole tensors or a new layout: the sharded state, gathered, goes
        into self.state in torch's form (absorbed again at the next sharded step)."""
        if self._sharded is not None and self._sharded.buckets:
            self.flush_updates()
            self._undo_early_updates()
            self.state.update(self._sharded.take_full())  # type: ignore[arg-type]


_VIEW = -2      # _taken's version of a gradient view: its bucket's version is checked instead


def _weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` called through a weak reference to its object: a no-op once it is collected."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)
    return call


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook` run eagerly under torch.compile: it waits for all-gathers and runs the wrapped
    optimizer's update, which dynamo cannot trace; the compiled graph breaks around it."""
    return torch.compiler.disable(hook, recursive=True)


def _remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in group.items() if k != "params"}


def _same_hyperparameters(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    def same(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                    and x.shape == y.shape and bool(torch.equal(x, y)))
        return bool(x == y)
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(same(x[k], y[k]) for k in x) for x, y in zip(a, b))


def _observed(observers: list[Callable[[Bucket], Any]], bucket: Bucket) -> Any:
    """The observers' context managers around one bucket's update (dear_observe_updates)."""
    return _all_entered(observers, bucket) if observers else contextlib.nullcontext()


@contextlib.contextmanager
def _all_entered(observers: list[Callable[[Bucket], Any]], bucket: Bucket) -> Iterator[None]:
    with contextlib.ExitStack() as stack:      # one that fails to enter exits the others
        for observer in observers:
            stack.enter_context(observer(bucket))
        yield


def _scope(name: str) -> Any:
    """A profiler scope naming the phase, only while a profiler records (its cost otherwise)."""
    return (torch.autograd.profiler.record_function(name)
            if torch.autograd.profiler._is_profiler_enabled else contextlib.nullcontext())


_DistributedOptimizer.step.hooked = True  # type: ignore[attr-defined]  # torch must not re-wrap
