"""dear.KFAC under mixed precision: with the loss multiplied by a scale, G must come from the
unscaled output gradients (kfac-pytorch's grad_scaler=), so results equal the unscaled
reference of tests/kfac_workloads.py; with dear.DistributedOptimizer stepped through a
GradScaler the scale is picked up without grad_scaler= (the first step waits for
optimizer.step(); dear/kfac/scaling.py)."""

from __future__ import annotations

import pytest
import torch

import dear
from dear.kfac import KFAC
from tests import kfac_workloads as W

pytestmark = pytest.mark.filterwarnings("ignore:GradScaler is going to stop:FutureWarning")

ARGS = dict(lr=0.1, damping=0.003, factor_decay=0.9, kl_clip=0.001, inv_update_freq=2)
STEPS = 6
TOL = 1e-9          # float64 everywhere: the reference and dear differ by rounding only


def _scaler(growth_interval: int) -> torch.amp.GradScaler:
    # growth_interval=1 doubles the scale after every step: a changing scale
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=growth_interval)


def _torch_loop(name: str, scaler: torch.amp.GradScaler | None, **kfac) -> list[dict]:
    """kfac-pytorch's AMP loop on one process: scale, backward, unscale_, precond, step."""
    model = W.make_model(name)
    precond = KFAC(model, **{**ARGS, **kfac})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for step in range(STEPS):
        x, y = W.batch(name, step, 1)
        opt.zero_grad()
        loss = W.loss_fn(model(x), y)
        if scaler is None:
            loss.backward()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        precond.step()
        out.append(W.grads_of(model))
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
    return out


@pytest.mark.parametrize("name", ["mlp", "cnn"])
@pytest.mark.parametrize("growth_interval", [1000, 1])      # fixed scale, changing scale
def test_grad_scaler_gives_the_unscaled_result(name, growth_interval):
    want = W.reference_run(name, 1, STEPS, **ARGS)
    scaler = _scaler(growth_interval)
    got = _torch_loop(name, scaler, grad_scaler=scaler)
    assert scaler.get_scale() == 2.0 ** 12 * (2 ** STEPS if growth_interval == 1 else 1)
    for step, (g, w) in enumerate(zip(got, want)):
        assert W.max_rel_diff(g, w) < TOL, step
    # without grad_scaler= G is scale^2 too large: the issue this guards against
    wrong = _torch_loop(name, _scaler(growth_interval))
    assert W.max_rel_diff(wrong[-1], want[-1]) > 1e-3


def test_callable_scale_that_changes_every_step():
    """grad_scaler= may be a callable returning the current scale (not a power of two here)."""
    scales = [3.0, 7.5, 1000.0, 0.25, 12.0, 5.0]
    model = W.make_model("cnn")
    steps = {"n": 0}
    precond = KFAC(model, **ARGS, grad_scaler=lambda: scales[steps["n"]])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    want = W.reference_run("cnn", 1, STEPS, **ARGS)
    for step in range(STEPS):
        steps["n"] = step
        x, y = W.batch("cnn", step, 1)
        opt.zero_grad()
        (W.loss_fn(model(x), y) * scales[step]).backward()
        for p in model.parameters():
            p.grad /= scales[step]
        precond.step()
        assert W.max_rel_diff(W.grads_of(model), want[step]) < TOL, step
        opt.step()


def _dear_loop(growth_interval: int, explicit: bool, steps: int = STEPS) -> tuple[dict, KFAC]:
    """dear's plain loop: scaler.scale(loss).backward(); precond.step(); scaler.step(opt)."""
    dear.init(backend="local")
    try:
        model = W.make_model("mlp")
        opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                        model=model, fusion_threshold=0)
        scaler = _scaler(growth_interval)
        precond = KFAC(model, **ARGS, grad_scaler=scaler if explicit else None)
        for step in range(steps):
            x, y = W.batch("mlp", step, 1)
            opt.zero_grad()
            scaler.scale(W.loss_fn(model(x), y)).backward()
            precond.step()
            scaler.step(opt)
            scaler.update()
        opt.flush_updates()
        return W.params_of(model), precond
    finally:
        dear.shutdown()


@pytest.mark.parametrize("growth_interval", [1000, 1])
def test_dear_optimizer_picks_the_scale_up(growth_interval):
    """Without grad_scaler=: the same bits as with it (GradScaler's scales are powers of two),
    and the reference's parameters; steps that keep the decompositions run on the shards, where
    the KL clip divides by scale^2."""
    want = W.reference_params("mlp", 1, STEPS, **ARGS)
    auto, precond = _dear_loop(growth_interval, explicit=False)
    given, _ = _dear_loop(growth_interval, explicit=True)
    assert precond.overlapped_steps == STEPS // 2
    assert all(torch.equal(auto[k], given[k]) for k in auto)
    assert W.max_rel_diff({k: auto[k] - want[0][k] for k in auto},
                          {k: want[STEPS][k] - want[0][k] for k in auto}) < TOL


def test_first_step_waits_for_the_optimizer_and_says_so():
    dear.init(backend="local")
    try:
        model = W.make_model("mlp")
        opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                        model=model)
        precond = KFAC(model, **ARGS)
        x, y = W.batch("mlp", 0, 1)
        W.loss_fn(model(x), y).backward()
        precond.step()
        assert precond.steps == 0                # deferred to optimizer.step()
        with pytest.raises(RuntimeError, match="before optimizer.step"):
            precond.step()
        opt.step()
        assert precond.steps == 1
    finally:
        dear.shutdown()


def test_horovods_loop_with_a_scaler_needs_grad_scaler():
    """synchronize() before precond.step(): the first step cannot wait, so a GradScaler that
    turns up at optimizer.step() is an error (the update is not applied), never a silent one."""
    dear.init(backend="local")
    try:
        model = W.make_model("mlp")
        opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                        model=model)
        precond = KFAC(model, **ARGS)
        scaler = _scaler(1000)
        before = W.params_of(model)
        x, y = W.batch("mlp", 0, 1)
        scaler.scale(W.loss_fn(model(x), y)).backward()
        opt.synchronize()
        precond.step()
        with pytest.raises(RuntimeError, match="Pass grad_scaler=scaler"):
            with opt.skip_synchronize():
                scaler.step(opt)
        opt.flush_updates()
        after = W.params_of(model)
        assert all(torch.equal(before[k], after[k]) for k in before)
    finally:
        dear.shutdown()


def _rank_dear_amp(strategy: str) -> tuple[dict, int]:
    dear.init()
    try:
        world, rank = dear.size(), dear.rank()
        model = W.make_model("mlp")
        opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                        model=model)
        scaler = _scaler(1)
        precond = KFAC(model, strategy=strategy, **ARGS)
        for step in range(STEPS):
            x, y = W.batch("mlp", step, world, rank)
            opt.zero_grad()
            scaler.scale(W.loss_fn(model(x), y)).backward()
            precond.step()
            scaler.step(opt)
            scaler.update()
        opt.flush_updates()
        return W.params_of(model), precond.overlapped_steps
    finally:
        dear.shutdown()


@pytest.mark.parametrize("strategy", ["comm-opt", "pad"])
def test_two_ranks_pick_the_scale_up(strategy):
    """comm-opt: the eigenbasis path on shards (KL sums gathered across ranks); pad: owners
    precondition .grad after synchronize(); both with a scale that doubles every step."""
    from tests.distributed import run_distributed
    results = run_distributed(_rank_dear_amp, 2, strategy, timeout=180)
    want = W.reference_params("mlp", 2, STEPS, **ARGS)
    for params, overlapped in results:
        assert overlapped == (STEPS // 2 if strategy == "comm-opt" else 0)
        assert W.max_rel_diff({k: params[k] - want[0][k] for k in params},
                              {k: want[STEPS][k] - want[0][k] for k in params}) < TOL
    assert all(torch.equal(results[0][0][k], results[1][0][k]) for k in results[0][0])


def test_horovods_loop_with_grad_scaler_matches_the_reference():
    """synchronize(); precond.step(); skip_synchronize(): scaler.step(opt): .grad is averaged
    but still scaled when K-FAC runs (the optimizer unscales it afterwards)."""
    want = W.reference_params("mlp", 1, STEPS, **ARGS)
    dear.init(backend="local")
    try:
        model = W.make_model("mlp")
        opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                        model=model)
        scaler = _scaler(1)
        precond = KFAC(model, **ARGS, grad_scaler=scaler)
        for step in range(STEPS):
            x, y = W.batch("mlp", step, 1)
            opt.zero_grad()
            scaler.scale(W.loss_fn(model(x), y)).backward()
            opt.synchronize()
            precond.step()
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
        opt.flush_updates()
        got = W.params_of(model)
        assert W.max_rel_diff({k: got[k] - want[0][k] for k in got},
                              {k: want[STEPS][k] - want[0][k] for k in got}) < TOL
    finally:
        dear.shutdown()
