"""Real Horovod's elastic mode (horovodrun --host-discovery-script) on ResNet-50's parameters
(SGD with momentum), with Horovod's hvd.DistributedOptimizer and with dear.DistributedOptimizer
in its place (dear/comm/horovod_elastic.py), on this machine (localhost and 127.0.0.1 as two
hosts of one slot each):

- lose: 2 hosts; the process on 127.0.0.1 kills itself after step K -> the time from its kill
  to the first step the survivor completes at size 1 (Horovod keeps the survivor's process);
- add: 1 host; after step K the discovery script starts reporting the second -> the time from
  then to the first step completed at size 2 (a new process: its imports count);
- commit: what hvd.elastic's commit (TorchState: a copy of the model's and the optimizer's
  state in memory) costs each time, in ms and ms per MB of state.

`--optimizers horovod,dear,dear-sharded`: dear-sharded is dear's with shard_optimizer_state=True,
whose commit keeps this rank's pieces and a copy of the other rank's (dear/sharding/commit.py).

    python -m benchmarks.horovod_elastic --name horovod_elastic_resize

Each worker appends JSON lines (its process start, each step with its world size, each commit)
to a file the driver reads; times are wall-clock on one machine.
"""

from __future__ import annotations

import time

T_EXEC = time.time()                     # the worker's process began (before torch's import)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

from benchmarks.elastic import _events, state_mb, write_rows  # noqa: E402  (the same logs)

ROOT = Path(__file__).resolve().parent.parent
#: dear's optimizer with shard_optimizer_state=True (its commit: pieces, never the whole state;
#: its MB counted as the whole state's, momentum included, for the same ms per MB)
SHARDED = "dear-sharded"


# ------------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:
    import torch

    if args.optimizer.startswith("dear"):
        import dear  # noqa: F401  (before hvd.init(): Horovod's Gloo timeout)
    import horovod.torch as hvd

    from benchmarks.models import resnet50
    hvd.init()
    torch.set_num_threads(1)
    out = Path(args.out)
    host = os.environ.get("HOROVOD_HOSTNAME", "")
    path = out / f"w{os.getpid()}.jsonl"

    def log(kind: str, **fields: Any) -> None:
        with open(path, "a") as fh:
            fh.write(json.dumps({"event": kind, "t": time.time(), "rank": hvd.rank(),
                                 "world": hvd.size(), "host": host, **fields}) + "\n")

    log("exec", at=T_EXEC)
    torch.manual_seed(0)
    model = resnet50(num_classes=10)
    sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if args.optimizer.startswith("dear"):
        import dear
        optimizer = dear.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                              model=model,
                                              shard_optimizer_state=args.optimizer == SHARDED)
    else:
        optimizer = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    log("ready")

    @hvd.elastic.run
    def train(state: Any) -> None:
        g = torch.Generator().manual_seed(hvd.rank())
        while state.step < args.steps:
            if args.kill_host == host and state.step == args.at:
                log("kill")
                os.kill(os.getpid(), signal.SIGKILL)
            if args.add_at is not None and hvd.rank() == 0 and state.step == args.add_at \
                    and not (out / "add").exists():
                (out / "add").write_text(str(time.time()))
            x = torch.randn(args.batch, 3, args.image, args.image, generator=g)
            y = torch.randint(0, 10, (args.batch,), generator=g)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            state.step += 1
            log("step", step=state.step)
            t0 = time.perf_counter()
            try:
                state.commit()
            finally:
                log("commit", step=state.step, s=time.perf_counter() - t0,
                    mb=state_mb(model, optimizer) if args.optimizer != SHARDED else
                    state_mb(model, sgd) + sum(p.numel() * p.element_size()
                                               for p in model.parameters()) / 1e6)

    state = hvd.elastic.TorchState(model, optimizer, step=0)
    train(state)
    log("end")



# ------------------------------------------------------------------------------- driver

def _run(args: argparse.Namespace, out: Path, np: int, discovery: str, *extra: str) -> None:
    script = out / "discover.sh"
    script.write_text("#!/bin/bash\n" + discovery)
    script.chmod(0o755)
    cmd = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", str(np),
           "--min-np", "1", "--max-np", "2", "--network-interface", "lo",
           "--host-discovery-script", str(script),
           sys.executable, "-m", "benchmarks.horovod_elastic", "--worker", "--out", str(out),
           "--optimizer", args.optimizer, "--image", str(args.image), "--batch",
           str(args.batch), "--steps", str(args.steps), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "DEAR_TIMEOUT": str(args.dear_timeout)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        raise RuntimeError(f"horovodrun did not finish within {args.timeout} s:\n{text[-4000:]}")
    if proc.returncode != 0:
        raise RuntimeError(f"horovodrun failed ({proc.returncode}):\n{text[-4000:]}")


def lose(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="hvd-lose-"))
    _run(args, out, 2, "echo localhost:1\necho 127.0.0.1:1\n", "--kill-host", "127.0.0.1",
         "--at", str(args.at))
    rows = _events(out)
    killed = next(r for r in rows if r["event"] == "kill")
    first = next(r for r in rows if r["event"] == "step" and r["world"] == 1
                 and r["t"] > killed["t"])
    return {"scenario": f"{args.optimizer}: lose 1 of 2", "first_step_s":
            round(first["t"] - killed["t"], 2), "resumed_from_step": first["step"] - 1}


def add(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="hvd-add-"))
    _run(args, out, 1, f"echo localhost:1\nif [ -f {out}/add ]; then echo 127.0.0.1:1; fi\n",
         "--add-at", str(args.at))
    rows = _events(out)
    t0 = float((out / "add").read_text())
    began = min(r["at"] for r in rows if r["event"] == "exec" and r["host"] == "127.0.0.1")
    first = next(r for r in rows if r["event"] == "step" and r["world"] == 2 and r["t"] > t0)
    return {"scenario": f"{args.optimizer}: add 1 to 1", "new_process_began_s":
            round(began - t0, 2), "first_step_s": round(first["t"] - t0, 2)}


def commits(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="hvd-commit-"))
    _run(args, out, 2, "echo localhost:1\necho 127.0.0.1:1\n")
    rows = [r for r in _events(out) if r["event"] == "commit" and r["step"] > 1]
    mb = rows[0]["mb"]
    total = [r["s"] for r in rows]
    return {"scenario": f"{args.optimizer}: commit on 2 ranks", "state_mb": round(mb, 1),
            "commits": len(rows), "commit_ms_median": round(1e3 * statistics.median(total), 1),
            "commit_ms_per_mb": round(1e3 * statistics.median(total) / mb, 2)}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out")
    p.add_argument("--optimizer", default="dear")
    p.add_argument("--optimizers", default="horovod,dear")
    p.add_argument("--image", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--at", type=int, default=3, help="the step of the kill or the add")
    p.add_argument("--kill-host", default="", help=argparse.SUPPRESS)
    p.add_argument("--add-at", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--scenarios", default="commit,lose,add")
    p.add_argument("--dear-timeout", type=float, default=10)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    rows = []
    for _ in range(args.repeat):
        for optimizer in args.optimizers.split(","):
            args.optimizer = optimizer
            for name in args.scenarios.split(","):
                row = {"commit": commits, "lose": lose, "add": add}[name](args)
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.name:
        write_rows(args.name, "Real Horovod's elastic mode: resizes and commits (ResNet-50), "
                   "Horovod's optimizer and dear's", rows,
                   ("resumed_from_step", "new_process_began_s", "first_step_s", "state_mb",
                    "commits", "commit_ms_median", "commit_ms_per_mb"),
                   {"dear_timeout": args.dear_timeout})
    return 0


if __name__ == "__main__":
    sys.exit(main())
