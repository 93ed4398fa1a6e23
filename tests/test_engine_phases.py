"""The engine's phase (dear/engine/state.py's Phase) follows an iteration: learning before the
first layout, backward once a reduce-scatter is launched, reduced after clip_grad_norm_ (the
shards are averaged), pending from step() until the next forward has applied every bucket, idle
after; and dear's only attribute in the optimizer's __dict__ is its engine."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import dear
from tests.distributed import run_distributed
from tests.workloads import batch, make_net


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
