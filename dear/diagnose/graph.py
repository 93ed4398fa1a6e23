"""From a trace to what replay needs: one rank's iteration as compute segments with dependencies.

The training thread's iteration is cut at the points where communication can interact with it:
- forward: at each module that owns parameters (the first time it runs): the segment after the
  cut needs those parameters updated (DeAR waits for their bucket's all-gather there);
- backward: at each parameter's gradient arriving (a bucket may become ready to reduce);
- step: the update of every parameter (DDP, WFBP, all-reduce) or, for DeAR, per bucket in the
  next forward, plus what step() itself does.
Each segment's duration is compute only: time inside traced waits and dear's per-bucket updates
is removed (the update is modelled separately, per parameter, proportional to its size), as is
time blocked on communication after the last gradient (DDP waits there, inside backward).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Optional, Sequence

from .chrome import RankTrace, Span, Trace
from .intervals import Interval, clip, intersect, subtract, total, union


@dataclasses.dataclass
class Segment:
    duration: float
    needs: tuple[int, ...] = ()           # forward: parameters first used by this segment
    produces: Optional[int] = None        # backward: the parameter whose gradient ends it


@dataclasses.dataclass
class Profile:
    """One rank's iteration, compute only (seconds)."""

    rank: int
    lead: float                           # iteration start to forward (zero_grad, data, ...)
    forward: list[Segment]
    loss: float                           # forward's end to backward's start
    backward: list[Segment]
    backward_tail: float                  # last gradient to step(), communication removed
    update: float                         # the optimizer's update of all parameters
    step_extra: float                     # the rest of step(): schedule-specific (see below)
    tail: float                           # step()'s end to the iteration's end

    def structure(self) -> tuple:
        return (tuple(s.needs for s in self.forward), tuple(s.produces for s in self.backward))

    @property
    def compute(self) -> float:
        return (self.lead + self.loss + self.backward_tail + self.update + self.step_extra
                + self.tail + sum(s.duration for s in self.forward + self.backward))


@dataclasses.dataclass
class Model:
    """What every rank shares: parameters, forward order, the traced schedule and buckets."""

    param_bytes: list[int]
    param_numel: list[int]
    #: parameters by first use in forward; those no module claims (used directly by a parent,
    #: e.g. `self.emb.weight[0]`) last, as dear's optimizer orders them
    forward_order: list[int]
    backward_order: list[int]             # parameters by gradient arrival
    schedule: str
    buckets: list[list[int]]              # traced buckets (dear), forward order
    fusion_threshold: Optional[int]
    world_size: int
    profiles: list[Profile]               # one per traced rank: median over iterations
    unclaimed: list[int] = dataclasses.field(default_factory=list)  # end of forward_order
    #: per traced iteration, every rank's profile of it (replayed one by one when given)
    iterations: list[list[Profile]] = dataclasses.field(default_factory=list)
    #: traced all-gather groups (bucket indices, forward order; dear) and the traced
    #: FusionConfig as a dict (rs_threshold, ag_threshold, first_bucket)
    gather_groups: list[list[int]] = dataclasses.field(default_factory=list)
    fusion: Optional[dict[str, Any]] = None
    #: the traced iteration number of each entry of `iterations`
    iteration_ids: list[int] = dataclasses.field(default_factory=list)
    #: the traced communicator's name (e.g. "gloo-pairwise", "nccl", "horovod"), if recorded
    backend: Optional[str] = None
    #: parameters dear keeps in a bucket of their own (row-sparse embedding tables) when it
    #: lays out buckets; replayed as dense buckets (a traced window sends them whole)
    alone: list[int] = dataclasses.field(default_factory=list)
    #: quantized buckets: seconds per bucket byte of dear's decode thread after a
    #: reduce-scatter ("reduce") and an all-gather ("gather"), replayed after the transfer
    decode_s_per_byte: dict[str, float] = dataclasses.field(default_factory=dict)


def _rank_profile(rank: RankTrace, iteration: int, comm: list[Interval],
                  contention: float = 0.0) -> Profile:
    spans = [s for s in rank.spans if s.iteration == iteration]
    window = rank.iterations[iteration]
    modules = rank.meta.get("modules", [])
    roots = [s for s in spans if s.cat == "forward" and s.args.get("module") == 0]
    steps = [s for s in spans if s.cat == "step"]
    if not modules and not roots:
        raise ValueError(
            f"rank {rank.rank}: the trace has no forward pass to replay, because the traced "
            "optimizer was built without model= (Horovod-style, from named_parameters), so "
            "dear could not hook the model's modules. Pass the model: "
            "dear.DistributedOptimizer(optimizer, named_parameters=..., model=model) with "
            "DEAR_TRACE, or trace explicitly with dear.diagnose.trace(model, optimizer, ...)")
    if len(roots) != 1 or len(steps) != 1:
        raise ValueError(
            f"rank {rank.rank} iteration {iteration}: replay models one forward, one backward "
            f"and one step() per iteration; this one has {len(roots)} forward(s) of the model "
            f"and {len(steps)} step(s) (gradient accumulation is not modelled yet)")
    root, step = roots[0], steps[0]

    def compute_in(span: Interval, holes: list[Interval]) -> float:
        """Compute time in `span` outside `holes`; with `contention` k, the part spent while a
        collective was in flight counts 1 / (1 + k): the work it would take on a quiet CPU."""
        pieces = subtract([span], holes)
        slowed = total(intersect(pieces, comm)) if contention > 0 else 0.0
        return total(pieces) - slowed * contention / (1 + contention)

    updates = [(s.start, s.end) for s in spans if s.cat == "update"]
    waits = [(s.start, s.end) for s in rank.spans if s.cat == "wait"]    # any iteration's
    not_compute = union(updates + waits)

    # The root's own parameters (e.g. a position embedding used in its forward) are needed
    # from the start, as dear's optimizer orders them.
    first = tuple(modules[0].get("params", [])) if modules else ()
    seen: set[int] = set(first)
    cuts: list[tuple[float, tuple[int, ...]]] = []
    for s in sorted((s for s in spans if s.cat == "forward" and s.args.get("module")),
                    key=lambda s: s.start):
        fresh = tuple(p for p in modules[s.args["module"]].get("params", []) if p not in seen)
        if fresh:
            seen.update(fresh)
            cuts.append((s.start, fresh))
    bounds = [root.start] + [t for t, _ in cuts] + [root.end]
    needs = [first] + [n for _, n in cuts]
    forward = [Segment(compute_in((a, b), not_compute), n)
               for a, b, n in zip(bounds, bounds[1:], needs)]

    grads = sorted((s for s in spans if s.cat == "grad"), key=lambda s: s.start)
    backward_spans = [s for s in spans if s.cat == "backward"]
    start = min([s.start for s in backward_spans] + [g.start for g in grads[:1]] + [step.start])
    backward, cursor, produced = [], start, set()
    for g in grads:
        param = int(g.args["param"])
        if param in produced:
            raise ValueError(f"rank {rank.rank} iteration {iteration}: parameter {param} got "
                             "two gradients (several backward passes per step are not modelled)")
        produced.add(param)
        backward.append(Segment(compute_in((cursor, g.start), not_compute), produces=param))
        cursor = g.start
    blocked = union(not_compute + clip(comm, cursor, step.start))
    update_spans = sum(compute_in(u, waits) for u in updates)
    step_compute = compute_in((step.start, step.end), waits)
    dear = rank.meta.get("schedule") == "dear"
    return Profile(
        rank=rank.rank,
        lead=compute_in((window.start, root.start), not_compute),
        forward=forward,
        loss=compute_in((root.end, start), not_compute),
        backward=backward,
        backward_tail=compute_in((cursor, step.start), blocked),
        update=update_spans if dear else step_compute,
        step_extra=step_compute if dear else 0.0,
        tail=compute_in((step.end, window.end), not_compute))


def _median_profile(profiles: Sequence[Profile]) -> Profile:
    """Element-wise median over iterations of the same structure."""
    first = profiles[0]
    med = lambda xs: statistics.median(xs)  # noqa: E731
    forward = [Segment(med([p.forward[i].duration for p in profiles]), s.needs)
               for i, s in enumerate(first.forward)]
    backward = [Segment(med([p.backward[i].duration for p in profiles]), produces=s.produces)
                for i, s in enumerate(first.backward)]
    scalars = {f: med([getattr(p, f) for p in profiles])
               for f in ("lead", "loss", "backward_tail", "update", "step_extra", "tail")}
    return Profile(rank=first.rank, forward=forward, backward=backward, **scalars)


def _fully_traced(trace: Trace) -> list[int]:
    """The complete iterations, less those whose forward waited for collectives issued before
    the trace began (DeAR's first traced iteration: its per-bucket updates hold no traced
    wait, so the time they waited would count as update compute), unless nothing else is
    left."""
    common = trace.common_iterations()

    def untraced_waits(rank: Any, it: int) -> bool:
        updates = rank.of("update", it)
        waits = rank.of("wait", it)
        return bool(updates) and not any(u.start <= w.start and w.end <= u.end
                                         for u in updates for w in waits)

    clean = [it for it in common if not any(untraced_waits(r, it) for r in trace.ranks)]
    return clean or common


def build_model(trace: Trace, iterations: Optional[Sequence[int]] = None,
                contention: float = 0.0) -> Model:
    """Profiles of every traced rank (median over `iterations`, default all complete ones);
    `contention`: see `_rank_profile` and engine.py."""
    chosen = list(iterations) if iterations is not None else _fully_traced(trace)
    if not chosen:
        raise ValueError(f"{trace.path}: no iteration was traced on every rank")
    profiles, per_rank = [], []
    for rank in trace.ranks:
        comm = union((s.start, s.end) for s in rank.spans if s.cat == "comm")
        per_it = [_rank_profile(rank, it, comm, contention) for it in chosen]
        per_rank.append(per_it)
        same = all(p.structure() == per_it[0].structure() for p in per_it)
        if same:
            profiles.append(_median_profile(per_it))
        else:                                  # take the iteration of median length
            times = sorted((rank.iterations[it].duration, k) for k, it in enumerate(chosen))
            profiles.append(per_it[times[len(times) // 2][1]])
    shape = profiles[0].structure()
    kept = [k for k in range(len(chosen))
            if all(per_it[k].structure() == shape for per_it in per_rank)]
    per_iteration = [[per_it[k] for per_it in per_rank] for k in kept]
    meta = trace.meta
    params = meta.get("params", [])
    if not params:
        raise ValueError(f"{trace.path}: the trace lists no parameters")
    p0 = profiles[0]
    forward_order = [p for s in p0.forward for p in s.needs]
    backward_order = [s.produces for s in p0.backward if s.produces is not None]
    missing = [i for i in range(len(params)) if i not in set(forward_order)]
    return Model(param_bytes=[int(p["bytes"]) for p in params],
                 param_numel=[int(p["numel"]) for p in params],
                 forward_order=forward_order + missing, unclaimed=missing,
                 backward_order=backward_order,
                 schedule=str(meta.get("schedule", "unknown")),
                 buckets=[list(b) for b in meta.get("buckets", [])],
                 fusion_threshold=meta.get("fusion_threshold"),
                 world_size=trace.world_size, profiles=profiles, iterations=per_iteration,
                 gather_groups=[list(g) for g in meta.get("gather_groups", [])],
                 fusion=meta.get("fusion"), iteration_ids=[chosen[k] for k in kept],
                 backend=meta.get("backend"),
                 decode_s_per_byte={str(k): float(v) for k, v in
                                    (meta.get("decode_s_per_byte") or {}).items()})


def collective_samples(trace: Trace, queued: bool = False) -> list[dict[str, Any]]:
    """Each traced collective once: kind, bytes, and its share of the link's busy time.

    A collective is on the link from the last rank's issue to the last rank's completion; while
    several are (Gloo runs some concurrently, dear queues its own), each gets an equal share of
    that time. The shares of a kind add up to the time the link spent on that kind, however the
    backend interleaved them. `queued`: a collective that ends after an earlier-issued one is
    taken to start when that one ended (a FIFO such as dear's; per-collective times then exclude
    queueing; the total is the same)."""
    by_seq: dict[int, list[Span]] = {}
    for rank in trace.ranks:
        for s in rank.of("comm"):
            if s.args.get("end_source") in ("watcher", "callback", "wait"):
                by_seq.setdefault(int(s.args["seq"]), []).append(s)
    items = []
    for seq in sorted(by_seq):
        spans = by_seq[seq]
        if len(spans) == len(trace.ranks):
            begin, end = max(s.start for s in spans), max(s.end for s in spans)
            args = spans[0].args               # a compressed wire: costed in its bucket's bytes
            items.append({"kind": args["kind"],
                          "bytes": int(args.get("buffer_bytes", args["bytes"])),
                          "seconds": 0.0, "seq": seq, "begin": begin, "end": end,
                          "iteration": spans[0].iteration})
    if queued:
        latest = float("-inf")
        for it in items:                       # in issue (sequence) order
            if latest < it["end"]:
                it["begin"] = max(it["begin"], latest)
            latest = max(latest, it["end"])
    cuts = sorted({t for it in items for t in (it["begin"], it["end"])})
    for lo, hi in zip(cuts, cuts[1:]):
        active = [it for it in items if it["begin"] <= lo and it["end"] >= hi]
        for it in active:
            it["seconds"] += (hi - lo) / len(active)
    for it in items:                           # alone on the link: a clean sample
        it["alone"] = it["seconds"] >= (it["end"] - it["begin"]) * (1 - 1e-9)
    return [it for it in items if it["seconds"] > 0]
