"""The analytic model beside the replay: buckets queued on one link, iteration time in closed form.

Fitted to the same trace as the replay, it keeps only what a queue needs, per traced rank:
the compute phases (lead, forward, loss, backward, tail, step, update: seconds), the time into
backward at which each bucket's last gradient arrives (its ready time r_j), for DeAR the
compute before each bucket's first use in forward (n_b), and each bucket's bytes. The link is
one FIFO server with deterministic service s_j = the cost model's time for bucket j at N
workers. For buckets issued in order at times i_j = max(r_1..r_j) (a bucket is issued once it
and every bucket before it are ready), the last one leaves the queue at the max-plus (Lindley)
closed form

    D = max_j ( i_j + s_j + s_{j+1} + ... + s_K ),

and the iteration time of each schedule is a sum of phases and such maxima:
- DDP, WFBP, HOROVOD (buckets: the schedule's rule; Horovod's from its greedy fusion plus one
  cycle per response), ALLREDUCE (one bucket at the end of backward):
      T = lead + forward + loss + max(backward + tail_b, D_allreduce) + update + tail
- DEAR: reduce-scatters queue in backward (D_rs as above); at step() the all-gather groups are
  issued at once, group g is in by A_g = s_1 + ... + s_g, and forward (with each bucket's update
  before its first use) ends at max(P, max_b (A_g(b) + P - n_b)), P its compute:
      T = step_extra + forward_end + loss + max(backward + tail_b, D_rs)
- PLANNED (all-gather chunks moved into backward's idle link): T_dear less the all-gathers'
  exposed time beyond the first group's, at most the link's idle time in backward after the
  first reduce-scatter could start (`rs_gap`).
The slowest traced rank's T is the prediction. It ignores what the replay models beyond
one server: torch's Gloo running two all-reduces at once (DDP, WFBP), per-iteration link
variation, the planned schedule's actual chunking and compute slowed by the transport.
It costs O(buckets + layers) per N; the replay simulates 4 iterations per traced one.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

from ..fusion.fusion_config import FusionConfig
from .costmodel import CostModel
from .dynamic import HOROVOD_CYCLE_S, horovod_buckets
from .graph import Model, Profile
from .programs import (
    DDP_FIRST_BUCKET,
    DEFAULT_THRESHOLD,
    DearLayout,
    ddp_buckets,
    dear_layout,
    wfbp_buckets,
)

SCHEDULES = ("ddp", "wfbp", "horovod", "allreduce", "dear", "planned")


def drain(issued: Sequence[float], service: Sequence[float]) -> float:
    """When a FIFO server that is idle at 0 finishes jobs issued at `issued` (in that order)
    needing `service` seconds each: max_j (i_j + s_j + ... + s_K); jobs issued earlier than
    a predecessor wait for it (i_j taken as max(i_1..i_j))."""
    end, t = 0.0, 0.0
    for i, s in zip(issued, service):
        t = max(t, i)
        end = max(end, t) + s
    return end


def _ready(prof: Profile, buckets: Sequence[tuple[list[int], int]]) -> list[float]:
    """Seconds into backward at which each bucket's last gradient arrives (inf: not in
    backward: issued after it)."""
    at: dict[int, float] = {}
    t = 0.0
    for seg in prof.backward:
        t += seg.duration
        if seg.produces is not None:
            at[seg.produces] = t
    return [max(at.get(p, float("inf")) for p in ps) for ps, _ in buckets]


def _backward_end(prof: Profile, ready: Sequence[float], service: Sequence[float],
                  extra: float = 0.0) -> float:
    """End of backward and its collectives: backward + its tail, or the queue's drain."""
    busy = sum(s.duration for s in prof.backward) + prof.backward_tail
    issued = [min(r, busy) for r in ready]     # the rest: issued after backward's tail
    return max(busy, drain(issued, service) + extra)


def allreduce_time(prof: Profile, buckets: Sequence[tuple[list[int], int]],
                   cost: CostModel, delay: float = 0.0, after_backward: bool = False) -> float:
    service = [cost.time("all_reduce", b) + delay for _, b in buckets]
    ready = [float("inf")] * len(buckets) if after_backward else _ready(prof, buckets)
    head = prof.lead + sum(s.duration for s in prof.forward) + prof.loss
    return head + _backward_end(prof, ready, service) + prof.update + prof.tail


def dear_time(prof: Profile, layout: DearLayout, numel: Sequence[int], cost: CostModel,
              exposed: Optional[Callable[[int], bool]] = None) -> float:
    """DeAR's closed form; `exposed(g)` False: group g's all-gather costs nothing (the planned
    schedule's bound)."""
    buckets = layout.buckets
    order = list(reversed(range(len(buckets))))          # reduce-scattered last to first
    ready = _ready(prof, buckets)
    rs = _backward_end(prof, [ready[b] for b in order],
                       [cost.time("reduce_scatter", buckets[b][1]) for b in order])
    group_bytes = layout.group_bytes()
    arrive, t = [], 0.0
    for g, nbytes in enumerate(group_bytes):
        t += cost.time("all_gather", nbytes) if exposed is None or exposed(g) else 0.0
        arrive.append(t)
    gather = {b: g for g, members in enumerate(layout.groups) for b in members}
    owner = {p: b for b, (ps, _) in enumerate(buckets) for p in ps}
    total = max(sum(numel), 1)
    update = [prof.update * sum(numel[p] for p in ps) / total for ps, _ in buckets]
    clock = prof.tail + prof.lead                        # compute since the all-gathers' issue
    waits: list[tuple[float, float]] = []                # (released at, compute before)
    pending = set(range(len(buckets)))
    needed = {owner[p] for s in prof.forward for p in s.needs}
    first = sorted(pending - needed)                     # applied at the root
    for seg in prof.forward:
        due = first + sorted({owner[p] for p in seg.needs} & pending)
        first = []
        for b in due:
            if b in pending:
                waits.append((arrive[gather[b]], clock))
                clock += update[b]
                pending.discard(b)
        clock += seg.duration
    forward_end = max([clock] + [r + clock - before for r, before in waits])
    return prof.step_extra + forward_end + prof.loss + rs


def rs_gap(prof: Profile, layout: DearLayout, cost: CostModel) -> float:
    """Seconds the link idles in backward once the first reduce-scatter could start: from
    the first bucket's arrival to the later of backward's end and the queue's drain, less
    the reduce-scatters' service. The planned schedule fills it with all-gather chunks."""
    buckets = layout.buckets
    order = list(reversed(range(len(buckets))))
    busy = sum(s.duration for s in prof.backward) + prof.backward_tail
    ready = [min(r, busy) for r in _ready(prof, buckets)]
    issued = [ready[b] for b in order]
    service = [cost.time("reduce_scatter", buckets[b][1]) for b in order]
    if not issued:
        return 0.0
    end = max(busy, drain(issued, service))
    return max(0.0, end - min(issued) - sum(service))


def planned_time(prof: Profile, layout: DearLayout, numel: Sequence[int],
                 cost: CostModel) -> float:
    """DeAR's time less what the planned schedule can take off it: the all-gathers' exposed
    time beyond the first group's (it is needed before any compute), at most the link's idle
    time in backward (where the plan moves all-gather chunks)."""
    dear = dear_time(prof, layout, numel, cost)
    owner = {p: b for b, (ps, _) in enumerate(layout.buckets) for p in ps}
    gather = {b: g for g, members in enumerate(layout.groups) for b in members}
    firsts = [gather[owner[p]] for s in prof.forward for p in s.needs]
    first = firsts[0] if firsts else 0
    low = dear_time(prof, layout, numel, cost, exposed=lambda g: g == first)
    return dear - min(dear - low, rs_gap(prof, layout, cost))


@dataclasses.dataclass
class QueueModel:
    """The trace's profiles and parameter sizes: all the closed form reads. `compute_scale`:
    every compute time multiplied by it (another accelerator, as Simulator.predict's)."""

    model: Model
    compute_scale: float = 1.0

    @property
    def profiles(self) -> list[Profile]:
        k = self.compute_scale
        if k == 1.0:
            return self.model.profiles
        seg = lambda ss: [dataclasses.replace(s, duration=s.duration * k) for s in ss]  # noqa
        return [dataclasses.replace(
            p, forward=seg(p.forward), backward=seg(p.backward),
            **{f: getattr(p, f) * k for f in ("lead", "loss", "backward_tail", "update",
                                               "step_extra", "tail")})
            for p in self.model.profiles]

    def buckets(self, schedule: str, n: int, fusion_threshold: Optional[int] = None,
                fusion: Optional[FusionConfig] = None
                ) -> "list[tuple[list[int], int]] | DearLayout":
        m, threshold = self.model, fusion_threshold or DEFAULT_THRESHOLD
        if schedule in ("dear", "planned"):
            if fusion is None and fusion_threshold is not None:
                fusion = FusionConfig.single(fusion_threshold)
            return dear_layout(m, fusion, n)
        if schedule == "ddp":
            return ddp_buckets(m, threshold, DDP_FIRST_BUCKET)
        if schedule == "wfbp":
            return wfbp_buckets(m, threshold)
        if schedule == "allreduce":
            return [(list(range(len(m.param_bytes))), sum(m.param_bytes))]
        raise ValueError(f"the queueing model has no closed form for {schedule!r}; "
                         f"expected one of {SCHEDULES}")

    def iteration_time(self, schedule: str, cost: CostModel,
                       fusion_threshold: Optional[int] = None,
                       fusion: Optional[FusionConfig] = None) -> float:
        """Seconds per iteration at cost.world_size workers (slowest traced rank)."""
        schedule = str(getattr(schedule, "value", schedule))
        numel = self.model.param_numel
        if schedule == "horovod":
            delay = HOROVOD_CYCLE_S
            hb = horovod_buckets(self.profiles, self.model.param_bytes,
                                 lambda b: cost.time("all_reduce", b) + delay)
            return max(allreduce_time(p, hb, cost, delay) for p in self.profiles)
        plan = self.buckets(schedule, cost.world_size, fusion_threshold, fusion)
        if isinstance(plan, DearLayout):
            fn = planned_time if schedule == "planned" else dear_time
            return max(fn(p, plan, numel, cost) for p in self.profiles)
        return max(allreduce_time(p, plan, cost, after_backward=schedule == "allreduce")
                   for p in self.profiles)
