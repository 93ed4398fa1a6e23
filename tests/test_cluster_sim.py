"""dear.cluster, the scheduler simulator, against answers known without it: an M/M/c queue's
mean response time (Erlang C), the best allocation found by exhaustive search, and the
invariants every policy must keep (workers <= G, every job ends, work conserved)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from dear.cluster import (FIFO, CommModelCurve, Job, JobView, LinearCurve, Optimus, Pollux,
                          TableCurve, as_curve, from_scaling_curve, generate, load_jobs,
                          make_policy, simulate)
from dear.cluster.__main__ import main as cli
from dear.cluster.metrics import batch_means_interval
from dear.cluster.policies import POLICIES
from dear.cluster.workload import MIXED, PHILLY


def erlang_c_response(c: int, lam: float, mu: float) -> float:
    """M/M/c mean response time W = C(c, a) / (c mu - lam) + 1/mu, a = lam/mu (Erlang C)."""
    a = lam / mu
    rho = a / c
    tail = a ** c / math.factorial(c) / (1 - rho)
    c_prob = tail / (sum(a ** k / math.factorial(k) for k in range(c)) + tail)
    return c_prob / (c * mu - lam) + 1 / mu


def test_mmc_mean_response_time_matches_erlang_c() -> None:
    """c = 5 workers, Poisson arrivals lam = 3.5/s, exponential work of mean 1 sample on a
    curve of 1 sample/s on exactly one worker (so service ~ Exp(mu = 1)), FIFO: rho = 0.7 and
    W = 1.2519 s. 20,000 jobs; the first 2,000 are dropped (the queue starts empty, which
    biases early response times low; at rho = 0.7 the busy periods are short, so 2,000 jobs
    is many relaxation times). The remaining 18,000 make 20 batches of 900 (each spans hundreds
    of busy periods, so batch means are close to independent); 99% interval, t(0.995, 19) =
    2.861: half-width about 0.08 s (6-8%, measured over 5 seeds while writing this).
    What it catches: an off-by-one in workers gives W = 2.476 (c = 4) or 1.071 (c = 6, 0.18 s
    away, about twice the half-width), a 10% longer service time 1.576, each outside the
    interval (asserted below); a policy
    that let a job skip the queue or progress at the wrong rate shifts W the same way."""
    from scipy import stats
    lam, mu, c, n, warm, batches = 3.5, 1.0, 5, 20_000, 2_000, 20
    rng = np.random.default_rng(12345)
    arrivals = np.cumsum(rng.exponential(1 / lam, n))
    work = rng.exponential(1 / mu, n)
    curve = LinearCurve(per_worker=1.0, max_workers=1)
    jobs = [Job(i, float(arrivals[i]), float(work[i]), curve, 1) for i in range(n)]
    result = simulate(jobs, c, FIFO())
    response = [r.jct for r in result.records][warm:]
    mean, half = batch_means_interval(response, batches, float(stats.t.ppf(0.995, batches - 1)))
    expected = erlang_c_response(c, lam, mu)
    assert half < 0.1 * expected, f"interval too wide to catch anything: +-{half:.3f}"
    assert abs(mean - expected) <= half, (mean, half, expected)
    for wrong in (erlang_c_response(c - 1, lam, mu), erlang_c_response(c + 1, lam, mu),
                  erlang_c_response(c, lam, mu / 1.1)):
        assert abs(wrong - mean) > half              # this interval rejects each of them


def _concave_jobs() -> list[JobView]:
    """Four jobs with concave curves (piecewise linear, decreasing slopes; one Pollux model
    with gamma=1, also concave) and different remaining work."""
    curves = [TableCurve.from_points([(1, 100), (2, 190), (4, 340), (8, 560)]),
              TableCurve.from_points([(1, 50), (2, 70), (3, 80), (6, 90)]),
              TableCurve.from_points([(1, 10), (2, 20), (4, 39), (5, 47)]),
              CommModelCurve(batch=32, t_compute=0.1, grad_bytes=0.0, bandwidth=1.0,
                             max_workers=6)]
    remaining = [5e5, 2e4, 3e3, 8e4]
    return [JobView(i, float(i), remaining[i], 1, c, c.max_workers)
            for i, c in enumerate(curves)]


def _brute_force(views: list[JobView], gpus: int, objective) -> float:
    best = -math.inf
    for ns in itertools.product(*(range(1, v.max_workers + 1) for v in views)):
        if sum(ns) <= gpus:
            best = max(best, sum(objective(v, n) for v, n in zip(views, ns)))
    return best


@pytest.mark.parametrize("gpus", [4, 7, 10, 15])
@pytest.mark.parametrize("p", [-1.0, 0.0, 1.0])
def test_pollux_allocation_is_the_exhaustive_optimum(gpus: int, p: float) -> None:
    """The Pollux-like fitness sum s(n)^p / p (sum log s at p = 0; p = 1: total normalized
    throughput) of the policy's allocation equals the best over every allocation (each job
    >= 1 worker, sum <= G) enumerated by itertools."""
    views = _concave_jobs()

    def fitness(v: JobView, n: int) -> float:
        s = v.curve.throughput(n) / v.curve.throughput(1)
        return math.log(s) if p == 0 else s ** p / p
    alloc = Pollux(p=p).allocate(0.0, views, gpus)
    assert sum(alloc.values()) <= gpus and all(alloc[v.id] >= 1 for v in views)
    got = sum(fitness(v, alloc[v.id]) for v in views)
    assert got == pytest.approx(_brute_force(views, gpus, fitness), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("gpus", [4, 7, 10, 15])
def test_optimus_allocation_is_the_exhaustive_optimum(gpus: int) -> None:
    """Optimus-like minimizes the sum of estimated remaining times R / f(n) (convex in n when
    f is concave); its allocation's sum equals the exhaustive minimum."""
    views = _concave_jobs()

    def neg_time(v: JobView, n: int) -> float:
        return -v.work / v.curve.throughput(n)
    alloc = Optimus().allocate(0.0, views, gpus)
    got = sum(neg_time(v, alloc[v.id]) for v in views)
    assert got == pytest.approx(_brute_force(views, gpus, neg_time), rel=1e-12)


def _records(seed: int, policy: str) -> list[tuple]:
    jobs = generate(PHILLY, 40, 16, seed=seed, early_stop=0.3)
    result = simulate(jobs, 16, make_policy(policy), restart_s=30.0)
    return [(r.id, r.arrival, r.start, r.finish, r.done) for r in result.records]


@pytest.mark.parametrize("policy", POLICIES)
def test_same_seed_same_result_other_seed_other_result(policy: str) -> None:
    assert _records(3, policy) == _records(3, policy)
    assert _records(3, policy) != _records(4, policy)


@pytest.mark.parametrize("policy", list(POLICIES) + ["pollux:p=1,period=0",
                                                     "tiresias:thresholds=600/6000"])
@pytest.mark.parametrize("workload", [PHILLY, MIXED])
def test_policy_invariants(policy: str, workload) -> None:
    """Never more than G workers; every job ends, once; each job's work done is its declared
    work times its hidden stop fraction, and the totals agree; no job finishes faster than its
    best speed allows; allocated GPU-seconds fit in G x makespan."""
    gpus = 16
    jobs = generate(workload, 60, gpus, seed=7, early_stop=0.4, load=1.2)
    assert any(j.stop_fraction < 1 for j in jobs) and any(j.stop_fraction == 1 for j in jobs)
    result = simulate(jobs, gpus, make_policy(policy), restart_s=20.0, record_timeline=True)
    assert result.max_allocated <= gpus
    assert max(used for _, used in result.timeline) <= gpus
    assert sorted(r.id for r in result.records) == sorted(j.id for j in jobs)
    by_id = {j.id: j for j in jobs}
    for r in result.records:
        job = by_id[r.id]
        assert r.done == pytest.approx(job.work * job.stop_fraction, rel=1e-12)
        assert r.stopped == (job.stop_fraction < 1)
        best = max(job.curve.throughput(n) for n in range(1, gpus + 1))
        assert r.finish - r.start >= job.work * job.stop_fraction / best * (1 - 1e-9) + 20.0
        assert r.start >= r.arrival
    assert sum(r.done for r in result.records) == pytest.approx(
        sum(j.work * j.stop_fraction for j in jobs), rel=1e-12)
    assert result.busy_gpu_seconds <= gpus * result.makespan * (1 + 1e-12)


def test_a_policy_that_oversubscribes_is_refused() -> None:
    class Greedy:
        name = "greedy"

        def allocate(self, now, jobs, gpus):
            return {v.id: v.max_workers for v in jobs}

        def next_decision(self, now, jobs, gpus):
            return None
    jobs = [Job(i, 0.0, 100.0, LinearCurve(1.0), 1) for i in range(3)]
    with pytest.raises(RuntimeError, match="allocated"):
        simulate(jobs, 4, Greedy())


def test_bad_input_is_refused_clearly(tmp_path: Path) -> None:
    curve = LinearCurve(1.0)
    with pytest.raises(ValueError, match="at least one GPU"):
        simulate([Job(0, 0.0, 1.0, curve, 1)], 0, FIFO())
    with pytest.raises(ValueError, match="asks for 9 workers but the cluster has 8"):
        simulate([Job(0, 0.0, 1.0, curve, 9)], 8, FIFO())
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("lifo")
    with pytest.raises(ValueError, match="worker count appears twice"):
        TableCurve.from_points([(1, 1.0), (1, 2.0)])
    with pytest.raises(ValueError, match="cannot make a throughput curve"):
        as_curve("fast")
    cases = {
        "not json": ("{jobs: [", "not valid JSON"),
        "no jobs": (json.dumps({"jobs": []}), "at least one job"),
        "no arrival": (json.dumps({"jobs": [{"work": 1, "model": "resnet50"}]}),
                       "missing field 'arrival'"),
        "bad kind": (json.dumps({"jobs": [{"arrival": 0, "work": 1,
                                           "curve": {"kind": "magic"}}]}),
                     "unknown curve kind 'magic'"),
        "work and duration": (json.dumps({"jobs": [{"arrival": 0, "work": 1, "duration": 2,
                                                    "model": "bert_base"}]}),
                              "exactly one of 'work'"),
        "typo": (json.dumps({"jobs": [{"arrival": 0, "work": 1, "model": "vgg16",
                                       "requsted": 2}]}), "unknown field"),
    }
    for name, (text, message) in cases.items():
        path = tmp_path / f"{name.replace(' ', '_')}.json"
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_jobs(str(path))


def test_jobs_file_round_trip_and_cli(tmp_path: Path) -> None:
    """example-jobs writes a file that simulate reads back; the CLI writes its three outputs
    and refuses a job larger than the cluster with exit code 2."""
    path = tmp_path / "jobs.json"
    assert cli(["example-jobs", str(path), "--jobs", "12", "--gpus", "8"]) == 0
    jobs = load_jobs(str(path))
    assert len(jobs) == 12 and all(1 <= j.requested <= 8 for j in jobs)
    out = tmp_path / "out"
    assert cli(["simulate", "--jobs-file", str(path), "--gpus", "8", "--policies",
                "fifo,pollux", "--out", str(out)]) == 0
    for name in ("results.json", "results.md", "jct_cdf.png"):
        assert (out / name).stat().st_size > 0
    summary = json.loads((out / "results.json").read_text())["summary"]
    assert {s["policy"] for s in summary} == {"fifo", "pollux"}
    assert cli(["simulate", "--jobs-file", str(path), "--gpus", "2", "--out",
                str(out)]) == 2


def test_a_scaling_curve_becomes_a_table_curve() -> None:
    """dear.diagnose.scale's result (duck-typed here: workers + samples_per_s) maps onto a
    TableCurve: exact at the predicted points, interpolated between, capped at the last."""
    class Scaling:
        workers = [1, 2, 4, 8]
        batch_size = 32

        def samples_per_s(self, schedule: str, model: str = "replay") -> list[float]:
            return {"dear": [100.0, 190.0, 350.0, 600.0]}[schedule]
    curve = from_scaling_curve(Scaling(), "dear")
    assert [curve.throughput(n) for n in (0, 1, 2, 3, 4, 8, 16)] == [
        0.0, 100.0, 190.0, 270.0, 350.0, 600.0, 600.0]
    assert curve.max_workers == 8
    with pytest.raises(ValueError, match="ScalingCurve"):
        from_scaling_curve(object())
