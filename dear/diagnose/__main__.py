"""python -m dear.diagnose report|simulate|scale TRACE_DIR [...] | hang [DIR]"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional


def _report(args: argparse.Namespace) -> int:
    from .plot import plot_timeline
    from .report import build_report, format_report
    report = build_report(args.trace, top=args.top)
    print(format_report(report))
    png = args.png or os.path.join(args.trace if os.path.isdir(args.trace)
                                   else os.path.dirname(args.trace), "timeline.png")
    print(f"\ntimeline: {plot_timeline(args.trace, png)}")
    return 0


def _hang(args: argparse.Namespace) -> int:
    from ..comm.hang import show
    print(show(args.directory))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dear.diagnose",
                                     description="Read and replay dear.diagnose traces.")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="per-iteration compute, communication and overlap; "
                                        "a PNG timeline")
    rep.add_argument("trace", help="directory holding rank*.json (or one rank's file)")
    rep.add_argument("--png", default="", help="timeline image (default: TRACE/timeline.png)")
    rep.add_argument("--top", type=int, default=5, help="how many slowest layers and buckets")
    rep.set_defaults(run=_report)
    hang = sub.add_parser("hang", help="the reports written when a collective failed: which "
                                       "rank did not issue it, what each rank last issued")
    hang.add_argument("directory", help="DEAR_HANG_REPORT's directory (default: the temporary "
                                        "directory's dear-hang/), or one job's folder in it")
    hang.set_defaults(run=_hang)
    from .simulate_cli import add_parser as add_simulate
    add_simulate(sub)
    from .scale_cli import add_parser as add_scale
    add_scale(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
