"""dear's steady iterations read no tensor's value on the host (issue 51).

On a GPU such a read (`Tensor.item()`, `bool(t)`, `torch.equal`, `.tolist()` of a device
tensor) stops the host until the device has caught up, so the CPU no longer runs ahead of it.
On CPU ranks the same reads are dispatcher ops (`aten::_local_scalar_dense`, `aten::item`,
`aten::equal`, `aten::is_nonzero`) that torch's profiler counts on every thread. Here: zero in
steady iterations (the planned schedule in force, and DeAR's order, which dear keeps where the
link is the host's own work) of a loop that reads nothing itself, on both hook paths (C++ and
Python), in iterations that compare contents (DEAR_CHECK_EVERY=1) and with the default
sampling; a control loop that calls `loss.item()` shows that the count sees a read.
On a GPU (marked cuda): the same steady iterations on a CUDA model raise no warning of
`torch.cuda.set_sync_debug_mode`, at one rank on NCCL and with the planned schedule on a side
stream (two ranks sharing the GPU through Gloo).
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F

import dear
from tests.distributed import run_distributed
from tests.workloads import batch, make_net

READS = ("aten::_local_scalar_dense", "aten::item", "aten::equal", "aten::is_nonzero")
SYNC_WARNING = "called a synchronizing CUDA operation"     # torch's sync debug mode, "warn"
WARMUP, COUNTED = 12, 6        # the plan is made after 4 iterations and checked after 4 more


def _reads(step, settle) -> collections.Counter:
    """The host reads of COUNTED calls of `step`, then `settle` (inside the window: a Gloo
    operation outliving the profiler crashed torch 2.13's profiler when it read its events)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for k in range(COUNTED):
            step(WARMUP + k)
        settle()
    return collections.Counter(e.name for e in prof.events() if e.name in READS)


def _count() -> dict:
    dear.init()
    rank, world = dear.rank(), dear.size()
    model = make_net()
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                    model=model, fusion_threshold=2048)
    losses = []

    def step(k: int, read: bool = False) -> None:
        opt.zero_grad()
        x, y = batch(k, world, rank)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if read:
            losses.append(loss.item())

    for k in range(WARMUP):
        step(k)
    planned = opt.dear_schedule.plan is not None
    opt.flush_updates()
    dear_reads = _reads(step, opt.flush_updates)
    control = _reads(lambda k: step(k, read=True), opt.flush_updates)
    dear.shutdown()
    return {"planned": planned, "dear": dict(dear_reads), "control": dict(control)}


@pytest.mark.parametrize("schedule", ["planned", "dear"])
@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("check_every", ["1", "16"])
def test_steady_iterations_read_nothing_on_the_host(native: str, check_every: str,
                                                    schedule: str) -> None:
    results = run_distributed(_count, 2, timeout=240,
                              env={"DEAR_NATIVE": native, "DEAR_CHECK_EVERY": check_every,
                                   "DEAR_SCHEDULE": schedule})
    for r, res in enumerate(results):
        assert res["planned"] == (schedule == "planned"), \
            f"rank {r}: the planned schedule was {'not ' * (schedule == 'planned')}in force"
        assert res["dear"] == {}, f"rank {r}: dear read tensors on the host: {res['dear']}"
        assert sum(res["control"].values()) >= 6, \
            f"rank {r}: the count missed the control's loss.item() reads: {res['control']}"


def _gpu_batches(world: int, rank: int, first: int, count: int) -> list:
    """Batches on the GPU, made before anything is watched (a copy from pageable memory
    synchronizes)."""
    batches = [tuple(t.cuda() for t in batch(first + k, world, rank)) for k in range(count)]
    torch.cuda.synchronize()
    return batches


def _gpu_steps(opt, model, batches: list) -> None:
    for x, y in batches:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def _count_gpu_syncs(mode: str) -> dict:
    """On a rank: steady iterations of dear on a CUDA model under the sync debug mode ("warn",
    recorded on this thread): the warnings dear's iterations raise, and a control's."""
    import warnings

    from tests.workloads import init_in_issue_mode
    if mode == "one":
        dear.init()                    # torchrun's variables: CUDA tensors on NCCL
    else:
        init_in_issue_mode(mode, "cuda")
    rank, world = dear.rank(), dear.size()
    model = make_net().cuda()
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                    model=model, fusion_threshold=2048)
    _gpu_steps(opt, model, _gpu_batches(world, rank, 0, WARMUP))
    planned = opt.dear_schedule.plan is not None
    batches = _gpu_batches(world, rank, WARMUP, COUNTED)
    control = torch.ones(1, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")   # (it warns once that it is a prototype)
        try:
            _gpu_steps(opt, model, batches)
            mine = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
                    if SYNC_WARNING in str(w.message)]
            control.item()                                  # the control: one sync
            control_syncs = sum(SYNC_WARNING in str(w.message) for w in caught) - len(mine)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    opt.synchronize()
    dear.shutdown()
    return {"planned": planned, "syncs": mine, "control": control_syncs}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("check_every", ["1", "16"])
@pytest.mark.parametrize("native", ["1", "0"])
def test_steady_iterations_do_not_synchronize_the_gpu_at_one_rank(native: str,
                                                                  check_every: str) -> None:
    """A world of one on NCCL (torchrun's variables): dear's steady iterations raise no
    warning of torch.cuda.set_sync_debug_mode, with contents compared every iteration and
    sampled, on both hook paths; the control `.item()` warns once."""
    [res] = run_distributed(_count_gpu_syncs, 1, "one", timeout=240,
                            env={"DEAR_NATIVE": native, "DEAR_CHECK_EVERY": check_every})
    assert res["control"] == 1, "the sync debug mode did not see the control's .item()"
    assert res["syncs"] == [], "dear synchronized the GPU in steady iterations:\n" + \
        "\n".join(res["syncs"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("check_every", ["1", "16"])
def test_the_planned_schedule_does_not_synchronize_the_gpu(check_every: str) -> None:
    """Two ranks sharing the GPU through Gloo's CUDA collectives, the planned schedule issued
    on a side stream as with NCCL: the training thread's steady iterations raise no warning of
    the sync debug mode (Gloo's own threads are not watched), and the schedule is in force."""
    results = run_distributed(_count_gpu_syncs, 2, "stream", timeout=240,
                              env={"DEAR_CHECK_EVERY": check_every})
    for r, res in enumerate(results):
        assert res["planned"], f"rank {r}: the planned schedule was not in force"
        assert res["control"] == 1, f"rank {r}: the sync debug mode missed the control"
        assert res["syncs"] == [], f"rank {r}: dear synchronized the GPU:\n" + \
            "\n".join(res["syncs"])
