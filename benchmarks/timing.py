"""The one timed training loop of the benchmarks, and the rules every measurement shares.

Rules, in one place:
- warm-up iterations are run and dropped; a barrier at the LAST warm-up iteration lines the ranks
  up (`barrier_before_timing`: not at the first timed one, whose forward would then skip its
  wait for dear's all-gathers);
- an iteration is zero_grad, forward, backward (+ clipping), step, timed per phase;
- ranks' medians differ slightly: the slowest rank sets the pace (`slowest_median`);
- the machine's own load is recorded beside the times (CPU seconds of this process, busy cores
  from /proc/stat), because these shared machines drift.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

PHASES = ("total", "forward", "backward", "step")
Batch = Callable[[int, int], Any]                 # (step, rank) -> (inputs, targets)
LossFn = Callable[[Any, Any], torch.Tensor]


@dataclasses.dataclass
class Timed:
    """Per phase, the timed iterations' seconds; every iteration's loss (warm-up included); the
    CPU seconds of this process and the machine's busy fraction over the timed iterations."""
    times: dict[str, list[float]]
    losses: list[float]
    cpu_s: float = 0.0
    wall_s: float = 0.0
    machine_busy: float = 0.0


def barrier_before_timing(step: int, warmup: int) -> None:
    """A barrier at the last warm-up iteration, so the ranks start the timed iterations together.
    Not at the first timed one: a barrier waits for dear's pending all-gathers, which would spare
    that iteration's forward its wait (it was 100-300 ms faster than the rest)."""
    if step == max(warmup - 1, 0):
        dist.barrier()


def busy_jiffies() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole machine since boot."""
    with open("/proc/stat") as fh:
        fields = [int(v) for v in fh.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def train_loop(net: Any, opt: Any, batch: Batch, loss_fn: LossFn, warmup: int, iters: int, *,
               start: int = 0, barrier: bool = True,
               after_backward: Optional[Callable[[], None]] = None,
               after_step: Optional[Callable[[int], None]] = None) -> Timed:
    """`warmup` + `iters` iterations from batch `start`; the last `iters` are timed. barrier:
    barrier_before_timing's barrier (off where ranks train alone). after_backward: clipping or
    a preconditioner, timed with backward. after_step(step): after each timed step, outside the
    timing."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    rec: dict[str, list[float]] = {key: [] for key in PHASES}
    losses: list[float] = []
    cpu0 = wall0 = 0.0
    busy0 = (0, 0)
    for step in range(start, start + warmup + iters):
        x, y = batch(step, rank)
        timed = step - start >= warmup
        if barrier:
            barrier_before_timing(step - start, warmup)
        if step - start == warmup:
            cpu0, busy0, wall0 = time.process_time(), busy_jiffies(), time.perf_counter()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(net(x), y)
        t1 = time.perf_counter()
        loss.backward()
        if after_backward is not None:
            after_backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if timed:
            for key, value in zip(PHASES, (t3 - t0, t1 - t0, t2 - t1, t3 - t2)):
                rec[key].append(value)
            if after_step is not None:
                after_step(step)
        losses.append(loss.item())
    if not iters:
        return Timed(rec, losses)
    busy1 = busy_jiffies()
    return Timed(rec, losses, cpu_s=time.process_time() - cpu0,
                 wall_s=time.perf_counter() - wall0,
                 machine_busy=(busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]))


def time_steps(model: Any, opt: Any, batch: Batch, loss_fn: LossFn, steps: int,
               start: int = 0) -> list[float]:
    """Seconds of `steps` iterations from batch `start`, no barrier (ranks alone, or a caller
    that lines them up itself)."""
    return train_loop(model, opt, batch, loss_fn, 0, steps, start=start,
                      barrier=False).times["total"]


def warm_up(model: Any, opt: Any, batch: Batch, loss_fn: LossFn, steps: int,
            start: int = 0) -> int:
    """`steps` untimed iterations from batch `start`, with barrier_before_timing's barrier
    before the last one. Returns the next batch."""
    train_loop(model, opt, batch, loss_fn, steps, 0, start=start)
    return start + steps


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def slowest_median(times: list[float]) -> float:
    """Ranks' medians differ slightly; the slowest rank sets the pace."""
    t = torch.tensor([statistics.median(times)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def measure_comm(numel: int, repeats: int) -> dict[str, float]:
    """Whole-gradient all-reduce: torch's all_reduce vs dear's reduce-scatter + all-gather
    (median of `repeats` after one dropped)."""
    from dear.comm.runtime import communicator

    comm, n = communicator(), dist.get_world_size()
    padded = -(-numel // n) * n
    buf, shard = torch.ones(padded), torch.empty(padded // n)
    out: dict[str, list[float]] = {"all_reduce": [], "rs_ag": []}
    for _ in range(repeats + 1):
        dist.barrier()
        begin = time.perf_counter()
        dist.all_reduce(buf)
        out["all_reduce"].append(time.perf_counter() - begin)
        dist.barrier()
        begin = time.perf_counter()
        comm.reduce_scatter(buf, shard).wait()
        comm.all_gather(shard, buf).wait()
        out["rs_ag"].append(time.perf_counter() - begin)
    return {k: statistics.median(v[1:]) for k, v in out.items()}
