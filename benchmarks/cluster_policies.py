"""Scheduling policies compared on a simulated shared cluster (dear.cluster).

    python -m benchmarks.cluster_policies [--gpus 64 --jobs 500 --seeds 0,1,2]

Three workloads: Philly and Helios generated from published trace statistics, and our model mix
written as a jobs file and read back through the user's format (seed 0's file is kept as
benchmarks/results/cluster_policies_mixed_jobs.json). Each seed runs every policy on the same
jobs with their early stops and again with the stops removed. Pure simulation: seconds of CPU,
no timing on this machine enters a figure. Writes benchmarks/results/cluster_policies.{json,md,
png}; docs/sharing-a-cluster.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

from benchmarks import results
from dear.cluster.experiment import compare
from dear.cluster.metrics import METRICS
from dear.cluster.plot import jct_cdf
from dear.cluster.policies import POLICIES
from dear.cluster.simulator import RESIZE_S
from dear.cluster.workload import WORKLOADS, Job, generate, jobs_to_data, load_jobs

NAME = "cluster_policies"


def _through_file(jobs: list[Job], keep: str = "") -> list[Job]:
    """The jobs written in the jobs-file format and read back, as a user's would be."""
    data = jobs_to_data(jobs)
    if keep:
        with open(keep, "w") as fh:
            json.dump(data, fh, indent=1)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(data, fh)
    try:
        return load_jobs(fh.name)
    finally:
        os.unlink(fh.name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--load", type=float, default=0.9)
    parser.add_argument("--restart-s", type=float, default=RESIZE_S)
    parser.add_argument("--workloads", default="philly,helios,mixed")
    parser.add_argument("--policies", default=";".join(list(POLICIES) + ["pollux:p=1"]))
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    policies = [p for p in args.policies.split(";") if p]
    data: dict[str, Any] = {"gpus": args.gpus, "jobs": args.jobs, "seeds": seeds,
                            "load": args.load, "restart_s": args.restart_s,
                            "policies": policies, "workloads": {}}
    rows: list[list[Any]] = []
    panels: dict[str, dict[str, list[float]]] = {}
    example = os.path.join(results.RESULTS_DIR, f"{NAME}_mixed_jobs.json")
    for name in args.workloads.split(","):
        stats = WORKLOADS[name]

        def make(seed: int, stats: Any = stats, name: str = name) -> list[Job]:
            jobs = generate(stats, args.jobs, args.gpus, seed, None, args.load)
            if name == "mixed":
                jobs = _through_file(jobs, keep=example if seed == seeds[0] else "")
            return jobs
        comp = compare(make, args.gpus, policies, seeds, args.restart_s,
                       progress=lambda line, n=name: print(f"{n}: {line}", flush=True))
        data["workloads"][name] = {
            "source": stats.source, "early_stop": stats.early_stop,
            "summary": [{"policy": p, "variant": v, **agg} for (p, v), agg in comp.per.items()],
            "runs": comp.runs}
        for variant in ("no early stop", "early stop"):
            keyed = {p: comp.per[(p, variant)] for p in policies if (p, variant) in comp.per}
            base = keyed["fifo"]["mean_jct_h"]["mean"] if "fifo" in keyed else None
            for policy, agg in keyed.items():
                mean = agg["mean_jct_h"]
                rows.append([name, variant, policy,
                             f"{mean['mean']:.3g} [{mean['min']:.3g}-{mean['max']:.3g}]",
                             *(agg[m]["mean"] for m in METRICS[1:]),
                             mean["mean"] / base if base else float("nan")])
                panels.setdefault(f"{name}, {variant}", {})[policy] = comp.jct[(policy,
                                                                                 variant)]
    headers = ["workload", "variant", "policy", "mean JCT h [min-max over seeds]", "p50 h",
               "p95 h", "p99 h", "makespan h", "utilization", "restarts/job", "mean JCT / FIFO"]
    notes = (f"{args.gpus} GPUs, {args.jobs} jobs per seed, seeds {seeds}, offered load "
             f"{args.load}, {args.restart_s:g} s without progress at every start or resize. "
             "Values are means over the seeds. 'early stop': each job, with the workload's "
             "probability, is stopped after U(0,1) of its declared work, unknown to every "
             "policy; 'no early stop': the same jobs run to their end. Utilization: allocated "
             "GPU-seconds / (GPUs x makespan). Sources of each workload's numbers: "
             + "; ".join(f"{n}: {WORKLOADS[n].source}" for n in args.workloads.split(","))
             + ". Definitions and the policies' steps: docs/sharing-a-cluster.md.")
    md = results.write(NAME, "Scheduling policies on a simulated shared cluster", data,
                       results.markdown_table(headers, rows), notes,
                       figure=lambda path: jct_cdf(panels, path))
    print(open(md).read())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
