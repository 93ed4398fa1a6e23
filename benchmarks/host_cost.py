"""Host cost: what plain training, DDP and dear spend on the host per iteration, at shapes where
host work, not compute or the link, sets the pace.

ResNet-50's module structure (161 parameter tensors, 107 modules holding them) at width 8 on
32x32 images, and BERT-Base's layout (201 parameter tensors: embeddings, 12 encoder layers,
pooler, classifier) at hidden size 64: the same hooks, buckets and optimizer calls as the real
models, a few MB of gradient. 2 Gloo ranks on loopback, one thread each; methods interleaved in
rounds (order rotated each round) so drift hits every method alike.

Per method and iteration (steady state: after the warm-up, so dear's planned schedule is in
force):
- wall: median iteration time (the slower rank's);
- host CPU: CPU time of the rank's whole process per iteration (every thread: training thread,
  dear's collective thread, Gloo's), and of the training thread alone;
- added: the same minus plain training's (`none`), and dear's added time / DDP's added time;
- calls: Python function calls per iteration into dear's package (training thread);
- ATen ops: ATen operators per iteration (all threads), and dear's minus plain's;
- host reads: ATen ops that read a tensor's value on the host (`aten::_local_scalar_dense`,
  `aten::item`, `aten::equal`, `aten::is_nonzero`): on a GPU each stalls the host until the
  device catches up. Counted in separate passes (profiler on), so they do not affect the times.

    python -m benchmarks.host_cost [--models resnet50_host,bert_base_host] [--methods ...]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

import dear
from benchmarks import cli, models, results
from benchmarks.launch import free_port, run_ranks
from benchmarks.methods import Built, Method, parse_methods

DEFAULT_METHODS = "none,ddp,dear"
DEFAULT_MODELS = "resnet50_host,bert_base_host"
HOST_READS = ("aten::_local_scalar_dense", "aten::item", "aten::equal", "aten::is_nonzero")
_DEAR_DIR = os.path.dirname(os.path.abspath(dear.__file__)) + os.sep


class CallCounter:
    """Python calls into dear's package on this thread, while `active` (sys.setprofile)."""

    def __init__(self) -> None:
        self.calls = 0

    def __enter__(self) -> "CallCounter":
        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call" and frame.f_code.co_filename.startswith(_DEAR_DIR):
                self.calls += 1
        sys.setprofile(profile)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(None)


def op_counts(step: Callable[[], None], iters: int,
              settle: Optional[Callable[[], Any]] = None) -> collections.Counter:
    """ATen operators (every thread) of `iters` calls of `step`, from torch's profiler.
    `settle` runs last inside the window: no collective may outlive it (torch 2.13's profiler
    crashed reading its events when an asynchronous Gloo operation issued inside the window
    completed after it: dear's all-gathers complete in the next forward)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            step()
        if settle is not None:
            settle()
    counts: collections.Counter = collections.Counter()
    for event in prof.events():
        if event.name.startswith("aten::"):
            counts[event.name] += 1
    return counts


def run_method(method: Method, workload: models.Workload, args: argparse.Namespace,
               rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = workload.make_model()
    built = Built(method, model, lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9))
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [workload.make_batch(gen) for _ in range(4)]
    state = {"k": 0}

    def step() -> None:
        x, y = batches[state["k"] % len(batches)]
        state["k"] += 1
        built.opt.zero_grad()
        workload.loss(built.net(x), y).backward()
        built.clip()
        built.opt.step()

    for i in range(args.warmup):
        step()
        if i == args.warmup - 1 and method.base != "none":
            dist.barrier()
    walls, threads = [], []
    cpu0 = time.process_time()
    for _ in range(args.iters):
        t0, c0 = time.perf_counter(), time.thread_time()
        step()
        walls.append(time.perf_counter() - t0)
        threads.append(time.thread_time() - c0)
    cpu = (time.process_time() - cpu0) / args.iters
    with CallCounter() as counter:
        for _ in range(args.count_iters):
            step()
    flush = getattr(built.opt, "flush_updates", None)
    if flush is not None:
        flush()                                # the window starts with nothing in flight
    ops = op_counts(step, args.count_iters, flush)
    built.finish()
    n = args.count_iters
    return {"wall": statistics.median(walls), "thread_cpu": statistics.median(threads),
            "process_cpu": cpu, "calls": counter.calls / n,
            "ops": sum(ops.values()) / n,
            "host_reads": sum(ops[name] for name in HOST_READS) / n,
            "host_reads_by_op": {name: ops[name] / n for name in HOST_READS if ops[name]}}


def slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dear.init()
    methods = parse_methods(args.methods)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {n: {m.label: [] for m in methods}
                                                        for n in names}
    for r in range(args.rounds):
        for name in names:
            workload = models.build(name)
            order = methods[r % len(methods):] + methods[:r % len(methods)]
            for method in order:
                got = run_method(method, workload, args, rank)
                got["wall"] = slowest(got["wall"])
                rows[name][method.label].append(got)
    if rank == 0:
        report(args, rows)
    dear.shutdown()


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def report(args: argparse.Namespace, rows: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
    headers = ["model", "method", "wall (ms)", "added wall (ms)", "process CPU (ms)",
               "added CPU (ms)", "thread CPU (ms)", "added wall / DDP's", "added CPU / DDP's",
               "dear calls", "ATen ops", "host reads"]
    table_rows, summary = [], {}
    for name, per_method in rows.items():
        med = {m: {k: _median(runs, k) for k in ("wall", "process_cpu", "thread_cpu", "calls",
                                                   "ops", "host_reads")}
               for m, runs in per_method.items()}
        base = med.get("none")
        ddp = med.get("ddp")
        summary[name] = med
        for label, m in med.items():
            added_wall = m["wall"] - base["wall"] if base else float("nan")
            added_cpu = m["process_cpu"] - base["process_cpu"] if base else float("nan")
            ratio_wall = ratio_cpu = float("nan")
            if base and ddp and label != "none":
                ratio_wall = added_wall / (ddp["wall"] - base["wall"])
                ratio_cpu = added_cpu / (ddp["process_cpu"] - base["process_cpu"])
            m.update(added_wall=added_wall, added_cpu=added_cpu, added_wall_vs_ddp=ratio_wall,
                     added_cpu_vs_ddp=ratio_cpu)
            table_rows.append([name, label, round(1e3 * m["wall"], 2), round(1e3 * added_wall, 2),
                               round(1e3 * m["process_cpu"], 2), round(1e3 * added_cpu, 2),
                               round(1e3 * m["thread_cpu"], 2), round(ratio_wall, 3),
                               round(ratio_cpu, 3), round(m["calls"], 1), round(m["ops"], 1),
                               round(m["host_reads"], 2)])
    table = results.markdown_table(headers, table_rows)
    print(table, flush=True)
    if args.name:
        results.write(args.name, "Host cost per iteration: plain training, DDP and dear",
                      {"args": vars(args), "summary": summary, "runs": rows}, table, NOTES)


NOTES = """Medians over rounds of each round's median iteration (the slower rank's wall time);
CPU times are rank 0's. `added` = the method minus plain training (`none`, every rank alone, no
communication); `added / DDP's` = dear's added time over DDP's (the issue's target: at most 1.2).
process CPU counts every thread of the rank's process (dear's collective thread and Gloo's
included), thread CPU the training thread only. `dear calls`: Python calls into dear's package on
the training thread per iteration (sys.setprofile); `ATen ops`: operators per iteration on every
thread (torch's profiler, a separate pass); `host reads`: those of them that read a tensor's
value on the host (aten::_local_scalar_dense, item, equal, is_nonzero), each a host-device
synchronization on a GPU; plain training's count comes from its SGD and loss, not from a
framework."""


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_options(parser, methods=DEFAULT_METHODS, rounds=5, warmup=12, iters=40,
                    name="host_cost", timeout=1800.0, nproc=2)
    parser.add_argument("--models", default=DEFAULT_MODELS,
                        help="workloads of benchmarks.models (default: %(default)s)")
    parser.add_argument("--count-iters", type=int, default=5,
                        help="iterations of each counting pass (calls, ATen ops)")
    args = parser.parse_args(argv)
    return run_ranks(rank_main, args.nproc, (args, free_port()), timeout=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
