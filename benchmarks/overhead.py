"""Per-iteration framework overhead of DeAR vs DDP on a model with many small parameters.

500 x Linear(32, 32) (1000 parameter tensors, 2 MB of gradient): compute and communication are
tiny, so the iteration time is dominated by per-tensor bookkeeping (hooks, copies, launches).
`none` is one rank's forward+backward+update with no communication: the floor.

    python -m benchmarks.overhead [--nproc 2] [--layers 500] [--iters 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

import dear
from benchmarks import cli, results, timing
from benchmarks.launch import free_port, run_ranks
from benchmarks.methods import Built, parse_method


def build(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def time_method(method: str, args: argparse.Namespace) -> list[float]:
    built = Built(parse_method(method), build(args.layers, args.width),
                  lambda params: torch.optim.SGD(params, lr=1e-3))
    x = torch.randn(args.batch, args.width)
    times = timing.time_steps(built.net, built.opt, lambda step, rank: (x, x), F.mse_loss,
                              args.iters)
    built.finish()
    return times[args.iters // 4:]


def rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dear.init()
    medians: dict[str, list[float]] = {m: [] for m in ("none", "ddp", "dear")}
    for _ in range(args.rounds):                 # interleave methods: drift hits all alike
        for method in medians:
            medians[method].append(statistics.median(time_method(method, args)))
    if rank == 0:
        ms = {m: 1e3 * statistics.median(v) for m, v in medians.items()}
        rows = [[m, round(ms[m], 3), round(ms[m] - ms["none"], 3), round(ms[m] / ms["ddp"], 3)]
                for m in ms]
        headers = ["method", "median iteration (ms)", "overhead vs none (ms)", "ratio to DDP"]
        table = results.markdown_table(headers, rows)
        print(table)
        results.write(args.name, "Framework overhead: DeAR vs DDP, many small parameters",
                      {"args": vars(args), "median_ms": ms}, table,
                      f"{args.layers} x Linear({args.width},{args.width}), batch {args.batch}, "
                      f"{args.nproc} ranks on loopback (Gloo), median of {args.rounds} rounds "
                      f"of {args.iters} iterations (first quarter dropped).")
    dear.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_options(parser, nproc=2, rounds=3, iters=40, name="overhead", timeout=600.0)
    parser.add_argument("--layers", type=int, default=500)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    return run_ranks(rank_main, args.nproc, (args, free_port()), timeout=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
