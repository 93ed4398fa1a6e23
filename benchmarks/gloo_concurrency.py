"""Do torch's Gloo all-reduces run one at a time or share the link? (dear.diagnose's `slots`)

DDP and WFBP issue one all-reduce per bucket and wait later. This times WFBP's buckets of a
model (dear's planner rule, gradient order) three ways, on the emulated cluster:

    concurrent   every bucket's all_reduce issued at once (async), then waited in order
    sequential   each bucket's all_reduce waited before the next is issued
    one          one all_reduce of all the bytes

and prints when each wait returned, next to dear.diagnose's replay of the same buckets on a
link that runs one collective at a time and on one that runs two at a time (torch's
ProcessGroupGloo has 2 worker threads). The link's rate is fitted from `one`.

    python -m benchmarks.cluster --nproc 2 --bandwidth 2gbit -- \\
        python -m benchmarks.gloo_concurrency --model vgg16 --scale 2 --name gloo_concurrency
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

from benchmarks import cli, emulated, results
from dear.diagnose.engine import replay
from dear.fusion.planner import plan_buckets


def _ends(fn) -> list[float]:
    dist.barrier()
    start = time.perf_counter()
    return [t - start for t in fn()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="vgg16")
    p.add_argument("--scale", type=int, default=2, help="parameters' first dimension / SCALE")
    p.add_argument("--threshold-mb", type=float, default=25.0)
    p.add_argument("--repeats", type=int, default=4)
    cli.add_options(p, name="gloo_concurrency")
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    model = emulated.EmulatedModel(emulated.spec(args.model, args.scale))
    params = list(model.parameters())
    specs = plan_buckets(params, list(reversed(range(len(params)))),
                         int(args.threshold_mb * 2**20), 1)
    bufs = [torch.ones(s.padded_numel) for s in specs]
    whole = torch.ones(sum(b.numel() for b in bufs))

    def concurrent() -> list[float]:
        works = [dist.all_reduce(b, async_op=True) for b in bufs]
        out = []
        for w in works:
            w.wait()
            out.append(time.perf_counter())
        return out

    def sequential() -> list[float]:
        out = []
        for b in bufs:
            dist.all_reduce(b)
            out.append(time.perf_counter())
        return out

    def one() -> list[float]:
        dist.all_reduce(whole)
        return [time.perf_counter()]

    runs: dict[str, list[list[float]]] = {"concurrent": [], "sequential": [], "one": []}
    for _ in range(args.repeats):                 # interleaved: drift hits all alike
        for name, fn in (("concurrent", concurrent), ("sequential", sequential), ("one", one)):
            runs[name].append(_ends(fn))
    if dist.get_rank() == 0:
        median = {k: [statistics.median(r[i] for r in v) for i in range(len(v[0]))]
                  for k, v in runs.items()}
        nbytes = [b.numel() * 4 for b in bufs]
        per_byte = median["one"][0] / sum(nbytes)
        progs = [[("issue", k) for k in range(len(bufs))] + [("wait", k) for k in range(len(bufs))]]
        replayed = {}
        for slots in (1, 2):
            comm = replay(progs, lambda k: nbytes[k] * per_byte, slots=slots).comm
            seen, out = 0.0, []
            for k in range(len(bufs)):                # a wait returns at max(its end, earlier)
                seen = max(seen, comm[k][1])
                out.append(seen)
            replayed[slots] = out
        rows = [[k, round(nbytes[k] / 2**20, 1), round(median["concurrent"][k] * 1e3),
                 round(replayed[2][k] * 1e3), round(median["sequential"][k] * 1e3),
                 round(replayed[1][k] * 1e3)] for k in range(len(bufs))]
        table = results.markdown_table(
            ["bucket", "MB", "concurrent: wait returned (ms)", "replay, 2 at a time",
             "sequential (ms)", "replay, 1 at a time"], rows)
        notes = (f"{args.model} / {args.scale}, {dist.get_world_size()} ranks, WFBP's buckets "
                 f"({args.threshold_mb:g} MB rule, gradient order); medians of {args.repeats} "
                 f"interleaved repeats; one all_reduce of all {sum(nbytes) / 2**20:.1f} MB: "
                 f"{median['one'][0] * 1e3:.0f} ms (the replay's rate). Totals: concurrent "
                 f"{median['concurrent'][-1] * 1e3:.0f} ms, sequential "
                 f"{median['sequential'][-1] * 1e3:.0f} ms.")
        print(table)
        print(notes)
        results.write(args.name, "Gloo all-reduces issued together share the link",
                      {"buckets_bytes": nbytes, "runs_s": runs, "median_s": median,
                       "replayed_s": replayed}, table, notes)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
