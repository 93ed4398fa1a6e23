"""Embedding tables sent as the rows some rank used (dear/fusion/rows.py).

Judged against single-process training on the global batch (an independent reference), on 2
and 3 ranks, in DeAR's order and under the planned schedule, with clipping, with a rank whose
batch skips the table, and by what went on the wire: the union of the rows the ranks touched.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dear
from tests.distributed import run_distributed
from tests.workloads import max_diff, state_of

VOCAB, DIM, SEQ, PER_RANK, STEPS = 97, 8, 5, 3, 7
TABLE = "emb.weight"


class TokenNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # Used by forward() itself, not by a module: dear puts it in bucket 0, so the table is
        # a later bucket, whose all-gather the planned schedule would otherwise cut into chunks.
        self.gate = nn.Parameter(torch.ones(DIM))
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mid = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, 3)

    def forward(self, ids: torch.Tensor, use_table: bool = True) -> torch.Tensor:
        h = self.emb(ids).mean(1) if use_table else torch.zeros(ids.shape[0], DIM)
        h = h * self.gate
        return self.out(torch.tanh(self.mid(h)))


def make_model() -> TokenNet:
    torch.manual_seed(0)
    return TokenNet()


def ids_of(step: int, rank: int) -> torch.Tensor:
    """Each rank draws from its own third of the vocabulary plus a shared block: the rows the
    ranks touch overlap in part, and most rows are untouched."""
    g = torch.Generator().manual_seed(100 * step + rank)
    own = torch.randint(0, 20, (PER_RANK, SEQ), generator=g) + 25 * rank
    shared = torch.randint(80, 90, (PER_RANK, 1), generator=g)
    return torch.cat([own, shared], 1)


def target_of(step: int, rank: int) -> torch.Tensor:
    return torch.randn(PER_RANK, 3, generator=torch.Generator().manual_seed(7 + step + rank))


def uses_table(step: int, rank: int, skip: bool) -> bool:
    return not (skip and rank == 1 and step % 2 == 1)


def reference(world: int, skip: bool, clip: float) -> dict[str, torch.Tensor]:
    """One process, the global batch: each rank's mean loss, averaged."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(F.mse_loss(model(ids_of(step, r), uses_table(step, r, skip)),
                              target_of(step, r)) for r in range(world)) / world
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return state_of(model)


def _train(skip: bool, clip: float, row_sparse: object) -> dict:
    dear.init()
    rank, world = dear.rank(), dear.size()
    model = make_model()
    opt = dear.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.05), model=model,
                                    named_parameters=model.named_parameters(),
                                    fusion_threshold=256, row_sparse=row_sparse)
    sent, touched = [], []
    for step in range(STEPS):
        opt.zero_grad()
        use = uses_table(step, rank, skip)
        F.mse_loss(model(ids_of(step, rank), use), target_of(step, rank)).backward()
        if clip:
            opt.clip_grad_norm_(clip)
        opt.step()
        stats = opt.row_sparse_stats()          # {table: (rows, rows sent)}
        assert set(stats) <= {TABLE}
        sent.append(stats[TABLE][1] if stats else None)
        touched.append({int(i) for r in range(world) if uses_table(step, r, skip)
                        for i in ids_of(step, r).unique()})
    opt.flush_updates()
    table = [b for b in opt.dear_engine.buckets if getattr(b, "rows", None) is not None][0]
    out = {"params": state_of(model), "sent": sent, "touched": [len(t) for t in touched],
           "modelled": opt.dear_engine.schedule._reduce_bytes()[table.spec.index],
           "rows": (table.rows, table.cols, table.buffer.element_size())}
    dear.shutdown()
    return out


@pytest.mark.parametrize("schedule", ["planned", "dear"])
@pytest.mark.parametrize("world,skip,clip", [(2, False, 0.0), (3, True, 0.0), (2, True, 0.5)],
                         ids=["2ranks", "3ranks-skip", "2ranks-skip-clip"])
def test_row_sparse_table_trains_like_the_global_batch(world: int, skip: bool, clip: float,
                                                       schedule: str) -> None:
    ranks = run_distributed(_train, world, skip, clip, [TABLE], timeout=180,
                            env={"DEAR_SCHEDULE": schedule, "DEAR_PLAN_AFTER": "2"})
    ref = reference(world, skip, clip)
    scale = max(v.abs().max().item() for v in ref.values())
    for res in ranks:
        assert res["sent"] == res["touched"], "the rows sent are not the union of rows used"
        assert max(res["sent"]) < VOCAB // 2
        assert max_diff(res["params"], ref) <= 2e-6 * scale
        # The planned schedule models the table's traffic as what went (the marks' and the
        # rows' all-reduces, each a reduce-scatter + an all-gather), not the whole table.
        rows, cols, item = res["rows"]
        assert res["modelled"] == 2 * item * (rows + res["sent"][-1] * cols + 1)
    for res in ranks[1:]:
        assert max_diff(res["params"], ranks[0]["params"]) == 0.0


def test_auto_finds_the_model_tables_and_names_are_checked() -> None:
    from dear.fusion.rows import resolve_row_sparse
    big = nn.Sequential(nn.Embedding(5000, 64), nn.Embedding(10, 4), nn.Linear(4, 4))
    named = list(big.named_parameters())
    assert resolve_row_sparse("auto", named, big) == {0}     # 1.3 MB table; the small one not
    assert resolve_row_sparse("off", named, big) == set()
    assert resolve_row_sparse("1.weight,2.weight", named, None) == {1, 2}
    with pytest.raises(ValueError, match="not a parameter"):
        resolve_row_sparse(["embed.weight"], named, big)
    with pytest.raises(ValueError, match="only a 2-D table"):
        resolve_row_sparse(["2.bias"], named, big)
    with pytest.raises(ValueError, match="model="):
        resolve_row_sparse(True, named, None)
    assert resolve_row_sparse("auto", named, None, explicit=False) == set()   # DEAR_ROW_SPARSE
    # Alone there is no link to save: "auto" picks none, names are still obeyed.
    assert resolve_row_sparse("auto", named, big, world_size=1) == set()
    assert resolve_row_sparse("0.weight", named, big, world_size=1) == {0}
    assert resolve_row_sparse("auto", named, big, world_size=2) == {0}


def test_a_traced_window_sends_the_table_densely(tmp_path) -> None:
    """dear.diagnose's replay models dense reduce-scatters and all-gathers: while a Tracer is
    attached the table travels as any bucket (so traces stay simulable), and training is the
    same."""
    ranks = run_distributed(_train, 2, False, 0.0, [TABLE], timeout=180,
                            env={"DEAR_TRACE": str(tmp_path), "DEAR_TRACE_ITERATIONS": "2:4",
                                 "DEAR_SCHEDULE": "dear"})
    ref = reference(2, False, 0.0)
    scale = max(v.abs().max().item() for v in ref.values())
    for res in ranks:
        dense = [s for s, (sent, touched) in enumerate(zip(res["sent"], res["touched"]))
                 if sent == VOCAB and touched < VOCAB]
        assert {2, 3} <= set(dense), f"sparse while traced: {res['sent']}"
        assert res["sent"][-1] == res["touched"][-1], "still dense after the trace"
        assert max_diff(res["params"], ref) <= 2e-6 * scale
    assert (tmp_path / "rank0.json").exists()


def test_auto_leaves_out_a_table_tied_to_an_output_layer() -> None:
    """A tied table's gradient has the output layer's in every row: sending it by rows would
    only add the marks' round trip. auto leaves it out; untied tables stay in."""
    from dear.fusion.rows import resolve_row_sparse

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(5000, 64)
            self.pos = nn.Embedding(5000, 64)
            self.head = nn.Linear(64, 5000, bias=False)
            self.head.weight = self.wte.weight

    model = Tied()
    named = list(model.named_parameters())
    assert [n for n, _ in named] == ["wte.weight", "pos.weight"]
    assert resolve_row_sparse("auto", named, model) == {1}
    assert resolve_row_sparse(["wte.weight"], named, model) == {0}   # named: the user's call


BIG_VOCAB, BIG_DIM = 4096, 64      # 1 MB: the smallest table auto sends by rows


class BigTokenNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(BIG_VOCAB, BIG_DIM)
        self.out = nn.Linear(BIG_DIM, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(ids).mean(1)))


def _big_ids(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, BIG_VOCAB, (PER_RANK, SEQ), generator=g)


def _big_loss(net: nn.Module, step: int, rank: int) -> torch.Tensor:
    return F.mse_loss(net(_big_ids(step, rank)), target_of(step, rank))


def _big_reference(make_opt, steps: int, world: int) -> tuple[dict, list[torch.Tensor]]:
    """One process, the global batch: the parameters after `steps` and each step's table
    gradient."""
    model = BigTokenNet()
    opt = make_opt(model.parameters())
    grads = []
    for step in range(steps):
        opt.zero_grad()
        (sum(_big_loss(model, step, r) for r in range(world)) / world).backward()
        grads.append(model.emb.weight.grad.clone())
        opt.step()
    return state_of(model), grads


def _train_big(steps: int, synchronized: bool = False) -> dict:
    """No row_sparse= argument: what DEAR_ROW_SPARSE (default auto) decides. `synchronized`:
    Horovod's pattern (as dear.KFAC's non-overlapped path and clipping users write it):
    synchronize() puts the averaged gradients in .grad, then step() in skip_synchronize()."""
    dear.init()
    rank = dear.rank()
    model = BigTokenNet()
    inner = (torch.optim.SGD(model.parameters(), lr=0.5) if synchronized
             else torch.optim.Adam(model.parameters(), lr=0.05))
    opt = dear.DistributedOptimizer(inner, model=model, fusion_threshold=4096)
    sent, grads = [], []
    for step in range(steps):
        opt.zero_grad()
        _big_loss(model, step, rank).backward()
        if synchronized:
            opt.synchronize()
            grads.append(model.emb.weight.grad.clone())
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        sent.append([b.sent_rows for b in opt.dear_engine.buckets if getattr(b, "rows", None)])
    opt.flush_updates()
    out = {"params": state_of(model), "sent": sent, "grads": grads}
    dear.shutdown()
    return out


@pytest.mark.parametrize("setting", [None, "off"], ids=["default", "off"])
def test_default_sends_an_untied_table_by_rows(setting: object) -> None:
    steps, world = 3, 2
    env = {"DEAR_ROW_SPARSE": setting} if setting else {}
    ranks = run_distributed(_train_big, world, steps, timeout=180, env=env)
    ref, _ = _big_reference(lambda ps: torch.optim.Adam(ps, lr=0.05), steps, world)
    scale = max(v.abs().max().item() for v in ref.values())
    for res in ranks:
        touched = [len({int(i) for r in range(world) for i in _big_ids(s, r).unique()})
                   for s in range(steps)]
        assert res["sent"] == ([[t] for t in touched] if setting is None else [[]] * steps)
        assert max_diff(res["params"], ref) <= 2e-6 * scale
    assert max_diff(ranks[1]["params"], ranks[0]["params"]) == 0.0


def test_synchronize_hands_back_the_whole_averaged_table() -> None:
    steps, world = 3, 2
    ranks = run_distributed(_train_big, world, steps, True, timeout=180)
    ref, ref_grads = _big_reference(lambda ps: torch.optim.SGD(ps, lr=0.5), steps, world)
    scale = max(v.abs().max().item() for v in ref.values())
    for res in ranks:
        assert all(len(sent) == 1 for sent in res["sent"])   # the default sent it by rows
        for got, want in zip(res["grads"], ref_grads):
            assert (got - want).abs().max().item() <= 1e-6 * want.abs().max().item()
            assert torch.equal(got.ne(0).any(1), want.ne(0).any(1))
        assert max_diff(res["params"], ref) <= 2e-6 * scale


def _join_runs(batches: list[int]) -> dict:
    """Uneven inputs with the table sent by rows (the default) under dear.join(), and DDP +
    torch's Join on the same batches: a joined rank shadows the marks' and rows' all-reduces."""
    from torch.distributed.algorithms.join import Join
    dear.init()
    rank = dear.rank()
    out = {}
    for kind in ("ddp", "dear"):
        model = BigTokenNet()
        net = torch.nn.parallel.DistributedDataParallel(model) if kind == "ddp" else model
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        if kind == "dear":
            opt = dear.DistributedOptimizer(opt, model=model, fusion_threshold=4096)
        with (Join([net]) if kind == "ddp" else dear.join(opt)):
            for step in range(batches[rank]):
                opt.zero_grad()
                _big_loss(net, step, rank).backward()
                opt.step()
        if kind == "dear":
            out["tables"] = sum(1 for b in opt.dear_engine.buckets if getattr(b, "rows", None))
        out[kind] = state_of(model)
    dear.shutdown()
    return out


def test_uneven_inputs_with_a_table_sent_by_rows_end_where_ddp_join_ends() -> None:
    ranks = run_distributed(_join_runs, 2, [2, 5], timeout=180, env={"DEAR_PLAN_AFTER": "2"})
    for res in ranks:
        assert res["tables"] == 1
        scale = max(v.abs().max().item() for v in res["ddp"].values())
        assert max_diff(res["dear"], res["ddp"]) <= 2e-6 * scale
    assert max_diff(ranks[0]["dear"], ranks[1]["dear"]) == 0.0
