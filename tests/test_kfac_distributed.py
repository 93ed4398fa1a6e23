"""dear.KFAC on 2 and 3 Gloo ranks, every strategy and variant: the preconditioned gradients at
every step equal the single-process reference in which factors and gradients are averaged over
the same shards of the global batch (tests/kfac_workloads.py). Also under torch DDP,
dear.DistributedOptimizer (Horovod's synchronize / skip_synchronize loop) and Horovod."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from dear.kfac import KFAC, NetworkModel
from tests import kfac_workloads as W
from tests.distributed import run_distributed
from tests.horovod_launch import NO_HOROVOD, horovod_available, run_horovod

STEPS, ARGS = W.STEPS, W.ARGS
# (model, strategy, extra KFAC options). A network with alpha = 1 s makes every small factor
# "cheaper to compute than to send", so those runs exercise redundant computation; alpha = 0
# makes nothing redundant.
SLOW_NET, FAST_NET = NetworkModel(1.0, 1e-6), NetworkModel(0.0, 0.0)
CASES = [
    ("mlp", "comm-opt", dict(network_model=FAST_NET)),
    ("cnn", "comm-opt", dict(network_model=SLOW_NET)),
    ("cnn", "comm-opt", dict(pipeline_factors=False, symmetry_aware=False, redundancy=False,
                             network_model=FAST_NET)),                      # naive D-KFAC
    ("embed", "comm-opt", dict(network_model=FAST_NET, bucket_cap_mb=1e-4)),  # many buckets
    ("mlp", "mem-opt", dict(network_model=FAST_NET)),
    ("cnn", "mem-opt", dict(network_model=SLOW_NET)),
    ("embed", "mem-opt", dict(network_model=FAST_NET, method="inverse")),
    ("mlp", "pad", dict(network_model=FAST_NET)),
    ("cnn", "pad", dict(network_model=FAST_NET, bucket_cap_mb=1e-4)),
    ("cnn", "pad", dict(network_model=FAST_NET, pipeline_factors=False, method="inverse")),
    ("embed", "pad", dict(network_model=FAST_NET)),
    ("mlp", "pad", dict(network_model=FAST_NET, factor_update_freq=2)),
    ("cnn", "comm-opt", dict(network_model=FAST_NET, allreduce_bucket_cap_mb=0)),  # kfac-pytorch:
                                                    # no bucketing (a message per factor)
    ("cnn", "auto", dict()),                            # measured network, calibrated costs
]


def _average_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def _rank_cases(cases: list, backend: str = "gloo") -> list:
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for name, strategy, extra in cases:
        model = W.make_model(name)
        precond = KFAC(model, strategy=strategy, **{**ARGS, **extra})
        assert precond._transport._gloo, f"{backend}: CPU factors should go point to point"
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        grads = []
        for step in range(STEPS):
            x, y = W.batch(name, step, world, rank)
            opt.zero_grad()
            W.loss_fn(model(x), y).backward()
            _average_grads(model)
            precond.step()
            grads.append(W.grads_of(model))
            opt.step()
        out.append((grads, precond.plan.strategy.value, list(precond.plan.layer_owner),
                    list(precond.plan.a_owner)))
    if world == 2 and backend == "gloo":   # the integrations, in the same ranks
        out.append(_with_ddp("pad"))
        out.append(_with_dear_optimizer("mem-opt"))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_every_strategy_matches_the_shard_averaged_reference(world):
    results = run_distributed(_rank_cases, world, CASES, timeout=240)
    _check(results, CASES, world)
    if world == 2:     # torch DDP (embedding model), then dear.DistributedOptimizer (CNN)
        for name, got in (("embed", [r[-2] for r in results]), ("cnn", [r[-1] for r in results])):
            want = W.reference_run(name, 2, STEPS, **ARGS)
            for grads in got:
                for step in range(STEPS):
                    assert W.max_rel_diff(grads[step], want[step]) < 1e-9, (name, step)


def test_pad_on_a_device_mapped_group():
    """PAD's factor reduce on a "cpu:gloo,cuda:nccl"-style group (here its CPU half), which
    dear.init() starts on GPU machines: CPU factors take the point-to-point reduce."""
    cases = [c for c in CASES if c[1] == "pad"][:2]
    _check(run_distributed(_rank_cases, 3, cases, "cpu:gloo", timeout=240), cases, 3)


def _check(results: list, cases: list, world: int) -> None:
    """Every rank's preconditioned gradients equal the shard-averaged reference's."""
    references = {}
    for k, (name, strategy, extra) in enumerate(cases):
        hyper = {k: v for k, v in extra.items() if k in ("method", "factor_update_freq")}
        key = (name, tuple(sorted(hyper.items())))
        if key not in references:
            references[key] = W.reference_run(name, world, STEPS, **{**ARGS, **hyper})
        want = references[key]
        for rank in range(world):
            grads, chosen, owners, _ = results[rank][k]
            assert (chosen == strategy) or strategy == "auto"
            assert owners == results[0][k][2], "ranks disagree on the plan"
            for step in range(STEPS):
                diff = W.max_rel_diff(grads[step], want[step])
                assert diff < 1e-9, (name, strategy, extra, rank, step, diff)
        if strategy == "pad":      # contiguous blocks, every rank owning some when possible
            owners = results[0][k][2]
            assert owners == sorted(owners)
        if strategy == "comm-opt" and extra.get("network_model") is SLOW_NET:
            assert -1 in results[0][k][3], "the slow network should make small factors redundant"


def _with_dear_optimizer(strategy: str) -> list:
    """Horovod's K-FAC loop on dear.DistributedOptimizer (dear.init() reuses the group)."""
    import dear
    dear.init()
    rank, world = dear.rank(), dear.size()
    model = W.make_model("cnn")
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model=model)
    precond = dear.KFAC(model, strategy=strategy, **ARGS)
    grads = []
    for step in range(STEPS):
        x, y = W.batch("cnn", step, world, rank)
        opt.zero_grad()
        W.loss_fn(model(x), y).backward()
        opt.synchronize()
        precond.step()
        grads.append(W.grads_of(model))
        with opt.skip_synchronize():
            opt.step()
    dear.shutdown()
    return grads


def _with_ddp(strategy: str) -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.parallel.DistributedDataParallel(W.make_model("embed"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    precond = KFAC(model, strategy=strategy, **ARGS)
    grads = []
    for step in range(STEPS):
        x, y = W.batch("embed", step, world, rank)
        opt.zero_grad()
        W.loss_fn(model(x), y).backward()
        precond.step()
        grads.append({k.removeprefix("module."): v for k, v in W.grads_of(model).items()})
        opt.step()
    return grads


@pytest.mark.skipif(not horovod_available(), reason=NO_HOROVOD)
def test_with_horovod_distributed_optimizer():
    want = W.reference_run("mlp", 2, STEPS, **ARGS)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "grads")
        run_horovod(["-m", "tests.kfac_workloads", "hvd", "pad", out], np=2, timeout=180)
        for rank in range(2):
            grads = torch.load(f"{out}.{rank}", weights_only=False)
            for step in range(STEPS):
                assert W.max_rel_diff(grads[step], want[step]) < 1e-9, step


def _kfac_group_timeouts() -> list[float]:
    """The timeouts of the process groups dear.KFAC made for itself (DDP user: torch's group)."""
    from dear.kfac import comm as kfac_comm
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(W.make_model("embed"))
    precond = KFAC(model, strategy="comm-opt", **ARGS)
    x, y = W.batch("embed", 0, dist.get_world_size(), dist.get_rank())
    W.loss_fn(model(x), y).backward()
    precond.step()
    groups = [g for _, t in kfac_comm._SHARED.values() for g in t._owned]
    timeouts = [g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                for g in groups]
    dist.destroy_process_group()
    return timeouts


def test_kfac_groups_time_out_after_dear_timeout():
    """torch's new_group gives a group 30 minutes whatever the default group has: a rank stuck
    in one of K-FAC's all-reduces kept its process alive 1800 s after a stalled peer."""
    for timeouts in run_distributed(_kfac_group_timeouts, 2, timeout=120,
                                    env={"DEAR_TIMEOUT": "7"}):
        assert timeouts and all(t == 7.0 for t in timeouts), timeouts
