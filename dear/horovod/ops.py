"""Horovod's collectives as torch.distributed calls: agree (negotiate.py), issue asynchronously,
hand back an integer handle; synchronize(handle) waits and returns the output as Horovod does.

Semantics kept from horovod/torch/mpi_ops.py and its C++ ops: outputs are new tensors unless the
name ends in `_`; Average is a sum scaled by postscale_factor / size (integers: truncated, the
scaling done in float64), prescale_factor scales each rank's input before the sum; allgather
concatenates along dim 0 with any first dimension per rank; reducescatter gives the first
`dim0 % size` ranks one row more; alltoall's handle yields (output, received_splits). Waits on
CPU tensors are bounded by DEAR_TIMEOUT; CUDA (NCCL) waits order the current stream, NCCL's
watchdog bounds them.
"""

from __future__ import annotations

import datetime
import functools
import itertools
import struct
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..comm import runtime
from ..comm.base import ReduceOp
from .basics import ProcessSet, global_process_set, member
from .control import HorovodInternalError, all_gather_flat, reduce_scatter_flat
from .handles import discard, filler, reserve, synchronize, wait_with
from .negotiate import (
    DEVICE,
    DTYPE,
    NUMEL,
    OP,
    Agreed,
    Call,
    Kind,
    code_dtype,
    dtype_code,
    join_rounds,
    negotiate,
    submit,
    wait_matched,
)

Issued = tuple[list[Any], Callable[[], Any]]     # torch's works, and what makes the output

# Horovod's reduction constants (horovod/common/message.h), so `op == hvd.Average` still holds.
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_TORCH_OPS = {Average: dist.ReduceOp.SUM, Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
              Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}
ADASUM_REFUSED = ("Adasum is not supported by dear.horovod (it is Horovod's own algorithm, not "
                  "a torch.distributed reduction): use hvd.Average or hvd.Sum")

# What Gloo and NCCL carry; other dtypes travel as their bytes, or are reduced in a wider type.
_CARRIED = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
            torch.int32, torch.int64, torch.bool}
_WIDER = {torch.int16: torch.int32}
for _name, _wide in (("uint16", torch.int32), ("uint32", torch.int64)):
    if hasattr(torch, _name):
        _WIDER[getattr(torch, _name)] = _wide


def resolve_op(op: Any, average: Optional[bool] = None, default: int = Average) -> int:
    """Horovod's op= / deprecated average= rules; dear.Average and dear.Sum are accepted too."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        if average is None:
            return default
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in "
                      "v1.0", DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    if isinstance(op, ReduceOp):
        return Average if op is ReduceOp.Average else Sum
    if isinstance(op, bool) or op not in (Average, Sum, Adasum, Min, Max, Product):
        raise ValueError(f"unknown reduction op {op!r}: use hvd.Average, hvd.Sum, hvd.Min, "
                         "hvd.Max or hvd.Product")
    if op == Adasum:
        raise NotImplementedError(ADASUM_REFUSED)
    return int(op)


# ------------------------------------------------------------------------------ buffers
def _drain(ps: ProcessSet) -> None:
    """The global set shares the default group with dear.DistributedOptimizer: what its
    backward handed to dear's collective thread is issued first, in the same order everywhere."""
    if ps is global_process_set:
        for opt in runtime.optimizers():
            opt.dear_schedule.drain()


def _f32(x: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def scale(t: torch.Tensor, factor: float) -> None:
    """Horovod's ScaleBuffer: float32 math for float32/float16 (on CUDA, fp16 factors),
    float64 for float64 and integers (then truncated)."""
    if factor == 1.0:
        return
    if t.is_complex() or t.dtype == torch.float64:
        t.mul_(factor)
    elif t.dtype == torch.float32:
        t.mul_(_f32(factor))
    elif t.dtype in (torch.float16, torch.bfloat16):
        f = float(torch.tensor(factor, dtype=t.dtype)) if t.is_cuda else _f32(factor)
        t.copy_(t.float().mul_(f))
    else:
        t.copy_(t.double().mul_(factor))


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype in _CARRIED or dtype.is_complex:
        return dtype
    if dtype in _WIDER:
        return _WIDER[dtype]
    raise TypeError(f"dear.horovod cannot reduce {dtype} tensors")


def _reducible(t: torch.Tensor) -> torch.Tensor:
    """A complex buffer as its real view (sums and scales alike)."""
    return torch.view_as_real(t) if t.is_complex() else t


def _reduce_buffer(inp: torch.Tensor, out: torch.Tensor
                   ) -> tuple[torch.Tensor, Callable[[], object]]:
    """A contiguous buffer holding `inp` in a dtype the backend reduces, and how its result goes
    into `out` (nothing when the buffer is `out` itself)."""
    wire = _wire_dtype(out.dtype)
    if wire == out.dtype and out.is_contiguous():
        buf = out.detach()
        if inp is not out:
            buf.copy_(inp.detach())
        return buf, lambda: None
    buf = inp.detach().to(wire, memory_format=torch.contiguous_format, copy=True)
    return buf, lambda: out.detach().copy_(buf)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` (contiguous) as (dim 0, rest) in a dtype the backends move: its own, or its bytes."""
    rest = 1
    for d in t.shape[1:]:
        rest *= d
    rows = t.reshape(t.shape[0], rest)
    return rows if t.dtype in _CARRIED else rows.view(torch.uint8)


def _flat(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return flat if t.dtype in _CARRIED else flat.view(torch.uint8)


def _check_group(tensors: Sequence[torch.Tensor], what: str) -> None:
    if not tensors:
        raise ValueError(f"{what} needs at least one tensor")
    if len({t.device for t in tensors}) > 1:
        raise HorovodInternalError(f"{what}: all tensors of a group must be on one device, got "
                                   f"{sorted({str(t.device) for t in tensors})}")


def _round_since(ps: ProcessSet, issued_at: int) -> bool:
    return ps.rounds > issued_at


def _submit(ps: ProcessSet, call: Call, issue: Callable[[Agreed], Issued]) -> int:
    """A handle for `call`: agreed on and issued now, or, if it is named and the other ranks
    have not called it yet, when they do (Horovod matches named collectives by name)."""
    handle = reserve(call.name, call.tensors)
    fill = filler(handle)

    def run(agreed: Agreed) -> None:
        _drain(ps)
        fill(*issue(agreed), functools.partial(_round_since, ps, ps.rounds))
    try:
        entry = submit(ps, call, run, deferrable=True)
    except BaseException:
        discard(handle)
        raise
    if entry is not None:
        wait_with(handle, functools.partial(wait_matched, ps, entry))
    return handle


# ------------------------------------------------------------------------------ allreduce
def _allreduce(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
               name: Optional[str], op: int, prescale_factor: float, postscale_factor: float,
               process_set: Optional[ProcessSet], grouped: bool) -> int:
    ps = member(process_set)
    _check_group(inputs, "allreduce")
    extra = [v for t in inputs for v in (dtype_code(t.dtype), t.numel())] if grouped else []
    post = postscale_factor / len(ps.ranks or ()) if op == Average else postscale_factor

    def issue(agreed: Agreed) -> Issued:
        works, steps = [], []
        for inp, out in zip(inputs, outputs):
            buf, back = _reduce_buffer(inp, out)
            scale(buf, prescale_factor)
            works.append(dist.all_reduce(_reducible(buf), op=_TORCH_OPS[op], group=ps.group,
                                         async_op=True))
            steps.append((buf, back))

        def finish() -> Any:
            for buf, back in steps:
                scale(buf, post)
                back()
            return tuple(outputs) if grouped else outputs[0]
        return works, finish
    return _submit(ps, Call(Kind.ALLREDUCE, inputs, op=op, name=name, prescale=prescale_factor,
                            postscale=postscale_factor, extra=extra), issue)


def _mirror_allreduce(ps: ProcessSet, device: int) -> Callable[[torch.Tensor, list[int]], None]:
    """A joined rank's part in an allreduce the others agreed on: zeros, same order, same op."""
    def mirror(ref: torch.Tensor, extra: list[int]) -> None:
        where = torch.device("cpu")
        if int(ref[DEVICE]) == 1:
            where = torch.device("cuda", device if device >= 0 else torch.cuda.current_device())
        pairs = list(zip(extra[0::2], extra[1::2])) if extra else [(int(ref[DTYPE]),
                                                                     int(ref[NUMEL]))]
        timeout = datetime.timedelta(seconds=runtime.config().timeout)
        for code, numel in pairs:
            zeros = torch.zeros(numel, dtype=_wire_dtype(code_dtype(code)), device=where)
            work = dist.all_reduce(_reducible(zeros), op=_TORCH_OPS[int(ref[OP])],
                                   group=ps.group, async_op=True)
            assert work is not None
            work.wait() if zeros.is_cuda else work.wait(timeout)
    return mirror


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None,
                    name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    op = resolve_op(op, average)
    out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _allreduce([tensor], [out], name, op, prescale_factor, postscale_factor,
                      process_set, False)


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None,
                     name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    op = resolve_op(op, average)
    return _allreduce([tensor], [tensor], name, op, prescale_factor, postscale_factor,
                      process_set, False)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In place; returns `tensor`."""
    op = resolve_op(op, average)
    return synchronize(allreduce_async_(tensor, None, name, op, prescale_factor,
                                        postscale_factor, process_set))


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    op = resolve_op(op, average)
    outs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    return _allreduce(list(tensors), outs, name, op, prescale_factor, postscale_factor,
                      process_set, True)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    op = resolve_op(op, average)
    return _allreduce(list(tensors), list(tensors), name, op, prescale_factor,
                      postscale_factor, process_set, True)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> tuple[torch.Tensor, ...]:
    op = resolve_op(op, average)
    return synchronize(grouped_allreduce_async_(tensors, None, name, op, prescale_factor,
                                                postscale_factor, process_set))


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: Any,
                           process_set: ProcessSet = global_process_set
                           ) -> Callable[[], torch.Tensor]:
    """Horovod's: all-gather the indices and values; the returned callable builds the sum (or
    average) as a sparse tensor."""
    op = resolve_op(op)
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    indices = allgather_async(t._indices().transpose(0, 1).contiguous(), name=f"{name}.indices",
                              process_set=process_set)
    # torch's sparse tensor: _values() is its COO values without coalescing
    values = allgather_async(t._values(), name=f"{name}.values",  # noqa: SLF001
                             process_set=process_set)
    set_size = member(process_set).size() or 1

    def handle() -> torch.Tensor:
        vals = synchronize(values)
        idx = synchronize(indices)
        vals = vals / set_size if op == Average else vals
        if idx.dim() == 0 or vals.dim() == 0:
            return t.new().resize_as_(t)
        return torch.sparse_coo_tensor(idx.transpose(0, 1), vals, t.size(),
                                       check_invariants=False)
    return handle


# ------------------------------------------------------------------------------ allgather
def _allgather(inputs: Sequence[torch.Tensor], name: Optional[str],
               process_set: Optional[ProcessSet], grouped: bool) -> int:
    ps = member(process_set)
    _check_group(inputs, "allgather")
    if any(t.dim() == 0 for t in inputs):
        raise ValueError("allgather concatenates along dimension 0: a tensor needs at least one "
                         "dimension (use tensor.reshape(1))")
    many = len(inputs) > 1

    def issue(agreed: Agreed) -> Issued:
        works: list[Any] = []
        makers: list[Callable[[], torch.Tensor]] = []
        for i, t in enumerate(inputs):
            dims = [row[i] for row in agreed.extra] if many else agreed.mine
            x = t.detach().contiguous()
            rest = tuple(x.shape[1:])
            top = max(dims)
            if all(d == top for d in dims):
                out = x.new_empty((sum(dims),) + rest)
                if out.numel():
                    works.append(all_gather_flat(_rows(out), _rows(x), group=ps.group,
                                                 async_op=True))
                makers.append(functools.partial(_same, out))
                continue
            padded = x.new_zeros((top,) + rest)       # equal sizes on the wire, cut afterwards
            padded[:x.shape[0]] = x
            big = x.new_empty((len(dims) * top,) + rest)
            works.append(all_gather_flat(_rows(big), _rows(padded), group=ps.group,
                                         async_op=True))
            makers.append(functools.partial(_unpad, big, dims, top))

        def finish() -> Any:
            outs = tuple(make() for make in makers)
            return outs if grouped else outs[0]
        return works, finish
    return _submit(ps, Call(Kind.ALLGATHER, inputs, name=name, first_dim_free=True,
                            mine=0 if many else int(inputs[0].shape[0]),
                            extra=[int(t.shape[0]) for t in inputs] if many else []), issue)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _unpad(big: torch.Tensor, dims: list[int], top: int) -> torch.Tensor:
    return torch.cat([big[r * top:r * top + d] for r, d in enumerate(dims)])


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> int:
    return _allgather([tensor], name, process_set, False)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> int:
    return _allgather(list(tensors), name, process_set, True)


# ------------------------------------------------------------------------------ broadcast
def _broadcast(inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], root_rank: int,
               name: Optional[str], process_set: Optional[ProcessSet], grouped: bool) -> int:
    ps = member(process_set)
    _check_group(inputs, "broadcast")
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) \
            or root_rank not in (ps.ranks or ()):
        raise ValueError(f"root_rank {root_rank!r} is not a rank of {ps} (roots are global "
                         "ranks)")

    def issue(agreed: Agreed) -> Issued:
        works, backs = [], []
        for out in targets:
            if out.is_contiguous():
                buf = out.detach()
            else:
                buf = out.detach().contiguous()
                backs.append(lambda out=out, buf=buf: out.detach().copy_(buf))
            works.append(dist.broadcast(_flat(buf), src=root_rank, group=ps.group,
                                        async_op=True))

        def finish() -> Any:
            for back in backs:
                back()
            return tuple(targets) if grouped else targets[0]
        return works, finish
    return _submit(ps, Call(Kind.BROADCAST, inputs, root=root_rank, name=name), issue)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> int:
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    return _broadcast([tensor], [out], root_rank, name, process_set, False)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> int:
    return _broadcast([tensor], [tensor], root_rank, name, process_set, False)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In place; returns `tensor`."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def grouped_broadcast_(tensors: Sequence[torch.Tensor], root_rank: int,
                       name: Optional[str] = None,
                       process_set: ProcessSet = global_process_set) -> tuple[torch.Tensor, ...]:
    """Several tensors in place after one agreement round (broadcast_parameters)."""
    return synchronize(_broadcast(list(tensors), list(tensors), root_rank, name, process_set,
                                  True))


# ------------------------------------------------------------------------------- alltoall
def _splits(tensor: torch.Tensor, splits: Any, n: int) -> tuple[list[int], torch.device]:
    """Horovod's checks of `splits` (ValueError, before any communication)."""
    if tensor.dim() == 0:
        raise ValueError("alltoall splits dimension 0: the tensor needs at least one dimension")
    rows = int(tensor.shape[0])
    if splits is None:
        if rows % n:
            raise ValueError("splits not provided, but first dimension of tensor is not an even "
                             f"multiple of the number of workers ({rows} rows, {n} ranks).")
        return [rows // n] * n, torch.device("cpu")
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise ValueError("alltoall expects splits to contain 32-bit integer elements, got "
                             f"{splits.dtype}.")
        if splits.dim() > 1:
            raise ValueError("alltoall expects a 1D splits tensor")
        values, where = [int(v) for v in splits.tolist()], splits.device
    else:
        values, where = [int(v) for v in splits], torch.device("cpu")
    if len(values) != n:
        raise ValueError(f"Number of entries in splits ({len(values)}) does not equal number of "
                         f"workers ({n}).")
    if any(v < 0 for v in values):
        raise ValueError(f"alltoall splits must be >= 0, got {values}")
    if sum(values) > rows:
        raise ValueError(f"Sum of splits entries ({sum(values)}) is greater than the first "
                         f"dimension of tensor ({rows}).")
    return values, where


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Row `splits[j]` of dim 0 go to set rank j; synchronize() returns (output,
    received_splits), int32 on the splits' device."""
    ps = member(process_set)
    sent, where = _splits(tensor, splits, len(ps.ranks or ()))

    def issue(agreed: Agreed) -> Issued:
        me = ps.rank() or 0
        received = [row[me] for row in agreed.extra]
        x = tensor.detach()[:sum(sent)].contiguous()
        out = x.new_empty((sum(received),) + tuple(x.shape[1:]))
        work = dist.all_to_all_single(_rows(out), _rows(x), output_split_sizes=received,
                                      input_split_sizes=sent, group=ps.group, async_op=True)
        splits_out = torch.tensor(received, dtype=torch.int32, device=where)
        return [work], lambda: (out, splits_out)
    return _submit(ps, Call(Kind.ALLTOALL, [tensor], name=name, first_dim_free=True, extra=sent),
                   issue)


# -------------------------------------------------------------------------- reducescatter
def _shares(rows: int, n: int) -> list[int]:
    """Horovod's split of dim 0: the first rows % n ranks get one row more."""
    return [rows // n + (1 if r < rows % n else 0) for r in range(n)]


def _reducescatter(inputs: Sequence[torch.Tensor], name: Optional[str], op: Any,
                   process_set: Optional[ProcessSet], prescale_factor: float,
                   postscale_factor: float, grouped: bool) -> int:
    ps = member(process_set)
    op = resolve_op(op)
    _check_group(inputs, "reducescatter")
    if any(t.dim() == 0 for t in inputs):
        raise ValueError("reducescatter splits dimension 0: a tensor needs at least one "
                         "dimension")
    n, me = len(ps.ranks or ()), ps.rank() or 0
    post = postscale_factor / n if op == Average else postscale_factor

    def issue(agreed: Agreed) -> Issued:
        works: list[Any] = []
        makers: list[Callable[[], torch.Tensor]] = []
        for t in inputs:
            x = t.detach().to(memory_format=torch.contiguous_format, copy=True)
            scale(x, prescale_factor)
            shares, rest = _shares(int(x.shape[0]), n), tuple(x.shape[1:])
            if x.is_cuda:                  # NCCL's reduce-scatter on equal, padded chunks
                wire = x.to(_wire_dtype(x.dtype))
                top = shares[0]
                padded = wire.new_zeros((n * top,) + rest)
                for r, start in enumerate(itertools.accumulate([0] + shares[:-1])):
                    padded[r * top:r * top + shares[r]] = wire[start:start + shares[r]]
                mine = wire.new_empty((top,) + rest)
                works.append(reduce_scatter_flat(_reducible(mine), _reducible(padded),
                                                 op=_TORCH_OPS[op], group=ps.group, async_op=True))
                makers.append(functools.partial(_first_rows, mine, shares[me], x.dtype))
                continue
            # Gloo: every rank's rows of this rank's share (one all-to-all), reduced here
            got = x.new_empty((n * shares[me],) + rest)
            works.append(dist.all_to_all_single(_rows(got), _rows(x),
                                                output_split_sizes=[shares[me]] * n,
                                                input_split_sizes=shares, group=ps.group,
                                                async_op=True))
            makers.append(functools.partial(_reduce_local, got.view((n, shares[me]) + rest), op))

        def finish() -> Any:
            outs = []
            for make in makers:
                out = make()
                scale(out, post)
                outs.append(out)
            return tuple(outs) if grouped else outs[0]
        return works, finish
    return _submit(ps, Call(Kind.REDUCESCATTER, inputs, op=op, name=name,
                            prescale=prescale_factor, postscale=postscale_factor), issue)


def _first_rows(t: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    return t[:rows].to(dtype)


def _reduce_local(stacked: torch.Tensor, op: int) -> torch.Tensor:
    """Reduce (ranks, rows, ...) over the ranks, in rank order, in the tensor's dtype."""
    if op in (Average, Sum):
        return stacked.sum(0, dtype=stacked.dtype)
    if op == Min:
        return stacked.amin(0)
    if op == Max:
        return stacked.amax(0)
    return stacked.prod(0, dtype=stacked.dtype)


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: Any = Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    return _reducescatter([tensor], name, op, process_set, prescale_factor, postscale_factor,
                          False)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                                op: Any = Average, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    return _reducescatter(list(tensors), name, op, process_set, prescale_factor,
                          postscale_factor, True)


# ------------------------------------------------------------------------- barrier, join
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every member has called barrier() (issued collectives are not waited for)."""
    negotiate(member(process_set), Call(Kind.BARRIER))


def join(device: int = -1) -> int:
    """This rank has no more data: it adds zeros to the others' allreduces (averages still
    divide by the whole set size) until every rank has joined. Returns the rank that joined
    last. dear.DistributedOptimizer's collectives are not mirrored: use dear.join(optimizer)."""
    ps = member(None)
    _drain(ps)
    return join_rounds(ps, _mirror_allreduce(ps, device))
