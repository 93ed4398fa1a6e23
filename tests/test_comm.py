"""dear's communicators against independent references.

TorchCommunicator on Gloo, in both modes ("pairwise": dear's own point-to-point exchange;
"native": torch's collectives), is compared with torch.distributed's own collectives on the same
inputs (dist.all_reduce then a slice for reduce-scatter, dist.all_gather's list form for
all-gather) and with sums recomputed locally from every rank's regenerated input. Spawning ranks
costs seconds, so each world size runs every case of both modes in one spawned run: the first
pass takes its mode from DEAR_GLOO_COLLECTIVES as given through run_distributed's env=, the
second sets the variable itself and starts dear again on the same process group.

Integer results must be exact. Float sums may differ from the reference's by rounding (the
summation order differs), so they get a tolerance for the dtype; but the all-gathered result of
a reduce-scatter must be bit-identical on every rank, which is what keeps replicas in step.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import re
import sys
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

import dear
from dear.comm.torch_dist import TorchCommunicator
from tests.distributed import run_distributed

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32)
SHARDS = (1, 7, 1001, 200_003)
MODES = ("native", "pairwise")
NAMES = {"native": "gloo", "pairwise": "gloo-pairwise"}


def make_input(dtype: torch.dtype, numel: int, rank: int, seed: int) -> torch.Tensor:
    """Rank `rank`'s input for case `seed`; any rank can regenerate any other rank's.

    Float values have magnitudes in [0.5, 1), so a missing, extra or misplaced term changes a
    sum by far more than rounding could."""
    g = torch.Generator().manual_seed(1009 * seed + rank)
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype)
    magnitude = 0.5 + 0.5 * torch.rand(numel, generator=g, dtype=torch.float64)
    sign = torch.randint(0, 2, (numel,), generator=g, dtype=torch.float64) * 2 - 1
    return (magnitude * sign).to(dtype)


def tolerance(dtype: torch.dtype, n: int) -> float:
    """Bound on how far two summation orders of n terms (|term| < 1) can disagree."""
    return n * n * torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class Checker:
    """Collects every mismatch of one rank instead of stopping at the first."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def close(self, what: str, got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
        if got.dtype != want.dtype or got.shape != want.shape:
            self.errors.append(f"{what}: got {got.dtype}{tuple(got.shape)}, "
                               f"want {want.dtype}{tuple(want.shape)}")
        elif atol == 0.0:
            if not torch.equal(got, want):
                bad = (got != want).nonzero().flatten()
                self.errors.append(f"{what}: {bad.numel()} elements differ, first at {bad[0]}")
        elif got.numel():
            diff = (got.double() - want.double()).abs().max().item()
            if not diff <= atol:                                # also catches NaN
                self.errors.append(f"{what}: max |error| {diff:.3g} > tolerance {atol:.3g}")

    def exact(self, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.dtype != want.dtype or not torch.equal(got.view(torch.uint8),
                                                      want.view(torch.uint8)):
            self.errors.append(f"{what}: not bitwise equal to the reference")

    def raises(self, what: str, fn: Callable[[], Any], pattern: str) -> None:
        try:
            fn()
        except ValueError as exc:
            if not re.search(pattern, str(exc)):
                self.errors.append(f"{what}: ValueError {str(exc)!r} does not match {pattern!r}")
        except Exception as exc:                                 # noqa: BLE001
            self.errors.append(f"{what}: raised {type(exc).__name__}: {exc}, not ValueError")
        else:
            self.errors.append(f"{what}: did not raise ValueError")


def sum_of_inputs(dtype: torch.dtype, numel: int, ranks: list[int], seed: int) -> torch.Tensor:
    """Exact sum (float64 / int64) of the given ranks' inputs, cast back to `dtype`."""
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    total = torch.zeros(numel, dtype=wide)
    for r in ranks:
        total += make_input(dtype, numel, r, seed).to(wide)
    return total.to(dtype)


def check_shards(comm: Any, chk: Checker, digests: dict[str, str]) -> None:
    """Reduce-scatter then all-gather every dtype and shard size; torch is the reference."""
    n, me = comm.size, comm.rank
    seed = 0
    for dtype in DTYPES:
        for shard in SHARDS:
            seed += 1
            case = f"{str(dtype).replace('torch.', '')} shard {shard}"
            mine = slice(me * shard, (me + 1) * shard)
            x = make_input(dtype, n * shard, me, seed)
            ref = x.clone()
            dist.all_reduce(ref)
            out = torch.full((shard,), 3, dtype=dtype)          # stale values must not survive
            comm.reduce_scatter(x, out).wait()
            chk.close(f"reduce_scatter {case}", out, ref[mine], tolerance(dtype, n))
            chk.close(f"reduce_scatter {case} vs local sum", out,
                      sum_of_inputs(dtype, n * shard, list(range(n)), seed)[mine],
                      tolerance(dtype, n))
            chk.exact(f"reduce_scatter {case} left its input alone", x,
                      make_input(dtype, n * shard, me, seed))

            gathered = torch.zeros(n * shard, dtype=dtype)
            comm.all_gather(out, gathered).wait()
            pieces = [torch.empty_like(out) for _ in range(n)]
            dist.all_gather(pieces, out)
            chk.exact(f"all_gather {case}", gathered, torch.cat(pieces))
            digests[f"{comm.name} {case}"] = digest(gathered)

            if comm.name.endswith("pairwise"):   # dear's exchange: output = our own shard
                buf = make_input(dtype, n * shard, me, seed)
                comm.reduce_scatter(buf, buf[mine]).wait()
                chk.close(f"in-place reduce_scatter {case}", buf[mine], ref[mine],
                          tolerance(dtype, n))

            # In place, as a bucket does it: the input is this rank's slice of the output.
            buf = torch.zeros(n * shard, dtype=dtype)
            buf[mine] = make_input(dtype, shard, me, seed)
            comm.all_gather(buf[mine], buf).wait()
            chk.exact(f"in-place all_gather {case}", buf,
                      torch.cat([make_input(dtype, shard, r, seed) for r in range(n)]))


def check_pieces(comm: Any, chk: Checker) -> None:
    """A reduce-scatter in pieces (column ranges of the shard, all issued before any wait, as
    a bucket larger than the fusion threshold sends them) gives the whole one's result; on
    dear's exchange its bits (each element is summed by the same chain)."""
    n, me = comm.size, comm.rank
    for seed, (dtype, shard) in enumerate(((torch.float32, 1001), (torch.float64, 7),
                                           (torch.int64, 200_003)), start=700):
        case = f"{str(dtype).replace('torch.', '')} shard {shard}"
        x = make_input(dtype, n * shard, me, seed)
        whole = torch.empty(shard, dtype=dtype)
        comm.reduce_scatter(x, whole).wait()
        columns = max(1, shard // 3)
        pieces = [(s, min(columns, shard - s)) for s in range(0, shard, columns)]
        out = torch.full((shard,), 3, dtype=dtype)
        works = [comm.reduce_scatter_columns(x, out, s, k) for s, k in pieces]
        for work in reversed(works):
            work.wait()
        what = f"reduce_scatter in {len(pieces)} pieces {case}"
        if comm.name.endswith("pairwise"):
            chk.exact(what, out, whole)
        else:                  # torch's Gloo may sum a smaller buffer in another order
            chk.close(what, out, whole, tolerance(dtype, n))
        chk.exact(f"reduce_scatter in pieces {case} left its input alone", x,
                  make_input(dtype, n * shard, me, seed))
        if comm.name.endswith("pairwise"):   # in place: the output is our own shard
            mine = slice(me * shard, (me + 1) * shard)
            buf = make_input(dtype, n * shard, me, seed)
            for work in [comm.reduce_scatter_columns(buf, buf[mine], s, k) for s, k in pieces]:
                work.wait()
            chk.exact(f"in-place reduce_scatter in pieces {case}", buf[mine], whole)


def check_in_flight(comm: Any, chk: Checker) -> None:
    """Two reduce-scatters and an all-gather issued before any wait; waited out of order."""
    n, me = comm.size, comm.rank
    a = make_input(torch.float32, n * 150_001, me, 901)
    b = make_input(torch.int64, n * 7, me, 902)
    c = make_input(torch.bfloat16, 60_001, me, 903)
    out_a, out_b = torch.empty(150_001), torch.empty(7, dtype=torch.int64)
    out_c = torch.empty(n * 60_001, dtype=torch.bfloat16)
    works = [comm.reduce_scatter(a, out_a), comm.reduce_scatter(b, out_b),
             comm.all_gather(c, out_c)]
    for i in (2, 0, 1, 0):                                      # a second wait() is harmless
        works[i].wait()
    for what, full, out in (("float32", a, out_a), ("int64", b, out_b)):
        ref = full.clone()
        dist.all_reduce(ref)
        shard = out.numel()
        chk.close(f"in flight: reduce_scatter {what}", out,
                  ref[me * shard:(me + 1) * shard], tolerance(full.dtype, n))
    chk.exact("in flight: all_gather bfloat16", out_c,
              torch.cat([make_input(torch.bfloat16, 60_001, r, 903) for r in range(n)]))


def check_others(comm: Any, chk: Checker) -> None:
    """all_reduce, broadcast (non-zero roots), broadcast_object, all_gather_object."""
    n, me = comm.size, comm.rank
    for seed, dtype in enumerate(DTYPES, start=500):
        t = make_input(dtype, 1001, me, seed)
        comm.all_reduce(t).wait()
        chk.close(f"all_reduce {dtype}", t, sum_of_inputs(dtype, 1001, list(range(n)), seed),
                  tolerance(dtype, n))
        for root in sorted({min(1, n - 1), n - 1}):     # non-zero roots where there are any
            t = make_input(dtype, 1001, me, seed + 100)
            comm.broadcast(t, root).wait()
            chk.exact(f"broadcast {dtype} from {root}", t,
                      make_input(dtype, 1001, root, seed + 100))
    obj = {"from": n - 1, "items": [1, "two", 3.0], "tensor": torch.arange(3)} \
        if me == n - 1 else None
    got = comm.broadcast_object(obj, n - 1)
    if not (isinstance(got, dict) and got["from"] == n - 1 and got["items"] == [1, "two", 3.0]
            and torch.equal(got["tensor"], torch.arange(3))):
        chk.errors.append(f"broadcast_object from {n - 1}: got {got!r}")
    everyone = comm.all_gather_object({"rank": me, "data": list(range(me))})
    want = [{"rank": r, "data": list(range(r))} for r in range(n)]
    if everyone != want:
        chk.errors.append(f"all_gather_object: got {everyone!r}, want {want!r}")


def check_bad_sizes(comm: Any, chk: Checker) -> None:
    """Refused before anything is sent, so the ranks stay in step (checked by the next call)."""
    n = comm.size
    chk.raises("reduce_scatter, one element too many",
               lambda: comm.reduce_scatter(torch.zeros(n * 5 + 1), torch.zeros(5)),
               rf"has {n * 5 + 1} elements, expected {n} x 5.*pad")
    chk.raises("all_gather, one element too few",
               lambda: comm.all_gather(torch.zeros(5), torch.zeros(n * 5 - 1)),
               rf"has {n * 5 - 1} elements, expected {n} x 5")
    chk.raises("reduce_scatter, 2-D input",
               lambda: comm.reduce_scatter(torch.zeros(n, 5), torch.zeros(5)),
               r"contiguous 1-D tensor, got shape \(\d+, 5\)")
    chk.raises("all_gather, non-contiguous output",
               lambda: comm.all_gather(torch.zeros(5), torch.zeros(2 * n * 5)[::2]),
               r"contiguous 1-D")
    chk.raises("reduce_scatter, mixed dtypes",
               lambda: comm.reduce_scatter(torch.zeros(n * 5), torch.zeros(5, dtype=torch.int64)),
               r"share dtype")
    chk.raises("broadcast, root out of range",
               lambda: comm.broadcast(torch.zeros(3), n), rf"root rank {n} does not exist")
    chk.raises("broadcast_object, negative root",
               lambda: comm.broadcast_object(1, -1), r"root rank -1 does not exist")
    x = make_input(torch.float64, n * 3, comm.rank, 77)
    out = torch.empty(3, dtype=torch.float64)
    comm.reduce_scatter(x, out).wait()
    ref = x.clone()
    dist.all_reduce(ref)
    chk.close("reduce_scatter after refused calls", out,
              ref[comm.rank * 3:(comm.rank + 1) * 3], tolerance(torch.float64, n))


def check_subgroup(mode: str, chk: Checker) -> None:
    """A group of the upper ranks 1..n-1: group ranks differ from global ranks (on 2 ranks it is
    a group of one, TorchCommunicator's size-1 path)."""
    n, me = dist.get_world_size(), dist.get_rank()
    if n == 1:
        return                                                  # no upper ranks to group
    members = list(range(1, n))
    group = dist.new_group(members)                             # every rank must call it
    if me not in members:
        return
    comm = TorchCommunicator(group, gloo_collectives=mode)
    k, shard = len(members), 1001
    mine = slice(comm.rank * shard, (comm.rank + 1) * shard)
    x = make_input(torch.int64, k * shard, me, 300)
    out, gathered = torch.empty(shard, dtype=torch.int64), torch.empty(k * shard, dtype=torch.int64)
    comm.reduce_scatter(x, out).wait()
    comm.all_gather(out, gathered).wait()
    total = sum_of_inputs(torch.int64, k * shard, members, 300)
    chk.close(f"subgroup {members} reduce_scatter", out, total[mine], 0.0)
    chk.exact(f"subgroup {members} all_gather", gathered, total)


def all_cases() -> dict[str, Any]:
    """Rank body: both modes on one process group; returns mismatches and result digests."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    chk, digests = Checker(), {}
    first = os.environ["DEAR_GLOO_COLLECTIVES"]
    for mode in (first, *(m for m in MODES if m != first)):
        os.environ["DEAR_GLOO_COLLECTIVES"] = mode
        dear.init()
        comm = dear.comm.runtime.communicator()
        if comm.name != NAMES[mode]:
            chk.errors.append(f"DEAR_GLOO_COLLECTIVES={mode} gave communicator {comm.name!r}")
        check_shards(comm, chk, digests)
        check_in_flight(comm, chk)
        check_pieces(comm, chk)
        check_others(comm, chk)
        check_bad_sizes(comm, chk)
        check_subgroup(mode, chk)
        dear.shutdown()                     # dear did not start the group: it stays up
    return {"errors": chk.errors, "digests": digests}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_torch_communicator_matches_torch(world_size: int) -> None:
    outcomes = run_distributed(all_cases, world_size, timeout=120,
                               env={"DEAR_GLOO_COLLECTIVES": "native"})
    problems = [f"rank {r}: {e}" for r, o in enumerate(outcomes) for e in o["errors"]]
    assert not problems, "\n".join(problems)
    first = outcomes[0]["digests"]
    assert len(first) == len(MODES) * len(DTYPES) * len(SHARDS)
    for r, o in enumerate(outcomes[1:], start=1):
        differ = [case for case in first if o["digests"].get(case) != first[case]]
        assert not differ, f"rank {r} all-gathered different bits than rank 0 for: {differ}"


def test_local_communicator() -> None:
    dear.init(backend="local")
    try:
        comm = dear.comm.runtime.communicator()
        assert (comm.name, comm.rank, comm.size) == ("local", 0, 1)
        for dtype in DTYPES:
            x = make_input(dtype, 1001, 0, 1)
            out = torch.zeros(1001, dtype=dtype)
            comm.reduce_scatter(x, out).wait()
            assert torch.equal(out, x)
            gathered = torch.zeros(1001, dtype=dtype)
            comm.all_gather(out, gathered).wait()
            assert torch.equal(gathered, x)
            comm.all_gather(gathered, gathered).wait()          # in place: nothing to do
            assert torch.equal(gathered, x)
            t = x.clone()
            comm.all_reduce(t).wait()
            comm.broadcast(t, 0).wait()
            assert torch.equal(t, x)
        assert comm.broadcast_object({"a": 1}, 0) == {"a": 1}
        assert comm.all_gather_object([1, 2]) == [[1, 2]]
        with pytest.raises(ValueError, match=r"expected 1 x 5"):
            comm.reduce_scatter(torch.zeros(6), torch.zeros(5))
        with pytest.raises(ValueError, match=r"expected 1 x 5"):
            comm.all_gather(torch.zeros(5), torch.zeros(4))
        with pytest.raises(ValueError, match=r"contiguous 1-D"):
            comm.reduce_scatter(torch.zeros(1, 5), torch.zeros(5))
        with pytest.raises(ValueError, match=r"root rank 1 does not exist"):
            comm.broadcast(torch.zeros(2), 1)
        with pytest.raises(ValueError, match=r"root rank 1 does not exist"):
            comm.broadcast_object(None, 1)
    finally:
        dear.shutdown()


def device_mapped_backend() -> dict[str, Any]:
    """Rank body: a group started with a per-device backend string, as dear.init() starts one
    where CUDA is there ("cpu:gloo,cuda:nccl"); here the CPU half alone."""
    dist.init_process_group("cpu:gloo", timeout=datetime.timedelta(seconds=60))
    chk, digests = Checker(), {}
    dear.init()
    comm = dear.comm.runtime.communicator()
    check_shards(comm, chk, digests)
    name = comm.name
    dear.shutdown()
    return {"errors": chk.errors, "name": name}


def test_device_mapped_backend_runs_the_pairwise_exchange_on_cpu() -> None:
    outcomes = run_distributed(device_mapped_backend, 2, timeout=120)
    assert [o["name"] for o in outcomes] == ["cpu:gloo-pairwise"] * 2
    problems = [f"rank {r}: {e}" for r, o in enumerate(outcomes) for e in o["errors"]]
    assert not problems, "\n".join(problems)


def test_which_backends_carry_cpu_tensors_on_gloo() -> None:
    from dear.comm.torch_dist import carries_cpu_on_gloo
    from dear.comm.runtime import default_backend
    assert carries_cpu_on_gloo("gloo") and carries_cpu_on_gloo("cpu:gloo,cuda:nccl")
    assert carries_cpu_on_gloo("cuda:nccl, cpu:gloo")
    assert not carries_cpu_on_gloo("nccl") and not carries_cpu_on_gloo("cuda:gloo")
    assert default_backend() == ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")


LOG_SCRIPT = """
import logging, sys, torch, dear
if sys.argv[1] == "configured":
    logging.basicConfig(format="USER %(message)s")
dear.init()
model = torch.nn.Linear(4, 2)
opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
model(torch.randn(3, 4)).sum().backward()
opt.step()
dear.shutdown()
dear.init()
dear.shutdown()
"""


@pytest.mark.parametrize("logging_setup", ["none", "configured"])
def test_log_level_info_is_printed_once(logging_setup: str) -> None:
    """DEAR_LOG_LEVEL=INFO prints dear's messages (the bucket layout) in a script that did not
    configure logging, after the rank, once however often dear.init() runs; where the script
    configured logging, through its handlers only. At the default level, nothing."""
    from tests.subprocesses import run
    cmd = [sys.executable, "-c", LOG_SCRIPT, logging_setup]
    out = run(cmd, timeout=120, env={"DEAR_LOG_LEVEL": "INFO"})
    assert out.returncode == 0, out.stdout
    prefix = "[rank 0] " if logging_setup == "none" else "USER "
    lines = out.stdout.splitlines()
    assert lines.count(f"{prefix}dear: rank 0 of 1 on local") == 2, out.stdout
    assert sum(line.startswith(f"{prefix}dear: 1 buckets") for line in lines) == 1, out.stdout
    assert not any(line.startswith("[rank 0]") for line in lines) or logging_setup == "none"
    quiet = run(cmd, timeout=120, env={"DEAR_LOG_LEVEL": "WARNING"})
    assert quiet.returncode == 0 and "dear:" not in quiet.stdout, quiet.stdout
