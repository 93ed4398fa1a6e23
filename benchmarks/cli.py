"""Command-line options every benchmark shares, spelled and explained once.

    parser = argparse.ArgumentParser(...)
    cli.add_options(parser, methods="ddp,dear", rounds=3, warmup=2, iters=6, name="x")

Each keyword adds its option with that default (None: the benchmark has no such option).
"""

from __future__ import annotations

import argparse
from typing import Optional

HELP = {
    "methods": "NAME[:KEY=VALUE...],... (benchmarks/methods.py: ddp, fsdp2, horovod, zero, "
               "allreduce, wfbp, dear and its options)",
    "rounds": "repeat every method this many times, interleaved (order rotated each round), so "
              "a machine that slows down mid-run slows every method alike",
    "warmup": "iterations run and dropped before timing (dear's planned schedule may need more: "
              "it plans after DEAR_PLAN_AFTER iterations and checks as many after)",
    "iters": "timed iterations per method and round",
    "name": "write benchmarks/results/<name>.{json,md} (and .png where there is a chart)",
    "timeout": "seconds before the ranks are killed",
    "nproc": "ranks",
}


def add_options(parser: argparse.ArgumentParser, *, methods: Optional[str] = None,
                rounds: Optional[int] = None, warmup: Optional[int] = None,
                iters: Optional[int] = None, name: Optional[str] = None,
                timeout: Optional[float] = None, nproc: Optional[int] = None,
                shaping: bool = False) -> argparse.ArgumentParser:
    """The shared options with these defaults; shaping: --no-shaping (loopback, no root)."""
    if nproc is not None:
        parser.add_argument("--nproc", type=int, default=nproc, help=HELP["nproc"])
    if methods is not None:
        parser.add_argument("--methods", default=methods, help=HELP["methods"])
    for key, value in (("rounds", rounds), ("warmup", warmup), ("iters", iters)):
        if value is not None:
            parser.add_argument(f"--{key}", type=int, default=value, help=HELP[key])
    if name is not None:
        parser.add_argument("--name", default=name, help=HELP["name"])
    if timeout is not None:
        parser.add_argument("--timeout", type=float, default=timeout, help=HELP["timeout"])
    if shaping:
        parser.add_argument("--no-shaping", action="store_true",
                            help="loopback: no network namespaces, no shaped link, no root")
    return parser
