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
and broadcasts the plan. Once the plan has run as many iterations, rank 0 checks it against the
tail it met (how long after backward's end the reduce-scatters were back) and plans again
where the link was slower or faster than modelled (`calibrate`); with DEAR_PLAN_VERIFY=1 it
then alternates the plan with DeAR's order and drops it unless its iterations were faster. On
CPU tensors, where the link's time would come out of backward's compute (loopback's "link" is
the cores' own work: `contention`), no plan is made: DeAR's order. The plan only says WHICH
chunks follow WHICH reduce-scatter; WHEN is up to readiness: a chunk cannot be sent before its
bucket's reduce-scatter is complete, and the training thread must not wait for that. So every
collective of a backward pass is issued by one thread (`CommExecutor`, below) in the
order the training thread submits them; a chunk whose shard is not averaged yet waits in that
thread, never in backward. The executor is drained (everything
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
import enum
import functools
import logging
import os
import statistics
import time
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch

from ..comm import launch
from ..comm.base import Communicator, Work
from ..comm.link import LinkModel
from .executor import (
    CommExecutor,
    FutureWork,
    close_shared,
    mark_planned,
    planned_somewhere,
    register_driver,
    scope,
    shared_executor,
)
from .plan import (
    BackwardClock,
    Plan,
    calibrate,
    chunk_columns,
    contention,
    plan_gaps,
    probe_link,
    replay_tail,
)

log = logging.getLogger("dear")

# The link probe's larger size (its smaller: a sixth), capped at what the model sends: both
# beyond a shaped link's burst, see probe_link; a small model needs no 12 MB probe.
_PROBE_BYTES, _PROBE_MIN_BYTES = 12 << 20, 256 << 10
# Windows of each schedule a verified plan alternates through (ScheduleDriver._alternate).
VERIFY_ROUNDS = 3

__all__ = ["BackwardClock", "CommExecutor", "FutureWork", "Plan", "ScheduleDriver",
           "ScheduleState", "ScheduleStateError", "chunk_columns", "close_shared", "issue_mode",
           "mark_planned", "plan_gaps", "planned_somewhere", "probe_link", "scope",
           "shared_executor"]


def cores_per_rank() -> float:
    """The cores this process can use: those it may run on, at most the machine's share per
    rank on it (LOCAL_WORLD_SIZE, as torchrun and dear's launchers set it)."""
    machine = os.cpu_count() or 1
    try:
        mine = len(os.sched_getaffinity(0))
    except AttributeError:                  # (not Linux)
        mine = machine
    return min(float(mine), machine / max(1, launch.process_env().local_size))


def _ms(seconds: Sequence[float]) -> str:
    return "/".join(f"{1e3 * t:.1f}" for t in seconds)


def _now() -> float:
    """The clock between step()s (ScheduleDriver's check of a plan against DeAR's order)."""
    return time.perf_counter()


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


class ScheduleState(enum.Enum):
    """Where a ScheduleDriver stands. Every rank makes the same transition at the same step()
    (rank 0 decides, a broadcast tells the others), once the state has run plan_after step()s:

        DISABLED                      for good: DEAR_SCHEDULE=dear, one rank, or no issue_mode()
        NO_LAYOUT -> MEASURING        reset(): the first layout; from any state but DISABLED
                                      a new layout or chunk size measures again
        MEASURING -> PLANNED_CHECKING probed and planned
                  -> DEAR_ORDER       no plan: a host-bound link, or nothing measured
        PLANNED_CHECKING -> PLANNED   checked (planned again with calibrated costs)
                  -> TRIAL_DEAR_ORDER ... and, with plan_verify, put on trial
        TRIAL_DEAR_ORDER -> TRIAL_PLANNED          the trial's windows alternate
        TRIAL_PLANNED -> TRIAL_DEAR_ORDER
                      -> PLANNED | DEAR_ORDER      after VERIFY_ROUNDS of each: kept or dropped

    The driver's `paused` and `held`, set from outside, keep a plan from running without
    changing the state: the clock and the step count go on, and the transitions wait."""

    DISABLED = "disabled"
    NO_LAYOUT = "no layout"
    MEASURING = "measuring"                # DeAR's order; backward's timing recorded
    PLANNED_CHECKING = "planned, checking"  # the plan runs; the tail it meets recorded
    TRIAL_DEAR_ORDER = "trial: DeAR's order"   # a window of the trial without the plan
    TRIAL_PLANNED = "trial: planned"       # a window of the trial with it
    PLANNED = "planned"                    # settled: the plan runs
    DEAR_ORDER = "DeAR's order"            # settled: no plan

    @property
    def counts(self) -> bool:
        """Its step()s are counted toward the next transition, and backward is timed."""
        return self in (ScheduleState.MEASURING, ScheduleState.PLANNED_CHECKING,
                        ScheduleState.TRIAL_DEAR_ORDER, ScheduleState.TRIAL_PLANNED)

    @property
    def on_trial(self) -> bool:
        return self in (ScheduleState.TRIAL_DEAR_ORDER, ScheduleState.TRIAL_PLANNED)


class ScheduleStateError(RuntimeError):
    """A transition of the planned schedule asked for from a state it does not leave from."""


class ScheduleDriver:
    """The planned schedule inside one dear.DistributedOptimizer: measures its first
    iterations, plans at the same step on every rank, and submits the collectives in the
    plan's order. `enabled=False` (DEAR_SCHEDULE=dear) keeps DeAR's own order. `mode`
    (issue_mode()): "thread" sends backward's collectives through the process's executor
    thread, planned or not, so every optimizer's share one order; "stream" issues them from
    the training thread, the plan's chunks on a side stream; None: no plan can run. Where it
    stands is `state` (ScheduleState); maybe_plan() makes the transitions."""

    def __init__(self, comm_of: Callable[[], Communicator], enabled: bool, plan_after: int,
                 chunk_bytes: int, mode: Optional[str] = "thread", slack: float = 0.1,
                 verify: bool = False, contention_limit: float = 1.0) -> None:
        self._comm_of = comm_of                 # the optimizer's (dear.diagnose may wrap it)
        if comm_of().size == 1:
            mode = None                         # nothing to plan
        self.state = (ScheduleState.NO_LAYOUT if enabled and mode is not None
                      else ScheduleState.DISABLED)
        self.mode = mode
        self._plan_after = plan_after
        self.default_chunk_bytes = chunk_bytes  # Config's; a FusionConfig may carry its own
        self._chunk_bytes = chunk_bytes
        self._slack = slack                     # Config.plan_slack
        self._contention_limit = contention_limit   # Config.plan_contention
        self.executor: Optional[CommExecutor] = (shared_executor() if mode == "thread"
                                                 else None)
        self._side: Optional[torch.cuda.Stream] = None   # "stream": the chunks' stream
        # The plan in force (None: DeAR's order): the state's, or one a test forces.
        self.plan: Optional[Plan] = None
        self.cost: Optional[LinkModel] = None
        self._clock: Optional[BackwardClock] = None   # while the state counts (else None)
        self._ready: list[float] = []           # rank 0: the measured backward planned from
        self._steps = 0                         # step()s the current state has run
        # `verify` (Config.plan_verify): after its check, the plan alternates with DeAR's
        # order in windows of plan_after iterations, VERIFY_ROUNDS of each, and is kept only if
        # its windows were faster (the median of the paired differences: a machine warming up
        # or slowing down favours neither). Only where the training thread's time is the
        # iteration's ("thread": CPU tensors); on a GPU the host runs ahead.
        self._verify = verify and mode == "thread"
        self._intervals: list[float] = []       # seconds between step()s in this window
        self._last_step: Optional[float] = None
        self._medians: list[float] = []         # per window: DeAR's order, plan, ... (rank 0)
        self._trial: Optional[Plan] = None      # on trial: the plan (in force in its windows)
        self._buckets: list[Any] = []
        self._prefix: dict[int, int] = {}       # columns of each bucket gathered in backward
        # No plan runs, whatever the state (set from outside, the same on every rank): dear.KFAC
        # edits the shards between the collectives, a tracer records DeAR's order, and
        # shard_optimizer_state where no plan can run (no issue_mode()).
        self.paused = False
        # This iteration issues no chunk (still measured and planned): with
        # shard_optimizer_state, an iteration whose step() may not run updates early.
        self.held = False
        # Run after a bucket's shard is averaged and before its first chunk is gathered: with
        # shard_optimizer_state, its early update (the chunks carry parameters).
        self.before_gather: Optional[Callable[[Any], None]] = None
        register_driver(self)                   # issue_pending() drains it

    @property
    def _comm(self) -> Communicator:
        return self._comm_of()

    @property
    def enabled(self) -> bool:
        """A plan may run here (DEAR_SCHEDULE=planned, several ranks, an issue_mode())."""
        return self.state is not ScheduleState.DISABLED

    def _leaving(self, transition: str, *sources: ScheduleState) -> None:
        """`transition` starts: only from one of `sources`, before it does anything."""
        if self.state not in sources:
            names = [s.name for s in sources]
            allowed = ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
            raise ScheduleStateError(f"dear: the planned schedule cannot {transition} from "
                                     f"{self.state.name}, only from {allowed}")

    def _enter(self, state: ScheduleState) -> None:
        """`state` starts with no step() run: MEASURING and PLANNED_CHECKING time backward
        afresh, the trial's windows keep the check's clock (read by nothing), and the states
        that count nothing drop it."""
        self.state, self._steps = state, 0
        self._intervals, self._last_step = [], None
        if state in (ScheduleState.MEASURING, ScheduleState.PLANNED_CHECKING):
            self._clock = BackwardClock(len(self._buckets), self._device)
        elif not state.counts:
            self._clock = None

    @property
    def settling_iterations(self) -> int:
        """Iterations from a new layout until its schedule has settled: plan_after measured,
        as many planned before the check, and with `verify` the trial's windows."""
        return (2 + 2 * VERIFY_ROUNDS * self._verify) * self._plan_after

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
        self.plan = None
        self._prefix = {}
        self._medians, self._trial = [], None
        self._enter(ScheduleState.MEASURING if self.enabled else ScheduleState.DISABLED)

    @property
    def active(self) -> bool:
        return self.plan is not None and not self.paused and not self.held

    @property
    def updates_early(self) -> bool:
        """Early updates (with shard_optimizer_state) may run in this iteration, or, held back
        now, in a later one that the step of this one decides."""
        return self.before_gather is not None and self.plan is not None and not self.paused

    def submitter(self) -> Optional[Callable[..., Work]]:
        """How this iteration's reduce-scatters are issued: through the executor (directly while
        a dear.diagnose Tracer records this optimizer: it records on the training thread)."""
        if self.executor is None or self.paused or not (self.active or planned_somewhere()):
            return None                         # DeAR's order alone: the training thread issues
        return self.executor.submit

    def reduce_scatter_submitted(self, bucket: Any, postscale: float) -> None:
        """Right after bucket's reduce-scatter was submitted: the chunks the plan puts next."""
        if self._clock is not None:
            self._clock.reduce_scatter_submitted(bucket.spec.index)
        if not self.active:
            return
        assert self.plan is not None
        comm = self._comm
        for b, start, length in self.plan.after.get(bucket.spec.index, ()):
            target = self._buckets[b]
            ready = functools.partial(self._ready_to_gather, target, postscale)
            if self.executor is not None:
                work = self.executor.submit(
                    functools.partial(target.gather_columns, comm, start, length),
                    before=ready)
            else:                               # "stream": nothing here waits on the host
                with self._chunk_stream(target.buffer.device):
                    ready()
                    work = target.gather_columns(comm, start, length)
            target.gather_early(work)
            self._prefix[b] = start + length

    def _ready_to_gather(self, bucket: Any, postscale: float) -> None:
        bucket.finish_reduce_scatter(postscale)
        if self.before_gather is not None:
            self.before_gather(bucket)

    def forget_early(self) -> None:
        """The chunks gathered in backward must be gathered again at step() (an early update
        was undone): after the executor is drained, every bucket is gathered whole."""
        self._prefix = {}

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
        """What backward submitted comes before what the training thread does next: issued
        ("thread"), or ("stream") ordered before the current stream's next work, so that it
        reads what the side stream wrote (averaged shards, sharded early updates)."""
        if self.executor is not None:
            self.executor.drain()
        elif self._side is not None:
            torch.cuda.current_stream(self._side.device).wait_stream(self._side)

    def gather_rest(self, groups: Sequence[Any],
                    before: Optional[Callable[[Sequence[Any]], None]] = None) -> None:
        """step(): every all-gather not issued in backward, in forward order (whole groups where
        no member was gathered early, else each bucket's remaining columns); `before(buckets)`
        runs before each group's (sharded: their update)."""
        for group in groups:
            if before is not None:
                before(group.buckets)
            if not any(b.spec.index in self._prefix for b in group.buckets):
                first = group.buckets[0]
                first.issued("all-gather", functools.partial(group.start, self._comm))
                continue
            for bucket in group.buckets:
                done = self._prefix.get(bucket.spec.index, 0)
                left = bucket.gather_numel - done
                bucket.gathering(bucket.issued("all-gather", functools.partial(
                    bucket.gather_columns, self._comm, done, left)) if left else None)

    def reduced(self) -> None:
        """step() has every reduce-scatter of this iteration back (on a GPU: the current
        stream waits for them)."""
        if self._clock is not None:
            self._clock.reduced()

    def end_step(self) -> None:
        """After step() issued its all-gathers."""
        self._prefix = {}
        if self.state.counts:
            self._steps += 1
            if self.state.on_trial:
                now = _now()
                if self._last_step is not None:
                    self._intervals.append(now - self._last_step)
                self._last_step = now

    def maybe_plan(self, itemsizes: Sequence[int]) -> None:
        """At step(), with nothing in flight (before its all-gathers), every rank at the same
        step (a collective): once the state has run `plan_after` iterations, its transition:
        measured, probe and plan (`_plan`); planned, check the plan against the link it met
        (`_check`); verifying, end the trial's window (`_alternate`)."""
        if not self.state.counts or self.paused or self._steps < self._plan_after:
            return                              # (paused is the same on every rank)
        if self.state is ScheduleState.MEASURING:
            self._plan(itemsizes)
        elif self.state is ScheduleState.PLANNED_CHECKING:
            self._check(itemsizes)
        else:
            self._alternate()

    def _plan(self, itemsizes: Sequence[int]) -> None:
        """MEASURING -> PLANNED_CHECKING, or DEAR_ORDER where rank 0 made no plan: every rank
        probes the link, rank 0 plans from the backward it measured, and broadcasts."""
        self._leaving("plan", ScheduleState.MEASURING)
        assert self._clock is not None
        largest = min(_PROBE_BYTES, max(_PROBE_MIN_BYTES, sum(self._reduce_bytes())))
        cost = probe_link(self._comm, (largest // 6, largest), device=self._device)
        plan = None
        if self._comm.rank == 0 and self._clock.samples:
            self._ready, _ = self._clock.medians()
            plan = self._plan_for(cost, itemsizes)
            log.info("dear: planned schedule: %d all-gather chunks in backward's idle link "
                     "time (%.1f ms predicted); link rs %.2f Gbit/s, ag %.2f Gbit/s per rank",
                     plan.num_chunks, 1e3 * plan.predicted_gap_fill_s,
                     8e-9 * cost.rate["reduce_scatter"], 8e-9 * cost.rate["all_gather"])
            if self._host_bound(cost):          # (an empty plan too: its check could add
                plan = None                     # chunks, and it would run on the thread)
        self.plan = self._comm.broadcast_object(plan, 0)
        if self.plan is not None:               # from now on every optimizer's backward
            mark_planned(self)                   # collectives share the executor's order
        self.cost = cost                        # (rank 0's is the one planned with)
        self._enter(ScheduleState.PLANNED_CHECKING if self.plan is not None
                    else ScheduleState.DEAR_ORDER)

    def _host_bound(self, cost: LinkModel) -> bool:
        """Whether the link time a plan moves into backward would mostly come out of backward's
        compute (rank 0): where the link is the cores' own work (loopback Gloo) and backward
        keeps the cores busy, the chunks move that work from the next forward into backward
        and the plan's model (link time is free beside compute) does not hold. Then DeAR's
        order: there a plan gained nothing
        (docs/benchmarks.md#no-plan-where-the-link-is-host-work)."""
        assert self._clock is not None
        if self.mode != "thread":
            return False
        load, cores = self._clock.host_load(), cores_per_rank()
        share = contention(load, cost.host_share, cores)
        if share <= self._contention_limit:
            return False
        log.info("dear: planned schedule not used: %.0f%% of the link time it would move into "
                 "backward is host work taken from backward (a collective %.2f cores, backward "
                 "%.2f, %.2f cores per rank; DEAR_PLAN_CONTENTION=%.2f): DeAR's order",
                 100 * share, cost.host_share, load, cores, self._contention_limit)
        return True

    def _reduce_bytes(self) -> list[int]:
        return [b.reduce_bytes for b in self._buckets]

    def _plan_for(self, cost: LinkModel, itemsizes: Sequence[int]) -> Plan:
        return plan_gaps(self._ready, self._reduce_bytes(),
                         [b.gather_numel if b.chunkable else 0 for b in self._buckets],
                         itemsizes, self._comm.size, cost, self._chunk_bytes, self._slack)

    def _factor(self, plan: Plan, cost: LinkModel, measured_tail: float,
                itemsizes: Sequence[int]) -> float:
        """How much slower than `cost` the link was, for `plan`'s replay to take as long as
        the measured tail (1: close enough, see calibrate)."""
        rs_bytes, world = self._reduce_bytes(), self._comm.size
        return calibrate(measured_tail, lambda f: replay_tail(
            plan, self._ready, rs_bytes, itemsizes, world, cost.slower(f)), max(self._ready))

    def _check(self, itemsizes: Sequence[int]) -> None:
        """PLANNED_CHECKING -> PLANNED, or with `verify` TRIAL_DEAR_ORDER. The probe times an
        idle link; under the plan the link may run slower (the chunks' per-message costs on the
        issuing thread, the cores' other work), and then chunks are still on the link when
        backward ends, delaying the last reduce-scatters
        (docs/benchmarks.md#checking-the-plan-against-its-tail). Rank 0 compares the tail the
        planned iterations met with the plan's replay and, if they differ, plans once more with
        the costs scaled by the factor that explains it. Broadcast either way (a collective).
        Then, verifying, the plan goes on trial (`_alternate`)."""
        self._leaving("check the plan", ScheduleState.PLANNED_CHECKING)
        plan, cost = self.plan, self.cost
        assert plan is not None and cost is not None and self._clock is not None
        if self._comm.rank == 0 and self._clock.samples:
            _, measured = self._clock.medians()
            factor = self._factor(plan, cost, measured, itemsizes)
            if factor != 1.0:
                cost = cost.slower(factor)
                plan = self._plan_for(cost, itemsizes)
            log.info("dear: planned schedule checked: tail %.1f ms; link costs x%.2f the "
                     "plan's: %d chunks", 1e3 * measured, factor, plan.num_chunks)
        self.plan = self._comm.broadcast_object(plan, 0)
        self.cost = cost
        if not self._verify:
            self._enter(ScheduleState.PLANNED)
            return
        self._trial, self._medians = self.plan, []
        self._switch(False)                     # a window in DeAR's order first

    def _switch(self, planned: bool) -> None:
        """Start a window of the trial: the plan in force (TRIAL_PLANNED), or DeAR's order
        (TRIAL_DEAR_ORDER: backward's collectives issued by the training thread). Every rank
        at the same step."""
        self._leaving("start a window of the trial", ScheduleState.PLANNED_CHECKING,
                      ScheduleState.TRIAL_DEAR_ORDER, ScheduleState.TRIAL_PLANNED)
        self.plan = self._trial if planned else None
        mark_planned(self, planned)
        self._enter(ScheduleState.TRIAL_PLANNED if planned else ScheduleState.TRIAL_DEAR_ORDER)

    def _alternate(self) -> None:
        """A window of the trial ended: its median kept (rank 0's decides), then the other
        schedule's window, until VERIFY_ROUNDS of each have run; then rank 0 keeps the plan
        (PLANNED) if its windows were faster than DeAR's order's, by the median of the paired
        differences, else drops it (DEAR_ORDER). Broadcast (a collective)."""
        self._leaving("end a window of the trial", ScheduleState.TRIAL_DEAR_ORDER,
                      ScheduleState.TRIAL_PLANNED)
        self._medians.append(statistics.median(self._intervals) if self._intervals
                             else float("nan"))
        without_plan = self.state is ScheduleState.TRIAL_DEAR_ORDER
        if without_plan or len(self._medians) < 2 * VERIFY_ROUNDS:
            self._switch(without_plan)          # (the trial ends on a window of the plan)
            return
        keep = True
        if self._comm.rank == 0:
            order, planned = self._medians[0::2], self._medians[1::2]
            gain = statistics.median(o - p for o, p in zip(order, planned))
            keep = gain > 0                     # (nan, unmeasured: not > 0, dropped)
            log.info("dear: planned schedule %s: its windows took %s ms, DeAR's order's %s "
                     "(median difference %.2f ms)", "kept" if keep else "dropped",
                     _ms(planned), _ms(order), 1e3 * gain)
        keep = self._comm.broadcast_object(keep, 0)
        self.plan = self._trial if keep else None
        mark_planned(self, keep)
        self._trial = None
        self._enter(ScheduleState.PLANNED if keep else ScheduleState.DEAR_ORDER)

    def close(self) -> None:
        """This optimizer is done: what it submitted is issued (the thread is the process's,
        stopped by dear.shutdown())."""
        self.drain()
