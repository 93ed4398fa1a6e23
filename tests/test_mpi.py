"""dear.init(backend="mpi") (dear/comm/mpi.py) under a real `mpirun` (MPICH from the `mpich`
wheel, mpi4py; both installed by `make setup`).

The ranks are started by mpirun running this file (`python -m tests.test_mpi <case>`); each rank
writes its result (JSON) to a file that the test reads. Every run has a hard timeout that kills
mpirun's whole process group.

- conformance, on 2 and 3 ranks: test_comm's checks (every dtype, odd shard sizes, several
  collectives in flight waited out of order, non-zero roots, objects of different sizes per
  rank, refused bad sizes), whose references are torch.distributed's own collectives on a Gloo
  group started from mpirun's variables (dear/comm/launch.py); and the MPI communicator's results
  against the torch backend's (TorchCommunicator, pairwise) on the same inputs: all-gathers
  bitwise, sums within test_comm's rounding bound.
- training: the same model and data with dear.DistributedOptimizer on backend "mpi" and on
  backend "torch" end with the same parameters: bitwise on 2 ranks (a sum of two terms does not
  depend on the order), within rounding on 3.
- progress: a collective completes without the issuing thread calling into MPI (the progress
  thread drives it); nothing is timed.
- failure: a rank that stalls or dies makes the others raise TimeoutError after DEAR_TIMEOUT.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import pytest
import torch

from tests.subprocesses import BIN, NO_MPIRUN, ROOT, run


def _mpirun() -> str:
    path = os.path.join(BIN, "mpirun")
    if not os.path.exists(path):
        path = shutil.which("mpirun") or ""
    if not path:
        pytest.skip(NO_MPIRUN)
    return path


def _launch(case: str, n: int, *extra: str, env: dict[str, str] | None = None,
            timeout: float = 180, flags: tuple[str, ...] = ()) -> tuple[int, list[Any], str]:
    pytest.importorskip("mpi4py")
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    clean.update(env or {})
    with tempfile.TemporaryDirectory(prefix="dear-mpi-test-") as outdir:
        clean["DEAR_TEST_OUT"] = outdir         # one file per rank: mpirun may interleave lines
        out = run([_mpirun(), *flags, "-np", str(n), sys.executable, "-m", "tests.test_mpi",
                   case, *extra], timeout=timeout, env=clean, cwd=ROOT)
        results = []
        for name in sorted(os.listdir(outdir)):
            with open(os.path.join(outdir, name)) as fh:
                results.append(json.load(fh))
    return out.returncode, sorted(results, key=lambda r: r["rank"]), out.stdout


# --------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("world_size", [2, 3])
def test_mpi_matches_torch(world_size: int) -> None:
    rc, results, out = _launch("conformance", world_size)
    assert rc == 0 and len(results) == world_size, out
    problems = [f"rank {r['rank']}: {e}" for r in results for e in r["errors"]]
    assert not problems, "\n".join(problems)
    first = results[0]["digests"]
    assert first
    for r in results[1:]:
        assert r["digests"] == first, "ranks all-gathered different bits"


@pytest.mark.parametrize("world_size", [2, 3])
def test_training_equals_torch_backend(world_size: int) -> None:
    # DeAR's order on both backends: this compares data planes. (The planned schedule's
    # collective thread on the torch backend, in a process that also ran MPI, aborted at exit
    # now and then: "terminate called without an active exception"; not understood yet.)
    rc, results, out = _launch("training", world_size, env={"DEAR_SCHEDULE": "dear"})
    assert rc == 0 and len(results) == world_size, out
    for r in results:
        assert r["name"] == "mpi"
        assert r["replicas_equal"], "ranks' parameters differ"
        if world_size == 2:
            assert r["max_diff"] == 0.0
        else:
            assert r["max_diff"] <= r["bound"], r
    assert results[0]["moved"] > 0


def test_progress_thread_completes_collectives() -> None:
    rc, results, out = _launch("progress", 2)
    assert rc == 0 and len(results) == 2, out
    for r in results:
        assert r["completed_without_wait"], r


def test_stalled_rank_times_out() -> None:
    """Rank 1 stops calling collectives; rank 0 raises TimeoutError after DEAR_TIMEOUT and exits
    non-zero; mpirun then ends the stalled rank."""
    start = time.monotonic()
    rc, results, out = _launch("fail", 2, "stall", env={"DEAR_TIMEOUT": "3"}, timeout=120)
    assert rc != 0, out
    assert "TimeoutError: MPI all-reduce not complete after 3 s (DEAR_TIMEOUT)" in out, out
    assert [r["waited"] for r in results if r["rank"] == 0][0] >= 3.0
    assert time.monotonic() - start < 120
    # the hang report, through the MPI backend's own rendezvous store: rank 1 is alive (its
    # records keep coming) but never issued the all-reduce
    assert "Rank(s) that did not issue it: 1." in out, out
    assert "rank 1: did NOT issue #2" in out and "alive, busy outside" in out, out


def test_dead_rank_times_out() -> None:
    """Rank 1 exits mid-run and mpirun keeps the others (-disable-auto-cleanup): rank 0 raises
    TimeoutError after DEAR_TIMEOUT and exits (MPI_Finalize, which would wait for the dead
    peer, is skipped)."""
    rc, results, out = _launch("fail", 2, "die", env={"DEAR_TIMEOUT": "3"}, timeout=120,
                               flags=("-disable-auto-cleanup",))
    assert rc != 0, out
    assert "TimeoutError: MPI all-reduce not complete after 3 s (DEAR_TIMEOUT)" in out, out
    assert "Rank(s) not responding: 1." in out, out


def test_mpi_backend_needs_mpi4py() -> None:
    code = ("import sys; sys.modules['mpi4py'] = None\nimport dear\n"
            "try:\n    dear.init(backend='mpi')\nexcept RuntimeError as e:\n    print('ERR', e)\n")
    out = run([sys.executable, "-c", code], timeout=120, cwd=ROOT)
    assert "ERR backend 'mpi' needs mpi4py and an MPI library" in out.stdout, out.stdout


# ------------------------------------------------------------------- what the ranks run
def _report(**fields: Any) -> None:
    """This rank's result, as a file in DEAR_TEST_OUT (or a line on stdout when run by hand)."""
    outdir = os.environ.get("DEAR_TEST_OUT")
    if not outdir:
        print("RESULT " + json.dumps(fields), flush=True)
        return
    path = os.path.join(outdir, f"{fields['rank']}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(fields, fh)
    os.replace(path + ".tmp", path)


def _conformance() -> None:
    import torch.distributed as dist

    from dear.comm import launch
    from dear.comm.mpi import MPICommunicator
    from dear.comm.torch_dist import TorchCommunicator
    from tests import test_comm as tc

    launch.setup_env()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    comm = MPICommunicator(timeout=60)
    chk, digests = tc.Checker(), {}
    if comm.local_rank != comm.rank:             # every rank of the test is on this host
        chk.errors.append(f"local_rank {comm.local_rank} on rank {comm.rank}")
    tc.check_shards(comm, chk, digests)
    tc.check_in_flight(comm, chk)
    tc.check_pieces(comm, chk)
    tc.check_others(comm, chk)
    tc.check_bad_sizes(comm, chk)
    # Against the torch backend on the same inputs.
    ref = TorchCommunicator(gloo_collectives="pairwise")
    n, me = comm.size, comm.rank
    for seed, dtype in enumerate(tc.DTYPES, start=700):
        for shard in (3, 4097):
            x = tc.make_input(dtype, n * shard, me, seed)
            a, b = torch.empty(shard, dtype=dtype), torch.empty(shard, dtype=dtype)
            comm.reduce_scatter(x, a).wait()
            ref.reduce_scatter(x, b).wait()
            chk.close(f"vs torch backend: reduce_scatter {dtype} {shard}", a, b,
                      2 * tc.tolerance(dtype, n))
            ga, gb = torch.empty(n * shard, dtype=dtype), torch.empty(n * shard, dtype=dtype)
            comm.all_gather(b, ga).wait()
            ref.all_gather(b, gb).wait()
            chk.exact(f"vs torch backend: all_gather {dtype} {shard}", ga, gb)
    ref.shutdown()
    comm.shutdown()
    dist.destroy_process_group()
    _report(rank=me, errors=chk.errors, digests=digests)


def _train(backend: str, steps: int = 6) -> dict[str, torch.Tensor]:
    import dear
    dear.init(backend=backend)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                    named_parameters=model.named_parameters(), model=model,
                                    fusion_threshold=8 * 1024)     # several buckets
    dear.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(100 + dear.rank())
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        y = torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    name = dear.comm.runtime.communicator().name
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}  # flushes
    dear.shutdown()
    params["__name__"] = name                                              # type: ignore
    return params


def _training() -> None:
    import torch.distributed as dist

    from dear.comm import launch
    mpi = _train("mpi")
    name = mpi.pop("__name__")
    launch.setup_env()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    ref = _train("torch")
    ref.pop("__name__")
    diff = max(float((mpi[k].double() - ref[k].double()).abs().max()) for k in mpi)
    # Replicas agree: every rank's parameters gathered and compared.
    flat = torch.cat([v.flatten() for v in mpi.values()])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    equal = all(torch.equal(everyone[0], t) for t in everyone)
    # On 3 ranks the two backends add 3 terms in different orders: each averaged gradient
    # element differs by at most 2 roundings of a sum of 3 terms of size <= 1 (3 * eps, with a
    # factor 2 for the averaging); momentum 0.9 weighs it at most 1 / (1 - 0.9) = 10 times, lr
    # 0.05, 6 steps, each difference fed back through the next steps' gradients (a factor 2 per
    # step is generous for this small ReLU net).
    bound = 6 * 0.05 * 10 * 2 * 3 * torch.finfo(torch.float32).eps * 2.0 ** 6
    torch.manual_seed(0)
    init = torch.nn.Sequential(torch.nn.Linear(32, 64)).state_dict()["0.weight"]
    moved = float((mpi["0.weight"] - init).abs().max())
    _report(rank=dist.get_rank(), name=name, max_diff=diff, bound=bound, replicas_equal=equal,
            moved=moved)
    dist.destroy_process_group()
    # KNOWN BUG, not fixed: a process that ran dear on MPI and then on Gloo aborts now and then
    # at interpreter exit ("terminate called without an active exception", MPICH), after its
    # work is done and reported. This test compares results, so it ends without teardown; but
    # MPI is finalized first: mpirun takes a rank that exits without MPI_Finalize for a failed
    # one and kills the others (seen under CI's load: "EXIT CODE: 9", a rank SIGKILLed while the
    # first one to finish had already exited).
    sys.stdout.flush()
    from mpi4py import MPI
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
    os._exit(0)


def _progress() -> None:
    """Issue a 16 MB reduce-scatter and never call wait() or any MPI function from this thread:
    only the progress thread can complete it (MPI's rendezvous protocol moves a message this
    large only inside MPI calls). Generous deadline; nothing is timed."""
    from dear.comm.mpi import MPICommunicator
    comm = MPICommunicator(timeout=60)
    x = torch.ones(4 * 1024 * 1024)
    out = torch.empty(x.numel() // comm.size)
    work = comm.reduce_scatter(x, out)
    request = work.inner[0]                                    # type: ignore[attr-defined]
    done = request.event.wait(60)
    work.wait()
    ok = done and bool((out == comm.size).all())
    comm.barrier()
    _report(rank=comm.rank, completed_without_wait=ok)
    comm.shutdown()


def _fail(how: str) -> None:
    import dear
    dear.init(backend="mpi")
    comm = dear.comm.runtime.communicator()
    x = torch.ones(1000)
    comm.all_reduce(x).wait()
    if comm.rank == 1:
        if how == "die":
            os._exit(0)
        time.sleep(600)                                        # stalled: mpirun ends it
    start = time.monotonic()
    try:
        comm.all_reduce(x).wait()
    finally:
        _report(rank=comm.rank, waited=time.monotonic() - start)


if __name__ == "__main__":
    case = sys.argv[1]
    if case == "conformance":
        _conformance()
    elif case == "training":
        _training()
    elif case == "progress":
        _progress()
    elif case == "fail":
        _fail(sys.argv[2])
    else:
        raise SystemExit(f"unknown case {case!r}")
