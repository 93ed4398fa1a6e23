"""dear.diagnose's replay validated in ONE run: bandwidths interleaved round by round.

    python -m benchmarks.diagnose_rounds [--model resnet50 --image-size 64 --batch 8]
        [--trace-bandwidth 1gbit --bandwidths 500mbit,2gbit --rounds 2]

Why: `benchmarks.diagnose validate` traces at one bandwidth in one run and measures the others
in other runs, minutes apart. On this shared 2-core machine a rank's compute drifts by 10-20%
between runs, which no replay can predict (the same configuration measured in two runs
differed by up to 12%). Here one cluster run changes the links' rate between blocks
(`benchmarks.cluster.set_bandwidth`): in every round each method is traced at the trace
bandwidth and timed at every bandwidth, so a prediction from round r's trace is compared with
round r's measurements, taken within minutes of it. The link rate at the other bandwidths is the
launcher's TCP measurement at the trace bandwidth scaled by the requested rates.

Run it alone on the machine (`flock -x /tmp/dear.lock ...`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import cli
from benchmarks.diagnose import DEFAULT_WORKDIR, METHODS, _knob_args, trace_window

RESULTS_NAME = "diagnose_validation_rounds"


# ----------------------------------------------------------------------------- one rank
def run(args: argparse.Namespace) -> int:
    import dear
    from benchmarks.methods import Built, parse_method, parse_methods
    from benchmarks.cluster import parse_rate, set_bandwidth
    from benchmarks.timing import slowest_median, time_steps, warm_up
    from benchmarks.train import make_sgd, workload
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dear.init(backend="torch")
    rank = dist.get_rank()
    build, blocks, batch, loss_fn = workload(args)
    methods = args.methods.split(",")
    if any(m.backend_switch for m in parse_methods(args.methods)):
        raise SystemExit("diagnose_rounds keeps every method alive at once; dear on another "
                         "backend (dear-hvd, dear:backend=...) cannot run beside them here")
    schedule = args.schedule.split(",")
    prepared = {m: Built(parse_method(m), build(), make_sgd, blocks) for m in methods}
    rounds: list[dict[str, dict[str, float]]] = []
    step = 0
    for r in range(args.rounds):
        measured: dict[str, dict[str, float]] = {}
        for bw in schedule:
            dist.barrier()
            if rank == 0:
                set_bandwidth(bw)
            dist.barrier()
            measured[bw] = {}
            for method in methods:
                net, opt = prepared[method].net, prepared[method].opt
                step = warm_up(net, opt, batch, loss_fn, args.warmup, step)
                times = time_steps(net, opt, batch, loss_fn, args.iters, step)
                step += args.iters
                measured[bw][method] = slowest_median(times)
                if bw == args.trace_bandwidth:
                    step = trace_window(net, opt, batch, loss_fn, step,
                                        os.path.join(args.out, f"r{r}", method),
                                        args.trace_iters)
                if prepared[method].is_dear:
                    opt.flush_updates()        # nothing in flight into the next method's block
                dist.barrier()
        rounds.append(measured)
        if rank == 0:
            print(f"round {r}: " + json.dumps({bw: {m: round(t * 1e3) for m, t in ms.items()}
                                               for bw, ms in measured.items()}), flush=True)
    for built in prepared.values():
        built.finish()
    dear.shutdown()
    dist.destroy_process_group()
    if rank == 0:
        link = float(os.environ.get("BENCH_CLUSTER_BANDWIDTH_MEASURED", 0)) or None
        requested = parse_rate(args.trace_bandwidth)
        links = {bw: (link * parse_rate(bw) / requested if link else parse_rate(bw))
                 for bw in schedule}
        with open(os.path.join(args.out, "measured.json"), "w") as fh:
            json.dump({"rounds": rounds, "links_bps": links, "trace_link_measured_bps": link},
                      fh, indent=1)
    return 0


# ------------------------------------------------------------------------------- driver
def validate(args: argparse.Namespace) -> int:
    from benchmarks import results
    from dear.diagnose import Simulator, build_report, fit_contention
    out = os.path.join(args.workdir, f"rounds-{args.model}")
    schedule = [args.trace_bandwidth] + [b for b in args.bandwidths.split(",") if b]
    path = os.path.join(out, "measured.json")
    if not (args.reuse and os.path.exists(path)):
        os.makedirs(out, exist_ok=True)
        cmd = [sys.executable, "-m", "benchmarks.cluster", "--nproc", "2", "--bandwidth",
               args.trace_bandwidth, "--timeout", str(args.timeout), "--", sys.executable, "-m",
               "benchmarks.diagnose_rounds", "run", "--out", out, "--model", args.model,
               "--batch", str(args.batch), "--warmup", str(args.warmup), "--iters",
               str(args.iters), "--methods", args.methods, "--schedule", ",".join(schedule),
               "--rounds", str(args.rounds), "--trace-bandwidth", args.trace_bandwidth,
               "--trace-iters", str(args.trace_iters)] + _knob_args(args)
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    with open(path) as fh:
        measured = json.load(fh)
    links = measured["links_bps"]
    link0 = links[args.trace_bandwidth]
    methods = args.methods.split(",")
    rows, data = [], []
    contention, compute = [], []  # per round: k; median compute per iteration per method
    for r, by_bw in enumerate(measured["rounds"]):
        where = {m: os.path.join(out, f"r{r}", m) for m in methods}
        sims = {m: Simulator(where[m]) for m in methods}
        # Compute slowed by the transport on the same core, measured in this round: DeAR's
        # trace against the all-reduce schedule's (no compute while communicating).
        k = fit_contention(where["dear"], where["allreduce"])
        contention.append(k)
        compute.append({m: statistics.median(i.compute for i in build_report(where[m])
                                             .iterations()) for m in methods})
        slowed = {m: Simulator(where[m], contention=k) for m in methods}
        for bw in schedule:
            for method in methods:
                real = by_bw[bw][method]
                kw = dict(bandwidth_bps=links[bw], traced_bandwidth_bps=link0)
                own = sims[method].predict(method, **kw)
                from_dear = sims["dear"].predict(method, **kw)
                own_k = slowed[method].predict(method, **kw)
                data.append({"round": r, "bandwidth": bw, "link_bps": links[bw],
                             "method": method, "measured_s": real,
                             "predicted_own_trace_s": own.iteration_time,
                             "predicted_from_dear_trace_s": from_dear.iteration_time,
                             "predicted_own_trace_contention_s": own_k.iteration_time,
                             "contention": k, "predicted_overlap": own.overlap})
                rows.append([r, bw, f"{links[bw] / 1e9:.2f}", method, round(real * 1e3, 1),
                             round(own.iteration_time * 1e3, 1),
                             f"{own.iteration_time / real - 1:+.1%}",
                             round(from_dear.iteration_time * 1e3, 1),
                             f"{from_dear.iteration_time / real - 1:+.1%}",
                             round(own_k.iteration_time * 1e3, 1),
                             f"{own_k.iteration_time / real - 1:+.1%}"])
    headers = ["round", "bandwidth (tc)", "link (Gbit/s)", "method", "measured (ms)",
               f"predicted from own trace at {args.trace_bandwidth} (ms)", "error",
               f"predicted from DeAR's trace at {args.trace_bandwidth} (ms)", "error",
               "own trace, with contention (ms)", "error"]
    table = results.markdown_table(headers, rows)

    def errors(key: str, where: Any) -> list[float]:
        return [abs(d[key] / d["measured_s"] - 1) for d in data if where(d)]

    other = lambda d: d["bandwidth"] != args.trace_bandwidth  # noqa: E731
    same = lambda d: d["bandwidth"] == args.trace_bandwidth  # noqa: E731
    own_other, dear_other = errors("predicted_own_trace_s", other), \
        errors("predicted_from_dear_trace_s", other)
    own_same = errors("predicted_own_trace_s", same)
    cont_other = errors("predicted_own_trace_contention_s", other)
    cont_same = errors("predicted_own_trace_contention_s", same)
    cont_bw = {bw: statistics.mean(errors("predicted_own_trace_contention_s",
                                          lambda d, bw=bw: d["bandwidth"] == bw))
               for bw in schedule[1:]}
    cont_method = {m: statistics.mean(errors("predicted_own_trace_contention_s",
                                             lambda d, m=m: other(d) and d["method"] == m))
                   for m in methods}
    per_method = {m: statistics.mean(errors("predicted_own_trace_s",
                                            lambda d, m=m: other(d) and d["method"] == m))
                  for m in methods}
    per_bw = {bw: statistics.mean(errors("predicted_own_trace_s",
                                         lambda d, bw=bw: d["bandwidth"] == bw))
              for bw in schedule[1:]}
    notes = (f"Model {args.model} (batch {args.batch}, knobs {_knob_args(args)}), 2 ranks on the "
             f"emulated cluster, one core each, one run: {args.rounds} rounds, each timing every "
             f"method at {', '.join(schedule)} (links re-shaped between blocks; {args.warmup} "
             f"warm-up then median of {args.iters} iterations, slowest rank) and tracing it at "
             f"{args.trace_bandwidth} ({args.trace_iters} iterations). Predictions from round "
             f"r's trace are compared with round r's measurements. Mean |error| at the other "
             f"bandwidths: own trace {statistics.mean(own_other):.1%} (max "
             f"{max(own_other):.1%}; per method "
             + ", ".join(f"{m} {e:.1%}" for m, e in per_method.items())
             + "; per bandwidth " + ", ".join(f"{bw} {e:.1%}" for bw, e in per_bw.items())
             + f"), from DeAR's trace {statistics.mean(dear_other):.1%} (max "
             f"{max(dear_other):.1%}); at the traced bandwidth (untraced iterations of the "
             f"same round): {statistics.mean(own_same):.1%} (max {max(own_same):.1%}).\n\n"
             f"With contention (compute 1 + k times slower while a collective is in flight, k "
             f"fitted per round from DeAR's trace against the all-reduce schedule's: "
             f"{', '.join(f'{k:.2f}' for k in contention)}): mean |error| at the other "
             f"bandwidths {statistics.mean(cont_other):.1%} (max {max(cont_other):.1%}; per "
             f"bandwidth " + ", ".join(f"{bw} {e:.1%}" for bw, e in cont_bw.items())
             + "; per method " + ", ".join(f"{m} {e:.1%}" for m, e in cont_method.items())
             + f"), at the traced bandwidth {statistics.mean(cont_same):.1%} (max "
             f"{max(cont_same):.1%}). Median compute per traced iteration (ms; the all-reduce "
             f"schedule computes while nothing is in flight): "
             + "; ".join(f"round {r}: " + ", ".join(f"{m} {c * 1e3:.0f}" for m, c in row.items())
                         for r, row in enumerate(compute))
             + ".\n\nLink "
             f"rates: {', '.join(f'{bw} {v / 1e9:.2f}' for bw, v in links.items())} Gbit/s "
             f"(TCP at {args.trace_bandwidth}, scaled).")
    if args.reuse:
        notes += f" (--reuse: recomputed from the run in {out}.)"
    print(table)
    print(notes)
    results.write(args.name or RESULTS_NAME,
                  "dear.diagnose: replay vs measurement, bandwidths interleaved in one run",
                  {"args": vars(args), "rows": data, "measured": measured}, table, notes)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    for name in ("run", "validate"):
        p = sub.add_parser(name)
        p.add_argument("--model", default="resnet50")
        p.add_argument("--batch", type=int, default=8)
        p.add_argument("--image-size", type=int, default=64)
        p.add_argument("--seq-len", type=int, default=0)
        cli.add_options(p, methods=METHODS, rounds=2, warmup=2, iters=8)
        p.add_argument("--trace-bandwidth", default="1gbit")
        p.add_argument("--trace-iters", type=int, default=6)
    run_p, val_p = sub.choices["run"], sub.choices["validate"]
    run_p.add_argument("--out", required=True)
    run_p.add_argument("--schedule", required=True, help="bandwidths, in the order of a round")
    val_p.add_argument("--bandwidths", default="500mbit,2gbit")
    val_p.add_argument("--workdir", default=DEFAULT_WORKDIR)
    cli.add_options(val_p, name="", timeout=3000.0)
    val_p.add_argument("--reuse", action="store_true",
                       help="recompute from the run already in --workdir")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv if argv[:1] in (["run"], ["validate"]) else
                             ["validate", *argv])
    return run(args) if args.command == "run" else validate(args)


if __name__ == "__main__":
    sys.exit(main())
