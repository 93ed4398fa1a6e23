"""What dear's edit checks cost on a GPU: one rank, one GPU, a real training iteration.

    python -m benchmarks.gpu_edit_checks [--models resnet50,bert_base] [--iters 30]
        [--warmup 10] [--name gpu_edit_checks]

dear reads every gradient and every parameter (two sums each on a GPU, dear/guards/written.py) to
refuse writes it could not honour. On the CPU-emulated accelerator those reads are host work
the emulated device waits for; here they are kernels beside a real forward, backward and
update. Each variant runs in its own process (a world of one, torchrun's variables):
  torch        the plain torch optimizer, no dear;
  dear         dear.DistributedOptimizer as users get it (C++ hooks);
  dear_py      DEAR_NATIVE=0 (Python hooks), the reference for the next two;
  dear_py_sums dear_py with the two torch sums per CUDA tensor that dear used before its CUDA
               digest (an experiment, not an option of dear);
  dear_py_off  dear_py with every fingerprint a constant (an experiment): the checks' floor.
Times are the median over the timed iterations of one synchronized iteration each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

VARIANTS = {
    "torch": {},
    "dear": {},
    "dear_py": {"DEAR_NATIVE": "0"},
    "dear_py_sums": {"DEAR_NATIVE": "0", "DEAR_EXPERIMENT_GPU_SUMS": "1"},
    "dear_py_off": {"DEAR_NATIVE": "0", "DEAR_EXPERIMENT_NO_FINGERPRINTS": "1"},
}
# benchmarks.models' workloads at their default knobs (ResNet-50 batch 32 at 224 px, BERT-Base
# batch 32 x 128 tokens), BERT-Base with dropout as in fine-tuning.
KNOBS: dict[str, dict[str, Any]] = {"resnet50": {}, "bert_base": {"dropout": 0.1}}


def _no_fingerprints() -> None:
    """The checks' floor: every fingerprint the same constant."""
    import dear.engine.engine
    import dear.engine.steps
    import dear.sharding.state
    import dear.guards.written

    def constant(tensors: Any) -> list[int]:
        return [0] * len(tensors)
    for module in (dear.guards.written, dear.engine.engine, dear.engine.steps, dear.sharding.state):
        module.fingerprints = constant         # type: ignore[attr-defined]
    dear.guards.written.fingerprint = dear.engine.engine.fingerprint = (  # type: ignore
        lambda tensor: 0)


def _gpu_sums() -> None:
    """dear/guards/written.py as before the CUDA digest: an extension without digests_cuda."""
    import types

    import dear.guards.written
    ext = dear.native.extension()
    assert ext is not None
    stripped = types.SimpleNamespace(digests=ext.digests)
    dear.guards.written._native = types.SimpleNamespace(  # type: ignore[assignment]
        extension=lambda: stripped)


def _workload(name: str, device: str) -> tuple[torch.nn.Module, Any, Any]:
    from benchmarks import models
    workload = models.build(name, **KNOBS.get(name, {}))
    x, y = workload.make_batch(torch.Generator().manual_seed(0))
    return workload.make_model().to(device), x.to(device), y.to(device)


def run_variant(variant: str, names: list[str], warmup: int, iters: int) -> dict[str, Any]:
    """In the variant's own process: each model's median synchronized iteration (ms)."""
    import dear
    if os.environ.get("DEAR_EXPERIMENT_NO_FINGERPRINTS") == "1":
        _no_fingerprints()
    if os.environ.get("DEAR_EXPERIMENT_GPU_SUMS") == "1":
        _gpu_sums()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if variant != "torch":
        dear.init()
    out: dict[str, Any] = {}
    for name in names:
        model, x, y = _workload(name, device)
        opt: Any = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        if variant != "torch":
            opt = dear.DistributedOptimizer(opt, model=model)
        times = []
        for step in range(warmup + iters):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            if device == "cuda":
                torch.cuda.synchronize()
            if step >= warmup:
                times.append(time.perf_counter() - t0)
        out[name] = 1e3 * statistics.median(times)
        if variant != "torch":
            opt.flush_updates()
        del model, opt
    if variant != "torch":
        dear.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnet50,bert_base")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--name", default="gpu_edit_checks")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = args.models.split(",")
    if args.child:
        print("RESULT " + json.dumps(run_variant(args.child, names, args.warmup, args.iters)))
        return
    ms: dict[str, dict[str, float]] = {}
    for variant in args.variants.split(","):
        env = {**os.environ, **VARIANTS[variant], "RANK": "0", "WORLD_SIZE": "1",
               "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(29400 + len(ms))}
        proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_edit_checks", "--child",
                               variant, "--models", args.models, "--warmup",
                               str(args.warmup), "--iters", str(args.iters)],
                              env=env, capture_output=True, text=True, timeout=600)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            sys.exit(f"{variant} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        ms[variant] = json.loads(line[-1][len("RESULT "):])
        print(variant, ms[variant], flush=True)
    from benchmarks import models, results
    rows = [[v] + [f"{ms[v][n]:.2f}" for n in names]
            + [f"{ms[v][n] / ms['torch'][n]:.3f}" if "torch" in ms else "" for n in names]
            for v in ms]
    table = results.markdown_table(["variant"] + [f"{n} (ms)" for n in names]
                                   + [f"{n} / torch" for n in names], rows)
    print(table)
    knobs = {n: {**models.REGISTRY[n][1], **KNOBS.get(n, {})} for n in names}
    print(results.write(args.name, "dear's edit checks on a GPU (one rank)",
                        {"ms": ms, "knobs": knobs, "warmup": args.warmup, "iters": args.iters},
                        table))


if __name__ == "__main__":
    main()
