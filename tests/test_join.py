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

# The planned schedule (dear/fusion/schedule.py) from the 3rd step, so these runs cover it.
PLANNED = {"DEAR_PLAN_AFTER": "2"}

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
    return run_distributed(_ranks, world, BATCHES[world], timeout=240, env=PLANNED)


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


SPARSE_BATCHES = [2, 4]


def _sparse_reference(dtype: torch.dtype) -> dict:
    """One process: in step t the ranks that still have a batch, each loss divided by the world
    size (a joined rank contributes zero, the average still divides by the world)."""
    from tests.test_sparse import data, make, optimizers
    world = len(SPARSE_BATCHES)
    model = make(dtype)
    opts = optimizers(model, "sparse_adam")
    for step in range(max(SPARSE_BATCHES)):
        for o in opts:
            o.zero_grad()
        active = [r for r in range(world) if step < SPARSE_BATCHES[r]]
        sum(F.mse_loss(model(x), y) for x, y in (data(step, r, dtype) for r in active)) \
            .div(world).backward()
        for o in opts:
            o.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _sparse_ranks() -> dict:
    from tests.test_sparse import data, make, optimizers
    dear.init()
    model = make()
    sparse_opt, dense_opt = optimizers(model, "sparse_adam")
    opts = [dear.DistributedOptimizer(sparse_opt, [("emb.weight", model.emb.weight)]),
            dear.DistributedOptimizer(dense_opt, model=model)]
    with dear.join(opts, model):
        for step in range(SPARSE_BATCHES[dear.rank()]):
            for o in opts:
                o.zero_grad()
            x, y = data(step, dear.rank())
            F.mse_loss(model(x), y).backward()
            for o in opts:
                o.step()
    out = state_of(model)
    dear.shutdown()
    return out


def test_two_optimizers_and_sparse_gradients_under_join() -> None:
    from tests.workloads import assert_float32_close
    ref, exact = _sparse_reference(torch.float32), _sparse_reference(torch.float64)
    ranks = run_distributed(_sparse_ranks, len(SPARSE_BATCHES), timeout=120, env=PLANNED)
    for rank, res in enumerate(ranks):
        assert max_diff(res, ranks[0]) == 0.0
        assert_float32_close(res, exact, ref, what=f"rank {rank}")


def test_join_on_horovod(tmp_path) -> None:
    """hvd.join()'s use case on dear's Horovod backend: the same uneven run under horovodrun's
    environment (dear.init() picks Horovod)."""
    from tests.horovod_launch import run_horovod
    from tests.workloads import assert_float32_close
    script = tmp_path / "join.py"
    script.write_text("import os, torch\nfrom tests.test_join import _sparse_ranks\n"
                      "out = _sparse_ranks()\n"
                      f"torch.save(out, {str(tmp_path)!r} + '/' + os.environ['HOROVOD_RANK'] "
                      "+ '.pt')\n")
    run_horovod([str(script)], np=len(SPARSE_BATCHES), timeout=120)
    ref, exact = _sparse_reference(torch.float32), _sparse_reference(torch.float64)
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(len(SPARSE_BATCHES))]
    for rank, res in enumerate(ranks):
        assert max_diff(res, ranks[0]) == 0.0
        assert_float32_close(res, exact, ref, what=f"rank {rank}")


def _scaler_in_join() -> None:
    dear.init()
    model = make_net()
    opt = dear.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()), model=model)
    scaler = torch.amp.GradScaler("cpu")
    with dear.join(opt):
        x, y = batch(0, dear.size(), dear.rank())
        scaler.scale(F.mse_loss(model(x), y)).backward()
        scaler.step(opt)


def test_what_join_cannot_shadow_is_refused_on_every_rank() -> None:
    outcomes = run_distributed(_scaler_in_join, 2, timeout=60, expect_failure=True)
    for text in outcomes:                      # both ranks, at the same step: no hang
        assert isinstance(text, str) and "GradScaler inside dear.join() is not supported" in text
    dear.init(backend="local")
    try:
        plain = torch.nn.Linear(2, 2)
        opt = dear.DistributedOptimizer(torch.optim.SGD(plain.parameters(), lr=0.1),
                                        plain.named_parameters())
        with pytest.raises(ValueError, match="needs the model"):
            dear.join(opt)
        with pytest.raises(TypeError, match="dear.DistributedOptimizer"):
            dear.join(torch.optim.SGD(plain.parameters(), lr=0.1), plain)
    finally:
        dear.shutdown()
