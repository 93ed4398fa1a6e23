"""How long a surviving rank takes to raise, and to exit, after its peer dies or stalls.

    python -m benchmarks.fault_exit [--timeout 5] [--name fault_exit]

Two ranks (Gloo, loopback) train with dear; at step 3 rank 1 dies (SIGKILL on itself), stalls
(sleeps far longer than DEAR_TIMEOUT: its other threads run on) or freezes (SIGSTOP on itself,
as a rank stuck in a driver call: none of its threads runs), and writes the time it did so.
Rank 0 writes when it caught the error; this script notes when rank 0's process ended (its
handler re-raises, as a training script would) and when the launcher returned. Cases:
dear.DistributedOptimizer alone, with dear.KFAC (comm-opt: its own process groups), and on a
process group the user made with torch's 30-minute default, the fault met in `dear.allreduce`
(user-group) or in backward's reduce-scatters (user-group-backward), on the Horovod backend
under horovodrun (horovod) and on the MPI backend under mpirun (mpi), whose own exits are
timed. The goal: every rank leaves within
DEAR_TIMEOUT + 5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

from benchmarks import cli

CASES = ("optimizer", "kfac", "user-group", "user-group-backward", "horovod", "mpi")
#: Need CUDA: dear's own NCCL communicator (backend="nccl") and torch's NCCL group (dear.init()
#: with CUDA tensors). Both ranks use GPU 0 where there is one GPU (NCCL refuses two ranks on
#: one device: the error is what gets reported then).
GPU_CASES = ("nccl", "torch-nccl")
FAULTS = ("dies", "stalls", "frozen")


def _rank(case: str, fault: str, marker: str) -> None:
    import datetime
    import signal

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import dear
    rank = int(os.environ.get("RANK") or os.environ.get("HOROVOD_RANK", "0"))
    if case.startswith("user-group"):          # the user's own group, torch's 30 minutes
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    if case == "horovod":                      # under horovodrun: dear on Horovod
        import horovod.torch as hvd
        hvd.init()
        rank = hvd.rank()
    with open(f"{marker}.pid{rank}", "w") as fh:   # the harness watches rank 0's process end
        fh.write(str(os.getpid()))
    device = "cuda" if case in GPU_CASES else "cpu"
    if case == "mpi":                          # under mpirun: MPI's collectives
        rank = int(os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
        dear.init(backend="mpi")
    elif case == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dear.init(backend="nccl")
    else:
        dear.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 4)).to(device)
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model=model)
    precond = dear.KFAC(model, strategy="comm-opt") if case == "kfac" else None
    def fault_here(step: int) -> None:
        if step == 3 and rank == 1:
            with open(marker, "w") as fh:
                fh.write(repr(time.time()))
            if fault == "dies":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "frozen":              # as a rank stuck in a driver call: no thread runs
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(3600)

    try:
        for step in range(50):
            if case != "user-group":           # the peer is missing from the next backward
                fault_here(step)
            x, y = torch.randn(16, 32, device=device), torch.randn(16, 4, device=device)
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            if precond is not None:
                precond.step()
            opt.step()
            if case == "user-group":           # ... from the all-reduce on the user's group
                fault_here(step)
                dear.allreduce(loss.detach())
    except Exception as exc:
        with open(marker + ".caught", "w") as fh:
            fh.write(json.dumps({"t": time.time(), "error": f"{type(exc).__name__}: {exc}"[:300]}))
        raise


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch(case: str, fault: str, marker: str, timeout: float) -> list[subprocess.Popen]:
    """Two ranks: torchrun's variables set by hand, or horovodrun itself (its exit is what a
    Horovod user waits for)."""
    rank_args = ["-m", "benchmarks.fault_exit", "--rank-of", case, fault, marker]
    if case == "mpi":
        runner = os.path.join(os.path.dirname(sys.executable), "mpirun")
        env = dict(os.environ, OMP_NUM_THREADS="1", DEAR_TIMEOUT=str(timeout),
                   OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        return [subprocess.Popen([runner, "-np", "2", sys.executable, *rank_args],
                                 env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True, start_new_session=True)]
    if case == "horovod":
        runner = os.path.join(os.path.dirname(sys.executable), "horovodrun")
        env = dict(os.environ, OMP_NUM_THREADS="1", DEAR_TIMEOUT=str(timeout))
        return [subprocess.Popen([runner, "-np", "2", "-H", "localhost:2", "--gloo",
                                  sys.executable, *rank_args],
                                 env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True, start_new_session=True)]
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   DEAR_TIMEOUT=str(timeout))
        procs.append(subprocess.Popen([sys.executable, *rank_args], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True))
    return procs


def _measure(case: str, fault: str, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        marker = os.path.join(tmp, "fault")
        procs = _launch(case, fault, marker, timeout)
        limit = time.time() + timeout + 40
        rank0: Optional[int] = None
        rank0_ended: Optional[float] = None
        while procs[0].poll() is None and time.time() < limit:
            rank0 = rank0 or _pid(marker + ".pid0")
            if rank0 is not None and rank0_ended is None and not _alive(rank0):
                rank0_ended = time.time()
            time.sleep(0.02)
        ended = time.time() if procs[0].poll() is not None else None
        if rank0_ended is None and rank0 is not None and not _alive(rank0):
            rank0_ended = ended
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)   # a frozen rank too: SIGKILL needs no SIGCONT
            p.wait()
        errors = procs[0].stderr.read() if procs[0].stderr is not None else ""
        fault_t = float(open(marker).read()) if os.path.exists(marker) else None
        caught = (json.load(open(marker + ".caught")) if os.path.exists(marker + ".caught")
                  else None)
    out: dict[str, Any] = {"case": case, "fault": fault}
    if fault_t is None:
        tail = " | ".join(line for line in errors.strip().splitlines()[-3:])
        return {**out, "error": f"rank 1 never reached the fault; rank 0: {tail[-400:]}"}
    out["raised_s"] = None if caught is None else round(caught["t"] - fault_t, 2)
    out["exited_s"] = None if ended is None else round(ended - fault_t, 2)
    out["rank0_exited_s"] = None if rank0_ended is None else round(rank0_ended - fault_t, 2)
    out["error"] = None if caught is None else caught["error"]
    survivor = rank0_ended if rank0_ended is not None else ended
    out["within_timeout_plus_5"] = survivor is not None and survivor - fault_t <= timeout + 5
    return out


def _pid(path: str) -> Optional[int]:
    try:
        with open(path) as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    """Whether the process runs (a zombie, ended but not yet reaped by its launcher, counts as
    ended)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_options(parser, name="")
    parser.add_argument("--timeout", type=float, default=5.0, help="DEAR_TIMEOUT, seconds")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, of {CASES + GPU_CASES}")
    parser.add_argument("--rank-of", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        _rank(*args.rank_of)
        return
    cases = [c for c in args.cases.split(",") if c]
    unknown = set(cases) - set(CASES + GPU_CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; choose from {CASES + GPU_CASES}")
    rows = []
    for case in cases:
        for fault in FAULTS:
            rows.append(_measure(case, fault, args.timeout))
            print(json.dumps(rows[-1]), flush=True)
    if args.name:
        from benchmarks.results import markdown_table, write
        table = markdown_table(
            ["case", "fault", "rank 0 raised (s after fault)", "rank 0's process ended (s)",
             "launcher returned (s)", f"within DEAR_TIMEOUT + 5 ({args.timeout:g} + 5 s)"],
            [[r["case"], r["fault"], r.get("raised_s"), r.get("rank0_exited_s"),
              r.get("exited_s"), r.get("within_timeout_plus_5")] for r in rows])
        print(write(args.name, "Time to raise and to exit after a peer's fault", {"rows": rows},
                    table))


if __name__ == "__main__":
    main()
