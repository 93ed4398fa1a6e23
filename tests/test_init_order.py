"""Scripts that start their process group their own way: a DDP script that keeps
dist.init_process_group() and never calls dear.init(), and a Horovod script that calls
hvd.init() before `import dear`."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import run_distributed
from tests.horovod_launch import run_horovod
from tests.workloads import Net, batch, max_diff, state_of

WORLD = 2
STEPS = 4


def _ddp_script_swapped() -> dict[str, Any]:
    """A DDP script as written for DDP (init_process_group, its own seed on each rank), trained
    once with DDP and once with dear.DistributedOptimizer in DDP's place, without dear.init()."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import dear
    from dear.comm import runtime
    from dear.config import Config

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    logging.getLogger("dear").addHandler(handler)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def train(wrap: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(rank)                # DDP's constructor (and dear's wrap) give rank 0's
        model = Net()
        opt: torch.optim.Optimizer
        if wrap == "ddp":
            ddp = DDP(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            forward: Any = ddp
        else:
            opt = dear.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model=model)
            forward = model
        for step in range(STEPS):
            opt.zero_grad()
            x, y = batch(step, WORLD, rank)
            F.mse_loss(forward(x), y).backward()
            opt.step()
        return state_of(model)

    ddp_state = train("ddp")
    assert not dear.is_initialized()
    dear_state = train("dear")
    implicit = {"started": dear.is_initialized(), "comm": runtime.communicator().name,
                "config": runtime.config(), "owns_group": runtime._state.owns_group}
    dear.shutdown()                            # as after dear.init(): the user's group stays
    group_kept = dist.is_initialized()
    dear.init()                                # the explicit path, on the same group
    explicit = {"started": True, "comm": runtime.communicator().name,
                "config": runtime.config(), "owns_group": runtime._state.owns_group}
    dear.shutdown()
    logging.getLogger("dear").removeHandler(handler)
    started_lines = [r.getMessage() for r in records
                     if r.levelno == logging.INFO and "not dear.init()" in r.getMessage()]
    return {"ddp": ddp_state, "dear": dear_state, "implicit": implicit, "explicit": explicit,
            "group_kept": group_kept, "started_lines": started_lines,
            "default": Config.from_env()}


def test_a_ddp_script_that_keeps_init_process_group_trains_as_ddp_does():
    """dear.DistributedOptimizer on a script that called dist.init_process_group() and not
    dear.init(): dear starts on that group as dear.init() would (same backend, same settings,
    the group left to the user at dear.shutdown()), says so once at INFO, and the training
    ends where DDP's ends on the same data."""
    results = run_distributed(_ddp_script_swapped, WORLD, timeout=180,
                              env={"DEAR_LOG_LEVEL": "INFO"})
    for rank, res in enumerate(results):
        diff = max_diff(res["dear"], res["ddp"])
        assert diff <= 1e-6, f"rank {rank}: dear differs from DDP by {diff:.3g}"
        assert res["implicit"] == res["explicit"], (rank, res["implicit"], res["explicit"])
        assert res["implicit"]["owns_group"] is False
        assert res["implicit"]["config"] == res["default"]
        assert res["group_kept"]
        assert len(res["started_lines"]) == 1, res["started_lines"]
    assert max_diff(results[0]["dear"], results[1]["dear"]) == 0


def _wrap_without_any_group() -> str:
    import dear
    model = torch.nn.Linear(4, 2)
    try:
        dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_wrapping_with_no_process_group_names_both_ways_to_start():
    [message] = run_distributed(_wrap_without_any_group, 1, timeout=60)
    assert "dear is not initialised" in message
    assert "dear.init()" in message
    assert "torch.distributed.init_process_group()" in message


_HOROVOD_SCRIPT = """\
import os, sys
os.environ.pop("HOROVOD_GLOO_TIMEOUT_SECONDS", None)   # horovodrun sets none by default
os.environ["DEAR_TIMEOUT"] = "20"
import torch
import horovod.torch as hvd
if sys.argv[1] == "hvd-first":
    hvd.init()
    import dear
else:                                      # the documented order
    import dear
    hvd.init()
print("GLOO_TIMEOUT_AT_WRAP", os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS"), flush=True)
for attempt in range(2):                   # a second start on the same Horovod warns no more
    model = torch.nn.Linear(4, 2)
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    dear.shutdown()
print("DONE", flush=True)
"""


@pytest.mark.parametrize("order", ["hvd-first", "dear-first"])
def test_horovod_started_before_dear_is_told_once_about_its_gloo_timeout(tmp_path, order):
    """hvd.init() before `import dear` with DEAR_TIMEOUT=20: Horovod keeps its own 30 s Gloo
    timeout (dear could not set HOROVOD_GLOO_TIMEOUT_SECONDS in time), and each rank says so
    once, naming the variable. In the documented order dear sets it (23) and says nothing."""
    script = tmp_path / "hvd_order.py"
    script.write_text(_HOROVOD_SCRIPT)
    outputs = run_horovod([str(script), order], np=2, timeout=180)
    for rank, out in enumerate(outputs):
        assert "DONE" in out, out
        warnings = [line for line in out.splitlines()
                    if "HOROVOD_GLOO_TIMEOUT_SECONDS" in line and "dear:" in line]
        if order == "hvd-first":
            assert "GLOO_TIMEOUT_AT_WRAP None" in out, out
            assert len(warnings) == 1, f"rank {rank}:\n{out}"
            assert "30 s" in warnings[0] and "before hvd.init()" in warnings[0], warnings[0]
            assert "HOROVOD_GLOO_TIMEOUT_SECONDS=23" in warnings[0], warnings[0]
        else:
            assert "GLOO_TIMEOUT_AT_WRAP 23" in out, out
            assert warnings == [], f"rank {rank}:\n{out}"
