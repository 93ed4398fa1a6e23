"""The CUDA half of the native path: kernels against the Python path, the fused SGD kernel
against torch.optim.SGD, the single-rank NCCL communicators (csrc and nccl4py) and the ordering
of communication after compute. Skipped without a GPU (world size 1 is all one GPU allows)."""

from __future__ import annotations

import os

import pytest
import torch

import dear
from dear import native
from tests.test_native import DTYPES, FakeComm, bits, drive, make_grads, make_params
from tests.workloads import assert_trains_like_one_process

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

needs_cuda_build = pytest.mark.skipif(not native.build_info().get("cuda"),
                                      reason="the extension was built without CUDA")


def cuda_params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().cuda()) for p in make_params(dtype)]


@needs_cuda_build
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("compress", [False, True], ids=["plain", "fp16-wire"])
def test_cuda_pack_kernel_bit_identical(dtype, world, compress) -> None:
    from dear.fusion.bucket import Bucket
    from dear.fusion.planner import plan_buckets
    params = cuda_params(dtype)
    wire = torch.float16 if compress and dtype in (torch.float32, torch.float64) else None
    grads = [g if g is None else g.cuda() for g in make_grads(params, seed=5, missing={2, 5})]
    for p, g in zip(params, grads):
        p.grad = g
    for spec in plan_buckets(params, list(range(len(params))), 64, world):
        members = [params[i] for i in spec.params]
        pair = [Bucket(spec, members, wire, native=n) for n in (True, False)]
        local = [grads[i] for i in spec.params]
        order = [j for j in reversed(range(len(local))) if local[j] is not None][:-1]
        comms = FakeComm(world), FakeComm(world)
        used = [drive(b, local, order, c, 0.5, 1.0 / world) for b, c in zip(pair, comms)]
        assert used[0] == used[1]
        assert torch.equal(bits(comms[0].sent[0]), bits(comms[1].sent[0]))
        assert torch.equal(bits(pair[0].buffer), bits(pair[1].buffer))


@needs_cuda_build
def test_cuda_unpack_into_and_standalone_pack() -> None:
    params = cuda_params(torch.float32)
    grads = [g if g is None else g.cuda() for g in make_grads(params, seed=9, missing={1})]
    offsets, cursor = [], 0
    for p in params:
        offsets.append(cursor)
        cursor += p.numel()
    numels = [p.numel() for p in params]
    buffer = torch.full((cursor + len(params) + 2,), float("nan"), device="cuda")
    native.pack_bucket(buffer, offsets, numels, cursor, grads, [g is not None for g in grads])
    outs = [torch.empty_like(p) for p in params]
    native.unpack_into(buffer, offsets, numels, cursor, outs)
    torch.cuda.synchronize()
    for g, out in zip(grads, outs):
        assert torch.equal(bits(out), bits(torch.zeros_like(out) if g is None else g))


def _single_rank_nccl(implementation: str) -> None:
    from dear.comm.nccl import NcclCommunicator
    import torch.distributed as dist
    comm = NcclCommunicator(0, 1, dist.HashStore(), implementation=implementation)
    try:
        x = torch.arange(12, dtype=torch.float32, device="cuda")
        out = torch.empty_like(x)
        comm.reduce_scatter(x, out).wait()
        gathered = torch.empty_like(x)
        comm.all_gather(out, gathered).wait()
        comm.all_reduce(gathered).wait()
        assert torch.equal(gathered, x)
        # Ordering: the collective reads a tensor that a long kernel on the compute stream is
        # still writing; without the event dependency it would read stale zeros.
        a = torch.randn(4096, 4096, device="cuda")
        src = torch.zeros(4096 * 4096, device="cuda")
        torch.matmul(a, a, out=src.view(4096, 4096))
        for _ in range(3):
            src.view(4096, 4096).copy_(torch.matmul(src.view(4096, 4096), a) * 1e-3)
        dst = torch.empty_like(src)
        comm.reduce_scatter(src, dst).wait()
        assert torch.equal(dst, src)
    finally:
        comm.shutdown()


@pytest.mark.skipif(not native.build_info().get("nccl"),
                    reason="the extension was built without NCCL")
def test_csrc_nccl_communicator_single_rank() -> None:
    _single_rank_nccl("csrc")


def test_nccl4py_communicator_single_rank() -> None:
    pytest.importorskip("nccl.core", reason="nccl4py not installed (pip install 'dear[nccl]')")
    _single_rank_nccl("nccl4py")


def test_dear_init_nccl_trains_on_one_gpu(monkeypatch) -> None:
    from dear.comm import nccl
    if nccl.availability().startswith("no"):
        pytest.skip(nccl.availability())
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    dear.init(backend="nccl")
    try:
        assert_trains_like_one_process(
            lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), "cuda")
    finally:
        dear.shutdown()
    assert os.environ["WORLD_SIZE"] == "1"
