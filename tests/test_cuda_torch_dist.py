"""dear.init() from torchrun's variables where CUDA is there: the group it starts carries CPU
tensors on Gloo and CUDA tensors on NCCL, and a wait on a CUDA collective orders the current
stream without blocking the host. World of one (all one GPU allows); skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

import dear
from tests.distributed import free_port
from tests.workloads import assert_trains_like_one_process

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture
def torchrun_world_of_one(monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    dear.init()
    yield dear.comm.runtime.communicator()
    dear.shutdown()


def test_cpu_and_cuda_tensors_on_one_group(torchrun_world_of_one) -> None:
    comm = torchrun_world_of_one
    assert comm.name == "cpu:gloo,cuda:nccl-pairwise"
    for device in ("cpu", "cuda"):
        x = torch.arange(12, dtype=torch.float32, device=device)
        t = x.clone()
        comm.all_reduce(t).wait()
        out = torch.empty(12, device=device)
        comm.reduce_scatter(x, out).wait()
        gathered = torch.empty(12, device=device)
        comm.all_gather(out, gathered).wait()
        torch.cuda.synchronize()
        assert torch.equal(t, x) and torch.equal(gathered, x), device


def test_wait_on_a_cuda_collective_does_not_block_the_host(torchrun_world_of_one) -> None:
    """The collective reads what a long chain of kernels writes; wait() must return while they
    still run (with DEAR_TIMEOUT passed to NCCL's wait, the host waited for all of them)."""
    comm = torchrun_world_of_one
    a = torch.randn(8192, 8192, device="cuda") / 8192**0.5
    x = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    for _ in range(60):                        # some hundreds of ms of GPU time
        x = a @ x
    expected = x.clone()
    work = comm.all_reduce(x)
    work.wait()
    done = torch.cuda.Event()
    done.record()
    assert not done.query(), "wait() blocked the host until the GPU had finished"
    torch.cuda.synchronize()
    assert torch.equal(x, expected)


def test_trains_like_one_process_on_the_gpu(torchrun_world_of_one) -> None:
    assert_trains_like_one_process(lambda params: torch.optim.AdamW(params, lr=0.01), "cuda",
                                   steps=5)
