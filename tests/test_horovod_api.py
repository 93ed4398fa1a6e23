"""dear.horovod: Horovod's torch API on torch.distributed, without Horovod (issue 35, part 3).

Every check runs on real ranks (tests/distributed.py: Gloo on loopback, hard timeout) and
compares with a reference computed independently: torch.distributed's own collective on a copy,
or a closed form of the ranks' inputs; never with dear.horovod's own output. Horovod's v0.28.1
test_torch.py, run against dear.horovod, is in benchmarks/results/horovod_api_tests.md."""

from __future__ import annotations

import fractions
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from tests.subprocesses import ROOT
from tests.workloads import set_batch, set_net, set_reference

FAST = {"DEAR_TIMEOUT": "60"}


def _data(rank: int, shape: tuple, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


def _torch_allreduce(t: torch.Tensor, op, group=None) -> torch.Tensor:
    out = t.clone()
    dist.all_reduce(out, op=op, group=group)
    return out


# ---------------------------------------------------------------------------- allreduce
def _allreduce_ranks() -> None:
    import dear.horovod as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    assert (r, n) == (dist.get_rank(), dist.get_world_size())
    assert hvd.is_initialized()
    x = _data(r, (4, 5), torch.float64)
    # Average (the default) is a new tensor; the input is unchanged.
    before = x.clone()
    avg = hvd.allreduce(x, name="x")
    assert avg.data_ptr() != x.data_ptr() and torch.equal(x, before)
    ref_sum = sum(_data(k, (4, 5), torch.float64) for k in range(n))
    torch.testing.assert_close(avg, ref_sum / n, rtol=0, atol=1e-12)
    for op, ref_op in ((hvd.Sum, dist.ReduceOp.SUM), (hvd.Min, dist.ReduceOp.MIN),
                       (hvd.Max, dist.ReduceOp.MAX), (hvd.Product, dist.ReduceOp.PRODUCT)):
        for dtype in (torch.float32, torch.int32, torch.int64, torch.int16):
            t = _data(r, (3, 3), dtype, seed=op)
            assert torch.equal(hvd.allreduce(t, op=op), _torch_allreduce(t.to(
                torch.int32 if dtype == torch.int16 else dtype), ref_op).to(dtype)), (op, dtype)
    # Integer Average: Horovod scales the sum by 1/size in float64 and truncates.
    t = torch.tensor([-7, 7, 5, -1, 2], dtype=torch.int32) * (r + 1)
    total = sum(torch.tensor([-7, 7, 5, -1, 2], dtype=torch.float64) * (k + 1) for k in range(n))
    assert torch.equal(hvd.allreduce(t), (total * (1.0 / n)).to(torch.int32))
    # prescale before the sum, postscale after (float64: exact closed form).
    t = _data(r, (6,), torch.float64)
    out = hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    torch.testing.assert_close(out, sum(_data(k, (6,), torch.float64) * 0.5
                                        for k in range(n)) * 3.0)
    # deprecated average=: False is Sum; with op= it is an error.
    with pytest.warns(DeprecationWarning):
        assert torch.equal(hvd.allreduce(t, average=False), _torch_allreduce(t, dist.ReduceOp.SUM))
    with pytest.raises(ValueError, match="supersedes"):
        hvd.allreduce(t, average=True, op=hvd.Sum)
    # in place
    y = _data(r, (2, 3), torch.float32)
    expect = _torch_allreduce(y, dist.ReduceOp.SUM)
    assert hvd.allreduce_(y, op=hvd.Sum) is y and torch.equal(y, expect)
    # async: handles, poll, synchronize; in place async; synchronize twice gives None
    z = _data(r, (1000,), torch.float32)
    handles = [hvd.allreduce_async(z, op=hvd.Sum, name=f"z{i}") for i in range(4)]
    results = [hvd.synchronize(h) for h in handles]
    assert all(hvd.poll(h) for h in handles)
    assert all(torch.equal(res, _torch_allreduce(z, dist.ReduceOp.SUM)) for res in results)
    assert hvd.synchronize(handles[0]) is None
    w = z.clone()
    h = hvd.allreduce_async_(w, op=hvd.Max)
    assert hvd.synchronize(h) is w and torch.equal(w, _torch_allreduce(z, dist.ReduceOp.MAX))
    # a non-contiguous tensor in place
    m = _data(r, (4, 6), torch.float32).t()
    expect = _torch_allreduce(m.contiguous(), dist.ReduceOp.SUM)
    hvd.allreduce_(m, op=hvd.Sum)
    assert torch.equal(m, expect)
    # grouped, out of place and in place, sync and async
    group = [_data(r, (k + 1, 2), torch.float32, seed=k) for k in range(3)]
    refs = [_torch_allreduce(g, dist.ReduceOp.SUM) for g in group]
    assert all(torch.equal(a, b) for a, b in zip(hvd.grouped_allreduce(group, op=hvd.Sum), refs))
    got = hvd.synchronize(hvd.grouped_allreduce_async(group, op=hvd.Sum))
    assert isinstance(got, tuple) and all(torch.equal(a, b) for a, b in zip(got, refs))
    copies = [g.clone() for g in group]
    hvd.synchronize(hvd.grouped_allreduce_async_(copies, op=hvd.Sum))
    assert all(torch.equal(a, b) for a, b in zip(copies, refs))
    copies = [g.clone() for g in group]
    hvd.grouped_allreduce_(copies, op=hvd.Sum)
    assert all(torch.equal(a, b) for a, b in zip(copies, refs))
    # compression: fp16 on the wire, the caller's dtype back
    f = torch.full((5,), 1.0 + r, dtype=torch.float32)
    out = hvd.allreduce(f, op=hvd.Sum, compression=hvd.Compression.fp16)
    assert out.dtype == torch.float32 and torch.equal(out, torch.full((5,), n * (n + 1) / 2))
    # float16 tensors: the sum in float16, the average scaled in float32 (Horovod's CPU rule)
    half = _data(r, (8,), torch.float16)
    hsum = _torch_allreduce(half, dist.ReduceOp.SUM)
    assert torch.equal(hvd.allreduce(half), (hsum.float() * (1.0 / n)).half())
    # dear.Average / dear.Sum work too
    import dear
    assert torch.equal(hvd.allreduce(y, op=dear.Sum), _torch_allreduce(y, dist.ReduceOp.SUM))
    hvd.shutdown()
    assert not hvd.is_initialized()


def test_allreduce_family():
    run_distributed(_allreduce_ranks, 3, timeout=180, env=FAST)


# ------------------------------------------------------------- allgather, broadcast, alltoall
def _movement_ranks() -> None:
    import dear.horovod as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    rows = [2, 0, 5][:n]
    for dtype in (torch.float32, torch.int16, torch.uint8, torch.float16):
        t = torch.full((rows[r], 3, 2), r + 1).to(dtype)
        out = hvd.allgather(t)
        ref = torch.cat([torch.full((rows[k], 3, 2), k + 1).to(dtype) for k in range(n)])
        assert out.dtype == dtype and torch.equal(out, ref), dtype
    same = torch.arange(6.0).view(2, 3) + 10 * r
    handle = hvd.allgather_async(same, name="g")
    ref = torch.cat([torch.arange(6.0).view(2, 3) + 10 * k for k in range(n)])
    assert torch.equal(hvd.synchronize(handle), ref)
    pair = [same, torch.full((rows[r],), float(r))]
    refs = [ref, torch.cat([torch.full((rows[k],), float(k)) for k in range(n)])]
    assert all(torch.equal(a, b) for a, b in zip(hvd.grouped_allgather(pair), refs))
    got = hvd.synchronize(hvd.grouped_allgather_async(pair))
    assert isinstance(got, tuple) and all(torch.equal(a, b) for a, b in zip(got, refs))
    # broadcast: a new tensor, the input untouched; in place; async; roots are global ranks
    for dtype in (torch.float64, torch.int16, torch.bool):
        t = torch.full((2, 3), r).to(dtype)
        out = hvd.broadcast(t, root_rank=n - 1)
        assert torch.equal(out, torch.full((2, 3), n - 1).to(dtype))
        assert torch.equal(t, torch.full((2, 3), r).to(dtype))
    t = torch.full((4,), float(r))
    assert hvd.broadcast_(t, 1) is t and torch.equal(t, torch.full((4,), 1.0))
    t = torch.full((4,), float(r))
    assert torch.equal(hvd.synchronize(hvd.broadcast_async(t, 0)), torch.zeros(4))
    assert torch.equal(t, torch.full((4,), float(r)))
    hvd.synchronize(hvd.broadcast_async_(t, 0))
    assert torch.equal(t, torch.zeros(4))
    # alltoall: rank r sends (j + 1) rows to rank j, each row = 100 r + j
    splits = [j + 1 for j in range(n)]
    x = torch.cat([torch.full((j + 1, 2), 100.0 * r + j) for j in range(n)])
    out, received = hvd.alltoall(x, splits=torch.tensor(splits, dtype=torch.int32))
    assert torch.equal(out, torch.cat([torch.full((r + 1, 2), 100.0 * k + r) for k in range(n)]))
    assert received.dtype == torch.int32 and received.tolist() == [r + 1] * n
    out2, received2 = hvd.alltoall(x, splits=splits)          # a list works too
    assert torch.equal(out2, out) and received2.tolist() == [r + 1] * n
    # without splits: equal shares, only the tensor back (Horovod 0.28)
    eq = torch.arange(2 * n, dtype=torch.int16) + 10 * r
    only = hvd.alltoall(eq)
    assert isinstance(only, torch.Tensor)
    assert torch.equal(only, torch.cat([torch.arange(2 * r, 2 * r + 2, dtype=torch.int16) + 10 * k
                                        for k in range(n)]))
    res = hvd.synchronize(hvd.alltoall_async(eq))
    assert isinstance(res, tuple) and torch.equal(res[0], only) and res[1].tolist() == [2] * n
    # fewer rows sent than the tensor has: the rest stays home (Horovod: sum(splits) <= dim 0)
    extra = torch.cat([x, torch.full((3, 2), -1.0)])
    out3, _ = hvd.alltoall(extra, splits=splits)
    assert torch.equal(out3, out)
    # sparse: all-gathered indices and values, summed (averaged) when densified
    dense = torch.zeros(6, 2)
    dense[r] = float(r + 1)
    dense[5] = 1.0
    handle_fn = hvd.sparse_allreduce_async(dense.to_sparse(), name="sp", op=hvd.Average)
    expect = _torch_allreduce(dense, dist.ReduceOp.SUM) / n
    assert torch.equal(handle_fn().to_dense(), expect)
    # topology: one host here
    assert (hvd.local_rank(), hvd.local_size()) == (r, n)
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1) and hvd.is_homogeneous()


def test_allgather_broadcast_alltoall():
    run_distributed(_movement_ranks, 3, timeout=180, env=FAST)


# ---------------------------------------------------------------------------- reducescatter
def _reducescatter_ranks() -> None:
    import dear.horovod as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    shares = [3, 2, 2]                             # 7 rows over 3 ranks: the first gets one more
    starts = [0, 3, 5]
    for dtype in (torch.float32, torch.int64, torch.float16):
        t = _data(r, (7, 4), dtype)
        full = _torch_allreduce(t, dist.ReduceOp.SUM)
        mine = full[starts[r]:starts[r] + shares[r]]
        assert torch.equal(hvd.reducescatter(t, op=hvd.Sum), mine), dtype
        if dtype == torch.int64:                 # Average: sum * (1/n) in float64, truncated
            assert torch.equal(hvd.reducescatter(t), (mine.double() * (1.0 / n)).long())
    for op, ref_op in ((hvd.Min, dist.ReduceOp.MIN), (hvd.Max, dist.ReduceOp.MAX)):
        t = _data(r, (7,), torch.int32, seed=op)
        assert torch.equal(hvd.reducescatter(t, op=op),
                           _torch_allreduce(t, ref_op)[starts[r]:starts[r] + shares[r]])
    t = _data(r, (7, 2), torch.float64)
    ref = sum(_data(k, (7, 2), torch.float64) * 0.25 for k in range(n)) * 2.0 / n
    out = hvd.reducescatter(t, prescale_factor=0.25, postscale_factor=2.0)
    torch.testing.assert_close(out, ref[starts[r]:starts[r] + shares[r]])
    handle = hvd.reducescatter_async(t, op=hvd.Sum, name="rs")
    expect = _torch_allreduce(t, dist.ReduceOp.SUM)[starts[r]:starts[r] + shares[r]]
    assert torch.equal(hvd.synchronize(handle), expect)
    grouped = hvd.grouped_reducescatter([t, t[:3]], op=hvd.Sum)
    assert torch.equal(grouped[0], expect)
    assert torch.equal(grouped[1], _torch_allreduce(t[:3].contiguous(), dist.ReduceOp.SUM)[r:r + 1])
    got = hvd.synchronize(hvd.grouped_reducescatter_async([t], op=hvd.Sum))
    assert isinstance(got, tuple) and torch.equal(got[0], expect)


def test_reducescatter_splits_dim0_as_horovod():
    run_distributed(_reducescatter_ranks, 3, timeout=180, env=FAST)


# ---------------------------------------------------------------------------- gradients
def _autograd_ranks() -> None:
    import dear.horovod as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x = torch.ones(3, 2, dtype=torch.float64, requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum).backward(torch.ones(3, 2, dtype=torch.float64))
    assert torch.equal(x.grad, torch.full((3, 2), float(n), dtype=torch.float64))
    x.grad = None
    hvd.allreduce(x).backward(torch.ones(3, 2, dtype=torch.float64))     # Average
    assert torch.equal(x.grad, torch.ones(3, 2, dtype=torch.float64))
    # allgather: rank k's rows of the averaged gradient
    rows = [2, 3][:n]
    g = torch.ones(rows[r], 2, requires_grad=True)
    grads_in = torch.cat([torch.full((rows[k], 2), float(k + 1)) for k in range(n)])
    hvd.allgather(g).backward(grads_in)
    assert torch.equal(g.grad, torch.full((rows[r], 2), float(r + 1)))
    # broadcast: the averaged gradient on the root, zero elsewhere
    b = torch.ones(4, requires_grad=True)
    hvd.broadcast(b, root_rank=1).backward(torch.full((4,), 2.0))
    assert torch.equal(b.grad, torch.full((4,), 2.0 if r == 1 else 0.0))
    # alltoall: the gradient travels back the way the data came
    a = torch.arange(2.0 * n, requires_grad=True)
    out, _ = hvd.alltoall(a, splits=[2] * n)
    out.backward(torch.arange(2.0 * n) + 100 * r)
    assert torch.equal(a.grad, torch.cat([torch.arange(2.0 * r, 2.0 * r + 2) + 100 * k
                                          for k in range(n)]))
    # reducescatter: Horovod's rule, allgather of the gradient (times size for Sum)
    s = torch.ones(2 * n, 3, requires_grad=True)
    hvd.reducescatter(s, op=hvd.Sum).backward(torch.ones(2, 3))
    assert torch.equal(s.grad, torch.full((2 * n, 3), float(n)))
    grouped = [torch.ones(2, requires_grad=True) for _ in range(2)]
    outs = hvd.grouped_allreduce(grouped, op=hvd.Sum)
    (outs[0] + 2 * outs[1]).sum().backward()
    assert torch.equal(grouped[0].grad, torch.full((2,), float(n)))
    assert torch.equal(grouped[1].grad, torch.full((2,), 2.0 * n))


def test_gradients_follow_horovods_rules():
    run_distributed(_autograd_ranks, 2, timeout=120, env=FAST)


# ---------------------------------------------------------------------------- process sets
def _process_set_ranks() -> None:
    import dear.horovod as hvd
    hvd.init()
    r = hvd.rank()
    pair = hvd.add_process_set([2, 0])               # sorted, as Horovod
    alone = hvd.add_process_set(hvd.ProcessSet([1]))
    assert pair.ranks == [0, 2] and pair.size() == 2 and alone.size() == 1
    assert pair.included() == (r != 1) and alone.included() == (r == 1)
    assert hvd.global_process_set.size() == 3 and hvd.global_process_set.rank() == r
    mine = pair if r != 1 else alone
    members = mine.ranks
    x = torch.full((3,), float(r + 1))
    assert torch.equal(hvd.allreduce(x, op=hvd.Sum, process_set=mine),
                       torch.full((3,), float(sum(k + 1 for k in members))))
    assert torch.equal(hvd.allreduce(x, process_set=mine),
                       torch.full((3,), sum(k + 1 for k in members) / len(members)))
    assert torch.equal(hvd.allgather(x[:r + 1], process_set=mine),
                       torch.cat([torch.full((k + 1,), float(k + 1)) for k in members]))
    # the root is a global rank
    root = members[-1]
    assert torch.equal(hvd.broadcast(x, root, process_set=mine), torch.full((3,), root + 1.0))
    with pytest.raises(ValueError, match="not a rank of"):
        hvd.broadcast(x, 1 if r != 1 else 0, process_set=mine)
    out, got = hvd.alltoall(torch.arange(float(len(members))) + 10 * r, process_set=mine,
                            splits=[1] * len(members))
    me = mine.rank()
    assert me == members.index(r)
    assert torch.equal(out, torch.tensor([me + 10.0 * k for k in members]))
    rs = hvd.reducescatter(torch.ones(4, 2) * (r + 1), op=hvd.Sum, process_set=mine)
    share = 4 // len(members)
    assert torch.equal(rs, torch.full((share, 2), float(sum(k + 1 for k in members))))
    assert hvd.broadcast_object({"from": members[0]} if r == members[0] else None,
                                root_rank=members[0], process_set=mine) == {"from": members[0]}
    assert hvd.allgather_object(r, process_set=mine) == members
    hvd.barrier(process_set=mine)
    # a collective on a set this rank is not in
    other = alone if r != 1 else pair
    with pytest.raises(ValueError, match="not a member"):
        hvd.allreduce(x, process_set=other)
    # duplicates are refused (every rank raises)
    with pytest.raises(ValueError, match="duplicate"):
        hvd.add_process_set([0, 2])
    # The optimizer on a set averages over its ranks: they train as one process on their
    # concatenated batches; rank 1, outside it, trains on its own (Horovod's optimizer there
    # averages nothing). Sums of two halves instead of one batch: float32 rounding.
    torch.manual_seed(0)
    net = set_net()
    start = {k: v.clone() for k, v in net.state_dict().items()}
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=net.named_parameters(), process_set=pair)
    for step in range(4):
        xb, yb = set_batch(step, r)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(xb), yb).backward()
        opt.step()
    for name, value in set_reference(start, [0, 2] if r != 1 else [1]).items():
        torch.testing.assert_close(net.state_dict()[name], value, rtol=1e-5, atol=1e-6,
                                   msg=f"rank {r}, {name}")
    opt.flush_updates()
    del opt
    assert hvd.remove_process_set(alone) and hvd.remove_process_set(pair)
    assert not hvd.remove_process_set(pair) and not hvd.remove_process_set(hvd.global_process_set)
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(x, process_set=pair)
    hvd.shutdown()
    # static registration through init(process_sets=...)
    evens = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[evens])
    if r != 1:
        assert torch.equal(hvd.allreduce(x, op=hvd.Sum, process_set=evens), torch.full((3,), 4.0))
    hvd.barrier()


def test_process_sets_run_on_their_own_groups():
    run_distributed(_process_set_ranks, 3, timeout=180, env=FAST)


# ---------------------------------------------------------- objects, parameters, state, join
class _Point:                       # not plain data: travels pickled
    def __init__(self, x: int) -> None:
        self.x = x


def _state_ranks() -> dict:
    import dear.horovod as hvd
    hvd.init()
    r = hvd.rank()
    obj = {"a": [1, 2.5, "x"], 3: (None, True), "t": torch.arange(3)} if r == 0 else None
    got = hvd.broadcast_object(obj, root_rank=0)
    assert got["a"] == [1, 2.5, "x"] and got[3] == (None, True)
    assert torch.equal(got["t"], torch.arange(3))
    assert hvd.broadcast_object(_Point(7) if r == 1 else None, root_rank=1).x == 7
    assert hvd.broadcast_object(fractions.Fraction(1, 3 + r), 1) == fractions.Fraction(1, 4)
    assert hvd.allgather_object({"rank": r, "extra": [r] * r}) == \
        [{"rank": k, "extra": [k] * k} for k in range(hvd.size())]
    # parameters: a state_dict, named_parameters() (a generator) and a list
    torch.manual_seed(r)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    net[1].running_mean.fill_(float(r))
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), ref.parameters()))
    assert torch.equal(net[1].running_mean, torch.zeros(4))
    with torch.no_grad():
        net[0].weight.add_(r)
    hvd.broadcast_parameters(net.named_parameters(), root_rank=1)
    assert torch.equal(net[0].weight, ref[0].weight + 1)
    if r == 0:
        with torch.no_grad():
            net[0].weight.copy_(ref[0].weight)
    hvd.broadcast_parameters(list(net.parameters()), root_rank=0)
    assert torch.equal(net[0].weight, ref[0].weight)
    with pytest.raises(ValueError, match="invalid params"):
        hvd.broadcast_parameters(torch.ones(2), root_rank=0)
    # optimizer state: rank 0 has stepped, rank 1 is fresh (Horovod initialises it first)
    model = torch.nn.Linear(3, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.9)
    if r == 0:
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    buf = opt.state[model.weight]["momentum_buffer"]
    assert torch.equal(buf, torch.ones(2, 3))         # d(sum)/dW of rank 0's step
    # a fresh optimizer everywhere: Horovod's zero-gradient step creates the state
    fresh = torch.optim.Adam(model.parameters(), lr=0.01)
    hvd.broadcast_optimizer_state(fresh, root_rank=0)
    assert model.weight.grad is not None and len(fresh.state) == 2
    with pytest.raises(ValueError, match="LBFGS"):
        hvd.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters()), 0)
    # join: rank 1 runs out first; rank 0's allreduces get zeros, averages divide by 2
    averages = []
    if r == 1:
        last = hvd.join()
    else:
        for k in range(3):
            averages.append(hvd.allreduce(torch.full((2,), 4.0 + k)))
        averages.append(hvd.grouped_allreduce([torch.ones(2), torch.full((3,), 6.0)],
                                              op=hvd.Sum))
        with pytest.raises(hvd.HorovodInternalError, match="join"):
            hvd.allgather(torch.ones(1))
        last = hvd.join()
    assert last == 0
    return {"averages": averages}


def test_objects_parameters_state_and_join():
    res = run_distributed(_state_ranks, 2, timeout=180, env=FAST)
    avg = res[0]["averages"]
    assert [a.tolist() for a in avg[:3]] == [[2.0, 2.0], [2.5, 2.5], [3.0, 3.0]]
    assert avg[3][0].tolist() == [1.0, 1.0] and avg[3][1].tolist() == [6.0] * 3


# ---------------------------------------------------------------------------- the optimizer
def _optimizer_ranks() -> dict:
    import dear.horovod as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    ref.load_state_dict(model.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.none, op=hvd.Average)
    assert isinstance(opt, torch.optim.SGD)
    assert set(opt._parameter_names.values()) == {n for n, _ in model.named_parameters()}
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(4):
        g = torch.Generator().manual_seed(10 * step + r)
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        # reference: plain SGD on gradients averaged with torch.distributed itself
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad /= n
        ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1), op=hvd.Adasum)
    with pytest.raises(ValueError, match="Average or hvd.Sum"):
        hvd.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1), op=hvd.Max)
    # fp16 compression is accepted (dear's wire dtype)
    opt16 = hvd.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1),
                                     compression=hvd.Compression.fp16,
                                     process_set=hvd.global_process_set)
    ref(torch.ones(1, 4)).sum().backward()
    opt16.step()
    hvd.shutdown()
    return {}


def test_distributed_optimizer_is_dears():
    run_distributed(_optimizer_ranks, 2, timeout=180, env=FAST)


# ---------------------------------------------------------------------------- errors
def _error_ranks() -> None:
    import dear.horovod as hvd
    with pytest.raises(ValueError, match="not been initialized"):
        hvd.rank()
    hvd.init()
    hvd.init()                                       # again: nothing happens, as Horovod
    r = hvd.rank()
    # ranks that disagree: every rank raises, naming what each rank called
    for bad, what in ((lambda: hvd.allreduce(torch.ones(3 + r)), "float32(3,)"),
                      (lambda: hvd.allreduce(torch.ones(3, dtype=torch.int32 if r else
                                                        torch.float32)), "int32(3,)"),
                      (lambda: hvd.broadcast(torch.ones(2), root_rank=r), "root_rank=1"),
                      (lambda: hvd.allgather(torch.ones(2, 2 + r)), "float32(2, 3)"),
                      (lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum if r else hvd.Max),
                       "op=Max"),
                      (lambda: hvd.allreduce(torch.ones(2)) if r else hvd.barrier(), "barrier")):
        with pytest.raises(hvd.HorovodInternalError, match="rank 0") as info:
            bad()
        assert what in str(info.value) and "rank 1" in str(info.value)
        # the group is still usable: the next collective is right
        assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), 2.0))
    # Adasum is refused clearly, before any communication (NotImplementedError is a
    # RuntimeError, as Horovod's errors for it)
    for call in (lambda: hvd.allreduce(torch.ones(2), op=hvd.Adasum),
                 lambda: hvd.grouped_allreduce([torch.ones(2)], op=hvd.Adasum),
                 lambda: hvd.reducescatter(torch.ones(2), op=hvd.Adasum),
                 lambda: hvd.allreduce_async_(torch.ones(2), op=hvd.Adasum)):
        with pytest.raises(NotImplementedError, match="Adasum is not supported"):
            call()
    # bad input: ValueError on the calling rank, before any communication
    for call, match in (
            (lambda: hvd.alltoall(torch.ones(3), splits=torch.ones(2)), "32-bit"),
            (lambda: hvd.alltoall(torch.ones(3), splits=[1, 1, 1]), "does not equal"),
            (lambda: hvd.alltoall(torch.ones(1), splits=[1, 1]), "greater than"),
            (lambda: hvd.alltoall(torch.ones(3)), "even multiple"),
            (lambda: hvd.allgather(torch.tensor(1.0)), "at least one dimension"),
            (lambda: hvd.reducescatter(torch.tensor(1.0)), "at least one dimension"),
            (lambda: hvd.broadcast(torch.ones(1), root_rank=5), "not a rank"),
            (lambda: hvd.allreduce(torch.ones(1), op=42), "unknown reduction op"),
            (lambda: hvd.add_process_set([0, 0]), "distinct ranks")):
        with pytest.raises(ValueError, match=match):
            call()
    # a name still in flight is refused, as Horovod
    h = hvd.allreduce_async(torch.ones(2), name="busy")
    with pytest.raises(ValueError, match="still in flight"):
        hvd.allreduce_async(torch.ones(2), name="busy")
    hvd.synchronize(h)
    hvd.synchronize(hvd.allreduce_async(torch.ones(2), name="busy"))   # free again
    # mixed devices in one group are refused (CPU only here: a meta tensor stands in)
    with pytest.raises(hvd.HorovodInternalError, match="one device"):
        hvd.grouped_allreduce([torch.ones(1), torch.ones(1, device="meta")])
    hvd.barrier()
    # a rank that never comes: tests/test_fault_timing.py (serial: it times the failure)


def test_errors_are_clear_and_leave_the_group_usable():
    run_distributed(_error_ranks, 2, timeout=150, env={"DEAR_TIMEOUT": "4"})


def _by_name_ranks() -> dict:
    import dear.horovod as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    rounds = hvd.global_process_set.rounds
    # Horovod's duplicate-name test: rank 0 issues before the barrier, the others after it
    x = _data(r, (17, 3), torch.float32)
    want = sum(_data(q, (17, 3), torch.float32) for q in range(n))
    if r == 0:
        first = hvd.allreduce_async(x, name="dup", op=hvd.Sum)
        with pytest.raises(ValueError, match="still in flight"):
            hvd.allreduce_async(x, name="dup")
    hvd.barrier()
    if r > 0:
        first = hvd.allreduce_async(x, name="dup", op=hvd.Sum)
        with pytest.raises(ValueError, match="still in flight"):
            hvd.allreduce_async(x, name="dup")       # issued, no agreement round since
    hvd.barrier()
    assert torch.equal(hvd.synchronize(first), want)
    # every rank its own order of names (and kinds), unnamed calls between them
    names = ["a", "b", "c"]
    order = names[r:] + names[:r]
    rows = {k: 1 + i for i, k in enumerate(names)}          # allgather: + r rows per rank
    handles = {}
    for k in order:
        handles[k] = hvd.allreduce_async(_data(r, (5,), torch.float64, seed=ord(k)), name=k,
                                         op=hvd.Sum)
        handles["g" + k] = hvd.allgather_async(torch.full((rows[k] + r, 2), float(r)),
                                               name="g" + k)
    handles["bc"] = hvd.broadcast_async(torch.full((3,), float(r)), root_rank=n - 1, name="bc")
    unnamed = hvd.allreduce(torch.ones(2), op=hvd.Sum)
    for k in names:
        assert torch.equal(hvd.synchronize(handles[k]),
                           sum(_data(q, (5,), torch.float64, seed=ord(k)) for q in range(n)))
        assert torch.equal(hvd.synchronize(handles["g" + k]),
                           torch.cat([torch.full((rows[k] + q, 2), float(q))
                                      for q in range(n)]))
    assert torch.equal(hvd.synchronize(handles["bc"]), torch.full((3,), float(n - 1)))
    assert torch.equal(unnamed, torch.full((2,), float(n)))
    # one name, different shapes: every rank raises, naming each rank's call
    with pytest.raises(hvd.HorovodInternalError, match="different collectives") as info:
        hvd.allreduce_async(torch.ones(2 + r), name="shape")
    assert all(f"rank {q}" in str(info.value) for q in range(n))
    # names no other rank ever calls: synchronize() raises on every rank (Horovod would hang)
    lonely = hvd.allreduce_async(torch.ones(2), name=f"only{r}")
    with pytest.raises(hvd.HorovodInternalError, match="only0") as info:
        hvd.synchronize(lonely)
    assert all(f"only{q}" in str(info.value) for q in range(n))
    # the group is still usable
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n)))
    # poll() of a held-back call takes part in rounds until the others call it
    if r == 0:
        hvd.barrier()
        polled = hvd.allreduce_async(torch.ones(2), name="pl", op=hvd.Sum)
    else:
        polled = hvd.allreduce_async(torch.ones(2), name="pl", op=hvd.Sum)
        hvd.barrier()
    while not hvd.poll(polled):
        time.sleep(0.01)
    assert torch.equal(hvd.synchronize(polled), torch.full((2,), float(n)))
    # by name inside a process set, in a different order on its two ranks
    pair = hvd.add_process_set([0, 1])
    if r < 2:
        order = ["p", "q"] if r == 0 else ["q", "p"]
        got_pair = {k: hvd.allreduce_async(torch.full((2,), float(r + ord(k))), name=k,
                                           op=hvd.Sum, process_set=pair) for k in order}
        for k in order:
            assert torch.equal(hvd.synchronize(got_pair[k]), torch.full((2,), 1.0 + 2 * ord(k)))
    hvd.remove_process_set(pair)
    # a rank that joins with a named call outstanding waits for it first
    y = torch.full((2,), 3.0 + r)
    if r == 0:
        hvd.barrier()
        got = hvd.allreduce(y, name="j", op=hvd.Sum)
        mirrored = hvd.allreduce(y, op=hvd.Sum)               # the others add zeros
        assert torch.equal(mirrored, y)
    else:
        late = hvd.allreduce_async(y, name="j", op=hvd.Sum)
        hvd.barrier()
        hvd.join()
        got = hvd.synchronize(late)
    if r == 0:
        hvd.join()
    assert torch.equal(got, sum(torch.full((2,), 3.0 + q) for q in range(n)))
    return {"rounds": hvd.global_process_set.rounds - rounds}


def test_named_collectives_match_by_name_in_any_order():
    """Named collectives issued in different orders on 3 ranks (allreduce, allgather with
    different row counts, broadcast) give torch's closed-form results; Horovod's duplicate-name
    sequence (a second call while the first waits, or was issued with no round since) raises
    ValueError; one name with different shapes, and names no other rank calls, raise a
    HorovodInternalError on every rank naming every rank's call, and the group stays usable;
    poll() of a held-back call completes once the others call it; names match inside a process
    set; a rank that joins with a named call outstanding still completes it."""
    res = run_distributed(_by_name_ranks, 3, timeout=180, env=FAST)
    assert len({out["rounds"] for out in res}) == 1     # every rank took part in every round


# -------------------------------------------------------------- launchers and import hygiene
def _slurm_ranks() -> list:
    """As under srun: only SLURM_* variables (dear.comm.launch translates them)."""
    env = os.environ
    rank, world, port = env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):
        env.pop(name)
    env.update({"SLURM_PROCID": rank, "SLURM_NTASKS": world, "SLURM_LOCALID": rank,
                "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": world,
                "SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
    import dear.horovod as hvd
    hvd.init()
    out = [hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(),
           hvd.allreduce(torch.ones(1), op=hvd.Sum).item()]
    hvd.shutdown()
    hvd.init()                                     # again after shutdown
    out.append(hvd.allgather_object(hvd.rank()))
    hvd.shutdown()
    return out


def test_srun_variables_and_reinit():
    res = run_distributed(_slurm_ranks, 2, timeout=120, env=FAST)
    assert res == [[0, 2, 0, 2, 2.0, [0, 1]], [1, 2, 1, 2, 2.0, [0, 1]]]


def test_imports_no_horovod_and_runs_alone():
    """`import dear` does not load dear.horovod; dear.horovod never imports horovod; without
    a launcher hvd.init() is a world of one (as Horovod without horovodrun)."""
    code = (
        "import sys, builtins, torch\n"
        "real = builtins.__import__\n"
        "def guard(name, *a, **k):\n"
        "    if name == 'horovod' or name.startswith('horovod.'):\n"
        "        raise ImportError('horovod must not be imported')\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = guard\n"
        "import dear\n"
        "assert 'dear.horovod' not in sys.modules\n"
        "import dear.horovod as hvd\n"
        "hvd.init()\n"
        "assert (hvd.rank(), hvd.size(), hvd.local_size()) == (0, 1, 1)\n"
        "t = torch.arange(4.0)\n"
        "assert torch.equal(hvd.allreduce(t), t) and torch.equal(hvd.allgather(t), t)\n"
        "assert torch.equal(hvd.alltoall(t), t)\n"
        "assert torch.equal(hvd.reducescatter(t), t)\n"
        "assert hvd.broadcast_object({'k': 1}) == {'k': 1}\n"
        "hvd.shutdown(); hvd.init(); hvd.shutdown()\n"
        "print('ok')\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "HOROVOD_RANK") and not k.startswith(("SLURM_", "OMPI_",
                                                                                "PMI_"))}
    env["PYTHONPATH"] = ROOT
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr


def test_refuses_horovodrun_gloo_launch_clearly():
    code = ("import dear.horovod as hvd\n"
            "try:\n    hvd.init()\nexcept RuntimeError as e:\n    print('refused:', e)\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "PYTHONPATH": ROOT})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert "refused:" in out.stdout and "torchrun" in out.stdout, out.stdout + out.stderr


def test_timeline_calls_warn_instead_of_failing():
    import dear.horovod as hvd
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hvd.start_timeline("/tmp/unused.json")
        hvd.stop_timeline()
    assert any("no Horovod timeline" in str(w.message) for w in caught)
