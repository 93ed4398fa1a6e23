"""Memory per rank with Adam: DDP, dear, dear with shard_optimizer_state, FSDP2
(reshard_after_forward=False) and torch's ZeroRedundancyOptimizer, on the real models' parameter
shapes (benchmarks/emulated.py: layers that sleep their compute share, so only memory is real).

Per rank, after a few training steps: the optimizer state's bytes (every state tensor this rank
holds), the communication buffers' bytes the method allocates beside parameters and gradients
(dear's buckets and shards: exact; DDP's buckets: its reducer holds one gradient-sized copy; FSDP2
and ZeRO: what their state and shards hold, not their transient buffers), and the process's
peak RSS growth from just before the method was set up. Each method runs in fresh processes.

    python -m benchmarks.memory --models resnet50,bert_base --ranks 2,4 --name memory_sharded
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
from typing import Any

from benchmarks import cli

METHODS = ("ddp", "dear", "dear-sharded", "fsdp2", "zero")
# dear's planned schedule plans after 2 iterations here (DEAR_PLAN_AFTER) and checks after 2
# more; with sharding its chunks then carry shards updated early in backward, whose state is
# saved until step() keeps the update: the steps after that are what the peak includes.
STEPS, PLAN_AFTER = 8, 2


def _tensor_bytes(obj: Any) -> int:
    import torch
    if isinstance(obj, torch.Tensor):
        t = obj.to_local() if hasattr(obj, "to_local") else obj
        return t.numel() * t.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _rank(rank: int, world: int, port: int, model_name: str, method: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      DEAR_PLAN_AFTER=str(PLAN_AFTER))
    import torch
    import torch.distributed as dist

    import dear
    from benchmarks import emulated, timing
    from benchmarks.methods import Built, parse_method
    torch.set_num_threads(1)
    dear.init()
    model = emulated.EmulatedModel(emulated.spec(model_name))
    params = sum(p.numel() for p in model.parameters())
    start = _current_rss_mb()
    adam = lambda p: torch.optim.Adam(p, lr=1e-4, foreach=False)   # noqa: E731
    built = Built(parse_method(method), model, adam)
    timing.train_loop(built.net, built.opt, lambda step, r: emulated.make_batch(step, r, 4),
                      emulated.loss_fn, STEPS, 0, barrier=False)
    saved = 0
    if built.is_dear:
        built.opt.flush_updates()
        stats = built.opt.memory_stats()
        buffers, state, saved = stats["buffers"], stats["state"], stats["peak_saved"]
    elif method == "zero":                    # DDP's buckets + this rank's share of the state
        buffers, state = params * 4, _tensor_bytes(list(built.opt.optim.state.values()))
    else:                                     # DDP: the reducer's one gradient-sized copy
        buffers = params * 4 if method == "ddp" else 0
        state = _tensor_bytes(list(built.opt.state.values()))
    row = {"model": model_name, "ranks": world, "method": method, "params": params,
           "state_mb": state / 2**20, "buffers_mb": buffers / 2**20,
           "saved_mb": saved / 2**20,
           "rss_growth_mb": _rss_mb() - start}
    with open(os.path.join(out, f"{rank}.json"), "w") as fh:
        json.dump(row, fh)
    dist.barrier()
    dear.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


def measure(model: str, world: int, method: str) -> list[dict[str, Any]]:
    from benchmarks.launch import free_port, run_ranks
    with tempfile.TemporaryDirectory() as out:
        code = run_ranks(_rank, world, (world, free_port(), model, method, out), timeout=600)
        if code:
            raise RuntimeError(f"{method} on {model} x{world} failed")
        return [json.load(open(os.path.join(out, f"{r}.json"))) for r in range(world)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet50,bert_base")
    p.add_argument("--ranks", default="2,4")
    cli.add_options(p, methods=",".join(METHODS), name="")
    args = p.parse_args(argv)
    rows = []
    for model in args.models.split(","):
        for world in (int(w) for w in args.ranks.split(",")):
            for method in args.methods.split(","):
                ranks = measure(model, world, method)
                worst = max(ranks, key=lambda r: r["rss_growth_mb"])
                row = {**worst, **{k: max(r[k] for r in ranks)
                                   for k in ("state_mb", "buffers_mb", "saved_mb")}}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.name:
        from benchmarks.results import markdown_table, write
        table = markdown_table(
            ["model", "ranks", "method", "optimizer state (MB, largest rank)",
             "state saved for early updates (MB, peak)", "communication buffers (MB)",
             "peak RSS growth (MB, largest rank)"],
            [[r["model"], r["ranks"], r["method"], f"{r['state_mb']:.0f}",
              f"{r['saved_mb']:.0f}", f"{r['buffers_mb']:.0f}", f"{r['rss_growth_mb']:.0f}"]
             for r in rows])
        print(write(args.name, "Memory per rank with Adam", {"rows": rows}, table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
