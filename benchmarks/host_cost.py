"""Host cost: what plain training, DDP and dear spend on the host per iteration, at shapes where
host work, not compute or the link, sets the pace.

ResNet-50's module structure (161 parameter tensors, 107 modules holding them) at width 8 on
32x32 images, and BERT-Base's layout (201 parameter tensors: embeddings, 12 encoder layers,
pooler, classifier) at hidden size 64: the same hooks, buckets and optimizer calls as the real
models, a few MB of gradient. 2 Gloo ranks on loopback, one thread each, each rank pinned to a
core; every method built once, then timed in blocks of iterations, the methods' blocks
interleaved (order rotated) so that the machine's drift hits every method alike.

Per method and iteration (steady state: after the warm-up, 40 iterations by default, so dear's
planned schedule has settled: planned after 4 (on loopback here, where the link is the cores'
own work, usually no plan: DeAR's order), checked after 8, and with DEAR_PLAN_VERIFY=1 tried
against DeAR's order for 24 more; docs/planned-schedule.md):
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

On a GPU (`--device cuda --nproc 1`): the same methods at one rank on real shapes, e.g.
`--models resnet50@32,resnet50@128,bert_base@32 --autocast bf16` (NAME@BATCH), torchrun's
variables for a world of one, so DDP and dear run on NCCL. A block is then timed as a whole
(synchronized before and after, its mean iteration kept): the host may run ahead of the device
inside it, as in training. `syncs`: the host-device synchronizations per iteration that
`torch.cuda.set_sync_debug_mode("warn")` reports. At one rank dear's communicator replaces its
collectives with a copy (the reduce-scatter) and nothing (the all-gather) while DDP issues its
NCCL all-reduce; the method option `collectives_at_one=true` (this benchmark's, not dear's)
makes dear issue its NCCL reduce-scatters and all-gathers as at any other size: dear's general
path.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import warnings
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


_COLLECTIVES_AT_ONE = [False]     # the running method's collectives_at_one (one thread steps)


def issue_collectives_at_one() -> None:
    """An experiment, not an option of dear: while _COLLECTIVES_AT_ONE[0], dear's
    torch.distributed communicator issues its reduce-scatters and all-gathers in a world of one
    (NCCL's, as at any other size) instead of its copy and no-op."""
    from dear.comm.base import CallbackWork
    from dear.comm.torch_dist import TorchCommunicator
    reduce_scatter, all_gather = TorchCommunicator.reduce_scatter, TorchCommunicator.all_gather

    def general(comm: Any, tensor: torch.Tensor) -> bool:
        return (_COLLECTIVES_AT_ONE[0] and comm.size == 1
                and not comm.pieces_in_place(tensor))

    def rs(self: Any, input: torch.Tensor, output: torch.Tensor) -> Any:
        if not general(self, input):
            return reduce_scatter(self, input, output)
        return CallbackWork([dist.reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM,
                                                        async_op=True)])

    def ag(self: Any, input: torch.Tensor, output: torch.Tensor) -> Any:
        if not general(self, input):
            return all_gather(self, input, output)
        if output.data_ptr() != input.data_ptr():
            output[:input.numel()].copy_(input)
        return CallbackWork([dist.all_gather_into_tensor(output, output[:input.numel()],
                                                         async_op=True)])

    TorchCommunicator.reduce_scatter, TorchCommunicator.all_gather = rs, ag  # type: ignore
    # and its buckets keep a shard beside the buffer, as at any other size (the layout is
    # built inside the method's first steps, while its flag is set)
    TorchCommunicator.in_place_alone = property(  # type: ignore[assignment]
        lambda self: not _COLLECTIVES_AT_ONE[0])


class Runner:
    """One method on a fresh model: its step, timed one iteration at a time (on a GPU: a block
    at a time)."""

    def __init__(self, method: Method, workload: models.Workload, rank: int,
                 args: argparse.Namespace) -> None:
        torch.manual_seed(0)
        options = dict(method.options)
        self.collectives_at_one = bool(options.pop("collectives_at_one", False))
        self.method = method
        self.workload = workload
        self.device = torch.device(args.device)
        self.autocast = args.autocast
        model = workload.make_model().to(self.device)
        self.built = Built(dataclasses.replace(method, options=options), model,
                           lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9))
        gen = torch.Generator().manual_seed(1000 + rank)
        self.batches = [tuple(t.to(self.device) for t in workload.make_batch(gen))
                        for _ in range(4)]
        self.k = 0
        self.walls: list[float] = []
        self.threads: list[float] = []
        self.processes: list[float] = []
        self.blocks: list[tuple[float, float, float]] = []   # per block: its medians

    def step(self) -> None:
        built = self.built
        x, y = self.batches[self.k % len(self.batches)]
        self.k += 1
        _COLLECTIVES_AT_ONE[0] = self.collectives_at_one
        built.opt.zero_grad()
        with self.autocasting():
            loss = self.workload.loss(built.net(x), y)
        loss.backward()
        built.clip()
        built.opt.step()

    def autocasting(self) -> Any:
        if self.autocast == "none":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, n: int = 1) -> None:
        """`n` iterations timed as one (synchronized before and after on a GPU), each kept at
        their mean."""
        self.sync()
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        for _ in range(n):
            self.step()
        self.sync()
        self.walls += [(time.perf_counter() - t0) / n] * n
        self.threads += [(time.thread_time() - c0) / n] * n
        self.processes += [(time.process_time() - p0) / n] * n

    def counts(self, iters: int) -> dict[str, Any]:
        with CallCounter() as counter:
            for _ in range(iters):
                self.step()
        flush = getattr(self.built.opt, "flush_updates", None)
        if flush is not None:
            flush()                            # the window starts with nothing in flight
        ops = op_counts(self.step, iters, flush)
        return {"calls": counter.calls / iters, "ops": sum(ops.values()) / iters,
                "host_reads": sum(ops[name] for name in HOST_READS) / iters,
                "host_reads_by_op": {name: ops[name] / iters for name in HOST_READS
                                     if ops[name]},
                **self.syncs(iters)}

    def syncs(self, iters: int) -> dict[str, Any]:
        """Host-device synchronizations per iteration (CUDA's sync debug mode; NaN on CPU),
        and where they were called from (file:line: the Python line that made each)."""
        if self.device.type != "cuda":
            return {"syncs": float("nan"), "sync_sites": {}}
        self.sync()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(iters):
                    self.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        self.sync()
        found = [w for w in caught if "synchroniz" in str(w.message)]
        sites = collections.Counter(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in found)
        return {"syncs": len(found) / iters,
                "sync_sites": {k: v / iters for k, v in sites.most_common(8)}}

    def block(self, n: int) -> None:
        """`n` timed iterations; their medians kept as one block's (on a GPU: the block timed
        as a whole, its mean iteration kept)."""
        walls, threads, processes = len(self.walls), len(self.threads), len(self.processes)
        if self.device.type == "cuda":
            self.timed(n)
        else:
            for _ in range(n):
                self.timed()
        self.blocks.append((statistics.median(self.walls[walls:]),
                            statistics.median(self.threads[threads:]),
                            statistics.median(self.processes[processes:])))

    def result(self) -> dict[str, Any]:
        return {"wall": statistics.median(self.walls),
                "thread_cpu": statistics.median(self.threads),
                "process_cpu": statistics.median(self.processes),
                "blocks": self.blocks}


def measure(workload: models.Workload, methods: list[Method], args: argparse.Namespace,
            rank: int) -> dict[str, dict[str, Any]]:
    """Every method built once, warmed up, then timed in blocks of `args.block` iterations,
    the methods' blocks interleaved (order rotated each time) so that the machine's drift
    (these shared machines run at different speeds from one minute to the next) hits them
    alike; medians over all their timed iterations."""
    runners = [Runner(m, workload, rank, args) for m in methods]
    for runner in runners:
        for _ in range(args.warmup):
            runner.step()
    for b in range(args.blocks):
        dist.barrier()
        for runner in runners[b % len(runners):] + runners[:b % len(runners)]:
            runner.block(args.block)
    out = {}
    for runner in runners:
        got = out[runner.method.label] = {**runner.result(), **runner.counts(args.count_iters)}
        got["wall"] = slowest(got["wall"])
        walls = torch.tensor([w for w, _, _ in got["blocks"]], dtype=torch.float64)
        dist.all_reduce(walls, op=dist.ReduceOp.MAX)          # per block, the slower rank
        got["blocks"] = [(w, t, p) for w, (_, t, p) in zip(walls.tolist(), got["blocks"])]
        runner.built.finish()
    return out


def workload(spec: str) -> models.Workload:
    """NAME or NAME@BATCH: a workload of benchmarks.models, at its own batch or BATCH."""
    name, _, batch = spec.partition("@")
    return models.build(name, batch_size=int(batch) if batch else None)


def slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    elif args.pin and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})   # one core each: less migration
    dear.init()
    methods = parse_methods(args.methods)
    if any(m.options.get("collectives_at_one") for m in methods):
        issue_collectives_at_one()
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    rows = {name: measure(workload(name), methods, args, rank) for name in names}
    if rank == 0:
        report(args, rows)
    dear.shutdown()


def _added(per_method: dict[str, dict[str, Any]], label: str, k: int) -> float:
    """What `label` adds to plain training: the median over blocks of its block's median
    minus the plain block's of the same cycle (paired: the machine's drift cancels)."""
    if "none" not in per_method:
        return float("nan")
    pairs = zip(per_method[label]["blocks"], per_method["none"]["blocks"])
    return statistics.median(mine[k] - plain[k] for mine, plain in pairs)


def report(args: argparse.Namespace, rows: dict[str, dict[str, dict[str, Any]]]) -> None:
    headers = ["model", "method", "wall (ms)", "added wall (ms)", "process CPU (ms)",
               "added CPU (ms)", "thread CPU (ms)", "added wall / DDP's", "added CPU / DDP's",
               "dear calls", "ATen ops", "host reads", "syncs", "wall / DDP's"]
    table_rows, summary = [], {}
    for name, per_method in rows.items():
        med = {m: {k: got[k] for k in ("wall", "process_cpu", "thread_cpu", "calls", "ops",
                                        "host_reads", "syncs", "sync_sites")}
               for m, got in per_method.items()}
        base = med.get("none")
        ddp = med.get("ddp")
        summary[name] = med
        for label, m in med.items():
            added_wall = _added(per_method, label, 0)
            added_cpu = _added(per_method, label, 2)
            ratio_wall = ratio_cpu = float("nan")
            if base and ddp and label != "none":
                ratio_wall = added_wall / _added(per_method, "ddp", 0)
                ratio_cpu = added_cpu / _added(per_method, "ddp", 2)
            m.update(added_wall=added_wall, added_cpu=added_cpu, added_wall_vs_ddp=ratio_wall,
                     added_cpu_vs_ddp=ratio_cpu)
            table_rows.append([name, label, round(1e3 * m["wall"], 2), round(1e3 * added_wall, 2),
                               round(1e3 * m["process_cpu"], 2), round(1e3 * added_cpu, 2),
                               round(1e3 * m["thread_cpu"], 2), round(ratio_wall, 3),
                               round(ratio_cpu, 3), round(m["calls"], 1), round(m["ops"], 1),
                               round(m["host_reads"], 2), round(m["syncs"], 2),
                               round(m["wall"] / ddp["wall"], 3) if ddp else float("nan")])
    table = results.markdown_table(headers, table_rows)
    print(table, flush=True)
    for name, med in summary.items():
        for label, m in med.items():
            if m["sync_sites"]:
                print(f"syncs of {name} {label} per iteration, by caller: {m['sync_sites']}")
    if args.name:
        results.write(args.name, "Host cost per iteration: plain training, DDP and dear",
                      {"args": vars(args), "summary": summary, "runs": rows}, table, NOTES)


NOTES = """Every method built once and warmed up, then timed in interleaved blocks (order
rotated each block); medians over all timed iterations (wall: the slower rank's); CPU times are
rank 0's, each rank pinned to its own core (--no-pin: not). `added` = what the method adds to
plain training (`none`, every rank alone, no communication): the median over cycles of its
block's median minus the plain block's of the same cycle (paired, so the machine's drift
cancels); `added / DDP's` = dear's added time over DDP's (the issue's target: at most 1.2).
process CPU counts every thread of the rank's process (dear's collective thread and Gloo's
included), thread CPU the training thread only. `dear calls`: Python calls into dear's package on
the training thread per iteration (sys.setprofile); `ATen ops`: operators per iteration on every
thread (torch's profiler, a separate pass); `host reads`: those of them that read a tensor's
value on the host (aten::_local_scalar_dense, item, equal, is_nonzero), each a host-device
synchronization on a GPU; plain training's count comes from its SGD and loss, not from a
framework. `syncs` (GPU only): synchronizations per iteration reported by
torch.cuda.set_sync_debug_mode("warn"); `wall / DDP's`: the method's iteration over DDP's (on a
GPU the issue's target for dear: at most 1.05)."""


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_options(parser, methods=DEFAULT_METHODS, warmup=40, name="host_cost",
                    timeout=1800.0, nproc=2)
    parser.add_argument("--blocks", type=int, default=12,
                        help="timed blocks per method, the methods' blocks interleaved")
    parser.add_argument("--block", type=int, default=8, help="iterations per block")
    parser.add_argument("--models", default=DEFAULT_MODELS,
                        help="workloads of benchmarks.models (default: %(default)s)")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="leave the ranks unpinned (default: rank r on the r-th core)")
    parser.add_argument("--count-iters", type=int, default=5,
                        help="iterations of each counting pass (calls, ATen ops, syncs)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where models and batches live (cuda: rank r on GPU r, NCCL)")
    parser.add_argument("--autocast", choices=("none", "bf16"), default="none",
                        help="forward and loss under torch.autocast to bfloat16")
    args = parser.parse_args(argv)
    return run_ranks(rank_main, args.nproc, (args, free_port()), timeout=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
