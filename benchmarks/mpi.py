"""dear's MPI backend against the Gloo pairwise exchange, on the emulated cluster.

    python -m benchmarks.mpi --nproc 2 --bandwidth 1gbit [--sizes-mb 100 25] [--repeats 5]
        [--model resnet50 --batch 8 --image-size 96 --iters 8] [--progress thread|none]
        [--no-shaping] [--name mpi]

Launch: MPICH's mpiexec (hydra, from the `mpich` wheel) runs in rank 0's network namespace with
`-launcher manual`, which prints the command of each host's proxy instead of starting it; each
proxy is started in its rank's namespace (pinned to one core), so every MPI byte crosses the
shaped link, as Gloo's do. MPI's transport: UCX over TCP on the rank's veth
(UCX_TLS=tcp,self, UCX_NET_DEVICES; MPIR_CVAR_NOLOCAL=1: no shared memory between "hosts").
torch.distributed's Gloo group for the pairwise exchange starts from mpiexec's variables
(dear/comm/launch.py), GLOO_SOCKET_IFNAME on the same veth.

Collectives (one fp32 buffer per size, methods interleaved and rotated in every repeat, each
figure the slowest rank's time from issue to wait() after a barrier; median of repeats):

    gloo_all_reduce   torch.distributed.all_reduce on Gloo (what DDP pays on CPU)
    gloo_rs, gloo_ag  dear's backend "torch": the pairwise exchange (isend/irecv on 2 groups)
    mpi_all_reduce    MPI_Iallreduce through dear's MPI communicator
    mpi_rs, mpi_ag    MPI_Ireduce_scatter_block, MPI_Iallgather (dear's backend "mpi")

Ratios: each reduce-scatter and all-gather over the all-reduce of its own library (target
<= 0.55: an ideal one moves half the bytes), as the median of per-repeat ratios.

Training: dear.DistributedOptimizer on backend "torch", on backend "mpi" and on backend "mpi"
without its progress thread (DEAR_MPI_PROGRESS=none: MPI moves data only inside wait()), same
model, data and seed, --iters timed iterations after --warmup, --rounds rounds with the backends
interleaved; in the last round --trace more iterations under dear.diagnose, whose report gives
the share of communication hidden behind compute (the overlap ratio).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional

from benchmarks import cli

_MB = 1024 * 1024
METHODS = ("gloo_all_reduce", "gloo_rs", "gloo_ag", "mpi_all_reduce", "mpi_rs", "mpi_ag")
RATIOS = (("gloo_rs", "gloo_all_reduce"), ("gloo_ag", "gloo_all_reduce"),
          ("mpi_rs", "mpi_all_reduce"), ("mpi_ag", "mpi_all_reduce"),
          ("mpi_all_reduce", "gloo_all_reduce"))


# ------------------------------------------------------------------------------ launcher
def _mpiexec() -> str:
    path = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    path = path if os.path.exists(path) else (shutil.which("mpiexec") or "")
    if not path:
        raise SystemExit("benchmarks.mpi needs mpiexec: pip install mpich mpi4py (make setup)")
    return path


def launch(args: argparse.Namespace, rank_argv: list[str]) -> int:
    from benchmarks.cluster import EmulatedCluster, _free_port
    n = args.nproc
    with EmulatedCluster(n, args.bandwidth, shaping=not args.no_shaping,
                         pin=not args.no_pin) as cluster:
        env = {"MASTER_ADDR": cluster.addr(0), "MASTER_PORT": str(_free_port() if
                                                                  args.no_shaping else 29500),
               "UCX_TLS": "tcp,self", "MPIR_CVAR_NOLOCAL": "1", "OMP_NUM_THREADS": "1",
               "BENCH_MPI_IFNAMES": ",".join(cluster.ifname(r) for r in range(n)),
               "BENCH_ARGV": shlex.join(sys.argv), "DEAR_MPI_PROGRESS": args.progress}
        if not args.no_shaping:
            bps = cluster.measure_bandwidth()
            env["BENCH_CLUSTER_BANDWIDTH_MEASURED"] = f"{bps:.0f}"
            env["BENCH_CLUSTER_BANDWIDTH_REQUESTED"] = f"{cluster.shape.rate_bps:.0f}"
            print(f"mpi: link measured at {bps / 1e9:.3f} Gbit/s", flush=True)
        rank_cmd = [sys.executable, "-m", "benchmarks.mpi", "--rank", *rank_argv]
        genv = [a for k, v in env.items() for a in ("-genv", k, v)]
        if args.no_shaping:
            cmd = [_mpiexec(), "-n", str(n), *genv, *rank_cmd]
            proc = cluster._popen(0, cmd, env={**os.environ, **env})
            return _wait(proc, cluster, args.timeout)
        hosts = ",".join(cluster.addr(r) for r in range(n))
        cmd = [_mpiexec(), "-launcher", "manual", "-hosts", hosts, "-n", str(n),
               "-localhost", cluster.addr(0), *genv, *rank_cmd]
        proc = cluster._popen(0, cmd, env={**os.environ, **env}, stdout=subprocess.PIPE,
                              text=True)
        proxies = []
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("HYDRA_LAUNCH_END"):
                break
            if line.startswith("HYDRA_LAUNCH:"):
                proxies.append(shlex.split(line[len("HYDRA_LAUNCH:"):]))
        if len(proxies) != n:
            raise SystemExit(f"mpiexec printed {len(proxies)} proxy commands, expected {n}")
        cores = sorted(os.sched_getaffinity(0))
        for rank, proxy in enumerate(proxies):
            pin = ["taskset", "-c", str(cores[rank % len(cores)])] if not args.no_pin else []
            cluster._popen(rank, pin + proxy)
        return _wait(proc, cluster, args.timeout, forward=True)


def _wait(proc: subprocess.Popen, cluster: Any, timeout: float, forward: bool = False) -> int:
    deadline = time.monotonic() + timeout
    if forward:
        import threading

        def pump() -> None:
            for line in proc.stdout:          # type: ignore[union-attr]
                print(line, end="", flush=True)
        threading.Thread(target=pump, daemon=True).start()
    while proc.poll() is None:
        if time.monotonic() > deadline:
            print(f"mpi: still running after {timeout:.0f} s; killing", file=sys.stderr)
            return 124
        time.sleep(0.2)
    return int(proc.returncode)


# ----------------------------------------------------------------------------- rank body
def _prepare_rank() -> int:
    """Before MPI starts (mpi4py's import): this rank's interface for UCX and Gloo."""
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    names = [x for x in os.environ.get("BENCH_MPI_IFNAMES", "").split(",") if x]
    if names and names[rank] != "lo":
        os.environ["GLOO_SOCKET_IFNAME"] = names[rank]
        os.environ["UCX_NET_DEVICES"] = names[rank]
    return rank


def _time(op: Callable[[], None], barrier: Callable[[], None]) -> float:
    barrier()
    start = time.perf_counter()
    op()
    return time.perf_counter() - start


def collectives(args: argparse.Namespace, gloo: Any, mpi: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    n, me = gloo.size, gloo.rank
    out: dict[str, Any] = {}
    for mb in args.sizes_mb:
        numel = int(mb * _MB / 4)
        numel -= numel % n
        full = torch.rand(numel, generator=torch.Generator().manual_seed(me))
        work = full.clone()
        shard = torch.empty(numel // n)
        gathered = torch.empty(numel)
        ops = {
            "gloo_all_reduce": lambda: dist.all_reduce(work, async_op=True).wait(),
            "gloo_rs": lambda: gloo.reduce_scatter(full, shard).wait(),
            "gloo_ag": lambda: gloo.all_gather(shard, gathered).wait(),
            "mpi_all_reduce": lambda: mpi.all_reduce(work).wait(),
            "mpi_rs": lambda: mpi.reduce_scatter(full, shard).wait(),
            "mpi_ag": lambda: mpi.all_gather(shard, gathered).wait(),
        }
        for op in ops.values():                      # warm-up: connections, buffers
            op()
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        for rep in range(args.repeats):
            order = METHODS[rep % len(METHODS):] + METHODS[:rep % len(METHODS)]
            for m in order:
                t = torch.tensor([_time(ops[m], dist.barrier)], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)   # the slowest rank's time
                times[m].append(float(t))
        medians = {m: statistics.median(v) for m, v in times.items()}
        ratios = {f"{a}/{b}": statistics.median(x / y for x, y in zip(times[a], times[b]))
                  for a, b in RATIOS}
        out[f"{mb:g}"] = {"times": times, "median": medians, "ratios": ratios}
        if me == 0:
            print(f"mpi: {mb:g} MB " + " ".join(f"{m}={medians[m]:.3f}s" for m in METHODS)
                  + " | " + " ".join(f"{k}={v:.3f}" for k, v in ratios.items()), flush=True)
    return out


def training(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    from benchmarks import models as bench_models
    knobs: dict[str, Any] = {"batch_size": args.batch}
    if args.image_size:
        knobs["image_size"] = args.image_size
    w = bench_models.build(args.model, **knobs)
    out: dict[str, Any] = {}
    backends = args.backends.split(",")
    for rnd in range(args.rounds):
        # Backends interleaved, the order rotated each round: drift on a shared machine hits
        # every backend alike.
        order = backends[rnd % len(backends):] + backends[:rnd % len(backends)]
        for backend in order:
            last = rnd == args.rounds - 1
            entry = _train_once(args, w, backend, trace=args.trace if last else 0)
            acc = out.setdefault(backend, {"name": entry["name"], "round_medians_s": [],
                                           "times": [], "losses": entry["losses"]})
            acc["round_medians_s"].append(entry["median_s"])
            acc["times"].append(entry["times"])
            if "trace" in entry:
                acc["trace"] = entry["trace"]
            if dist.get_rank() == 0:
                tr = entry.get("trace", {})
                print(f"mpi: round {rnd} train {backend} ({entry['name']}) "
                      f"{entry['median_s']:.3f} s/iter"
                      + (f", traced overlap {tr['overlap']:.2f} (comm {tr['comm_s']:.3f} s, "
                         f"exposed {tr['exposed_s']:.3f} s, compute {tr['compute_s']:.3f} s)"
                         if tr else ""), flush=True)
    for backend, acc in out.items():
        acc["median_s"] = statistics.median(acc["round_medians_s"])
    if "torch" in out and "mpi" in out:
        out["mpi_over_torch_per_round"] = [m / t for m, t in zip(out["mpi"]["round_medians_s"],
                                                                   out["torch"]["round_medians_s"])]
    return out


def _train_once(args: argparse.Namespace, w: Any, backend: str, trace: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import dear
    if backend == "mpi-noprogress":            # MPI moving data only inside wait()
        dear.init(backend="mpi", timeout=600, mpi_progress="none")
    else:
        dear.init(backend=backend, timeout=600)
    torch.manual_seed(0)
    model = w.make_model()
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                    named_parameters=model.named_parameters(), model=model)
    rank = dear.rank()
    times, losses = [], []
    trace_dir = tempfile.mkdtemp(prefix=f"dear-mpi-trace-{backend}-")
    total = args.warmup + args.iters
    tracer = None
    for step in range(total + trace):
        x, y = w.make_batch(torch.Generator().manual_seed(1000 * step + rank))
        if step == args.warmup:
            dist.barrier()
        if step == total and trace:
            tracer = dear.diagnose.trace(model, opt, out=trace_dir, iterations=range(0, trace))
            tracer.__enter__()
        start = time.perf_counter()
        opt.zero_grad()
        loss = w.loss(model(x), y)
        loss.backward()
        opt.step()
        if step < total:
            times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    opt.synchronize()
    if tracer is not None:
        tracer.__exit__(None, None, None)
    t = torch.tensor(times[args.warmup:], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)                 # the slowest rank's iterations
    entry: dict[str, Any] = {"name": dear.comm.runtime.communicator().name,
                             "median_s": statistics.median(t.tolist()), "times": t.tolist(),
                             "losses": losses}
    dist.barrier()
    if rank == 0 and trace:
        its = dear.diagnose.build_report(trace_dir).iterations()
        entry["trace"] = {"dir": trace_dir,
                          "comm_s": statistics.median(i.comm for i in its),
                          "exposed_s": statistics.median(i.exposed for i in its),
                          "compute_s": statistics.median(i.compute for i in its),
                          "overlap": statistics.median(i.overlap or 0.0 for i in its)}
    del opt, model
    dear.shutdown()
    return entry


def rank_main(args: argparse.Namespace) -> int:
    rank = _prepare_rank()
    import datetime

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    from mpi4py import MPI  # noqa: F401  (starts MPI with this rank's interface)

    from dear.comm import launch
    from dear.comm.mpi import MPICommunicator
    from dear.comm.torch_dist import TorchCommunicator
    launch.setup_env()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    data: dict[str, Any] = {"args": vars(args),
                            "bandwidth_measured_bps": os.environ.get(
                                "BENCH_CLUSTER_BANDWIDTH_MEASURED"),
                            "bandwidth_requested_bps": os.environ.get(
                                "BENCH_CLUSTER_BANDWIDTH_REQUESTED"),
                            "mpi": MPI.Get_library_version().split("\n")[0].strip(),
                            "loadavg_at_start": list(os.getloadavg())}
    if args.sizes_mb:
        gloo = TorchCommunicator(gloo_collectives="pairwise")
        mpi = MPICommunicator(timeout=600, progress=args.progress)
        data["collectives"] = collectives(args, gloo, mpi)
        mpi.shutdown()
        gloo.shutdown()
    if args.iters:
        data["training"] = training(args)
    if rank == 0 and args.name:
        _write(args, data)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _write(args: argparse.Namespace, data: dict[str, Any]) -> None:
    from benchmarks import results
    sys.argv = shlex.split(os.environ.get("BENCH_ARGV", "")) or sys.argv
    measured = data.get("bandwidth_measured_bps")
    link = f"{float(measured) / 1e9:.3f} Gbit/s measured" if measured else "loopback"
    rows = []
    for mb, entry in data.get("collectives", {}).items():
        med, rat = entry["median"], entry["ratios"]
        rows.append([f"{mb} MB", *(med[m] for m in METHODS),
                     rat["gloo_rs/gloo_all_reduce"], rat["gloo_ag/gloo_all_reduce"],
                     rat["mpi_rs/mpi_all_reduce"], rat["mpi_ag/mpi_all_reduce"]])
    table = results.markdown_table(
        ["size", *(f"{m} (s)" for m in METHODS), "gloo rs/ar", "gloo ag/ar", "mpi rs/ar",
         "mpi ag/ar"], rows) if rows else ""
    train = {k: v for k, v in data.get("training", {}).items() if isinstance(v, dict)}
    if train:
        trows = [[b, e["name"], e["median_s"], " ".join(f"{x:.3f}" for x in e["round_medians_s"]),
                  e.get("trace", {}).get("overlap", ""), e.get("trace", {}).get("comm_s", ""),
                  e.get("trace", {}).get("exposed_s", ""), e.get("trace", {}).get("compute_s", ""),
                  e["losses"][-1]] for b, e in train.items()]
        ratios = data["training"].get("mpi_over_torch_per_round")
        table += ("\n\nTraining, " + f"{args.model} batch {args.batch}"
                  + (f" image {args.image_size}" if args.image_size else "")
                  + f", {args.iters} timed iterations per round (slowest rank), {args.rounds} "
                  "rounds, backends interleaved:\n\n"
                  + results.markdown_table(["backend", "communicator", "s/iter (median of rounds)",
                                            "per round", "traced overlap", "traced comm (s)",
                                            "traced exposed comm (s)", "traced compute (s)",
                                            "last loss"], trows))
        if ratios:
            table += ("\n\nmpi / torch per round: " + ", ".join(f"{r:.3f}" for r in ratios)
                      + f" (median {statistics.median(ratios):.3f})")
    mpi_version = " ".join(data["mpi"].split())
    load = data.get("loadavg_at_start")
    notes = (f"{args.nproc} ranks, {link}, {mpi_version}; MPI progress: {args.progress}"
             + (f"; load average at the start {load[0]:.1f} on {os.cpu_count()} cores (other "
                "work on the machine slows compute at random: compare backends within a round)"
                if load else "") + ". "
             "Ratios: median over repeats of each repeat's ratio to the all-reduce of the same "
             "library. Traced (dear.diagnose, last round, median iteration): comm is the union of "
             "the collectives' issue-to-completion intervals, exposed comm the part of it during "
             "which the training thread computed nothing (waited); overlap = 1 - exposed / comm. "
             "Without the progress thread (mpi-noprogress) a collective moves only inside wait(), "
             "so its interval stretches to the wait and the waits grow.")
    path = results.write(args.name, "dear's MPI backend vs the Gloo pairwise exchange", data,
                         table, notes)
    print(f"mpi: wrote {path}", flush=True)


# ---------------------------------------------------------------------------------- main
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cli.add_options(p, nproc=2, rounds=3, warmup=3, iters=8, name="mpi", timeout=1800.0,
                    shaping=True)
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--no-pin", action="store_true")
    p.add_argument("--sizes-mb", type=float, nargs="*", default=[100.0, 25.0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--image-size", type=int, default=96)
    p.add_argument("--trace", type=int, default=4, help="iterations traced by dear.diagnose")
    p.add_argument("--backends", default="torch,mpi,mpi-noprogress",
                   help="dear backends to train with; mpi-noprogress: backend mpi with "
                        "DEAR_MPI_PROGRESS=none (no progress thread), for comparison")
    p.add_argument("--progress", default="thread", choices=("thread", "none"))
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.rank:
        return rank_main(args)
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
