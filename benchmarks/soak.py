"""Soak run: many iterations of a real training loop under dear, watching memory and drift.

The loop uses everything a real one does: Adam, torch.amp.GradScaler, clip_grad_norm_, an LR
schedule, dropout, an eval-mode forward and an atomic checkpoint now and then. Every `--every`
iterations each rank samples its resident memory (VmRSS) and the number of live Python objects,
and hashes its parameters (after flush_updates); the hashes are compared across ranks. A leak
shows as RSS or objects growing with the iteration count; drift as ranks' hashes differing. The
same loop on torch DDP (fresh processes) is the reference for what RSS does without dear.

    python -m benchmarks.soak [--nproc 2] [--iters 2000] [--every 100] [--methods dear,ddp]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dear
from benchmarks import cli, results
from benchmarks.launch import free_port, run_ranks


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def param_hash(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def slope_kb_per_iter(samples: list[tuple[int, float]]) -> float:
    """Least-squares slope of RSS (MB) against iteration, in kB per iteration."""
    n = len(samples)
    if n < 2:
        return 0.0
    mx = sum(i for i, _ in samples) / n
    my = sum(r for _, r in samples) / n
    var = sum((i - mx) ** 2 for i, _ in samples)
    return 1024 * sum((i - mx) * (r - my) for i, r in samples) / var


def rank_main(rank: int, args: argparse.Namespace, port: int, method: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dear.init()
    world = dear.size()
    model = build()
    net: torch.nn.Module = model
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if method == "dear":
        opt = dear.DistributedOptimizer(opt, model=model, fusion_threshold=args.fusion_threshold)
    else:
        net = torch.nn.parallel.DistributedDataParallel(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=500, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", growth_interval=200)
    torch.manual_seed(100 + rank)
    ckpt_dir = tempfile.mkdtemp(prefix="dear-soak-")
    len(gc.get_objects())                      # size the heap for the samples' object list
    rows, start_rss, skipped = [], rss_mb(), 0
    began = time.monotonic()
    for it in range(1, args.iters + 1):
        g = torch.Generator().manual_seed(it)
        mine = slice(rank * args.batch, (rank + 1) * args.batch)
        x = torch.randn(world * args.batch, 64, generator=g)[mine]
        y = torch.randint(0, 10, (world * args.batch,), generator=g)[mine]
        opt.zero_grad()
        scaler.scale(F.cross_entropy(net(x), y)).backward()
        if method == "dear":
            opt.clip_grad_norm_(1.0, grad_scaler=scaler)
        else:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before
        sched.step()
        if it % args.eval_every == 0:          # eval forward: applies pending updates
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()
        if it % args.ckpt_every == 0:
            dear.atomic_save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                              "scaler": scaler.state_dict(), "step": it},
                             os.path.join(ckpt_dir, f"rank{rank}.pt"))
        if it % args.every == 0:
            if method == "dear":
                opt.flush_updates()
            sample = (it, round(rss_mb(), 2), len(gc.get_objects()), param_hash(model))
            everyone = [None] * world
            dist.all_gather_object(everyone, sample)
            if rank == 0:
                rows.append({"iteration": it, "rss_mb": [s[1] for s in everyone],
                             "objects": [s[2] for s in everyone],
                             "hashes_equal": len({s[3] for s in everyone}) == 1,
                             "hash": everyone[0][3]})
                print(f"{method} iter {it}: RSS {rows[-1]['rss_mb']} MB, objects "
                      f"{rows[-1]['objects']}, hashes equal {rows[-1]['hashes_equal']}",
                      flush=True)
    elapsed = time.monotonic() - began
    starts = [None] * world
    dist.all_gather_object(starts, round(start_rss, 2))
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"samples": rows, "rss_before_training_mb": starts, "skipped": skipped,
                       "seconds": round(elapsed, 1)}, fh)
    dear.shutdown()


def summarize(args: argparse.Namespace, run: dict) -> list[dict]:
    rows, out = run["samples"], []
    for r in range(args.nproc):
        rss = [(s["iteration"], s["rss_mb"][r]) for s in rows]
        # Steady state: every code path (eval forward, checkpoint) has run at least once.
        steady = [p for p in rss if p[0] >= max(args.ckpt_every, args.eval_every, args.every)]
        out.append({"rank": r, "rss_before_training_mb": run["rss_before_training_mb"][r],
                    "rss_first_sample_mb": rss[0][1], "rss_end_mb": rss[-1][1],
                    "growth_mb": round(rss[-1][1] - rss[0][1], 2),
                    "steady_from": steady[0][0],
                    "steady_growth_mb": round(steady[-1][1] - steady[0][1], 2),
                    "slope_kb_per_iter": round(slope_kb_per_iter(steady), 4),
                    "objects_first": rows[0]["objects"][r], "objects_end": rows[-1]["objects"][r]})
    return out


def write(args: argparse.Namespace, runs: dict[str, dict]) -> None:
    summary_rows, data = [], {"args": vars(args)}
    for method, run in runs.items():
        per_rank = summarize(args, run)
        drift = [s["iteration"] for s in run["samples"] if not s["hashes_equal"]]
        data[method] = {**run, "per_rank": per_rank, "drift_at": drift}
        for p in per_rank:
            summary_rows.append([method, p["rank"], p["rss_before_training_mb"],
                                 p["rss_first_sample_mb"], p["rss_end_mb"], p["growth_mb"],
                                 p["steady_growth_mb"], p["slope_kb_per_iter"],
                                 f"{p['objects_first']} -> {p['objects_end']}",
                                 "none" if not drift else f"at {drift}", run["skipped"],
                                 run["seconds"]])
    headers = ["method", "rank", "RSS before training (MB)", f"RSS at iter {args.every} (MB)",
               f"RSS at iter {args.iters} (MB)", "growth (MB)",
               f"growth from iter {max(args.ckpt_every, args.eval_every, args.every)} (MB)",
               "steady slope (kB/iter)",
               "Python objects", "drift between ranks", "skipped steps", "seconds"]
    table = results.markdown_table(headers, summary_rows)
    dear_rows = runs.get("dear", next(iter(runs.values())))["samples"]
    samples = results.markdown_table(
        ["iteration"] + [f"RSS rank {r} (MB)" for r in range(args.nproc)] + ["hashes equal"],
        [[s["iteration"], *s["rss_mb"], s["hashes_equal"]] for s in dear_rows])
    notes = (f"{args.iters} iterations per method on {args.nproc} ranks (Gloo, loopback), each "
             f"method in fresh processes. Loop: Adam, GradScaler('cpu'), clipping at norm 1.0 "
             f"(dear: optimizer.clip_grad_norm_(grad_scaler=); DDP: scaler.unscale_ + "
             f"torch.nn.utils.clip_grad_norm_), StepLR, dropout, an eval forward every "
             f"{args.eval_every} and dear.atomic_save every {args.ckpt_every} iterations. "
             f"Parameter hashes (sha256 of every parameter's bytes) compared across ranks every "
             f"{args.every} iterations. Steady state (growth, slope by least squares): from "
             f"iteration "
             f"{max(args.ckpt_every, args.eval_every, args.every)}, once every code path (eval "
             f"forward, checkpoint) has run.\n\nSamples of the first method:\n\n{samples}")
    print(table)
    results.write(args.name, "Soak: memory and cross-rank parameter drift over a long run",
                  data, table, notes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_options(parser, nproc=2, methods="dear,ddp", iters=2000, name="soak", timeout=1800.0)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--ckpt-every", type=int, default=500)
    parser.add_argument("--fusion-threshold", type=int, default=64 * 1024)
    args = parser.parse_args(argv)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="dear-soak-") as tmp:
        for method in args.methods.split(","):
            out = os.path.join(tmp, f"{method}.json")
            if run_ranks(rank_main, args.nproc, (args, free_port(), method, out),
                         timeout=args.timeout):
                return 1
            with open(out) as fh:
                runs[method] = json.load(fh)
    write(args, runs)
    drift = {m: [s["iteration"] for s in r["samples"] if not s["hashes_equal"]]
             for m, r in runs.items()}
    if any(drift.values()):
        print(f"error: parameters drifted between ranks: {drift}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
