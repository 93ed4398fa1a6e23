"""What-if replay of a traced iteration under another schedule, network, size or fusion.

    sim = Simulator("traces/")                       # profiles + a cost model fitted on the trace
    sim.predict(Schedule.DDP, bandwidth_bps=10e9, world_size=64)
    sim.predict(Schedule.DEAR, fusion=FusionConfig(8 << 20, 32 << 20, first_bucket=1 << 20))
    predict_iteration_time("traces/", fusion_threshold=8 << 20)   # the tuner's objective

Schedules (compute segments from `graph`, one program per traced rank, 4 iterations replayed,
the last one measured so DeAR's all-gathers from the previous step are in it):
- DEAR: buckets and all-gather groups from a FusionConfig (dear.fusion.layout's own planner:
  reduce-scatter threshold, first bucket, consecutive buckets all-gathered as one message up to
  the all-gather threshold); reduce-scatters from the last bucket to the first as buckets fill
  in backward; step() waits for them and issues the all-gathers, group by group; the next
  forward waits for a bucket's group and updates the bucket before the first module that
  needs it.
- DDP: buckets in gradient order, a 1 MB first bucket then the threshold (torch's rule: a bucket
  closes once it reaches the cap); all-reduces in order as buckets fill; backward waits for all.
- WFBP: as DDP, but buckets never exceed the threshold (dear's planner rule, as Horovod's
  fusion and benchmarks.baselines.WFBP) and there is no small first bucket.
- ALLREDUCE: one all-reduce of every gradient after backward, then the update.
- HOROVOD: Horovod's tensor fusion (see `dynamic`): each fused all-reduce holds what became
  ready while the previous one ran (up to 128 MB), one negotiation cycle (1 ms) each; step()
  waits for all.
"""

from __future__ import annotations

import dataclasses
import enum
import statistics
from typing import Any, Callable, Mapping, Optional, Sequence

from ..fusion.fusion_config import FusionConfig
from .chrome import Trace, load_trace
from .costmodel import CostModel, iteration_rates
from .dynamic import HOROVOD_CYCLE_S, horovod_buckets
from .engine import Action, Replay, replay_contended
from .graph import Model, Profile, build_model, collective_samples
from .intervals import clip, subtract, total, union
from .programs import (
    DDP_FIRST_BUCKET,
    DEFAULT_THRESHOLD,
    ITERATIONS,
    DearLayout,
    allreduce_program,
    ddp_buckets,
    dear_layout,
    dear_program,
    traced_fusion,
    wfbp_buckets,
)

#: collectives torch's Gloo process group runs at once (its 2 worker threads): DDP's and
#: WFBP's all-reduces share the link two at a time there (engine.py's `slots`)
GLOO_ALLREDUCE_SLOTS = 2


def backend_allreduce_slots(backend: Optional[str]) -> int:
    """How many of DDP's / WFBP's all-reduces run at once on the traced backend: 2 on Gloo
    (torch's process group), 1 elsewhere (NCCL's stream) or when the trace does not say."""
    return GLOO_ALLREDUCE_SLOTS if (backend or "").lower().startswith("gloo") else 1


class Schedule(str, enum.Enum):
    DEAR = "dear"
    PLANNED = "planned"            # dear's default: DeAR + all-gather chunks in backward's gaps
    # shard_optimizer_state: the planned schedule; the buckets it gathers in backward are
    # updated early on the collective thread, the rest in step() before their all-gathers
    # (with a GradScaler or clipping that clips, dear holds back to DeAR's order: Schedule.DEAR
    # with the update in step())
    SHARDED = "sharded"
    DDP = "ddp"
    WFBP = "wfbp"
    ALLREDUCE = "allreduce"
    HOROVOD = "horovod"            # dynamic fusion: what is ready when the link frees


_DEAR_SCHEDULES = (Schedule.DEAR, Schedule.PLANNED, Schedule.SHARDED)


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


class Simulator:
    """A trace's profiles and fitted cost model, replayed under what-if settings."""

    def __init__(self, trace: "Trace | str", iterations: Optional[Sequence[int]] = None,
                 cost: Optional[CostModel] = None, contention: float = 0.0) -> None:
        """`contention` k: compute runs 1 + k times slower while a collective is in flight
        (see engine.py; `fit_contention` measures it). The trace's compute is taken back to
        what it would be on a quiet CPU, and replays slow it where the link is busy."""
        if contention < 0:
            raise ValueError(f"contention must be >= 0, got {contention}")
        trace = load_trace(trace) if isinstance(trace, str) else trace
        samples = collective_samples(trace)
        self.contention = contention
        self.model = build_model(trace, iterations, contention)
        self.fitted: Optional[CostModel] = cost
        #: per traced iteration, each kind's link rate in it (fitted from the trace only)
        self.iteration_rates: dict[int, dict[str, float]] = {}
        if cost is None and samples:
            self.fitted = CostModel.fit(samples, self.model.world_size)
            self.iteration_rates = iteration_rates(samples, self.fitted)

    @classmethod
    def from_model(cls, model: Model, cost: Optional[CostModel] = None) -> "Simulator":
        """A simulator of hand-made profiles (tests, or a model built elsewhere)."""
        sim = cls.__new__(cls)
        sim.model, sim.fitted, sim.contention = model, cost, 0.0
        sim.iteration_rates = {}
        return sim

    def _iteration_cost(self, cost: CostModel, k: int) -> CostModel:
        """`cost` with the link as it ran in the k-th replayed traced iteration: each traced
        kind's rate times that iteration's rate over the fitted (median) one. So a traced
        iteration whose transport was slowed is replayed slowed, and the median of the
        replays is taken as of the measured iterations (median of iterations)."""
        ids = self.model.iteration_ids
        mine = self.iteration_rates.get(ids[k]) if k < len(ids) else None
        if not mine or self.fitted is None:
            return cost
        rate = {kind: r * (mine[kind] / self.fitted.rate[kind]
                           if kind in mine and self.fitted.rate.get(kind) else 1.0)
                for kind, r in cost.rate.items()}
        return CostModel(cost.alpha, rate, cost.world_size)

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

    def layout(self, fusion: Optional[FusionConfig] = None, world_size: Optional[int] = None,
               unclaimed_first: bool = False) -> DearLayout:
        """DeAR's buckets and all-gather groups for `fusion` (see `dear_layout`)."""
        n = self.model.world_size if world_size is None else world_size
        return dear_layout(self.model, fusion, n, unclaimed_first)

    def predict(self, schedule: "Schedule | str" = Schedule.DEAR, *,
                fusion_threshold: Optional[int] = None, bandwidth_bps: Optional[float] = None,
                latency_s: Optional[float] = None, world_size: Optional[int] = None,
                traced_bandwidth_bps: Optional[float] = None,
                compute_scale: float = 1.0, unclaimed_first: bool = False,
                fusion: Optional[FusionConfig] = None, step_overhead_s: float = 0.0,
                unpack_s: float = 0.0, fused_cost: Optional[CostModel] = None,
                allreduce_slots: Optional[int] = None,
                row_sparse: Optional[Mapping[int, tuple[int, int]]] = None) -> Prediction:
        """`fusion_threshold` is one threshold for every schedule (for DeAR:
        FusionConfig.single, as dear's own fusion_threshold=); `fusion` is DeAR's full layout
        (reduce-scatter threshold, all-gather threshold, first bucket). `step_overhead_s`: CPU
        seconds an all-reduce implementation spends in step() after its waits that the traced
        one did not (e.g. benchmarks.baselines.WFBP copies every averaged gradient out of its
        buckets); measured apart, never in the trace. `unpack_s`: the same kind of seconds
        spent bucket by bucket, each bucket's share (by bytes) right after its wait, while
        later buckets are still on the link (WFBP's copy-out, as benchmarks.baselines does).
        `fused_cost` (Horovod): the all-reduce cost of a response that fuses several tensors,
        at the traced world size and link, moved to the asked ones as the trace's cost is
        (Horovod copies fused tensors through its fusion buffer; a tensor alone is reduced in
        place at the usual cost); None: the same cost for both. `allreduce_slots` (DDP, WFBP,
        ALLREDUCE): how many all-reduces share the link at once; None: from the traced backend
        (`backend_allreduce_slots`: 2 on Gloo, whose process group runs two at a time).
        `row_sparse` (DEAR, PLANNED): {parameter: (rows, rows sent)} for embedding tables dear
        sends by rows (dear/fusion/rows.py; a trace sends them whole, so how many rows the
        ranks' batches touch together is given here): such a table is a bucket of its own, its
        reduce-scatter is an all-reduce of the row marks and one of the rows sent, and its
        all-gather costs nothing (every rank already holds the averaged table)."""
        schedule = Schedule(schedule)
        if fusion_threshold is not None and fusion_threshold < 0:
            raise ValueError(f"fusion_threshold must be >= 0 bytes, got {fusion_threshold}")
        if fusion is not None:
            if not isinstance(fusion, FusionConfig):
                raise TypeError(f"fusion must be a dear FusionConfig, got {type(fusion).__name__}")
            if fusion_threshold is not None or schedule not in _DEAR_SCHEDULES:
                raise ValueError("fusion= is DeAR's layout: give it with Schedule.DEAR and "
                                 "without fusion_threshold=")
        elif schedule in _DEAR_SCHEDULES and fusion_threshold is not None:
            fusion = FusionConfig.single(fusion_threshold)
        if not compute_scale > 0:
            raise ValueError(f"compute_scale must be > 0, got {compute_scale}")
        if fused_cost is not None and (schedule is not Schedule.HOROVOD
                                       or not isinstance(fused_cost, CostModel)):
            raise ValueError("fused_cost= is the cost of Horovod's fused responses: give a "
                             "dear.diagnose CostModel with Schedule.HOROVOD")
        if allreduce_slots is not None and allreduce_slots < 1:
            raise ValueError(f"allreduce_slots must be >= 1, got {allreduce_slots}")
        if allreduce_slots is not None and schedule not in (Schedule.DDP, Schedule.WFBP,
                                                            Schedule.ALLREDUCE):
            raise ValueError("allreduce_slots= is for torch's all-reduce schedules (DDP, WFBP, "
                             "ALLREDUCE); dear and Horovod run one collective at a time")
        slots = (allreduce_slots if allreduce_slots is not None
                 else backend_allreduce_slots(self.model.backend)
                 if schedule in (Schedule.DDP, Schedule.WFBP, Schedule.ALLREDUCE) else 1)
        rows = dict(row_sparse or {})
        if rows and schedule not in _DEAR_SCHEDULES:
            raise ValueError("row_sparse= is dear's: give it with Schedule.DEAR or PLANNED")
        for p, (table_rows, sent) in rows.items():
            if not 0 <= p < len(self.model.param_bytes) or not 0 <= sent <= table_rows \
                    or table_rows < 1:
                raise ValueError(f"row_sparse: parameter {p} with {sent} of {table_rows} rows "
                                 "sent is not a table of this model")
        if step_overhead_s < 0 or unpack_s < 0:
            raise ValueError(f"step_overhead_s and unpack_s must be >= 0, got "
                             f"{step_overhead_s}, {unpack_s}")
        cost = self.cost_model(bandwidth_bps, latency_s, world_size, traced_bandwidth_bps)
        if fused_cost is not None:
            fused_cost = fused_cost.what_if(bandwidth_bps, latency_s, cost.world_size,
                                            traced_bandwidth_bps)
        # Each traced iteration replayed on its own, on the link as it ran in that iteration
        # (_iteration_cost); the median one is the prediction (the median of iterations, as
        # measured, rather than an iteration of medians).
        plan = self._plan(schedule, fusion_threshold, fusion, cost.world_size, unclaimed_first,
                          sorted(rows))
        chunk = None if fusion is None else fusion.chunk_bytes     # PLANNED: the plan's chunks
        runs = [self._replay(ps, schedule, plan, self._iteration_cost(cost, k) if
                             self.model.iterations else cost, compute_scale, chunk,
                             step_overhead_s=step_overhead_s, unpack_s=unpack_s,
                             fused_cost=fused_cost, slots=slots, rows=rows)
                for k, ps in enumerate(self.model.iterations or [self.model.profiles])]
        runs.sort(key=lambda p: p.iteration_time)
        return runs[len(runs) // 2]

    def _plan(self, schedule: Schedule, fusion_threshold: Optional[int],
              fusion: Optional[FusionConfig], n: int, unclaimed_first: bool,
              alone: Sequence[int] = ()
              ) -> "tuple[list[tuple[list[int], int]], Optional[DearLayout]]":
        """The schedule's buckets (and DeAR's layout), planned once per prediction; `alone`:
        row-sparse tables, each in a bucket of its own."""
        m = self.model
        threshold = DEFAULT_THRESHOLD if fusion_threshold is None else fusion_threshold
        if schedule in _DEAR_SCHEDULES:
            if set(alone) - set(m.alone):      # the traced buckets cannot hold them: re-plan
                m = dataclasses.replace(m, alone=sorted(set(m.alone) | set(alone)))
                fusion = traced_fusion(m) if fusion is None else fusion
            layout = dear_layout(m, fusion, n, unclaimed_first)
            return layout.buckets, layout
        if schedule is Schedule.ALLREDUCE:
            return [(list(range(len(m.param_bytes))), sum(m.param_bytes))], None
        if schedule is Schedule.HOROVOD:
            return [], None                    # decided per replayed iteration (_replay)
        if schedule is Schedule.DDP:
            return ddp_buckets(m, threshold, DDP_FIRST_BUCKET), None
        return wfbp_buckets(m, threshold), None

    def _replay(self, profiles: list[Profile], schedule: Schedule,
                plan: "tuple[list[tuple[list[int], int]], Optional[DearLayout]]",
                cost: CostModel, compute_scale: float,
                chunk: Optional[int] = None, step_overhead_s: float = 0.0,
                unpack_s: float = 0.0, fused_cost: Optional[CostModel] = None,
                slots: int = 1, rows: Optional[Mapping[int, tuple[int, int]]] = None
                ) -> Prediction:
        buckets, layout = plan
        profiles = [_scaled(p, compute_scale) for p in profiles]
        delay = 0.0                            # per collective: Horovod's negotiation cycle
        per_bucket: list[CostModel] = []       # per all-reduce bucket: its cost model
        if layout is not None:
            numel = self.model.param_numel
            shard = 1.0 / cost.world_size if schedule is Schedule.SHARDED else None
            programs = [dear_program(p, layout, numel, sharded=shard) for p in profiles]
            tables = _row_sparse_seconds(buckets, rows or {}, numel, cost)
            group_bytes = layout.group_bytes()

            def bucket_sizes(key: tuple) -> int:
                return buckets[key[2]][1] if key[0] == "rs" else group_bytes[key[2]]
            sizes: Callable[[tuple], int] = bucket_sizes
            if schedule in (Schedule.PLANNED, Schedule.SHARDED):
                plan, layout, sizes = self._planned(programs, layout, cost, chunk, tables)
                programs = [dear_program(p, layout, numel, plan, sharded=shard)
                            for p in profiles]
            # a table sent by rows: its own reduce-scatter time, nothing to all-gather
            fixed = {("rs", b): t for b, t in tables.items()}
            fixed.update((("ag", g), 0.0) for g, members in enumerate(layout.groups)
                         if members and all(b in tables for b in members))

            def seconds(key: tuple) -> float:
                known = fixed.get((key[0], key[2]))
                return known if known is not None else cost.time(
                    {"rs": "reduce_scatter"}.get(key[0], "all_gather"), sizes(key))
            rates = self.model.decode_s_per_byte

            def decoding(key: tuple) -> float:
                """A quantized trace: the decode thread's time after the transfer."""
                if (key[0], key[2]) in fixed:
                    return 0.0
                return rates.get("reduce" if key[0] == "rs" else "gather", 0.0) * sizes(key)
            result = replay_contended(programs, seconds, self.contention,
                                      post=decoding if rates else None)
            return _measure(result, schedule, cost.world_size, len(buckets))
        else:
            fused = fused_cost or cost         # given for Schedule.HOROVOD only
            if schedule is Schedule.HOROVOD:   # dynamic fusion: from this iteration's timing
                delay = HOROVOD_CYCLE_S
                buckets = horovod_buckets(
                    profiles, self.model.param_bytes,
                    lambda b: cost.time("all_reduce", b) + delay, fused_s=lambda b: fused.time(
                        "all_reduce", b) + delay)
            programs = [allreduce_program(p, buckets, schedule is Schedule.ALLREDUCE,
                                           step_overhead_s, unpack_s) for p in profiles]
            kinds = {"ar": "all_reduce"}
            nbytes = {"ar": [b for _, b in buckets]}
            per_bucket = [fused if len(ps) > 1 else cost for ps, _ in buckets]
        result = replay_contended(
            programs, lambda key: (per_bucket[key[2]] if key[0] == "ar" else cost).time(
                kinds[key[0]], nbytes[key[0]][key[2]]) + (delay if key[0] == "ar" else 0.0),
            self.contention, slots=slots)
        return _measure(result, schedule, cost.world_size, len(buckets))


    def _planned(self, programs: list[list[Action]], layout: DearLayout, cost: CostModel,
                 chunk: Optional[int] = None, tables: Optional[Mapping[int, float]] = None
                 ) -> tuple[Any, DearLayout, Callable[[tuple], int]]:
        """What dear does: replay DeAR's order, take when each bucket's reduce-scatter was
        issued in the last iteration, and plan the gaps with dear's own planner, in chunks of
        `chunk` bytes (the FusionConfig's: the offline tuner searches it; None: Config's).
        Returns the plan, the layout as it then runs (step() gathers an all-gather group that
        an early chunk touched bucket by bucket, ScheduleDriver.gather_rest: one group per
        bucket there) and each collective's bytes. `tables`: buckets sent by rows and their
        seconds on the link (_row_sparse_seconds): planned with that time, as dear plans with
        Bucket.reduce_bytes, and never chunked."""
        from ..config import Config
        from ..fusion.schedule import plan_gaps
        buckets, group_bytes = layout.buckets, layout.group_bytes()
        base = replay_contended(programs, lambda key: cost.time(
            {"rs": "reduce_scatter", "ag": "all_gather"}[key[0]],
            (buckets[key[2]][1] if key[0] == "rs" else group_bytes[key[2]])), self.contention)
        n, world = len(buckets), cost.world_size
        last = ITERATIONS - 1
        issued = base.issued[0]
        origin = min(issued[("rs", last, b)] for b in range(n))
        ready = [issued[("rs", last, b)] - origin for b in range(n)]
        link = cost                            # the planner's link model is the same one
        itemsize = [max(1, b // max(1, sum(self.model.param_numel[p] for p in ps) + len(ps)))
                    for ps, b in buckets]
        shard = [b // itemsize[k] // world for k, (_, b) in enumerate(buckets)]
        chunk = Config().chunk_bytes if chunk is None else chunk
        tables = tables or {}
        reduced = [b if k not in tables else link.bytes_in("reduce_scatter", tables[k])
                   for k, (_, b) in enumerate(buckets)]
        plan = plan_gaps(ready, reduced,
                         [0 if k in tables else n for k, n in enumerate(shard)],
                         itemsize, world, link, chunk,   # as dear: no chunks of a rows table
                         Config.from_env().plan_slack)
        early = {c[0] for cs in plan.after.values() for c in cs}
        layout = DearLayout(buckets, [part for g in layout.groups
                                      for part in ([[b] for b in g] if early & set(g) else [g])])
        group_bytes = layout.group_bytes()
        length = {(c[0], c[1]): c[2] for cs in plan.after.values() for c in cs}
        done: dict[int, int] = {}
        for cs in plan.after.values():
            for c in cs:
                done[c[0]] = max(done.get(c[0], 0), c[1] + c[2])

        def nbytes(key: tuple) -> int:
            kind, b = key[0], key[2]
            if kind == "rs":
                return buckets[b][1]
            if kind == "agc":
                return world * length[(b, key[3])] * itemsize[b]
            if kind == "agr":
                return world * (shard[b] - done.get(b, 0)) * itemsize[b]
            return group_bytes[b]                       # "ag": a whole group
        return plan, layout, nbytes


def _row_sparse_seconds(buckets: list[tuple[list[int], int]],
                        rows: Mapping[int, tuple[int, int]], numel: Sequence[int],
                        cost: CostModel) -> dict[int, float]:
    """Seconds on the link of each bucket that holds one row-sparse table, in its
    reduce-scatter's place: the marks' all-reduce (one element a row) and the rows' (+ the
    usage flag)."""
    out: dict[int, float] = {}
    for b, (ps, nbytes) in enumerate(buckets):
        if len(ps) == 1 and ps[0] in rows:
            table_rows, sent = rows[ps[0]]
            item = max(1, nbytes // (numel[ps[0]] + 1))      # + flag and padding: < 1 element
            row_bytes = numel[ps[0]] // table_rows * item
            out[b] = (cost.time("all_reduce", table_rows * item)
                      + cost.time("all_reduce", sent * row_bytes + item))
    return out


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
    iteration, compute_s, comm_s, exposed_s, idle_s = (sum(col) / len(rows) for col in zip(*rows))
    return Prediction(schedule, n, iteration, compute_s, comm_s, exposed_s, idle_s, nbuckets)


def fit_contention(overlapped: "Trace | str", clean: "Trace | str") -> float:
    """k such that compute runs 1 + k times slower while a collective is in flight, from two
    traces of the same model on the same machine: one whose compute overlaps communication
    (DeAR, DDP) and one whose does not (the all-reduce schedule: communication after
    backward). Wall compute C0 of the overlapped trace is its quiet-CPU work W plus
    busy * k / (1 + k); W is the clean trace's compute; busy (compute time with a collective
    in flight) comes from building the overlapped profile with k = 1 (C1 = C0 - busy / 2)."""
    def compute(trace: "Trace | str", k: float) -> float:
        model = build_model(load_trace(trace) if isinstance(trace, str) else trace,
                            contention=k)
        return statistics.mean(p.compute for p in model.profiles)
    c0, c1, work = compute(overlapped, 0.0), compute(overlapped, 1.0), compute(clean, 0.0)
    busy = 2 * (c0 - c1)
    if busy <= 0:
        raise ValueError("the overlapped trace has no compute while collectives are in flight")
    x = min(max((c0 - work) / busy, 0.0), 0.9)   # k / (1 + k)
    return x / (1 - x)


def predict_iteration_time(trace: "Trace | str | Simulator",
                           fusion_threshold: Optional[int] = None, *,
                           schedule: "Schedule | str" = Schedule.DEAR,
                           bandwidth_bps: Optional[float] = None,
                           latency_s: Optional[float] = None, world_size: Optional[int] = None,
                           traced_bandwidth_bps: Optional[float] = None,
                           fusion: Optional[FusionConfig] = None) -> float:
    """Predicted seconds per iteration: a zero-cost objective for the fusion tuner
    (dear.autotune.offline). Pass a `Simulator` to reuse its profiles and fitted cost model."""
    sim = trace if isinstance(trace, Simulator) else Simulator(trace)
    return sim.predict(schedule, fusion_threshold=fusion_threshold, bandwidth_bps=bandwidth_bps,
                       latency_s=latency_s, world_size=world_size,
                       traced_bandwidth_bps=traced_bandwidth_bps, fusion=fusion).iteration_time
