"""dear.kfac's placement: LPT, the DP contiguous partition (vs brute force), the redundancy rule,
the plan `auto` picks, and the symmetric packing of factors."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from dear.kfac import ComputeMethod, CostModel, NetworkModel, Strategy
from dear.kfac.assignment import (
    EVERYWHERE,
    contiguous_partition,
    lpt,
    lpt_with_redundancy,
    max_load,
)
from dear.kfac.comm import pack, packed_size, split_into_buckets, unpack
from dear.kfac.planner import LayerShape, PlanInputs, make_plan


def _brute_force_contiguous(costs, ranks):
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations_with_replacement(range(n + 1), ranks - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("seed", range(30))
def test_contiguous_partition_is_optimal_and_contiguous(seed):
    rng = random.Random(seed)
    n, ranks = rng.randint(1, 8), rng.randint(1, 4)
    costs = [rng.choice([0.1, 1.0, 5.0, rng.random() * 10]) for _ in range(n)]
    owners = contiguous_partition(costs, ranks)
    assert owners == sorted(owners) and all(0 <= o < ranks for o in owners)
    assert max_load(costs, owners, ranks) == pytest.approx(_brute_force_contiguous(costs, ranks))


def test_lpt_is_the_greedy_schedule():
    # 5 -> r0, 4 -> r1, 3 -> r1 (4 < 5), 3 -> r0 (5 < 7), 3 -> r1 (7 < 8): max 10 (optimum 9)
    assert lpt([3, 5, 3, 4, 3], 2) == [1, 0, 0, 1, 1]
    assert max_load([3, 5, 3, 4, 3], lpt([3, 5, 3, 4, 3], 2), 2) == 10
    assert lpt([1.0] * 4, 4) == [0, 1, 2, 3]
    owners = lpt_with_redundancy([9, 1, 8, 1], 2, [False, True, False, True])
    assert owners == [0, EVERYWHERE, 1, EVERYWHERE]
    assert max_load([9, 1, 8, 1], owners, 2) == 11   # redundant work counts on every rank


@pytest.mark.parametrize("diagonal,symmetric", [(False, True), (False, False), (True, True)])
def test_factor_packing_round_trip(diagonal, symmetric):
    x = torch.randn(7, 7, dtype=torch.float64)
    factor = torch.rand(7, dtype=torch.float64) if diagonal else x + x.t()   # exactly symmetric
    out = torch.empty(packed_size(7, diagonal, symmetric), dtype=torch.float64)
    pack(factor, out, diagonal, symmetric)
    assert out.numel() == (7 if diagonal else 28 if symmetric else 49)
    assert torch.equal(unpack(out, 7, diagonal, symmetric), factor)


def test_buckets_split_by_group_and_capacity():
    items = [("a", 4, 0), ("b", 4, 0), ("c", 4, 0), ("d", 10, 0), ("e", 1, 1)]
    got = split_into_buckets(items, 8)
    assert got == [([("a", 4), ("b", 4)], 0), ([("c", 4)], 0), ([("d", 10)], 0),
                   ([("e", 1)], 1)]


def _inputs(shapes, cost, net, ranks=2, inv=10):
    return PlanInputs(shapes, ranks, ComputeMethod.EIGEN, inv, 1, cost, net)


def test_auto_picks_the_cheapest_estimate_and_the_expected_one_in_extremes():
    shapes = [LayerShape(257, 256), LayerShape(1025, 256), LayerShape(257, 1024)]
    for net in (NetworkModel(1e-5, 1e-10), NetworkModel(1e-3, 1e-7)):
        plan = make_plan(Strategy.AUTO, _inputs(shapes, CostModel(), net))
        assert plan.estimates[plan.strategy.value] == min(plan.estimates.values())
    # A free network: only compute counts, and comm-opt preconditions every layer everywhere.
    free = make_plan(Strategy.AUTO, _inputs(shapes, CostModel(), NetworkModel(0.0, 0.0)))
    assert free.strategy is not Strategy.COMM_OPT
    # Free compute, slow network, an embedding-sized gradient with small factors: sending the
    # gradient every step (mem-opt, pad) costs more than comm-opt's occasional decompositions.
    emb = [LayerShape(20000, 8, diagonal_a=True)]
    slow = make_plan(Strategy.AUTO, _inputs(emb, CostModel((0, 0), (0, 0), 0),
                                            NetworkModel(0.0, 1e-8)))
    assert slow.strategy is Strategy.COMM_OPT
    # PAD owners are contiguous blocks; explicit strategies are honoured
    pad = make_plan(Strategy.PAD, _inputs(shapes * 3, CostModel(), NetworkModel(), ranks=3))
    assert list(pad.layer_owner) == sorted(pad.layer_owner) and pad.reduce_to_owner
    assert len(set(pad.layer_owner)) == 3
