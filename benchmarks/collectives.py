"""Reduce-scatter and all-gather time against all-reduce time, on one fp32 buffer.

An ideal reduce-scatter or all-gather moves half the bytes of an all-reduce (ring or pairwise),
so each should take about 0.5 x the all-reduce; DeAR's schedule pays off only if they do (the
target is <= 0.6 x). Measured per buffer size, methods interleaved in every repeat so that drift
on a shared machine hits all alike:

    all_reduce        torch.distributed.all_reduce (the reference: what DDP pays)
    native_rs         torch's reduce_scatter_tensor (Gloo's own)
    native_ag         torch's all_gather_into_tensor (Gloo's own)
    dear_rs           dear's TorchCommunicator.reduce_scatter (pairwise exchange on Gloo)
    dear_ag           dear's TorchCommunicator.all_gather (pairwise exchange on Gloo)
    dear_rs_1group    the same two on one Gloo group: a TorchCommunicator over an explicit
    dear_ag_1group    group gets no twin group, so both directions share one transport thread

A figure is, per repeat, the slowest rank's time from issue to wait() (after a barrier); the
table gives the median, interquartile range and minimum over repeats, and each method's ratio to
all_reduce: of the medians, the median of per-repeat ratios (robust to drift), of the minima.

    python -m benchmarks.collectives [--sizes-mb 100 25] [--world-size 2] [--repeats 5]
                                     [--name collectives]

Without RANK/WORLD_SIZE/MASTER_ADDR in the environment it spawns --world-size ranks on loopback.
With them (an external launcher, e.g. ranks in network namespaces joined by a shaped link; set
GLOO_SOCKET_IFNAME there) it runs as that one rank; rank 0 prints and writes the results.

--backend horovod measures Horovod's own collectives instead (Gloo on CPU), launched by Horovod:

    python -m benchmarks.cluster --nproc 2 --no-shaping --horovod -- \
        python -m benchmarks.collectives --backend horovod --name collectives_horovod

    all_reduce        hvd.allreduce_async_ (Sum): what hvd.DistributedOptimizer pays
    hvd_rs            hvd.reducescatter_async (Sum)
    hvd_ag            hvd.allgather_async
    dear_rs           dear's HorovodCommunicator.reduce_scatter on its default data plane
    dear_ag           (DEAR_HOROVOD_DATA_PLANE=gloo): the pairwise exchange on private Gloo groups
    dear_rs_hvd       the same on DEAR_HOROVOD_DATA_PLANE=horovod: alltoall + local sum,
    dear_ag_hvd       and hvd.allgather_async + copy
    gloo_all_reduce   all_reduce on the Gloo data plane's own group (Gloo's ring), for scale
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import warnings
from typing import Callable

import torch
import torch.distributed as dist

from benchmarks import cli, results
from benchmarks.launch import free_port, run_ranks
from dear.comm.torch_dist import TorchCommunicator

METHODS = ("all_reduce", "native_rs", "native_ag", "dear_rs", "dear_ag", "dear_rs_1group",
           "dear_ag_1group")
HOROVOD_METHODS = ("all_reduce", "hvd_rs", "hvd_ag", "dear_rs", "dear_ag", "dear_rs_hvd",
                   "dear_ag_hvd", "gloo_all_reduce")
_MB = 1024 * 1024


def _operations(numel: int, world: int, comm: TorchCommunicator,
                one_group: TorchCommunicator) -> dict[str, Callable[[], None]]:
    """One callable per method: issue the collective and wait for it. Buffers are made once."""
    numel -= numel % world
    full = torch.rand(numel, generator=torch.Generator().manual_seed(comm.rank))
    work = full.clone()                         # all_reduce is in place: keep `full` intact
    shard = torch.empty(numel // world)
    gathered = torch.empty(numel)
    group = comm.group

    def all_reduce() -> None:
        dist.all_reduce(work, group=group, async_op=True).wait()

    def native_rs() -> None:
        dist.reduce_scatter_tensor(shard, full, group=group, async_op=True).wait()

    def native_ag() -> None:
        dist.all_gather_into_tensor(gathered, shard, group=group, async_op=True).wait()

    def dear_rs() -> None:
        comm.reduce_scatter(full, shard).wait()

    def dear_ag() -> None:
        comm.all_gather(shard, gathered).wait()

    def dear_rs_1group() -> None:
        one_group.reduce_scatter(full, shard).wait()

    def dear_ag_1group() -> None:
        one_group.all_gather(shard, gathered).wait()

    return {"all_reduce": all_reduce, "native_rs": native_rs, "native_ag": native_ag,
            "dear_rs": dear_rs, "dear_ag": dear_ag, "dear_rs_1group": dear_rs_1group,
            "dear_ag_1group": dear_ag_1group}


def _time_once(op: Callable[[], None], barrier: Callable[[], None]) -> float:
    barrier()
    start = time.perf_counter()
    op()
    return time.perf_counter() - start


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


class _Backend:
    """What the timing loop needs from a backend: its methods, their operations per buffer
    size, a barrier, and an element-wise max over ranks."""

    methods: tuple[str, ...]

    def operations(self, numel: int) -> dict[str, Callable[[], None]]:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def max_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _TorchBackend(_Backend):
    methods = METHODS

    def __init__(self) -> None:
        self.comm = TorchCommunicator(gloo_collectives="pairwise")
        self.one_group = TorchCommunicator(dist.new_group(list(range(self.comm.size))),
                                           gloo_collectives="pairwise")
        self.world = self.comm.size

    def operations(self, numel: int) -> dict[str, Callable[[], None]]:
        return _operations(numel, self.world, self.comm, self.one_group)

    def barrier(self) -> None:
        dist.barrier(group=self.comm.group)

    def max_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.comm.group)
        return tensor

    def close(self) -> None:
        self.comm.shutdown()


class _HorovodBackend(_Backend):
    methods = HOROVOD_METHODS

    def __init__(self) -> None:
        from dear.comm.horovod import DataPlane, HorovodCommunicator
        import horovod.torch as hvd
        self.hvd = hvd
        hvd.init()
        self.comm = HorovodCommunicator(data_plane=DataPlane.GLOO)
        self.hvd_plane = HorovodCommunicator(data_plane=DataPlane.HOROVOD)
        self.world = self.comm.size
        self._count = 0

    def _name(self) -> str:
        self._count += 1
        return f"bench.{self._count}"

    def operations(self, numel: int) -> dict[str, Callable[[], None]]:
        hvd, world = self.hvd, self.world
        numel -= numel % world
        full = torch.rand(numel, generator=torch.Generator().manual_seed(self.comm.rank))
        work = full.clone()
        shard = torch.empty(numel // world)
        gathered = torch.empty(numel)
        return {
            "all_reduce": lambda: hvd.synchronize(
                hvd.allreduce_async_(work, op=hvd.Sum, name=self._name())),
            "hvd_rs": lambda: hvd.synchronize(
                hvd.reducescatter_async(full, op=hvd.Sum, name=self._name())),
            "hvd_ag": lambda: hvd.synchronize(hvd.allgather_async(shard, name=self._name())),
            "dear_rs": lambda: self.comm.reduce_scatter(full, shard).wait(),
            "dear_ag": lambda: self.comm.all_gather(shard, gathered).wait(),
            "dear_rs_hvd": lambda: self.hvd_plane.reduce_scatter(full, shard).wait(),
            "dear_ag_hvd": lambda: self.hvd_plane.all_gather(shard, gathered).wait(),
            "gloo_all_reduce": lambda: self.comm._gloo.forward.allreduce([work]).wait(),
        }

    def barrier(self) -> None:
        self.hvd.barrier()

    def max_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        every = self.hvd.allgather(tensor.unsqueeze(0), name=self._name())
        return every.amax(dim=0)

    def close(self) -> None:
        self.comm.shutdown()
        self.hvd_plane.shutdown()


def measure(args: argparse.Namespace,
            backend: _Backend) -> dict[str, dict[str, dict[str, float]]]:
    """Run on every rank; return {size: {method: figures}} (slowest rank per repeat)."""
    methods = backend.methods
    out: dict[str, dict[str, dict[str, float]]] = {}
    for size_mb in args.sizes_mb:
        ops = backend.operations(int(size_mb * _MB) // 4)
        for _ in range(args.warmup):
            for name in methods:
                _time_once(ops[name], backend.barrier)
        mine = torch.zeros(args.repeats, len(methods), dtype=torch.float64)
        for r in range(args.repeats):
            for k in range(len(methods)):          # rotate the order: no method always first
                m = (r + k) % len(methods)
                mine[r, m] = _time_once(ops[methods[m]], backend.barrier)
        mine = backend.max_over_ranks(mine)
        figures = {}
        for m, name in enumerate(methods):
            times = mine[:, m].tolist()
            q1, q3 = _quartiles(times)
            figures[name] = {"median_s": statistics.median(times), "q1_s": q1, "q3_s": q3,
                             "iqr_s": q3 - q1, "times_s": times}
        ref = figures["all_reduce"]
        for fig in figures.values():
            fig["min_s"] = min(fig["times_s"])
            fig["ratio_to_all_reduce"] = fig["median_s"] / ref["median_s"]
            # Paired within a repeat (methods run back to back), so drift largely cancels.
            fig["median_paired_ratio"] = statistics.median(
                t / r for t, r in zip(fig["times_s"], ref["times_s"]))
            fig["ratio_of_minima"] = fig["min_s"] / ref["min_s"]
        out[f"{size_mb:g}"] = figures
        del ops
    return out


def report(args: argparse.Namespace, world: int, data: dict, load: tuple) -> None:
    horovod = args.backend == "horovod"
    headers = ["size (MB)", "method", "median (s)", "IQR (s)", "min (s)",
               "ratio to all_reduce (medians)", "median paired ratio", "ratio of minima"]
    rows = []
    for size, figures in data.items():
        for name, f in figures.items():
            rows.append([size, name, round(f["median_s"], 4), round(f["iqr_s"], 4),
                         round(f["min_s"], 4), round(f["ratio_to_all_reduce"], 3),
                         round(f["median_paired_ratio"], 3), round(f["ratio_of_minima"], 3)])
    table = results.markdown_table(headers, rows)
    print(table)
    verdicts = []
    for size, figures in data.items():
        for name in (HOROVOD_METHODS[1:-1] if horovod else ("dear_rs", "dear_ag")):
            ratio = figures[name]["ratio_to_all_reduce"]
            verdicts.append(f"{size} MB {name}: {ratio:.3f} x all_reduce (medians; paired "
                            f"{figures[name]['median_paired_ratio']:.3f}) "
                            f"({'meets' if ratio <= 0.6 else 'MISSES'} the <= 0.6 target)")
    print("\n".join(verdicts))
    what = ("Horovod 0.28.1 over Gloo (HOROVOD_CPU_OPERATIONS=gloo)" if horovod
            else "torch.distributed Gloo")
    notes = (f"Load average (1 min) {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after. "
             f"{world} ranks, {what}, fp32, torch.set_num_threads(1) per rank, "
             f"{args.warmup} warm-up round(s), {args.repeats} repeats; methods interleaved in "
             f"each repeat, in an order rotated from repeat to repeat. A figure is the slowest "
             f"rank's issue-to-wait() time after a barrier; median, IQR and minimum over "
             f"repeats. 'ratio to all_reduce' divides medians; 'median paired ratio' is the "
             f"median over repeats of the method's time over the all_reduce time of the same "
             f"repeat. " + ("hvd_*: Horovod's own reducescatter / allgather; dear_rs/dear_ag: "
                            "dear's Horovod backend on its default data plane (pairwise "
                            "exchange on private Gloo groups); dear_*_hvd: on "
                            "DEAR_HOROVOD_DATA_PLANE=horovod (reduce-scatter = alltoall + local "
                            "sum); gloo_all_reduce: Gloo's all-reduce on the data plane's group. "
                            if horovod else
                            "dear_*_1group: dear's exchange on one Gloo group (no twin group), "
                            "for comparison. ")
             + "Ideal ratio 0.5, target <= 0.6. The machine may be shared with "
             "other work (see the load average): timings are noisy, compare ratios from one "
             "run.\n\n" + "\n".join(f"- {v}" for v in verdicts))
    results.write(args.name, "Collectives: reduce-scatter and all-gather vs all-reduce",
                  {"args": vars(args), "world_size": world, "executable": sys.executable,
                   "master_addr": os.environ.get("MASTER_ADDR"),
                   "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
                   "loadavg_before": load, "loadavg_after": os.getloadavg(),
                   "results": data}, table, notes)


def rank_main(rank: int, args: argparse.Namespace, port: int | None) -> None:
    if port is not None:                       # spawned by us on loopback
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(args.world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    if args.backend == "horovod":
        backend: _Backend = _HorovodBackend()
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
        backend = _TorchBackend()
    try:
        load = os.getloadavg()
        data = measure(args, backend)
        if backend.comm.rank == 0:
            report(args, backend.world, data, load)
    finally:
        backend.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def launched_externally() -> bool:
    return all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[100.0])
    parser.add_argument("--world-size", type=int, default=2,
                        help="ranks to spawn (ignored when launched externally)")
    parser.add_argument("--repeats", type=int, default=5)
    cli.add_options(parser, warmup=1, name="collectives", timeout=1200.0)
    parser.add_argument("--backend", choices=("torch", "horovod"), default="torch",
                        help="horovod: Horovod's collectives, under a Horovod launcher")
    args = parser.parse_args(argv)
    if argv is None and __spec__ is not None:  # run with -m: record the command as typed
        sys.argv[0:1] = ["-m", __spec__.name]
    if launched_externally():
        rank_main(int(os.environ["RANK"]), args, None)
        return 0
    if args.backend == "horovod":
        parser.error("--backend horovod runs under a Horovod launcher: python -m "
                     "benchmarks.cluster --nproc 2 --no-shaping --horovod -- python -m "
                     "benchmarks.collectives --backend horovod")
    return run_ranks(rank_main, args.world_size, (args, free_port()), timeout=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
