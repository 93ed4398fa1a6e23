"""The differentiable collectives: hvd.allreduce, allgather, broadcast, alltoall, reducescatter
and their grouped forms, with Horovod's backward rules (horovod/torch/mpi_ops.py) and
`compression=` around the call. The backward passes run collectives too, so every rank must
run the same backward."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch.autograd import Function

from . import ops
from .basics import ProcessSet, global_process_set, member, rank
from .compression import Compression
from .ops import Average, Sum, resolve_op


class _Allreduce(Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str], op: int, pre: float,
                post: float, ps: ProcessSet) -> torch.Tensor:
        ctx.op, ctx.pre, ctx.post, ctx.ps = op, pre, post, ps
        return ops.synchronize(ops.allreduce_async(tensor, None, name, op, pre, post, ps))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return (allreduce(grad, op=ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post,
                          process_set=ctx.ps), None, None, None, None, None)


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """A new tensor: the average (default) or Sum/Min/Max/Product of `tensor` over the set."""
    op = resolve_op(op, average)
    compressed, ctx = compression.compress(tensor)
    out = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


class _GroupedAllreduce(Function):
    @staticmethod
    def forward(ctx: Any, name: Optional[str], op: int, pre: float, post: float, ps: ProcessSet,
                *tensors: torch.Tensor) -> Any:
        ctx.op, ctx.pre, ctx.post, ctx.ps = op, pre, post, ps
        return ops.synchronize(ops.grouped_allreduce_async(list(tensors), None, name, op, pre,
                                                           post, ps))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        reduced = grouped_allreduce(list(grads), op=ctx.op, prescale_factor=ctx.pre,
                                    postscale_factor=ctx.post, process_set=ctx.ps)
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: Any = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """allreduce of each tensor after one agreement round."""
    op = resolve_op(op, average)
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, process_set,
                                   *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


class _Allgather(Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str],
                ps: ProcessSet) -> torch.Tensor:
        ctx.dim, ctx.ps = tensor.shape[0] if tensor.dim() else 0, ps
        return ops.synchronize(ops.allgather_async(tensor, name, ps))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _gather_grad(grad, ctx.dim, ctx.ps), None, None


def _gather_grad(grad: torch.Tensor, dim: int, ps: ProcessSet) -> torch.Tensor:
    """Horovod's allgather gradient: the average of the gradients, this rank's rows."""
    reduced = allreduce(grad, op=Average, process_set=ps)
    dims = allgather(torch.tensor([dim], dtype=torch.int32), process_set=ps)
    offset = int(dims[:member(ps).rank() or 0].sum())
    return reduced.narrow(0, offset, dim)


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every member's tensor concatenated along dim 0 (first dimensions may differ)."""
    return _Allgather.apply(tensor, name, process_set)


class _GroupedAllgather(Function):
    @staticmethod
    def forward(ctx: Any, name: Optional[str], ps: ProcessSet, *tensors: torch.Tensor) -> Any:
        ctx.dims, ctx.ps = [t.shape[0] if t.dim() else 0 for t in tensors], ps
        return ops.synchronize(ops.grouped_allgather_async(list(tensors), name, ps))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        return (None, None, *[_gather_grad(g, d, ctx.ps) for g, d in zip(grads, ctx.dims)])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


class _Broadcast(Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Optional[str],
                ps: ProcessSet) -> torch.Tensor:
        ctx.root, ctx.ps = root_rank, ps
        return ops.synchronize(ops.broadcast_async(tensor, root_rank, name, ps))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = allreduce(grad, op=Average, process_set=ctx.ps)
        if rank() != ctx.root:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """A new tensor holding `root_rank`'s (a global rank) values; `tensor` is left as it is."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


class _Alltoall(Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Optional[str],
                ps: ProcessSet) -> Any:
        out, received = ops.synchronize(ops.alltoall_async(tensor, splits, name, ps))
        ctx.ps, ctx.received = ps, received
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> Any:
        back, _ = alltoall(grad, splits=ctx.received, process_set=ctx.ps)
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Rows of dim 0 scattered by `splits` (default: equal shares), gathered from everyone;
    returns the output, and with `splits` given (output, received_splits) as Horovod 0.28."""
    return _Alltoall.apply(tensor, splits, name, process_set)


class _Reducescatter(Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str], op: int, ps: ProcessSet,
                pre: float, post: float) -> torch.Tensor:
        ctx.op, ctx.ps, ctx.pre, ctx.post = op, ps, pre, post
        return ops.synchronize(ops.reducescatter_async(tensor, name, op, ps, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return allgather(_scatter_grad(ctx, grad), process_set=ctx.ps), None, None, None, \
            None, None


def _scatter_grad(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    """Horovod's reducescatter gradient scale: the set size for Sum, and both factors."""
    if ctx.op == Sum:
        grad = grad * (member(ctx.ps).size() or 1)
    if ctx.pre != 1.0:
        grad = grad * ctx.pre
    if ctx.post != 1.0:
        grad = grad * ctx.post
    return grad


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None,
                  compression: Any = Compression.none, op: Any = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """This rank's share of dim 0 (the first dim0 % size ranks get one row more) of the
    average (default) or sum over the set."""
    op = resolve_op(op)
    compressed, ctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor,
                               postscale_factor)
    return compression.decompress(out, ctx)


class _GroupedReducescatter(Function):
    @staticmethod
    def forward(ctx: Any, name: Optional[str], op: int, ps: ProcessSet, pre: float, post: float,
                *tensors: torch.Tensor) -> Any:
        ctx.op, ctx.ps, ctx.pre, ctx.post = op, ps, pre, post
        return ops.synchronize(ops.grouped_reducescatter_async(list(tensors), name, op, ps, pre,
                                                               post))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        gathered = grouped_allgather([_scatter_grad(ctx, g) for g in grads],
                                     process_set=ctx.ps)
        return (None, None, None, None, None, *gathered)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: Any = Compression.none, op: Any = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    op = resolve_op(op)
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,
                                       *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]
