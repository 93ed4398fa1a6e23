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
makes the plan on rank 0 (broadcast): until then nothing is pipelined.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Hashable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from .assignment import EVERYWHERE
from .comm import Transport, measure_network
from .costs import CostModel, NetworkModel, calibrate
from .enums import ComputeMethod, Strategy, parse
from .exchange import BroadcastExchange, FactorExchange
from .linalg import Decomposition, flat_size, flatten, precondition, unflatten
from .overlap import DearLink
from .options import NAMES, Hyper, Hyperparameters, check, find_layers, resolve
from .planner import LayerShape, Plan, PlanInputs, make_plan
from .state import LayerState

log = logging.getLogger("dear")


class KFAC:
    """K-FAC preconditioner (kfac-pytorch's conventions) with SPD/PAD-style distribution.

    Loop: `loss.backward(); precond.step(); optimizer.step()` (one process, torch DDP,
    dear.DistributedOptimizer). With hvd.DistributedOptimizer: `loss.backward();
    optimizer.synchronize(); precond.step(); with optimizer.skip_synchronize(): optimizer.step()`.
    Every hyperparameter may be a callable of the step (precond.steps).
    """

    def __init__(self, model: nn.Module, lr: Hyper = 0.1, damping: Hyper = 0.001,
                 factor_decay: Hyper = 0.95, kl_clip: Hyper = 0.001,
                 factor_update_freq: Hyper = 1, inv_update_freq: Hyper = 10,
                 method: str | ComputeMethod = "eigen",
                 strategy: str | Strategy = "auto",
                 skip_layers: Iterable[str | type] = (), *,
                 pipeline_factors: bool = True, symmetry_aware: bool = True,
                 redundancy: bool = True, bucket_cap_mb: float = 25.0,
                 cost_model: CostModel | None = None,
                 network_model: NetworkModel | None = None) -> None:
        self._sources: dict[str, Hyper] = {}
        for name, value in zip(NAMES, (lr, damping, factor_decay, kl_clip, factor_update_freq,
                                       inv_update_freq)):
            self._sources[name] = value if callable(value) else check(name, value)
        self.method = parse(ComputeMethod, method, "method")
        self.strategy = parse(Strategy, strategy, "strategy")
        if bucket_cap_mb <= 0:
            raise ValueError(f"dear.KFAC: bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        layers, others = find_layers(model, skip_layers)
        if not layers:
            raise ValueError(
                f"dear.KFAC: {type(model).__name__} has no layer K-FAC can precondition "
                "(nn.Linear, nn.Conv2d with groups=1, dense nn.Embedding, with a trainable "
                f"weight); modules with parameters: {others or 'none'}")
        self.layers = [LayerState(i, layer) for i, layer in enumerate(layers)]
        log.info("dear.KFAC: preconditioning %d layers; left to the optimizer: %s",
                 len(layers), ", ".join(others) if others else "none")
        self.pipeline, self.symmetric = pipeline_factors, symmetry_aware
        self.redundancy = redundancy
        self._cap_bytes = int(bucket_cap_mb * 2**20)
        self.steps = 0
        self._transport = Transport.from_environment()
        self.rank, self.size = self._transport.rank, self._transport.size
        distributed = self.size > 1
        self._network = network_model or (measure_network(self._transport) if distributed
                                          else NetworkModel())
        self._cost = cost_model or (calibrate() if distributed and self.rank == 0
                                    else CostModel())
        self.plan: Plan | None = None
        self._order: list[int] = []
        self._factors: FactorExchange | None = None
        self._results: BroadcastExchange | None = None
        self._force_decompose = False
        self._factor_step_cache = (-1, False)
        self._model = model
        # With dear.DistributedOptimizer: eigenbasis preconditioning on its reduced shards
        # (dear/kfac/overlap.py); decided at the first step, once the plan is known.
        self._link: DearLink | None = None
        self.overlapped_steps = 0                  # steps preconditioned on DeAR's shards
        self._hooks = [s.layer.module.register_forward_hook(functools.partial(self._on_forward, s))
                       for s in self.layers]

    # ------------------------------------------------------------------ hyperparameters
    def __getattr__(self, name: str) -> Any:
        if name in NAMES:
            return self.__dict__["_sources"][name]
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in NAMES:
            self._sources[name] = value if callable(value) else check(name, value)
        else:
            super().__setattr__(name, value)

    def hyperparameters(self) -> Hyperparameters:
        """The values in force at the current step (callables evaluated and checked)."""
        return resolve(self._sources, self.steps)

    def _factor_step(self) -> bool:
        step, value = self._factor_step_cache
        if step != self.steps:
            source = self._sources["factor_update_freq"]
            freq = check("factor_update_freq", source(self.steps), self.steps) if callable(
                source) else source
            value = self.steps % int(freq) == 0  # type: ignore[arg-type]
            self._factor_step_cache = (self.steps, value)
        return value

    # ------------------------------------------------------------------ hooks
    def _on_forward(self, state: LayerState, module: nn.Module, inputs: Any, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled() and self._factor_step()):
            return
        if self.plan is None and state.index not in self._order:
            self._order.append(state.index)
        calls = state.add_a(state.layer.batch_a(inputs[0]))
        self._maybe_send("A", state, calls, state.a_expected)
        if isinstance(output, Tensor) and output.requires_grad:
            output.register_hook(functools.partial(self._on_grad_output, state))

    def _on_grad_output(self, state: LayerState, grad: Tensor) -> None:
        calls = state.add_g(state.layer.batch_g(grad))
        self._maybe_send("G", state, calls, state.g_expected)

    def _maybe_send(self, which: str, state: LayerState, calls: int, expected: int) -> None:
        if self._factors is None or not self.pipeline or expected == 0:
            return
        if calls == expected:
            batch = state.batch_a() if which == "A" else state.batch_g()
            self._factors.put(which, state.index, batch)  # type: ignore[arg-type]
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
        With dear.DistributedOptimizer, the averaged gradients it holds (dear/kfac/overlap.py)."""
        hyper = self.hyperparameters()
        if self.plan is None:
            self._make_plan(hyper)
        decompose = self.steps % hyper.inv_update_freq == 0 or self._force_decompose
        on_shards = self._dear.begin_step(decompose)
        if self.steps % hyper.factor_update_freq == 0:
            self._update_factors(hyper.factor_decay)
        if decompose:
            self._update_decompositions(hyper)
            self._force_decompose = False
        if on_shards:
            self._dear.overlap.precondition_shards(  # type: ignore[union-attr]
                hyper.damping, hyper.lr, hyper.kl_clip)
            self.overlapped_steps += 1
        else:
            self._precondition(hyper)
        self.steps += 1
        self._dear.end_step(self._keeps_bases())

    def _keeps_bases(self) -> bool:
        """Whether the next step preconditions with the decompositions held now."""
        freq = self.hyperparameters().inv_update_freq
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
        plan = None
        if self.rank == 0:
            shapes = [LayerShape(self.layers[i].layer.a_dim, self.layers[i].layer.g_dim,
                                 self.layers[i].layer.diagonal_a) for i in order]
            plan = make_plan(self.strategy, PlanInputs(
                shapes, self.size, self.method, hyper.inv_update_freq, hyper.factor_update_freq,
                self._cost, self._network, self.symmetric, self.redundancy,
                self.layers[0].dtype.itemsize))
        plan = self._transport.broadcast_object(plan, 0)
        back = {layer: k for k, layer in enumerate(order)}   # positions -> layer indices
        pick = lambda owners: tuple(owners[back[i]] for i in range(len(self.layers)))
        self.plan = Plan(plan.strategy, pick(plan.a_owner), pick(plan.g_owner),
                         pick(plan.layer_owner), plan.reduce_to_owner, plan.estimates)
        self._order = order
        log.info("dear.KFAC: strategy %s (estimates %s s/iteration); owners %s",
                 self.plan.strategy.value, {k: round(v, 5) for k, v in plan.estimates.items()},
                 list(self.plan.layer_owner))
        for s in self.layers:                                 # calls per step, for pipelining
            s.a_expected, s.g_expected = s.a_calls, s.g_calls
        if self.size > 1:
            self._build_exchanges()

    def _build_exchanges(self) -> None:
        plan = self.plan
        assert plan is not None
        cap = max(1, self._cap_bytes // self.layers[0].dtype.itemsize)
        self._factors = FactorExchange(self.layers, self._order, plan, self._transport,
                                       self.symmetric, cap)
        items: list[tuple[Hashable, int, int]] = []
        dtypes: list[torch.dtype] = []
        for i in self._order:
            s = self.layers[i]
            if plan.strategy is Strategy.COMM_OPT:
                for which, owner in (("A", plan.a_owner[i]), ("G", plan.g_owner[i])):
                    if owner != EVERYWHERE:
                        diagonal = which == "A" and s.layer.diagonal_a
                        dim = s.layer.a_dim if which == "A" else s.layer.g_dim
                        items.append(((which, i), flat_size(self.method, dim, diagonal), owner))
                        dtypes.append(s.dtype)
            elif plan.layer_owner[i] != EVERYWHERE:
                items.append(((i,), s.layer.a_dim * s.layer.g_dim, plan.layer_owner[i]))
                dtypes.append(s.dtype)
        self._results = BroadcastExchange(items, dtypes, self._transport, cap,
                                          self.layers[0].device)

    def _update_factors(self, decay: float) -> None:
        if self._factors is None:                   # one process: the batch factors as they are
            averaged = {}
            for s in self.layers:
                for which, batch in (("A", s.batch_a()), ("G", s.batch_g())):
                    if batch is not None:
                        averaged[(which, s.index)] = batch
        else:
            for i in self._order:                   # what the hooks did not send
                s = self.layers[i]
                for which, batch in (("A", s.batch_a()), ("G", s.batch_g())):
                    if batch is not None and not self._factors.is_put(which, i):
                        self._factors.put(which, i, batch, launch=False)
            averaged = self._factors.finish()
        for (which, i), factor in averaged.items():
            self.layers[i].update(which, factor, decay)
        for s in self.layers:
            if s.a_expected == 0 and s.g_expected == 0:   # first factor step it ran in
                s.a_expected, s.g_expected = s.a_calls, s.g_calls
            s.clear_batch()

    def _mine(self, owner: int) -> bool:
        return owner == EVERYWHERE or owner == self.rank

    def _update_decompositions(self, hyper: Hyperparameters) -> None:
        plan, results = self.plan, self._results
        assert plan is not None
        for s in self.layers:
            for which, owner in (("A", plan.a_owner[s.index]), ("G", plan.g_owner[s.index])):
                if self._mine(owner):
                    dec = s.decompose(which, self.method, hyper.damping)
                    setattr(s, "a_dec" if which == "A" else "g_dec", dec)
                    key = (which, s.index)
                    if results is not None and key in results:
                        flatten(dec, results.slot(key))
                        results.mark(key)
        if results is None or plan.strategy is not Strategy.COMM_OPT:
            return
        results.run()
        for s in self.layers:
            for which, owner in (("A", plan.a_owner[s.index]), ("G", plan.g_owner[s.index])):
                if not self._mine(owner):
                    diagonal = which == "A" and s.layer.diagonal_a
                    dim = s.layer.a_dim if which == "A" else s.layer.g_dim
                    flat = results.get((which, s.index))
                    assert flat is not None
                    dec = unflatten(flat, self.method, dim, diagonal)
                    setattr(s, "a_dec" if which == "A" else "g_dec", dec)
        results.reset()

    def _precondition_layer(self, s: LayerState, grad: Tensor | None, damping: float
                            ) -> Tensor | None:
        if grad is None or s.a is None or s.g is None or s.a_dec is None or s.g_dec is None:
            return None
        out = precondition(grad, s.a_dec, s.g_dec, damping)
        if not torch.isfinite(out).all():
            s.warn_once("nonfinite-grad", "dear.KFAC: layer %s: the preconditioned gradient is "
                        "not finite (is the gradient?); its gradient is left unpreconditioned",
                        s.name)
            return None
        return out

    def _precondition(self, hyper: Hyperparameters) -> None:
        plan, results = self.plan, self._results
        assert plan is not None
        grads = {s.index: s.layer.grad_matrix() for s in self.layers}
        owned_by_others = plan.strategy is not Strategy.COMM_OPT and results is not None
        done: dict[int, Tensor] = {}
        for s in self.layers:
            owner = plan.layer_owner[s.index]
            if self._mine(owner) or not owned_by_others:
                p = self._precondition_layer(s, grads[s.index], hyper.damping)
                if p is not None:
                    done[s.index] = p
                    if owned_by_others and owner != EVERYWHERE:
                        results.put((s.index,), p)  # type: ignore[union-attr]
        if owned_by_others:
            results.run()  # type: ignore[union-attr]
            for s in self.layers:
                if not self._mine(plan.layer_owner[s.index]):
                    flat = results.get((s.index,))  # type: ignore[union-attr]
                    if flat is not None:
                        done[s.index] = flat.view(s.layer.g_dim, s.layer.a_dim)
        nu = 1.0
        if hyper.kl_clip:
            # in float64: a float32 product can overflow long before nu becomes tiny
            vg = 0.0
            for i in sorted(done):
                grad = grads[i]
                if grad is not None:
                    vg += float(torch.dot(done[i].reshape(-1).double(), grad.reshape(-1).double()))
            vg *= hyper.lr ** 2
            if vg != 0 and math.isfinite(vg):
                nu = min(1.0, math.sqrt(hyper.kl_clip / abs(vg)))
        for i in sorted(done):
            layer = self.layers[i].layer
            if layer.weight.grad is None:
                layer.weight.grad = torch.zeros_like(layer.weight)
            layer.set_grad(done[i] * nu)
        if owned_by_others:
            results.reset()  # type: ignore[union-attr]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, include_factors: bool = True) -> dict[str, Any]:
        """The step counter and, with include_factors, the running factors and decompositions
        this rank holds (under mem-opt and pad only the owner holds a layer's decomposition,
        under pad also its factors: save every rank's state_dict to resume those)."""
        out: dict[str, Any] = {"steps": self.steps, "method": self.method.value}
        if include_factors:
            out["layers"] = {s.name: _layer_state(s) for s in self.layers}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "steps" not in state:
            raise ValueError("dear.KFAC.load_state_dict: not a KFAC state_dict (no 'steps')")
        names = {s.name: s for s in self.layers}
        unknown = sorted(set(state.get("layers", {})) - set(names))
        if unknown:
            raise ValueError(f"dear.KFAC.load_state_dict: the checkpoint has layers this model "
                             f"lacks: {unknown}")
        same_method = state.get("method") == self.method.value
        self.steps = int(state["steps"])
        self._factor_step_cache = (-1, False)
        for name, saved in state.get("layers", {}).items():
            s = names[name]
            s.a, s.g = _clone(saved.get("A")), _clone(saved.get("G"))
            s.a_dec = _decomposition(saved.get("A_dec"), self.method) if same_method else None
            s.g_dec = _decomposition(saved.get("G_dec"), self.method) if same_method else None
        # Decompositions missing where factors exist are recomputed at the next step, by every
        # rank's plan (all ranks load the same checkpoint, so they agree).
        if self._link is not None:          # the armed eigenbases are no longer ours
            self._link.disarm()
        self._force_decompose = "layers" not in state or not same_method or any(
            (s.a is not None and s.a_dec is None) for s in self.layers)

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._link is not None:
            self._link.disarm()


def _clone(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().clone()


def _layer_state(s: LayerState) -> dict[str, Any]:
    out: dict[str, Any] = {"A": _clone(s.a), "G": _clone(s.g)}
    for key, dec in (("A_dec", s.a_dec), ("G_dec", s.g_dec)):
        out[key] = None if dec is None else {"q": _clone(dec.q), "d": _clone(dec.d),
                                             "inv": _clone(dec.inv)}
    return out


def _decomposition(saved: dict[str, Any] | None, method: ComputeMethod
                   ) -> Decomposition | None:
    if saved is None:
        return None
    return Decomposition(method, _clone(saved["q"]), _clone(saved["d"]), _clone(saved["inv"]))
