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
import logging
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from ..comm import flight, runtime
from ..comm.base import Communicator
from ..comm.compression import Compressor
from ..fusion.bucket import Bucket, Stage
from ..fusion.fusion_config import FusionConfig
from ..fusion.layout import GatherGroup, Layout
from ..fusion.rows import RowSparseBucket
from ..fusion.schedule import ScheduleDriver, scope
from ..fusion.views import GradientViews
from ..guards.stream import StreamCheck
from ..guards.written import Verdict, fingerprint, fingerprints
from . import checks, layout
from .buffers import BufferBroadcast, issue_pending
from .feedback import ErrorFeedback
from .hooks import Hooks
from .sparse import SparseGradients
from .state import VIEW, Iteration, Pending, Phase, hyperparameters
from .updates import Updates

log = logging.getLogger("dear")

class Engine:
    """Buckets, layout, schedule, the iteration in progress and what is pending from step() to
    the next forward, for one wrapped optimizer (`opt`). Built by dear/engine/setup.py."""

    buckets: Optional[list[Bucket]]
    layout: Optional[Layout]
    buffer_sync: Optional[BufferBroadcast]
    sparse: Optional[SparseGradients]

    schedule: ScheduleDriver                  # set right after construction (it reads .comm)
    # From the wrap's arguments (dear/engine/wrapper.py's attach):
    fusion: FusionConfig                      # the thresholds in force
    compression: Compressor
    sparse_as_dense: bool
    groups: Any                               # Horovod's groups= (explicit buckets), or None
    row_sparse_setting: Any                   # row_sparse= / DEAR_ROW_SPARSE, and what it chose
    row_sparse_explicit: bool
    row_sparse: Any
    autotuner: Any                            # dear/autotune/factory.py's, or None
    sparse_ids: set[int]                      # Embedding(sparse=True) weights: not in buckets

    def __init__(self, opt: torch.optim.Optimizer, comm: Communicator,
                 named: list[tuple[str, torch.nn.Parameter]], model: Optional[torch.nn.Module],
                 updates: Updates, inner_step: Callable[[Any], Any], passes: int,
                 prescale: float, postscale: float) -> None:
        self.opt = opt
        self.comm = comm
        self.owned_comm: Optional[Communicator] = None   # a process set's, shut down with it
        self.model = model
        self.updates = updates
        self.inner_step = inner_step        # the wrapped class's step, without step hooks
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.index = {p: i for i, p in enumerate(self.params)}
        self.name_of = {p: n for n, p in named}
        self.passes_needed = passes
        self.prescale, self.postscale = prescale, postscale
        self.phase = Phase.LEARNING
        self.check_every = runtime.config().check_every
        self.layout_steps = 0               # step()s since the layout was built (checks.py)
        self.iteration = Iteration.start(len(self.params))
        self.pending = Pending()
        self.buckets, self.layout = None, None
        self.where: list[tuple[Bucket, int]] = []
        self.gather_groups: list[GatherGroup] = []
        self.triggers: dict[torch.nn.Module, list[Bucket]] = {}
        self.views: Optional[GradientViews] = None
        self.buffer_sync, self.sparse = None, None
        self.overlap = model is not None
        self.provisional = False            # plan built before any forward: thrown away
        self.forward_order: list[int] = []  # parameters in first-execution order
        self.forward_seen: set[int] = set()
        self.forward_modules: dict[torch.nn.Module, None] = {}   # modules, first-run order
        # Each bucket's first module in that order (and the root): in eager mode only these
        # stay hooked once the modules were seen to run in that order (dear/engine/hooks.py).
        self.first_module: dict[int, torch.nn.Module] = {}
        self.order_varies = False           # a module ran before its bucket's first module
        self.grad_order: list[int] = []     # parameters in first-gradient order
        self.skip_sync = False
        # Quantized compression's warm-up count and residuals (dear/engine/feedback.py)
        self.feedback: Optional[ErrorFeedback] = None
        # dear.KFAC's eigenbasis path (dear/kfac/overlap.py): it edits buckets before the
        # reduce-scatter and after the all-gather, and needs `ties` kept in one bucket each.
        self.transform: Any = None
        self.ties: list[list[int]] = []
        self.order: list[int] = []          # rank 0's parameter order, for re-layouts
        self.relayout_wanted = False        # new ties: re-plan when nothing is in flight
        self.param_key: tuple[int, ...] = ()   # the trained parameters' stream-check digest
        self.param_digest = 0
        # The parameter set as the layout was built (dear/engine/layout.py's cheap test).
        self.groups_key: list[tuple[int, int]] = []
        self.untrained: list[torch.nn.Parameter] = []
        self.update_observers: list[Callable[[Bucket], Any]] = []   # dear_observe_updates
        self.step_listeners: list[Callable[[Any], Any]] = []        # dear/shardops/amp.py's
        self.read_warned = False            # dear/guards/model_guard.py said it once
        # .grad edits whose contents were compared on a GPU: read at a later step() (steps.py)
        self.late_edits: list[tuple[Sequence[int], Verdict]] = []
        self.hooks = Hooks()                # where dear is called from (dear/engine/hooks.py)
        # One tiny all-gather per iteration checks that the ranks' collectives still pair up
        # (dear/guards/stream.py); it also carries a digest of the trained parameters.
        self.stream = StreamCheck(comm)

    # ------------------------------------------------------------------------------ hooks
    def arm_hooks(self) -> None:
        """The C++ hooks' switch for the iteration starting now (dear/engine/hooks.py)."""
        self.hooks.arm(self.buckets, self.provisional, self.iteration, self.passes_needed)

    def bind_hooks(self) -> None:
        self.hooks.bind(self.buckets, self.where)
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
            if self.buckets is None:          # first iteration: the plan is built in step()
                self.take(i, param.grad)
                self.grad_order.append(i)
                return
            bucket, j = self.where[i]
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
            flight.mark("backward", self.step_number)
            buckets = self.buckets
            assert buckets is not None
            self.phase = Phase.BACKWARD
            it = self.iteration
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
                    self.transform.before_reduce(bucket)
                self.updates.launched(self, bucket)
                bucket.start_reduce_scatter(self.comm, self.prescale, self.schedule.submitter())
                self.schedule.reduce_scatter_submitted(bucket, self.postscale)
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
            if self.buckets is None:
                layout.build_buckets(self)
            buckets = self.buckets
            assert buckets is not None
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
                for bucket in reversed(buckets):
                    bucket.finish_reduce_scatter(self.postscale)
            self.schedule.reduced()
            self.iteration.reduced = True
            self.phase = Phase.REDUCED
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
        count = len(self.buckets or ())
        self.stream.issue(self.had_gradients, layout.trainable_digest(self),
                          f"the reduce-scatters of buckets 0-{count - 1}" if count else "",
                          all(b.all_used_here for b in self.buckets or ()))

    # ------------------------------------------------------------- 4. gather
    def gather(self, skip: bool = False, gradients: bool = False) -> None:
        """step(): start the all-gathers in forward order; the update is now pending (a step
        a GradScaler skips, `skip`, gathers nothing, on every rank). `gradients`: they carry
        the averaged gradients even with shard_optimizer_state (synchronize())."""
        with scope("dear::gather"):
            buckets = self.buckets
            assert buckets is not None
            if not skip:
                flight.mark_phase("step")
                update = self.updates.updater(self, gradients)
                self.schedule.maybe_plan([b.wire.element_size() for b in buckets])
                # forward order, 0 needed first; sharded: each group's update right before its
                # all-gather, so the link starts after the first group's, not after all of them
                self.schedule.gather_rest(self.gather_groups, update)
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
                self.phase = Phase.PENDING
            self.schedule.end_step()
            self.end_iteration()

    def end_iteration(self) -> None:
        """The iteration's state is dropped (step() ended, or it was abandoned); the next one
        starts, with its checks decided (the same on every rank)."""
        self.updates.undo_early(self)          # none left after a step() that kept them
        for bucket in self.buckets or ():
            if bucket.stage is Stage.REDUCING:  # a skipped step: nothing to gather or apply
                bucket.drop()
        if self.buckets is not None and not self.provisional:
            self.layout_steps += 1
        check = checks.contents_checked(self.layout_steps, self.stream.steps + 1,
                                        self.check_every)
        self.iteration = Iteration.start(len(self.params), check)
        self.phase = (Phase.LEARNING if self.buckets is None else
                      Phase.PENDING if self.pending.count else Phase.IDLE)
        self.hooks.any = False
        self.arm_hooks()
        self.hook_modules()

    def hook_modules(self) -> None:
        """Every module holding parameters hooked while the layout is new, in iterations that
        compare contents (checks.py) and when the modules did not keep the first forward's
        order; else only each bucket's first module and the root (hooks.py says why)."""
        narrow = (self.buckets is not None and not self.provisional and self.first_module
                  and not self.iteration.check_contents and not self.order_varies)
        keep = {*self.first_module.values(), self.model} if narrow else None
        self.hooks.hook_modules(keep)  # type: ignore[arg-type]

    def abandon_iteration(self) -> None:
        """Drop this iteration's gradients: finish the reduce-scatters already issued (every
        rank issued the same ones), reset the buckets; parameters and pending updates are kept."""
        self.updates.undo_early(self)
        for bucket in self.buckets or ():
            if bucket.stage is not Stage.GATHERING:   # a pending update of the last step stays
                bucket.drop()
        self.schedule.drain()
        if self.buckets is None:
            self.grad_order = []
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
        if module is model:
            self._before_model(module, args)
        if module is model and not module.training:
            self.flush()                           # evaluation reads every parameter
        elif self.pending.count:
            for bucket in self.triggers.get(module, ()):
                if bucket.stage is Stage.GATHERING:
                    if module is not self.first_module.get(bucket.spec.index, module) \
                            and not self.order_varies:
                        self.order_varies = True   # every module stays hooked (hooks.py)
                        log.info("dear: a module ran before the first module of its bucket "
                                 "in the first forward; every module keeps its hook")
                    self.apply(bucket)
        elif self.buckets is None:                 # first iteration: learn the execution order
            self.forward_modules.setdefault(module)
            for p in module.parameters(recurse=False):
                i = self.index.get(p)
                if i is not None and i not in self.forward_seen:
                    self.forward_seen.add(i)
                    self.forward_order.append(i)

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
        bucket; benchmarks/results/world_of_one_updates.md)."""
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
                observed.enter_context(_observed(self.update_observers, b))
            self.updates.apply(self, bucket, together[1:])

    def applied(self, bucket: Bucket) -> None:
        """The update of `bucket` is done with (or, sharded, failed): it is no longer pending.
        A replicated bucket whose all-gather failed stays pending: discard_pending_updates()
        then drops the whole step."""
        bucket.reset()
        self.pending.count -= 1
        if not self.pending.count and self.phase is Phase.PENDING:
            self.phase = Phase.IDLE

    def finish_all_gather(self, bucket: Bucket) -> list[bool]:
        """The averaged gradients in the bucket's buffer (dear.KFAC's rotation undone); which
        parameters any rank produced a gradient for. Nothing is applied before the stream check
        of its step has passed (issued before the all-gathers, so already arrived)."""
        with scope("dear::wait_gather"):
            self.stream.settle()
            used = bucket.finish_all_gather()
            if self.transform is not None:
                self.transform.after_gather(bucket)
            return used

    def apply_deferred(self, bucket: Bucket) -> None:
        """Unscale / clip factors of step() that chunks gathered in backward missed."""
        grads = bucket.buffer[:bucket.spec.flags_offset]
        for factor in self.pending.deferred:
            grads.mul_(factor.to(grads.dtype))

    def flush(self) -> int:
        """Apply every pending update now; returns how many buckets it applied. Issues no
        collective, so it is safe on one rank alone (dear/guards/model_guard.py, eval, shutdown)."""
        if not self.pending.count or self.buckets is None:
            return 0
        applied = 0
        for bucket in self.buckets:
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
