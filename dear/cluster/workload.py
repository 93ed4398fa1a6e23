"""Jobs: what arrives at the cluster, from published trace statistics or from a user's file.

A job declares its total work (samples) and the workers it asks for; its curve says how fast it
runs on n workers. Early termination is a hidden `stop_fraction`: the job ends once it has done
that fraction of its declared work (a hyperparameter search killing a poor trial, a user
cancelling, a crash); no policy reads it. The statistics each generator uses, and which numbers
are our own approximation, are listed in docs/sharing-a-cluster.md."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from .curves import CommModelCurve, ThroughputCurve, curve_from_dict, curve_to_dict


@dataclass(frozen=True)
class Job:
    """One job. work: declared total samples; requested: the workers it asks for (what FIFO,
    SRTF and Tiresias give it); stop_fraction in (0, 1]: hidden from every policy."""

    id: int
    arrival: float
    work: float
    curve: ThroughputCurve
    requested: int = 1
    stop_fraction: float = 1.0
    name: str = ""

    @property
    def stopped_work(self) -> float:
        """The work the job actually does before it ends (or is stopped)."""
        return self.work * self.stop_fraction


# Reference curves: per-worker batch 32 on a V100-class GPU, fp32 gradients, a 25 Gbit/s link
# (3.125e9 B/s), 50 us per tree step, and the fraction of compute that hides communication
# (gradients ready layer by layer). Our assumptions, chosen to span a compute-bound model
# (small), two mid ones (ResNet-50, BERT-Base) and a communication-bound one (VGG-16).
_LINK = 25e9 / 8
REFERENCE_CURVES: dict[str, ThroughputCurve] = {
    "resnet50": CommModelCurve(batch=32, t_compute=0.095, grad_bytes=102e6, bandwidth=_LINK,
                               alpha=50e-6, overlap=0.6),
    "bert_base": CommModelCurve(batch=32, t_compute=0.25, grad_bytes=440e6, bandwidth=_LINK,
                                alpha=50e-6, overlap=0.6),
    "vgg16": CommModelCurve(batch=32, t_compute=0.13, grad_bytes=553e6, bandwidth=_LINK,
                            alpha=50e-6, overlap=0.3),
    "small": CommModelCurve(batch=128, t_compute=0.04, grad_bytes=11e6, bandwidth=_LINK,
                            alpha=50e-6, overlap=0.5),
}


@dataclass(frozen=True)
class SizeBucket:
    """A share of the jobs: worker counts (equally likely) and a log-normal duration at the
    requested size, given by its median and 90th percentile (seconds)."""

    share: float
    sizes: tuple[int, ...]
    median_s: float
    p90_s: float


@dataclass(frozen=True)
class TraceStatistics:
    """What a generator draws from; `source` says where each number comes from."""

    name: str
    buckets: tuple[SizeBucket, ...]
    max_duration_s: float
    early_stop: float            # share of jobs that do not complete (published, or ours)
    source: str


# Jeon et al., ATC 2019, Figure 2 (run time CDF per GPU-count bucket), as re-drawn by the public
# trace's notebook (msr-fiddle/philly-traces, analysis/Philly Trace Analysis.ipynb): medians and
# 90th percentiles read off that figure by us (within a factor ~1.5). The bucket shares and the
# sizes inside a bucket are OUR approximation (the figure gives no counts).
PHILLY = TraceStatistics(
    name="philly",
    buckets=(SizeBucket(0.70, (1,), 22 * 60, 350 * 60),
             SizeBucket(0.18, (2, 4), 60 * 60, 3000 * 60),
             SizeBucket(0.08, (8,), 200 * 60, 5000 * 60),
             SizeBucket(0.04, (16, 32), 170 * 60, 3000 * 60)),
    max_duration_s=1e4 * 60,
    early_stop=0.3,
    source="Jeon et al. ATC'19 Fig. 2 (run times by size, read off); shares ours; "
           "early stop 0.3 ours (the Helios artifact's analysis of the public Philly trace: "
           "31.3% of GPU time in completed jobs, 32.6% killed, 36.1% failed)")

# Hu et al., SC 2021 (Helios, SenseTime), the artifact's helios_cluster_summary.csv, all four
# clusters: GPU jobs' median run time 206 s, mean 6652 s (a log-normal with that median and mean
# has sigma = 2.64, so p90 = 206 * exp(1.2816 * 2.64)), mean GPU count 3.72, final states 62.4%
# completed, 22.1% canceled, 15.5% failed (early stop 0.376). The size shares are OUR reading of
# the artifact's job_cdf_gpunum figure, scaled to the published mean of 3.72 GPUs.
HELIOS = TraceStatistics(
    name="helios",
    buckets=(SizeBucket(0.665, (1,), 206.0, 206.0 * math.exp(1.2816 * 2.64)),
             SizeBucket(0.13, (2, 4), 206.0, 206.0 * math.exp(1.2816 * 2.64)),
             SizeBucket(0.13, (8,), 206.0, 206.0 * math.exp(1.2816 * 2.64)),
             SizeBucket(0.075, (16, 32), 206.0, 206.0 * math.exp(1.2816 * 2.64))),
    max_duration_s=14 * 86400.0,
    early_stop=0.376,
    source="Hu et al. SC'21 artifact summary (median 206 s, mean 6652 s, 3.72 GPUs, 62.4/22.1/"
           "15.5% completed/canceled/failed); size shares ours")

# Our own mix for the user's-jobs format: the four reference models, sizes 1-16, one hour median.
MIXED = TraceStatistics(
    name="mixed",
    buckets=(SizeBucket(0.4, (1, 2), 3600.0, 4 * 3600.0),
             SizeBucket(0.4, (4, 8), 3600.0, 4 * 3600.0),
             SizeBucket(0.2, (16,), 3600.0, 4 * 3600.0)),
    max_duration_s=3 * 86400.0,
    early_stop=0.3,
    source="ours: ResNet-50 / BERT-Base / VGG-16 / small-model curves, log-normal durations "
           "(median 1 h, p90 4 h)")

WORKLOADS = {s.name: s for s in (PHILLY, HELIOS, MIXED)}


def generate(stats: TraceStatistics, n_jobs: int, gpus: int, seed: int = 0,
             early_stop: Optional[float] = None, load: float = 0.9,
             models: Sequence[str] = tuple(REFERENCE_CURVES)) -> list[Job]:
    """n_jobs drawn from `stats`, Poisson arrivals at the rate that makes the offered load
    (GPU-seconds requested per second / gpus) equal `load` for this sample. early_stop (None:
    the statistics' own share): each job, with that probability, is stopped after a fraction
    U(0, 1) of its work, drawn from its own stream so the jobs are the same with and without."""
    if n_jobs < 1:
        raise ValueError(f"n_jobs must be >= 1, got {n_jobs}")
    check_gpus(gpus)
    if not load > 0:
        raise ValueError(f"load must be > 0 (offered GPU-seconds per GPU-second), got {load}")
    p_stop = stats.early_stop if early_stop is None else early_stop
    if not 0.0 <= p_stop <= 1.0:
        raise ValueError(f"early_stop is a probability in [0, 1], got {p_stop}")
    jobs_seq, arrival_seq, stop_seq = np.random.SeedSequence(seed).spawn(3)
    rng = np.random.default_rng(jobs_seq)
    shares = np.array([b.share for b in stats.buckets], dtype=float)
    shares /= shares.sum()
    sizes: list[int] = []
    durations: list[float] = []
    kinds: list[str] = []
    for _ in range(n_jobs):
        bucket = stats.buckets[int(rng.choice(len(shares), p=shares))]
        size = int(bucket.sizes[int(rng.integers(len(bucket.sizes)))])
        sigma = math.log(bucket.p90_s / bucket.median_s) / 1.2816
        duration = float(bucket.median_s * math.exp(sigma * rng.standard_normal()))
        sizes.append(min(size, gpus))
        durations.append(min(max(duration, 6.0), stats.max_duration_s))
        kinds.append(models[int(rng.integers(len(models)))])
    gpu_seconds = float(np.mean(np.array(sizes) * np.array(durations)))
    rate = load * gpus / gpu_seconds
    arrivals = np.cumsum(np.random.default_rng(arrival_seq).exponential(1.0 / rate, n_jobs))
    arrivals -= arrivals[0]
    stop_rng = np.random.default_rng(stop_seq)
    jobs = []
    for i in range(n_jobs):
        stop = 1.0
        killed, frac = stop_rng.random(), stop_rng.random()
        if killed < p_stop:
            stop = max(frac, 1e-3)
        curve = REFERENCE_CURVES[kinds[i]]
        work = durations[i] * curve.throughput(sizes[i])
        jobs.append(Job(id=i, arrival=float(arrivals[i]), work=work, curve=curve,
                        requested=sizes[i], stop_fraction=stop, name=f"{kinds[i]}-{i}"))
    return jobs


def check_gpus(gpus: int) -> None:
    if not isinstance(gpus, (int, np.integer)) or gpus < 1:
        raise ValueError(f"the cluster needs at least one GPU (worker), got gpus={gpus!r}")


def check_jobs(jobs: Sequence[Job], gpus: int) -> None:
    """Refuse what no policy could run: a job asking for more workers than the cluster has,
    non-positive work, an unknown stop fraction, duplicate ids."""
    check_gpus(gpus)
    seen: set[int] = set()
    for job in jobs:
        label = f"job {job.id} ({job.name})" if job.name else f"job {job.id}"
        if job.id in seen:
            raise ValueError(f"{label}: two jobs share this id; give each job its own id")
        seen.add(job.id)
        if job.requested < 1 or job.requested > gpus:
            raise ValueError(f"{label} asks for {job.requested} workers but the cluster has "
                             f"{gpus}: ask for 1..{gpus} or simulate a larger cluster")
        if not (job.work > 0 and math.isfinite(job.work)):
            raise ValueError(f"{label}: work must be a positive number of samples, got "
                             f"{job.work}")
        if not 0.0 < job.stop_fraction <= 1.0:
            raise ValueError(f"{label}: stop_fraction is in (0, 1], got {job.stop_fraction}")
        if not (job.arrival >= 0 and math.isfinite(job.arrival)):
            raise ValueError(f"{label}: arrival must be a time >= 0 in seconds, got "
                             f"{job.arrival}")
        if job.curve.throughput(job.requested) <= 0:
            raise ValueError(f"{label}: its curve gives no throughput at the requested "
                             f"{job.requested} workers")


def load_jobs(path: str) -> list[Job]:
    """A jobs file (JSON; format in docs/sharing-a-cluster.md) -> jobs sorted by arrival."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    return jobs_from_data(data, where=path)


def jobs_from_data(data: Any, where: str = "jobs") -> list[Job]:
    entries = data.get("jobs") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where}: expected {{\"jobs\": [ ... ]}} (or a list) with at least "
                         "one job")
    jobs = []
    for i, entry in enumerate(entries):
        try:
            jobs.append(_job_from_entry(i, entry))
        except (KeyError, TypeError, ValueError) as exc:
            msg = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
            raise ValueError(f"{where}: job #{i}: {msg}") from None
    return sorted(jobs, key=lambda j: (j.arrival, j.id))


def _job_from_entry(i: int, entry: Any) -> Job:
    if not isinstance(entry, dict):
        raise ValueError(f"a job is a JSON object, got {entry!r}")
    known = {"id", "name", "arrival", "work", "duration", "requested", "curve", "model",
             "stop_fraction"}
    unknown = set(entry) - known
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
    if ("curve" in entry) == ("model" in entry):
        raise ValueError(f"give exactly one of 'curve' (an object) or 'model' (one of "
                         f"{sorted(REFERENCE_CURVES)})")
    if "model" in entry:
        if entry["model"] not in REFERENCE_CURVES:
            raise ValueError(f"unknown model {entry['model']!r}: one of "
                             f"{sorted(REFERENCE_CURVES)}, or give a 'curve'")
        curve = REFERENCE_CURVES[entry["model"]]
    else:
        curve = curve_from_dict(entry["curve"])
    requested = int(entry.get("requested", 1))
    if ("work" in entry) == ("duration" in entry):
        raise ValueError("give exactly one of 'work' (samples) or 'duration' (seconds at the "
                         "requested workers)")
    if "work" in entry:
        work = float(entry["work"])
    else:
        work = float(entry["duration"]) * curve.throughput(requested)
    return Job(id=int(entry.get("id", i)), arrival=float(entry["arrival"]), work=work,
               curve=curve, requested=requested,
               stop_fraction=float(entry.get("stop_fraction", 1.0)),
               name=str(entry.get("name", "")))


def jobs_to_data(jobs: Sequence[Job]) -> dict[str, Any]:
    """Jobs as a jobs file's content (reference curves by name, others in full)."""
    names = {id(c): n for n, c in REFERENCE_CURVES.items()}
    out = []
    for job in jobs:
        entry: dict[str, Any] = {"id": job.id, "name": job.name, "arrival": job.arrival,
                                 "work": job.work, "requested": job.requested}
        if id(job.curve) in names:
            entry["model"] = names[id(job.curve)]
        else:
            entry["curve"] = curve_to_dict(job.curve)
        if job.stop_fraction < 1.0:
            entry["stop_fraction"] = job.stop_fraction
        out.append(entry)
    return {"jobs": out}

