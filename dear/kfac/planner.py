"""The plan: for each layer (in forward-execution order), who decomposes its factors, who
preconditions its gradient, and where its factors are reduced; and, for `auto`, which strategy
the cost models say is fastest. Made on rank 0 and broadcast, so every rank follows one plan.

Per-iteration estimates (factor work divided by factor_update_freq, decompositions by
inv_update_freq):
  COMM_OPT  all-reduce(factors) + [LPT max load of the factors' decompositions + broadcast of the
            decompositions] + every layer's preconditioning on every rank
  MEM_OPT   all-reduce(factors) + LPT max load over layers (decompositions + preconditioning)
            + broadcast of the preconditioned gradients from their owners
  PAD       reduce(factors) to owners + contiguous-partition max load over layers
            + broadcast of the preconditioned gradients from their owners
Overlap with the forward and backward passes (SPD's pipelining) is not modelled: it helps every
strategy's factor communication alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .assignment import (
    EVERYWHERE,
    contiguous_partition,
    kaisa_greedy,
    kaisa_groups,
    lpt_with_redundancy,
    max_load,
)
from .comm import packed_size
from .costs import CostModel, NetworkModel
from .enums import AssignmentStrategy, ComputeMethod, Strategy
from .linalg import flat_size


@dataclasses.dataclass(frozen=True)
class LayerShape:
    a_dim: int
    g_dim: int
    diagonal_a: bool = False


@dataclasses.dataclass(frozen=True)
class Plan:
    strategy: Strategy
    a_owner: tuple[int, ...]        # rank decomposing A of each layer (EVERYWHERE: all ranks)
    g_owner: tuple[int, ...]
    layer_owner: tuple[int, ...]    # rank preconditioning each layer (EVERYWHERE: all ranks)
    reduce_to_owner: bool           # PAD: factors reduced to layer_owner instead of all-reduced
    estimates: dict[str, float]     # strategy value -> estimated seconds per iteration
    columns: int = 0                # HYBRID_OPT: columns of KAISA's grid (layer's column:
                                    # layer_owner % columns; its ranks precondition it)


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    shapes: Sequence[LayerShape]
    ranks: int
    method: ComputeMethod
    inv_update_freq: int
    factor_update_freq: int
    cost: CostModel
    network: NetworkModel
    symmetric: bool = True
    redundancy: bool = True
    element_size: int = 4
    assignment: AssignmentStrategy | None = None   # kfac-pytorch's d^3 / d^2 greedy
    colocate: bool = False          # a layer's A and G decomposed by one rank
    grad_workers: int | None = None  # HYBRID_OPT: ranks per column


def _kaisa_work(p: PlanInputs) -> list[tuple[float, float]]:
    """Each layer's (A, G) decomposition cost: d^3 / d^2 (kfac-pytorch's assignment_strategy),
    else the calibrated cost model's seconds."""
    if p.assignment is None:
        return [(p.cost.decompose(p.method, s.a_dim, s.diagonal_a),
                 p.cost.decompose(p.method, s.g_dim)) for s in p.shapes]
    power = 3 if p.assignment is AssignmentStrategy.COMPUTE else 2
    return [(float(s.a_dim ** power), float(s.g_dim ** power)) for s in p.shapes]


def _kaisa(p: PlanInputs, strategy: Strategy, grad_workers: int) -> Plan:
    """kfac-pytorch's assignment for its grad_worker_fraction = grad_workers / ranks."""
    colocate = p.colocate or grad_workers == 1
    owners = kaisa_greedy(_kaisa_work(p), kaisa_groups(p.ranks, grad_workers), p.ranks,
                          colocate)
    a_owner = tuple(a for a, _ in owners)
    g_owner = tuple(g for _, g in owners)
    columns = p.ranks // grad_workers
    if strategy is Strategy.COMM_OPT:
        return Plan(strategy, a_owner, g_owner, (EVERYWHERE,) * len(owners), False, {})
    return Plan(strategy, a_owner, g_owner, g_owner, False, {},
                columns if strategy is Strategy.HYBRID_OPT else 0)


def _factor_numel(s: LayerShape, symmetric: bool) -> int:
    return packed_size(s.a_dim, s.diagonal_a, symmetric) + packed_size(s.g_dim, False, symmetric)


def _comm_opt(p: PlanInputs) -> tuple[Plan, float]:
    n, es, net, cost = p.ranks, p.element_size, p.network, p.cost
    items = [(s.a_dim, s.diagonal_a) for s in p.shapes] + [(s.g_dim, False) for s in p.shapes]
    secs = [cost.decompose(p.method, d, diag) for d, diag in items]
    sizes = [flat_size(p.method, d, diag) * es for d, diag in items]
    redundant = [p.redundancy and c <= net.link.time("send", b * (n - 1))
                 for c, b in zip(secs, sizes)]
    owners = lpt_with_redundancy(secs, n, redundant)
    by_owner = [sum(b for b, o in zip(sizes, owners) if o == r) for r in range(n)]
    factors = net.all_reduce(sum(_factor_numel(s, p.symmetric) for s in p.shapes) * es, n)
    inverse = max_load(secs, owners, n) + net.owners_exchange(by_owner, sum(by_owner) > 0)
    precond = sum(cost.precondition(p.method, s.g_dim, s.a_dim, s.diagonal_a) for s in p.shapes)
    total = factors / p.factor_update_freq + inverse / p.inv_update_freq + precond
    k = len(p.shapes)
    plan = Plan(Strategy.COMM_OPT, tuple(owners[:k]), tuple(owners[k:]),
                (EVERYWHERE,) * k, False, {})
    return plan, total


def _layer_costs(p: PlanInputs) -> list[float]:
    return [(p.cost.decompose(p.method, s.a_dim, s.diagonal_a)
             + p.cost.decompose(p.method, s.g_dim)) / p.inv_update_freq
            + p.cost.precondition(p.method, s.g_dim, s.a_dim, s.diagonal_a) for s in p.shapes]


def _owned(p: PlanInputs, strategy: Strategy, owners: list[int], costs: list[float]
           ) -> tuple[Plan, float]:
    n, es, net = p.ranks, p.element_size, p.network
    grads = [s.a_dim * s.g_dim * es for s in p.shapes]
    by_owner = [sum(b for b, o in zip(grads, owners) if o == r) for r in range(n)]
    fnumel = [_factor_numel(s, p.symmetric) * es for s in p.shapes]
    if strategy is Strategy.PAD:
        blocks = len(set(owners))
        factors = net.owners_exchange([sum(b for b, o in zip(fnumel, owners) if o == r)
                                       for r in range(n)], 2 * blocks)
    else:
        factors = net.all_reduce(sum(fnumel), n)
    total = (factors / p.factor_update_freq + max_load(costs, owners, n)
             + net.owners_exchange(by_owner, sum(1 for b in by_owner if b)))
    owners_t = tuple(owners)
    return Plan(strategy, owners_t, owners_t, owners_t, strategy is Strategy.PAD, {}), total


def _mem_opt(p: PlanInputs) -> tuple[Plan, float]:
    costs = _layer_costs(p)
    net, n, es = p.network, p.ranks, p.element_size
    redundant = [p.redundancy and c <= net.link.time("send", s.a_dim * s.g_dim * es * (n - 1))
                 for c, s in zip(costs, p.shapes)]
    return _owned(p, Strategy.MEM_OPT, lpt_with_redundancy(costs, n, redundant), costs)


def _pad(p: PlanInputs) -> tuple[Plan, float]:
    costs = _layer_costs(p)
    return _owned(p, Strategy.PAD, contiguous_partition(costs, p.ranks), costs)


_BUILDERS = {Strategy.COMM_OPT: _comm_opt, Strategy.MEM_OPT: _mem_opt, Strategy.PAD: _pad}


def make_plan(strategy: Strategy, inputs: PlanInputs) -> Plan:
    """The plan for `strategy` (AUTO: the one with the lowest estimate)."""
    if inputs.ranks == 1:
        k = len(inputs.shapes)
        chosen = Strategy.COMM_OPT if strategy in (Strategy.AUTO, Strategy.HYBRID_OPT) \
            else strategy
        return Plan(chosen, (0,) * k, (0,) * k, (0,) * k, False, {})
    if strategy is Strategy.HYBRID_OPT:
        assert inputs.grad_workers is not None
        return _kaisa(inputs, strategy, inputs.grad_workers)
    if strategy in (Strategy.COMM_OPT, Strategy.MEM_OPT) and (
            inputs.assignment is not None or inputs.colocate):
        workers = inputs.ranks if strategy is Strategy.COMM_OPT else 1
        return _kaisa(inputs, strategy, workers)
    candidates = {s: b(inputs) for s, b in _BUILDERS.items()}
    estimates = {s.value: t for s, (_, t) in candidates.items()}
    if strategy is Strategy.AUTO:
        strategy = min(candidates, key=lambda s: (candidates[s][1], s.value))
    return dataclasses.replace(candidates[strategy][0], estimates=estimates)


def describe(plan: Plan, auto: bool, network: NetworkModel, measured: bool, cost: CostModel,
             calibrated: bool) -> str:
    """The plan, the estimates and the measurements behind an `auto` choice, for the log."""
    estimates = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in sorted(plan.estimates.items()))
    return (f"strategy {plan.strategy.value}{' (auto)' if auto else ''}; estimated per "
            f"iteration: {estimates or 'not estimated'}; network alpha {network.alpha:.3g} s, "
            f"beta {network.beta:.3g} s/byte ({'measured' if measured else 'given'}); "
            f"decomposition c0 + c3 d^3 with eigen ({cost.eigen[0]:.3g}, {cost.eigen[1]:.3g}), "
            f"inverse ({cost.inverse[0]:.3g}, {cost.inverse[1]:.3g}), matmul {cost.flop_s:.3g} "
            f"s/flop ({'calibrated on rank 0' if calibrated else 'given'}); owners "
            f"{list(plan.layer_owner)}"
            + (f"; pin this choice with strategy={plan.strategy.value!r}" if auto else ""))
