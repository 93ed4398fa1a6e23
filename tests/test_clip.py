"""optimizer.clip_grad_norm_ (global norm from the reduced shards) against DDP followed by
torch.nn.utils.clip_grad_norm_ on the all-reduced gradient: 2 and 3 Gloo ranks (3 pads every
bucket), one bucket per parameter / several / one, norm types 2, 1 and inf, a branch that some
ranks skip (parameters without a gradient)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

import dear
from tests.distributed import run_distributed
from tests.workloads import batch, branch_used, make_net, max_diff, state_of

STEPS = 5
MAX_NORM = {2.0: 1.28, 1.0: 25.0, math.inf: 0.33}     # some steps clip, some do not
THRESHOLDS = {"per-param": 0, "several": 2048, "one": 1 << 30}
NORMS = (2.0, 1.0, math.inf)


def clip_loop(method: str, norm_type: float, threshold: int = 0) -> dict:
    rank, world = dear.rank(), dear.size()
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if method == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    else:
        net = model
        opt = dear.DistributedOptimizer(opt, model=model, fusion_threshold=threshold)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, world, rank)
        F.mse_loss(net(x, branch_used(step, rank)), y).backward()
        if method == "ddp":
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM[norm_type],
                                                  norm_type)
        else:
            norm = opt.clip_grad_norm_(MAX_NORM[norm_type], norm_type)
        norms.append(norm.item())
        opt.step()
    return {"params": state_of(model), "norms": norms}


def all_cases() -> dict:
    dear.init()
    out = {}
    for norm_type in NORMS:
        out[("ddp", norm_type)] = clip_loop("ddp", norm_type)
        for label, threshold in THRESHOLDS.items():
            out[(label, norm_type)] = clip_loop("dear", norm_type, threshold)
    dear.shutdown()
    return out


@functools.lru_cache(maxsize=None)
def results(world: int) -> list[dict]:
    return run_distributed(all_cases, world, timeout=150)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("layout", list(THRESHOLDS))
def test_equals_clipping_the_all_reduced_gradient(world: int, norm_type: float,
                                                  layout: str) -> None:
    ranks = results(world)
    for rank, res in enumerate(ranks):
        ddp = res[("ddp", norm_type)]
        ours = res[(layout, norm_type)]
        assert any(n > MAX_NORM[norm_type] for n in ddp["norms"]), "the reference never clipped"
        assert ours["norms"] == pytest.approx(ddp["norms"], rel=1e-5), f"rank {rank}: norms"
        # SGD does not magnify rounding (no division by gradient statistics): dear and DDP
        # differ only by float32 sums in another order and a clip coefficient a few ulps
        # apart, so the difference is bounded relative to the parameters' scale.
        scale = max(v.abs().max().item() for v in ddp["params"].values())
        assert max_diff(ours["params"], ddp["params"]) <= 1e-5 * scale, \
            f"rank {rank} differs from DDP"
        assert max_diff(ours["params"], ranks[0][(layout, norm_type)]["params"]) == 0.0


@pytest.fixture
def local_dear():
    dear.init(backend="local")
    yield
    dear.shutdown()


def _backward(model: torch.nn.Module, step: int = 0) -> None:
    x, y = batch(step, 1, 0)
    F.mse_loss(model(x), y).backward()


def test_after_synchronize_it_is_torchs_clip(local_dear) -> None:
    model, ref = make_net(), make_net()
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    _backward(model)
    _backward(ref)
    opt.synchronize()
    norm = opt.clip_grad_norm_(0.1)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    assert norm.item() == want.item()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_misuse_fails_clearly(local_dear) -> None:
    model = make_net()
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    with pytest.raises(ValueError, match="norm_type"):
        opt.clip_grad_norm_(1.0, norm_type=0)
    _backward(model)
    opt.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="after optimizer.clip_grad_norm_"):
        _backward(model)                       # a gradient the clip did not see
    model, opt = make_net(), None
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    x, y = batch(0, 1, 0)
    F.mse_loss(model(x), y * math.inf).backward()
    with pytest.raises(RuntimeError, match="non-finite"):
        opt.clip_grad_norm_(1.0, error_if_nonfinite=True)
