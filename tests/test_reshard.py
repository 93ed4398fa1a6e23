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
    if case == "broadcast":                 # a backend without an all-to-all
        type(comm).supports_all_to_all = property(lambda self: False)
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


def test_a_backend_without_all_to_all_moves_the_same_values() -> None:
    whole = _whole()
    for res in run_distributed(move, 3, "broadcast", timeout=90):
        for param, lo, hi, state in res["got"]:
            assert torch.equal(state["exp_avg"], whole[param]["exp_avg"][lo:hi])
            assert torch.equal(state["exp_avg_sq"], whole[param]["exp_avg_sq"][lo:hi])


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


def commit_and_resume(hosts: list[str], lost: list[int]) -> dict[str, Any]:
    """Each rank commits its interim pieces of the known state (copies to its buddy); the
    ranks in `lost` then drop everything they hold, as if they had left; every rank resumes."""
    from dear.sharding.commit import agree, make
    from dear.sharding.reshard import StateLost, redistribute
    comm = _comm()
    rank, world = comm.rank, comm.size
    whole = _whole()
    own = [_piece(whole, i, *interim(n, rank, world)) for i, n in enumerate(NUMELS)]
    commit = make(comm, own, hosts, (1, 1), lambda i: torch.device("cpu"))
    kept = {r: [(p.param, p.lo, p.hi, p.state) for p in pieces]
            for r, pieces in commit.held.items()}
    try:
        _, held = agree(comm, None if rank in lost else commit, generation=1)
    except StateLost as exc:
        return {"kept": kept, "lost": str(exc)}
    # what a new world of the same ranks would cut: parameter 2 whole on every rank
    got = redistribute(comm, held or [], [(2, 0, NUMELS[2])], lambda i: torch.device("cpu"))
    return {"kept": kept, "got": got[0].state}


@pytest.mark.parametrize("hosts,lost", [(["a", "b", "c"], [1]), (["a", "a", "b"], [2])])
def test_a_lost_ranks_pieces_come_back_from_its_copy(hosts: list[str], lost: list[int]) -> None:
    whole = _whole()
    results = run_distributed(commit_and_resume, 3, hosts, lost, timeout=90)
    backup = buddies(hosts)
    for rank, res in enumerate(results):
        # each rank keeps its own pieces and copies of exactly the ranks it backs up
        assert sorted(res["kept"]) == sorted({rank} | {r for r in range(3) if backup[r] == rank})
        for r, pieces in res["kept"].items():
            for param, lo, hi, state in pieces:
                assert (lo, hi) == interim(NUMELS[param], r, 3)
                assert torch.equal(state["exp_avg"], whole[param]["exp_avg"][lo:hi])
        assert torch.equal(res["got"]["exp_avg"], whole[2]["exp_avg"])
        assert torch.equal(res["got"]["exp_avg_sq"], whole[2]["exp_avg_sq"])


def test_a_rank_lost_with_its_copy_is_named_on_every_rank() -> None:
    """Ranks 0 and 1 share host a; rank 2 (host b) backs both up: losing ranks 0 and 2 loses
    rank 0's pieces (and rank 2's: rank 0 held its copy)."""
    for res in run_distributed(commit_and_resume, 3, ["a", "a", "b"], [0, 2], timeout=90):
        assert "rank(s) [0, 2] of the 3-rank world" in res["lost"], res["lost"]


def rejoin_twice() -> dict[str, Any]:
    """Sharded Adam, 2 steps, a commit (Horovod Elastic's, in memory); a rejoin whose cross-rank
    checks fail (a rank lost during the sync), then one that succeeds: the state put together
    after it against the state at the commit."""
    import dataclasses

    import dear
    dear.init(backend="torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    opt = dear.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model=model,
                                    shard_optimizer_state=True)
    g = torch.Generator().manual_seed(dear.rank())
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 5, generator=g)).pow(2).mean().backward()
        opt.step()
    engine = opt.dear_engine                   # a test's look inside: Horovod's handler's calls
    assert engine.updates.make_commit(engine)
    at_commit = opt.state_dict()["state"]
    options = engine.options

    def lost(comm: Any) -> None:
        raise RuntimeError("a rank was lost during the sync")
    engine.options = dataclasses.replace(options, rejoin_checks=lost)
    try:
        engine.rejoin()
        failed = False
    except RuntimeError:
        failed = True
    engine.options = options
    resumed = engine.rejoin()
    after = opt.state_dict()["state"]
    dear.shutdown()
    return {"failed": failed, "resumed": resumed, "at_commit": at_commit, "after": after}


def test_a_failed_rejoin_keeps_the_commit_for_the_next() -> None:
    for res in run_distributed(rejoin_twice, 2, timeout=90):
        assert res["failed"] and res["resumed"]
        assert sorted(res["after"]) == sorted(res["at_commit"])
        for i, entry in res["at_commit"].items():
            for key, value in entry.items():
                assert torch.equal(res["after"][i][key], value), (i, key)
