"""`make bench`: DeAR against DDP, FSDP2, Horovod, all-reduce and WFBP on an emulated cluster.

For each model, 2 ranks (one core each) in their own network namespaces behind a shaped link,
sized so that communication takes about as long as compute (the regime where overlap matters).
Writes benchmarks/results/bench_<model>.{json,md} (from benchmarks.train), and
benchmarks/results/bench.{json,md,png}: every method as a ratio to the lower bound T_lb and to DDP.
Without root (or `ip`/`tc`) it says so and runs on loopback with --no-shaping.

Then the same methods on an emulated accelerator (benchmarks.emulated_bench: the real models'
parameters, compute that sleeps and leaves the cores to the network, as on a GPU cluster):
benchmarks/results/bench_emulated.{md,json,png}, its table also in bench.md. On the CPU table every
method's compute shares each rank's one core with the network stack (bench_analysis.md); the
emulated table is the one that says how the schedules compare where compute runs on a device.

    python -m benchmarks.bench [--models resnet50,bert_base] [--quick] [--no-shaping]
                               [--emulated SETUPS | --emulated ''] [--emulated-only]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from benchmarks import results
from benchmarks.cluster import EmulatedCluster, check_can_shape
from benchmarks.methods import horovod_installed

# Sized on the 2-core development machine: one-core iteration ~ the all-reduce time at the rate.
CONFIGS: dict[str, dict[str, Any]] = {
    "resnet50": {"bandwidth": "1gbit", "args": ["--image-size", "64", "--batch", "16"],
                 "iters": 4},
    "bert_base": {"bandwidth": "2gbit", "args": ["--seq-len", "64", "--batch", "4"], "iters": 3,
                  "extra": ["dear-dense"]},
}
METHODS = "ddp,fsdp2,allreduce,wfbp,horovod,dear-order,dear,dear-hvd"
# Warm-up iterations per method and round: dear's planned schedule measures 4 iterations
# (DEAR_PLAN_AFTER) in DeAR's order before it plans, and runs the plan 4 more before it checks
# it (maybe planning again), so timing starts after that.
WARMUP = 10
# The emulated-accelerator table: under 10 minutes on the 2-core machine (2 rounds, 3 timed
# iterations per method and round). The full study: benchmarks.emulated_bench --setups ... (README).
EMULATED_SETUPS = "resnet50:2,vgg16:2:1gbit:4,bert_base:2:1gbit:4,resnet50:4:1gbit:2"
EMULATED_METHODS = "ddp,wfbp,horovod,fsdp2,dear,dear:schedule=dear,dear:row_sparse=off"
# BERT-Base as a fine-tune: 32 x 128 tokens per rank, so the word embedding's gradient is
# non-zero in ~2,300 of 30,522 rows (dear's default sends only those; dear:row_sparse=off
# sends the whole table).
EMULATED_TOKENS = 4096


def run_model(model: str, args: argparse.Namespace, shaping: bool) -> dict[str, Any]:
    cfg = CONFIGS[model]
    methods = args.methods
    use_hvd = horovod_installed()
    if not use_hvd:
        methods = ",".join(m for m in methods.split(",") if m not in ("horovod", "dear-hvd"))
        print("bench: Horovod is not installed; skipping its methods (run `make horovod`)")
    methods = ",".join([methods, *cfg.get("extra", [])])   # e.g. the embedding-table option
    name = f"bench_{model}{args.suffix}"
    # Two interleaved rounds: this shared machine's speed drifts by tens of percent within a run.
    iters = (["--rounds", "1", "--warmup", "1", "--iters", "3"] if args.quick else
             ["--rounds", "2", "--warmup", str(WARMUP), "--iters", str(cfg["iters"])])
    cmd = [sys.executable, "-m", "benchmarks.train", "--model", model, "--methods", methods,
           "--name", name, *iters, *cfg["args"]]
    with EmulatedCluster(2, cfg["bandwidth"], shaping=shaping, horovod=use_hvd) as cluster:
        if shaping:
            measured = cluster.measure_bandwidth()
            print(f"bench: {model}: link requested {cfg['bandwidth']}, measured "
                  f"{measured / 1e9:.2f} Gbit/s", flush=True)
        code = cluster.run(cmd, timeout=args.timeout)
    if code != 0:
        raise SystemExit(f"bench: {model} failed (exit {code})")
    with open(os.path.join(results.RESULTS_DIR, f"{name}.json")) as fh:
        return json.load(fh)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,bert_base")
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--quick", action="store_true", help="fewer iterations (for make demo)")
    parser.add_argument("--no-shaping", action="store_true")
    parser.add_argument("--suffix", default="", help="appended to the result names")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--emulated", default=EMULATED_SETUPS,
                        help="emulated-accelerator setups (benchmarks.emulated_bench); '' skips")
    parser.add_argument("--emulated-methods", default=EMULATED_METHODS)
    parser.add_argument("--emulated-only", action="store_true", help="skip the CPU table")
    args = parser.parse_args(argv)
    shaping = not args.no_shaping
    reason = check_can_shape() if shaping else None
    if reason:
        print(f"bench: cannot shape a network here ({reason}); running on loopback instead")
        shaping = False
    emulated = run_emulated(args, shaping) if args.emulated else ""
    if args.emulated_only:
        return 0
    reports = {m: run_model(m, args, shaping) for m in args.models.split(",") if m}
    rows = []
    for model, rep in reports.items():
        for method, res in rep["methods"].items():
            rows.append([model, method, round(res["median_s"] * 1e3, 1), round(res["ratio_lb"], 3),
                         round(res["ratio_ddp"], 3) if res.get("ratio_ddp") else "-",
                         "ok" if res.get("loss_matches_ddp", True) else "REFUSED"])
    table = results.markdown_table(
        ["model", "method", "median iter (ms)", "x T_lb", "x DDP", "loss vs DDP"], rows)
    limits = "\n".join(
        f"- {model}: T_compute {rep['t_compute_s'] * 1e3:.0f} ms, T_comm "
        f"{min(rep['t_comm_s'].values()) * 1e3:.0f} ms (all_reduce "
        f"{rep['t_comm_s']['all_reduce'] * 1e3:.0f}, dear rs+ag "
        f"{rep['t_comm_s']['rs_ag'] * 1e3:.0f})"
        f", link bound {rep['link_bound_s'] * 1e3 if rep['link_bound_s'] else float('nan'):.0f} ms,"
        f" measured link {(rep['bandwidth_measured_bps'] or 0) / 1e9:.2f} Gbit/s"
        + (f", TCP {rep['congestion']}" if rep.get("congestion") else "")
        for model, rep in reports.items())
    print(table)
    print(limits)
    figure = results.ratio_chart([results.Panel(
        f"{model}: {rep['t_lb_s'] * 1e3:.0f} ms lower bound",
        {m: r["ratio_lb"] for m, r in rep["methods"].items()}) for model, rep in reports.items()])
    results.write(f"bench{args.suffix}", "DeAR vs baselines on an emulated 2-node cluster",
                  {"shaping": shaping, "configs": CONFIGS, "reports": reports}, table,
                  limits + emulated, figure=figure)
    return 0


def run_emulated(args: argparse.Namespace, shaping: bool) -> str:
    """The emulated-accelerator table (bench_emulated.*); returns a section for bench.md."""
    from benchmarks import emulated_bench, emulated_report

    name = f"bench_emulated{args.suffix}"
    iters = (["--rounds", "1", "--warmup", "1", "--iters", "2"] if args.quick else
             ["--rounds", "2", "--warmup", "1", "--iters", "3"])
    cmd = ["--setups", args.emulated, "--methods", args.emulated_methods, "--name", name,
           "--comm-repeats", "2", "--timeout", str(args.timeout), "--tokens",
           str(EMULATED_TOKENS), *iters]
    if not shaping:
        cmd.append("--no-shaping")
    emulated_bench.main(cmd)
    with open(os.path.join(results.RESULTS_DIR, f"{name}.json")) as fh:
        reports = json.load(fh)["reports"]
    table, notes = emulated_report.table(reports)
    return (f"\n\n## Emulated accelerator (compute off the CPU): {name}.md\n\n{table}\n\n"
            f"{notes}\n\n{emulated_report.EXPLAIN}\n\n![x T_lb]({name}.png)")


if __name__ == "__main__":
    sys.exit(main())
