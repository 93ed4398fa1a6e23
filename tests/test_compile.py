"""torch.compile with dear.DistributedOptimizer (issue 16, item 5).

dear's forward pre-hooks wait for all-gathers and run the wrapped optimizer's update, which dynamo
cannot trace: they run eagerly (torch.compiler.disable) and the compiled graph breaks around
them. The model trains as DDP + torch.compile does, to rounding, and the all-gathers still
overlap the forward pass: after step() buckets are in flight, the forward applies them.

The suite compiles with backend="aot_eager" (dynamo + AOTAutograd: the parts that meet dear's
hooks); inductor only changes the generated kernels and takes minutes to compile on 2 cores.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dear
from dear.fusion.bucket import Stage
from tests.distributed import run_distributed
from tests.workloads import OPTIMIZERS, batch, make_net, max_diff, state_of

STEPS = 4


def _train(mode: str) -> dict:
    rank, world = dear.rank(), dear.size()
    # dynamo does not guard on module hooks (skip_nnmodule_hook_guards): a code object compiled
    # for another run of Net would be reused without dear's hooks. A user compiles once.
    torch._dynamo.reset()
    model = make_net()
    compiled = torch.compile(model, backend="aot_eager")
    if mode == "ddp":
        net = torch.compile(torch.nn.parallel.DistributedDataParallel(model),
                            backend="aot_eager")
        opt = OPTIMIZERS["adam"](model.parameters())
    else:
        net = compiled
        hooked = compiled if mode == "dear-compiled" else model   # the uncompiled module too
        opt = dear.DistributedOptimizer(OPTIMIZERS["adam"](model.parameters()), model=hooked,
                                        fusion_threshold=2048)
    in_flight = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, world, rank)
        F.mse_loss(net(x), y).backward()
        opt.step()
        if mode != "ddp":
            in_flight.append(sum(b.stage is Stage.GATHERING for b in opt._buckets))
    if mode != "ddp":
        opt.flush_updates()
    return {"params": state_of(model), "in_flight": in_flight,
            "buckets": 0 if mode == "ddp" else len(opt._buckets)}


def _all_modes() -> dict:
    dear.init()
    out = {mode: _train(mode) for mode in ("ddp", "dear-compiled", "dear-module")}
    dear.shutdown()
    return out


@pytest.mark.parametrize("world", [2])
def test_compiled_model_trains_as_ddp_with_compile(world: int) -> None:
    ranks = run_distributed(_all_modes, world, timeout=400)
    for res in ranks:
        ref = res["ddp"]["params"]
        scale = max(v.abs().max().item() for v in ref.values())
        for mode in ("dear-compiled", "dear-module"):
            # Same math, same order of summation in the reduction (rank order): the difference
            # is the rounding of the compiled kernels, relative to the parameters' size.
            assert max_diff(res[mode]["params"], ref) <= 1e-6 * scale, mode
            # the all-gathers overlap the next forward: buckets are in flight after step()
            assert res[mode]["buckets"] > 1
            assert all(n == res[mode]["buckets"] for n in res[mode]["in_flight"][1:]), mode
    assert max_diff(ranks[0]["dear-compiled"]["params"], ranks[1]["dear-compiled"]["params"]) == 0
