"""dear.KFAC: the public preconditioner. Hooks record factors; step() averages them, updates the
decompositions on schedule, and replaces each supported layer's gradient by its K-FAC
preconditioned (and KL-clipped) version, for the wrapped optimizer to apply.

Life of one step (read top to bottom):
  forward   hook of layer L: batch A from L's input; a hook on L's output records batch G in
            backward. With pipelining (SPD) each factor goes into its bucket as soon as it is
            complete and a full bucket's all-reduce (PAD: reduce to the owner) starts at once.
  step()    finish the factor exchange, update the running factors; on inverse steps decompose
            (each factor or layer by its assigned rank; COMM_OPT broadcasts decompositions);
            precondition (COMM_OPT: every rank, every layer; MEM_OPT/PAD: owners, then a
            broadcast of the preconditioned gradients); KL-clip with the global scale; write
            the result into .grad.
With dear.DistributedOptimizer, steps that keep the decompositions precondition its reduced shards
in the eigenbasis instead (dear/kfac/overlap.py); the others call its synchronize() first.
The first step also learns the execution order and how often each layer runs per step, then
makes the plan on rank 0 (broadcast): until then nothing is pipelined. Under a GradScaler, G
comes from unscaled output gradients and the KL clip from unscaled ones (dear/kfac/scaling.py);
who decomposes and preconditions what is dear/kfac/distribute.py; kfac-pytorch's argument names
are translated in dear/kfac/settings.py.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from ..comm import flight
from . import persist
from .comm import Transport, measure_network
from .costs import CostModel, NetworkModel, calibrate
from .distribute import Distribution
from .enums import ComputeMethod, Strategy
from .exchange import FactorExchange
from .options import ALIASES, NAMES, Hyper, Hyperparameters, check, find_layers, resolve, value_at
from .overlap import DearLink
from .planner import LayerShape, Plan, PlanInputs, describe, make_plan
from .scaling import LossScale
from .settings import one_of, settings
from .state import LayerState

log = logging.getLogger("dear")


class KFAC:
    """K-FAC preconditioner (kfac-pytorch's conventions) with SPD/PAD-style distribution.

    Loop: `loss.backward(); precond.step(); optimizer.step()` (one process, torch DDP,
    dear.DistributedOptimizer). With hvd.DistributedOptimizer: `loss.backward();
    optimizer.synchronize(); precond.step(); with optimizer.skip_synchronize(): optimizer.step()`.
    Every hyperparameter may be a callable of the step (precond.steps); reading one as an
    attribute gives its current value. kfac-pytorch's KFACPreconditioner arguments are accepted
    under its names and meanings (dear/kfac/settings.py).
    """

    def __init__(self, model: nn.Module, lr: Hyper = 0.1, damping: Hyper = 0.001,
                 factor_decay: Hyper = 0.95, kl_clip: Hyper = 0.001,
                 factor_update_freq: Hyper = 1, inv_update_freq: Hyper = 10,
                 method: str | ComputeMethod = "eigen",
                 strategy: str | Strategy = "auto",
                 skip_layers: Iterable[str | type] | None = (), *,
                 pipeline_factors: bool = True, symmetry_aware: bool = True,
                 redundancy: bool = True, bucket_cap_mb: float = 25.0,
                 cost_model: CostModel | None = None,
                 network_model: NetworkModel | None = None,
                 grad_scaler: Any = None, compute_eigenvalue_outer_product: bool = True,
                 # kfac-pytorch's names (dear/kfac/settings.py)
                 factor_update_steps: Hyper = None, inv_update_steps: Hyper = None,
                 compute_method: Any = None, accumulation_steps: int | None = None,
                 assignment_strategy: Any = None, colocate_factors: bool | None = None,
                 grad_worker_fraction: Any = None, update_factors_in_hook: bool | None = None,
                 allreduce_bucket_cap_mb: float | None = None,
                 factor_dtype: torch.dtype | None = None, inv_dtype: torch.dtype | None = None,
                 loglevel: int = logging.DEBUG) -> None:
        self._transport = Transport.from_environment()
        self.rank, self.size = self._transport.rank, self._transport.size
        self.settings = settings(
            self.size, method=method, strategy=strategy, skip_layers=skip_layers,
            pipeline_factors=pipeline_factors, symmetry_aware=symmetry_aware,
            redundancy=redundancy, bucket_cap_mb=bucket_cap_mb, compute_method=compute_method,
            grad_worker_fraction=grad_worker_fraction,
            update_factors_in_hook=update_factors_in_hook,
            allreduce_bucket_cap_mb=allreduce_bucket_cap_mb,
            accumulation_steps=accumulation_steps, assignment_strategy=assignment_strategy,
            colocate_factors=colocate_factors, factor_dtype=factor_dtype, inv_dtype=inv_dtype,
            compute_eigenvalue_outer_product=compute_eigenvalue_outer_product)
        factor_update_freq = one_of("factor_update_freq", factor_update_freq, 1,
                                    "factor_update_steps", factor_update_steps)
        inv_update_freq = one_of("inv_update_freq", inv_update_freq, 10, "inv_update_steps",
                                 inv_update_steps)
        self._sources: dict[str, Hyper] = {}
        for name, value in zip(NAMES, (lr, damping, factor_decay, kl_clip, factor_update_freq,
                                       inv_update_freq)):
            self._sources[name] = value if callable(value) else check(name, value)
        self.method = self.settings.method
        self.strategy = self.settings.strategy
        layers, others = find_layers(model, self.settings.skip_layers)
        if not layers:
            raise ValueError(
                f"dear.KFAC: {type(model).__name__} has no layer K-FAC can precondition "
                "(nn.Linear, nn.Conv2d with groups=1, dense nn.Embedding, with a trainable "
                f"weight); modules with parameters: {others or 'none'}")
        self.layers = [LayerState(i, layer, self.settings.factor_dtype, self.settings.inv_dtype)
                       for i, layer in enumerate(layers)]
        log.log(self._summary_level(loglevel),
                "dear.KFAC: preconditioning %d layers; left to the optimizer: %s",
                len(layers), ", ".join(others) if others else "none")
        for s in self.layers:
            log.log(loglevel, "dear.KFAC: Registered name=%r: %r", s.name, s.layer)
        log.log(loglevel, "dear.KFAC: layer assignments (kfac-pytorch's KAISAAssignment) are "
                "planned at the first step, strategy %s", self.settings.strategy.value)
        self.symmetric, self.redundancy = self.settings.symmetric, self.settings.redundancy
        self.pipeline = self.settings.pipeline
        self._cap_bytes = self.settings.bucket_cap_bytes
        self.steps = 0
        distributed = self.size > 1
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._network = network_model or (measure_network(self._transport, device=device)
                                          if distributed else NetworkModel())
        self._network_measured = network_model is None and distributed
        self._cost = cost_model or (calibrate() if distributed and self.rank == 0
                                    else CostModel())
        self._cost_calibrated = cost_model is None and distributed
        self.plan: Plan | None = None
        self._order: list[int] = []
        self._factors: FactorExchange | None = None
        self._dist: Distribution | None = None
        self._force_decompose = False
        self._step_cache: tuple[int, bool, float] = (-1, False, 0.0)
        self._dec_damping: float | None = None     # damping of the decompositions held
        self._scale = LossScale(grad_scaler)
        self._raw_g = False                          # G batch factors not yet unscaled
        self._model = model
        # With dear.DistributedOptimizer: eigenbasis preconditioning on its reduced shards
        # (dear/kfac/overlap.py); decided at the first step, once the plan is known.
        self._link: DearLink | None = None
        self.overlapped_steps = 0                  # steps preconditioned on DeAR's shards
        self._hooks = [s.layer.module.register_forward_hook(functools.partial(self._on_forward, s))
                       for s in self.layers]

    @staticmethod
    def _summary_level(loglevel: int) -> int:
        """dear.KFAC says at INFO which layers it left to the optimizer (kfac-pytorch's class
        logs nothing above its loglevel: dear/kfac/compat.py)."""
        return max(loglevel, logging.INFO)

    # ------------------------------------------------------------------ hyperparameters
    def __getattr__(self, name: str) -> Any:
        name = ALIASES.get(name, name)
        if name in NAMES:
            return getattr(self.hyperparameters(), name)
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        name = ALIASES.get(name, name)
        if name in NAMES:
            self._sources[name] = value if callable(value) else check(name, value)
            self._step_cache = (-1, False, 0.0)
        else:
            super().__setattr__(name, value)

    def hyperparameters(self) -> Hyperparameters:
        """The values in force at the current step (callables evaluated and checked)."""
        return resolve(self._sources, self.steps)

    def _factor_step(self) -> tuple[bool, float]:
        """Whether this step records factors, and its factor_decay (read once per step)."""
        step, value, decay = self._step_cache
        if step != self.steps:
            value = self.steps % value_at(self._sources, "factor_update_freq", self.steps) == 0
            decay = value_at(self._sources, "factor_decay", self.steps)
            self._step_cache = (self.steps, value, decay)
        return value, decay

    def memory_usage(self) -> dict[str, int]:
        """Bytes of factors, batch factors and decompositions this rank holds (kfac-pytorch's
        keys: a_factors, g_factors, a_batch, g_batch, a_inverses, g_inverses, total)."""
        sizes: dict[str, int] = {}
        for s in self.layers:
            for key, value in s.memory_usage().items():
                sizes[key] = sizes.get(key, 0) + value
        sizes["total"] = sum(sizes.values())
        return sizes

    def reset_batch(self) -> None:
        """Forget the factors recorded since the last step (e.g. after a skipped batch)."""
        for s in self.layers:
            s.clear_batch()

    # ------------------------------------------------------------------ hooks
    def _on_forward(self, state: LayerState, module: nn.Module, inputs: Any, output: Any) -> None:
        if not module.training or not torch.is_grad_enabled():
            return
        record, decay = self._factor_step()
        if not record:
            return
        if self.plan is None and state.index not in self._order:
            self._order.append(state.index)
        state.add_a(state.layer.batch_a(inputs[0], state.dtype))
        if self._update_due(state.a_passes):
            state.fold_chunk("A", decay)
        self._maybe_send("A", state, state.a_passes, state.a_expected)
        if isinstance(output, Tensor) and output.requires_grad:
            output.register_hook(functools.partial(self._on_grad_output, state))

    def _on_grad_output(self, state: LayerState, grad: Tensor) -> None:
        if self._scale.known():              # as kfac-pytorch: G from the unscaled gradient
            scale = self._scale.value(self.steps)
            if scale != 1.0:
                grad = grad.to(state.dtype) / scale
        else:                                # unscaled at step() (dear/kfac/scaling.py)
            self._raw_g = True
        state.add_g(state.layer.batch_g(grad, state.dtype))
        if self._update_due(state.g_passes):
            state.fold_chunk("G", self._factor_step()[1])
        self._maybe_send("G", state, state.g_passes, state.g_expected)

    def _update_due(self, passes: int) -> bool:
        """kfac-pytorch's accumulation_steps=k: after the k-th, 2k-th, ... pass of a step, all
        passes recorded since the last update make one running-average update."""
        k = self.settings.accumulation_steps
        return k is not None and passes % k == 0

    def _maybe_send(self, which: str, state: LayerState, calls: int, expected: int) -> None:
        """Pipelining (SPD): send a layer's factor from the hook of its last pass of the step
        (as many passes as in the first step)."""
        if self._factors is None or not self.pipeline or expected == 0:
            return
        if calls == expected:
            if self.settings.accumulation_steps is None:
                batch = state.batch_a() if which == "A" else state.batch_g()
            else:                            # this step's whole updates (leftovers wait)
                folded = state.folded(which, self._factor_step()[1])
                batch = None if folded is None else folded[0]
            if batch is not None:
                self._factors.put(which, state.index, batch)
        elif calls > expected:
            raise RuntimeError(
                f"dear.KFAC: layer {state.name} produced its {which} factor {calls} times in "
                f"this step but {expected} times in the first one, and its pipelined factor "
                "communication had already started; for layers that run a varying number of "
                "times per step, pass pipeline_factors=False")

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self) -> None:
        """Precondition the gradients in .grad (call after backward, before optimizer.step).
        With dear.DistributedOptimizer, the averaged gradients it holds (dear/kfac/overlap.py).
        Its first step there waits for optimizer.step() to learn the loss scale."""
        if self._scale.pending is not None:
            raise RuntimeError(
                "dear.KFAC: step() again before optimizer.step(): the first step waits for "
                "dear.DistributedOptimizer.step() to learn whether a GradScaler scales the "
                "gradients (pass grad_scaler= to dear.KFAC to precondition at once)")
        hyper = self.hyperparameters()
        if self.plan is None:
            self._make_plan(hyper)
        optimizers = self._dear.optimizers()
        for opt in optimizers:
            self._scale.listen(opt)
        if optimizers and not self._scale.known() and self._scale.defer_or_assume(
                optimizers[0], functools.partial(self._run_step, hyper)):
            return
        self._run_step(hyper)

    @torch.no_grad()
    def _run_step(self, hyper: Hyperparameters) -> None:
        if self._dear.optimizers():        # the hang report's label: the optimizer's iteration
            flight.mark_phase("dear.KFAC.step")
        else:                              # with DDP, say: K-FAC's own step count
            flight.mark("dear.KFAC.step", self.steps)
        if self._raw_g:
            self._unscale_batch_g(self._scale.value(self.steps) if self._scale.known() else 1.0)
        decompose = self.steps % hyper.inv_update_freq == 0 or self._force_decompose
        on_shards = self._dear.begin_step(decompose)
        if self.steps % hyper.factor_update_freq == 0:
            self._update_factors(hyper.factor_decay)
        if decompose:
            assert self._dist is not None
            self._dist.decompose(hyper.damping)
            self._dec_damping = hyper.damping
            self._force_decompose = False
        damping = hyper.damping
        if self.settings.outer_product and self.method is ComputeMethod.EIGEN \
                and self._dec_damping is not None:
            damping = self._dec_damping      # kfac-pytorch: fixed with the decompositions
        optimizers = self._dear.optimizers()
        grad_scale = 1.0
        if self._scale.gradients_scaled(optimizers[0] if optimizers else None):
            grad_scale = self._scale.value(self.steps)
        if on_shards:
            self._dear.overlap.precondition_shards(  # type: ignore[union-attr]
                damping, hyper.lr, hyper.kl_clip, grad_scale)
            self.overlapped_steps += 1
        else:
            assert self._dist is not None
            self._dist.precondition(damping, hyper.lr, hyper.kl_clip, grad_scale)
        self.steps += 1
        self._dear.end_step(self._keeps_bases())

    def _unscale_batch_g(self, scale: float) -> None:
        """G recorded before the scale was known: divide by scale^2 (exact for GradScaler's
        powers of two, so the same bits as dividing the output gradients by the scale)."""
        self._raw_g = False
        if scale == 1.0:
            return
        for s in self.layers:
            if s.g_sum is not None:
                s.g_sum = s.g_sum / scale ** 2
            if "G" in s.fold:
                s.fold["G"] = (s.fold["G"][0] / scale ** 2, s.fold["G"][1])

    def _keeps_bases(self) -> bool:
        """Whether the next step preconditions with the decompositions held now."""
        freq = value_at(self._sources, "inv_update_freq", self.steps)
        return self.steps % freq != 0 and not self._force_decompose

    @property
    def _dear(self) -> DearLink:
        if self._link is None:
            assert self.plan is not None
            everywhere = self.size == 1 or self.plan.strategy is Strategy.COMM_OPT
            self._link = DearLink(self.layers, self.method is ComputeMethod.EIGEN and everywhere)
        return self._link

    def _make_plan(self, hyper: Hyperparameters) -> None:
        order = self._order + [s.index for s in self.layers if s.index not in self._order]
        order = self._transport.broadcast_object(order, 0)   # rank 0's order everywhere
        # kfac-pytorch's assignment goes by registration order; dear's by execution order
        kaisa = self.settings.assignment is not None or self.settings.colocate or \
            self.strategy is Strategy.HYBRID_OPT
        plan_order = sorted(order) if kaisa else order
        plan = None
        if self.rank == 0:
            shapes = [LayerShape(self.layers[i].layer.a_dim, self.layers[i].layer.g_dim,
                                 self.layers[i].layer.diagonal_a) for i in plan_order]
            plan = make_plan(self.strategy, PlanInputs(
                shapes, self.size, self.method, hyper.inv_update_freq, hyper.factor_update_freq,
                self._cost, self._network, self.symmetric, self.redundancy,
                self.layers[0].dtype.itemsize, self.settings.assignment, self.settings.colocate,
                self.settings.grad_workers))
            log.info("dear.KFAC: %s", describe(
                plan, self.strategy is Strategy.AUTO, self._network, self._network_measured,
                self._cost, self._cost_calibrated))
        plan = self._transport.broadcast_object(plan, 0)      # rank 0 decides for everyone
        back = {layer: k for k, layer in enumerate(plan_order)}   # positions -> layer indices

        def pick(owners: Sequence[int]) -> tuple[int, ...]:
            return tuple(owners[back[i]] for i in range(len(self.layers)))
        self.plan = Plan(plan.strategy, pick(plan.a_owner), pick(plan.g_owner),
                         pick(plan.layer_owner), plan.reduce_to_owner, plan.estimates,
                         plan.columns)
        self._order = order
        for s in self.layers:                                 # passes per step, for pipelining
            s.a_expected, s.g_expected = s.a_passes, s.g_passes
        if self.size > 1:
            self._factors = FactorExchange(self.layers, self._order, self.plan, self._transport,
                                           self.symmetric, max(1, self._cap_bytes //
                                                               self.layers[0].dtype.itemsize))
        self._dist = Distribution(self.layers, self._order, self.plan, self._transport,
                                  self.method, self._cap_bytes)

    def _update_factors(self, decay: float) -> None:
        accumulate = self.settings.accumulation_steps is not None
        batches: dict[tuple[str, int], tuple[Tensor, float]] = {}
        for s in self.layers:
            for which, batch in (("A", s.batch_a()), ("G", s.batch_g())):
                folded = s.folded(which, decay) if accumulate else (
                    None if batch is None else (batch, decay))
                if folded is not None:
                    batches[(which, s.index)] = folded
        if self._factors is None:                   # one process: the batch factors as they are
            averaged = {key: batch for key, (batch, _) in batches.items()}
        else:
            for i in self._order:                   # what the hooks did not send
                for which in ("A", "G"):
                    entry = batches.get((which, i))
                    if entry is not None and not self._factors.is_put(which, i):
                        self._factors.put(which, i, entry[0], launch=False)
            averaged = self._factors.finish()
        for (which, i), factor in averaged.items():
            self.layers[i].update(which, factor, batches[(which, i)][1])
        for s in self.layers:
            if s.a_expected == 0 and s.g_expected == 0:   # first factor step it ran in
                s.a_expected, s.g_expected = s.a_passes, s.g_passes
            s.clear_batch(keep_partial=accumulate)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, include_factors: bool = True) -> dict[str, Any]:
        """The step counter and, with include_factors, the running factors and decompositions
        this rank holds (under mem-opt, hybrid-opt and pad only some ranks hold a layer's
        decomposition, under pad also its factors: save every rank's state_dict to resume)."""
        return persist.save(self.steps, self.method, self._dec_damping, self._sources,
                            self.layers, include_factors)

    def load_state_dict(self, state: dict[str, Any], compute_inverses: bool = True) -> None:
        """Resume from state_dict() (or from a kfac-pytorch checkpoint: its factors and plain
        hyperparameters; the decompositions are then recomputed at the next step)."""
        restored = persist.load(state, self.layers, self.method, compute_inverses)
        self.steps = restored.steps
        for name, value in restored.hyperparameters.items():
            setattr(self, name, value)
        self._step_cache = (-1, False, 0.0)
        self._dec_damping = restored.decomposition_damping
        self._force_decompose = restored.force_decompose
        if self._link is not None:          # the armed eigenbases are no longer ours
            self._link.disarm()

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._link is not None:
            self._link.disarm()
