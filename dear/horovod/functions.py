"""Objects, parameters, optimizer state and the optimizer (horovod/torch/functions.py and
optimizer.py): dear's DistributedOptimizer behind Horovod's arguments.

Objects travel in dear's plain-data encoding (dear/comm/wire.py) when they are plain values and
CPU tensors; anything else (numpy arrays, user classes) is pickled, as Horovod (cloudpickle) and
torch.distributed do, so a receiving rank unpickles what its root sent over the job's own Gloo
connections (never bytes from the rendezvous store).
"""

from __future__ import annotations

import pickle
from typing import Any, Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist

from ..comm import runtime, wire
from ..engine.optimizer import DistributedOptimizer as _dear_optimizer
from ..guards.validation import named_params_of
from .basics import (
    ProcessSet,
    allgather_bytes,
    check_initialized,
    global_process_set,
    member,
    rank,
    size,
)
from .compression import Compression
from .negotiate import Call, Kind, negotiate
from .ops import ADASUM_REFUSED, Adasum, Average, Max, Min, Product, grouped_broadcast_


def _dumps(obj: Any) -> bytes:
    try:
        return b"W" + wire.encode(obj)
    except TypeError:
        return b"P" + pickle.dumps(obj)


def _loads(data: bytes) -> Any:
    if data[:1] == b"W":
        return wire.decode(data[1:])
    if data[:1] == b"P":
        return pickle.loads(data[1:])
    raise ValueError("dear.horovod: an object from another rank could not be decoded")


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """`root_rank`'s object on every member of the set (root_rank is a global rank)."""
    ps = member(process_set)
    ranks = ps.ranks or []
    if root_rank not in ranks:
        raise ValueError(f"root_rank {root_rank!r} is not a rank of {ps}")
    payload = _dumps(obj) if rank() == root_rank else b""
    agreed = negotiate(ps, Call(Kind.BROADCAST_OBJECT, root=root_rank, name=name,
                                mine=len(payload)))
    nbytes = agreed.mine[ranks.index(root_rank)]
    if nbytes == 0:
        return obj
    buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if rank() == root_rank
           else torch.empty(nbytes, dtype=torch.uint8))
    dist.broadcast(buf, src=root_rank, group=ps.control)
    return obj if rank() == root_rank else _loads(buf.numpy().tobytes())


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every member's object, in set-rank order."""
    ps = member(process_set)
    payload = _dumps(obj)
    agreed = negotiate(ps, Call(Kind.ALLGATHER_OBJECT, name=name, mine=len(payload)))
    rows = allgather_bytes(payload, ps.control, agreed.mine)
    me = ps.rank()
    return [obj if r == me else _loads(row) for r, row in enumerate(rows)]


Params = Union[Mapping[str, torch.Tensor], Iterable[Any]]


def broadcast_parameters(params: Params, root_rank: int = 0) -> None:
    """Copy `root_rank`'s tensors into every rank's, in place: a state_dict (sorted by name, as
    Horovod), named_parameters() or parameters(); pending dear updates are applied first."""
    check_initialized()
    if isinstance(params, Mapping):
        items = sorted(params.items())
    elif isinstance(params, Iterable) and not isinstance(params, torch.Tensor):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    tensors = [p for _, p in items]
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"broadcast_parameters expects tensors, got {type(t)}")
    runtime.flush_all()
    devices = list(dict.fromkeys(t.device for t in tensors))
    for device in devices:                 # one agreement round per device
        grouped_broadcast_([t.detach() for t in tensors if t.device == device], root_rank)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              model: Optional[torch.nn.Module] = None) -> None:
    """Horovod's: an optimizer without state first takes a step with zero gradients (its own
    step, no communication) so that every rank has the same state layout; then every rank
    takes `root_rank`'s state and hyperparameters. Stateless optimizers: nothing is sent."""
    check_initialized()
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    runtime.flush_all()
    if len(optimizer.state_dict()["state"]) == 0:
        _initialize_state(optimizer, model)
        if len(optimizer.state_dict()["state"]) == 0:
            return
    runtime.broadcast_optimizer_state(optimizer, root_rank)


def _initialize_state(optimizer: torch.optim.Optimizer, model: Optional[torch.nn.Module]) -> None:
    sparse = {id(p) for m in (model.modules() if model is not None else ())
              if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p.data)
                if isinstance(optimizer, torch.optim.SparseAdam) or \
                        (isinstance(optimizer, torch.optim.SGD) and id(p) in sparse):
                    p.grad = p.grad.to_sparse()
    from ..engine.wrapper import _DistributedOptimizer
    if isinstance(optimizer, _DistributedOptimizer):
        super(_DistributedOptimizer, optimizer).step()   # the wrapped class's own step
    else:
        optimizer.step()


def DistributedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802 (Horovod's name)
                         named_parameters: Any = None, compression: Any = Compression.none,
                         backward_passes_per_step: int = 1, op: Any = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False,
                         process_set: Optional[ProcessSet] = global_process_set,
                         **options: Any) -> torch.optim.Optimizer:
    """dear.DistributedOptimizer with Horovod's arguments in Horovod's positions (dear's own,
    such as model=, as keywords). A process set of some ranks: the optimizer averages over
    those ranks (every member creates it), and on a rank outside the set over none, as
    Horovod's."""
    if named_parameters is not None:          # Horovod checks the names before hvd.init()
        named_parameters = list(named_parameters)
        named_params_of(optimizer, named_parameters, None, sparse_as_dense)
    check_initialized()
    if process_set is not None and not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set must be a ProcessSet, got {process_set!r}")
    if process_set is not None and process_set.ranks == list(range(size())):
        process_set = global_process_set       # every rank: dear's own communicator
    if not isinstance(op, bool) and op == Adasum:
        raise NotImplementedError(ADASUM_REFUSED)
    if not isinstance(op, bool) and op in (Min, Max, Product):
        raise ValueError("DistributedOptimizer averages or sums gradients: op must be "
                         "hvd.Average or hvd.Sum")
    wrapped: Any = _dear_optimizer(optimizer, named_parameters, compression,
                                   backward_passes_per_step, op, gradient_predivide_factor,
                                   num_groups, groups, sparse_as_dense, process_set, **options)
    return wrapped


class SyncBatchNorm(torch.nn.SyncBatchNorm):
    """Horovod's signature on torch.nn.SyncBatchNorm (statistics over the process set; CUDA
    inputs, as torch's)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: ProcessSet = global_process_set) -> None:
        group = None if process_set is global_process_set else member(process_set).group
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         process_group=group)
