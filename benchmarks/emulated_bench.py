"""DeAR vs DDP, WFBP, Horovod and FSDP2 on an emulated accelerator (benchmarks.emulated).

Real gradient volumes; compute that sleeps and leaves the cores to the network.

    python -m benchmarks.emulated_bench --setups resnet50:2,bert_base:2 \
        --methods ddp,wfbp,horovod,fsdp2,dear,dear:first_bucket=2MB --rounds 3

A setup is MODEL:RANKS[:BANDWIDTH[:SCALE]] (defaults per setup in SETUPS). Each runs on the
emulated cluster (benchmarks.cluster: a network namespace per rank, tbf-shaped links; root) or,
without root or with --no-shaping, on loopback. In one run, interleaved in rounds (method order
rotated each round, so drift hits every method alike):
- T_comm: the fastest measured way to all-reduce the whole gradient (benchmarks.train's
  measure_comm: torch's all_reduce, or dear's reduce-scatter + all-gather);
- the compute time: --compute-ms, else T_comm x --balance (default 1: the balanced regime, where
  overlap decides everything); per-layer times from FLOPs (or --trace DIR: a dear.diagnose trace);
- T_compute: every rank trains the emulated model alone at once, no communication;
- every method: warm-up, then timed iterations, split into forward, backward and step.
Reported: median iteration, x T_lb (T_lb = max(T_compute, T_comm)), x DDP, DeAR's bound
max(T_fwd, T_comm/2) + max(T_bwd, T_comm/2), DDP's T_fwd + max(T_bwd, T_comm) and the layers'
dependency bound (benchmarks.emulated_report.dependency_bound; each method's "x dep bound");
where time goes (forward wait = forward - the forward alone, backward extra, step wait); CPU:
CPU seconds per iteration of each rank's process (all its threads) and the machine's busy cores
(/proc/stat, everything on the machine). Losses are compared with DDP's (same data, same
deterministic emulated gradients).

Methods: benchmarks/methods.py, the registry every benchmark shares: `NAME[:KEY=VALUE...]`,
e.g. `dear:first_bucket=2MB`, `wfbp:threshold=8MB`, `ddp:bucket_cap_mb=50`, and `clip=NORM` on any.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from benchmarks import cli, emulated, results, timing
from benchmarks.emulated_report import EXPLAIN, chart, summarize, table
from benchmarks.methods import Built, Committing, Method, horovod_installed, parse_methods

DEFAULT_METHODS = "ddp,wfbp,horovod,fsdp2,dear,dear:schedule=dear"
# (model, ranks) -> (bandwidth per host, scale). Scale: every parameter's first dimension divided
# by it. Rule: at most 4 Gbit/s in all through the emulated switch (2 x 2, 4 x 1, 8 x 0.5): above
# that this 2-core machine's cores saturate with the kernel's and Gloo's network work; the scale
# then brings T_comm back to about 1-2 s.
SETUPS: dict[tuple[str, int], tuple[str, int]] = {
    ("resnet50", 2): ("1gbit", 1), ("resnet50", 4): ("1gbit", 1), ("resnet50", 8): ("500mbit", 2),
    ("vgg16", 2): ("2gbit", 2), ("vgg16", 4): ("1gbit", 4), ("vgg16", 8): ("500mbit", 8),
    ("bert_base", 2): ("2gbit", 1), ("bert_base", 4): ("1gbit", 4),
    ("bert_base", 8): ("500mbit", 8),
}
OptFactory = Callable[[Any], torch.optim.Optimizer]


# ---------------------------------------------------------------- methods (benchmarks.methods)


def make_optimizer(update: str) -> OptFactory:
    return lambda params: emulated.EmulatedSGD(params, lr=0.01, momentum=0.9, update=update)


# ---------------------------------------------------------------- one method, one rank


def train(method: Method, model_spec: emulated.ModelSpec, warmup: int, iters: int,
          batch_size: int, update: str = "probe", plan_warmup: bool = True) -> dict[str, Any]:
    """Train a fresh emulated model with `method` on this rank: per-iteration times (total and
    forward / backward / step), losses, CPU use over the timed iterations, final parameters
    (update="full" only: to compare methods' numbers). plan_warmup: dear's planned schedule
    warms up until it runs its plan (losses still start at step 0: comparable with DDP's)."""
    started = time.perf_counter()
    warmup = max(warmup, _plan_warmup(method)) if plan_warmup else warmup
    model = emulated.EmulatedModel(model_spec)
    built = Built(method, model, make_optimizer(update))
    rows_sent: list[dict[str, tuple[int, int]]] = []

    def note_rows(step: int) -> None:              # tables sent by rows: how many went
        rows_sent.append(built.opt.row_sparse_stats())

    setup = time.perf_counter() - started
    run = timing.train_loop(built.net, built.opt, lambda step, rank: emulated.make_batch(
        step, rank, batch_size), emulated.loss_fn, warmup, iters, after_backward=built.clip,
        after_step=note_rows if built.is_dear else None)
    params = None
    if update == "full":
        if built.is_dear:
            built.opt.synchronize()                # the last step's updates, before reading
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = built.opt
    commit = ({"seconds": opt.commit_s, "mb": opt.state_mb()} if isinstance(opt, Committing)
              else None)
    del model
    built.finish()
    return {"times": run.times, "losses": run.losses, "warmup": warmup, "cpu_s": run.cpu_s,
            "wall_s": run.wall_s, "setup_s": setup,
            "teardown_s": time.perf_counter() - started - setup - run.wall_s,
            "machine_busy": run.machine_busy,
            "loadavg": os.getloadavg()[0], "params": params, "rows_sent": rows_sent,
            "commit": commit}


def _plan_warmup(method: Method) -> int:
    """dear's planned schedule runs DeAR's order for plan_after iterations, then plans, runs the
    plan as many iterations and checks it against the link (maybe planning again): time it only
    once it runs the checked plan (2 more iterations), not while it measures."""
    if method.base != "dear":
        return 0
    import dear
    cfg = dear.comm.runtime.config()
    if method.options.get("schedule", getattr(cfg, "schedule", "dear")) != "planned":
        return 0
    return 2 * int(method.options.get("plan_after", getattr(cfg, "plan_after", 0))) + 2


def compute_only(model_spec: emulated.ModelSpec, warmup: int, iters: int, batch_size: int
                 ) -> dict[str, Any]:
    """Every rank trains alone at once: the emulated compute with no communication."""
    model = emulated.EmulatedModel(model_spec)
    opt = make_optimizer("probe")(model.parameters())
    run = timing.train_loop(model, opt, lambda step, rank: emulated.make_batch(
        step, rank, batch_size), emulated.loss_fn, warmup, iters, barrier=False)
    return {"times": run.times}


# ---------------------------------------------------------------- the worker (every rank)


def worker(args: argparse.Namespace,
           before_rounds: Optional[Callable[[emulated.ModelSpec], dict[str, Any]]] = None) -> int:
    """One rank: the link measured, the model timed, then every method in interleaved rounds.
    `before_rounds(model_spec)` (benchmarks.emulated_validate: a dear.diagnose trace) runs on
    every rank once the model is timed; rank 0's return value goes into the report as "extra"."""
    import dear

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dear.init(backend="torch")
    rank, world = dist.get_rank(), dist.get_world_size()
    methods = parse_methods(args.methods)
    if any(m.base == "horovod" for m in methods) and "HOROVOD_RANK" not in os.environ:
        raise SystemExit("method 'horovod' needs Horovod's launcher (benchmarks.cluster "
                         "--horovod; the driver does it when Horovod is installed)")
    started = time.perf_counter()
    model_spec = dataclasses.replace(emulated.spec(args.model, args.scale), tokens=args.tokens)
    spec_s = time.perf_counter() - started
    comm = timing.measure_comm(model_spec.numel, args.comm_repeats)
    comm_s = time.perf_counter() - started - spec_s
    t = torch.tensor([min(comm.values()), comm["all_reduce"], comm["rs_ag"]])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)         # the slowest rank's view
    t_comm = t[0].item()
    comm = {"all_reduce": t[1].item(), "rs_ag": t[2].item()}
    compute_s = args.compute_ms / 1e3 if args.compute_ms else t_comm * args.balance
    if args.trace:
        model_spec = emulated.times_from_trace(model_spec, args.trace,
                                               compute_s if args.compute_ms else None)
    else:
        model_spec = model_spec.timed(compute_s, args.backward_factor)
    extra = before_rounds(model_spec) if before_rounds is not None else None
    runs: dict[str, list[dict[str, Any]]] = {m.label: [] for m in methods}
    compute: list[dict[str, Any]] = []
    for r in range(args.rounds):
        compute.append(compute_only(model_spec, args.warmup, args.iters, args.batch))
        shift = r % len(methods)
        for method in methods[shift:] + methods[:shift]:
            if rank == 0:
                print(f"emulated: {args.model} x{world} round {r + 1}: {method.label}",
                      file=sys.stderr, flush=True)
            runs[method.label].append(train(method, model_spec, args.warmup, args.iters,
                                            args.batch))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"runs": runs, "compute": compute})
    dear.shutdown()
    dist.destroy_process_group()
    if rank == 0:
        report = summarize(gathered, methods, model_spec, comm, t_comm, args)
        report["worker_s"] = {"spec": spec_s, "comm": comm_s,
                              "total": time.perf_counter() - started}
        if extra is not None:
            report["extra"] = extra
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2, default=str)
    return 0


# ---------------------------------------------------------------- the driver


def parse_setup(text: str) -> tuple[str, int, str, int]:
    parts = text.strip().split(":")
    model, nproc = parts[0], int(parts[1]) if len(parts) > 1 else 2
    if model not in emulated.MODELS:
        raise ValueError(f"unknown model {model!r} in setup {text!r}; expected one of "
                         f"{emulated.MODELS}")
    bandwidth, scale = SETUPS.get((model, nproc), ("1gbit", 1))
    if len(parts) > 2 and parts[2]:
        bandwidth = parts[2]
    if len(parts) > 3 and parts[3]:
        scale = int(parts[3])
    return model, nproc, bandwidth, scale


def run_setup(setup: str, args: argparse.Namespace, shaping: bool,
              module: str = "benchmarks.emulated_bench",
              worker_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """One setup on the emulated cluster; `module --worker ... worker_args` on every rank
    (benchmarks.emulated_validate passes its own module and options)."""
    from benchmarks.cluster import EmulatedCluster

    model, nproc, bandwidth, scale = parse_setup(setup)
    methods = args.methods
    use_hvd = "horovod" in [m.base for m in parse_methods(methods)]
    if use_hvd and not horovod_installed():
        methods = ",".join(m.label for m in parse_methods(methods) if m.base != "horovod")
        print("emulated: Horovod is not installed; skipping it (make horovod)", file=sys.stderr)
        use_hvd = False
    load_before = os.getloadavg()
    fd, out = tempfile.mkstemp(prefix="dear-emulated-", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", module, "--worker", "--out", out,
           "--model", model, "--scale", str(scale), "--methods", methods,
           "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--iters", str(args.iters),
           "--batch", str(args.batch), "--comm-repeats", str(args.comm_repeats),
           "--balance", str(args.balance), "--compute-ms", str(args.compute_ms),
           "--backward-factor", str(args.backward_factor), "--tokens", str(args.tokens)]
    if args.trace:
        cmd += ["--trace", args.trace]
    cmd += list(worker_args)
    try:
        for attempt in (1, 2):
            with EmulatedCluster(nproc, bandwidth, shaping=shaping, horovod=use_hvd,
                                 congestion=args.congestion) as cluster:
                measured = cluster.measure_bandwidth() if shaping and nproc >= 2 else None
                if measured:
                    print(f"emulated: {model} x{nproc}: link requested {bandwidth}, measured "
                          f"{measured / 1e9:.3f} Gbit/s", file=sys.stderr, flush=True)
                code = cluster.run(cmd, timeout=args.timeout)
                congestion = cluster.congestion or "system"
            if code == 0:
                break
            # Horovod's second hvd.init() in a process used to abort on a Gloo "connection
            # refused" (its rendezvous server's bug, fixed in benchmarks/cluster.py); one more
            # try for whatever else fails once.
            print(f"emulated: {setup} failed (exit {code})"
                  + ("; trying once more" if attempt == 1 and code != 124 else ""),
                  file=sys.stderr, flush=True)
            if code == 124:
                break
        if code != 0:
            raise SystemExit(f"emulated: {setup} failed (exit {code})")
        with open(out) as fh:
            report = json.load(fh)
    finally:
        os.remove(out)
    report.update(setup=setup, bandwidth_requested=bandwidth if shaping else None,
                  congestion=congestion if shaping else None,
                  shaping=shaping, loadavg_before=load_before, loadavg_after=os.getloadavg())
    return report


def parse_args(argv: Optional[list[str]] = None,
               extend: Optional[Callable[[argparse.ArgumentParser], None]] = None
               ) -> argparse.Namespace:
    """`extend` adds a caller's own options (benchmarks.emulated_validate)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setups", default="resnet50:2",
                   help="MODEL:RANKS[:BANDWIDTH[:SCALE]],... (defaults per setup: SETUPS)")
    cli.add_options(p, methods=DEFAULT_METHODS, rounds=3, warmup=2, iters=6, name="emulated",
                    timeout=1200.0, shaping=True)
    p.add_argument("--batch", type=int, default=32, help="nominal batch per rank (samples/s)")
    p.add_argument("--comm-repeats", type=int, default=3)
    p.add_argument("--balance", type=float, default=1.0,
                   help="compute time = T_comm x this (unless --compute-ms)")
    p.add_argument("--compute-ms", type=float, default=0.0)
    p.add_argument("--backward-factor", type=float, default=emulated.BACKWARD_FACTOR)
    p.add_argument("--trace", default="", help="per-layer times from this dear.diagnose trace")
    p.add_argument("--tokens", type=int, default=0,
                   help="token positions per batch and rank: the word embedding's gradient is "
                        "non-zero only in the rows they look up (0: dense)")
    p.add_argument("--congestion", default="auto",
                   help="TCP congestion control of the ranks: auto (loss-based; why: "
                        "benchmarks/cluster.py), a name, or system")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    p.add_argument("--model", default="resnet50", help=argparse.SUPPRESS)
    p.add_argument("--scale", type=int, default=1, help=argparse.SUPPRESS)
    if extend is not None:
        extend(p)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    parse_methods(args.methods)                    # fail early on a typo
    setups = [s for s in args.setups.split(",") if s.strip()]
    for s in setups:
        parse_setup(s)
    from benchmarks.cluster import check_can_shape
    shaping = not args.no_shaping
    if shaping and (why := check_can_shape()):
        print(f"emulated: {why}; running on loopback (unshaped)", file=sys.stderr)
        shaping = False
    reports = [run_setup(s, args, shaping) for s in setups]
    text, notes = table(reports)
    print(text)
    print(notes)
    results.write(args.name, "DeAR vs baselines on an emulated accelerator",
                  {"shaping": shaping, "reports": reports}, text, f"{notes}\n\n{EXPLAIN}",
                  figure=chart(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
