"""One benchmark run: every method trains the same model on the same data, side by side.

Run on each rank (by `benchmarks.cluster`, torchrun, or alone with --spawn N on loopback):

    python -m benchmarks.cluster --nproc 2 --bandwidth 1gbit -- \
        python -m benchmarks.train --model resnet50 --methods ddp,fsdp2,wfbp,dear

Per method: warm-up iterations dropped, then timed iterations (median, IQR, samples/s). In the
same run: T_compute (each rank alone, no communication: forward, backward, update) and T_comm
(the fastest measured way to all-reduce the whole gradient: torch's all_reduce, or dear's
reduce-scatter + all-gather), next to the link-rate bound 2(N-1)/N x bytes / bandwidth.
T_lb = max(T_compute, T_comm); every method is reported as a ratio to T_lb and to DDP. A method
whose loss trajectory differs from DDP's is refused, not reported. With --rounds R, T_compute and
every method are measured R times, interleaved, in an order rotated each round: on a shared
machine whose speed drifts by tens of percent within minutes, this keeps the ratios honest.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

import dear
from benchmarks import cli, results, timing
from benchmarks import models as bench_models
from benchmarks.methods import Built, parse_method, parse_methods
from tqdm import tqdm

LOSS_RTOL = 1e-3


def workload(args: argparse.Namespace) -> tuple[Callable[[], torch.nn.Module],
                                                 Callable[[torch.nn.Module], list[torch.nn.Module]],
                                                 Callable[[int, int], Any],
                                                 Callable[[Any, Any], torch.Tensor]]:
    """(build model, its blocks for FSDP2, batch(step, rank) -> (inputs, targets), loss)."""
    w = bench_models.build(args.model, batch_size=args.batch, **_knobs(args))

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return w.make_model()

    def batch(step: int, rank: int) -> Any:
        return w.make_batch(torch.Generator().manual_seed(1000 * step + rank))

    return build, w.blocks, batch, w.loss


def _knobs(args: argparse.Namespace) -> dict[str, Any]:
    knobs = {}
    if args.image_size:
        knobs["image_size"] = args.image_size
    if args.seq_len:
        knobs["seq_len"] = args.seq_len
    return knobs


def make_sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def run_method(method: str, args: argparse.Namespace, build: Callable, blocks: Callable,
               batch: Callable, loss_fn: Callable) -> tuple[list[float], list[float]]:
    """Train a fresh copy with `method`: (timed iteration times after warm-up, every loss)."""
    built = Built(parse_method(method), build(), make_sgd, blocks)
    run = timing.train_loop(built.net, built.opt, batch, loss_fn, args.warmup, args.iters,
                            after_backward=built.clip)
    built.finish()
    return run.times["total"], run.losses


def summarize(timed: list[float], losses: list[float], args: argparse.Namespace) -> dict[str, Any]:
    median = timing.slowest_median(timed)
    q1, _, q3 = timing.quartiles(timed)
    return {"median_s": median, "q1_s": q1, "q3_s": q3, "losses": losses,
            "samples_per_s": args.batch * dist.get_world_size() / median}


def measure_compute(args: argparse.Namespace, build: Callable, batch: Callable,
                    loss_fn: Callable) -> list[float]:
    """Every rank trains alone at once (same core load as the real run): timed iterations."""
    model = build()
    return timing.time_steps(model, make_sgd(model.parameters()), batch, loss_fn,
                             args.warmup + args.iters)[args.warmup:]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    cli.add_options(parser, methods="ddp,fsdp2,allreduce,wfbp,dear", rounds=1, warmup=3, iters=10,
                    name="")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=0)
    parser.add_argument("--comm-repeats", type=int, default=3)
    parser.add_argument("--spawn", type=int, default=0,
                        help="start this many local ranks on loopback (no launcher needed)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.spawn:
        from benchmarks.launch import free_port, run_ranks
        return run_ranks(_spawned, args.spawn, (args, free_port()), timeout=3600)
    return run(args)


def _spawned(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.spawn), LOCAL_RANK=str(rank))
    run(args)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    # torch.distributed for every method; Horovod too when its launcher set it up.
    dist.init_process_group("gloo")
    dear.init(backend="torch")
    rank, world = dear.rank(), dear.size()
    build, blocks, batch, loss_fn = workload(args)
    methods = [m.label for m in parse_methods(args.methods)]   # a typo fails here
    probe = build()
    numel = sum(p.numel() for p in probe.parameters())
    del probe
    comm = timing.measure_comm(numel, args.comm_repeats)
    t_comm = min(comm.values())
    measured_bw = float(os.environ.get("BENCH_CLUSTER_BANDWIDTH_MEASURED", "0"))
    link_bound = (2 * (world - 1) / world * numel * 4 * 8 / measured_bw) if measured_bw else None
    for method in parse_methods(args.methods):
        if method.uses_horovod and "HOROVOD_RANK" not in os.environ:
            raise SystemExit(f"method {method.label!r} needs Horovod's launcher: run under "
                             "benchmarks.cluster --horovod or horovodrun")
    compute_times: list[float] = []
    timed: dict[str, list[float]] = {m: [] for m in methods}
    first_losses: dict[str, list[float]] = {}
    progress = tqdm(total=args.rounds * (len(methods) + 1), desc="methods", disable=rank != 0,
                    leave=False)
    for r in range(args.rounds):
        progress.set_postfix_str(f"round {r + 1} compute")
        compute_times += measure_compute(args, build, batch, loss_fn)
        progress.update()
        shift = r % len(methods)
        for method in methods[shift:] + methods[:shift]:
            progress.set_postfix_str(f"round {r + 1} {method}")
            times, losses = run_method(method, args, build, blocks, batch, loss_fn)
            timed[method] += times
            first = first_losses.setdefault(method, losses)
            if max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, first)) > LOSS_RTOL:
                raise SystemExit(f"{method}: round {r + 1} trained to other losses than round 1 "
                                 f"({losses} vs {first}); refusing to report it")
            progress.update()
    progress.close()
    t_compute = timing.slowest_median(compute_times)
    t_lb = max(t_compute, t_comm)
    rows: list[list[Any]] = []
    report = {m: summarize(timed[m], first_losses[m], args) for m in methods}
    ref = report.get("ddp", {}).get("losses")
    for method, res in report.items():
        if ref is not None:
            worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(res["losses"], ref))
            res["loss_matches_ddp"] = worst <= LOSS_RTOL
            res["loss_rel_diff"] = worst
        ratio_ddp = res["median_s"] / report["ddp"]["median_s"] if "ddp" in report else None
        res.update(ratio_lb=res["median_s"] / t_lb, ratio_ddp=ratio_ddp)
        rows.append([method, round(res["median_s"] * 1e3, 1),
                     f"{res['q1_s'] * 1e3:.0f}-{res['q3_s'] * 1e3:.0f}",
                     round(res["samples_per_s"], 2), round(res["ratio_lb"], 3),
                     round(ratio_ddp, 3) if ratio_ddp else "-",
                     "ok" if res.get("loss_matches_ddp", True) else "REFUSED (loss differs)"])
    dear.shutdown()
    dist.destroy_process_group()
    if rank == 0:
        headers = ["method", "median iter (ms)", "IQR (ms)", "samples/s", "x T_lb", "x DDP",
                   "loss vs DDP"]
        table = results.markdown_table(headers, rows)
        limits = (f"T_compute {t_compute * 1e3:.1f} ms; T_comm {t_comm * 1e3:.1f} ms "
                  f"(all_reduce {comm['all_reduce'] * 1e3:.1f}, dear rs+ag "
                  f"{comm['rs_ag'] * 1e3:.1f}); link bound "
                  f"{'%.1f ms' % (link_bound * 1e3) if link_bound else 'n/a (no shaping)'}; "
                  f"T_lb {t_lb * 1e3:.1f} ms; gradient {numel * 4 / 2**20:.1f} MB, {world} ranks")
        print(table)
        print(limits)
        if args.name:
            results.write(args.name, f"{args.model}: DeAR vs baselines", {
                "args": vars(args), "t_compute_s": t_compute, "t_comm_s": comm,
                "link_bound_s": link_bound, "t_lb_s": t_lb,
                "bandwidth_measured_bps": measured_bw or None,
                "congestion": os.environ.get("BENCH_CLUSTER_CONGESTION"), "methods": report},
                table, limits)
    return 0


if __name__ == "__main__":
    sys.exit(main())
