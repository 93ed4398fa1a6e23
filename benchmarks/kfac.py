"""dear.KFAC benchmarks: iteration time of distributed K-FAC variants, and convergence on digits.

    make kfac-bench      # all of it: emulated 2-node cluster (root; else loopback) + digits
    python -m benchmarks.cluster --nproc 2 --bandwidth 1gbit -- python -m benchmarks.kfac \
        iteration --model resnet --methods sgd,spd,dear-sync,dear-overlap --rounds 3 \
        --name kfac.dear
    python -m benchmarks.cluster --nproc 2 --bandwidth 1gbit -- \
        python -m benchmarks.kfac iteration --model resnet --inv-freqs 1,10 --name kfac
    python -m benchmarks.kfac convergence        # one process, sklearn's digits
    python -m benchmarks.cluster --nproc 2 --bandwidth 1gbit -- \
        python -m benchmarks.kfac collectives    # reduce-to-owner implementations

Iteration methods (gradients averaged by torch DDP in every method, SGD with momentum):
  sgd     no preconditioning
  naive   D-KFAC: full factors all-reduced after backward, each factor decomposed by one rank
          (LPT, no redundancy) and the decompositions broadcast; every rank preconditions all
  spd     SPD-KFAC: factors all-reduced from the hooks as buckets fill, upper triangles only,
          LPT with small factors decomposed redundantly, decompositions broadcast (comm-opt)
  pad     PAD-KFAC: factors (upper triangles, from the hooks) REDUCED to the layer's owner,
          owners are contiguous blocks (DP); owners precondition and broadcast the gradient
  mem-opt factors all-reduced, LPT owners precondition and broadcast (KAISA's MEM-OPT)
  dear-sync     SPD with gradients averaged by dear.DistributedOptimizer, Horovod's loop
                (synchronize(); precond.step(); step() in skip_synchronize()): the all-gathers
                complete before preconditioning
  dear-overlap  the same with the plain loop (backward(); precond.step(); step()): between
                decompositions, preconditioning in the eigenbasis on DeAR's reduced shards and
                the all-gathers overlapped with the next forward (dear/kfac/overlap.py)
Timing: mean over whole inverse intervals (a median would skip the inverse steps).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks import models as bench_models
from benchmarks import cli, results, timing

KFAC_ARGS = dict(lr=0.1, damping=0.003, factor_decay=0.95, kl_clip=0.001)
METHODS: dict[str, dict[str, Any]] = {
    "naive": dict(strategy="comm-opt", pipeline_factors=False, symmetry_aware=False,
                  redundancy=False),
    "spd": dict(strategy="comm-opt"),
    "pad": dict(strategy="pad"),
    "mem-opt": dict(strategy="mem-opt"),
    "dear-sync": dict(strategy="comm-opt"),
    "dear-overlap": dict(strategy="comm-opt"),
}


# ----------------------------------------------------------------- digits (convergence)

def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """sklearn's bundled digits (no download): 1437 train / 360 test, fixed permutation."""
    from sklearn.datasets import load_digits
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return x[360:], y[360:], x[:360], y[:360]


def digits_model(arch: str) -> nn.Module:
    if arch == "mlp":
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(256, 10))


def train_digits(arch: str, kfac: bool, lr: float = 0.05, batch: int = 256, epochs: int = 30,
                 seed: int = 0, target: float = 0.97, stop_at_target: bool = True,
                 **kfac_args: Any) -> dict[str, Any]:
    """SGD (momentum 0.9, cosine lr over `epochs`) with or without dear.KFAC (whose lr follows
    the same schedule). Returns the first epoch reaching `target` test accuracy (None if not
    reached), the wall time to it, and the accuracy after each epoch."""
    from dear.kfac import KFAC
    xtr, ytr, xte, yte = digits()
    torch.manual_seed(seed)
    model = digits_model(arch)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs * -(-len(ytr) // batch))
    args = {**KFAC_ARGS, "inv_update_freq": 10, **kfac_args}
    precond = KFAC(model, **{**args, "lr": lambda step: sched.get_last_lr()[0]}) if kfac else None
    hit, accs, start = None, [], time.perf_counter()
    for epoch in range(epochs):
        order = torch.randperm(len(ytr), generator=torch.Generator().manual_seed(epoch))
        model.train()
        for i in range(0, len(ytr), batch):
            idx = order[i:i + batch]
            opt.zero_grad()
            F.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            if precond is not None:
                precond.step()
            opt.step()
            sched.step()
        model.eval()
        with torch.no_grad():
            accs.append((model(xte).argmax(1) == yte).float().mean().item())
        if hit is None and accs[-1] >= target:
            hit = (epoch + 1, time.perf_counter() - start)
            if stop_at_target:
                break
    return {"epochs": hit[0] if hit else None, "seconds": hit[1] if hit else None,
            "accuracy": accs, "total_seconds": time.perf_counter() - start}


def convergence(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.kfac convergence")
    p.add_argument("--seeds", default="0,1,2,3")
    p.add_argument("--batches", default="64,256")
    p.add_argument("--lrs", default="0.05,0.1")
    cli.add_options(p, name="kfac.convergence")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows, data = [], []
    for arch in ("mlp", "cnn"):
        for batch in map(int, args.batches.split(",")):
            for lr in map(float, args.lrs.split(",")):
                for seed in map(int, args.seeds.split(",")):
                    sgd = train_digits(arch, False, lr, batch, seed=seed)
                    kfac = train_digits(arch, True, lr, batch, seed=seed, damping=0.03)
                    data.append({"arch": arch, "batch": batch, "lr": lr, "seed": seed,
                                 "sgd": sgd, "kfac": kfac})
                    rows.append([arch, batch, lr, seed, _epochs(sgd), _epochs(kfac)])
                    print(rows[-1], flush=True)
    table = results.markdown_table(
        ["model", "batch", "lr (cosine, 30 epochs)", "seed", "SGD: epochs to 97% (wall)",
         "K-FAC: epochs to 97% (wall)"], rows)
    notes = ("SGD momentum 0.9; K-FAC damping 0.03, kl_clip 0.001, factor_decay 0.95, "
             "inv_update_freq 10, its lr following the same cosine schedule. One thread.")
    results.write(args.name, "K-FAC vs SGD on sklearn digits", {"runs": data}, table, notes)
    print(table)
    return 0


def _epochs(run: dict[str, Any]) -> str:
    return f"{run['epochs']} ({run['seconds']:.2f} s)" if run["epochs"] else "not in 30"


# ----------------------------------------------------------------- iteration time

def bench_model(name: str) -> tuple[Callable[[], nn.Module], Callable[[int, int], Any]]:
    """CPU-sized ResNet-50 layout (width 16) and BERT (4 layers, hidden 256)."""
    if name == "resnet":
        make = functools.partial(bench_models.ResNet, [3, 4, 6, 3], num_classes=100, width=16)
        sample = bench_models._images(32, 100)
        batch = 16
    elif name == "bert":
        cfg = bench_models.BertConfig(vocab_size=4096, hidden=256, layers=4, heads=4, ffn=1024,
                                      max_positions=128, num_labels=2, dropout=0.0)
        make = functools.partial(bench_models.Bert, cfg)
        sample = bench_models._tokens(64, cfg.vocab_size, 2)
        batch = 8
    else:
        raise ValueError(f"unknown model {name!r}: resnet or bert")
    return make, lambda step, rank: sample(batch, torch.Generator().manual_seed(1000 * step + rank))


def _launcher_note() -> str:
    """How the ranks were started (results.command() only sees this rank's argv)."""
    requested = os.environ.get("BENCH_CLUSTER_BANDWIDTH_REQUESTED")
    measured = os.environ.get("BENCH_CLUSTER_BANDWIDTH_MEASURED")
    if requested:
        return (f"Ranks started by `python -m benchmarks.cluster --nproc {dist.get_world_size()} "
                f"--bandwidth {float(requested) / 1e9:g}gbit -- <command>`; link measured "
                f"{float(measured or 0) / 1e9:.3g} Gbit/s one way (TCP).")
    return f"{dist.get_world_size()} ranks on loopback (no shaping)."


class _SkipSynchronize:
    """Horovod's loop: step() after the gradients were synchronized by hand."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self) -> None:
        with self.opt.skip_synchronize():
            self.opt.step()


def _time_method(method: str, inv_freq: int, make: Callable[[], nn.Module],
                 batch: Callable[[int, int], Any], warmup: int, intervals: int) -> dict[str, Any]:
    import dear
    from dear.kfac import KFAC
    torch.manual_seed(0)
    with_dear = method.startswith("dear-")
    if with_dear:
        dear.init()                            # reuses this process group
        model = make()
        opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01,
                                                        momentum=0.9), model=model)
    else:
        model = nn.parallel.DistributedDataParallel(make())
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    precond = None
    if method != "sgd":
        precond = KFAC(model, inv_update_freq=inv_freq, **KFAC_ARGS, **METHODS[method])
    iters = intervals * inv_freq if inv_freq > 1 else intervals
    pre_times: list[float] = []

    def precondition() -> None:               # between backward and step(), timed apart
        begin = time.perf_counter()
        if method == "dear-sync":
            opt.synchronize()
        if precond is not None:
            precond.step()
        pre_times.append(time.perf_counter() - begin)

    run = timing.train_loop(model, _SkipSynchronize(opt) if method == "dear-sync" else opt,
                            batch, F.cross_entropy, warmup, iters, after_backward=precondition)
    if with_dear:
        overlapped = precond.overlapped_steps if precond is not None else 0
        dear.shutdown()                        # applies the last pending update
    timed = run.times["total"]
    slowest = torch.tensor([statistics.mean(timed)])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    pre = pre_times[warmup:]                   # the backward phase includes precondition()
    out = {"mean_s": slowest.item(), "median_s": statistics.median(timed),
           "forward_mean_s": statistics.mean(run.times["forward"]),
           "backward_mean_s": statistics.mean(b - p for b, p in zip(run.times["backward"], pre)),
           "precond_mean_s": statistics.mean(pre), "losses": run.losses}
    if with_dear:
        out["overlapped_steps"] = overlapped
    if precond is not None:
        out["plan"] = {"strategy": precond.plan.strategy.value,
                       "estimates": precond.plan.estimates,
                       "owners": list(precond.plan.layer_owner)}
    return out


def iteration(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.kfac iteration")
    p.add_argument("--model", default="resnet")
    p.add_argument("--methods", default="sgd,naive,spd,pad")
    p.add_argument("--inv-freqs", default="1,10")
    cli.add_options(p, rounds=1, warmup=2, name="")
    p.add_argument("--intervals", type=int, default=4,
                   help="timed iterations: this many (freq 1) or this many inverse intervals")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    make, batch = bench_model(args.model)
    freqs = [int(f) for f in args.inv_freqs.split(",")]
    runs = [(m, f) for f in freqs for m in args.methods.split(",")
            if m != "sgd" or f == freqs[0]]          # SGD has no inverse frequency: once
    rounds: dict[str, list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        shift = r % len(runs)
        for method, freq in runs[shift:] + runs[:shift]:
            res = _time_method(method, freq, make, batch, args.warmup, args.intervals)
            key = method if method == "sgd" else f"{method}@{freq}"
            rounds.setdefault(key, []).append(res)
            if rank == 0:
                print(f"{args.model} round {r + 1} {key}: {res['mean_s'] * 1e3:.0f} "
                      f"ms/iteration (forward {res['forward_mean_s'] * 1e3:.0f}, backward "
                      f"{res['backward_mean_s'] * 1e3:.0f}, precond.step "
                      f"{res['precond_mean_s'] * 1e3:.0f} ms)", flush=True)
    report = {key: _median_round(results) for key, results in rounds.items()}
    if rank == 0:
        rows = []
        for key, res in report.items():
            freq = key.split("@")[1] if "@" in key else "-"
            naive = report.get(f"naive@{freq}")
            speedup = naive["mean_s"] / res["mean_s"] if naive else None
            rows.append([args.model, key.split("@")[0], freq, round(res["mean_s"] * 1e3, 1),
                         round(res["precond_mean_s"] * 1e3, 1),
                         round(speedup, 3) if speedup else "-",
                         round(report["sgd"]["mean_s"] / res["mean_s"], 3) if "sgd" in report
                         else "-"])
        table = results.markdown_table(
            ["model", "method", "inv_update_freq", "mean iteration (ms)", "precond.step (ms)",
             "speed-up vs naive", "speed vs SGD"], rows)
        pairs = _per_round_ratios(rounds)
        if pairs:
            table += "\n\n" + pairs
        print(table)
        if args.name:
            bw = os.environ.get("BENCH_CLUSTER_BANDWIDTH_MEASURED")
            results.write(args.name, f"dear.KFAC iteration time, {args.model}", {
                "args": vars(args), "world": dist.get_world_size(), "kfac_args": KFAC_ARGS,
                "bandwidth_measured_bps": float(bw) if bw else None, "methods": report,
                "rounds": rounds},
                table, "Mean over the timed iterations of the slowest rank (with --rounds, the "
                "median over rounds of it); factor updates every iteration. Gradients averaged "
                "by torch DDP, except in dear-sync and dear-overlap "
                "(dear.DistributedOptimizer). " + _launcher_note())
    dist.destroy_process_group()
    return 0


def _median_round(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median mean iteration time (its other figures with it)."""
    ordered = sorted(results, key=lambda res: res["mean_s"])
    return {**ordered[(len(ordered) - 1) // 2], "round_means_s": [r["mean_s"] for r in results]}


def _per_round_ratios(rounds: dict[str, list[dict[str, Any]]]) -> str:
    """dear-sync / dear-overlap iteration time within each round (same machine state)."""
    lines = []
    for key, syncs in rounds.items():
        if not key.startswith("dear-sync@"):
            continue
        overlaps = rounds.get(key.replace("dear-sync", "dear-overlap"))
        if not overlaps:
            continue
        ratios = [s["mean_s"] / o["mean_s"] for s, o in zip(syncs, overlaps)]
        lines.append(f"- inv_update_freq {key.split('@')[1]}: dear-sync / dear-overlap "
                     f"iteration time per round {[round(x, 3) for x in ratios]}, median "
                     f"{statistics.median(ratios):.3f}")
    return "\n".join(lines)


# ----------------------------------------------------------------- reduce implementations

def collectives(argv: list[str]) -> int:
    """Two 10 MB reduces to different roots (what PAD does on 2 ranks): Gloo's dist.reduce vs
    dear.kfac's direct sends, next to one 20 MB all-reduce and a 10 MB each-way exchange."""
    from dear.kfac.comm import Transport
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    transport = Transport.from_environment()
    numel = 10 * 2**18
    halves = [torch.ones(numel), torch.ones(numel)]
    full = torch.ones(2 * numel)

    def timed(fn: Callable[[], None], reps: int = 5) -> float:
        fn()
        out = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
        return statistics.median(out)

    def gloo_reduce() -> None:
        for w in [dist.reduce(halves[r], dst=r, async_op=True) for r in range(2)]:
            w.wait()

    def kfac_reduce() -> None:
        for w in [transport.reduce(halves[r], r) for r in range(2)]:
            w.wait()

    figures = {"all_reduce 20 MB": timed(lambda: dist.all_reduce(full)),
               "2 x dist.reduce 10 MB (roots 0, 1)": timed(gloo_reduce),
               "2 x dear.kfac reduce 10 MB (roots 0, 1)": timed(kfac_reduce),
               "2 x broadcast 10 MB (roots 0, 1)": timed(
                   lambda: [w.wait() for w in [transport.broadcast(halves[r], r)
                                                for r in range(2)]])}
    if dist.get_rank() == 0:
        table = results.markdown_table(["collective (2 ranks, fp32)", "median s"],
                                       [[k, round(v, 4)] for k, v in figures.items()])
        print(table)
        results.write("kfac.collectives", "Reduce to owners: Gloo's reduce vs direct sends",
                      {"seconds": figures}, table, _launcher_note())
    dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------- make kfac-bench

def everything(argv: list[str]) -> int:
    """Iteration time of both models on the emulated cluster (loopback without root), then
    convergence on digits; each writes its own results file."""
    p = argparse.ArgumentParser(prog="benchmarks.kfac")
    p.add_argument("--bandwidth", default="1gbit")
    cli.add_options(p, shaping=True)
    args = p.parse_args(argv)
    shaping = [] if not args.no_shaping and os.geteuid() == 0 else ["--no-shaping"]
    status = 0
    with_dear = ["--methods", "sgd,spd,dear-sync,dear-overlap", "--rounds", "3"]
    for extra in (["collectives"], ["iteration", "--model", "resnet", "--name", "kfac"],
                  ["iteration", "--model", "bert", "--name", "kfac.bert"],
                  ["iteration", "--model", "resnet", *with_dear, "--name", "kfac.dear"],
                  ["iteration", "--model", "bert", *with_dear, "--name", "kfac.dear.bert"]):
        cmd = [sys.executable, "-m", "benchmarks.cluster", "--nproc", "2", "--bandwidth",
               args.bandwidth, *shaping, "--timeout", "3000", "--",
               sys.executable, "-m", "benchmarks.kfac", *extra]
        print("+", " ".join(cmd), flush=True)
        status |= subprocess.call(cmd)
    return status | convergence([])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"iteration": iteration, "convergence": convergence, "collectives": collectives}
    if argv and argv[0] in commands:
        return commands[argv[0]](argv[1:])
    return everything(argv)


if __name__ == "__main__":
    sys.exit(main())
