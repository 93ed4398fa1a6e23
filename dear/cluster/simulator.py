"""The discrete-event simulation: jobs arrive, a policy allocates workers, jobs progress at their
curve's throughput until the next event.

Between two events every allocation is constant, so each running job's progress is exact
(rate x time, no time step): the next event is the earliest of the next arrival, a running job
reaching the end of its work (or its hidden early stop), and a time the policy asks to decide
again (a Tiresias queue threshold, a Pollux period). A job whose allocation changes to a new
non-zero size makes no progress for `restart_s` seconds (checkpoint and restart); so does its
first start."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

from .curves import ThroughputCurve
from .workload import Job, check_jobs


@dataclass
class JobView:
    """What a policy sees of a job: what it declared and what it received so far; never its
    early stop. remaining is declared work minus done."""

    id: int
    arrival: float
    work: float
    requested: int
    curve: ThroughputCurve
    max_workers: int
    done: float = 0.0
    attained: float = 0.0          # GPU-seconds received (Tiresias' attained service)
    workers: int = 0
    started: bool = False
    last_run: float = -1.0          # when it last held workers (-1: never)
    executed: float = 0.0           # seconds it held workers

    @property
    def remaining(self) -> float:
        return max(self.work - self.done, 0.0)


class Policy(Protocol):
    """A scheduling policy: given the active jobs (arrival order), the workers each gets."""

    name: str

    def allocate(self, now: float, jobs: Sequence[JobView], gpus: int) -> dict[int, int]: ...

    def next_decision(self, now: float, jobs: Sequence[JobView],
                      gpus: int) -> Optional[float]: ...


@dataclass
class JobRecord:
    """One job's outcome. jct = finish - arrival; stopped: ended by its early stop."""

    id: int
    name: str
    arrival: float
    start: float
    finish: float
    work: float
    done: float
    requested: int
    stopped: bool
    restarts: int

    @property
    def jct(self) -> float:
        return self.finish - self.arrival


@dataclass
class SimulationResult:
    policy: str
    gpus: int
    records: list[JobRecord]
    busy_gpu_seconds: float          # integral of allocated workers over time
    max_allocated: int               # the most workers held at once (<= gpus)
    events: int
    restarts: int
    timeline: list[tuple[float, int]] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        if not self.records:
            return 0.0
        return max(r.finish for r in self.records) - min(r.arrival for r in self.records)

    @property
    def utilization(self) -> float:
        span = self.makespan
        return self.busy_gpu_seconds / (self.gpus * span) if span > 0 else 0.0


_REL = 1e-9


#: Seconds a job makes no progress when it starts or is resized, by default: dear's measured
#: resize under torchrun's elastic agent, a node lost to the first step at the new size
#: (ResNet-50, 2 ranks: docs/elastic.md#what-it-costs).
RESIZE_S = 11.0


def simulate(jobs: Sequence[Job], gpus: int, policy: Policy, restart_s: float = 0.0,
             record_timeline: bool = False) -> SimulationResult:
    """Run `jobs` on `gpus` workers under `policy` until every job finished or was stopped."""
    check_jobs(jobs, gpus)
    if not (restart_s >= 0 and math.isfinite(restart_s)):
        raise ValueError(f"restart_s must be >= 0 seconds, got {restart_s}")
    pending = sorted(jobs, key=lambda j: (j.arrival, j.id))
    by_id = {j.id: j for j in pending}
    target = {j.id: j.stopped_work for j in pending}
    active: dict[int, JobView] = {}
    stall: dict[int, float] = {}
    restarts: dict[int, int] = {}
    starts: dict[int, float] = {}
    records: list[JobRecord] = []
    busy = 0.0
    max_alloc = 0
    events = 0
    timeline: list[tuple[float, int]] = []
    idx = 0
    t = pending[0].arrival if pending else 0.0
    while idx < len(pending) or active:
        while idx < len(pending) and pending[idx].arrival <= t:
            j = pending[idx]
            active[j.id] = JobView(j.id, j.arrival, j.work, j.requested, j.curve,
                                   max(1, min(j.curve.max_workers, gpus)))
            idx += 1
        views = list(active.values())
        if views:
            alloc = policy.allocate(t, views, gpus)
            used = _apply(alloc, active, gpus, policy.name, t, restart_s, stall, restarts,
                          starts)
            max_alloc = max(max_alloc, used)
            if record_timeline:
                timeline.append((t, used))
        events += 1
        # the next event
        t_next = pending[idx].arrival if idx < len(pending) else math.inf
        running = []                       # (view, rate, progress resumes at, finish time)
        for v in views:
            if v.workers:
                rate = v.curve.throughput(v.workers)
                resume = stall.get(v.id, t)
                resume = resume if resume > t else t
                end = resume + (target[v.id] - v.done) / rate if rate > 0 else math.inf
                running.append((v, rate, resume, end))
                if end < t_next:
                    t_next = end
        decide = policy.next_decision(t, views, gpus) if views else None
        if decide is not None and decide > t * (1 + _REL) + _REL and decide < t_next:
            t_next = decide
        if math.isinf(t_next):
            raise RuntimeError(f"policy {policy.name!r} left {len(views)} job(s) waiting with "
                               f"nothing running and nothing to wait for at t={t:.6g}")
        # advance every running job to t_next; those whose end is reached finish
        dt = t_next - t
        close = t_next * (1 + _REL) + _REL
        for v, rate, resume, end in running:
            if t_next > resume:
                v.done += rate * (t_next - resume)
            v.attained += v.workers * dt
            v.executed += dt
            v.last_run = t_next
            busy += v.workers * dt
            if end <= close:
                job = by_id[v.id]
                v.done = target[v.id]
                records.append(JobRecord(v.id, job.name, job.arrival, starts[v.id], t_next,
                                         job.work, v.done, job.requested,
                                         job.stop_fraction < 1.0, restarts.get(v.id, 0)))
                del active[v.id]
        t = t_next
    records.sort(key=lambda r: r.id)
    return SimulationResult(policy.name, gpus, records, busy, max_alloc, events,
                            sum(restarts.values()), timeline)


def _apply(alloc: dict[int, int], active: dict[int, JobView], gpus: int, name: str, t: float,
           restart_s: float, stall: dict[int, float], restarts: dict[int, int],
           starts: dict[int, float]) -> int:
    """Check a policy's answer (a bug there must not pass as a result) and install it."""
    unknown = set(alloc) - set(active)
    if unknown:
        raise RuntimeError(f"policy {name!r} allocated workers to jobs not in the cluster: "
                           f"{sorted(unknown)[:5]}")
    used = 0
    for jid, n in alloc.items():
        v = active[jid]
        if not isinstance(n, int) or n < 0 or n > v.max_workers:
            raise RuntimeError(f"policy {name!r} gave job {jid} {n!r} workers (allowed "
                               f"0..{v.max_workers})")
        used += n
    if used > gpus:
        raise RuntimeError(f"policy {name!r} allocated {used} workers on a cluster of {gpus}")
    for jid, v in active.items():
        n = alloc.get(jid, 0)
        if n != v.workers and n > 0:
            stall[jid] = t + restart_s
            if v.started:
                restarts[jid] = restarts.get(jid, 0) + 1
            else:
                starts[jid] = t
            v.started = True
        v.workers = n
    return used
