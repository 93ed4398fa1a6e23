"""Step-by-step probe of dear's NCCL communicators on a GPU machine, after the extension is built
(tools/gpu_check.sh). Each step prints before it runs, so a crash names its step, interpreter exit
included: a destroyed stream once crashed it there.

  python tools/gpu_probe.py raw|csrc|nccl4py   the extension's class alone, or through dear
"""

from __future__ import annotations

import faulthandler
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


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "csrc"
    if what == "raw":
        probe_raw()
    else:
        probe_dear(what)
    say("end of script; the interpreter exits next")
