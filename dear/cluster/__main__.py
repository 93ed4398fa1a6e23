"""python -m dear.cluster simulate ...: compare scheduling policies on a workload; writes
results.json, results.md and jct_cdf.png to --out. python -m dear.cluster example-jobs FILE
writes a jobs file to start from."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from .experiment import compare
from .metrics import METRICS
from .plot import jct_cdf
from .policies import POLICIES
from .simulator import RESIZE_S
from .workload import WORKLOADS, Job, generate, jobs_to_data, load_jobs


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dear.cluster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("simulate", help="compare policies on a workload")
    sim.add_argument("--workload", default="philly", choices=sorted(WORKLOADS),
                     help="generated from published trace statistics (philly, helios) or our "
                          "model mix (mixed); ignored with --jobs-file")
    sim.add_argument("--jobs-file", help="your jobs (JSON, docs/sharing-a-cluster.md)")
    sim.add_argument("--gpus", type=int, default=64)
    sim.add_argument("--policies", default=",".join(POLICIES),
                     help="comma-separated; options after a colon, '/' between values: "
                          "pollux:p=1 optimus:period=600 tiresias:thresholds=3600/36000 "
                          "(separate several policies with ';' when one has options)")
    sim.add_argument("--jobs", type=int, default=500, help="jobs generated per seed")
    sim.add_argument("--seeds", default="0", help="comma-separated seeds, e.g. 0,1,2")
    sim.add_argument("--early-stop", type=float, default=None,
                     help="probability a job is stopped after U(0,1) of its work (default: "
                          "the workload's own; 0 for none)")
    sim.add_argument("--no-compare", action="store_true",
                     help="run only as given, not also with the early stops removed")
    sim.add_argument("--load", type=float, default=0.9,
                     help="offered load: requested GPU-seconds per second / GPUs")
    sim.add_argument("--restart-s", type=float, default=RESIZE_S,
                     help="seconds without progress when a job starts or is resized (default: "
                          "dear's measured resize under torchrun's elastic agent)")
    sim.add_argument("--out", required=True, help="directory for results.json/.md, png")
    ex = sub.add_parser("example-jobs", help="write a jobs file generated from a workload")
    ex.add_argument("path")
    ex.add_argument("--workload", default="mixed", choices=sorted(WORKLOADS))
    ex.add_argument("--jobs", type=int, default=20)
    ex.add_argument("--gpus", type=int, default=16)
    ex.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        if args.command == "example-jobs":
            jobs = generate(WORKLOADS[args.workload], args.jobs, args.gpus, args.seed)
            with open(args.path, "w") as fh:
                json.dump(jobs_to_data(jobs), fh, indent=1)
            print(f"wrote {len(jobs)} jobs to {args.path}")
            return 0
        return _simulate(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _simulate(args: argparse.Namespace) -> int:
    sep = ";" if ";" in args.policies else ","
    policies = [p.strip() for p in args.policies.split(sep) if p.strip()]
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds takes comma-separated integers, got {args.seeds!r}") from None
    if args.jobs_file:
        user_jobs = load_jobs(args.jobs_file)
        if args.early_stop is not None:
            raise ValueError("--early-stop applies to generated workloads; in a jobs file give "
                             "each job's stop_fraction")

        def make(seed: int) -> list[Job]:
            return user_jobs
        seeds = seeds[:1]
        workload = args.jobs_file
    else:
        stats = WORKLOADS[args.workload]

        def make(seed: int) -> list[Job]:
            return generate(stats, args.jobs, args.gpus, seed, args.early_stop, args.load)
        workload = args.workload
    result = compare(make, args.gpus, policies, seeds, args.restart_s,
                     both=not args.no_compare, progress=print)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for (policy, label), agg in result.per.items():
        rows.append([label, policy] + [agg[m]["mean"] for m in METRICS])
    rows.sort(key=lambda r: (r[0], r[2]))
    header = "| variant | policy | " + " | ".join(METRICS) + " |"
    lines = [header, "|" + "---|" * (len(METRICS) + 2)]
    lines += ["| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r)
              + " |" for r in rows]
    table = "\n".join(lines)
    with open(os.path.join(args.out, "results.md"), "w") as fh:
        fh.write(f"# {workload}, {args.gpus} GPUs, seeds {seeds}\n\n{table}\n")
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump({"workload": workload, "gpus": args.gpus, "seeds": seeds,
                   "restart_s": args.restart_s, "load": args.load,
                   "summary": [{"policy": p, "variant": v, **agg}
                               for (p, v), agg in result.per.items()],
                   "runs": result.runs}, fh, indent=1)
    panels: dict[str, dict[str, list[float]]] = {}
    for (policy, label), times in result.jct.items():
        panels.setdefault(f"{workload}, {label}", {})[policy] = times
    jct_cdf(panels, os.path.join(args.out, "jct_cdf.png"))
    print(table)
    print(f"wrote {args.out}/results.md, results.json, jct_cdf.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
