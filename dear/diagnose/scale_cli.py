"""`python -m dear.diagnose scale TRACE [--workers 1-256] [--bandwidth ...] [--gpus-per-node ...]`

Prints the table and writes PREFIX.json, PREFIX.md and PREFIX.png (default PREFIX:
TRACE/scaling)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ..config import _parse_bytes
from .simulate_cli import _rate, _seconds


def parse_workers(text: str) -> list[int]:
    """'1,2,3,8', '1-256' (the powers of two from 1 to 256, both ends kept) or '2..8' (every
    count), or a mix: '1-64,96'."""
    out: set[int] = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            if ".." in item:
                lo, hi = (int(x) for x in item.split(".."))
                out.update(range(lo, hi + 1))
            elif "-" in item:
                lo, hi = (int(x) for x in item.split("-"))
                k = 1
                while k <= hi:
                    if k >= lo:
                        out.add(k)
                    k *= 2
                out.update((lo, hi))
            else:
                out.add(int(item))
        except ValueError:
            raise SystemExit(f"--workers {text!r}: give counts like 1,2,4,8, a range of powers "
                             "of two 1-256, or every count 2..8") from None
        if any(n < 1 for n in out) or (".." in item or "-" in item) and lo > hi:
            raise SystemExit(f"--workers {item!r}: counts are >= 1 and ranges go low to high")
    if not out:
        raise SystemExit("--workers: give at least one worker count")
    return sorted(out)


def _scale(args: argparse.Namespace) -> int:
    from .scale import MODELS, scaling_curve
    from .topology import Topology
    topology = Topology(bandwidth_bps=args.bandwidth, latency_s=args.latency,
                        gpus_per_node=args.gpus_per_node,
                        intra_bandwidth_bps=args.intra_bandwidth,
                        intra_latency_s=args.intra_latency, hierarchical=args.hierarchical,
                        traced_bandwidth_bps=args.traced_bandwidth)
    workers = parse_workers(args.workers)
    curve = scaling_curve(args.trace, workers, [s.strip() for s in args.schedule.split(",")],
                          topology=topology, batch_size=args.batch,
                          fusion_threshold=args.fusion_threshold,
                          compute_scale=args.compute_scale,
                          models=("replay",) if args.no_queueing else MODELS)
    base = args.out or os.path.join(args.trace if os.path.isdir(args.trace)
                                    else os.path.dirname(args.trace), "scaling")
    os.makedirs(os.path.dirname(os.path.abspath(base)), exist_ok=True)
    costs = ", ".join(f"{m} {s * 1e3:.1f} ms" for m, s in curve.cost_s.items())
    text = (f"# Throughput vs workers: {args.trace}\n\n{topology.describe()}; batch "
            f"{args.batch:g} per worker; computed in: {costs} "
            f"({len(workers)} worker counts x {len(curve.schedules)} schedules)\n\n"
            f"{curve.table()}\n\n![curve]({os.path.basename(base)}.png)\n")
    with open(base + ".json", "w") as fh:
        json.dump({"trace": args.trace, **curve.to_dict()}, fh, indent=2)
    with open(base + ".md", "w") as fh:
        fh.write(text)
    curve.plot(base + ".png")
    print(text)
    print(f"wrote {base}.json, {base}.md, {base}.png")
    return 0


def add_parser(sub: Any) -> None:
    sc = sub.add_parser("scale", help="throughput, speed-up and efficiency vs workers, "
                                      "replay and queueing model; table, JSON and PNG")
    sc.add_argument("trace", help="directory holding rank*.json (a trace of 1-2 ranks)")
    sc.add_argument("--workers", default="1-256",
                    help="worker counts: 1,2,4,8 / 1-256 (powers of two) / 2..8 (every one)")
    sc.add_argument("--schedule", default="planned,dear,ddp,wfbp,horovod",
                    help="comma-separated: planned (dear's default), dear, ddp, wfbp, horovod, "
                         "allreduce")
    sc.add_argument("--batch", type=float, default=1.0,
                    help="samples per worker and iteration (the traced batch)")
    sc.add_argument("--bandwidth", type=_rate, default=None,
                    help="inter-node link of each node, e.g. 25gbit (default: as traced)")
    sc.add_argument("--latency", type=_seconds, default=None,
                    help="inter-node per-step latency, e.g. 20us (default: as fitted)")
    sc.add_argument("--gpus-per-node", type=int, default=1,
                    help="workers per node sharing its link (default 1)")
    sc.add_argument("--intra-bandwidth", type=_rate, default=None,
                    help="link between GPUs of a node, e.g. 600gbit (with --gpus-per-node > 1)")
    sc.add_argument("--intra-latency", type=_seconds, default=None,
                    help="intra-node per-step latency (default: the inter-node one)")
    sc.add_argument("--hierarchical", action="store_true",
                    help="collectives in two levels (inside nodes, then between them) instead "
                         "of one flat ring")
    sc.add_argument("--traced-bandwidth", type=_rate, default=None,
                    help="the traced link's rate: each collective keeps its measured "
                         "efficiency on the new links instead of running at the link rate")
    sc.add_argument("--fusion-threshold", type=_parse_bytes, default=None,
                    help="bucket size, e.g. 25MB (default: as traced, else 25MB)")
    sc.add_argument("--compute-scale", type=float, default=1.0,
                    help="multiply compute times (e.g. 0.5 for a 2x faster accelerator)")
    sc.add_argument("--no-queueing", action="store_true", help="the replay only")
    sc.add_argument("--out", default="",
                    help="output prefix for .json/.md/.png (default: TRACE/scaling)")
    sc.set_defaults(run=_scale)
