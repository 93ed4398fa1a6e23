"""Sharded optimizer state moved between cuts without being whole on any rank
(dear/sharding/reshard.py, dear/sharding/commit.py), on 3 Gloo ranks.

The reference is the whole state itself: every rank builds the same known tensors from a seed,
holds only some pieces of them, and what each rank receives is compared with slices of the
known tensors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dear.sharding.commit import buddies
from dear.sharding.reshard import Piece, interim
from tests.distributed import run_distributed

NUMELS = [7, 1, 40, 2]      # parameter 1 has fewer elements than ranks


def _whole() -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(3)
    return [{"exp_avg": torch.randn(n, generator=g),
             "exp_avg_sq": torch.rand(n, generator=g, dtype=torch.float64),
             "step": torch.tensor(float(5 + i))} for i, n in enumerate(NUMELS)]


def _piece(whole: list[dict[str, Any]], param: int, lo: int, hi: int) -> Piece:
    return Piece(param, lo, hi, {k: (v[lo:hi].clone() if v.dim() else v.clone())
                                 for k, v in whole[param].items()})


def _comm() -> Any:
    import dear
    dear.init(backend="torch")
    from dear.comm import runtime
    return runtime.communicator()


def move(case: str) -> dict[str, Any]:
    from dear.sharding import reshard
    from dear.sharding.reshard import StateLost, redistribute
    if case == "rounds":                    # each pair's slices cut across many rounds
        reshard.ROUND_BYTES = 24
    comm = _comm()
    rank, world = comm.rank, comm.size
    whole = _whole()
    # held: each rank its interim piece of every parameter, and a copy of the next rank's
    held = []
    for r in (rank, (rank + 1) % world):
        for i, n in enumerate(NUMELS):
            lo, hi = interim(n, r, world)
            held.append(_piece(whole, i, lo, hi))
    if case == "hole":                      # rank 2's pieces of parameter 2 are nowhere
        drop = interim(NUMELS[2], 2, world)
        held = [p for p in held if not (p.param == 2 and (p.lo, p.hi) == drop)]
    # wanted: other cuts (uneven, overlapping between ranks, whole on rank 0 for parameter 3)
    wanted = {0: [(0, 0, 3), (2, 0, 40), (3, 0, 2)], 1: [(0, 3, 7), (2, 10, 25), (1, 0, 1)],
              2: [(2, 25, 40), (1, 0, 0), (0, 2, 6)]}[rank]
    try:
        got = redistribute(comm, held, wanted, lambda i: torch.device("cpu"))
    except StateLost as exc:
        return {"lost": str(exc)}
    return {"got": [(p.param, p.lo, p.hi, p.state) for p in got], "wanted": wanted}


def test_every_rank_gets_the_slices_it_asked_for() -> None:
    whole = _whole()
    for res in run_distributed(move, 3, "copies", timeout=90):
        assert [tuple(g[:3]) for g in res["got"]] == [tuple(w) for w in res["wanted"]]
        for param, lo, hi, state in res["got"]:
            assert set(state) == {"exp_avg", "exp_avg_sq", "step"}
            assert torch.equal(state["exp_avg"], whole[param]["exp_avg"][lo:hi])
            assert torch.equal(state["exp_avg_sq"], whole[param]["exp_avg_sq"][lo:hi])
            assert state["exp_avg_sq"].dtype == torch.float64
            assert torch.equal(state["step"], whole[param]["step"])


def test_a_missing_piece_is_named_on_every_rank() -> None:
    for res in run_distributed(move, 3, "hole", timeout=90):
        assert "trained parameter 2" in res["lost"] and "held by no rank" in res["lost"]


def test_small_rounds_move_the_same_values() -> None:
    """The exchange in rounds of two elements (each pair's slices cut across rounds)."""
    whole = _whole()
    for res in run_distributed(move, 3, "rounds", timeout=90):
        for param, lo, hi, state in res["got"]:
            assert torch.equal(state["exp_avg"], whole[param]["exp_avg"][lo:hi])


@pytest.mark.parametrize("hosts,expected", [
    (["a", "a", "a"], [1, 2, 0]),
    (["a", "b", "c"], [1, 2, 0]),
    (["a", "a", "b", "b"], [2, 3, 0, 1]),
    (["a", "a", "b"], [2, 2, 0]),
])
def test_each_rank_is_copied_to_another_host(hosts: list[str], expected: list[int]) -> None:
    got = buddies(hosts)
    assert got == expected
    if len(set(hosts)) > 1:
        assert all(hosts[b] != hosts[r] for r, b in enumerate(got))
