"""Wrapping twice (issue 16, item 6): dear over dear, dear over hvd.DistributedOptimizer and hvd
over dear fail at wrap time with an error saying what to do; a DDP model under dear's optimizer
(which would communicate every gradient twice) draws a warning."""

from __future__ import annotations

import warnings

import pytest
import torch

import dear
from tests.distributed import run_distributed


@pytest.fixture
def local_dear():
    dear.init(backend="local")
    yield
    dear.shutdown()


def test_dear_over_dear_is_refused_clearly(local_dear) -> None:
    model = torch.nn.Linear(3, 2)
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    with pytest.raises(TypeError, match="already a dear.DistributedOptimizer; wrap the plain"):
        dear.DistributedOptimizer(opt, model=model)
    with pytest.raises(TypeError, match="must not be wrapped again"):
        type(opt)(model.parameters(), lr=0.1)


def _with_horovod() -> dict:
    """One Horovod process (hvd.init() without a launcher is a world of one)."""
    import horovod.torch as hvd
    hvd.init()
    out = {}
    model = torch.nn.Linear(3, 2)
    hvd_opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters())
    try:
        dear.DistributedOptimizer(hvd_opt, model=model)
    except Exception as exc:                  # today: RecursionError
        out["dear_over_hvd"] = (type(exc).__name__, str(exc))
    dear_opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         model=model)
    try:
        hvd.DistributedOptimizer(dear_opt, model.named_parameters())
    except Exception as exc:                  # today: AttributeError
        out["hvd_over_dear"] = (type(exc).__name__, str(exc))
    # dear's optimizer still trains after the refused wrap.
    dear_opt.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    dear_opt.step()
    dear_opt.synchronize()
    out["trained"] = torch.isfinite(model.weight).all().item()
    dear.shutdown()
    hvd.shutdown()
    return out


def test_horovod_over_dear_and_dear_over_horovod_are_refused_clearly() -> None:
    out = run_distributed(_with_horovod, 1, timeout=120)[0]
    kind, text = out["dear_over_hvd"]
    assert kind == "TypeError" and "already a hvd.DistributedOptimizer" in text
    assert "INSTEAD of hvd.DistributedOptimizer" in text
    kind, text = out["hvd_over_dear"]
    assert kind == "TypeError" and "must not be wrapped again" in text
    assert "hvd.DistributedOptimizer" in text
    assert out["trained"]


def _ddp_warnings() -> dict:
    dear.init()
    out = {}
    for case in ("ddp-model", "ddp-params", "inner-module", "plain"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        ddp = torch.nn.parallel.DistributedDataParallel(model) if case != "plain" else None
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if case == "ddp-model":
                dear.DistributedOptimizer(opt, model=ddp)
            elif case == "ddp-params":
                dear.DistributedOptimizer(opt, named_parameters=ddp.named_parameters())
            else:
                dear.DistributedOptimizer(opt, model=model)
        out[case] = [str(w.message) for w in caught if "communicated twice" in str(w.message)]
        del ddp
    dear.shutdown()
    return out


def test_ddp_model_under_dear_warns_that_it_communicates_twice() -> None:
    for out in run_distributed(_ddp_warnings, 2, timeout=120):
        for case in ("ddp-model", "ddp-params", "inner-module"):
            assert len(out[case]) == 1, (case, out[case])
            assert "ddp.module" in out[case][0]
        assert out["plain"] == []
