"""Framework overhead with and without dear's native extension, against DDP.

The model of benchmarks/overhead.py (500 x Linear(32, 32): 1000 parameter tensors, 2 MB of
gradient), 2 ranks on loopback. Methods, interleaved round by round so drift hits all alike:
`none` (one rank's forward + backward + SGD step, no communication: the floor), `ddp`,
`dear-python` (DEAR_NATIVE=0) and `dear-native` (the C++ bookkeeping and pack of csrc/).
Overhead = median iteration - `none`. With --profile, rank 0 also runs each DeAR variant under
cProfile and reports where the time outside torch's own compute goes (hooks, pack, update).

    python -m benchmarks.overhead_native [--layers 500] [--iters 40] [--rounds 5] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import dataclasses
import io
import os
import pstats
import statistics
import sys
import time
from typing import Iterator

import torch
import torch.nn.functional as F

import dear
from benchmarks import cli, results
from benchmarks.launch import free_port, run_ranks
from benchmarks.overhead import build
from dear import native
from dear.comm import runtime

METHODS = ("none", "ddp", "dear-python", "dear-native")


@contextlib.contextmanager
def native_path(enabled: bool) -> Iterator[None]:
    """Buckets built inside take the native (or Python) path: what DEAR_NATIVE=1/0 selects at
    dear.init(), switched here without restarting the process group."""
    saved = runtime._state.config
    runtime._state.config = dataclasses.replace(saved, native=enabled)
    try:
        yield
    finally:
        runtime._state.config = saved


def train(method: str, args: argparse.Namespace, iters: int) -> list[float]:
    model = build(args.layers, args.width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    net: torch.nn.Module = model
    if method == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
    elif method.startswith("dear"):
        opt = dear.DistributedOptimizer(opt, model=model)
    x = torch.randn(args.batch, args.width)
    times = []
    with native_path(method == "dear-native"):
        for _ in range(iters):
            start = time.perf_counter()
            opt.zero_grad()
            F.mse_loss(net(x), x).backward()
            opt.step()
            times.append(time.perf_counter() - start)
        if method.startswith("dear"):
            opt.synchronize()
            assert (opt.dear_engine.buckets[0]._ready is not None) == (method == "dear-native")
    return times[iters // 4:]


# (label, file suffix or "", function name or the text inside a built-in's name)
_PROFILED = [
    ("backward: autograd engine, hooks included", "", "run_backward"),
    ("backward: gradient hooks (engine.post_backward)", "engine.py", "post_backward"),
    ("backward: Bucket.pack", "bucket.py", "pack"),
    ("forward: pre-hooks (engine.pre_forward)", "engine.py", "pre_forward"),
    ("forward: Linear kernels", "", "torch._C._nn.linear"),
    ("update: engine.apply (SGD step included)", "engine.py", "apply"),
    ("update: torch SGD arithmetic", "sgd.py", "_single_tensor_sgd"),
    ("step(): reduce-scatter finish, all-gather start", "steps.py", "step"),
    ("iteration (profiled)", "overhead_native.py", "train"),
]


def profile(method: str, args: argparse.Namespace) -> dict[str, float]:
    """ms per iteration (cProfile's inflated clock, cumulative) in the functions that make the
    overhead."""
    prof = cProfile.Profile()
    prof.enable()
    train(method, args, args.profile_iters)
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO()).stats  # type: ignore[attr-defined]
    out: dict[str, float] = {}
    for (filename, _, name), (_, _, _, cumtime, _) in stats.items():
        for label, suffix, wanted in _PROFILED:
            builtin = filename == "~" and wanted in name
            if builtin or (filename.endswith(suffix) and name == wanted and suffix):
                out[label] = out.get(label, 0.0) + 1e3 * cumtime / args.profile_iters
    return {label: round(out.get(label, 0.0), 2) for label, _, _ in _PROFILED}


def micro(args: argparse.Namespace) -> dict[str, float]:
    """One process, one bucket holding the model's 1000 gradients: pack them as the hooks do,
    reduce-scatter and all-gather on a world of one, unpack. Isolates what the extension
    replaces from the hooks and the model; median microseconds per iteration."""
    from dear.comm.local import LocalCommunicator
    from dear.fusion.bucket import Bucket
    from dear.fusion.planner import plan_buckets
    torch.set_num_threads(1)
    params = list(build(args.layers, args.width).parameters())
    grads = [torch.randn_like(p) for p in params]
    spec, = plan_buckets(params, list(range(len(params))), 1 << 30, 1)
    comm, out = LocalCommunicator(), {}
    for label, use_native in (("python", False), ("native", True)):
        bucket = Bucket(spec, params, native=use_native)
        times = []
        for _ in range(args.micro_reps):
            start = time.perf_counter()
            for j in reversed(range(len(params))):
                bucket.pack(j, grads[j])
                assert not bucket.full or j == 0
            bucket.start_reduce_scatter(comm, 1.0)
            bucket.finish_reduce_scatter(1.0)
            bucket.start_all_gather(comm)
            bucket.finish_all_gather()
            bucket.reset()
            times.append(time.perf_counter() - start)
        out[label] = 1e6 * statistics.median(times)
    return out


def hook_costs(args: argparse.Namespace) -> dict[str, float]:
    """What a Python-hook design pays before doing any work: forward + backward of the model
    bare, with a no-op Python post-accumulate-grad hook on every parameter (what dear's
    gradient hooks ride on), and with a no-op forward pre-hook on every module (what its
    deferred update rides on). Median ms, one process, interleaved."""
    torch.set_num_threads(1)
    x = torch.randn(args.batch, args.width)
    variants = {"bare": build(args.layers, args.width)}
    grad_hooked = build(args.layers, args.width)
    for p in grad_hooked.parameters():
        p.register_post_accumulate_grad_hook(lambda p: None)
    variants["no-op gradient hooks"] = grad_hooked
    fwd_hooked = build(args.layers, args.width)
    for m in fwd_hooked:
        m.register_forward_pre_hook(lambda m, a: None)
    variants["no-op forward pre-hooks"] = fwd_hooked
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.micro_reps // 4):
        for name, model in variants.items():
            start = time.perf_counter()
            F.mse_loss(model(x), x).backward()
            times[name].append(time.perf_counter() - start)
            model.zero_grad()
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def phases(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Where the time goes, without a profiler's inflation: one process, world of one (the
    collectives are local copies), median ms of each phase of an iteration. For DeAR, forward
    includes the deferred update of the previous step, backward the gradient hooks and packing,
    step() the end of the reduce-scatters and the start of the all-gathers."""
    torch.set_num_threads(1)
    dear.init(backend="local")
    x = torch.randn(args.batch, args.width)
    out: dict[str, dict[str, float]] = {}
    try:
        for method in ("plain", "dear-python", "dear-native"):
            model = build(args.layers, args.width)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            if method != "plain":
                opt = dear.DistributedOptimizer(opt, model=model)
            t: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}
            with native_path(method == "dear-native"):
                for it in range(args.micro_reps // 4 + 5):
                    opt.zero_grad()
                    t0 = time.perf_counter()
                    loss = F.mse_loss(model(x), x)
                    t1 = time.perf_counter()
                    loss.backward()
                    t2 = time.perf_counter()
                    opt.step()
                    t3 = time.perf_counter()
                    if it >= 5:
                        for k, v in zip(t, (t1 - t0, t2 - t1, t3 - t2)):
                            t[k].append(v)
            out[method] = {k: round(1e3 * statistics.median(v), 2) for k, v in t.items()}
            out[method]["total"] = round(sum(out[method].values()), 2)
    finally:
        dear.shutdown()
    return out


def rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dear.init()
    medians: dict[str, list[float]] = {m: [] for m in METHODS}
    for _ in range(args.rounds):
        for method in METHODS:
            medians[method].append(statistics.median(train(method, args, args.iters)))
    profiles = {}
    micro_us, hooks_ms, phase_ms = args.single_process
    if args.profile:
        for method in ("dear-python", "dear-native"):
            profiles[method] = profile(method, args)
    if rank == 0:
        ms = {m: 1e3 * statistics.median(v) for m, v in medians.items()}
        rows = [[m, round(ms[m], 2), round(ms[m] - ms["none"], 2),
                 round((ms[m] - ms["none"]) / max(ms["ddp"] - ms["none"], 1e-9), 2),
                 round(ms[m] / ms["ddp"], 3)] for m in METHODS]
        headers = ["method", "median iteration (ms)", "overhead vs none (ms)",
                   "overhead / DDP's", "iteration / DDP's"]
        table = results.markdown_table(headers, rows)
        if profiles:
            keys = [label for label, _, _ in _PROFILED]
            table += "\n\ncProfile, rank 0, ms per iteration (cumulative; cProfile inflates " \
                     "Python-heavy code):\n\n" + results.markdown_table(
                         ["where", *profiles], [[k, *[p.get(k, "") for p in profiles.values()]]
                                                for k in keys])
        n = 2 * args.layers
        table += (f"\n\nOne bucket of {n} gradients, pack + collectives on a world of one + "
                  f"unpack, one process, median of {args.micro_reps}: Python path "
                  f"{micro_us['python']:.0f} us ({micro_us['python'] / n:.2f} us/gradient), "
                  f"native {micro_us['native']:.0f} us ({micro_us['native'] / n:.2f} "
                  f"us/gradient), ratio {micro_us['native'] / micro_us['python']:.2f}.")
        bare = hooks_ms["bare"]
        table += ("\n\nForward + backward, one process, median ms: " + ", ".join(
            f"{k} {v:.2f}" + ("" if k == "bare" else f" (+{v - bare:.2f})")
            for k, v in hooks_ms.items()) + ".")
        table += ("\n\nPhases of one iteration, one process, world of one (plain torch: "
                  "SGD in step(); DeAR: the update runs in the next forward), median ms:\n\n"
                  + results.markdown_table(["method", "forward", "backward", "step", "total"],
                                           [[m, *v.values()] for m, v in phase_ms.items()]))
        print(table)
        results.write(args.name, "Framework overhead: DeAR with and without the native "
                      "extension vs DDP", {"args": vars(args), "median_ms": ms,
                                           "rounds_ms": {m: [1e3 * v for v in vals]
                                                         for m, vals in medians.items()},
                                           "profile_ms": profiles, "micro_us": micro_us,
                                           "hook_costs_ms": hooks_ms, "phases_ms": phase_ms,
                                           "native": native.build_info()}, table,
                      f"{args.layers} x Linear({args.width},{args.width}) "
                      f"({2 * args.layers} parameter tensors), batch {args.batch}, "
                      f"{args.nproc} ranks on loopback (Gloo), torch.set_num_threads(1), SGD; "
                      f"median over {args.rounds} rounds of the median of {args.iters} "
                      "iterations (first quarter dropped). Methods are interleaved per round.")
    dear.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_options(parser, nproc=2, rounds=5, iters=40, name="overhead_native", timeout=1200.0)
    parser.add_argument("--layers", type=int, default=500)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-iters", type=int, default=20)
    parser.add_argument("--micro-reps", type=int, default=200)
    args = parser.parse_args(argv)
    if not native.native_available():
        print(f"error: the native extension is not built ({native.load_error()})",
              file=sys.stderr)
        return 1
    # Single-process measurements first, in this process, with nothing else running.
    args.single_process = (micro(args), hook_costs(args), phases(args))
    return run_ranks(rank_main, args.nproc, (args, free_port()), timeout=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
