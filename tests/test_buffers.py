"""broadcast_buffers (issue 16, item 3): with model= dear gives every rank rank 0's module
buffers, as DDP does by default, so BatchNorm's running statistics (and so evaluation and
checkpoints) do not depend on the rank. Compared with DDP on 2 and 3 Gloo ranks."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import dear
from tests.distributed import run_distributed

# The planned schedule (dear/fusion/schedule.py) from the 3rd step, so these runs cover it.
PLANNED = {"DEAR_PLAN_AFTER": "2"}

STEPS = 5
PER_RANK = 6


class BNNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.bn1 = torch.nn.BatchNorm1d(16)
        self.fc2 = torch.nn.Linear(16, 16)
        self.bn2 = torch.nn.BatchNorm1d(16, momentum=None)   # cumulative: num_batches_tracked
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.fc1(x)))
        return self.head(F.relu(self.bn2(self.fc2(h))))


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Each rank's batch has its own mean and scale, so unsynchronised running stats drift apart.
    g = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randn(PER_RANK, 8, generator=g) * (1 + rank) + rank,
            torch.randn(PER_RANK, 3, generator=g))


def _train(kind: str) -> dict[str, torch.Tensor]:
    rank = dear.rank()
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if kind == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
    else:
        net = model
        opt = dear.DistributedOptimizer(opt, model=model, fusion_threshold=1024,
                                        **({"broadcast_buffers": False} if kind == "off" else {}))
    def train(steps: range) -> None:
        for step in steps:
            opt.zero_grad()
            x, y = _data(step, rank)
            F.mse_loss(net(x), y).backward()
            opt.step()

    train(range(STEPS))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}   # flushes dear
    model.eval()
    with torch.no_grad():                      # through DDP's wrapper, as scripts evaluate
        state["eval_output"] = net(_data(99, 0)[0]).detach()
    # timm's distribute_bn (its default at each epoch's end): every rank averages its running
    # statistics, in place; then training goes on.
    for name, buf in model.named_buffers():
        if "running_" in name:
            torch.distributed.all_reduce(buf)
            buf /= dear.size()
    model.train()
    train(range(STEPS, STEPS + 2))
    state.update({f"later.{k}": v.detach().clone() for k, v in model.state_dict().items()})
    return state


def _ranks() -> dict:
    dear.init()
    out = {kind: _train(kind) for kind in ("ddp", "dear", "off")}
    dear.shutdown()
    return out


@functools.lru_cache(maxsize=None)
def results(world: int) -> list[dict]:
    return run_distributed(_ranks, world, timeout=180, env=PLANNED)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


BUFFERS = ("bn1.running_mean", "bn1.running_var", "bn2.running_mean", "bn2.running_var")


@pytest.mark.parametrize("world", [2, 3])
def test_running_stats_equal_across_ranks_and_to_ddp(world: int) -> None:
    ranks = results(world)
    # DDP broadcasts rank 0's buffers at the start of each forward with gradients: after the
    # last step each DDP rank still holds its own (what an EMA update or an eval reads there),
    # and so must each dear rank: every rank is compared with the same DDP rank.
    for rank, res in enumerate(ranks):
        mine, ddp = res["dear"], res["ddp"]
        for name in (*BUFFERS, "fc1.weight", "head.weight", "eval_output",
                     *(f"later.{b}" for b in BUFFERS), "later.fc1.weight", "later.head.weight"):
            # Same math as DDP, gradients only summed in another order: float32 rounding,
            # relative to each tensor's scale (1e-5 is ~80 ulps after 7 steps).
            assert rel_diff(mine[name], ddp[name]) < 1e-5, (rank, name)
        for name in ("bn2.num_batches_tracked", "later.bn2.num_batches_tracked"):
            assert torch.equal(mine[name], ddp[name])
    if world > 1:                              # their own: not copies of rank 0's
        assert not torch.equal(ranks[1]["dear"]["bn1.running_mean"],
                               ranks[0]["dear"]["bn1.running_mean"])
    # Without the broadcast, each rank keeps its own statistics (what dear did before).
    assert not torch.equal(ranks[1]["off"]["bn1.running_mean"], ranks[0]["off"]["bn1.running_mean"])


def _reassigned(how: str) -> dict:
    """A buffer replaced after the wrap (a new tensor, or new memory under `.data`), with
    rank-dependent values: the broadcast must carry the new one. The values at the next
    forward are read by a forward pre-hook that runs after dear's."""
    dear.init()
    rank = dear.rank()
    torch.manual_seed(0)
    model = BNNet()
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model=model,
                                    fusion_threshold=1024)
    seen = []
    model.bn1.register_forward_pre_hook(lambda m, a: seen.append(m.running_mean.clone()))
    for step in range(4):
        if step == 2:
            if how == "tensor":
                model.bn1.running_mean = torch.full((16,), float(rank))
            else:
                model.bn1.running_mean.data = torch.full((16,), float(rank))
        opt.zero_grad()
        x, y = _data(step, rank)
        F.mse_loss(model(x), y).backward()
        opt.step()
    opt.zero_grad()
    model(_data(4, rank)[0])                   # the forward that puts step 3's values in place
    dear.shutdown()
    return {"seen": seen}


def _reassigned_reference(world: int, replace: bool = True) -> list[torch.Tensor]:
    """Rank 0's bn1.running_mean before each forward of _reassigned, in one process without dear.
    In training mode BatchNorm normalises by the batch's own statistics, so the running buffers
    never change an output: the parameters follow SGD on the mean of the ranks' losses, each
    rank's batch through the model on its own, and rank 0's buffers are what its own forwards
    (and its replacement at step 2, zeros, unless not `replace`) leave in them."""
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen = []
    for step in range(4):
        if step == 2 and replace:
            model.bn1.running_mean = torch.full((16,), 0.0)
        opt.zero_grad()
        losses = []
        seen.append(model.bn1.running_mean.clone())
        for r in range(world):
            x, y = _data(step, r)
            if r == 0:
                out = model(x)
            else:                                  # another rank's statistics stay its own
                mine = {n: b.clone() for n, b in model.named_buffers()}
                out = torch.func.functional_call(model, {**dict(model.named_parameters()),
                                                         **mine}, (x,))
            losses.append(F.mse_loss(out, y))
        torch.stack(losses).mean().backward()
        opt.step()
    seen.append(model.bn1.running_mean.clone())
    return seen


@functools.lru_cache(maxsize=None)
def _reassigned_runs(how: str, check_every: str) -> list[dict]:
    return run_distributed(_reassigned, 2, how, timeout=120,
                           env={"DEAR_CHECK_EVERY": check_every})


@pytest.mark.parametrize("check_every", ["1", "0"])
@pytest.mark.parametrize("how", ["tensor", "data"])
def test_a_reassigned_buffer_is_the_one_broadcast(how: str, check_every: str) -> None:
    """DEAR_CHECK_EVERY=1: every iteration re-walks the buffers; 0: none does, and the cheap
    comparison of the cached buffers with the modules' own must see the replacement. At every
    forward but the one right after the replacement, every rank holds rank 0's values, as a
    one-process reference computes them."""
    ranks = _reassigned_runs(how, check_every)
    want = _reassigned_reference(2)
    for rank, res in enumerate(ranks):
        for k in (0, 1, 3, 4):
            # Same math, gradients summed in another order: float32 rounding, relative to the
            # tensor's scale (1e-5 is ~80 ulps after 4 steps).
            assert rel_diff(res["seen"][k], want[k]) < 1e-5, (rank, k)
    # The old buffer's statistics (no replacement) are far from these: the comparison tells them
    # apart.
    old = _reassigned_reference(2, replace=False)
    assert min(rel_diff(want[k], old[k]) for k in (3, 4)) > 1e-2


@pytest.mark.parametrize("check_every", ["1", "0"])
@pytest.mark.parametrize("how", ["tensor", "data"])
def test_the_forward_after_a_replacement_reads_this_ranks_new_buffer(how: str,
                                                                     check_every: str) -> None:
    """docs/contract.md: a buffer this rank changed between step() and the next forward keeps
    its new value there (rank r wrote r everywhere)."""
    for rank, res in enumerate(_reassigned_runs(how, check_every)):
        assert torch.equal(res["seen"][2], torch.full((16,), float(rank))), rank
