"""The elastic state: what a commit saves and what a reset brings back (Horovod's State,
ObjectState and TorchState, with one implementation for dear.elastic and dear.horovod.elastic).

`commit()` = `save()` (a copy in memory: `restore()` returns to it inside the process, as in
Horovod) + inside run() under torchrun, the same state written to the commit directory (it
outlives the process: dear/elastic/commit.py) + `check_host_updates()` (raises
HostsUpdatedInterrupt on every rank at the same commit when the set of workers changes).
`sync()` makes every rank hold rank 0's (a new worker, or after a restore).
"""

from __future__ import annotations

import copy
import dataclasses
import queue
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional

from .commit import pack, unpack
from .errors import HostsUpdatedInterrupt, HostUpdateResult
from .handlers import Handler, handler_for
from .ops import DEAR, Ops

if TYPE_CHECKING:
    from .session import Session

_HANDLER_PREFIX = "state."
_OBJECTS = "objects"


class BaseState:
    """Horovod's `State`: reset callbacks, commit, host updates. `save`, `restore` and `sync`
    are the subclass's. `bcast_object` and `get_rank` are Horovod's arguments (they replace
    how objects are broadcast and the rank is read); `ops` replaces every collective."""

    def __init__(self, bcast_object: Optional[Callable[[Any], Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None, *,
                 ops: Optional[Ops] = None) -> None:
        base = ops or DEAR
        if bcast_object is not None:
            base = dataclasses.replace(base, broadcast_object=_root_zero(bcast_object))
        if get_rank is not None:
            base = dataclasses.replace(base, rank=get_rank)
        self._ops = base
        self._host_messages: queue.Queue = queue.Queue()
        self._last_updated_timestamp: float = 0
        self._reset_callbacks: list[Callable[[], None]] = []
        self._session: Optional[Session] = None      # set by run() under torchrun

    @property
    def ops(self) -> Ops:
        return self._ops

    def attach(self, session: Optional["Session"]) -> None:
        """run() under torchrun: where commits go (None: in memory only)."""
        self._session = session

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Callbacks run after every reset (a worker added or lost; under torchrun, every
        restart of the workers), before sync(): e.g. the learning rate for the new size."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update_res: int) -> None:
        """A notification that the hosts changed (Horovod's driver calls this; tests may)."""
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Save the state (in memory, and under torchrun in the commit directory), then check
        for a change of the workers (HostsUpdatedInterrupt, after which nothing is lost).
        Every rank calls it at the same step. A commit costs a copy of the state (and its
        write): commit every few batches to trade that against the work a failure loses."""
        self.save()
        if self._session is not None:
            self._session.persist(self)
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt on every rank if any rank learnt that the workers
        change: a notification (on_hosts_updated), SIGTERM from torchrun's agent, a node
        waiting in torchrun's rendezvous. One small all-gather: every rank decides alike."""
        prev = last = self._last_updated_timestamp
        update = HostUpdateResult.no_update
        while not self._host_messages.empty():
            timestamp, result = self._host_messages.get()
            if timestamp > last:
                last = timestamp
                update |= HostUpdateResult(int(result))
        session = self._session
        stopping, waiting = session.host_update() if session is not None else (False, None)
        rows = self._ops.allgather_object(
            (last, int(update), bool(stopping), -1 if waiting is None else int(waiting)))
        newest = max(row[0] for row in rows)
        combined = HostUpdateResult.no_update
        for row in rows:
            if row[0] > prev:
                combined |= HostUpdateResult(int(row[1]))
        any_stop = any(row[2] for row in rows)
        most_waiting = max(row[3] for row in rows)
        self._last_updated_timestamp = newest
        if session is not None:
            session.agreed_waiting = None if most_waiting < 0 else most_waiting
        if newest > prev or any_stop or most_waiting > 0:
            only_removed = combined == HostUpdateResult.removed and not most_waiting > 0
            raise HostsUpdatedInterrupt(bool(only_removed))

    def save(self) -> None:
        """Save the state in memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Return to the last commit, undoing what changed since."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank hold rank 0's state."""
        raise NotImplementedError

    def reset(self) -> None:
        """After a reset, before the callbacks and sync()."""

    # ------------------------------------------------ the commit directory (subclasses')
    def commit_items(self, rank: int) -> dict[str, Any]:
        """What a commit writes for this rank (replicated items and this rank's own)."""
        return {}

    def commit_template(self, keys: Mapping[str, Any], old_world: int, rank: int,
                        world: int) -> dict[str, Any]:
        """What to read back from a commit made on `old_world` ranks."""
        return {}

    def apply_commit(self, loaded: dict[str, Any], old_world: int, rank: int,
                     world: int) -> None:
        """Put what commit_template() read in place."""


def _root_zero(bcast_object: Callable[[Any], Any]) -> Callable[[Any, int], Any]:
    """Horovod's bcast_object(obj) (root 0) as Ops.broadcast_object(obj, root)."""
    def broadcast(obj: Any, root: int) -> Any:
        if root != 0:
            raise ValueError("a bcast_object given to the state broadcasts from rank 0 only")
        return bcast_object(obj)
    return broadcast


class ObjectState(BaseState):
    """Plain Python objects, each a keyword argument and an attribute (Horovod's
    ObjectState). save() keeps a deep copy (so restore() undoes changes made in place); sync()
    takes rank 0's; a commit writes them once (pickled: the commit directory must be trusted
    storage, as any checkpoint)."""

    def __init__(self, bcast_object: Optional[Callable[[Any], Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None, *, ops: Optional[Ops] = None,
                 **kwargs: Any) -> None:
        self._saved_state: dict[str, Any] = dict(kwargs)
        super().__init__(bcast_object, get_rank, ops=ops)
        self._set_attrs()

    def save(self) -> None:
        self._saved_state = {attr: _copied(getattr(self, attr)) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._ops.broadcast_object(self._saved_state, 0)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, _copied(value))

    def commit_items(self, rank: int) -> dict[str, Any]:
        return {_OBJECTS: pack(self._saved_state)} if self._saved_state else {}

    def commit_template(self, keys: Mapping[str, Any], old_world: int, rank: int,
                        world: int) -> dict[str, Any]:
        return {_OBJECTS: b""} if _OBJECTS in keys else {}

    def apply_commit(self, loaded: dict[str, Any], old_world: int, rank: int,
                     world: int) -> None:
        if _OBJECTS in loaded:
            saved = unpack(loaded[_OBJECTS])
            unknown = sorted(set(saved) - set(self._saved_state))
            if unknown:
                raise ValueError(f"dear.elastic: the commit has attributes {unknown} that this "
                                 "state lacks: the state must be built with the same names")
            merged = dict(self._saved_state)
            merged.update(saved)
            self._saved_state = merged
            self._set_attrs()


def _copied(value: Any) -> Any:
    try:
        return copy.deepcopy(value)
    except Exception:                          # noqa: BLE001 - not copyable: kept as is
        return value


class State(ObjectState):
    """A training process's state (Horovod's TorchState, for dear.elastic.run under torchrun).

    `State(model=model, optimizer=optimizer, sampler=sampler, epoch=0, batch=0)`: objects with
    a handler (torch modules, torch optimizers, dear's with shard_optimizer_state and
    compression included, ElasticSampler, dear.KFAC, LR schedulers and anything else with
    state_dict()/load_state_dict()) are committed, restored and synchronized through it; the
    rest are plain attributes (ObjectState). Several of each kind are fine, by name.
    Assigning a handled attribute (`state.model = other`) saves it at once, as in Horovod.
    """

    def __init__(self, model: Any = None, optimizer: Any = None, *,
                 ops: Optional[Ops] = None, **kwargs: Any) -> None:
        kwargs.update(dict(model=model, optimizer=optimizer))
        resolved = ops or DEAR
        handlers: dict[str, Handler] = {}
        rest: dict[str, Any] = {}
        for name, value in kwargs.items():
            handler = handler_for(value, resolved)
            if handler is not None:
                handlers[name] = handler
            else:
                rest[name] = value
        self._handlers: dict[str, Handler] = handlers
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(ops=resolved, **rest)

    def _flush(self) -> None:
        """dear's optimizers apply their pending update (the last step's, which otherwise
        lands in the next forward) before the state is read: a commit holds whole steps."""
        for handler in self._handlers.values():
            flush = getattr(handler.value, "flush_updates", None)
            if callable(flush):
                flush()

    def save(self) -> None:
        self._flush()
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers")
        if handlers is not None and name in handlers:
            handlers[name].set_value(value)
        object.__setattr__(self, name, value)

    def commit_items(self, rank: int) -> dict[str, Any]:
        self._flush()
        out = super().commit_items(rank)
        for name, handler in self._handlers.items():
            prefix = _HANDLER_PREFIX + name
            out.update(handler.replicated(prefix))
            out.update(handler.own(prefix, rank))
        return out

    def commit_template(self, keys: Mapping[str, Any], old_world: int, rank: int,
                        world: int) -> dict[str, Any]:
        out = super().commit_template(keys, old_world, rank, world)
        for name, handler in self._handlers.items():
            prefix = _HANDLER_PREFIX + name
            if not any(k == prefix or k.startswith(prefix) for k in keys):
                raise ValueError(f"dear.elastic: the commit holds nothing for {name!r}: the "
                                 "state must be built with the same names as when it was "
                                 "committed")
            out.update(handler.template(prefix, keys, old_world, rank, world))
        return out

    def apply_commit(self, loaded: dict[str, Any], old_world: int, rank: int,
                     world: int) -> None:
        super().apply_commit(loaded, old_world, rank, world)
        for name, handler in self._handlers.items():
            handler.load(_HANDLER_PREFIX + name, loaded, old_world, rank, world)


__all__ = ["BaseState", "ObjectState", "State"]
