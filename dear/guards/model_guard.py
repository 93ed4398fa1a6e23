"""Reads through the model see the updated weights.

dear applies step()'s update to each module just before that module's next forward, so between
step() and the next forward the parameters are one update behind. Whatever reads them there
through the model (EMA and SWA's `update_parameters(model)`, `model.parameters()`,
`named_parameters()`, `buffers()`, `state_dict()`, `copy.deepcopy(model)`, pickling and
`torch.save(model)`, an eval-mode forward) must see the weights DDP would show. So the model
given as `model=` becomes, in place, an instance of a subclass of its own class (as the optimizer
does) whose readers apply the pending updates first. The ordinary loop (zero_grad, forward) reads
nothing, so it keeps the all-gather overlap; a read that forces the updates early says so once.

Reads this cannot see (docs/contract.md): a tensor reference kept from before (`w = model.fc.weight`
then `w.sum()` after step()), a submodule read directly (`model.fc.weight`, `model.fc.parameters()`)
between step() and the next forward, and the optimizer's param_groups' tensors.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
import weakref
from typing import Any, Iterator

import torch

log = logging.getLogger("dear")

# model -> the dear optimizers updating it (weakly: neither keeps the other alive)
_owners: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakSet[Any]]" = \
    weakref.WeakKeyDictionary()
_in_forward: "weakref.WeakKeyDictionary[torch.nn.Module, int]" = weakref.WeakKeyDictionary()
_dear_hook_ids: set[int] = set()           # module hooks of dear's: left out of copies
_quiet = threading.local()                 # dear's own reads: no flush
_classes: dict[type, type] = {}           # a model's class -> its guarded subclass
_bases: dict[type, type] = {}             # and back


def track(handle: Any) -> Any:
    """Record a module hook of dear's, so copies and pickles of the model leave it out."""
    _dear_hook_ids.add(handle.id)
    return handle


def untrack(handle: Any) -> None:
    """A hook of dear's that is removed (dear/engine/hooks.py narrows them between iterations)."""
    _dear_hook_ids.discard(handle.id)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """dear's own reads of the model (buffers, zero_grad): no flush."""
    before = getattr(_quiet, "on", False)
    _quiet.on = True
    try:
        yield
    finally:
        _quiet.on = before


def guard(model: torch.nn.Module, optimizer: Any) -> None:
    """Make `model`'s readers apply `optimizer`'s pending updates first."""
    owners = _owners.get(model)
    if owners is None:
        owners = _owners[model] = weakref.WeakSet()
        if not isinstance(model, _ReadGuard):
            model.__class__ = _guarded_class(type(model))
        # Kept for the model's life (a later optimizer on the same model reuses them): they
        # only count forwards, so reads inside one do not force the updates early.
        track(model.register_forward_pre_hook(_eager(_enter_forward)))
        track(model.register_forward_hook(_eager(_leave_forward), always_call=True))
    owners.add(optimizer)


#: the optimizers whose early application `flush_for_read` has reported (once each)
_warned: "weakref.WeakSet[Any]" = weakref.WeakSet()


def flush_for_read(model: torch.nn.Module, what: str) -> None:
    """Apply the pending updates of every dear optimizer of `model` before `what` reads it."""
    if getattr(_quiet, "on", False) or _in_forward.get(model, 0):
        return                                 # inside a forward the modules' hooks apply them
    for opt in list(_owners.get(model, ())):
        start = time.perf_counter()
        applied = opt.flush_updates()
        if applied and opt not in _warned:
            _warned.add(opt)
            log.warning(
                "dear: %s read the model while the last step()'s update was pending, so it was "
                "applied now (%d buckets, %.1f ms): the all-gathers that overlap the next "
                "forward were waited for here. Harmless, but to keep the overlap read the model "
                "after the next forward (this is said once)", what, applied,
                1e3 * (time.perf_counter() - start))


def _enter_forward(module: torch.nn.Module, args: Any) -> None:
    _in_forward[module] = _in_forward.get(module, 0) + 1


def _leave_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
    _in_forward[module] = max(0, _in_forward.get(module, 0) - 1)


def _eager(hook: Any) -> Any:
    return torch.compiler.disable(hook, recursive=True)


class _ReadGuard(torch.nn.Module):
    """Mixed into the model's own class by `guard`."""

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        flush_for_read(self, "model.parameters()")
        return super().parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        flush_for_read(self, "model.named_parameters()")
        return super().named_parameters(*args, **kwargs)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        flush_for_read(self, "model.buffers()")
        return super().buffers(recurse)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        flush_for_read(self, "model.named_buffers()")
        return super().named_buffers(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        flush_for_read(self, "model.state_dict()")
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        # a pending update applied after the load would overwrite what was loaded
        for opt in list(_owners.get(self, ())):
            opt.flush_updates()
        return super().load_state_dict(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Touches .grad only: no flush (Hugging Face's Trainer calls it after every step)."""
        owners = [o for o in _owners.get(self, ()) if o.gradient_as_bucket_view]
        done: set[torch.nn.Parameter] = set()
        for opt in owners:                     # their .grad are bucket views (views.py)
            opt.zero_grad(set_to_none)
            done.update(p for g in opt.param_groups for p in g["params"])
        with quiet():
            if not done:
                super().zero_grad(set_to_none)
                return
            rest = [p for p in super().parameters() if p not in done]
        for p in rest:                         # torch's own rule
            grad = p.grad
            if grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                if grad.grad_fn is not None:
                    grad.detach_()
                else:
                    grad.requires_grad_(False)
                grad.zero_()

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickling and copy.deepcopy: the updated weights, as the model's own class, without
        dear's hooks (the copy is a plain model: an EMA copy must not take dear's updates)."""
        flush_for_read(self, "copy.deepcopy(model) / pickling")
        return _Plain(self, {}).__reduce_ex__(protocol)


def _guarded_class(base: type) -> type:
    cls = _classes.get(base)
    if cls is None:
        cls = type(base.__name__, (_ReadGuard, base),
                   {"__module__": base.__module__, "__qualname__": base.__qualname__})
        _classes[base], _bases[cls] = cls, base
    return cls


def plain_class(module: torch.nn.Module) -> type:
    """The module's own class (without dear's read guard)."""
    return _bases.get(type(module), type(module))


class _Plain:
    """Stands for a module in a pickle or a deepcopy: rebuilt as its own class with its state,
    minus dear's hooks; shared submodules stay shared (one stand-in each)."""

    def __init__(self, module: torch.nn.Module, cache: dict[int, "_Plain"]) -> None:
        self.module, self.cache = module, cache
        cache[id(module)] = self

    def __reduce_ex__(self, protocol: Any) -> Any:
        module = self.module
        got = module.__getstate__()            # the class's own, if it defines one
        state = dict(got if isinstance(got, dict) else module.__dict__)
        for key, value in list(state.items()):
            if "hooks" in key and isinstance(value, dict) \
                    and any(k in _dear_hook_ids for k in value):
                kept = collections.OrderedDict((k, v) for k, v in value.items()
                                               if k not in _dear_hook_ids)
                state[key] = kept
        state["_modules"] = {name: (None if child is None else
                                    self.cache.get(id(child)) or _Plain(child, self.cache))
                             for name, child in module._modules.items()}
        return (_rebuild, (plain_class(module), state))


def _rebuild(cls: Any, state: dict[str, Any]) -> torch.nn.Module:
    module = cls.__new__(cls)
    modules = state.get("_modules", {})
    state = dict(state, _modules=collections.OrderedDict(modules))
    module.__setstate__(state)
    return module


__all__ = ["flush_for_read", "guard", "plain_class", "quiet", "track", "untrack"]
