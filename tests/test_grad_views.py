"""gradient_as_bucket_view=True (dear/fusion/views.py): the same training as single-process
training on the global batch, .grad really in the bucket buffers (no copy), the averaged gradient
in .grad after the update, and edits after backward refused as without views."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import dear
from tests.distributed import run_distributed
from tests.test_optimizer import STEPS, loop_features
from tests.workloads import (OPTIMIZERS, assert_float32_close, batch, make_net, max_diff,
                             reference, state_of)

VIEWS = {"DEAR_GRADIENT_AS_BUCKET_VIEW": "1", "DEAR_PLAN_AFTER": "2"}


def _train(opt: str, steps: int, views: bool, schedule: str) -> tuple[dict, torch.nn.Module,
                                                                       torch.optim.Optimizer]:
    rank, world = dear.rank(), dear.size()
    model = make_net()
    optimizer = dear.DistributedOptimizer(OPTIMIZERS[opt](model.parameters()), model=model,
                                          fusion_threshold=2048, schedule=schedule,
                                          gradient_as_bucket_view=views)
    for step in range(steps):
        optimizer.zero_grad()
        x, y = batch(step, world, rank)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return state_of(model), model, optimizer


def _buffer_of(optimizer: torch.optim.Optimizer, p: torch.nn.Parameter) -> torch.Tensor:
    bucket, _ = optimizer.dear_layout.where[optimizer.dear_parameter_index[p]]      # type: ignore[attr-defined]
    return bucket.buffer


def views_checks() -> dict:
    dear.init()
    rank, world = dear.rank(), dear.size()
    out: dict = {}
    for opt in ("sgd", "adam"):
        for schedule in ("planned", "dear"):
            out[(opt, schedule, "copy")] = _train(opt, STEPS, False, schedule)[0]
            out[(opt, schedule, "views")] = _train(opt, STEPS, True, schedule)[0]

    # .grad is a view of the bucket buffer, the same memory in every iteration, and holds the
    # averaged gradient of the global batch once the update is applied.
    _, model, optimizer = _train("sgd", 3, True, "planned")
    params = list(model.parameters())
    before = {id(p): p.grad.data_ptr() for p in params}
    optimizer.zero_grad()
    x, y = batch(3, world, rank)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    F.mse_loss(model(x), y).backward()
    out["same_memory"] = all(p.grad.data_ptr() == before[id(p)] for p in params)
    out["in_buffer"] = all(
        _buffer_of(optimizer, p).data_ptr() <= p.grad.data_ptr()
        < _buffer_of(optimizer, p).data_ptr() + _buffer_of(optimizer, p).numel() * 4
        for p in params)
    optimizer.step()
    optimizer.flush_updates()
    out["averaged_grad"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    out["start"] = start

    # An edit after backward is refused at step(), in every iteration; training goes on.
    refused = 0
    for step in range(2):
        optimizer.zero_grad()
        x, y = batch(4 + step, world, rank)
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        try:
            optimizer.step()
        except RuntimeError as exc:
            refused += "changed after backward" in str(exc)
    out["refused"] = refused
    # zero_grad() between backward and step() is refused at once; step() then goes on.
    optimizer.zero_grad()
    x, y = batch(6, world, rank)
    F.mse_loss(model(x), y).backward()
    try:
        optimizer.zero_grad()
        out["zero_between"] = ""
    except RuntimeError as exc:
        out["zero_between"] = str(exc)
    optimizer.step()
    optimizer.flush_updates()
    out["after"] = state_of(model)
    dear.shutdown()
    return out


@functools.lru_cache(maxsize=None)
def checks(world: int) -> list[dict]:
    return run_distributed(views_checks, world, timeout=240, env={"DEAR_PLAN_AFTER": "2"})


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_views_train_like_one_process_and_like_copies(world: int, opt: str) -> None:
    ref, exact = (reference(opt, world, STEPS, dtype=d) for d in (torch.float32, torch.float64))
    for rank, res in enumerate(checks(world)):
        for schedule in ("planned", "dear"):
            views = res[(opt, schedule, "views")]
            assert_float32_close(views, exact, ref, what=f"views, {schedule}, rank {rank}")
            # The same collectives on the same numbers: bit for bit what copying gives.
            assert max_diff(views, res[(opt, schedule, "copy")]) == 0.0


@pytest.mark.parametrize("world", [1, 2, 3])
def test_grad_is_the_bucket_and_holds_the_average(world: int) -> None:
    for res in checks(world):
        assert res["same_memory"] and res["in_buffer"]
        model = make_net()
        model.load_state_dict(res["start"])
        losses = [F.mse_loss(model(batch(3, world, r)[0]), batch(3, world, r)[1])
                  for r in range(world)]
        torch.stack(losses).mean().backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(res["averaged_grad"][name], p.grad, rtol=1e-5,
                                       atol=1e-7)


@pytest.mark.parametrize("world", [2])
def test_edits_after_backward_are_refused(world: int) -> None:
    ranks = checks(world)
    for res in ranks:
        assert res["refused"] == 2
        assert "between backward and step()" in res["zero_between"]
    assert max_diff(ranks[0]["after"], ranks[1]["after"]) == 0.0


@functools.lru_cache(maxsize=None)
def view_features(world: int) -> list[dict]:
    return run_distributed(loop_features, world, timeout=240, env=VIEWS)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_loop_features_with_views(world: int) -> None:
    """Accumulation, a branch some ranks skip (zero_grad(set_to_none=True) leaves it out, as
    one process does), no model=, zero_grad(set_to_none=False) with a scheduler, checkpoints."""
    cases = {"accumulation": dict(), "branch": dict(branch=True),
             "scheduler_frozen": dict(frozen=True, scheduler=True)}
    for res in view_features(world):
        for key, kw in cases.items():
            ref, exact = (reference("sgd", world, STEPS, dtype=d, **kw)  # type: ignore[arg-type]
                          for d in (torch.float32, torch.float64))
            assert_float32_close(res[key], exact, ref, what=key)
        ref, exact = (reference("adam", world, STEPS, dtype=d)
                      for d in (torch.float32, torch.float64))
        assert_float32_close(res["named_only"], exact, ref, what="named_parameters only")
        assert_float32_close(res["resumed"], exact, ref, what="resumed")
