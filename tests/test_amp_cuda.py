"""GradScaler("cuda") under the deferred update, against DDP on the same GPU (world of one, NCCL).

The CPU tests (tests/test_amp.py) cover the cross-rank agreement; here the CUDA scaler's own
path: autocast fp16 forward, inf/NaN injected at two steps, dear's found-inf check on the reduced
shards and the skip of the deferred update, against DDP's. Skipped without a GPU. Run on an H100
(torch 2.11, CUDA 13, 2026-11-24): besides the two injected steps, the fp16 forward overflows by
itself once the scale has grown to 2^17, so the skipped steps are counted from the scales.
"""

from __future__ import annotations

import math
import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import dear
from tests.workloads import batch, make_net, max_diff, state_of

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore:GradScaler is going to stop:FutureWarning"),
]

STEPS = 8
INJECT = {2: math.inf, 5: math.nan}           # step -> value added to the loss


@pytest.fixture
def nccl_world_of_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, device_id=torch.device("cuda", 0))
    dear.init(backend="torch")
    yield
    dear.shutdown()
    dist.destroy_process_group()


def _loop(mode: str) -> dict:
    model = make_net().cuda()
    net = (torch.nn.parallel.DistributedDataParallel(model, device_ids=[0]) if mode == "ddp"
           else model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if mode == "dear":
        opt = dear.DistributedOptimizer(opt, model=model, fusion_threshold=2048)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16, growth_interval=2)
    scales = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = (t.cuda() for t in batch(step, 1, 0))
        with torch.autocast("cuda", dtype=torch.float16):
            out = net(x)
        loss = F.mse_loss(out.float(), y)
        if step in INJECT:
            loss = loss + INJECT[step] * next(model.parameters()).view(-1)[0]
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    steps = {int(s["step"]) for s in opt.state_dict()["state"].values()}
    return {"params": state_of(model), "scales": scales, "adam_steps": steps}


def test_cuda_grad_scaler_matches_ddp(nccl_world_of_one) -> None:
    ddp, ours = _loop("ddp"), _loop("dear")
    assert ours["scales"] == ddp["scales"], "different skip decisions"
    before = [2.0**16] + ddp["scales"][:-1]
    skipped = sum(after < prior for prior, after in zip(before, ddp["scales"]))
    assert skipped >= len(INJECT), "an injected inf/NaN did not skip its step"
    assert ours["adam_steps"] == ddp["adam_steps"] == {STEPS - skipped}
    assert max_diff(ours["params"], ddp["params"]) < 1e-5
