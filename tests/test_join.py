"""dear.join() (issue 16, item 10): ranks with different numbers of batches finish without
hanging, and end where DDP + torch's Join ends: every rank holding the last joiner's parameters.
Every run has the hard timeout of tests/distributed.py."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import dear
from tests.distributed import run_distributed
from tests.workloads import OPTIMIZERS, batch, make_net, max_diff, state_of

BATCHES = {2: [3, 5], 3: [4, 0, 6]}          # per rank; rank 1 of 3 has no batch at all


def _loop(model, opt, net, n: int, clip: bool = False) -> None:
    rank, world = dear.rank(), dear.size()
    for step in range(n):
        opt.zero_grad()
        x, y = batch(step, world, rank)
        F.mse_loss(net(x), y).backward()
        if clip:
            opt.clip_grad_norm_(0.5)
        opt.step()


def _ranks(batches: list[int]) -> dict:
    from torch.distributed.algorithms.join import Join
    dear.init()
    n = batches[dear.rank()]
    out = {}
    model = make_net()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = OPTIMIZERS["sgd"](ddp.parameters())
    with Join([ddp]):
        _loop(model, opt, ddp, n)
    out["ddp"] = state_of(model)
    for label, clip in (("dear", False), ("dear-clip", True)):
        model = make_net()
        opt = dear.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()), model=model,
                                        fusion_threshold=2048)
        with dear.join(opt):                # with clipping every rank needs a batch
            _loop(model, opt, model, max(n, 1) if clip else n, clip)
        out[label] = state_of(model)
        out[label + "-momentum"] = [opt.state[p]["momentum_buffer"].clone()
                                    for p in model.parameters() if p in opt.state]
    # Equal numbers of batches: dear.join() changes nothing.
    model = make_net()
    opt = dear.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()), model=model,
                                    fusion_threshold=2048)
    with dear.join(opt):
        _loop(model, opt, model, 3)
    out["even"] = state_of(model)
    model = make_net()
    opt = dear.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()), model=model,
                                    fusion_threshold=2048)
    _loop(model, opt, model, 3)
    opt.flush_updates()
    out["even-no-join"] = state_of(model)
    if len(batches) == 2:                      # BatchNorm: buffers from the highest active rank
        from tests.test_buffers import BNNet, _data
        for kind in ("ddp-bn", "dear-bn"):
            torch.manual_seed(0)
            model = BNNet()
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            net = torch.nn.parallel.DistributedDataParallel(model) if kind == "ddp-bn" else model
            if kind == "dear-bn":
                opt = dear.DistributedOptimizer(opt, model=model, fusion_threshold=1024)
            with (Join([net]) if kind == "ddp-bn" else dear.join(opt)):
                for step in range(n):
                    opt.zero_grad()
                    x, y = _data(step, dear.rank())
                    F.mse_loss(net(x), y).backward()
                    opt.step()
            out[kind] = state_of(model)
    dear.shutdown()
    return out


@functools.lru_cache(maxsize=None)
def results(world: int) -> list[dict]:
    return run_distributed(_ranks, world, BATCHES[world], timeout=240)


def rel(a: dict, b: dict) -> float:
    return max_diff(a, b) / max(v.abs().max().item() for v in b.values())


@pytest.mark.parametrize("world", [2, 3])
def test_uneven_inputs_end_where_ddp_join_ends(world: int) -> None:
    ranks = results(world)
    for rank, res in enumerate(ranks):
        # Every rank holds the same parameters (the last joiner's), as with DDP + Join.
        assert max_diff(res["dear"], ranks[0]["dear"]) == 0.0
        assert max_diff(res["ddp"], ranks[0]["ddp"]) == 0.0
        # Same math as DDP + Join (zeros from joined ranks, divided by the world size), only
        # summed in another order: float32 rounding relative to the parameters' scale.
        assert rel(res["dear"], res["ddp"]) < 1e-5, rank
        # Unlike DDP's joined ranks, dear's applied every update: optimizer state is equal too.
        for a, b in zip(res["dear-momentum"], ranks[-1]["dear-momentum"]):
            assert torch.equal(a, b)
        assert max_diff(res["dear-clip"], ranks[0]["dear-clip"]) == 0.0
        assert torch.equal(res["even"]["fc1.weight"], res["even-no-join"]["fc1.weight"])
    if world == 2:
        for res in ranks:                      # the highest rank is active throughout here
            assert max_diff(res["dear-bn"], ranks[0]["dear-bn"]) == 0.0
            for name, value in res["ddp-bn"].items():
                if value.is_floating_point():
                    scale = value.abs().max().item()
                    assert (res["dear-bn"][name] - value).abs().max() <= 1e-5 * scale, name
                else:
                    assert torch.equal(res["dear-bn"][name], value), name
    # The uneven loop really trained beyond the shortest rank's batches.
    assert max_diff(ranks[0]["dear"], make_net().state_dict()) > 0
