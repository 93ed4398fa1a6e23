"""Horovod's elastic API (`hvd.elastic`) on torch.distributed, with no Horovod installed:
`run`, `TorchState`, `ObjectState`, `State`, `ElasticSampler`, with Horovod's signatures and
semantics, over dear.elastic's machinery (one implementation; this module only binds it to
Horovod's collectives and errors).

Membership comes from torchrun's elastic agent (`torchrun --nnodes MIN:MAX --max-restarts N
--rdzv-backend c10d ...`): every change restarts the workers, so `run` resumes each new
generation from the last commit (written to DEAR_ELASTIC_DIR by `commit()`), runs the reset
callbacks and `sync()`, and `hvd.size()` / `hvd.rank()` are the new ones. Without torchrun,
Horovod's in-process loop (restore on HorovodInternalError, reset = hvd.shutdown(); hvd.init()).
docs/elastic.md says what differs from Horovod.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

from ..elastic import ElasticSampler as _Sampler
from ..elastic import HostsUpdatedInterrupt, HostUpdateResult, register_recoverable, run_fn
from ..elastic import ObjectState as _ObjectState
from ..elastic import State as _State
from ..elastic.handlers import get_handler_registry, set_handler_registry
from ..elastic.ops import Ops
from .basics import init, rank, shutdown, size
from .control import HorovodInternalError
from .functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)

register_recoverable(HorovodInternalError)

R = TypeVar("R")

#: Horovod's collectives (agreement rounds and all), for the state's synchronization.
HOROVOD = Ops(rank=rank, size=size,
              broadcast_object=lambda obj, root: broadcast_object(obj, root_rank=root),
              allgather_object=lambda obj: allgather_object(obj),
              broadcast_parameters=lambda params, root: broadcast_parameters(params, root),
              broadcast_optimizer_state=lambda opt, root: broadcast_optimizer_state(opt, root))


class State(_ObjectState):
    """Horovod's `State(bcast_object, get_rank)`: the base of custom states (override save,
    restore and sync; ObjectState keeps no attributes of its own here)."""

    def __init__(self, bcast_object: Optional[Callable[[Any], Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None) -> None:
        super().__init__(bcast_object, get_rank, ops=HOROVOD)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class ObjectState(_ObjectState):
    """Horovod's `ObjectState(bcast_object, get_rank, **kwargs)`: plain objects as
    attributes. Both functions may be omitted (Horovod's broadcast_object and rank)."""

    def __init__(self, bcast_object: Optional[Callable[[Any], Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None, **kwargs: Any) -> None:
        super().__init__(bcast_object, get_rank, ops=HOROVOD, **kwargs)


class TorchState(_State):
    """Horovod's `TorchState(model=None, optimizer=None, **kwargs)`: models, optimizers
    (dear.DistributedOptimizer too, sharded state included), ElasticSampler, dear.KFAC, LR
    schedulers by handler; other keyword arguments are plain attributes."""

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer, ops=HOROVOD, **kwargs)


class ElasticSampler(_Sampler):
    """Horovod's `ElasticSampler(dataset, shuffle=True, seed=0)`, on hvd.rank()/hvd.size()."""

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        super().__init__(dataset, shuffle, seed, rank_size=lambda: (rank(), size()))


def _reset() -> None:
    shutdown()
    init()


def run(func: Callable[..., R]) -> Callable[..., Optional[R]]:
    """Horovod's `@hvd.elastic.run`: `func(state, ...)` runs elastically (see the module's
    docstring). As in Horovod, `func` must not start with a collective: a new worker
    synchronizes the state first."""
    return run_fn(func, _reset)


__all__ = ["ElasticSampler", "HorovodInternalError", "HostUpdateResult",
           "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState",
           "get_handler_registry", "run", "set_handler_registry"]
