"""What-if replay of a traced iteration under another schedule, network, size or fusion.

    sim = Simulator("traces/")                       # profiles + a cost model fitted on the trace
    sim.predict(Schedule.DDP, bandwidth_bps=10e9, world_size=64)
    predict_iteration_time("traces/", fusion_threshold=8 << 20)   # the tuner's objective

Schedules (compute segments from `graph`, one program per traced rank, 4 iterations replayed,
the last one measured so DeAR's all-gathers from the previous step are in it):
- DEAR: buckets contiguous in forward order (dear's own planner); reduce-scatters from the last
  bucket to the first as buckets fill in backward; step() waits for them and issues the
  all-gathers; the next forward waits for a bucket's all-gather and updates it before the first
  module that needs it.
- DDP: buckets in gradient order, a 1 MB first bucket then the threshold (torch's rule: a bucket
  closes once it reaches the cap); all-reduces in order as buckets fill; backward waits for all.
- WFBP: as DDP, but buckets never exceed the threshold (dear's planner rule, as Horovod's
  fusion and benchmarks.baselines.WFBP) and there is no small first bucket.
- ALLREDUCE: one all-reduce of every gradient after backward, then the update.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Sequence

import torch

from .chrome import Trace, load_trace
from .costmodel import CostModel
from .engine import Action, Replay, replay
from .graph import Model, Profile, build_model, collective_samples
from .intervals import clip, subtract, total, union

DEFAULT_THRESHOLD = 25 * 2**20
DDP_FIRST_BUCKET = 2**20
ITERATIONS = 4


class Schedule(str, enum.Enum):
    DEAR = "dear"
    DDP = "ddp"
    WFBP = "wfbp"
    ALLREDUCE = "allreduce"


@dataclasses.dataclass
class Prediction:
    schedule: Schedule
    world_size: int
    iteration_time: float
    compute: float
    comm: float
    exposed: float
    idle: float
    buckets: int

    @property
    def overlap(self) -> Optional[float]:
        return (self.comm - self.exposed) / self.comm if self.comm > 0 else None


def dear_buckets(model: Model, threshold: Optional[int], world_size: int,
                 unclaimed_first: bool = False) -> list[tuple[list[int], int]]:
    """(parameters, wire bytes) per bucket, as dear.fusion.planner lays them out.

    `unclaimed_first`: put the parameters no module claims first in forward order (where dear
    updates them: before the root's forward) instead of last (where dear's planner puts them,
    so their late gradients hold back the last bucket's reduce-scatter until backward ends)."""
    from ..fusion.planner import plan_buckets
    order = model.forward_order
    if unclaimed_first and model.unclaimed:
        order = model.unclaimed + [p for p in order if p not in set(model.unclaimed)]
    if threshold is None and model.buckets and model.schedule == "dear" \
            and world_size == model.world_size and not unclaimed_first:
        groups = model.buckets
    else:
        if threshold is None:
            threshold = model.fusion_threshold if model.schedule == "dear" else None
        threshold = DEFAULT_THRESHOLD if threshold is None else threshold
        specs = plan_buckets(_fake_params(model), order, threshold, world_size)
        groups = [list(s.params) for s in specs]
    out = []
    for g in groups:
        numel = sum(model.param_numel[p] for p in g) + len(g)        # + one flag per parameter
        padded = -(-numel // world_size) * world_size
        width = model.param_bytes[g[0]] // max(model.param_numel[g[0]], 1)
        out.append((g, padded * width))
    return out


def _dtype_of(nbytes: int, numel: int) -> torch.dtype:
    return {2: torch.float16, 8: torch.float64}.get(nbytes // max(numel, 1), torch.float32)


def _gradient_order(model: Model) -> list[int]:
    seen = set(model.backward_order)
    return model.backward_order + [p for p in range(len(model.param_bytes)) if p not in seen]


def wfbp_buckets(model: Model, threshold: int) -> list[tuple[list[int], int]]:
    """WFBP (Horovod-style, benchmarks.baselines.WFBP): gradient order, dear's planner rule (a
    bucket never exceeds the threshold unless one parameter does), no padding."""
    from ..fusion.planner import plan_buckets
    specs = plan_buckets(_fake_params(model), _gradient_order(model), threshold, 1)
    return [(list(s.params), sum(model.param_bytes[p] for p in s.params)) for s in specs]


def _fake_params(model: Model) -> list[torch.Tensor]:
    return [torch.empty(n, device="meta", dtype=_dtype_of(b, n))
            for b, n in zip(model.param_bytes, model.param_numel)]


def ddp_buckets(model: Model, threshold: int, first_bucket: Optional[int]
                ) -> list[tuple[list[int], int]]:
    """DDP: gradient order; a bucket closes once it holds at least its cap (torch's rule)."""
    out: list[tuple[list[int], int]] = []
    current: list[int] = []
    size = 0
    for p in _gradient_order(model):
        current.append(p)
        size += model.param_bytes[p]
        cap = first_bucket if (first_bucket is not None and not out) else threshold
        if size >= cap:
            out.append((current, size))
            current, size = [], 0
    if current:
        out.append((current, size))
    return out


def _dear_program(prof: Profile, buckets: list[tuple[list[int], int]], numel: list[int]
                  ) -> list[Action]:
    owner = {p: b for b, (ps, _) in enumerate(buckets) for p in ps}
    total_numel = max(sum(numel), 1)
    update = [prof.update * sum(numel[p] for p in ps) / total_numel for ps, _ in buckets]
    sizes = [len(ps) for ps, _ in buckets]
    prog: list[Action] = []
    for it in range(ITERATIONS):
        prog += [("mark", "iteration"), ("compute", prof.lead, "idle")]
        pending = list(range(len(buckets))) if it else []
        needed = {owner[p] for s in prof.forward for p in s.needs}
        first = [b for b in pending if b not in needed]            # applied at the root
        for seg in prof.forward:
            due = first + sorted({owner[p] for p in seg.needs} & set(pending))
            first = []
            for b in due:
                if b in pending:
                    prog += [("wait", ("ag", it - 1, b)), ("compute", update[b], "update")]
                    pending.remove(b)
            prog.append(("compute", seg.duration, "forward"))
        prog.append(("compute", prof.loss, "forward"))
        filled, nxt = [0] * len(buckets), len(buckets) - 1
        for seg in prof.backward:
            prog.append(("compute", seg.duration, "backward"))
            if seg.produces is not None:
                filled[owner[seg.produces]] += 1
            while nxt >= 0 and filled[nxt] == sizes[nxt]:
                prog.append(("issue", ("rs", it, nxt)))
                nxt -= 1
        prog.append(("compute", prof.backward_tail, "backward"))
        prog += [("issue", ("rs", it, b)) for b in range(nxt, -1, -1)]
        prog += [("wait", ("rs", it, b)) for b in reversed(range(len(buckets)))]
        prog.append(("compute", prof.step_extra, "step"))
        prog += [("issue", ("ag", it, b)) for b in range(len(buckets))]
        prog.append(("compute", prof.tail, "idle"))
    prog.append(("mark", "iteration"))
    return prog


def _allreduce_program(prof: Profile, buckets: list[tuple[list[int], int]],
                       after_backward: bool) -> list[Action]:
    owner = {p: b for b, (ps, _) in enumerate(buckets) for p in ps}
    sizes = [len(ps) for ps, _ in buckets]
    prog: list[Action] = []
    for it in range(ITERATIONS):
        prog += [("mark", "iteration"), ("compute", prof.lead, "idle")]
        prog += [("compute", s.duration, "forward") for s in prof.forward]
        prog.append(("compute", prof.loss, "forward"))
        filled, nxt = [0] * len(buckets), 0
        for seg in prof.backward:
            prog.append(("compute", seg.duration, "backward"))
            if seg.produces is not None:
                filled[owner[seg.produces]] += 1
            while not after_backward and nxt < len(buckets) and filled[nxt] == sizes[nxt]:
                prog.append(("issue", ("ar", it, nxt)))
                nxt += 1
        prog.append(("compute", prof.backward_tail, "backward"))
        prog += [("issue", ("ar", it, b)) for b in range(nxt, len(buckets))]
        prog += [("wait", ("ar", it, b)) for b in range(len(buckets))]
        prog += [("compute", prof.update, "step"), ("compute", prof.tail, "idle")]
    prog.append(("mark", "iteration"))
    return prog


class Simulator:
    """A trace's profiles and fitted cost model, replayed under what-if settings."""

    def __init__(self, trace: "Trace | str", iterations: Optional[Sequence[int]] = None,
                 cost: Optional[CostModel] = None) -> None:
        trace = load_trace(trace) if isinstance(trace, str) else trace
        samples = collective_samples(trace)
        self.model = build_model(trace, iterations)
        self.fitted: Optional[CostModel] = cost
        if cost is None and samples:
            self.fitted = CostModel.fit(samples, self.model.world_size)

    @classmethod
    def from_model(cls, model: Model, cost: Optional[CostModel] = None) -> "Simulator":
        """A simulator of hand-made profiles (tests, or a model built elsewhere)."""
        sim = cls.__new__(cls)
        sim.model, sim.fitted = model, cost
        return sim

    def cost_model(self, bandwidth_bps: Optional[float] = None, latency_s: Optional[float] = None,
                   world_size: Optional[int] = None,
                   traced_bandwidth_bps: Optional[float] = None) -> CostModel:
        n = self.model.world_size if world_size is None else world_size
        if self.fitted is None:
            if bandwidth_bps is None:
                raise ValueError("the trace holds no collective to fit the network on (one "
                                 "rank?); give bandwidth_bps / --bandwidth")
            return CostModel.ideal(bandwidth_bps, latency_s or 0.0, n)
        return self.fitted.what_if(bandwidth_bps, latency_s, n, traced_bandwidth_bps)

    def predict(self, schedule: "Schedule | str" = Schedule.DEAR, *,
                fusion_threshold: Optional[int] = None, bandwidth_bps: Optional[float] = None,
                latency_s: Optional[float] = None, world_size: Optional[int] = None,
                traced_bandwidth_bps: Optional[float] = None,
                compute_scale: float = 1.0, unclaimed_first: bool = False) -> Prediction:
        schedule = Schedule(schedule)
        if fusion_threshold is not None and fusion_threshold < 0:
            raise ValueError(f"fusion_threshold must be >= 0 bytes, got {fusion_threshold}")
        if not compute_scale > 0:
            raise ValueError(f"compute_scale must be > 0, got {compute_scale}")
        cost = self.cost_model(bandwidth_bps, latency_s, world_size, traced_bandwidth_bps)
        # Each traced iteration replayed on its own; the median one is the prediction (the
        # median of iterations, as measured, rather than an iteration of medians).
        runs = [self._replay(ps, schedule, fusion_threshold, cost, compute_scale,
                             unclaimed_first)
                for ps in (self.model.iterations or [self.model.profiles])]
        runs.sort(key=lambda p: p.iteration_time)
        return runs[len(runs) // 2]

    def _replay(self, profiles: list[Profile], schedule: Schedule,
                fusion_threshold: Optional[int], cost: CostModel,
                compute_scale: float, unclaimed_first: bool) -> Prediction:
        n = cost.world_size
        m = self.model
        profiles = [_scaled(p, compute_scale) for p in profiles]
        threshold = DEFAULT_THRESHOLD if fusion_threshold is None else fusion_threshold
        if schedule is Schedule.DEAR:
            buckets = dear_buckets(m, fusion_threshold, n, unclaimed_first)
            programs = [_dear_program(p, buckets, m.param_numel) for p in profiles]
            kinds = {"rs": "reduce_scatter", "ag": "all_gather"}
        else:
            if schedule is Schedule.ALLREDUCE:
                buckets = [(list(range(len(m.param_bytes))), sum(m.param_bytes))]
            elif schedule is Schedule.DDP:
                buckets = ddp_buckets(m, threshold, DDP_FIRST_BUCKET)
            else:
                buckets = wfbp_buckets(m, threshold)
            programs = [_allreduce_program(p, buckets, schedule is Schedule.ALLREDUCE)
                        for p in profiles]
            kinds = {"ar": "all_reduce"}
        sizes = [nbytes for _, nbytes in buckets]
        result = replay(programs, lambda key: cost.time(kinds[key[0]], sizes[key[2]]))
        return _measure(result, schedule, n, len(buckets))


def _scaled(p: Profile, k: float) -> Profile:
    if k == 1.0:
        return p
    scale = lambda segs: [dataclasses.replace(s, duration=s.duration * k) for s in segs]  # noqa
    return dataclasses.replace(
        p, forward=scale(p.forward), backward=scale(p.backward), loss=p.loss * k,
        backward_tail=p.backward_tail * k, update=p.update * k, step_extra=p.step_extra * k)


def _measure(result: Replay, schedule: Schedule, n: int, nbuckets: int) -> Prediction:
    """The last replayed iteration, per rank as in `report`, averaged over ranks."""
    rows = []
    for r, marks in enumerate(result.mark_times("iteration")):
        lo, hi = marks[-2], marks[-1]
        compute = clip([(s, e) for s, e, label in result.compute[r] if label != "idle"], lo, hi)
        comm = clip([(result.issued[r][key], end) for key, (_, end) in result.comm.items()],
                    lo, hi)
        exposed = subtract(comm, compute)
        idle = subtract(subtract([(lo, hi)], compute), comm)
        rows.append((hi - lo, total(compute), total(union(comm)), total(exposed), total(idle)))
    avg = [sum(col) / len(rows) for col in zip(*rows)]
    return Prediction(schedule, n, *avg, buckets=nbuckets)


def predict_iteration_time(trace: "Trace | str | Simulator",
                           fusion_threshold: Optional[int] = None, *,
                           schedule: "Schedule | str" = Schedule.DEAR,
                           bandwidth_bps: Optional[float] = None,
                           latency_s: Optional[float] = None, world_size: Optional[int] = None,
                           traced_bandwidth_bps: Optional[float] = None) -> float:
    """Predicted seconds per iteration: a zero-cost objective for the fusion tuner. Pass a
    `Simulator` to reuse its profiles and fitted cost model across calls."""
    sim = trace if isinstance(trace, Simulator) else Simulator(trace)
    return sim.predict(schedule, fusion_threshold=fusion_threshold, bandwidth_bps=bandwidth_bps,
                       latency_s=latency_s, world_size=world_size,
                       traced_bandwidth_bps=traced_bandwidth_bps).iteration_time
