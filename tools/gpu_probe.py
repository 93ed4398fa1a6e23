"""Step-by-step probe of dear's NCCL communicators on a GPU machine, after the extension is built
(tools/gpu_check.sh). Each step prints before it runs, so a crash names its step, interpreter exit
included: a destroyed stream once crashed it there.

  python tools/gpu_probe.py raw|csrc|nccl4py   the extension's class alone, or through dear
  PYTHONPATH=. python tools/gpu_probe.py amp     tests/test_amp_cuda.py's loop, step by step
"""

from __future__ import annotations

import faulthandler
import math
import socket
import sys

import torch
import torch.distributed as dist

faulthandler.enable()


def say(*parts: object) -> None:
    print(*parts, flush=True)


def probe_raw() -> None:
    from dear import native
    ext = native.extension()
    say("build", native.build_info(), "torch nccl", torch.cuda.nccl.version())
    uid = bytes(ext.nccl_unique_id())
    say("communicator")
    comm = ext.NcclCommunicator(0, 1, uid, 0)
    x = torch.arange(12, dtype=torch.float32, device="cuda")
    out = torch.empty_like(x)
    say("reduce-scatter")
    work = comm.reduce_scatter(x, out)
    work.wait()
    torch.cuda.synchronize()
    say("reduce-scatter right:", torch.equal(out, x))
    comm.destroy()
    say("destroyed; x, out and the work outlive it, to the interpreter's exit")


def probe_dear(implementation: str) -> None:
    from dear.comm.nccl import NcclCommunicator
    say("communicator", implementation)
    comm = NcclCommunicator(0, 1, dist.HashStore(), implementation=implementation)
    x = torch.arange(12, dtype=torch.float32, device="cuda")
    out = torch.empty_like(x)
    comm.reduce_scatter(x, out).wait()
    torch.cuda.synchronize()
    say("reduce-scatter right:", torch.equal(out, x))
    comm.shutdown()
    say("shut down")


def probe_amp() -> None:
    """tests/test_amp_cuda.py's loop for DDP and dear: each step's scale, found-inf and Adam's
    step counts."""
    import torch.nn.functional as F

    import dear
    from tests.workloads import batch, make_net, max_diff, state_of
    inject = {2: math.inf, 5: math.nan}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, device_id=torch.device("cuda", 0))
    dear.init(backend="torch")
    results = {}
    for mode in ("ddp", "dear"):
        model = make_net().cuda()
        net = (torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
               if mode == "ddp" else model)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        if mode == "dear":
            opt = dear.DistributedOptimizer(opt, model=model, fusion_threshold=2048)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16, growth_interval=2)
        for step in range(8):
            opt.zero_grad()
            x, y = (t.cuda() for t in batch(step, 1, 0))
            with torch.autocast("cuda", dtype=torch.float16):
                out = net(x)
            loss = F.mse_loss(out.float(), y)
            if step in inject:
                loss = loss + inject[step] * next(model.parameters()).view(-1)[0]
            scaler.scale(loss).backward()
            scaler.step(opt)
            state = scaler._per_optimizer_states[id(opt)]
            found = {str(k): v.item() for k, v in state["found_inf_per_device"].items()}
            scaler.update()
            steps = sorted({int(s["step"]) for s in opt.state_dict()["state"].values()})
            say(mode, step, "scale", scaler.get_scale(), "found", found, "adam", steps)
        results[mode] = state_of(model)
    say("largest parameter difference", max_diff(results["ddp"], results["dear"]))
    dear.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "csrc"
    if what == "raw":
        probe_raw()
    elif what == "amp":
        probe_amp()
    else:
        probe_dear(what)
    say("end of script; the interpreter exits next")
