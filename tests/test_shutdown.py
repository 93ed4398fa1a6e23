"""dear.shutdown() leaves no process group for the interpreter's teardown.

A ProcessGroupGloo still referenced at interpreter exit is destroyed during finalization, which
aborted processes now and then ("terminate called without an active exception" after all output,
in make demo and test_mpi runs). After dear.shutdown() no torch ProcessGroup object may remain,
even while the user still holds the model and the wrapped optimizer (whose hooks form cycles).
"""

from __future__ import annotations

import gc
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dear
from tests.distributed import run_distributed
from tests.workloads import batch, make_net

KEPT: list = []


def _run(schedule: str) -> dict:
    dear.init()
    rank, world = dear.rank(), dear.size()
    model = make_net()
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                    fusion_threshold=1024, schedule=schedule)
    for step in range(6):
        opt.zero_grad()
        x, y = batch(step, world, rank)
        F.mse_loss(model(x), y).backward()
        opt.step()
    KEPT.append((model, opt))                  # the user keeps them past shutdown
    world_group, twin = dist.group.WORLD, dear.comm.runtime.communicator()._reverse
    assert isinstance(world_group, dist.ProcessGroup) and isinstance(twin, dist.ProcessGroup)
    dear.shutdown()
    gc.collect()
    # References besides our variable and getrefcount's argument (pybind objects are not in
    # gc.get_objects(), so count them).
    return {"others": [sys.getrefcount(world_group) - 2, sys.getrefcount(twin) - 2]}


def test_no_process_group_survives_shutdown() -> None:
    # 3 ranks: the exchange's ring thread has run, and must not keep a group either.
    for schedule, world in (("planned", 2), ("dear", 2), ("planned", 3)):
        for res in run_distributed(_run, world, schedule, timeout=120,
                                   env={"DEAR_PLAN_AFTER": "2"}):
            assert res["others"] == [0, 0], \
                f"references to (default group, dear's twin) left after shutdown: {res['others']}"
