"""Scheduling policies: FIFO, SRTF, Tiresias-like, Optimus-like, Pollux-like.

Each is `allocate(now, jobs, gpus) -> {job id: workers}` over the active jobs (in arrival
order) and optionally a time it wants to decide again. What each knows: FIFO and Tiresias no job
length; SRTF and Optimus the declared remaining work (never the hidden early stop); Pollux only
the curves. Steps of each are in docs/sharing-a-cluster.md."""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional, Sequence, cast

import numpy as np

from .curves import ThroughputCurve
from .simulator import JobView


def _size(v: JobView) -> int:
    return min(v.requested, v.max_workers)


class FIFO:
    """Jobs start in arrival order with the workers they asked for, and keep them to the end;
    the head of the queue waits for room (no backfilling), as a plain batch queue does."""

    name = "fifo"

    def allocate(self, now: float, jobs: Sequence[JobView], gpus: int) -> dict[int, int]:
        alloc = {v.id: v.workers for v in jobs if v.workers}
        free = gpus - sum(alloc.values())
        for v in jobs:
            if v.workers:
                continue
            if _size(v) > free:
                break
            alloc[v.id] = _size(v)
            free -= _size(v)
        return alloc

    def next_decision(self, now: float, jobs: Sequence[JobView], gpus: int) -> Optional[float]:
        return None


def _greedy_fixed(order: Sequence[JobView], gpus: int) -> dict[int, int]:
    """Requested sizes in priority order, skipping a job that does not fit (backfilling)."""
    alloc: dict[int, int] = {}
    free = gpus
    for v in order:
        if _size(v) <= free:
            alloc[v.id] = _size(v)
            free -= _size(v)
    return alloc


class SRTF:
    """Shortest remaining time first, preemptive: at every event, jobs sorted by declared
    remaining work / throughput at their requested size; each gets its requested workers in that
    order when they fit."""

    name = "srtf"

    def allocate(self, now: float, jobs: Sequence[JobView], gpus: int) -> dict[int, int]:
        order = sorted(jobs, key=lambda v: (v.remaining / v.curve.throughput(_size(v)),
                                            v.arrival, v.id))
        return _greedy_fixed(order, gpus)

    def next_decision(self, now: float, jobs: Sequence[JobView], gpus: int) -> Optional[float]:
        return None


@dataclass
class Tiresias:
    """Discretized two-dimensional least-attained-service (Tiresias, NSDI 2019), no job
    length: a job's attained service is the GPU-seconds it has received; it sits in queue k
    while that is below thresholds[k]; queues in order, FIFO (arrival) inside a queue, requested
    sizes, preemptive. Decides again when a running job crosses a threshold."""

    thresholds: tuple[float, ...] = (3600.0, 36000.0)
    name: str = "tiresias"

    def __post_init__(self) -> None:
        if list(self.thresholds) != sorted(self.thresholds) or any(
                t <= 0 for t in self.thresholds):
            raise ValueError(f"tiresias thresholds must be increasing GPU-seconds > 0, got "
                             f"{self.thresholds}")

    def queue(self, v: JobView) -> int:
        for k, limit in enumerate(self.thresholds):
            if v.attained < limit:
                return k
        return len(self.thresholds)

    def allocate(self, now: float, jobs: Sequence[JobView], gpus: int) -> dict[int, int]:
        order = sorted(jobs, key=lambda v: (self.queue(v), v.arrival, v.id))
        return _greedy_fixed(order, gpus)

    def next_decision(self, now: float, jobs: Sequence[JobView], gpus: int) -> Optional[float]:
        soonest = math.inf
        for v in jobs:
            k = self.queue(v)
            if v.workers and k < len(self.thresholds):
                soonest = min(soonest, now + (self.thresholds[k] - v.attained) / v.workers)
        return None if math.isinf(soonest) else soonest


def throughputs(curve: ThroughputCurve, cap: int) -> np.ndarray:
    """curve.throughput(n) for n = 0..cap, cached for hashable curves (workloads share a few
    curves, and every decision asks again)."""
    try:
        return _cached_throughputs(cast(Hashable, curve), cap)
    except TypeError:                           # an unhashable user curve: no cache
        return np.array([curve.throughput(n) for n in range(cap + 1)], dtype=float)


@functools.lru_cache(maxsize=4096)
def _cached_throughputs(curve: Hashable, cap: int) -> np.ndarray:
    table = np.array([cast(ThroughputCurve, curve).throughput(n) for n in range(cap + 1)],
                     dtype=float)
    table.setflags(write=False)
    return table


def marginal_allocation(jobs: Sequence[JobView], gpus: int,
                        values: Callable[[JobView, np.ndarray], np.ndarray],
                        first: Callable[[JobView], tuple[float, ...]]) -> dict[int, int]:
    """One worker each in the order `first` gives (while workers last), then the rest one step
    at a time to the job whose value rises most per added worker. A step may add several workers
    at once (the best average gain over any look-ahead), so a curve that dips before it rises is
    not left behind; on concave values this is exactly the optimum of sum(value) (greedy on a
    separable concave objective), which tests/test_cluster_sim.py checks by exhaustive search."""
    alloc: dict[int, int] = {}
    free = gpus
    for v in sorted(jobs, key=first):
        if free == 0:
            break
        alloc[v.id] = 1
        free -= 1
    views = {v.id: v for v in jobs}
    # each job's value at 0..cap workers (index 0 unused), once per decision
    table = {jid: values(views[jid], throughputs(views[jid].curve,
                                                 min(views[jid].max_workers, gpus)))
             for jid in alloc}

    def best_step(jid: int) -> tuple[float, int]:
        vals, n = table[jid], alloc[jid]
        k_max = min(len(vals) - 1 - n, free)
        if k_max <= 0:
            return 0.0, 0
        gains = (vals[n + 1: n + k_max + 1] - vals[n]) / np.arange(1, k_max + 1)
        k = int(np.argmax(gains))               # the first of equal gains: fewest workers
        return (float(gains[k]), k + 1) if gains[k] > 0 else (0.0, 0)

    heap: list[tuple[float, float, int, int]] = []
    for jid in alloc:
        gain, k = best_step(jid)
        if k:
            heapq.heappush(heap, (-gain, views[jid].arrival, jid, k))
    while heap and free > 0:
        _, _, jid, k = heapq.heappop(heap)
        if k > free:                       # stale: fewer workers left than it planned for
            gain, k = best_step(jid)
            if k:
                heapq.heappush(heap, (-gain, views[jid].arrival, jid, k))
            continue
        alloc[jid] += k
        free -= k
        gain, k = best_step(jid)
        if k:
            heapq.heappush(heap, (-gain, views[jid].arrival, jid, k))
    return alloc


@dataclass
class _Periodic:
    """Re-decide at most once per `period` seconds, and only when the set of jobs changed (the
    curves are fixed, so nothing else changes the answer); in between, allocations stay and new
    jobs wait for the next decision (Pollux decides every 60 s)."""

    period: float = 0.0
    _decided_at: float = field(default=-math.inf, init=False, repr=False)
    _ids: Optional[tuple[int, ...]] = field(default=None, init=False, repr=False)

    def _due(self, now: float, jobs: Sequence[JobView]) -> bool:
        ids = tuple(v.id for v in jobs)
        if ids == self._ids:
            return False
        return now >= self._decided_at + self.period - 1e-9 * max(1.0, abs(now))

    def _decided(self, now: float, jobs: Sequence[JobView]) -> None:
        self._decided_at, self._ids = now, tuple(v.id for v in jobs)

    def next_decision(self, now: float, jobs: Sequence[JobView], gpus: int) -> Optional[float]:
        if tuple(v.id for v in jobs) == self._ids:
            return None
        return max(now, self._decided_at + self.period)


@dataclass
class Optimus(_Periodic):
    """Optimus-like (EuroSys 2018): elastic, knows each job's declared remaining work R and its
    curve f; minimizes the sum of estimated remaining times sum R/f(n): one worker each to the
    jobs with the shortest R/f(1) first, then each further worker where it cuts R/f(n) most."""

    period: float = 60.0
    name: str = "optimus"

    def allocate(self, now: float, jobs: Sequence[JobView], gpus: int) -> dict[int, int]:
        if not self._due(now, jobs):
            return {v.id: v.workers for v in jobs}
        self._decided(now, jobs)
        return marginal_allocation(jobs, gpus, self.values,
                                   lambda v: (v.remaining / v.curve.throughput(1), v.arrival,
                                              v.id))

    @staticmethod
    def values(v: JobView, thr: np.ndarray) -> np.ndarray:
        """-(estimated remaining time) on n workers: what the greedy maximizes."""
        with np.errstate(divide="ignore"):
            return -v.remaining / thr


@dataclass
class Pollux(_Periodic):
    """Pollux-like (OSDI 2021) without the statistical-efficiency term: maximizes the
    cluster's fitness, the power mean of the jobs' speedups s(n) = f(n)/f(1), sum s^p / p
    (p = -1, Pollux's default, favours fairness; p = 1 is the total normalized throughput;
    p = 0 is sum log s); no job length. One worker each, oldest first, then the greedy."""

    p: float = -1.0
    period: float = 60.0
    name: str = "pollux"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.p) and self.p <= 1.0):
            raise ValueError(f"pollux p must be <= 1 (a concave fitness), got {self.p}")

    def allocate(self, now: float, jobs: Sequence[JobView], gpus: int) -> dict[int, int]:
        if not self._due(now, jobs):
            return {v.id: v.workers for v in jobs}
        self._decided(now, jobs)
        return marginal_allocation(jobs, gpus, self.values, lambda v: (v.arrival, v.id))

    def values(self, v: JobView, thr: np.ndarray) -> np.ndarray:
        """The fitness term s(n)^p / p (log s(n) at p = 0), s(n) = f(n) / f(1)."""
        s = thr / thr[1]
        with np.errstate(divide="ignore"):
            return np.log(s) if self.p == 0 else s ** self.p / self.p


POLICIES = ("fifo", "srtf", "tiresias", "optimus", "pollux")


def make_policy(spec: str) -> FIFO | SRTF | Tiresias | Optimus | Pollux:
    """'name' or 'name:key=value,key=value' (pollux:p=1,period=60; tiresias:thresholds=3600/
    36000; optimus:period=600) -> a fresh policy (policies keep state: one per simulation)."""
    name, _, rest = spec.strip().partition(":")
    kwargs: dict[str, object] = {}
    for item in filter(None, rest.split(",")):
        key, eq, val = item.partition("=")
        if not eq:
            raise ValueError(f"policy option {item!r} in {spec!r}: write key=value")
        try:
            kwargs[key.strip()] = (tuple(float(x) for x in val.split("/"))
                                   if key.strip() == "thresholds" else float(val))
        except ValueError:
            raise ValueError(f"policy option {item!r} in {spec!r}: not a number") from None
    makers: dict[str, Callable[..., FIFO | SRTF | Tiresias | Optimus | Pollux]] = {
        "fifo": FIFO, "srtf": SRTF, "tiresias": Tiresias, "optimus": Optimus, "pollux": Pollux}
    if name not in makers:
        raise ValueError(f"unknown policy {name!r}: one of {', '.join(POLICIES)}")
    try:
        policy = makers[name](**kwargs)
    except TypeError:
        raise ValueError(f"policy {name!r} does not take {sorted(kwargs)}") from None
    if rest:
        policy.name = spec.strip()
    return policy
