"""Horovod's tensor fusion in the replay: buckets decided while the link runs, not planned.

Horovod (0.28: `HOROVOD_CYCLE_TIME` 1 ms, `HOROVOD_FUSION_THRESHOLD` 128 MB by default) has no
fixed buckets. A background thread loops: it negotiates which gradients every rank has
submitted, fuses those ready ones (in the order they became ready, up to the threshold) into
one all-reduce, runs it to completion, and loops again. So a fused all-reduce holds exactly
what became ready while the previous one was on the link: its size follows the timing.

Within one iteration Horovod never blocks the training thread before `step()` (which waits for
everything), so the link is idle when backward starts and the gradients' ready times depend on
compute only. The fusion can therefore be decided ahead of the replay, from the profiles: a
greedy pass over the ready times with the same link cost, giving buckets the static all-reduce
program then replays (a bucket issued when its last gradient is ready starts on the FIFO link
when the previous one ends: the greedy's own rule).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from .graph import Profile

HOROVOD_THRESHOLD = 128 * 2**20       # Horovod >= 0.21's default fusion buffer
HOROVOD_CYCLE_S = 1e-3                # and its default cycle time


def ready_times(profiles: Sequence[Profile]) -> dict[int, float]:
    """Seconds from the iteration's start until every rank has each gradient (Horovod's
    coordinator waits for the last rank's request)."""
    out: dict[int, float] = {}
    for prof in profiles:
        t = prof.lead + sum(s.duration for s in prof.forward) + prof.loss
        for seg in prof.backward:
            t += seg.duration
            if seg.produces is not None:
                out[seg.produces] = max(out.get(seg.produces, 0.0), t)
    return out


def horovod_buckets(profiles: Sequence[Profile], param_bytes: Sequence[int],
                    allreduce_s: Callable[[int], float], threshold: int = HOROVOD_THRESHOLD,
                    cycle_s: float = HOROVOD_CYCLE_S,
                    fused_s: Optional[Callable[[int], float]] = None
                    ) -> list[tuple[list[int], int]]:
    """The fused all-reduces Horovod makes in one backward: at each point the link frees (or
    the next gradient arrives on an idle link) plus one cycle for the negotiation, everything
    ready by then, in ready order, up to `threshold` bytes (a larger gradient goes alone).
    Gradients never produced in backward go last, in one message (step() submits them).
    `fused_s`: the cost of a response of several tensors, if not `allreduce_s` (Horovod copies
    them into its fusion buffer and back; one tensor alone is reduced in place)."""
    ready = ready_times(profiles)
    pending = sorted(ready, key=lambda p: (ready[p], p))
    missing = [p for p in range(len(param_bytes)) if p not in ready]
    out: list[tuple[list[int], int]] = []
    link_free = 0.0
    i = 0
    while i < len(pending):
        pick = max(link_free, ready[pending[i]]) + cycle_s
        group: list[int] = []
        size = 0
        while i < len(pending) and ready[pending[i]] <= pick:
            b = param_bytes[pending[i]]
            if group and size + b > threshold:
                break
            group.append(pending[i])
            size += b
            i += 1
        out.append((group, size))
        link_free = pick + (fused_s if fused_s is not None and len(group) > 1
                            else allreduce_s)(size)
    if missing:
        out.append((missing, sum(param_bytes[p] for p in missing)))
    return out
