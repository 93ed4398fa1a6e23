"""`make demo`: DDP and DeAR side by side, where the gain can show.

As root (CI and these machines): the emulated accelerator on a shaped link (benchmarks/
emulated_bench.py, a short version of `make bench`'s emulated table: ResNet-50's real parameter
shapes on 2 ranks, each in its own network namespace behind a 1 Gbit/s link, layers that take
their share of the compute time), printed as each method's iteration time over T_lb =
max(T_compute, T_comm), the physical limit, with DDP's losses compared. About 1-2 minutes.

Without root (no network namespaces): one small model on 2 CPU ranks over loopback, the same
data with both, the loss trajectories compared; the time ratio is printed with one line on what
loopback can and cannot show (there is no network to hide there).

    python -m benchmarks.demo [--rounds N] [--loopback] [--nproc 2] [--iters 20] [--hidden 1024]

--rounds: each method this many times, interleaved (default 2 on the shaped link, 3 on loopback;
the suite runs 1, a check that the demo works rather than a measurement).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from benchmarks import cli
import torch.nn.functional as F

import dear


def build(hidden: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = [torch.nn.Linear(256, hidden), torch.nn.ReLU()]
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    mods.append(torch.nn.Linear(hidden, 10))
    return torch.nn.Sequential(*mods)


def data(step: int, rank: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(batch, 256, generator=g)
    return x, (x[:, :10].sum(1) > 0).long() + 2 * (x[:, 10:20].sum(1) > 0).long()


def train(method: str, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    rank = dear.rank()
    dear.comm.runtime.communicator().barrier()
    model = build(args.hidden, args.layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if method == "ddp":
        net: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(model)
    else:
        net = model
        opt = dear.DistributedOptimizer(opt, model=model)
    times, losses = [], []
    for step in range(args.iters):
        start = time.perf_counter()
        x, y = data(step, rank, args.batch)
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(dear.allreduce(loss.detach()).item())
    if method == "dear":
        opt.synchronize()
    return times, losses


def rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dear.init()
    load = os.getloadavg()[0]
    warm = min(5, args.iters // 4)
    medians: dict[str, list[float]] = {"ddp": [], "dear": []}
    worst = 0.0
    for r in range(args.rounds):                # alternate, so drift hits both alike
        order = ("ddp", "dear") if r % 2 == 0 else ("dear", "ddp")
        results = {m: train(m, args) for m in order}
        for method, (times, _) in results.items():
            medians[method].append(statistics.median(times[warm:]))
        worst = max(worst, max(abs(a - b) for a, b in zip(results["ddp"][1],
                                                           results["dear"][1])))
        final = {m: results[m][1][-1] for m in results}
    if rank == 0:
        print(f"{'method':<6} {'median iter (ms)':>17} {'per round (ms)':>24} {'final loss':>11}")
        for method in ("ddp", "dear"):
            rounds = " ".join(f"{1e3 * t:.1f}" for t in medians[method])
            print(f"{method:<6} {1e3 * statistics.median(medians[method]):>17.2f} "
                  f"{rounds:>24} {final[method]:>11.5f}")
        ratios = [d / p for d, p in zip(medians["dear"], medians["ddp"])]
        print(f"DeAR / DDP iteration time per round: {' '.join(f'{x:.2f}' for x in ratios)} "
              f"(load average {load:.1f} on {os.cpu_count()} cores at the start)")
        print("On loopback the 'network' is a memory copy made by the cores that compute: "
              "there is no link time for DeAR to hide, so these ratios say nothing about its "
              "speed either way (run as root for the shaped-link demo, or `make bench`); what "
              "this run shows is that both train the same model.")
        print(f"largest loss difference DDP vs DeAR over {args.rounds} x {args.iters} "
              f"iterations: {worst:.2e}")
        if worst > 1e-4:
            raise SystemExit("DeAR and DDP loss trajectories differ")
    dear.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_options(parser, nproc=2, iters=20, timeout=300.0)
    parser.add_argument("--rounds", type=int, default=None,
                        help=cli.HELP["rounds"] + " (default 2 on the shaped link, 3 on loopback)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--loopback", action="store_true",
                        help="the loopback demo even where a shaped link is possible")
    args = parser.parse_args(argv)
    from benchmarks.cluster import check_can_shape
    why = "--loopback given" if args.loopback else check_can_shape()
    if why is None:
        return shaped_link_demo(args.rounds or 2)
    args.rounds = args.rounds or 3
    print(f"demo: no shaped link ({why}); DDP and DeAR on loopback", flush=True)
    from benchmarks.launch import free_port, run_ranks
    return run_ranks(rank_main, args.nproc, (args, free_port()), timeout=args.timeout)


def shaped_link_demo(rounds: int) -> int:
    """ResNet-50's shapes on 2 ranks over a shaped 1 Gbit/s link: DDP and DeAR as ratios to
    T_lb, DeAR's losses against DDP's (the demo fails if they differ)."""
    from benchmarks import emulated_bench
    args = emulated_bench.parse_args(["--setups", "resnet50:2", "--methods", "ddp,dear",
                                      "--rounds", str(rounds), "--timeout", "400"])
    print("demo: ResNet-50's parameter shapes on 2 ranks, each behind a shaped 1 Gbit/s link "
          "(the emulated accelerator: layers take their share of the compute time)", flush=True)
    report = emulated_bench.run_setup("resnet50:2", args, shaping=True)
    t_lb = report["t_lb_s"]
    print(f"T_compute {report['t_compute_s'] * 1e3:.0f} ms, T_comm {report['t_comm_s'] * 1e3:.0f}"
          f" ms: the physical limit T_lb = max of the two = {t_lb * 1e3:.0f} ms")
    print(f"{'method':<6} {'iteration (ms)':>15} {'x T_lb':>8} {'losses vs DDP':>14}")
    for name in ("ddp", "dear"):
        m = report["methods"][name]
        same = "same" if m.get("loss_matches_ddp", True) else "DIFFER"
        print(f"{name:<6} {m['median_s'] * 1e3:>15.0f} {m['ratio_lb']:>8.2f} {same:>14}")
    dear_, ddp = report["methods"]["dear"], report["methods"]["ddp"]
    print(f"DeAR / DDP: {dear_['median_s'] / ddp['median_s']:.2f} (DDP waits for the link after "
          "backward; DeAR overlaps its reduce-scatters with backward and its all-gathers with "
          "the next forward)")
    if not dear_.get("loss_matches_ddp", False):
        raise SystemExit("DeAR and DDP loss trajectories differ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
