"""torch.compile with DDP and with dear, side by side: graphs, graph breaks, recompiles, cold
compile and steady iteration time of a ResNet-18.

    python -m benchmarks.compile [--nproc 2] [--backend aot_eager|inductor] [--steps 20]
        [--width 16] [--batch 8] [--device cpu|cuda] [--name compile_resnet18]

Each mode runs in its own ranks (torchrun), so compile caches and dynamo counters start cold;
inductor's on-disk caches are pointed at a fresh directory per mode. `first_s` is the first
iteration (the cold compile), `steady_ms` the median of the iterations after the third, when
dear's layout is built and its all-gathers overlap the forward. With --device cuda each rank
needs a GPU of its own (NCCL); one GPU runs --nproc 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from benchmarks import cli
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                   nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b2(self.c2(F.relu(self.b1(self.c1(x)))))
        return F.relu(h + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        layers, cin = [], width
        for k, cout in enumerate([width, 2 * width, 4 * width, 8 * width]):
            layers += [Block(cin, cout, 1 if k == 0 else 2), Block(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


def _count_recompiles() -> list[int]:
    """Dynamo's own "Recompiling function" records (TORCH_LOGS=recompiles), counted."""
    import logging

    count = [0]

    class Counter(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "Recompiling function" in record.getMessage():
                count[0] += 1
    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(Counter())
    return count


def _rank(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.utils import counters
    torch.set_num_threads(1 if args.device == "cpu" else 4)
    graphs = [0]
    recompiles = _count_recompiles()

    def counting(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        graphs[0] += 1
        return lookup_backend(args.backend)(gm, inputs)

    device = torch.device(args.device)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    if args.mode == "ddp":
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        rank = dist.get_rank()
    else:
        import dear
        dear.init()
        rank = dear.rank()
    torch.manual_seed(0)
    model = ResNet18(args.width).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if args.mode == "ddp":
        net = torch.compile(torch.nn.parallel.DistributedDataParallel(model), backend=counting)
    else:
        net = torch.compile(model, backend=counting)
        opt = dear.DistributedOptimizer(opt, model=model)
    g = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(args.steps):
        x = torch.randn(args.batch, 3, 32, 32, generator=g).to(device)
        y = torch.randint(0, 10, (args.batch,), generator=g).to(device)
        if args.device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    steady = sorted(times[3:])
    out = {"mode": args.mode, "rank": rank, "graphs": graphs[0],
           "graph_breaks": sum(counters["graph_break"].values()),
           "recompiles": recompiles[0],
           "frames": counters["frames"].get("total", 0),
           "first_s": round(times[0], 3), "steady_ms": round(1e3 * steady[len(steady) // 2], 2)}
    if args.mode == "ddp":
        dist.destroy_process_group()
    else:
        dear.shutdown()
    print("RESULT " + json.dumps(out), flush=True)


def _launch(args: argparse.Namespace, mode: str) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS="1",
                   TRITON_CACHE_DIR=os.path.join(cache, "triton"))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
               str(args.nproc), "--master_addr", "127.0.0.1", "--master_port", str(args.port),
               "-m", "benchmarks.compile", "--rank-of", mode, "--backend", args.backend,
               "--steps", str(args.steps), "--width", str(args.width), "--batch",
               str(args.batch), "--device", args.device]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    found = [json.loads(line[7:]) for line in done.stdout.splitlines()
             if line.startswith("RESULT ")]
    if done.returncode != 0 or len(found) != args.nproc:
        raise RuntimeError(f"{mode} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return sorted(found, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_options(parser, nproc=2, name="", timeout=900.0)
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--port", type=int, default=29631)
    parser.add_argument("--rank-of", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        args.mode = args.rank_of
        _rank(args)
        return
    results = {mode: _launch(args, mode) for mode in ("ddp", "dear")}
    rows = [[m, r["rank"], r["graphs"], r["graph_breaks"], r["recompiles"], r["frames"],
             r["first_s"], r["steady_ms"]] for m in results for r in results[m]]
    ratio = {k: round(max(r[k] for r in results["dear"]) / max(r[k] for r in results["ddp"]), 3)
             for k in ("first_s", "steady_ms")}
    for row in rows:
        print(row)
    print("dear / DDP:", ratio)
    if args.name:
        from benchmarks.results import markdown_table, write
        table = markdown_table(["mode", "rank", "graphs", "graph breaks", "recompiles",
                                "frames", "first iteration (s)", "steady (ms)"], rows)
        print(write(args.name, "torch.compile: DDP vs dear", {"results": results,
                                                               "dear_over_ddp": ratio},
                    table, f"dear / DDP (slowest rank): {ratio}"))


if __name__ == "__main__":
    main()
