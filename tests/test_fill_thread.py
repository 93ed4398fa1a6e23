"""Where gradients are copied into their buckets (dear/fusion/bucket.py: pack takes references,
fill copies right before the reduce-scatter is issued).

Under the planned schedule the copy runs on the collective executor's thread, beside backward,
not in backward's hooks on the training thread: on a GPU the copy is a side-stream kernel, and
on the emulated accelerator it was what lengthened backward (benchmarks/results/). Training must
stay exactly single-process training on the global batch, on the native and the Python path.
"""

from __future__ import annotations

import threading

import pytest
import torch.nn.functional as F

import dear
from dear.fusion import bucket as bucket_module
from tests.distributed import run_distributed
from tests.workloads import OPTIMIZERS, batch, make_net, max_diff, reference, state_of

STEPS = 6
PLAN_AFTER = 2


def _run() -> dict:
    dear.init()
    rank, world = dear.rank(), dear.size()
    fills: list[tuple[int, str]] = []
    step_now = [0]
    original = bucket_module.Bucket.fill

    def recording_fill(self: bucket_module.Bucket) -> None:
        if not self._filled:
            fills.append((step_now[0], threading.current_thread().name))
        original(self)

    bucket_module.Bucket.fill = recording_fill  # type: ignore[method-assign]
    model = make_net()
    opt = dear.DistributedOptimizer(OPTIMIZERS["adam"](model.parameters()), model=model,
                                    fusion_threshold=1024, schedule="planned")
    planned_steps = []
    for step in range(STEPS):
        step_now[0] = step
        if opt.dear_engine.schedule.plan is not None:
            planned_steps.append(step)
        opt.zero_grad()
        x, y = batch(step, world, rank)
        F.mse_loss(model(x), y).backward()
        opt.step()
    opt.flush_updates()
    out = {"params": state_of(model), "fills": fills, "planned_steps": planned_steps,
           "main": threading.current_thread().name}
    dear.shutdown()
    return out


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "python"])
def test_planned_schedule_copies_gradients_off_the_training_thread(native: str) -> None:
    ranks = run_distributed(_run, 2, timeout=180,
                            env={"DEAR_PLAN_AFTER": str(PLAN_AFTER), "DEAR_NATIVE": native})
    ref = reference("adam", 2, STEPS)
    scale = max(v.abs().max().item() for v in ref.values())
    for res in ranks:
        planned = set(res["planned_steps"])
        assert planned, "the schedule never planned"
        on_main = [s for s, thread in res["fills"] if thread == res["main"]]
        assert on_main and min(on_main) < PLAN_AFTER, \
            "before the plan, the training thread itself should copy (DeAR's order)"
        assert not planned & set(on_main), \
            f"gradients copied on the training thread in planned steps {sorted(planned)}"
        off_main = {s for s, thread in res["fills"] if thread != res["main"]}
        assert planned <= off_main
        assert max_diff(res["params"], ref) <= 1e-6 * scale
    assert max_diff(ranks[0]["params"], ranks[1]["params"]) == 0.0
