"""`python -m dear.diagnose simulate TRACE [--schedule ...] [--bandwidth ...] ...`"""

from __future__ import annotations

import argparse
from typing import Any

from ..config import _parse_bytes


def _rate(text: str) -> float:
    """'10gbit', '100mbit', '1e9' (bits/s)."""
    value = text.strip().lower().replace("bps", "bit")
    for suffix, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0),
                          ("g", 1e9), ("m", 1e6), ("k", 1e3)):
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * scale
    return float(value)


def _seconds(text: str) -> float:
    value = text.strip().lower()
    for suffix, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * scale
    return float(value)


def _row_sparse(text: str, names: list[str]) -> dict[int, tuple[int, int]]:
    """'NAME=ROWS:SENT[,NAME=ROWS:SENT...]' -> {parameter index: (rows, rows sent)}."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, counts = item.rpartition("=")
        rows, _, sent = counts.partition(":")
        if name not in names or not rows.isdigit() or not sent.isdigit():
            raise SystemExit(f"--row-sparse {item!r}: give NAME=ROWS:SENT with NAME a traced "
                             f"parameter (e.g. {names[0] if names else '-'}=30522:3900)")
        out[names.index(name)] = (int(rows), int(sent))
    return out


def _simulate(args: argparse.Namespace) -> int:
    from ..fusion.fusion_config import FusionConfig
    from .chrome import load_trace
    from .simulate import DEFAULT_THRESHOLD, Schedule, Simulator
    trace = load_trace(args.trace)
    sim = Simulator(trace, contention=args.contention)
    tables = _row_sparse(args.row_sparse, [p["name"] for p in trace.meta.get("params", [])])
    fusion = None                              # DeAR's full layout, when any part is given
    if args.rs_threshold is not None or args.ag_threshold is not None \
            or args.first_bucket is not None:
        rs = args.rs_threshold if args.rs_threshold is not None else (
            args.fusion_threshold if args.fusion_threshold is not None else DEFAULT_THRESHOLD)
        fusion = FusionConfig(rs_threshold=rs, ag_threshold=args.ag_threshold or rs,
                              first_bucket=args.first_bucket)
    schedules = [Schedule(s) for s in args.schedule.split(",")]
    worlds = [int(w) for w in args.world_size.split(",")] if args.world_size else [None]
    print(f"{args.trace}: traced schedule {sim.model.schedule} on {sim.model.world_size} ranks")
    if sim.fitted is not None:
        print(f"fitted network: {sim.fitted.describe()}")
    cost = sim.cost_model(args.bandwidth, args.latency, None, args.traced_bandwidth)
    print(f"replayed with: {cost.describe()}\n")
    print("| schedule | world size | buckets | iteration (ms) | compute | communication | "
          "exposed | overlap |")
    print("|---|---|---|---|---|---|---|---|")
    for n in worlds:
        for schedule in schedules:
            dear_like = schedule in (Schedule.DEAR, Schedule.PLANNED)
            layout: dict[str, Any] = (dict(fusion=fusion) if fusion is not None and dear_like
                                      else dict(fusion_threshold=args.fusion_threshold))
            if dear_like and tables:
                layout["row_sparse"] = tables
            p = sim.predict(schedule, **layout,
                            bandwidth_bps=args.bandwidth, latency_s=args.latency, world_size=n,
                            traced_bandwidth_bps=args.traced_bandwidth,
                            compute_scale=args.compute_scale)
            ov = "-" if p.overlap is None else f"{p.overlap:.0%}"
            print(f"| {p.schedule.value} | {p.world_size} | {p.buckets} | "
                  f"{p.iteration_time * 1e3:.1f} | {p.compute * 1e3:.1f} | {p.comm * 1e3:.1f} | "
                  f"{p.exposed * 1e3:.1f} | {ov} |")
    return 0


def add_parser(sub: Any) -> None:
    sim = sub.add_parser("simulate", help="replay the traced iteration under what-if settings")
    sim.add_argument("trace", help="directory holding rank*.json")
    sim.add_argument("--schedule", default="planned,dear,ddp,wfbp,allreduce",
                     help="comma-separated: planned (dear's default), dear, ddp, wfbp, allreduce")
    sim.add_argument("--bandwidth", type=_rate, default=None,
                     help="link rate, e.g. 10gbit (default: as fitted from the trace)")
    sim.add_argument("--latency", type=_seconds, default=None,
                     help="per-step latency, e.g. 20us (default: as fitted)")
    sim.add_argument("--world-size", default="",
                     help="comma-separated world sizes (default: the traced one)")
    sim.add_argument("--fusion-threshold", type=_parse_bytes, default=None,
                     help="bucket size, e.g. 25MB (default: as traced, else 25MB)")
    sim.add_argument("--rs-threshold", type=_parse_bytes, default=None,
                     help="DeAR only: reduce-scatter bucket size (default: --fusion-threshold)")
    sim.add_argument("--ag-threshold", type=_parse_bytes, default=None,
                     help="DeAR only: all-gather message size (default: the reduce-scatter one)")
    sim.add_argument("--first-bucket", type=_parse_bytes, default=None,
                     help="DeAR only: size of the first bucket, gathered alone")
    sim.add_argument("--contention", type=float, default=0.0,
                     help="compute 1 + K times slower while a collective is in flight (the "
                          "transport on the compute's CPU; dear.diagnose.fit_contention)")
    sim.add_argument("--traced-bandwidth", type=_rate, default=None,
                     help="the traced link's rate: --bandwidth then keeps each collective's "
                          "measured efficiency instead of assuming the ideal rate")
    sim.add_argument("--row-sparse", default="",
                     help="DeAR only: NAME=ROWS:SENT,... embedding tables dear sends by rows "
                          "(its default for untied nn.Embedding tables of 1 MB or more): a "
                          "trace sends them whole, so give how many rows the ranks send")
    sim.add_argument("--compute-scale", type=float, default=1.0,
                     help="multiply compute times (e.g. 0.1 for a 10x faster accelerator)")
    sim.set_defaults(run=_simulate)
