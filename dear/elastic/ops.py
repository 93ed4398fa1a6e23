"""The few collectives the elastic state needs, behind one small object so that dear.elastic
runs on dear's communicator and dear.horovod.elastic on Horovod's API (its agreement rounds),
with one implementation of everything else."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..comm import runtime, wire


@dataclass(frozen=True)
class Ops:
    """rank/size of the moment, and broadcasts from a root and an all-gather of objects, each
    called by every rank in the same order."""

    rank: Callable[[], int]
    size: Callable[[], int]
    broadcast_object: Callable[[Any, int], Any]
    allgather_object: Callable[[Any], list[Any]]
    broadcast_parameters: Callable[[Any, int], None]
    broadcast_optimizer_state: Callable[[torch.optim.Optimizer, int], None]


def _running() -> bool:
    return runtime.is_initialized() or (dist.is_available() and dist.is_initialized())


def _rank() -> int:
    return runtime.rank() if _running() else 0


def _size() -> int:
    return runtime.size() if _running() else 1


def _plain_or_pickled(obj: Any) -> tuple[str, Any]:
    """dear's plain-data encoding where it can carry `obj`, else pickle's bytes (the user's
    own objects in an ObjectState, as Horovod pickles them)."""
    try:
        wire.encode(obj)
    except (TypeError, ValueError):
        return "pickle", pickle.dumps(obj)
    return "plain", obj


def _broadcast_object(obj: Any, root: int) -> Any:
    if not _running():
        return obj
    comm = runtime.communicator()
    runtime.flush_all()                        # after whatever an optimizer left in flight
    kind, value = comm.broadcast_object(_plain_or_pickled(obj) if comm.rank == root else None,
                                        root)
    if comm.rank == root:
        return obj
    return pickle.loads(value) if kind == "pickle" else value


def _allgather_object(obj: Any) -> list[Any]:
    if not _running():
        return [obj]
    comm = runtime.communicator()
    runtime.flush_all()
    return list(comm.all_gather_object(obj))


def _broadcast_parameters(params: Any, root: int) -> None:
    if _running():
        runtime.broadcast_parameters(params, root)


def _broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root: int) -> None:
    if _running():
        runtime.broadcast_optimizer_state(optimizer, root)


#: dear's own: its communicator (dear.init(), or started on torch.distributed's default group),
#: a world of one when neither runs.
DEAR = Ops(rank=_rank, size=_size, broadcast_object=_broadcast_object,
           allgather_object=_allgather_object, broadcast_parameters=_broadcast_parameters,
           broadcast_optimizer_state=_broadcast_optimizer_state)


__all__ = ["DEAR", "Ops"]
