"""A comparison: the same jobs under every policy, over seeds, with and without early stops; what
the CLI and benchmarks/cluster_policies.py run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from .metrics import aggregate, summarize
from .policies import make_policy
from .simulator import RESIZE_S, simulate
from .workload import Job


@dataclass
class Comparison:
    """per[(policy, label)] = aggregated metrics over seeds; jct[(policy, label)] = every job's
    completion time in hours, all seeds pooled (for the CDF)."""

    per: dict[tuple[str, str], dict[str, Any]]
    jct: dict[tuple[str, str], list[float]]
    runs: list[dict[str, Any]]


def without_early_stop(jobs: Sequence[Job]) -> list[Job]:
    """The same jobs run to their declared end."""
    return [dataclasses.replace(j, stop_fraction=1.0) for j in jobs]


def compare(make_jobs: Callable[[int], list[Job]], gpus: int, policies: Sequence[str],
            seeds: Sequence[int], restart_s: float = RESIZE_S, both: bool = True,
            progress: Optional[Callable[[str], None]] = None) -> Comparison:
    """make_jobs(seed) -> jobs (with their early stops). both: also run every seed with the
    stops removed (label 'no early stop'), else only as given (label 'early stop' when any job
    stops early, else 'no early stop')."""
    per_runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    jct: dict[tuple[str, str], list[float]] = {}
    runs: list[dict[str, Any]] = []
    for seed in seeds:
        jobs = make_jobs(seed)
        stops = any(j.stop_fraction < 1.0 for j in jobs)
        variants = [("early stop" if stops else "no early stop", jobs)]
        if both and stops:
            variants.append(("no early stop", without_early_stop(jobs)))
        for label, js in variants:
            for spec in policies:
                result = simulate(js, gpus, make_policy(spec), restart_s=restart_s)
                summary = summarize(result)
                key = (result.policy, label)
                per_runs.setdefault(key, []).append(summary)
                jct.setdefault(key, []).extend(r.jct / 3600.0 for r in result.records)
                runs.append({"seed": seed, "policy": result.policy, "variant": label,
                             "events": result.events, "max_allocated": result.max_allocated,
                             **summary})
                if progress:
                    progress(f"seed {seed} {label:14s} {result.policy:10s} mean JCT "
                             f"{summary['mean_jct_h']:.3g} h, utilization "
                             f"{summary['utilization']:.3f}")
    per = {key: aggregate(vals) for key, vals in per_runs.items()}
    return Comparison(per, jct, runs)
