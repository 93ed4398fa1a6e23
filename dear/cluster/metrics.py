"""What a policy is judged by: job completion times (mean and tail), makespan, utilization."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .simulator import SimulationResult

METRICS = ("mean_jct_h", "p50_jct_h", "p95_jct_h", "p99_jct_h", "makespan_h", "utilization",
           "restarts_per_job")


def summarize(result: SimulationResult) -> dict[str, float]:
    """Hours for times; utilization = allocated GPU-seconds / (GPUs x makespan)."""
    jct = np.array([r.jct for r in result.records], dtype=float) / 3600.0
    n = max(len(result.records), 1)
    return {"mean_jct_h": float(jct.mean()), "p50_jct_h": float(np.percentile(jct, 50)),
            "p95_jct_h": float(np.percentile(jct, 95)),
            "p99_jct_h": float(np.percentile(jct, 99)),
            "makespan_h": result.makespan / 3600.0, "utilization": result.utilization,
            "restarts_per_job": result.restarts / n}


def aggregate(summaries: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Several seeds: each metric's mean and its min-max over the seeds."""
    out: dict[str, Any] = {}
    for key in METRICS:
        vals = np.array([s[key] for s in summaries], dtype=float)
        out[key] = {"mean": float(vals.mean()), "min": float(vals.min()),
                    "max": float(vals.max())}
    return out


def batch_means_interval(values: Sequence[float], batches: int,
                         t_quantile: float) -> tuple[float, float]:
    """Mean and half-width of its confidence interval by batch means: `batches` consecutive
    batches (their means nearly independent when a batch spans many busy periods), half-width
    t_quantile x standard deviation of the batch means / sqrt(batches)."""
    vals = np.asarray(values, dtype=float)
    size = len(vals) // batches
    if size < 2:
        raise ValueError(f"{len(vals)} values cannot make {batches} batches of >= 2")
    means = vals[: size * batches].reshape(batches, size).mean(axis=1)
    return float(means.mean()), float(t_quantile * means.std(ddof=1) / np.sqrt(batches))
