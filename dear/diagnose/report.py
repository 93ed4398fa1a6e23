"""What a trace says: per iteration compute, communication, and how much of it was hidden.

Definitions (per rank, within an iteration's window, from the previous step's end to its own):
- compute: the model's work on the training thread: the root module's forward, the loss between
  forward and backward, backward, dear's per-bucket updates and step(), minus the time blocked in
  a collective's wait();
- communication: the union of the collectives' intervals (issue to completion);
- exposed communication: communication while no compute runs; hidden = communication - exposed;
  overlap ratio = hidden / communication;
- idle: neither compute nor communication (data loading, zero_grad, Python outside the model).
So iteration time = compute + exposed communication + idle.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from typing import Any, Optional

from .chrome import RankTrace, Trace, load_trace
from .intervals import Interval, clip, subtract, total, union


@dataclasses.dataclass
class IterationStats:
    rank: int
    iteration: int
    time: float
    compute: float
    comm: float
    exposed: float
    idle: float

    @property
    def hidden(self) -> float:
        return self.comm - self.exposed

    @property
    def overlap(self) -> Optional[float]:
        return self.hidden / self.comm if self.comm > 0 else None


@dataclasses.dataclass
class Report:
    path: str
    world_size: int
    schedule: str
    per_rank: list[IterationStats]                 # one per (rank, iteration)
    layers: list[tuple[str, float, float]]          # (module, forward s, backward s), slowest first
    buckets: list[dict[str, Any]]                   # slowest first
    rank_compute: dict[int, float]                  # mean compute per iteration, by rank

    def iterations(self) -> list[IterationStats]:
        """Per iteration, every figure averaged over ranks (so time = compute + exposed +
        idle still holds); ranks' windows differ only by when each one's step() returned."""
        by_it: dict[int, list[IterationStats]] = defaultdict(list)
        for s in self.per_rank:
            by_it[s.iteration].append(s)
        out = []
        for it, rows in sorted(by_it.items()):
            n = len(rows)
            out.append(IterationStats(-1, it, sum(r.time for r in rows) / n,
                                      sum(r.compute for r in rows) / n,
                                      sum(r.comm for r in rows) / n,
                                      sum(r.exposed for r in rows) / n,
                                      sum(r.idle for r in rows) / n))
        return out

    @property
    def slowest_rank(self) -> Optional[int]:
        return max(self.rank_compute, key=self.rank_compute.__getitem__) if self.rank_compute \
            else None


def compute_intervals(rank: RankTrace, iteration: int) -> list[Interval]:
    """The training thread's model work in `iteration` (see the module docstring)."""
    spans = [s for s in rank.spans if s.iteration == iteration]
    root_forward = [s for s in spans if s.cat == "forward" and s.args.get("module") == 0]
    backward = [s for s in spans if s.cat == "backward"]
    busy = [(s.start, s.end) for s in root_forward + backward]
    busy += [(s.start, s.end) for s in spans if s.cat in ("update", "step")]
    for fwd in root_forward:                   # the loss: forward's end to backward's start
        after = [b.start for b in backward if b.start >= fwd.end]
        if after:
            busy.append((fwd.end, min(after)))
    waits = [(s.start, s.end) for s in rank.spans if s.cat == "wait"]   # any iteration's
    return subtract(busy, waits)


def comm_intervals(rank: RankTrace) -> list[Interval]:
    return union((s.start, s.end) for s in rank.spans if s.cat == "comm")


def iteration_stats(rank: RankTrace, iteration: int) -> IterationStats:
    window = rank.iterations[iteration]
    lo, hi = window.start, window.end
    compute = clip(compute_intervals(rank, iteration), lo, hi)
    comm = clip(comm_intervals(rank), lo, hi)
    exposed = subtract(comm, compute)
    idle = subtract(subtract([(lo, hi)], compute), comm)
    return IterationStats(rank.rank, iteration, hi - lo, total(compute), total(comm),
                          total(exposed), total(idle))


def build_report(trace: Trace | str, top: int = 5) -> Report:
    if isinstance(trace, str):
        trace = load_trace(trace)
    iterations = trace.common_iterations()
    if not iterations:
        raise ValueError(f"{trace.path}: no iteration was traced on every rank; trace more "
                         "iterations (the range must end before training does)")
    per_rank = [iteration_stats(r, it) for r in trace.ranks for it in iterations]
    rank_compute = {r.rank: statistics.mean(s.compute for s in per_rank if s.rank == r.rank)
                    for r in trace.ranks}
    return Report(trace.path, trace.world_size, str(trace.meta.get("schedule", "?")), per_rank,
                  _slowest_layers(trace, iterations, top), _slowest_buckets(trace, top),
                  rank_compute)


def _slowest_layers(trace: Trace, iterations: list[int], top: int
                    ) -> list[tuple[str, float, float]]:
    """Mean forward and backward seconds per iteration of each leaf module, over ranks."""
    fwd: dict[str, float] = defaultdict(float)
    bwd: dict[str, float] = defaultdict(float)
    for rank in trace.ranks:
        modules = rank.meta.get("modules", [])
        for s in rank.spans:
            m = s.args.get("module")
            if m is None or s.iteration not in iterations or not modules[m].get("leaf"):
                continue
            (fwd if s.cat == "forward" else bwd)[modules[m]["name"]] += s.duration
    n = len(iterations) * len(trace.ranks)
    rows = [(name, fwd[name] / n, bwd[name] / n) for name in set(fwd) | set(bwd)]
    return sorted(rows, key=lambda r: -(r[1] + r[2]))[:top]


def _slowest_buckets(trace: Trace, top: int) -> list[dict[str, Any]]:
    """Per (bucket, kind): mean time on the link (from the last rank's issue or the end of the
    collective before it, whichever is later), bytes and the rate."""
    from .graph import collective_samples
    bucket_of = {int(s.args["seq"]): s.args.get("bucket") for s in trace.ranks[0].of("comm")}
    rows: dict[tuple[Any, str], list[tuple[float, int]]] = defaultdict(list)
    for sample in collective_samples(trace, queued=True):
        rows[(bucket_of.get(sample["seq"]), sample["kind"])].append(
            (sample["seconds"], sample["bytes"]))
    out = []
    for (bucket, kind), samples in rows.items():
        mean = statistics.mean(d for d, _ in samples)
        nbytes = samples[0][1]
        out.append({"bucket": bucket, "kind": kind, "seconds": mean, "bytes": nbytes,
                    "gbit_per_s": nbytes * 8 / mean / 1e9 if mean > 0 else None,
                    "count": len(samples)})
    return sorted(out, key=lambda r: -r["seconds"])[:top]


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def format_report(rep: Report) -> str:
    lines = [f"{rep.path}: schedule {rep.schedule}, {rep.world_size} ranks "
             f"(ms per iteration, averaged over ranks)", "",
             "| iteration | time | compute | communication | exposed comm | overlap | idle |",
             "|---|---|---|---|---|---|---|"]
    rows = rep.iterations()
    for s in rows:
        ov = "-" if s.overlap is None else f"{s.overlap:.0%}"
        lines.append(f"| {s.iteration} | {_ms(s.time)} | {_ms(s.compute)} | {_ms(s.comm)} | "
                     f"{_ms(s.exposed)} | {ov} | {_ms(s.idle)} |")
    if rows:
        med = {k: statistics.median(getattr(s, k) for s in rows)
               for k in ("time", "compute", "comm", "exposed", "idle")}
        comm = sum(s.comm for s in rows)
        ov = f"{sum(s.hidden for s in rows) / comm:.0%}" if comm > 0 else "-"
        lines.append(f"| median | {_ms(med['time'])} | {_ms(med['compute'])} | "
                     f"{_ms(med['comm'])} | {_ms(med['exposed'])} | {ov} | {_ms(med['idle'])} |")
    if rep.layers:
        lines += ["", "Slowest layers (ms per iteration): " + ", ".join(
            f"{name} {_ms(f)} fwd + {_ms(b)} bwd" for name, f, b in rep.layers)]
    if rep.buckets:
        lines += ["", "Slowest collectives (mean time on the link): " + ", ".join(
            f"{b['kind']} bucket {b['bucket']} {_ms(b['seconds'])} ms for "
            f"{b['bytes'] / 2**20:.1f} MB ({b['gbit_per_s'] or 0:.2f} Gbit/s of buffer)"
            for b in rep.buckets)]
    slow = rep.slowest_rank
    if len(rep.rank_compute) > 1 and slow is not None:
        others = statistics.median(rep.rank_compute.values())
        lines += ["", f"Slowest rank: {slow} (compute {_ms(rep.rank_compute[slow])} ms per "
                      f"iteration; median over ranks {_ms(others)} ms)"]
    return "\n".join(lines)
