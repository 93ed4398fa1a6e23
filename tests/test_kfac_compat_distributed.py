"""kfac-pytorch's distribution arguments on Gloo ranks: grad_worker_fraction (comm-opt,
HYBRID-OPT on KAISA's grid, mem-opt), assignment_strategy and colocate_factors assign work as
kfac-pytorch's KAISAAssignment does (its greedy rule written out here), results equal the
shard-averaged reference and replicas are bitwise equal; strategy="auto" is decided by rank 0,
logged with its figures, and can be pinned."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from dear.kfac import KFAC, CostModel, DistributedStrategy, NetworkModel
from tests import kfac_workloads as W
from tests.distributed import run_distributed

ARGS = dict(W.ARGS)
STEPS = W.STEPS
# (grad_worker_fraction, assignment_strategy, colocate_factors, expected strategy, columns)
CASES = [
    (0.5, "compute", True, "hybrid-opt", 2),
    (0.5, "memory", False, "hybrid-opt", 2),
    (DistributedStrategy.HYBRID_OPT, None, None, "hybrid-opt", 2),
    (1, "compute", False, "comm-opt", 0),
    (1, "memory", True, "comm-opt", 0),
    (0.25, "compute", True, "mem-opt", 0),
    (DistributedStrategy.MEM_OPT, "memory", False, "mem-opt", 0),
]


def kaisa_owners(dims: list[tuple[int, int]], world: int, workers: int, power: int,
                 colocate: bool) -> list[tuple[int, int]]:
    """kfac-pytorch's KAISAAssignment.greedy_assignment with d^power costs (its docstrings)."""
    columns = world // workers
    groups = [list(g) for g in {frozenset(range(i, world, columns)) for i in range(columns)}]
    work = [(a ** power, g ** power) for a, g in dims]
    loads = [0.0] * world
    out = {}
    for i in sorted(range(len(work)), key=lambda i: sum(work[i]), reverse=True):
        group = groups[[sum(loads[r] for r in g) for g in groups].index(
            min(sum(loads[r] for r in g) for g in groups))]
        items = [("A", work[i][0]), ("G", work[i][1])]
        if colocate:
            items = [("AG", sum(work[i]))]
        else:
            items.sort(key=lambda x: (x[1], x[0]), reverse=True)
        owner = {}
        for which, cost in items:
            r = group[[loads[x] for x in group].index(min(loads[x] for x in group))]
            loads[r] += cost
            for f in which:
                owner[f] = r
        out[i] = (owner["A"], owner["G"])
    return [out[i] for i in range(len(work))]


def _average(model: torch.nn.Module) -> None:
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def _rank_cases() -> list:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for fraction, assignment, colocate, _, _ in CASES:
        model = W.make_model("cnn")
        extra = {} if assignment is None else dict(assignment_strategy=assignment,
                                                   colocate_factors=colocate)
        precond = KFAC(model, grad_worker_fraction=fraction, **ARGS, **extra)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        grads = []
        for step in range(STEPS):
            x, y = W.batch("cnn", step, world, rank)
            opt.zero_grad()
            W.loss_fn(model(x), y).backward()
            _average(model)
            precond.step()
            grads.append(W.grads_of(model))
            opt.step()
        plan = precond.plan
        dims = [(s.layer.a_dim, s.layer.g_dim) for s in precond.layers]
        out.append((grads, plan.strategy.value, plan.columns, list(zip(plan.a_owner,
                                                                       plan.g_owner)), dims))
    return out


def test_grad_worker_fraction_assignment_and_colocation_on_4_ranks():
    world = 4
    results = run_distributed(_rank_cases, world, timeout=300)
    want = W.reference_run("cnn", world, STEPS, **ARGS)
    for k, (fraction, assignment, colocate, strategy, columns) in enumerate(CASES):
        grads, chosen, got_columns, owners, dims = results[0][k]
        assert (chosen, got_columns) == (strategy, columns), CASES[k]
        if assignment is not None:
            workers = {"comm-opt": world, "mem-opt": 1, "hybrid-opt": world // 2}[strategy]
            assert owners == kaisa_owners(dims, world, workers,
                                          3 if assignment == "compute" else 2,
                                          colocate or workers == 1), CASES[k]
        for rank in range(world):
            assert results[rank][k][3] == owners, "ranks disagree on the plan"
            for step in range(STEPS):
                assert W.max_rel_diff(results[rank][k][0][step], want[step]) < 1e-9
                assert all(torch.equal(results[rank][k][0][step][n], grads[step][n])
                           for n in grads[step]), (CASES[k], rank, step)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _rank_auto() -> tuple[str, list[str], str]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    handler = _Records()
    logger = logging.getLogger("dear")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    # each rank believes something else about its costs: only rank 0's view may decide
    cost = CostModel() if rank == 0 else CostModel((1.0, 1.0), (1.0, 1.0), 1.0)
    net = NetworkModel(1e-4, 1e-9) if rank == 0 else NetworkModel(10.0, 1.0)
    model = W.make_model("cnn")
    auto = KFAC(model, strategy="auto", cost_model=cost, network_model=net, **ARGS)
    x, y = W.batch("cnn", 0, 2, rank)
    W.loss_fn(model(x), y).backward()
    _average(model)
    auto.step()
    chosen = auto.plan.strategy.value
    pinned = KFAC(W.make_model("cnn"), strategy=chosen, cost_model=cost, network_model=net,
                  **ARGS)
    W.loss_fn(pinned._model(x), y).backward()
    pinned.step()
    return chosen, handler.lines, pinned.plan.strategy.value


def test_auto_is_decided_on_rank_0_logged_with_its_figures_and_pinnable():
    results = run_distributed(_rank_auto, 2, timeout=120)
    chosen = results[0][0]
    assert [r[0] for r in results] == [chosen, chosen]
    assert [r[2] for r in results] == [chosen, chosen]
    lines = [line for line in results[0][1] if "(auto)" in line]
    assert len(lines) == 1, results[0][1]
    line = lines[0]
    for text in ("estimated per iteration: comm-opt", "mem-opt", "pad", "network alpha 0.0001 s",
                 "beta 1e-09 s/byte (given)", f"pin this choice with strategy={chosen!r}"):
        assert text in line, (text, line)
    estimates = {part.split()[0]: float(part.split()[1])
                 for part in line.split("estimated per iteration: ")[1].split(";")[0].split(", ")}
    assert min(estimates, key=estimates.get) == chosen
    assert not any("(auto)" in line for line in results[1][1])   # rank 0 logs for everyone


def _rank_accumulation(passes: int, accumulation: int) -> list[dict]:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = W.make_model("cnn")
    precond = KFAC(model, **ARGS, accumulation_steps=accumulation,
                   network_model=NetworkModel(0.0, 0.0))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    grads = []
    for step in range(4):
        opt.zero_grad()
        for j in range(passes):
            x, y = W.batch("cnn", step * passes + j, world, rank)
            W.loss_fn(model(x), y).backward()
        _average(model)
        precond.step()
        grads.append(W.grads_of(model))
        opt.step()
    return grads


def test_accumulation_steps_with_pipelined_factors_on_2_ranks():
    """3 passes per step, an update after every 2nd pass of a step (kfac-pytorch's rule): the
    updates of a step are sent from the hook of the last pass, leftovers wait for the next."""
    results = run_distributed(_rank_accumulation, 2, 3, 2, timeout=180)
    model = W.make_model("cnn")
    ref = W.ReferenceKFAC(model, **ARGS, accumulation_steps=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(4):
        ref.backward_on_passes([[W.batch("cnn", step * 3 + j, 2, r) for r in range(2)]
                                for j in range(3)])
        ref.step()
        for grads in results:
            assert W.max_rel_diff(grads[step], W.grads_of(model)) < 1e-9, step
        opt.step()
