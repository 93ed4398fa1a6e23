"""The planned schedule's measurements and plan: what the link costs (`probe_link`), when each
bucket became ready in backward (`BackwardClock`), which all-gather chunks fill which gap
(`plan_gaps`, a greedy replay of one backward on a FIFO link), and how far the plan's link model
was from the link the planned iterations met (`replay_tail`, `calibrate`). Pure functions of
timings, except the probe (a collective) and the clock (which reads CUDA events on a GPU); the
driver that issues the collectives is dear/fusion/schedule.py."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Optional, Sequence

import torch

from ..comm.base import Communicator
from ..comm.link import LinkModel, measure_link


# --------------------------------------------------------------------------- measurement
def probe_link(comm: Communicator, sizes: Sequence[int] = (2 << 20, 12 << 20),
               repeats: int = 3, device: torch.device | str = "cpu") -> LinkModel:
    """Time a reduce-scatter and an all-gather of two sizes (float32, on `device`), on every
    rank at once (a collective: call it at the same step everywhere); the best of `repeats`
    (dear/comm/link.py's `measure_link`). Both sizes exceed what a shaped link lets through at
    once (tbf's burst), which smaller ones would read as bandwidth
    (docs/benchmarks.md#the-link-probes-sizes). On CPU tensors the model's `host_share` is the
    process's CPU time over the wall time of a collective of the larger size, the most of any
    repeat: waiting for a late peer only lowers it (on a GPU the host only waits: 0)."""
    n = comm.size
    cuda = torch.device(device).type == "cuda"
    buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # by the full buffer's bytes
    for nbytes in sizes:
        numel = max(n, nbytes // 4 // n * n)
        buffers[numel * 4] = (torch.zeros(numel, device=device),
                              torch.zeros(numel // n, device=device))

    def settle() -> None:
        if cuda:
            torch.cuda.synchronize(device)
        comm.barrier()

    largest = max(buffers)
    shares = [0.0]                               # the largest's process CPU / wall seconds

    def run(kind: str, nbytes: int) -> None:
        full, shard = buffers[nbytes]
        cpu, wall = time.process_time(), time.perf_counter()
        if kind == "reduce_scatter":
            comm.reduce_scatter(full, shard).wait()
        else:
            comm.all_gather(shard, full).wait()
        if cuda:                                 # wait() only ordered the stream
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - wall
        if nbytes == largest and wall > 0:
            shares.append((time.process_time() - cpu) / wall)

    model = measure_link(run, ("reduce_scatter", "all_gather"), sorted(buffers), n, repeats,
                         settle)
    return dataclasses.replace(model, host_share=0.0 if cuda else max(shares))


def contention(load: float, host_share: float, cores: float) -> float:
    """The share of link time moved into backward that comes out of backward's compute, where
    backward keeps `load` cores busy (CPU seconds per second, this process), a collective
    `host_share`, and the rank has `cores`: what the two need beyond the cores, over what
    backward needs (the OS shares the cores fairly: at most all of it). 0 where the link's
    work fits beside backward's: a GPU's, a network card's, an idle core's."""
    if load <= 0 or host_share <= 0:
        return 0.0
    return min(1.0, max(0.0, load + host_share - cores) / load)


class BackwardClock:
    """When each bucket's reduce-scatter was submitted in backward, and when step() had every
    reduce-scatter back, relative to the first submission, over the measured iterations. On a
    GPU (`device` cuda) the times are those of the compute stream, read from CUDA events."""

    def __init__(self, num_buckets: int, device: Optional[torch.device] = None) -> None:
        self._cuda = device is not None and device.type == "cuda"
        self._current: dict[int, Any] = {}
        self._samples: list[tuple[dict[int, Any], Any]] = []
        self._n = num_buckets
        self._cpu_first = 0.0                    # process CPU time at the first submission
        self._loads: list[float] = []            # CPU seconds per second in each backward

    def _now(self) -> Any:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def reduce_scatter_submitted(self, bucket: int) -> None:
        if bucket not in self._current:
            self._current[bucket] = self._now()
            if self._cuda:
                return
            if len(self._current) == 1:
                self._cpu_first = time.process_time()
            elif len(self._current) == self._n:  # bucket 0's, at backward's end
                wall = self._current[bucket] - min(self._current.values())
                if wall > 0:
                    self._loads.append((time.process_time() - self._cpu_first) / wall)

    def reduced(self) -> None:
        """step() has every reduce-scatter of the iteration back."""
        now = self._now()
        if self._current and len(self._current) == self._n:   # 0 buckets: sparse params only
            self._samples.append((self._current, now))
        self._current = {}

    @property
    def samples(self) -> int:
        return len(self._samples)

    def host_load(self) -> float:
        """Cores this process kept busy in backward (its CPU seconds per second, every thread,
        from the first submission to the last; median): 0 on a GPU, where the host runs
        ahead, or with one bucket."""
        return statistics.median(self._loads) if self._loads else 0.0

    def _seconds(self, marks: dict[int, Any], end: Any) -> tuple[dict[int, float], float]:
        if self._cuda:
            first = next(iter(marks.values()))        # submitted first: the origin
            for event in (*marks.values(), end):
                event.synchronize()
            return ({b: first.elapsed_time(e) / 1e3 for b, e in marks.items()},
                    first.elapsed_time(end) / 1e3)
        origin = min(marks.values())
        return {b: t - origin for b, t in marks.items()}, end - origin

    def medians(self) -> tuple[list[float], float]:
        """Each bucket's submission time, and the tail: how long after bucket 0's submission
        (the last, at the end of backward) the reduce-scatters were all back."""
        samples = [self._seconds(*s) for s in self._samples]
        ready = [statistics.median(s[0][b] for s in samples) for b in range(self._n)]
        return ready, statistics.median(s[1] - s[0][0] for s in samples)


# ------------------------------------------------------------------------------ planning
Chunk = tuple[int, int, int]          # (bucket, first column, number of columns) of the shard


@dataclasses.dataclass(frozen=True)
class Plan:
    """After the reduce-scatter of bucket b is submitted, submit the all-gathers `after[b]`;
    the rest of every bucket is gathered at step() in forward order."""

    after: dict[int, tuple[Chunk, ...]]
    predicted_gap_fill_s: float = 0.0

    @property
    def num_chunks(self) -> int:
        return sum(len(c) for c in self.after.values())


def chunk_columns(shard_numel: int, chunk: int) -> list[tuple[int, int]]:
    """The shard cut into the fewest pieces of at most `chunk` columns, of near-equal length
    (no tiny tail piece paying a whole collective's latency)."""
    if shard_numel <= 0:
        return []                            # nothing to gather (e.g. a row-sparse table)
    pieces = max(1, -(-shard_numel // max(1, chunk)))
    base, extra = divmod(shard_numel, pieces)
    out, start = [], 0
    for k in range(pieces):
        length = base + (k < extra)
        out.append((start, length))
        start += length
    return out


def plan_gaps(ready: Sequence[float], rs_bytes: Sequence[float],
              shard_numels: Sequence[int], itemsizes: Sequence[int], world: int,
              cost: LinkModel, chunk_bytes: int, slack: float = 0.1) -> Plan:
    """Replay one backward on a FIFO link: reduce-scatters in reduce order (last bucket first)
    at their ready times; after each, the all-gather chunks that fit before the next bucket is
    ready (with `slack` of the gap kept free), needed-first (lowest bucket, lowest column)
    among the buckets already reduced. `chunk_bytes` is the grain a gap is filled in:
    consecutive pieces of one bucket in one gap are one collective. Bucket 0's
    reduce-scatter is last; everything after it waits for step()."""
    n = len(ready)
    order = list(range(n - 1, -1, -1))
    link_free = 0.0
    done: dict[int, float] = {}
    waiting: list[Chunk] = []
    after: dict[int, tuple[Chunk, ...]] = {}
    filled = 0.0
    for k, b in enumerate(order):
        link_free = max(link_free, ready[b]) + cost.reduce_scatter(rs_bytes[b])
        done[b] = link_free
        columns = max(1, chunk_bytes // max(1, world * itemsizes[b]))
        waiting.extend((b, s, length) for s, length in chunk_columns(shard_numels[b], columns))
        waiting.sort()
        if k == n - 1:
            break                            # bucket 0: step() gathers the rest, needed first
        nxt = ready[order[k + 1]]
        budget = nxt - slack * max(0.0, nxt - ready[b])
        chosen: list[Chunk] = []
        while waiting:
            c = waiting[0]
            # A piece right after the previous one of its bucket joins that collective: one
            # alpha for the run, and at 8 ranks 7 messages instead of 7 per piece
            # (docs/benchmarks.md#merged-all-gather-pieces).
            last = chosen[-1] if chosen else (-1, 0, 0)     # (bucket -1: joins nothing)
            joins = last[0] == c[0] and last[1] + last[2] == c[1]
            took = (cost.all_gather(world * c[2] * itemsizes[c[0]])
                    - (cost.latency("all_gather") if joins else 0.0))
            end = max(link_free, done[c[0]]) + took
            if end > budget:
                break
            waiting.pop(0)
            if joins:
                chosen[-1] = (c[0], last[1], last[2] + c[2])
            else:
                chosen.append(c)
            link_free = end
            filled += took
        if chosen:
            after[b] = tuple(chosen)
    return Plan(after=after, predicted_gap_fill_s=filled)


def replay_tail(plan: Plan, ready: Sequence[float], rs_bytes: Sequence[int],
                itemsizes: Sequence[int], world: int, cost: LinkModel) -> float:
    """Seconds from bucket 0's readiness (the end of backward) until its reduce-scatter is
    done, when the plan's collectives run in its order on a FIFO link of `cost`."""
    link_free, done = 0.0, {}
    for b in range(len(ready) - 1, -1, -1):
        link_free = max(link_free, ready[b]) + cost.reduce_scatter(rs_bytes[b])
        done[b] = link_free
        for c, _, length in plan.after.get(b, ()):
            link_free = max(link_free, done[c]) + cost.all_gather(world * length * itemsizes[c])
    return done[0] - ready[0]


def calibrate(measured_tail: float, tail: Callable[[float], float], backward_s: float,
              tolerance: float = 0.05, noise: float = 0.02,
              bounds: tuple[float, float] = (0.5, 4.0)) -> float:
    """The factor f by which every link cost must change for the replay (`tail(f)`, e.g.
    replay_tail with cost.slower(f)) to take as long as the tail the planned iterations met,
    within `bounds`: above 1 where the link was slower than the plan assumed. 1 where the
    two are within `tolerance` of the replay's tail or `noise` x the backward's duration.
    Why the latter: a short tail (one small bucket after backward) is mostly host timing;
    scaling every cost to explain it once cut a plan to no chunks, and a plan without chunks
    has no tail to undo it (docs/benchmarks.md#checking-the-plan-against-its-tail)."""
    predicted = tail(1.0)
    if abs(measured_tail - predicted) <= max(tolerance * predicted, noise * backward_s):
        return 1.0
    low, high = bounds
    if tail(low) >= measured_tail:
        return low
    if tail(high) <= measured_tail:
        return high
    while high - low > 1e-3:               # tail(f) grows with f: every cost does
        mid = (low + high) / 2
        if tail(mid) < measured_tail:
            low = mid
        else:
            high = mid
    return high
