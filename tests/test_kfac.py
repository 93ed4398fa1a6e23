"""dear.KFAC on one process: against the reference computed from the definitions
(tests/kfac_workloads.py), hyperparameter callables, checkpoints, and bad input."""

from __future__ import annotations

import io
import logging
import math

import pytest
import torch
from torch import nn

import dear
from dear.kfac import KFAC, ComputeMethod, Strategy
from tests import kfac_workloads as W

KFAC_ARGS = dict(lr=0.1, damping=0.003, factor_decay=0.9, kl_clip=0.001,
                 factor_update_freq=1, inv_update_freq=2)


def run_kfac(name: str, steps: int, eval_forward: bool = False, **kfac):
    model = W.make_model(name)
    precond = KFAC(model, **kfac)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for step in range(steps):
        x, y = W.batch(name, step, 1)
        opt.zero_grad()
        W.loss_fn(model(x), y).backward()
        if eval_forward:              # must not record factors
            model.eval()
            model(x)
            model.train()
            with torch.no_grad():
                model(x)
        precond.step()
        out.append(W.grads_of(model))
        opt.step()
    return out, precond


@pytest.mark.parametrize("name", ["mlp", "cnn", "embed"])
@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("kl_clip", [0.001, None])
def test_matches_the_definitions(name, method, kl_clip):
    args = {**KFAC_ARGS, "kl_clip": kl_clip, "method": method}
    got, _ = run_kfac(name, 5, eval_forward=(name == "cnn"), **args)
    want = W.reference_run(name, 1, 5, **args)
    for step, (g, w) in enumerate(zip(got, want)):
        assert W.max_rel_diff(g, w) < 1e-9, f"step {step}"


def test_kl_clip_is_active_in_the_clipped_test():
    """The clipped variant above must actually clip (nu < 1) and the other must not."""
    model = W.make_model("mlp")
    ref = W.ReferenceKFAC(model, **KFAC_ARGS)
    ref.backward_on_shards([W.batch("mlp", 0, 1)])
    ref.step()
    assert ref.last_nu < 0.5
    grads_clipped, _ = run_kfac("mlp", 1, **KFAC_ARGS)
    grads_free, _ = run_kfac("mlp", 1, **{**KFAC_ARGS, "kl_clip": None})
    ratio = grads_clipped[0]["fc1.weight"] / grads_free[0]["fc1.weight"]
    assert torch.allclose(ratio, torch.full_like(ratio, ref.last_nu), rtol=1e-9)


def test_hyperparameter_callables_are_honoured():
    sched = dict(lr=lambda s: 0.1 / (1 + s), damping=lambda s: 0.01 if s < 3 else 0.002,
                 factor_decay=lambda s: 0.5 if s == 0 else 0.9, kl_clip=lambda s: 0.001 * (s + 1),
                 factor_update_freq=lambda s: 1 if s < 3 else 2,
                 inv_update_freq=lambda s: 2 if s < 4 else 3)
    got, precond = run_kfac("cnn", 7, **sched)
    want = W.reference_run("cnn", 1, 7, **sched)
    for step, (g, w) in enumerate(zip(got, want)):
        assert W.max_rel_diff(g, w) < 1e-9, f"step {step}"
    # and they differ from the constant run, so the callables mattered
    const, _ = run_kfac("cnn", 7, **KFAC_ARGS)
    assert W.max_rel_diff(const[-1], got[-1]) > 1e-3
    precond.damping = 0.004                 # plain values can be changed between steps
    assert precond.hyperparameters().damping == 0.004


def _train(model, opt, precond, steps, start):
    out = []
    for step in range(start, start + steps):
        x, y = W.batch("cnn", step, 1)
        opt.zero_grad()
        W.loss_fn(model(x), y).backward()
        precond.step()
        out.append(W.grads_of(model))
        opt.step()
    return out


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_state_dict_round_trip_resumes_identically(method):
    args = {**KFAC_ARGS, "inv_update_freq": 3, "method": method}
    model = W.make_model("cnn")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    precond = KFAC(model, **args)
    _train(model, opt, precond, 4, 0)          # stop in the middle of an inverse interval
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "kfac": precond.state_dict()}, buf)
    straight = _train(model, opt, precond, 5, 4)

    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    model2 = W.make_model("cnn")
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(1.0)                        # make sure the load matters
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.05, momentum=0.9)
    precond2 = KFAC(model2, **args)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    precond2.load_state_dict(saved["kfac"])
    assert precond2.steps == 4
    resumed = _train(model2, opt2, precond2, 5, 4)
    for a, b in zip(straight, resumed):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_state_dict_without_factors_restores_the_step_and_restarts_factors():
    model = W.make_model("mlp")
    precond = KFAC(model, **KFAC_ARGS)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):
        x, y = W.batch("mlp", step, 1)
        opt.zero_grad()
        W.loss_fn(model(x), y).backward()
        precond.step()
        opt.step()
    state = precond.state_dict(include_factors=False)
    assert "layers" not in state
    model2 = W.make_model("mlp")
    fresh = KFAC(model2, **KFAC_ARGS)
    fresh.load_state_dict(state)
    assert fresh.steps == 3
    x, y = W.batch("mlp", 3, 1)
    W.loss_fn(model2(x), y).backward()
    fresh.step()                              # step 3 is not an inverse step: decomposes anyway
    assert fresh.layers[0].a_dec is not None and fresh.steps == 4
    assert torch.isfinite(model2.fc1.weight.grad).all()
    with pytest.raises(ValueError, match="lacks"):
        fresh.load_state_dict({"steps": 1, "layers": {"nope": {}}})


def test_unsupported_layers_are_listed_once(caplog):
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Conv2d(6, 6, 1, groups=2),
                          nn.Embedding(5, 3, sparse=True), nn.Linear(6, 2))
    model[2].register_forward_pre_hook(lambda m, a: None)
    with caplog.at_level(logging.INFO, logger="dear"):
        precond = KFAC(model, lr=0.1)
        lin = nn.Sequential(model[0], model[1], model[4])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            lin(torch.randn(8, 4)).sum().backward()
            precond.step()
            opt.step()
    lines = [r.getMessage() for r in caplog.records if "left to the optimizer" in r.getMessage()]
    assert len(lines) == 1
    for text in ("1 (LayerNorm)", "2 (Conv2d: groups=2", "3 (Embedding: sparse=True"):
        assert text in lines[0]
    assert [s.name for s in precond.layers] == ["0", "4"]


def test_skip_layers_by_name_class_and_type():
    model = W.make_model("cnn")
    assert [s.name for s in KFAC(model, skip_layers=["conv1"]).layers] == ["conv2", "fc"]
    assert [s.name for s in KFAC(model, skip_layers=["Linear"]).layers] == ["conv1", "conv2"]
    # kfac-pytorch's rule: case-sensitive re.search (tests/test_kfac_compat.py)
    assert [s.name for s in KFAC(model, skip_layers=["linear"]).layers] == ["conv1", "conv2",
                                                                             "fc"]
    assert [s.name for s in KFAC(model, skip_layers=[nn.Conv2d]).layers] == ["fc"]
    with pytest.raises(TypeError, match="skip_layers"):
        KFAC(model, skip_layers=[3])


def test_enums_and_strings():
    model = W.make_model("mlp")
    assert KFAC(model, method=ComputeMethod.INVERSE).method is ComputeMethod.INVERSE
    assert KFAC(model, strategy="COMM_OPT").strategy is Strategy.COMM_OPT
    with pytest.raises(ValueError, match="strategy must be one of"):
        KFAC(model, strategy="fast")
    with pytest.raises(ValueError, match="method must be one of"):
        KFAC(model, method="cholesky")


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="no layer K-FAC can precondition.*LayerNorm"):
        KFAC(nn.Sequential(nn.LayerNorm(4), nn.ReLU()))
    frozen = nn.Linear(3, 3).requires_grad_(False)
    with pytest.raises(ValueError, match="frozen weight"):
        KFAC(frozen)
    model = W.make_model("mlp")
    for bad in (0.0, -1e-3, float("nan")):
        with pytest.raises(ValueError, match="damping must be"):
            KFAC(model, damping=bad)
    with pytest.raises(ValueError, match="factor_decay must be in"):
        KFAC(model, factor_decay=1.5)          # [0, 1]: 1 allowed, as kfac-pytorch
    with pytest.raises(ValueError, match="inv_update_freq must be an integer"):
        KFAC(model, inv_update_freq=0)
    precond = KFAC(model, damping=lambda s: 0.0)
    W.loss_fn(model(W.batch("mlp", 0, 1)[0]), W.batch("mlp", 0, 1)[1]).backward()
    with pytest.raises(ValueError, match="damping must be > 0.*returned by its callable at step 0"):
        precond.step()
    with pytest.raises(ValueError, match="damping must be"):
        precond.damping = -1.0


def test_non_finite_factor_is_skipped_and_parameters_stay_finite(caplog):
    """float32: a loss scaled by 1e20 (an fp16-style loss-scale overflow) gives finite gradients
    but G = g^T g overflows; the batch factor is skipped, the running factors stay finite, and
    the KL clip (computed in float64) keeps the update small."""
    model = W.make_model("mlp", torch.float32)
    precond = KFAC(model, **KFAC_ARGS)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with caplog.at_level(logging.WARNING, logger="dear"):
        for step in range(4):
            x, y = W.batch("mlp", step, 1, dtype=torch.float32)
            opt.zero_grad()
            loss = W.loss_fn(model(x), y) * (1e20 if step == 1 else 1.0)
            loss.backward()
            if step == 1:
                assert all(torch.isfinite(p.grad).all() for p in model.parameters())
            precond.step()
            opt.step()
    assert any("non-finite" in r.getMessage() for r in caplog.records)
    for s in precond.layers:
        assert torch.isfinite(s.a).all() and torch.isfinite(s.g).all()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # the preconditioned layers moved little (the LayerNorm, left to SGD, took the 1e20 step)
    assert all(model.get_parameter(f"{s.name}.weight").abs().max() < 10 for s in precond.layers)


def test_failed_decomposition_keeps_the_previous_one(caplog):
    model = W.make_model("mlp")
    precond = KFAC(model, **{**KFAC_ARGS, "inv_update_freq": 1})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with caplog.at_level(logging.WARNING, logger="dear"):
        for step in range(3):
            x, y = W.batch("mlp", step, 1)
            opt.zero_grad()
            W.loss_fn(model(x), y).backward()
            if step == 2:                      # a running factor gone bad (e.g. a bug upstream)
                precond.layers[0].g = torch.full_like(precond.layers[0].g, math.nan)
                previous = precond.layers[0].g_dec
            precond.step()
            opt.step()
    assert precond.layers[0].g_dec is previous
    assert any("keeping the previous decomposition" in r.getMessage() for r in caplog.records)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("reload_at", [None, 3])
def test_dear_optimizer_plain_loop_matches_the_reference(reload_at):
    """backward(); precond.step(); optimizer.step() on dear's one-rank backend: steps that keep
    the decompositions precondition in the eigenbasis on the reduced shards (dear/kfac/
    overlap.py); a load_state_dict() between steps drops the armed bases (that step synchronizes).
    """
    args = {**KFAC_ARGS, "inv_update_freq": 2}
    want = W.reference_params("mlp", 1, 5, **args)
    dear.init(backend="local")
    try:
        model = W.make_model("mlp")
        opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                        model=model, fusion_threshold=0)
        precond = KFAC(model, **args)
        for step in range(5):
            if step == reload_at:
                precond.load_state_dict(precond.state_dict())
            x, y = W.batch("mlp", step, 1)
            opt.zero_grad()
            W.loss_fn(model(x), y).backward()
            precond.step()
            opt.step()
        opt.flush_updates()
        assert precond.overlapped_steps == (2 if reload_at is None else 1)
        got = W.params_of(model)
        assert W.max_rel_diff({k: got[k] - want[0][k] for k in got},
                              {k: want[5][k] - want[0][k] for k in got}) < 1e-9
    finally:
        dear.shutdown()


def test_kfac_joining_dear_training_late_replans_and_matches_horovods_loop():
    """DeAR trains two steps with a bucket per parameter (a layer's weight and bias apart), then
    dear.KFAC joins: its first step synchronizes and the buckets are re-planned with each layer
    in one bucket, after which steps overlap. Compared with the same run in Horovod's loop
    (synchronize(); precond.step(); step() in skip_synchronize()), checked against the
    reference elsewhere."""
    def run(plain: bool) -> tuple[dict, int, bool]:
        dear.init(backend="local")
        try:
            model = W.make_model("cnn")
            opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                            model=model, fusion_threshold=0)
            precond = None
            for step in range(7):
                if step == 2:
                    precond = KFAC(model, **{**KFAC_ARGS, "inv_update_freq": 3})
                x, y = W.batch("cnn", step, 1)
                opt.zero_grad()
                W.loss_fn(model(x), y).backward()
                if precond is None:
                    opt.step()
                elif plain:
                    precond.step()
                    opt.step()
                else:
                    opt.synchronize()
                    precond.step()
                    with opt.skip_synchronize():
                        opt.step()
            opt.flush_updates()
            conv = model.conv1
            where, index = opt.dear_layout.where, opt.dear_parameter_index
            together = where[index[conv.weight]][0] is where[index[conv.bias]][0]
            return W.params_of(model), precond.overlapped_steps, together
        finally:
            dear.shutdown()

    got, overlapped, together = run(plain=True)
    want, none, _ = run(plain=False)
    assert together and overlapped == 3 and none == 0     # K-FAC steps 1, 2 and 4 of 0..4
    assert W.max_rel_diff(got, want) < 1e-10
