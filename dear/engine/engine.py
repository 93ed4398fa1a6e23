"""The engine of one dear.DistributedOptimizer: everything its data path holds, and the phases of
an iteration as methods, each under a profiler scope `dear::<phase>`:

    post_backward -> launch -> reduce -> gather (step()) -> pre_forward -> apply (next forward)

1. `post_backward` (backward, a gradient hook per parameter; C++ on the native path): take the
   gradient into its bucket (`Bucket.pack`, dear/fusion/bucket.py);
2. `launch`: a full bucket's reduce-scatter starts, every rank in the same order (through the
   schedule's collective thread: dear/fusion/executor.py; the backend's collective:
   dear/comm/torch_dist.py for torch.distributed, wrapped by dear/comm/flight.py);
3. `reduce` (step(), or clip_grad_norm_ earlier): the reduce-scatters finished, each shard
   averaged, then the stream check (dear/guards/stream.py);
4. `gather` (step()): the all-gathers start in forward order; the update is now pending
   (`Pending`);
5. `pre_forward` (next forward; dear/engine/compiled.py under torch.compile): a module holding
   parameters applies the pending buckets holding them, and
6. `apply` lends those parameters the averaged gradients and runs the wrapped optimizer's own
   update on them only, just before the module reads them (`updates`: dear/engine/updates.py;
   with shard_optimizer_state the update already ran in step() and the gathered parameters are
   installed instead).

The user's optimizer holds this object as its one attribute `dear_engine` (dear/engine/
wrapper.py gives it torch's and Horovod's API); the checks of docs/contract.md live in
dear/engine/checks.py, the layout's construction in dear/engine/layout.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from typing import Any, Callable, Iterator, Optional

import torch

from ..autotune.factory import make_autotuner
from ..comm import flight, runtime
from ..comm.base import Communicator
from ..fusion.bucket import Bucket, Stage
from ..fusion.executor import issue_pending
from ..fusion.fusion_config import FusionConfig
from ..fusion.rows import RowSparseBucket
from ..fusion.schedule import ScheduleDriver, issue_mode, scope
from ..fusion.views import GradientViews
from ..guards.stream import StreamCheck
from ..guards.written import fingerprint, fingerprints
from ..sharding.state import ShardedState
from . import checks, layout
from .buffers import BufferBroadcast
from .checks import LateEdits
from .feedback import ErrorFeedback
from .hooks import Hooks, remove_hooks
from .layout import ModelLayout
from .options import EngineOptions
from .params import ParameterSet
from .sparse import SparseGradients
from .state import (
    TRANSITIONS,
    VIEW,
    ForwardOrder,
    Iteration,
    Pending,
    Phase,
    check_transition,
    hyperparameters,
)
from .updates import ShardedUpdates, Updates

log = logging.getLogger("dear")


class Engine:
    """Buckets, layout, schedule, the iteration in progress and what is pending from step() to
    the next forward, for one wrapped optimizer (`opt`). Built complete here from the wrap's
    settings (`EngineOptions`) and what it trains (`ParameterSet`); only its own methods assign
    its fields (tests/test_architecture.py checks this)."""

    def __init__(self, opt: torch.optim.Optimizer, comm: Communicator, options: EngineOptions,
                 trained: ParameterSet, model: Optional[torch.nn.Module],
                 inner_step: Callable[[Any], Any], *, owned_comm: Optional[Communicator] = None,
                 buffer_sync: Optional[BufferBroadcast] = None,
                 sparse: Optional[SparseGradients] = None) -> None:
        self.opt = opt
        self.comm = comm                    # every collective's (a tracer may swap in a proxy)
        self.owned_comm = owned_comm        # a process set's, shut down with the engine
        self.model = model
        self.options = options
        self.trained = trained
        self.inner_step = inner_step        # the wrapped class's step, without step hooks
        self.passes_needed = options.passes
        self.skip_sync = False              # inside skip_synchronize()
        self.buffer_sync, self.sparse = buffer_sync, sparse
        # What depends on the world (its size, the communicator's state): built again when the
        # world changes under Horovod Elastic (`rejoin`).
        self.updates, self.schedule, self.feedback, self.autotuner, self.stream = \
            self._world_bound()
        # gradient_as_bucket_view: .grad lives in the bucket buffers (dear/fusion/views.py)
        self.views = GradientViews() if options.views else None
        # dear.KFAC's eigenbasis path (dear/kfac/overlap.py): it edits buckets before the
        # reduce-scatter and after the all-gather, and needs its ties kept in one bucket each.
        self.transform: Optional[Transform] = None
        self.phase = Phase.LEARNING
        self.learned = ForwardOrder()       # the first iterations' order, until a layout
        self.layout: Optional[ModelLayout] = None
        self.iteration = Iteration.start(len(trained.params))
        self.pending = Pending()
        # .grad edits whose contents were compared on a GPU: read at a later step() (checks.py)
        self.late_edits = LateEdits()
        self.listeners = Listeners()
        self.hooks = Hooks()                # where dear is called from (dear/engine/hooks.py)
        self.hooks.register(self)
        weakref.finalize(self, remove_hooks, self.hooks.handles)
        if self.trained.row_sparse:
            log.info("dear: sent as the rows some rank used (row_sparse; DEAR_ROW_SPARSE=off "
                     "sends them whole): %s", ", ".join(trained.names[i]
                                                       for i in sorted(trained.row_sparse)))

    def _world_bound(self) -> tuple[Updates, ScheduleDriver, Optional[ErrorFeedback], Any,
                                    StreamCheck]:
        """The parts built for the world as it is: where updates run (sharded state is cut
        for N), the schedule (planned from this world's link), quantization's residuals, the
        autotuner's trials, and the stream check (one tiny all-gather per iteration that checks
        that the ranks' collectives still pair up; it also carries a digest of the trained
        parameters: dear/guards/stream.py)."""
        cfg, options, comm = runtime.config(), self.options, self.comm
        updates: Updates = (ShardedUpdates(ShardedState(comm, lambda: self.params))
                            if options.sharded else Updates())
        # Which collective goes on the link when (dear/fusion/schedule.py): DeAR's order, or a
        # plan that also fills backward's idle link time with all-gather chunks. It reads the
        # engine's communicator, which a tracer may swap for its recording proxy.
        schedule = ScheduleDriver(_comm_of(self), options.planned, cfg.plan_after,
                                  cfg.chunk_bytes, issue_mode(self.trained.params, comm),
                                  cfg.plan_slack, cfg.plan_verify, cfg.plan_contention)
        if isinstance(updates, ShardedUpdates):
            # Each rank updates its shards and the all-gathers carry parameters, so a chunk
            # gathered in backward needs its bucket's update first: run early, undone at
            # step() unless nothing it assumed changed (ShardedUpdates.settle). On the executor
            # thread (CPU tensors) or, on a GPU, on the chunks' side stream, ordered before
            # step() by the schedule's drain().
            if schedule.mode is None:
                schedule.paused = True
            schedule.before_gather = _early_updater(self, updates)
        # Quantized compression's warm-up count and residuals (dear/engine/feedback.py)
        feedback = ErrorFeedback(options.compression) \
            if options.compression.quantizes else None
        autotuner = (make_autotuner(self.opt, list(zip(self.trained.names, self.trained.params)),
                                    options.autotune, cfg, comm, options.fusion, schedule,
                                    overlap=options.overlap, passes_per_step=options.passes)
                     if options.autotune else None)
        return updates, schedule, feedback, autotuner, StreamCheck(comm)

    # -------------------------------------------------------------- reading the state
    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self.trained.params

    @property
    def names(self) -> list[str]:
        return self.trained.names

    @property
    def index(self) -> dict[torch.nn.Parameter, int]:
        return self.trained.index

    @property
    def name_of(self) -> dict[torch.nn.Parameter, str]:
        return self.trained.name_of

    @property
    def buckets(self) -> Optional[list[Bucket]]:
        """The layout's buckets in forward order; None until the first step() builds them."""
        return None if self.layout is None else self.layout.buckets

    @property
    def fusion(self) -> FusionConfig:
        """The thresholds in force (the autotuner's latest, or the wrap's)."""
        return self.options.fusion if self.layout is None else self.layout.fusion

    @property
    def postscale(self) -> float:
        """What each reduced sum is multiplied by: the average's 1 / N (of the world as it is
        now), times gradient_predivide_factor; 1 for op=Sum."""
        options = self.options
        return options.predivide / self.comm.size if options.average else 1.0

    @property
    def overlap(self) -> bool:
        return self.options.overlap

    @property
    def provisional(self) -> bool:
        """The layout was built before any forward (a step() with no order yet): thrown away
        after that step."""
        return self.layout is not None and self.layout.provisional

    @property
    def ties(self) -> list[list[int]]:
        return [] if self.transform is None else self.transform.ties

    @property
    def row_sparse(self) -> set[int]:
        """The tables the layout sends as rows (none under dear.KFAC: it rotates every row)."""
        return self.trained.row_sparse if self.transform is None else set()

    # ------------------------------------------------------------------------------ hooks
    def arm_hooks(self) -> None:
        """The C++ hooks' switch for the iteration starting now (dear/engine/hooks.py)."""
        layout = self.layout
        self.hooks.arm(None if layout is None else layout.buckets,
                       layout is not None and layout.provisional, self.iteration,
                       self.passes_needed)

    def bind_hooks(self) -> None:
        self.hooks.bind(self.buckets, self.layout.where if self.layout is not None else [])
        self.arm_hooks()

    @property
    def had_gradients(self) -> bool:
        """A backward ran since the last step() (through either kind of hook)."""
        return (self.iteration.grads_since_step
                or self.hooks.any)

    @property
    def step_number(self) -> int:
        """The step() this iteration ends, counted from 1 (labels in the hang report)."""
        return self.stream.steps + (0 if self.iteration.stream_verified else 1)

    # ------------------------------------------------------------- 1. backward: take
    def post_backward(self, i: int, param: torch.nn.Parameter) -> None:
        """In backward: take parameter i's gradient into its bucket; launch full ones (the
        native path's C++ hook does this without calling here in a plain iteration)."""
        with scope("dear::post_backward"):
            it = self.iteration
            if it.reduced:
                raise RuntimeError(
                    f"gradient of {self.names[i]} arrived after optimizer.clip_grad_norm_() "
                    "had reduced this iteration's gradients; call clip_grad_norm_ after the last "
                    "backward and before step(), never after step()")
            it.passes[i] += 1
            if it.passes[i] < self.passes_needed:
                return
            if it.passes[i] > self.passes_needed:
                raise RuntimeError(_passes_error(self.names[i], it.passes[i], self.passes_needed))
            it.grads_since_step = True
            if self.layout is None:           # first iteration: the plan is built in step()
                self.take(i, param.grad)
                self.learned.grads.append(i)
                return
            bucket, j = self.layout.where[i]
            if bucket.stage is Stage.GATHERING:    # its module did not run in this forward
                if bucket.exposes_views and param.grad is bucket.user_views[j]:
                    raise RuntimeError(
                        f"dear: backward wrote the gradient of {self.names[i]} into its bucket "
                        "while the bucket's update was still pending (gradient_as_bucket_view): "
                        "its module did not run and the model's own forward did not end (a "
                        "submodule called directly?). Call optimizer.flush_updates() before "
                        "such a forward, or wrap without gradient_as_bucket_view")
                self.apply(bucket)
            if self.views is not None and self.views.owns(param):
                grad = self.views.adopt(param)    # a view: its bucket's version is checked
                it.taken[i] = (None if grad is None else weakref.ref(grad), VIEW)
            else:
                grad = param.grad
                self.take(i, grad)
            bucket.pack(j, grad)
            if bucket.full:
                self.launch()

    def take(self, i: int, grad: Optional[torch.Tensor]) -> None:
        """Record what parameter i's gradient is as dear takes it, for step()'s edit check."""
        it = self.iteration
        if grad is None:
            it.taken[i] = (None, -1)
            return
        it.taken[i] = (weakref.ref(grad), grad._version)
        if it.check_contents and not grad.is_sparse:
            it.fingerprints[i] = fingerprint(grad)

    # ------------------------------------------------------------- 2. launch
    def launch(self) -> None:
        """Start the reduce-scatters of the full buckets, in reduce order (last bucket first)."""
        with scope("dear::launch"):
            if self.options.elastic and self._world_moved():   # a removal-only reset skips
                self.rejoin()                                    # Horovod's sync
                return
            flight.mark("backward", self.step_number)
            assert self.layout is not None
            buckets = self.layout.buckets
            self._enter(Phase.BACKWARD, "a reduce-scatter's launch")
            it = self.iteration
            postscale = None
            while it.next_launch < len(buckets):
                bucket = buckets[len(buckets) - 1 - it.next_launch]
                # A bucket whose module skipped this forward still holds last step's pending
                # update (and last step's "full"): it waits for step(), which applies it first.
                if bucket.stage is not Stage.IDLE or not bucket.full:
                    return
                if isinstance(bucket, RowSparseBucket):   # a Tracer's replay models dense ones
                    bucket.send_dense = self.schedule.paused
                if self.transform is not None:      # it rotates the packed gradients
                    bucket.fill()
                    self.transform.rotation.before_reduce(bucket)
                self.updates.launched(self, bucket)
                bucket.start_reduce_scatter(self.comm, self.options.prescale,
                                            self.schedule.submitter())
                if postscale is None:
                    postscale = self.postscale
                self.schedule.reduce_scatter_submitted(bucket, postscale)
                it.next_launch += 1

    # ------------------------------------------------------------- 3. reduce
    def reduce(self, verify: bool = True, at_step: bool = False) -> None:
        """Finish the reduce-scatters and average each shard, once per iteration; then (once,
        here or at the next call) the stream check, the first collective after them. `at_step`
        (step()): the parameters' fingerprints for the write checks are taken while the last
        reduce-scatters run, not after: nothing writes a parameter from here to step()'s end."""
        if self.iteration.reduced:
            if verify:
                self.verify_stream()
            return
        with scope("dear::reduce"):
            if self.layout is None:
                self.build_layout()
            assert self.layout is not None
            buckets = self.layout.buckets
            self.flush()                       # buffers are about to be reused
            for bucket in buckets:
                if self.views is not None:     # zero_grad(set_to_none=True): no gradient
                    for j, p in enumerate(bucket.params):
                        if bucket.exposes_views and not bucket.packed[j] \
                                and self.views.absent(p):
                            bucket.pack(j, None)
                bucket.pack_missing()          # unused parameters count as zero
            self.launch()
            if at_step and self.iteration.check_contents and self.updates.prints_at_step:
                self.iteration.param_prints = {b.spec.index: fingerprints(b.params)
                                               for b in buckets}
            with scope("dear::wait_collective_thread"):
                self.schedule.drain()          # what backward submitted is issued: our turn
            flight.mark_phase("reduced")       # the stream check, clipping's all-reduce
            with scope("dear::wait_reduce_scatter"):
                postscale = self.postscale
                for bucket in reversed(buckets):
                    bucket.finish_reduce_scatter(postscale)
            self.schedule.reduced()
            self.iteration.reduced = True
            self._enter(Phase.REDUCED, "the reduce-scatters' end")
            self.arm_hooks()
            if verify:
                self.verify_stream()

    def verify_stream(self) -> None:
        """dear/guards/stream.py's check, once per iteration, right after its reduce-scatters (the
        same place in every rank's stream, whether the next collective is clipping's, a
        GradScaler's or step()'s)."""
        if self.iteration.stream_verified:
            return
        self.iteration.stream_verified = True
        issue_pending()                        # every optimizer's backward: ours goes after
        buckets = () if self.layout is None else self.layout.buckets
        count = len(buckets)
        digest = self.trained.current_digest(self.opt, self.model, self.iteration.check_contents)
        self.stream.issue(self.had_gradients, digest,
                          f"the reduce-scatters of buckets 0-{count - 1}" if count else "",
                          all(b.all_used_here for b in buckets))

    # ------------------------------------------------------------- 4. gather
    def gather(self, skip: bool = False, gradients: bool = False) -> None:
        """step(): start the all-gathers in forward order; the update is now pending (a step
        a GradScaler skips, `skip`, gathers nothing, on every rank). `gradients`: they carry
        the averaged gradients even with shard_optimizer_state (synchronize())."""
        with scope("dear::gather"):
            assert self.layout is not None
            buckets = self.layout.buckets
            if self.phase is not Phase.REDUCED:
                check_transition(self.phase, Phase.PENDING, "step()'s all-gathers")
            if not skip:
                flight.mark_phase("step")
                update = self.updates.updater(self, gradients)
                self.schedule.maybe_plan([b.wire.element_size() for b in buckets])
                # forward order, 0 needed first; sharded: each group's update right before its
                # all-gather, so the link starts after the first group's, not after all of them
                self.schedule.gather_rest(self.layout.gather_groups, update)  # type: ignore[union-attr]
                self.updates.end_step()
                # The update runs later, after e.g. an LR scheduler has moved on: it must use
                # the hyperparameters that were in force when step() was called.
                pending = self.pending
                pending.hyper = [hyperparameters(g) for g in self.opt.param_groups]
                pending.deferred = self.iteration.deferred
                pending.count = len(buckets)
                if not gradients:              # else synchronize() applies them right away
                    prints = self.iteration.param_prints
                    for bucket in buckets:
                        k = bucket.spec.index
                        pending.writes.note_step(k, bucket.params, prints.get(k),
                                                 self.iteration.check_contents)
                self._enter(Phase.PENDING, "step()'s all-gathers")
            self.schedule.end_step()
            self.end_iteration()

    def end_iteration(self) -> None:
        """The iteration's state is dropped (step() ended, or it was abandoned); the next one
        starts, with its checks decided (the same on every rank)."""
        self.updates.undo_early(self)          # none left after a step() that kept them
        layout = self.layout
        for bucket in () if layout is None else layout.buckets:
            if bucket.stage is Stage.REDUCING:  # a skipped step: nothing to gather or apply
                bucket.drop()
        if layout is not None and not layout.provisional:
            layout.steps += 1
        check = checks.contents_checked(0 if layout is None else layout.steps,
                                        self.stream.steps + 1, self.options.check_every)
        self.iteration = Iteration.start(len(self.params), check)
        self.phase = (Phase.LEARNING if layout is None else
                      Phase.PENDING if self.pending.count else Phase.IDLE)
        self.hooks.any = False
        self.arm_hooks()
        self.hook_modules()

    def hook_modules(self) -> None:
        """Every module holding parameters hooked while the layout is new, in iterations that
        compare contents (checks.py) and when the modules did not keep the first forward's
        order; else only each bucket's first module and the root (hooks.py says why)."""
        layout = self.layout
        narrow = (layout is not None and not layout.provisional and layout.first_module
                  and not self.iteration.check_contents and not layout.order_varies)
        keep = {*layout.first_module.values(), self.model} if narrow else None  # type: ignore[union-attr]
        self.hooks.hook_modules(keep)  # type: ignore[arg-type]

    def abandon_iteration(self) -> None:
        """Drop this iteration's gradients: finish the reduce-scatters already issued (every
        rank issued the same ones), reset the buckets; parameters and pending updates are kept."""
        self.updates.undo_early(self)
        for bucket in self.buckets or ():
            if bucket.stage is not Stage.GATHERING:   # a pending update of the last step stays
                bucket.drop()
        self.schedule.drain()
        if self.layout is None:
            self.learned.grads.clear()
        self.end_iteration()

    # ------------------------------------------------------------- 5. next forward
    def pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        """Before `module` runs: apply the pending buckets holding its parameters."""
        if torch.autograd.profiler._is_profiler_enabled:     # scope() inlined: per module
            with torch.autograd.profiler.record_function("dear::pre_forward"):
                self._pre_forward(module, args)
        else:
            self._pre_forward(module, args)

    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        model = self.model
        layout = self.layout
        if module is model:
            self._before_model(module, args)
        if module is model and not module.training:
            self.flush()                           # evaluation reads every parameter
        elif self.pending.count and layout is not None:
            for bucket in layout.triggers.get(module, ()):
                if bucket.stage is Stage.GATHERING:
                    if module is not layout.first_module.get(bucket.spec.index, module) \
                            and not layout.order_varies:
                        layout.order_varies = True   # every module stays hooked (hooks.py)
                        log.info("dear: a module ran before the first module of its bucket "
                                 "in the first forward; every module keeps its hook")
                    self.apply(bucket)
        elif layout is None:                       # first iteration: learn the execution order
            self.learned.saw_module(module, self.index)

    def _before_model(self, model: torch.nn.Module, args: Any) -> None:
        """The root's own work before its forward: the autotuner learns the batch size, and
        the buffers received in step() go in place (DDP's broadcast_buffers point)."""
        tuner = self.autotuner
        if tuner is not None and tuner.samples_per_iteration is None:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            tuner.samples_per_iteration = 0 if first is None else first.shape[0] * self.comm.size
        if self.buffer_sync is not None:
            self.buffer_sync.apply_staged()

    def after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.pending.count:
            self.flush()

    # ------------------------------------------------------------- 6. apply
    def apply(self, bucket: Bucket) -> None:
        """The update of `bucket` (pending since step()): refuse a parameter written in place
        since, then the strategy's update (dear/engine/updates.py). In a world of one every
        all-gather is a local copy, done when issued, so there is nothing for the updates to
        overlap: every pending bucket is updated in this one call of the optimizer, as torch's
        own step() would (one call a bucket costs the optimizer's per-call host time once per
        bucket; docs/benchmarks.md#host-cost)."""
        together = [bucket]
        if self.comm.size == 1 and self.buckets is not None and not self.updates.sharded:
            together += [b for b in self.buckets
                         if b is not bucket and b.stage is Stage.GATHERING]
        for b in together:
            j = self.pending.writes.before_update(b.spec.index, b.params)
            if j is not None:                  # said once: the updates stay pending
                self.pending.writes.forget()
                raise checks.written_error(self.names[b.spec.params[j]], "in place")
        with scope("dear::apply"), contextlib.ExitStack() as observed:
            for b in together:
                observed.enter_context(_observed(self.listeners.updates, b))
            self.updates.apply(self, bucket, together[1:])

    def applied(self, bucket: Bucket) -> None:
        """The update of `bucket` is done with (or, sharded, failed): it is no longer pending.
        A replicated bucket whose all-gather failed stays pending: discard_pending_updates()
        then drops the whole step."""
        bucket.reset()
        self.pending.count -= 1
        if not self.pending.count and self.phase is Phase.PENDING:
            self._enter(Phase.IDLE, "the last pending update")

    def finish_all_gather(self, bucket: Bucket) -> list[bool]:
        """The averaged gradients in the bucket's buffer (dear.KFAC's rotation undone); which
        parameters any rank produced a gradient for. Nothing is applied before the stream check
        of its step has passed (issued before the all-gathers, so already arrived)."""
        with scope("dear::wait_gather"):
            self.stream.settle()
            used = bucket.finish_all_gather()
            if self.transform is not None:
                self.transform.rotation.after_gather(bucket)
            return used

    def apply_deferred(self, bucket: Bucket) -> None:
        """Unscale / clip factors of step() that chunks gathered in backward missed."""
        grads = bucket.buffer[:bucket.spec.flags_offset]
        for factor in self.pending.deferred:
            grads.mul_(factor.to(grads.dtype))

    def flush(self) -> int:
        """Apply every pending update now; returns how many buckets it applied. Issues no
        collective, so it is safe on one rank alone (dear/guards/model_guard.py, eval, shutdown).
        Under Horovod Elastic, after the world changed, nothing pending can arrive: dropped."""
        layout = self.layout
        if not self.pending.count or layout is None:
            return 0
        if self.options.elastic and self._world_moved():
            self.abandon_world()
            return 0
        applied = 0
        for bucket in layout.buckets:
            if bucket.stage is Stage.GATHERING:
                self.apply(bucket)
                applied += 1
        return applied

    def gathered_early(self) -> bool:
        """Some bucket already holds gathered gradients before step() (chunks of the planned
        schedule, row-sparse tables): scale factors of step() are deferred to the update."""
        return self.schedule.gathered_early() or any(
            isinstance(b, RowSparseBucket) for b in self.buckets or ())

    def describe_buffer(self, ptr: int) -> Optional[str]:
        """Which bucket a collective's tensor belongs to, for the hang report
        (dear/comm/hang.py)."""
        for bucket in self.buckets or ():
            if bucket.holds(ptr):
                return f"bucket {bucket.spec.index} ({len(bucket.params)} parameters)"
        return None

    # ------------------------------------------------------------- the layout
    def build_layout(self) -> None:
        """The first step(): the layout from the order the first forward showed (rank 0's:
        ranks may have run different branches, everyone adopts rank 0's decision)."""
        order, provisional = layout.first_order(self.learned, len(self.params), self.overlap)
        order, provisional = self.comm.broadcast_object((order, provisional), 0)
        self._adopt_layout(order, provisional, self.fusion)
        self._enter(Phase.IDLE, "the first layout")
        for i, p in enumerate(self.params):
            if self.iteration.passes[i] > 0 or p.grad is not None:
                bucket, j = self.layout.where[i]  # type: ignore[union-attr]
                bucket.pack(j, p.grad)

    def relayout(self, fusion: FusionConfig) -> None:
        """Buckets and all-gather groups rebuilt from the same order with `fusion` (autotuner,
        dear.KFAC's ties, the end of quantization's warm-up, a loaded state); nothing may be
        in flight. Deterministic given the order, so every rank builds the same layout."""
        assert self.layout is not None
        self._adopt_layout(self.layout.order, self.layout.provisional, fusion)

    def relayout_if_wanted(self, also: bool = False) -> None:
        """After a synchronized step (nothing in flight): the layout dear.KFAC's new ties asked
        for, or (`also`) one for another reason."""
        wanted = self.transform is not None and self.transform.relayout_wanted
        if wanted or also:
            if self.transform is not None:
                self.transform.relayout_wanted = False
            self.relayout(self.fusion)

    def _adopt_layout(self, order: list[int], provisional: bool, fusion: FusionConfig) -> None:
        self.updates.release(self)             # the state follows the new shards
        feedback = self.feedback               # quantized: residuals follow their parameters
        if feedback is not None:
            feedback.collect(self)
        self.layout = layout.build(
            self.params, order, provisional, fusion, self.options, self.comm, self.ties,
            self.options.compression if feedback is None else feedback.wire_compression(),
            self.row_sparse, self.model, self.learned, self.index)
        self.pending.writes.forget()           # keyed by bucket: nothing is pending now
        if feedback is not None:
            feedback.restore(self)
        self.iteration.check_contents = True   # the checks compare contents for a while
        if self.views is not None:             # .grad moves into the new buffers
            self.views.attach(self.layout.buckets)
            self.iteration.taken_into_views(self.views, self.params, self.layout.where)
        self.schedule.reset(self.layout.buckets, fusion.chunk_bytes)  # re-planned, its chunks
        self.updates.layout(self.layout.buckets)
        self.bind_hooks()
        self.hook_modules()
        log.info("dear: %s (%s)", self.layout.describe(), fusion.describe())

    def discard_provisional_layout(self) -> None:
        """After the step() that ran before any forward: its layout is thrown away and the
        next forward's order makes the real one."""
        if self.layout is None or not self.layout.provisional:
            return
        self.updates.release(self)
        self.layout = None
        self.learned = ForwardOrder()
        self.phase = Phase.LEARNING
        self.bind_hooks()
        self.hook_modules()

    def adopt_parameter_set(self) -> None:
        """The trained parameters changed (add_param_group, requires_grad flipped): hooks,
        names and indices for those trained now; buckets built at the next step() from the
        order the next forward shows."""
        old = self.trained
        named = old.trainable_named(self.opt, self.model)
        self.hooks.remove()
        self.trained = ParameterSet.build(self.opt, named, self.model, old.sparse_ids,
                                          self.options.row_sparse,
                                          self.options.row_sparse_explicit, self.comm.size,
                                          name_of=old.name_of)
        self.iteration = Iteration.start(len(self.params))
        self.layout = None
        self.learned = ForwardOrder()
        self.phase = Phase.LEARNING
        if self.views is not None:
            self.views = GradientViews()
        self.hooks.register(self)
        self.bind_hooks()
        log.info("dear: the trained parameters changed (%d now); the layout is rebuilt at the "
                 "next step", len(self.params))

    # ------------------------------------------------------------- settings changed by calls
    def attach_transform(self, rotation: Any, ties: list[list[int]]) -> None:
        """dear.KFAC's eigenbasis path (the optimizer's dear_attach_transform)."""
        assert self.views is None, "dear.KFAC preconditions after synchronize() with views"
        self.updates.check_transform()
        if self.options.elastic:
            raise ValueError("dear.KFAC under Horovod Elastic: its factors, decompositions and "
                             "owners would have to follow a world that changes in place; run "
                             "dear.KFAC under torchrun's elastic agent (dear.elastic), which "
                             "restarts the workers at each change")
        if self.options.compression.quantizes:
            raise ValueError(
                f"dear.KFAC's eigenbasis path rotates the gradients before the reduce-scatter, "
                f"and {self.options.compression!r}'s error feedback would carry residuals "
                "from one basis into the next: wrap the optimizer with compression=dear."
                "Compression.none or .fp16 for dear.KFAC")
        self.transform = Transform(rotation, ties, relayout_wanted=(
            self.layout is not None and not rotation.layout_fits()))
        self.schedule.paused = True            # it edits the shards between the collectives

    def set_passes(self, passes: int) -> None:
        """Horovod's set_backward_passes_per_step, between step() and the next backward."""
        if passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        if self.had_gradients or any(self.iteration.passes):
            raise RuntimeError("set_backward_passes_per_step() between backward and step(): "
                               "call it after step(), before the next backward")
        self.passes_needed = passes
        self.arm_hooks()

    @contextlib.contextmanager
    def skipping_synchronize(self) -> Iterator[None]:
        """Horovod's skip_synchronize(): step() inside applies what synchronize() averaged."""
        self.skip_sync = True
        try:
            yield
        finally:
            self.skip_sync = False

    def use_communicator(self, comm: Communicator) -> None:
        """A tracer's recording proxy in place of the communicator, or the original back."""
        self.comm = comm

    def gathered_by_hand(self) -> None:
        """synchronize() waited for every all-gather itself and put the averages in .grad:
        nothing is pending."""
        self.pending.count = 0
        if self.phase is Phase.PENDING:
            self._enter(Phase.IDLE, "synchronize()")

    def forget_pending(self) -> int:
        """After a collective failed: the pending update is dropped (the optimizer's
        discard_pending_updates()). Returns how many buckets' updates were dropped."""
        buckets = self.buckets or []
        if not self.pending.count:
            return 0
        self.updates.check_discard()
        if self.pending.count != len(buckets):
            applied = len(buckets) - self.pending.count
            raise RuntimeError(
                f"dear: {applied} of the {len(buckets)} buckets of the last step were already "
                "applied when its collectives failed, so the model mixes two steps and no whole "
                "step can be saved; resume from the last checkpoint instead")
        for bucket in buckets:
            bucket.reset()                     # the failed collectives are not waited for
        self.pending.writes.forget()
        self.pending.count = 0
        self.end_iteration()                   # nothing is REDUCING now: it waits for nothing
        return len(buckets)

    # ------------------------------------------------------------- a world that changed
    def abandon_world(self, keep_state: bool = True) -> None:
        """The world this engine was built for is gone (Horovod Elastic: a collective of it
        failed, or Horovod re-formed it): whatever waits on it is dropped without waiting, the
        same on every rank: the pending update, the iteration, the layout (cut for the old N).
        The optimizer state stays whole in the optimizer; sharded, it is the last commit's
        (`keep_state` False: the caller loads a commit itself). Local: no collective."""
        with contextlib.suppress(Exception):  # the collective thread's failed issues
            self.schedule.drain()
        for bucket in self.buckets or ():
            bucket.reset()
        if not self.updates.abandon(self) and keep_state:
            raise RuntimeError(
                "dear: the world changed (Horovod Elastic) after shard_optimizer_state's "
                "shards were updated past the last commit, and the shards of the ranks that "
                "left are gone with them: no whole optimizer state is left to go on from. "
                "Commit (state.commit()) after every step before checking for host updates, "
                "so that a reset resumes from the commit")
        self.updates.clear()
        self.pending = Pending()
        self.late_edits = LateEdits()
        self.layout = None
        self.learned = ForwardOrder()
        self.iteration = Iteration.start(len(self.params))
        self.phase = Phase.LEARNING
        if self.views is not None:
            self.views = GradientViews()
        self.bind_hooks()
        self.hook_modules()

    def rejoin(self) -> bool:
        """Every rank, at the same point, once the world changed (Horovod Elastic's sync, or the
        first collective after a re-formed world): this engine starts over in the world as it
        is now. What was cut for the old world is dropped (`abandon_world`), what depends on it
        is built again (the schedule is planned again, the autotuner tunes again, quantization's
        residuals start from zero after a warm-up, the stream check counts from 1), the wrap's
        cross-rank checks run again (a new rank's first), and the next step() lays the buckets
        out for the new N from rank 0's forward order. Whole optimizer state stays where it is
        (the caller loaded the last commit); sharded, the last commit's pieces, wherever the
        ranks hold them, are cut again for this world (`ShardedUpdates.resume`): then True."""
        commit, generation = self.updates.commit, self.updates.generation
        self.abandon_world()
        self.schedule.close()
        if self.autotuner is not None:
            self.autotuner.close()
        self.comm.rejoin()
        self.updates, self.schedule, self.feedback, self.autotuner, self.stream = \
            self._world_bound()
        # before any collective: a rejoin that fails in one (a rank lost meanwhile) leaves the
        # commit where the next rejoin finds it
        self.updates.commit, self.updates.generation = commit, generation
        if self.options.rejoin_checks is not None:
            self.options.rejoin_checks(self.comm)
        resumed = self.updates.resume(self, commit, generation)
        log.info("dear: rank %d of %d after the world changed; buckets are laid out again at "
                 "the next step", self.comm.rank, self.comm.size)
        return resumed

    def _world_moved(self) -> bool:
        """Horovod Elastic re-formed the world since this engine joined it (the callers ask
        only under Horovod Elastic: options.elastic)."""
        return self.comm.moved

    def _enter(self, phase: Phase, what: str) -> None:
        if phase not in TRANSITIONS[self.phase]:
            check_transition(self.phase, phase, what)          # raises, naming both
        self.phase = phase

    def shutdown(self) -> None:
        """dear.shutdown(): apply what is pending; an offline autotune still tracing detaches
        its tracer (its hooks would otherwise stay on the model)."""
        self.flush()
        self.schedule.close()
        if self.autotuner is not None:
            self.autotuner.close()
        if self.owned_comm is not None:        # a process set's communicator
            self.owned_comm.shutdown()
            self.owned_comm = None


@dataclasses.dataclass
class Transform:
    """dear.KFAC's eigenbasis path attached to the engine: `rotation.before_reduce` and
    `after_gather` edit each bucket around its collectives; `ties` share a bucket."""

    rotation: Any
    ties: list[list[int]]
    relayout_wanted: bool = False              # new ties: re-plan when nothing is in flight


@dataclasses.dataclass
class Listeners:
    """Collaborators' callbacks (the optimizer's extension points)."""

    #: each returns a context manager entered around one bucket's update (dear_observe_updates)
    updates: list[Callable[[Bucket], Any]] = dataclasses.field(default_factory=list)
    #: called with step()'s grad_scaler first thing in step() (dear_on_step: dear.KFAC's scale)
    steps: list[Callable[[Any], Any]] = dataclasses.field(default_factory=list)


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


def _observed(observers: list[Callable[[Bucket], Any]], bucket: Bucket) -> Any:
    """The observers' context managers around one bucket's update (dear_observe_updates)."""
    return _all_entered(observers, bucket) if observers else contextlib.nullcontext()


@contextlib.contextmanager
def _all_entered(observers: list[Callable[[Bucket], Any]], bucket: Bucket) -> Iterator[None]:
    with contextlib.ExitStack() as stack:      # one that fails to enter exits the others
        for observer in observers:
            stack.enter_context(observer(bucket))
        yield


def _passes_error(name: str, passes: int, needed: int) -> RuntimeError:
    return RuntimeError(
        f"gradient of {name} was computed {passes} times since "
        f"this optimizer's last step(), but backward_passes_per_step="
        f"{needed}. dear reduces each gradient as backward produces "
        "it, so a backward that reaches these parameters counts even if its "
        "gradients are meant to be thrown away: typically another model's loss "
        "backpropagating through this one (a GAN's generator loss through the "
        "discriminator). Keep that backward away from these parameters (e.g. "
        "p.requires_grad_(False) for them around it, or detach the input), call "
        "step() after each backward, or raise backward_passes_per_step if the "
        "passes are meant to accumulate")


__all__ = ["Engine", "Phase", "scope"]
