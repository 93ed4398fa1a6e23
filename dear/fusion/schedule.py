"""When each collective goes on the link: DeAR's order, or a plan that also uses backward's idle
link time for all-gathers.

DeAR issues reduce-scatters in backward as buckets fill and every all-gather at step(), so the
all-gathers can hide only behind the next forward pass (a third of the compute): it is bounded
by max(T_fwd, T_ag) + max(T_bwd, T_rs), 1.17 x max(T_compute, T_comm) when the two are equal.
Meanwhile the link sits idle in backward whenever the reduce-scatters of the buckets ready so far
are done. The planned schedule fills those gaps with all-gathers of buckets already reduced, cut
into chunks small enough that a reduce-scatter becoming ready never waits long behind one; what
does not fit is gathered at step() in the order the next forward needs it, as in DeAR.

Every rank must issue the same collectives in the same order, so the decision cannot depend on a
rank's own timing. It is a plan: after a few iterations in DeAR's order, every rank measures the
link (`probe_link`, a collective at the same step everywhere), rank 0 replays the measured
backward (when each bucket became ready, when backward ended) with a greedy simulation
(`plan_gaps`: after each reduce-scatter, the chunks that finish before the next bucket is ready)
and broadcasts the plan. The plan only says WHICH chunks follow WHICH reduce-scatter; WHEN is up
to readiness: a chunk cannot be sent before its bucket's reduce-scatter is complete, and the
training thread must not wait for that. So every collective of a backward pass is issued by one
thread (`CommExecutor`, executor.py) in the order the training thread submits them; a chunk whose shard is not
averaged yet waits in that thread, never in backward. The executor is drained (everything
submitted is issued) before anything else uses the communicator (step(), clipping, dear.allreduce),
so main-thread collectives keep their place in the order too.

With CUDA tensors on a stream-ordered communicator (NCCL) no thread is needed: waiting for a
collective only makes a stream wait, never the host. The training thread issues the plan's chunks
itself, right after each reduce-scatter, on a side stream, so the waits for their reduce-scatters
hold back that stream and not backward's kernels. The plan is the same; its timings come from
CUDA events (the host runs ahead of the GPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import statistics
import time
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch

from ..comm.base import Communicator, Work
from .executor import (CommExecutor, FutureWork, close_shared, mark_planned, planned_somewhere,
                       shared_executor)

log = logging.getLogger("dear")


# --------------------------------------------------------------------------- measurement
@dataclasses.dataclass(frozen=True)
class LinkCost:
    """Seconds for a collective of `nbytes` (the full buffer): alpha + nbytes / rate."""

    alpha_rs: float
    rate_rs: float
    alpha_ag: float
    rate_ag: float

    def reduce_scatter(self, nbytes: float) -> float:
        return self.alpha_rs + nbytes / self.rate_rs

    def all_gather(self, nbytes: float) -> float:
        return self.alpha_ag + nbytes / self.rate_ag


def _fit(small: tuple[int, float], large: tuple[int, float]) -> tuple[float, float]:
    (b1, t1), (b2, t2) = small, large
    rate = (b2 - b1) / max(t2 - t1, 1e-9)
    return max(t1 - b1 / rate, 0.0), rate


def probe_link(comm: Communicator, sizes: Sequence[int] = (1 << 16, 4 << 20),
               repeats: int = 3, device: torch.device | str = "cpu") -> LinkCost:
    """Time a reduce-scatter and an all-gather of two sizes (float32, on `device`), on every
    rank at once (a collective: call it at the same step everywhere); the best of `repeats`."""
    n = comm.size
    cuda = torch.device(device).type == "cuda"
    points: dict[str, list[tuple[int, float]]] = {"rs": [], "ag": []}
    for nbytes in sizes:
        numel = max(n, nbytes // 4 // n * n)
        full = torch.zeros(numel, device=device)
        shard = torch.zeros(numel // n, device=device)
        for kind in ("rs", "ag"):
            best = float("inf")
            for _ in range(repeats):
                if cuda:
                    torch.cuda.synchronize(device)
                comm.barrier()
                start = time.perf_counter()
                if kind == "rs":
                    comm.reduce_scatter(full, shard).wait()
                else:
                    comm.all_gather(shard, full).wait()
                if cuda:                         # wait() only ordered the stream
                    torch.cuda.synchronize(device)
                best = min(best, time.perf_counter() - start)
            points[kind].append((numel * 4, best))
    alpha_rs, rate_rs = _fit(*points["rs"])
    alpha_ag, rate_ag = _fit(*points["ag"])
    return LinkCost(alpha_rs, rate_rs, alpha_ag, rate_ag)


class BackwardClock:
    """When each bucket's reduce-scatter was submitted in backward and when step() came,
    relative to the first submission, over the last few iterations (medians). On a GPU
    (`device` cuda) the times are those of the compute stream, read from CUDA events."""

    def __init__(self, num_buckets: int, device: Optional[torch.device] = None) -> None:
        self._cuda = device is not None and device.type == "cuda"
        self._current: dict[int, Any] = {}
        self._samples: list[tuple[dict[int, Any], Any]] = []
        self._n = num_buckets

    def _now(self) -> Any:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def reduce_scatter_submitted(self, bucket: int) -> None:
        if bucket not in self._current:
            self._current[bucket] = self._now()

    def step(self) -> None:
        """step() was called: the iteration's backward is over."""
        now = self._now()
        if self._current and len(self._current) == self._n:   # 0 buckets: sparse params only
            self._samples.append((self._current, now))
        self._current = {}

    @property
    def samples(self) -> int:
        return len(self._samples)

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
        samples = [self._seconds(*s) for s in self._samples]
        ready = [statistics.median(s[0][b] for s in samples) for b in range(self._n)]
        return ready, statistics.median(s[1] for s in samples)


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


def plan_gaps(ready: Sequence[float], rs_bytes: Sequence[int],
              shard_numels: Sequence[int], itemsizes: Sequence[int], world: int,
              cost: LinkCost, chunk_bytes: int, slack: float = 0.1) -> Plan:
    """Replay one backward on a FIFO link: reduce-scatters in reduce order (last bucket first)
    at their ready times; after each, the all-gather chunks that fit before the next bucket is
    ready (with `slack` of the gap kept free), needed-first (lowest bucket, lowest column)
    among the buckets already reduced. Bucket 0's reduce-scatter is last; everything after it
    waits for step()."""
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
            took = cost.all_gather(world * c[2] * itemsizes[c[0]])
            end = max(link_free, done[c[0]]) + took
            if end > budget:
                break
            chosen.append(waiting.pop(0))
            link_free = end
            filled += took
        if chosen:
            after[b] = tuple(chosen)
    return Plan(after=after, predicted_gap_fill_s=filled)


__all__ = ["BackwardClock", "CommExecutor", "FutureWork", "LinkCost", "Plan", "chunk_columns",
           "issue_mode", "plan_gaps", "probe_link"]


# ------------------------------------------------------------------------------- driving
def issue_mode(params: Sequence[torch.Tensor], comm: Communicator) -> Optional[str]:
    """How backward's collectives can follow a plan here: "thread" (CPU tensors: the executor
    thread issues them), "stream" (CUDA tensors on a stream-ordered communicator: the training
    thread issues them, chunks on a side stream), or None (DeAR's order only: e.g. Horovod's
    GPU waits block the host, or tensors on several kinds of device)."""
    devices = {p.device.type for p in params}
    if devices == {"cpu"} and comm.issue_from_any_thread:
        return "thread"
    if devices == {"cuda"} and comm.stream_ordered:
        return "stream"
    return None


class ScheduleDriver:
    """The planned schedule inside one dear.DistributedOptimizer: measures its first
    iterations, plans at the same step on every rank, and submits the collectives in the
    plan's order. `enabled=False` (DEAR_SCHEDULE=dear) keeps DeAR's own order. `mode`
    (issue_mode()): "thread" sends backward's collectives through the process's executor
    thread, planned or not, so every optimizer's share one order; "stream" issues them from
    the training thread, the plan's chunks on a side stream; None: no plan can run."""

    def __init__(self, comm_of: Callable[[], Communicator], enabled: bool, plan_after: int,
                 chunk_bytes: int, mode: Optional[str] = "thread", slack: float = 0.1
                 ) -> None:
        self._comm_of = comm_of                 # the optimizer's (dear.diagnose may wrap it)
        if comm_of().size == 1:
            mode = None                         # nothing to plan
        self.enabled = enabled and mode is not None
        self._plan_after = plan_after
        self.default_chunk_bytes = chunk_bytes  # Config's; a FusionConfig may carry its own
        self._chunk_bytes = chunk_bytes
        self._slack = slack                     # Config.plan_slack
        self.executor: Optional[CommExecutor] = (shared_executor() if mode == "thread"
                                                 else None)
        self._side: Optional[torch.cuda.Stream] = None   # "stream": the chunks' stream
        self.plan: Optional[Plan] = None
        self.cost: Optional[LinkCost] = None
        self._clock: Optional[BackwardClock] = None
        self._steps = 0                         # step()s since the layout was (re)built
        self._buckets: list[Any] = []
        self._prefix: dict[int, int] = {}       # columns of each bucket gathered in backward
        self.paused = False                     # e.g. dear.KFAC edits the shards before gathers
        self._planned = False

    @property
    def _comm(self) -> Communicator:
        return self._comm_of()

    @property
    def searched_chunk_bytes(self) -> Optional[int]:
        """What an autotuner starts the chunk size from, or None when no plan can run here
        (DeAR's order, one rank, no issue_mode()): then the chunk size changes nothing."""
        return self.default_chunk_bytes if self.enabled else None

    def reset(self, buckets: Sequence[Any], chunk_bytes: Optional[int] = None) -> None:
        """A new layout or chunk size (the autotuner's FusionConfig; None: Config's): forget
        the plan and measure again (every rank at the same step, so the probe and the plan's
        broadcast keep their place in every rank's order)."""
        self._chunk_bytes = self.default_chunk_bytes if chunk_bytes is None else chunk_bytes
        self._buckets = list(buckets)
        self.plan, self._steps, self._planned = None, 0, False
        self._clock = BackwardClock(len(buckets), self._device) if self.enabled else None
        self._prefix = {}

    @property
    def active(self) -> bool:
        return self.plan is not None and not self.paused

    def submitter(self) -> Optional[Callable[..., Work]]:
        """How this iteration's reduce-scatters are issued: through the executor (directly while
        a dear.diagnose Tracer records this optimizer: it records on the training thread)."""
        if self.executor is None or self.paused or not (self.active or planned_somewhere()):
            return None                         # DeAR's order alone: the training thread issues
        return self.executor.submit

    def reduce_scatter_submitted(self, bucket: Any, postscale: float) -> None:
        """Right after bucket's reduce-scatter was submitted: the chunks the plan puts next."""
        if self._clock is not None and not self._planned:
            self._clock.reduce_scatter_submitted(bucket.spec.index)
        if not self.active:
            return
        assert self.plan is not None
        comm = self._comm
        for b, start, length in self.plan.after.get(bucket.spec.index, ()):
            target = self._buckets[b]
            if self.executor is not None:
                work = self.executor.submit(
                    lambda t=target, s=start, n=length: t.gather_columns(comm, s, n),
                    before=lambda t=target: t.finish_reduce_scatter(postscale))
            else:                               # "stream": nothing here waits on the host
                with self._chunk_stream(target.buffer.device):
                    target.finish_reduce_scatter(postscale)
                    work = target.gather_columns(comm, start, length)
            target.gather_early(work)
            self._prefix[b] = start + length

    @property
    def _device(self) -> torch.device:
        return self._buckets[0].buffer.device if self._buckets else torch.device("cpu")

    def _chunk_stream(self, device: torch.device) -> ContextManager[Any]:
        """Where the chunks' waits and averaging go: the side stream (on CPU tensors, forced
        by tests, the same path runs on the host)."""
        if device.type != "cuda":
            return contextlib.nullcontext()
        if self._side is None:
            self._side = torch.cuda.Stream(device=device)
        return torch.cuda.stream(self._side)

    def gathered_early(self) -> bool:
        return bool(self._prefix)

    def drain(self) -> None:
        if self.executor is not None:
            self.executor.drain()

    def gather_rest(self, groups: Sequence[Any]) -> None:
        """step(): every all-gather not issued in backward, in forward order (whole groups where
        no member was gathered early, else each bucket's remaining columns)."""
        for group in groups:
            if not any(b.spec.index in self._prefix for b in group.buckets):
                group.start(self._comm)
                continue
            for bucket in group.buckets:
                done = self._prefix.get(bucket.spec.index, 0)
                left = bucket.spec.shard_numel - done
                bucket.gathering(bucket.gather_columns(self._comm, done, left) if left else None)

    def end_step(self) -> None:
        """After step() issued its all-gathers: record the iteration's backward; plan when the
        measured iterations are there (every rank at the same step: a collective)."""
        self._prefix = {}
        if self._clock is None or self._planned:
            return                              # measured once per layout
        self._clock.step()
        self._steps += 1

    def maybe_plan(self, itemsizes: Sequence[int]) -> None:
        """At step(), with nothing in flight (before its all-gathers): probe and plan once the
        layout has run `plan_after` iterations. Same step on every rank."""
        if (self._clock is None or self._planned or self.paused
                or self._steps < self._plan_after):
            return                              # (paused is the same on every rank)
        cost = probe_link(self._comm, device=self._device)
        plan = None
        if self._comm.rank == 0 and self._clock.samples:
            ready, _ = self._clock.medians()
            plan = plan_gaps(ready, [b.wire.numel() * b.wire.element_size()
                                     for b in self._buckets],
                             [b.spec.shard_numel if b.chunkable else 0 for b in self._buckets],
                             itemsizes, self._comm.size, cost,
                             self._chunk_bytes, self._slack)
            log.info("dear: planned schedule: %d all-gather chunks in backward's idle link "
                     "time (%.1f ms predicted); link rs %.2f Gbit/s, ag %.2f Gbit/s",
                     plan.num_chunks, 1e3 * plan.predicted_gap_fill_s, 8e-9 * cost.rate_rs,
                     8e-9 * cost.rate_ag)
        self.plan = self._comm.broadcast_object(plan, 0)
        if self.plan is not None:               # from now on every optimizer's backward
            mark_planned()                       # collectives share the executor's order
        self.cost = cost
        self._planned = True                   # plan once per layout

    def close(self) -> None:
        """This optimizer is done: what it submitted is issued (the thread is the process's,
        stopped by dear.shutdown())."""
        self.drain()
