"""Elastic training's costs under torchrun's elastic agent, on ResNet-50's parameters
(25.6 M, SGD with momentum: 204 MB of state) with dear.elastic, agents as nodes on this
machine (dear/testing/elastic.py):

- lose: 2 nodes, one lost (its agent SIGKILLed, its worker with it) -> the time from the
  kill to the first step the survivor completes at the new size, and its parts;
- add: 1 node, a second one started -> the time from its start to the first step at size 2;
- commit: what each commit costs in the steady state, in ms and in ms per MB of state, with
  its in-memory copy apart.

    python -m benchmarks.elastic --name elastic_resize

Each worker appends JSON lines (its process start, resume done, each step, each commit) to a
file the driver reads; times are wall-clock on one machine. The rendezvous settings are
`--rdzv-conf` (default: keep_alive 1 s x 5, last_call 2 s: docs/elastic.md says why).
"""

from __future__ import annotations

import time

T_EXEC = time.time()                     # the worker's process began (before torch's import)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Optional  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RDZV = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=5"


# ------------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:
    from dear.testing.elastic import die_with_parent
    die_with_parent()
    import torch

    import dear
    import dear.elastic as elastic
    from benchmarks.models import resnet50
    torch.set_num_threads(1)
    out = Path(args.out)
    dear.init()
    rank, world = dear.rank(), dear.size()
    path = out / f"w{os.getpid()}.jsonl"

    def log(kind: str, **fields: Any) -> None:
        with open(path, "a") as fh:
            fh.write(json.dumps({"event": kind, "t": time.time(), "rank": rank, "world": world,
                                 "pid": os.getpid(), **fields}) + "\n")

    log("exec", at=T_EXEC)
    torch.manual_seed(0)
    model = resnet50(num_classes=10)
    optimizer = dear.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), model=model)
    state = elastic.State(model=model, optimizer=optimizer, step=0)
    log("ready")                                  # imported, started, model built

    @elastic.run
    def train(state: Any) -> None:
        log("resume", step=state.step)
        g = torch.Generator().manual_seed(rank)
        first = True
        while not (out / "stop").exists():
            x = torch.randn(args.batch, 3, args.image, args.image, generator=g)
            y = torch.randint(0, 10, (args.batch,), generator=g)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            state.step += 1
            log("first_step" if first else "step", step=state.step)
            first = False
            if state.step % args.commit_every == 0:
                t0 = time.perf_counter()
                state.save()                      # the in-memory copy alone, for the split
                t1 = time.perf_counter()
                try:
                    state.commit()                # HostsUpdatedInterrupt: after writing
                finally:
                    t2 = time.perf_counter()
                    log("commit", step=state.step, save_s=t1 - t0, commit_s=t2 - t1,
                        mb=state_mb(model, optimizer))

    train(state)
    log("end", step=state.step)


def state_mb(model: Any, optimizer: Any) -> float:
    """The MB of tensors in the model's state_dict() and the optimizer's state (this rank's)."""
    import torch
    n = sum(v.numel() * v.element_size() for v in model.state_dict().values()
            if isinstance(v, torch.Tensor))
    for entry in optimizer.state.values():
        n += sum(v.numel() * v.element_size() for v in entry.values()
                 if isinstance(v, torch.Tensor))
    return n / 1e6


# ------------------------------------------------------------------------------- driver
def _events(out: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for f in out.glob("w*.jsonl"):
        rows += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r["t"])


def _first(rows: list[dict[str, Any]], after: float,
           pred: Callable[[dict[str, Any]], bool]) -> Optional[dict[str, Any]]:
    return next((r for r in rows if r["t"] >= after and pred(r)), None)


def _cluster(out: Path, args: argparse.Namespace, nnodes: str) -> Any:
    from dear.testing.elastic import ElasticCluster
    conf = dict(kv.split("=", 1) for kv in args.rdzv_conf.split(",") if kv)
    return ElasticCluster(
        [str(Path(__file__).resolve()), "--worker", "--out", str(out), "--image",
         str(args.image), "--batch", str(args.batch), "--commit-every", str(args.commit_every)],
        nnodes=nnodes, max_restarts=3, rdzv_conf=conf, timeout=args.timeout, workdir=out,
        env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONPATH": str(ROOT),
             "DEAR_ELASTIC_DIR": str(out / "commits"), "OMP_NUM_THREADS": "1",
             "DEAR_TIMEOUT": str(args.dear_timeout)})


def _steps_at(out: Path, world: int, step: int, after: float = 0.0) -> Callable[[], bool]:
    return lambda: any(r["t"] >= after and r["world"] == world and r.get("step", -1) >= step
                       and r["event"] in ("step", "first_step") for r in _events(out))


def _parts(rows: list[dict[str, Any]], t0: float, world: int) -> dict[str, Any]:
    """The new generation's milestones after t0 (s): its processes began, resumed (commit
    loaded, state synchronized), first step done."""
    execd = _first(rows, t0, lambda r: r["event"] == "exec" and r["world"] == world)
    ready = _first(rows, t0, lambda r: r["event"] == "ready" and r["world"] == world)
    resumed = _first(rows, t0, lambda r: r["event"] == "resume" and r["world"] == world)
    first = _first(rows, t0, lambda r: r["event"] == "first_step" and r["world"] == world)
    return {"new_processes_began_s": round(execd["at"] - t0, 2) if execd else None,
            "imported_and_built_s": round(ready["t"] - t0, 2) if ready else None,
            "resumed_s": round(resumed["t"] - t0, 2) if resumed else None,
            "first_step_s": round(first["t"] - t0, 2) if first else None,
            "resumed_from_step": resumed["step"] if resumed else None}


def lose(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="dear-elastic-lose-"))
    with _cluster(out, args, "1:2") as cluster:
        a, b = cluster.start_agent(), cluster.start_agent()
        cluster.wait_for(_steps_at(out, 2, args.commit_every + 1), "two steps past a commit")
        t0 = time.time()
        cluster.kill_agent(b)
        cluster.wait_for(lambda: _first(_events(out), t0, lambda r: r["event"] == "first_step"
                                        and r["world"] == 1), "the first step at size 1")
        rows = _events(out)
        last = max(r["step"] for r in rows if r["t"] < t0 and r["event"] in ("step",
                                                                           "first_step"))
        (out / "stop").write_text("")
        cluster.wait_agents([a])
    return {"scenario": "lose 1 of 2 nodes", "lost_at_step": last, **_parts(rows, t0, 1)}


def add(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="dear-elastic-add-"))
    with _cluster(out, args, "1:2") as cluster:
        cluster.start_agent()
        cluster.wait_for(_steps_at(out, 1, args.commit_every + 1), "a step past a commit")
        t0 = time.time()
        cluster.start_agent()
        cluster.wait_for(lambda: _first(_events(out), t0, lambda r: r["event"] == "first_step"
                                        and r["world"] == 2), "the first step at size 2")
        rows = _events(out)
        (out / "stop").write_text("")
        cluster.wait_agents()
    old_last = max(r["t"] for r in rows if r["world"] == 1 and r["event"] == "commit")
    return {"scenario": "add a node to 1", **_parts(rows, t0, 2),
            "old_workers_last_commit_s": round(old_last - t0, 2)}


def commits(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="dear-elastic-commit-"))
    with _cluster(out, args, f"{args.ranks}:{args.ranks}") as cluster:
        for _ in range(args.ranks):
            cluster.start_agent()
        need = args.commit_every * (args.commits + 1)
        cluster.wait_for(_steps_at(out, args.ranks, need), f"{args.commits + 1} commits")
        (out / "stop").write_text("")
        cluster.wait_agents()
    rows = [r for r in _events(out) if r["event"] == "commit"][args.ranks:]   # not the 1st
    total = [r["commit_s"] for r in rows]
    save = [r["save_s"] for r in rows]
    mb = rows[0]["mb"]
    return {"scenario": f"commit on {args.ranks} ranks", "state_mb": round(mb, 1),
            "commits": len(rows), "commit_ms_median": round(1e3 * statistics.median(total), 1),
            "commit_ms_per_mb": round(1e3 * statistics.median(total) / mb, 2),
            "in_memory_copy_ms_median": round(1e3 * statistics.median(save), 1)}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out")
    p.add_argument("--image", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--commit-every", type=int, default=2)
    p.add_argument("--commits", type=int, default=4)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--scenarios", default="commit,lose,add")
    p.add_argument("--rdzv-conf", default=RDZV)
    p.add_argument("--dear-timeout", type=float, default=10)
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    rows = []
    for _ in range(args.repeat):
        for name in args.scenarios.split(","):
            row = {"commit": commits, "lose": lose, "add": add}[name](args)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.name:
        write_rows(args.name, "Elastic training under torchrun: resizes and commits (ResNet-50)",
                   rows, ("lost_at_step", "resumed_from_step", "old_workers_last_commit_s",
                          "new_processes_began_s", "imported_and_built_s", "resumed_s",
                          "first_step_s", "state_mb", "commits", "commit_ms_median",
                          "commit_ms_per_mb", "in_memory_copy_ms_median"),
                   {"rdzv_conf": args.rdzv_conf, "dear_timeout": args.dear_timeout})
    return 0


def write_rows(name: str, title: str, rows: list[dict[str, Any]], columns: tuple[str, ...],
               extra: dict[str, Any]) -> None:
    """The scenarios' rows as benchmarks/results/<name>: a column for each of `columns` that
    some row has."""
    from benchmarks.results import markdown_table, write
    keys = [k for k in columns if any(k in r for r in rows)]
    table = markdown_table(["scenario", *keys], [[r["scenario"], *(r.get(k, "") for k in keys)]
                                                for r in rows])
    write(name, title, {"rows": rows, **extra}, table)


if __name__ == "__main__":
    sys.exit(main())
