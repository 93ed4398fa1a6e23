"""How each kind of object in an elastic state is committed, restored, synchronized and
carried to a new world size. Chosen by type, first match (Horovod's registry, extended): a
torch module, a torch optimizer (dear's with or without shard_optimizer_state), an
ElasticSampler, dear.KFAC, then anything with state_dict()/load_state_dict() (LR schedulers,
GradScaler).

Each handler keeps two copies of its object's state: in memory (`save`/`restore`, Horovod's
commit within a process), and in the commit directory (`items`/`template`/`load`, which
outlive the process). For the directory it says which items are the same on every rank
(`replicated`: written once) and which are this rank's own (`own`: written by it, and read
back only by the rank that takes its place at the same world size).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Mapping, Optional

import torch

from .commit import nested_template, pack, unpack
from .ops import Ops
from .sampler import ElasticSampler


class Handler:
    """One object of the state (see the module's docstring)."""

    def __init__(self, value: Any, ops: Ops) -> None:
        self.value = value
        self.ops = ops
        self.save()

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()

    # -- the commit directory: `prefix` is the handler's key in the commit
    def replicated(self, prefix: str) -> dict[str, Any]:
        """Items that every rank holds the same of (written once)."""
        return {}

    def own(self, prefix: str, rank: int) -> dict[str, Any]:
        """Items that are this rank's only."""
        return {}

    def template(self, prefix: str, keys: Mapping[str, Any], old_world: int, rank: int,
                 world: int) -> dict[str, Any]:
        """What to read back from a commit made on `old_world` ranks (`keys`: its items by key)."""
        return {}

    def load(self, prefix: str, loaded: dict[str, Any], old_world: int, rank: int,
             world: int) -> None:
        """Put what template() read in place."""


def _fresh(value: Any) -> Any:
    return copy.deepcopy(value)


class ModelHandler(Handler):
    """A torch module: its state_dict (replicated: data-parallel replicas are equal)."""

    def save(self) -> None:
        self.saved = _fresh(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def sync(self) -> None:
        self.ops.broadcast_parameters(self.value.state_dict(), 0)

    def replicated(self, prefix: str) -> dict[str, Any]:
        return {prefix: self.value.state_dict()}

    def template(self, prefix: str, keys: Mapping[str, Any], old_world: int, rank: int,
                 world: int) -> dict[str, Any]:
        return {prefix: {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                         for k, v in self.value.state_dict().items()}}

    def load(self, prefix: str, loaded: dict[str, Any], old_world: int, rank: int,
             world: int) -> None:
        self.value.load_state_dict(loaded[prefix])


class OptimizerHandler(Handler):
    """A torch optimizer, dear's included. Without shard_optimizer_state its state_dict() is
    replicated and committed once, whole. With it, each rank commits its own pieces
    (sharded_state_dict(): DCP reads each new rank's pieces from whichever files hold them, so
    the state is resharded to the new size without being gathered anywhere); in memory each rank
    keeps a copy of its pieces. Quantized compression's error-feedback residuals (in dear's
    state_dict(), this rank's) are per rank: carried when the world size is unchanged (the rank
    that takes rank r's place gets rank r's), dropped when it changes (their layout and their
    owners change; see docs/elastic.md); with shard_optimizer_state the same, kept beside the
    sharded pieces (dear_feedback_state(): its sharded_state_dict() holds none)."""

    def __init__(self, value: Any, ops: Ops) -> None:
        from ..engine.feedback import STATE_KEY
        from ..interfaces import DearOptimizer
        self.feedback_key = STATE_KEY
        self.dear = isinstance(value, DearOptimizer)
        self.saved_feedback: Optional[dict[str, Any]] = None    # sharded: kept beside
        super().__init__(value, ops)

    @property
    def sharded(self) -> bool:
        return self.dear and bool(self.value.shard_optimizer_state)

    def _without_feedback(self, state: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in state.items() if k != self.feedback_key}

    def _stepped(self) -> bool:
        """Whether the optimizer has state yet. Before its first step a sharded optimizer's
        sharded_state_dict() would create the state with a step at lr 0 (its template needs
        every key), which counts as a step for Adam's bias correction: nothing is taken from
        it then, and there is nothing to take. State carried in pieces from another world
        size (resumed, not yet laid out) counts."""
        if bool(self.value.state) or not self.dear:
            return bool(self.value.state)
        sharded = self.value.dear_sharded_state
        return self.value.dear_layout is not None or (
            sharded is not None and sharded.carried is not None)

    def _load_sharded(self, state: dict[str, Any], feedback_follows: bool) -> None:
        """The sharded pieces; their error-feedback entry (a warm-up count, no residuals)
        left out where the rank's own feedback state is loaded next."""
        if feedback_follows:
            state = {k: v for k, v in state.items() if k != self.feedback_key}
        self.value.load_sharded_state_dict(state)

    def _feedback(self) -> Optional[dict[str, Any]]:
        """This rank's error-feedback state (dear's optimizers with quantized compression),
        read without building the whole state_dict()."""
        return self.value.dear_feedback_state() if self.dear else None

    def save(self) -> None:
        if self.sharded:
            self.saved = _copy_sharded(self.value.sharded_state_dict()) if self._stepped() \
                else None
            feedback = self._feedback()
            self.saved_feedback = _fresh(feedback) if feedback is not None else None
        else:
            self.saved = _fresh(self.value.state_dict())

    def restore(self) -> None:
        if self.sharded:
            if self.saved is not None:     # None: committed before the first step
                self._load_sharded(_copy_sharded(self.saved), self.saved_feedback is not None)
            if self.saved_feedback is not None:
                self.value.dear_load_feedback_state(_fresh(self.saved_feedback))
        else:                          # torch's load_state_dict may alias what it is given
            self.value.load_state_dict(_fresh(self.saved))

    def sync(self) -> None:
        """Rank 0's state and hyperparameters on every rank; each rank keeps its own
        error-feedback residuals (rank 0's state_dict() carries rank 0's, which are not
        replicated state)."""
        own = None if self.sharded else self.value.state_dict().get(self.feedback_key)
        own = _fresh(own) if own is not None else None
        self.ops.broadcast_optimizer_state(self.value, 0)
        if own is not None:
            self.value.load_state_dict({**self.value.state_dict(), self.feedback_key: own})

    def replicated(self, prefix: str) -> dict[str, Any]:
        if not self.sharded:
            return {prefix: _as_items(self._without_feedback(self.value.state_dict()))}
        return {prefix: self.value.sharded_state_dict()} if self._stepped() else {}

    def own(self, prefix: str, rank: int) -> dict[str, Any]:
        feedback = self._feedback()
        if feedback is None:
            return {}
        meta = {k: v for k, v in feedback.items() if k != "residuals"}
        residuals = {str(i): t.detach() for i, t in feedback.get("residuals", {}).items()}
        return {f"{prefix}_feedback_rank{rank}": {"meta": pack(meta), "residuals": residuals}}

    def template(self, prefix: str, keys: Mapping[str, Any], old_world: int, rank: int,
                 world: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.sharded:
            if any(k.startswith(prefix + ".") for k in keys):   # else committed before a step
                out[prefix] = self.value.sharded_state_dict()
        else:
            out[prefix] = nested_template(keys, prefix)
        mine = f"{prefix}_feedback_rank{rank}"
        if f"{mine}.meta" in keys:
            out[mine] = nested_template(keys, mine)
        else:                          # another size: the warm-up count from any rank's
            other = next((k[:-len(".meta")] for k in sorted(keys)
                          if k.startswith(f"{prefix}_feedback_rank") and k.endswith(".meta")),
                         None)
            if other is not None:
                out[other] = {"meta": b""}
        return out

    def load(self, prefix: str, loaded: dict[str, Any], old_world: int, rank: int,
             world: int) -> None:
        entry = next((v for k, v in loaded.items()
                      if k.startswith(f"{prefix}_feedback_rank")), None)
        feedback = None
        if entry is not None:
            feedback = unpack(entry["meta"])
            if old_world == world and feedback.get("rank") == rank:
                feedback["residuals"] = {int(i): t for i, t in
                                         entry.get("residuals", {}).items()}
            else:                      # dropped: the warm-up count only
                feedback = {"steps": feedback.get("steps", 0)}
        if self.sharded:
            if prefix in loaded:
                self._load_sharded(loaded[prefix], feedback is not None)
            if feedback is not None:
                self.value.dear_load_feedback_state(feedback)
            return
        state = _from_items(loaded[prefix])
        if feedback is not None:
            state[self.feedback_key] = feedback
        self.value.load_state_dict(state)


def _as_items(state: dict[str, Any]) -> dict[str, Any]:
    """A torch optimizer's state_dict() as DCP items: its state tensors as tensors (DCP writes
    them as they are, where one pickled object of the same bytes is pickled twice), the rest
    (param_groups, non-tensor entries) as objects."""
    per_param = {str(i): {k: (v.detach() if isinstance(v, torch.Tensor) else pack(v))
                          for k, v in entry.items()}
                 for i, entry in state.get("state", {}).items()}
    rest = {k: v for k, v in state.items() if k not in ("state", "param_groups")}
    return {"state": per_param, "param_groups": pack(state.get("param_groups", [])),
            "rest": pack(rest)}


def _from_items(items: dict[str, Any]) -> dict[str, Any]:
    """_as_items() read back into torch's state_dict() form."""
    state = {int(i): {k: (v if isinstance(v, torch.Tensor) else unpack(v))
                      for k, v in entry.items()}
             for i, entry in items.get("state", {}).items()}
    return {**unpack(items["rest"]), "state": state,
            "param_groups": unpack(items["param_groups"])}


def _copy_sharded(state: Any) -> Any:
    """A sharded_state_dict() with this rank's pieces copied (ShardedTensors rebuilt around
    clones of their local shards), so later steps cannot change it."""
    if hasattr(state, "local_shards"):
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
        shards = [Shard(s.tensor.detach().clone(), s.metadata) for s in state.local_shards()]
        return ShardedTensor._init_from_local_shards_and_global_metadata(  # noqa: SLF001
            shards, state.metadata())       # torch's only constructor from given pieces
    if isinstance(state, dict):
        return {k: _copy_sharded(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_copy_sharded(v) for v in state]
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    return copy.deepcopy(state)


class StatefulHandler(Handler):
    """Anything else with state_dict()/load_state_dict() (an LR scheduler, a GradScaler):
    replicated, synchronized from rank 0."""

    def save(self) -> None:
        self.saved = _fresh(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(_fresh(self.saved))

    def sync(self) -> None:
        self.value.load_state_dict(self.ops.broadcast_object(self.value.state_dict(), 0))

    def replicated(self, prefix: str) -> dict[str, Any]:
        return {prefix: pack(self.value.state_dict())}

    def template(self, prefix: str, keys: Mapping[str, Any], old_world: int, rank: int,
                 world: int) -> dict[str, Any]:
        return {prefix: b""}

    def load(self, prefix: str, loaded: dict[str, Any], old_world: int, rank: int,
             world: int) -> None:
        self.value.load_state_dict(unpack(loaded[prefix]))


class SamplerHandler(StatefulHandler):
    """An ElasticSampler: epoch and processed count (replicated); sync() takes rank 0's and
    the sampler's load_state_dict deals what is left of the epoch to the ranks of the moment."""


class KFACHandler(Handler):
    """dear.KFAC: each rank commits its own state_dict (factors and the decompositions it
    holds). At the same world size rank r gets rank r's back (the owners are the same); at
    another size the factors (equal on every rank that holds them) are merged from the old
    ranks, the decompositions are dropped and recomputed at the next step by the owners the
    preconditioner, built at the new size, assigns."""

    def save(self) -> None:
        self.saved = self.value.state_dict(include_factors=True)

    def restore(self) -> None:
        self.value.load_state_dict(_fresh(self.saved))

    def sync(self) -> None:
        """Nothing: every rank loaded the same commit, and the factors are averaged anyway."""

    def own(self, prefix: str, rank: int) -> dict[str, Any]:
        return {f"{prefix}_rank{rank}": pack(self.value.state_dict(include_factors=True))}

    def template(self, prefix: str, keys: Mapping[str, Any], old_world: int, rank: int,
                 world: int) -> dict[str, Any]:
        if old_world == world:
            return {f"{prefix}_rank{rank}": b""}
        return {f"{prefix}_rank{r}": b"" for r in range(old_world)
                if f"{prefix}_rank{r}" in keys}

    def load(self, prefix: str, loaded: dict[str, Any], old_world: int, rank: int,
             world: int) -> None:
        if old_world == world:
            self.value.load_state_dict(unpack(loaded[f"{prefix}_rank{rank}"]))
            return
        states = [unpack(loaded[k]) for k in sorted(loaded) if k.startswith(f"{prefix}_rank")]
        self.value.load_state_dict(merge_kfac(states))


def merge_kfac(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One dear.KFAC state from every old rank's: the first rank's step count and
    hyperparameters, each layer's factors from the first rank that holds them, no
    decompositions (recomputed at the next step)."""
    if not states:
        raise ValueError("dear.elastic: the commit holds no dear.KFAC state")
    merged = {k: v for k, v in states[0].items() if k != "layers"}
    layers: dict[str, Any] = {}
    for state in states:
        for name, layer in (state.get("layers") or {}).items():
            entry = layers.setdefault(name, {"A": None, "G": None, "A_dec": None,
                                             "G_dec": None})
            for which in ("A", "G"):
                if entry[which] is None and layer.get(which) is not None:
                    entry[which] = layer[which]
    if any("layers" in s for s in states):
        merged["layers"] = layers
    return merged


def _is_kfac(value: Any) -> bool:
    from ..kfac import KFAC
    return isinstance(value, KFAC)


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and \
        callable(getattr(value, "load_state_dict", None)) and not isinstance(value, type)


#: (test, handler class), first match wins (get_handler_registry / set_handler_registry).
Registry = list[tuple[Callable[[Any], bool], type[Handler]]]

_registry: Registry = [
    (lambda v: isinstance(v, torch.nn.Module), ModelHandler),
    (lambda v: isinstance(v, torch.optim.Optimizer), OptimizerHandler),
    (lambda v: isinstance(v, ElasticSampler), SamplerHandler),
    (_is_kfac, KFACHandler),
    (_is_stateful, StatefulHandler),
]


def get_handler_registry() -> Registry:
    return _registry


def set_handler_registry(registry: Registry) -> None:
    global _registry
    _registry = list(registry)


def handler_for(value: Any, ops: Ops) -> Optional[Handler]:
    for test, cls in _registry:
        if test(value):
            return cls(value, ops)
    return None


__all__ = ["Handler", "KFACHandler", "ModelHandler", "OptimizerHandler", "SamplerHandler",
           "StatefulHandler", "get_handler_registry", "handler_for", "merge_kfac",
           "set_handler_registry"]
