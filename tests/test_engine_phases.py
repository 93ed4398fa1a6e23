"""The engine's phase (dear/engine/state.py's Phase) follows an iteration: learning before the
first layout, backward once a reduce-scatter is launched, reduced after clip_grad_norm_ (the
shards are averaged), pending from step() until the next forward has applied every bucket, idle
after; and dear's only attribute in the optimizer's __dict__ is its engine."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import dear
from tests.distributed import run_distributed
from tests.workloads import (
    assert_float32_close,
    batch,
    make_net,
    max_diff,
    reference,
    state_of,
)


def _phases() -> dict:
    dear.init()
    rank, world = dear.rank(), dear.size()
    model = make_net()
    plain_keys = set(torch.optim.SGD(make_net().parameters(), lr=0.1).__dict__)
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                    fusion_threshold=2048)
    engine = opt.dear_engine
    seen = {"start": engine.phase.value}
    for step in range(3):
        opt.zero_grad()
        x, y = batch(step, world, rank)
        loss = F.mse_loss(model(x), y)
        seen[f"forward {step}"] = engine.phase.value
        loss.backward()
        seen[f"backward {step}"] = engine.phase.value
        opt.clip_grad_norm_(10.0)
        seen[f"clip {step}"] = engine.phase.value
        opt.step()
        seen[f"step {step}"] = engine.phase.value
    opt.flush_updates()
    seen["flushed"] = engine.phase.value
    seen["added"] = sorted(set(opt.__dict__) - plain_keys)
    dear.shutdown()
    return seen


def test_phases_of_an_iteration() -> None:
    for seen in run_distributed(_phases, 2, timeout=120):
        assert seen["start"] == "learning"
        assert seen["forward 0"] == "learning" and seen["backward 0"] == "learning"
        for step in (1, 2):
            assert seen[f"forward {step}"] == "idle", seen     # every bucket applied
            assert seen[f"backward {step}"] == "backward", seen
            assert seen[f"clip {step}"] == "reduced", seen
        assert all(seen[f"step {s}"] == "pending" for s in range(3)), seen
        assert seen["flushed"] == "idle"
        assert seen["added"] == ["dear_engine"], seen["added"]


def _out_of_turn() -> dict:
    """Phase methods called where they cannot follow: each raises PhaseError naming both phases,
    before touching a bucket, and the iteration goes on as if nothing was called."""
    from dear.engine.state import PhaseError
    dear.init()
    rank, world = dear.rank(), dear.size()
    model = make_net()
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                    fusion_threshold=2048)
    engine = opt.dear_engine
    errors = {}
    for step in range(3):
        opt.zero_grad()
        x, y = batch(step, world, rank)
        F.mse_loss(model(x), y).backward()
        if step == 1:                          # a layout, a backward: not reduced yet
            try:
                engine.gather()                # step()'s all-gathers before the reduce
            except PhaseError as exc:
                errors["gather"] = (engine.phase.value, str(exc))
        opt.step()
        if step == 1:                          # pending: step()'s all-gathers are in flight
            try:
                engine.gather()
            except PhaseError as exc:
                errors["again"] = (engine.phase.value, str(exc))
    opt.flush_updates()
    out = {"errors": errors, "state": state_of(model)}
    dear.shutdown()
    return out


def test_a_phase_method_out_of_turn_raises_and_changes_nothing() -> None:
    results = run_distributed(_out_of_turn, 2, timeout=120)
    for r in results:
        phase, text = r["errors"]["gather"]
        assert phase == "backward"
        assert "step()'s all-gathers in phase 'backward'" in text and "'reduced'" in text
        phase, text = r["errors"]["again"]
        assert phase == "pending" and "step()'s all-gathers in phase 'pending'" in text
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    assert_float32_close(results[0]["state"], reference(sgd, 2, 3, dtype=torch.float64),
                         reference(sgd, 2, 3), what="after the refused calls")
    assert max_diff(results[0]["state"], results[1]["state"]) == 0


def _optimizer_calls(kind: str) -> dict:
    """Adam or SGD with momentum through dear on this world, buckets of 2 KB (several), four
    steps; how many times the wrapped optimizer's update ran in each iteration's forward."""
    dear.init()
    rank, world = dear.rank(), dear.size()
    model = make_net()
    inner = (torch.optim.Adam(model.parameters(), lr=0.01) if kind == "adam"
             else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    opt = dear.DistributedOptimizer(inner, model=model, fusion_threshold=2048)
    engine = opt.dear_engine
    calls = []
    step_of = engine.inner_step

    def counted(optimizer):
        calls[-1] += 1
        return step_of(optimizer)
    engine.inner_step = counted
    for step in range(4):
        calls.append(0)
        opt.zero_grad()
        x, y = batch(step, world, rank)
        F.mse_loss(model(x), y).backward()
        opt.step()
    calls.append(0)
    opt.flush_updates()
    out = {"calls": calls, "buckets": len(engine.buckets), "state": state_of(model),
           "plain": _plain(kind)}            # in this process: the same kernels and threads
    dear.shutdown()
    return out


def _plain(kind: str) -> dict:
    model = make_net()
    opt = (torch.optim.Adam(model.parameters(), lr=0.01) if kind == "adam"
           else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for step in range(4):
        opt.zero_grad()
        x, y = batch(step, 1)
        F.mse_loss(model(x), y).backward()
        opt.step()
    return state_of(model)


def test_a_world_of_one_updates_every_bucket_in_one_optimizer_call() -> None:
    """One rank: every all-gather is a local copy, so the next forward runs the optimizer once
    for all buckets (as torch's step() does), with torch's bits; two ranks: once a bucket."""
    for kind in ("adam", "sgd"):
        one = run_distributed(_optimizer_calls, 1, kind, timeout=120)[0]
        assert one["buckets"] >= 3, one["buckets"]
        assert one["calls"][1:] == [1, 1, 1, 1], one["calls"]     # steps 0-3 applied once each
        assert max_diff(one["state"], one["plain"]) == 0.0, kind
    two = run_distributed(_optimizer_calls, 2, "sgd", timeout=120)
    assert two[0]["calls"][2:] == [two[0]["buckets"]] * 3, two[0]["calls"]


def _alone(setting: str) -> dict:
    """Four SGD-momentum steps through dear at one rank in `setting`, beside plain torch."""
    from dear.fusion.fusion_config import FusionConfig
    dear.init()
    options: dict = {"fusion_threshold": 2048}
    if setting == "views":
        options["gradient_as_bucket_view"] = True
    elif setting == "predivide":
        options["gradient_predivide_factor"] = 4.0     # a power of two: exact in float32
    elif setting == "groups":                          # every bucket in one all-gather group
        options = {"fusion_config": FusionConfig(2048, 1 << 20)}
    model, plain = make_net(), make_net()
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    model=model, **options)
    ref = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        for net, o in ((model, opt), (plain, ref)):
            o.zero_grad()
            x, y = batch(step, 1)
            F.mse_loss(net(x), y).backward()
            o.step()
    opt.flush_updates()
    engine = opt.dear_engine
    out = {"diff": max_diff(state_of(model), state_of(plain)), "buckets": len(engine.buckets),
           "groups": len(engine.layout.gather_groups), "buffers": opt.memory_stats()["buffers"],
           "one_each": sum(b.buffer.numel() * b.buffer.element_size() for b in engine.buckets)}
    dear.shutdown()
    return out


def test_a_world_of_one_keeps_each_shard_in_its_bucket() -> None:
    """One rank (torch.distributed's backend takes a buffer into itself as done): the buckets
    hold one buffer each, no shard beside it, and training gives plain torch's bits with
    .grad as bucket views, a predivide factor, and all-gather groups of several buckets, on
    the C++ gradient hooks and on the Python ones."""
    for env in ({}, {"DEAR_NATIVE": "0"}):         # the default: C++ where it was built
        for setting in ("default", "views", "predivide", "groups"):
            out = run_distributed(_alone, 1, setting, timeout=120, env=env)[0]
            assert out["buckets"] >= 3, out
            assert out["diff"] == 0.0, (setting, env, out)
            assert out["buffers"] == out["one_each"], (setting, env, out)
            if setting == "groups":
                assert out["groups"] < out["buckets"], out
