"""dear.DistributedOptimizer: the DeAR schedule around any torch optimizer.

Life of one gradient (read top to bottom):
  1. backward: a post-accumulate-grad hook copies it into its bucket (`Bucket.pack`); when the
     bucket is full and every bucket before it in reduce order has started, its reduce-scatter
     starts (`_launch_ready`), so every rank issues reduce-scatters in the same order.
  2. `step()`: finishes the reduce-scatters, averages each shard, starts the all-gathers in
     forward order, and returns: the update is now pending.
  3. next forward: a forward pre-hook on each module waits for the all-gathers of the buckets
     holding that module's parameters and runs the WRAPPED optimizer's own update on those
     parameters only (`_apply`), just before the module reads them.
`synchronize()` applies whatever is still pending; it runs before state_dict(), load_state_dict(),
dear.shutdown() and an eval-mode forward, so nobody reads half-updated parameters.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Iterable, Optional

import torch

from . import runtime
from .comm.base import ReduceOp
from .fusion.bucket import Bucket, Stage
from .fusion.planner import plan_buckets
from .validation import check_optimizer, check_same_across_ranks, named_params_of

log = logging.getLogger("dear")


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into the wrapped optimizer's own class (see `DistributedOptimizer`)."""

    def _dear_setup(self, named: list[tuple[str, torch.nn.Parameter]],
                    model: Optional[torch.nn.Module], backward_passes_per_step: int,
                    op: ReduceOp, gradient_predivide_factor: float,
                    fusion_threshold: Optional[int], overlap_allgather: bool) -> None:
        comm = runtime.communicator()
        self._comm = comm
        step = super(_DistributedOptimizer, type(self)).step
        # The wrapped class's step minus its profiling/step-hook layer: step hooks run once, in
        # our step(), not once per bucket. The inner layer keeps torch's no_grad handling.
        self._inner_step = step.__wrapped__ if getattr(step, "hooked", False) else step
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._index = {p: i for i, p in enumerate(self._params)}
        self._passes_needed = backward_passes_per_step
        self._passes = [0] * len(self._params)
        self._prescale = 1.0 / gradient_predivide_factor
        self._postscale = (gradient_predivide_factor / comm.size
                           if op is ReduceOp.Average else 1.0)
        cfg = runtime.config()
        self._threshold = cfg.fusion_threshold if fusion_threshold is None else fusion_threshold
        self._model = model
        self._overlap = overlap_allgather and model is not None
        if overlap_allgather and model is None:
            log.info("dear: no model= given, so all-gathers complete inside step(); pass "
                     "model= to overlap them with the next forward pass")
        self._buckets: Optional[list[Bucket]] = None
        self._where: list[tuple[Bucket, int]] = []
        self._next_launch = 0                  # position in reduce order (last bucket first)
        self._num_pending = 0                  # buckets whose update waits to be applied
        self._forward_order: list[int] = []    # parameters in first-execution order
        self._forward_seen: set[int] = set()
        self._grad_order: list[int] = []       # parameters in first-gradient order
        self._triggers: dict[torch.nn.Module, list[Bucket]] = {}
        self._hooks: list[Any] = []
        for i, p in enumerate(self._params):
            self._hooks.append(p.register_post_accumulate_grad_hook(
                functools.partial(self._on_grad, i)))
        if model is not None:
            self._hook_model(model)
        runtime.register_optimizer(self)

    # ----------------------------------------------------------------- backward: pack & reduce
    def _on_grad(self, i: int, param: torch.nn.Parameter) -> None:
        self._passes[i] += 1
        if self._passes[i] < self._passes_needed:
            return
        if self._passes[i] > self._passes_needed:
            raise RuntimeError(
                f"gradient of {self._names[i]} was computed {self._passes[i]} times before "
                f"step(), but backward_passes_per_step={self._passes_needed}; call step() "
                "after each backward or raise backward_passes_per_step")
        if self._buckets is None:              # first iteration: the plan is built in step()
            self._grad_order.append(i)
            return
        bucket, j = self._where[i]
        if bucket.stage is Stage.GATHERING:    # its module did not run in this forward
            self._apply(bucket)
        bucket.pack(j, param.grad)
        if bucket.full:
            self._launch_ready()

    def _launch_ready(self) -> None:
        buckets = self._buckets
        assert buckets is not None
        while self._next_launch < len(buckets):
            bucket = buckets[len(buckets) - 1 - self._next_launch]
            if not bucket.full:
                return
            bucket.start_reduce_scatter(self._comm, self._prescale)
            self._next_launch += 1

    # ----------------------------------------------------------------------- step: all-gather
    @torch.optim.Optimizer.profile_hook_step
    def step(self, closure: Optional[Callable[[], float]] = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("dear.DistributedOptimizer.step() does not take a closure: the "
                             "update is applied later, in the next forward pass")
        if self._buckets is None:
            self._build_buckets()
        buckets = self._buckets
        assert buckets is not None
        if self._num_pending:
            self.synchronize()
        for bucket in buckets:
            bucket.pack_missing()              # unused parameters count as zero
        self._launch_ready()
        for bucket in reversed(buckets):
            bucket.finish_reduce_scatter(self._postscale)
        for bucket in buckets:                 # forward order: bucket 0 is needed first
            bucket.start_all_gather(self._comm)
        # The update runs later, after e.g. an LR scheduler has moved on: it must use the
        # hyperparameters that were in force when step() was called.
        self._hyper_at_step = [_hyperparameters(g) for g in self.param_groups]
        self._num_pending = len(buckets)
        self._next_launch = 0
        self._passes = [0] * len(self._params)
        if not self._overlap:
            self.synchronize()

    def synchronize(self) -> None:
        """Apply every pending update now (issues no new collective: safe on one rank alone)."""
        if not self._num_pending or self._buckets is None:
            return
        for bucket in self._buckets:
            if bucket.stage is Stage.GATHERING:
                self._apply(bucket)

    # ---------------------------------------------------------------- next forward: the update
    def _apply(self, bucket: Bucket) -> None:
        """Run the wrapped optimizer's update on this bucket's parameters only, with the averaged
        gradient as .grad (a view into the gathered buffer); the user's .grad is put back."""
        used = bucket.finish_all_gather()
        saved = [p.grad for p in bucket.params]
        groups = self.param_groups
        originals = [dict(g) for g in groups]
        try:
            for p, view, u in zip(bucket.params, bucket.grad_views, used):
                p.grad = view if u else None
            for g, members, hyper in zip(groups, self._group_members(bucket),
                                         self._hyper_at_step):
                g.update(hyper)
                g["params"] = members
            self._base_step()
        finally:
            for g, original in zip(groups, originals):
                g.update(original)
            for p, grad in zip(bucket.params, saved):
                p.grad = grad
            bucket.reset()
            self._num_pending -= 1

    def _group_members(self, bucket: Bucket) -> list[list[torch.nn.Parameter]]:
        members = getattr(bucket, "group_members", None)
        if members is None:
            owner = {p: gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
            members = [[] for _ in self.param_groups]
            for p in bucket.params:
                members[owner[p]].append(p)
            bucket.group_members = members  # type: ignore[attr-defined]
        return members

    def _base_step(self) -> None:
        self._inner_step(self)

    # ------------------------------------------------------------------- plan (first step)
    def _build_buckets(self) -> None:
        order = self._forward_order if self._overlap else list(reversed(self._grad_order))
        order = list(dict.fromkeys(order))
        seen = set(order)
        order = order + [i for i in range(len(self._params)) if i not in seen]
        # Ranks may have run different branches: everyone adopts rank 0's order.
        order = self._comm.broadcast_object(order, 0)
        specs = plan_buckets(self._params, order, self._threshold, self._comm.size)
        self._buckets = [Bucket(s, [self._params[i] for i in s.params]) for s in specs]
        self._where = [(self._buckets[0], 0)] * len(self._params)
        for bucket in self._buckets:
            for j, i in enumerate(bucket.spec.params):
                self._where[i] = (bucket, j)
        for i, p in enumerate(self._params):
            if self._passes[i] > 0 or p.grad is not None:
                bucket, j = self._where[i]
                bucket.pack(j, p.grad)
        if self._model is not None:
            self._map_triggers(self._model)
        log.info("dear: %d buckets, sizes (MB) %s", len(self._buckets),
                 [round(b.buffer.numel() * b.buffer.element_size() / 2**20, 2)
                  for b in self._buckets])

    # ------------------------------------------------------------------------- module hooks
    def _hook_model(self, model: torch.nn.Module) -> None:
        for module in model.modules():
            if module is model or any(p in self._index for p in module.parameters(recurse=False)):
                self._hooks.append(module.register_forward_pre_hook(self._pre_forward))
        self._hooks.append(model.register_state_dict_pre_hook(
            lambda *args, **kwargs: self.synchronize()))
        self._hooks.append(model.register_load_state_dict_pre_hook(
            lambda *args, **kwargs: self.synchronize()))

    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        if module is self._model and not module.training:
            self.synchronize()                 # evaluation reads every parameter
        elif self._num_pending:
            for bucket in self._triggers.get(module, ()):
                if bucket.stage is Stage.GATHERING:
                    self._apply(bucket)
        elif self._buckets is None:            # first iteration: learn the execution order
            for p in module.parameters(recurse=False):
                i = self._index.get(p)
                if i is not None and i not in self._forward_seen:
                    self._forward_seen.add(i)
                    self._forward_order.append(i)

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

    # --------------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        self.synchronize()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.synchronize()
        super().load_state_dict(state_dict)
        for bucket in self._buckets or ():
            bucket.group_members = None  # type: ignore[attr-defined]


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in group.items() if k != "params"}


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable[tuple[str, torch.nn.Parameter]]] = None,
                         *, model: Optional[torch.nn.Module] = None,
                         backward_passes_per_step: int = 1, op: ReduceOp = ReduceOp.Average,
                         gradient_predivide_factor: float = 1.0,
                         fusion_threshold: Optional[int] = None,
                         overlap_allgather: bool = True) -> torch.optim.Optimizer:
    """Wrap `optimizer` so its gradients are averaged with DeAR's decoupled all-reduce.

    Returns an instance of a subclass of the optimizer's own class that shares its state, so
    isinstance checks, LR schedulers and checkpoint code keep working (as in Horovod).
    """
    runtime.communicator()                     # fails clearly before dear.init()
    check_optimizer(optimizer)
    if not isinstance(op, ReduceOp):
        raise TypeError(f"op must be dear.Average or dear.Sum, got {op!r}")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    if gradient_predivide_factor <= 0:
        raise ValueError("gradient_predivide_factor must be > 0")
    if gradient_predivide_factor != 1.0 and op is not ReduceOp.Average:
        raise ValueError("gradient_predivide_factor only applies to op=dear.Average")
    if fusion_threshold is not None and fusion_threshold < 0:
        raise ValueError(f"fusion_threshold must be >= 0 bytes, got {fusion_threshold}")
    named = named_params_of(optimizer, named_parameters, model)
    check_same_across_ranks(named, runtime.communicator())
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._dear_setup(named, model, backward_passes_per_step, op, gradient_predivide_factor,
                        fusion_threshold, overlap_allgather)
    return wrapped


_DistributedOptimizer.step.hooked = True  # type: ignore[attr-defined]  # torch must not re-wrap

__all__ = ["DistributedOptimizer"]
