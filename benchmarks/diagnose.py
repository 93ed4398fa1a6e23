"""dear.diagnose on the emulated cluster: the tracer's overhead, the watcher's precision, and
the paper's scaling predicted. (The replay validated against measurement: benchmarks.
diagnose_rounds on real CPU compute, benchmarks.emulated_validate on the emulated accelerator.)

    python -m benchmarks.diagnose overhead   iteration time with and without the tracer,
        alternating blocks -> benchmarks/results/diagnose_overhead.{json,md}
    python -m benchmarks.diagnose paper --trace resnet50=DIR --trace bert_base=DIR
        DeAR vs DDP vs WFBP at 16 and 64 workers, 10 and 100 Gbit/s, next to the DeAR paper
    python -m benchmarks.diagnose precision   how late the watcher stamps a completion
    python -m benchmarks.diagnose run --out DIR ...   (one rank; what the others launch)

Run timing commands alone on the machine (`flock -x /tmp/dear.lock ...`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from benchmarks import cli

DEFAULT_WORKDIR = "/tmp/dear-diagnose"
METHODS = "dear,ddp,wfbp,allreduce"


# ----------------------------------------------------------------------------- one rank
def trace_window(net: Any, opt: Any, batch: Callable, loss_fn: Callable, step: int, where: str,
                 iterations: int) -> int:
    """Trace `iterations` iterations into `where`, starting at batch `step`; returns the next
    batch. Iteration 0 runs traced but unrecorded (so the all-gathers iteration 1 waits for are
    traced ones) and one more runs after the window (so the last one's complete)."""
    from benchmarks.timing import time_steps
    from dear import diagnose
    with diagnose.trace(net, opt, out=where, iterations=range(1, 1 + iterations)):
        time_steps(net, opt, batch, loss_fn, iterations + 2, step)
    return step + iterations + 2


def run(args: argparse.Namespace) -> int:
    """Per method: warm-up, untraced timed iterations, then a traced window (own directory);
    with --overhead-rounds, alternating untraced and traced blocks of --iters iterations."""
    import dear
    from benchmarks.methods import Built, parse_method
    from benchmarks.timing import slowest_median, time_steps, warm_up
    from benchmarks.train import make_sgd, workload
    from dear import diagnose
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dear.init(backend="torch")
    rank = dist.get_rank()
    build, blocks, batch, loss_fn = workload(args)
    out: dict[str, Any] = {"bandwidth_measured_bps":
                           float(os.environ.get("BENCH_CLUSTER_BANDWIDTH_MEASURED", 0)) or None,
                           "methods": {}}
    step = 0
    for method in args.methods.split(","):
        built = Built(parse_method(method), build(), make_sgd, blocks)
        net, opt = built.net, built.opt
        step = warm_up(net, opt, batch, loss_fn, args.warmup, step)
        plain, traced = [], []
        for round_ in range(max(args.overhead_rounds, 1)):
            plain += time_steps(net, opt, batch, loss_fn, args.iters, step)
            step += args.iters
            if args.overhead_rounds:
                where = os.path.join(args.out, "overhead", f"{method}-{round_}")
                with diagnose.trace(net, opt, out=where, iterations=range(0, args.iters)):
                    traced += time_steps(net, opt, batch, loss_fn, args.iters, step)
                step += args.iters
                # The ranks wrote their traces: start the next plain block together, one
                # untimed iteration after the barrier (barrier_before_timing says why).
                dist.barrier()
                time_steps(net, opt, batch, loss_fn, 1, step)
                step += 1
        res: dict[str, Any] = {"median_s": slowest_median(plain), "times": plain}
        if traced:
            res["traced_median_s"] = slowest_median(traced)
            res["traced_times"] = traced
        if args.trace_iters:
            step = trace_window(net, opt, batch, loss_fn, step, os.path.join(args.out, method),
                                args.trace_iters)
        if built.is_dear:
            opt.flush_updates()
        out["methods"][method] = res
        dist.barrier()
        del net, opt
        built.finish()
    dear.shutdown()
    dist.destroy_process_group()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "measured.json"), "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


# ------------------------------------------------------------------------------- driver
def _launch(args: argparse.Namespace, bandwidth: str, out: str, extra: list[str]) -> dict:
    if getattr(args, "reuse", False) and os.path.exists(os.path.join(out, "measured.json")):
        print(f"reusing {out}", flush=True)
        with open(os.path.join(out, "measured.json")) as fh:
            return json.load(fh)
    cmd = [sys.executable, "-m", "benchmarks.cluster", "--nproc", "2", "--bandwidth", bandwidth,
           "--timeout", str(args.timeout), "--", sys.executable, "-m", "benchmarks.diagnose",
           "run", "--out", out, "--model", args.model, "--batch", str(args.batch),
           "--warmup", str(args.warmup), "--iters", str(args.iters)] + _knob_args(args) + extra
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    with open(os.path.join(out, "measured.json")) as fh:
        return json.load(fh)


def _knob_args(args: argparse.Namespace) -> list[str]:
    out = []
    if args.image_size:
        out += ["--image-size", str(args.image_size)]
    if args.seq_len:
        out += ["--seq-len", str(args.seq_len)]
    return out


def overhead(args: argparse.Namespace) -> int:
    from benchmarks import results
    out = os.path.join(args.workdir, f"overhead-{args.model}-{args.trace_bandwidth}")
    measured = _launch(args, args.trace_bandwidth, out,
                       ["--methods", args.methods, "--trace-iters", "0",
                        "--overhead-rounds", str(args.rounds)])
    rows, data = [], {}
    for method, res in measured["methods"].items():
        plain, traced = res["median_s"], res["traced_median_s"]
        rows.append([method, round(plain * 1e3, 1), round(traced * 1e3, 1),
                     f"{traced / plain - 1:+.2%}"])
        data[method] = {"untraced_median_s": plain, "traced_median_s": traced,
                        "overhead": traced / plain - 1}
    sizes = []
    for d, _, files in os.walk(os.path.join(out, "overhead")):
        sizes += [os.path.getsize(os.path.join(d, f)) for f in files if f.endswith(".json")]
    table = results.markdown_table(["method", "untraced (ms)", "traced (ms)", "overhead"], rows)
    notes = (f"Model {args.model} (batch {args.batch}, {_knob_args(args)}), 2 ranks on the "
             f"emulated cluster at {args.trace_bandwidth}; {args.rounds} rounds of {args.iters} "
             f"untraced then {args.iters} traced iterations (medians over all rounds, slowest "
             f"rank). Trace size: {statistics.mean(sizes) / 1e3:.0f} kB per rank for "
             f"{args.iters} iterations.")
    print(table)
    print(notes)
    results.write(args.name or "diagnose_overhead", "dear.diagnose: tracing overhead",
                  {"args": vars(args), "methods": data, "measured": measured}, table, notes)
    return 0


def profile(args: argparse.Namespace) -> int:
    """One process, plain SGD, no network: a compute profile for `paper` (seconds per layer)."""
    from benchmarks.train import make_sgd, workload
    from dear import diagnose
    torch.set_num_threads(args.threads)
    build, _, batch, loss_fn = workload(args)
    model = build()
    opt = make_sgd(model.parameters())
    with diagnose.trace(model, opt, out=args.out, iterations=range(1, 1 + args.trace_iters)):
        for step in range(args.trace_iters + 1):
            x, y = batch(step, 0)
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
    print(f"profile of {args.model}: {args.out}")
    return 0


def _precision_rank(rank: int, port: int, rounds: int, out: str) -> None:
    """Rank 1 sends a small message at a known time; rank 0 has the watcher wait for it while
    its training thread sleeps, runs torch kernels (GIL released) or pure Python (GIL held)."""
    from dear.diagnose.comm import CompletionWatcher, _Relay
    from dear.diagnose.recorder import CollectiveKind, CollectiveRecord
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    clock = time.perf_counter_ns                  # one host: the same CLOCK_MONOTONIC
    watcher = CompletionWatcher(clock)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    loads = {"sleep": lambda: time.sleep(0.2),
             "torch kernels": lambda: [a @ b for _ in range(400)],
             "pure Python": lambda: sum(i * i for i in range(3_000_000))}
    lags: dict[str, list[float]] = {k: [] for k in loads}
    sent = torch.zeros(1, dtype=torch.int64)
    for name, load in loads.items():
        for k in range(rounds):
            dist.barrier()
            if rank == 0:
                buf = torch.zeros(1, dtype=torch.int64)
                rec = CollectiveRecord(k, CollectiveKind.BROADCAST, 8, None, 0, clock())
                relay = _Relay()
                watcher.wait_for(rec, [dist.irecv(buf, 1, tag=7)], [relay])
                load()
                relay.wait()
                lags[name].append((rec.end_ns - int(buf.item())) / 1e6)
            else:
                time.sleep(0.05 + 0.1 * (k % 3) / 3)
                sent[0] = clock()
                dist.send(sent, 0, tag=7)
    watcher.close()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(lags, fh)
    dist.destroy_process_group()


def precision(args: argparse.Namespace) -> int:
    """How late the watcher stamps a completion, by what the training thread is doing."""
    from benchmarks import results
    from benchmarks.launch import free_port, run_ranks
    out = os.path.join(args.workdir, "precision.json")
    os.makedirs(args.workdir, exist_ok=True)
    if run_ranks(_precision_rank, 2, (free_port(), args.rounds, out), timeout=600):
        return 1
    with open(out) as fh:
        lags = json.load(fh)
    rows = [[name, round(statistics.median(v), 3), round(sorted(v)[int(0.95 * (len(v) - 1))], 3),
             round(max(v), 3)] for name, v in lags.items()]
    table = results.markdown_table(["training thread meanwhile", "median lag (ms)",
                                    "p95 lag (ms)", "max lag (ms)"], rows)
    notes = (f"Lag = the watcher's completion stamp minus the time the peer sent an 8-byte "
             f"message (Gloo, 2 ranks on loopback, {args.rounds} rounds each), so it includes "
             f"the message's own latency: an upper bound on how late a collective's end is "
             f"stamped. Python's GIL switch interval is 5 ms.")
    print(table)
    print(notes)
    results.write(args.name or "diagnose_precision", "dear.diagnose: completion-stamp lag",
                  {"args": vars(args), "lags_ms": lags}, table, notes)
    return 0


# What the DeAR paper's GPUs spend computing one iteration (assumed, see the notes).
PAPER_COMPUTE_S = {"resnet50": 0.22, "bert_base": 0.35}
PAPER_LATENCY_S = {10e9: 30e-6, 100e9: 5e-6}
TUNE_MB = (1, 2, 4, 8, 16, 25, 32, 64, 128)


def paper(args: argparse.Namespace) -> int:
    from benchmarks import results
    from dear.diagnose import Schedule, Simulator
    traces = dict(t.split("=", 1) for t in args.trace)
    targets = {**PAPER_COMPUTE_S, **{k: float(v) for k, v in
                                     (t.split("=", 1) for t in args.compute_time)}}
    rows, data = [], []
    for name, path in traces.items():
        sim = Simulator(path)
        prof = sim.model.profiles[0]
        busy = (sum(s.duration for s in prof.forward + prof.backward) + prof.loss
                + prof.backward_tail + prof.update)
        scale = targets[name] / busy
        for bw in (10e9, 100e9):
            for n in (16, 64):
                pred = {s: sim.predict(s, bandwidth_bps=bw, latency_s=PAPER_LATENCY_S[bw],
                                       world_size=n, compute_scale=scale,
                                       fusion_threshold=args.fusion_threshold,
                                       unclaimed_first=args.unclaimed_first)
                        for s in (Schedule.DEAR, Schedule.DDP, Schedule.WFBP)}
                best = args.fusion_threshold
                if args.tune:                  # DeAR with its best threshold, as predicted
                    tried = {mb: sim.predict(Schedule.DEAR, bandwidth_bps=bw,
                                             latency_s=PAPER_LATENCY_S[bw], world_size=n,
                                             compute_scale=scale, fusion_threshold=mb << 20,
                                             unclaimed_first=args.unclaimed_first)
                             for mb in TUNE_MB}
                    best = min(tried, key=lambda mb: tried[mb].iteration_time)
                    pred[Schedule.DEAR] = tried[best]
                    best <<= 20
                t = {s.value: p.iteration_time for s, p in pred.items()}
                rows.append([name, f"{bw / 1e9:g}", n, round(t["dear"] * 1e3, 1),
                             round(t["ddp"] * 1e3, 1), round(t["wfbp"] * 1e3, 1),
                             f"{t['ddp'] / t['dear'] - 1:+.0%}",
                             f"{t['wfbp'] / t['dear'] - 1:+.0%}",
                             f"{pred[Schedule.DEAR].overlap:.0%}",
                             f"{(best or 25 << 20) >> 20} MB"])
                data.append({"model": name, "bandwidth_bps": bw, "world_size": n,
                             "iteration_s": t, "compute_scale": scale,
                             "overlap_dear": pred[Schedule.DEAR].overlap,
                             "dear_fusion_threshold": best or 25 << 20})
    headers = ["model", "Gbit/s", "workers", "DeAR (ms)", "DDP (ms)", "WFBP (ms)",
               "DeAR gain vs DDP", "DeAR gain vs WFBP", "DeAR overlap", "DeAR threshold"]
    table = results.markdown_table(headers, rows)
    notes = (f"Compute profiles traced on this CPU ({traces}), each scaled so one iteration's "
             f"compute is {targets} s (assumed for the paper's GPUs); ideal ring collectives at "
             f"the link rate with {PAPER_LATENCY_S} s per ring step; DeAR's fusion threshold "
             + (f"the best predicted of {TUNE_MB} MB" if args.tune
                else str(args.fusion_threshold or "25 MB"))
             + ", DDP's and WFBP's 25 MB"
             + ("; parameters no module claims first in DeAR forward order"
                if args.unclaimed_first else "")
             + ". The DeAR paper (ANCHORS.md) reports "
             "up to 83% speedup over the best baseline on 64 GPUs with 10 Gb/s Ethernet and up "
             "to 15% with 100 Gb/s InfiniBand.")
    print(table)
    print(notes)
    results.write(args.name or "diagnose_paper", "dear.diagnose: DeAR vs DDP vs WFBP at scale "
                  "(predicted)", {"args": vars(args), "rows": data}, table, notes)
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--image-size", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=0)
    cli.add_options(p, methods=METHODS, warmup=2, iters=6, name="", timeout=3000.0)
    p.add_argument("--workdir", default=DEFAULT_WORKDIR, help="where traces go")
    p.add_argument("--trace-bandwidth", default="1gbit")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    _common(r)
    r.add_argument("--out", required=True)
    r.add_argument("--trace-iters", type=int, default=5)
    r.add_argument("--overhead-rounds", type=int, default=0)
    o = sub.add_parser("overhead")
    _common(o)
    cli.add_options(o, rounds=4)
    pr = sub.add_parser("profile")
    _common(pr)
    pr.add_argument("--out", required=True)
    pr.add_argument("--trace-iters", type=int, default=3)
    pr.add_argument("--threads", type=int, default=1)
    pa = sub.add_parser("paper")
    pa.add_argument("--trace", action="append", default=[], help="MODEL=TRACE_DIR")
    pa.add_argument("--compute-time", action="append", default=[],
                    help="MODEL=SECONDS of compute per iteration on the target GPU")
    pa.add_argument("--fusion-threshold", type=int, default=None)
    pa.add_argument("--tune", action="store_true",
                    help=f"DeAR at its best predicted threshold among {TUNE_MB} MB")
    pa.add_argument("--unclaimed-first", action="store_true",
                    help="DeAR buckets with parameters no module claims first in forward order")
    cli.add_options(pa, name="")
    pc = sub.add_parser("precision")
    cli.add_options(pc, rounds=20, name="")
    pc.add_argument("--workdir", default=DEFAULT_WORKDIR)
    args = parser.parse_args(argv)
    return {"run": run, "overhead": overhead, "profile": profile,
            "paper": paper, "precision": precision}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
