"""Checks run once when an optimizer is wrapped: bad input fails here, clearly, on every rank,
instead of hanging or silently diverging later."""

from __future__ import annotations

import inspect
from typing import Iterable, Optional

import torch

from .comm.base import Communicator


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(
            f"{type(optimizer).__name__}.step() needs a closure (it re-evaluates the loss), which "
            "a deferred update cannot provide; use an optimizer whose step takes no closure")


def named_params_of(optimizer: torch.optim.Optimizer,
                    named_parameters: Optional[Iterable[tuple[str, torch.nn.Parameter]]],
                    model: Optional[torch.nn.Module], sparse_as_dense: bool = False
                    ) -> list[tuple[str, torch.nn.Parameter]]:
    """The optimizer's trainable parameters with names, in the optimizer's order."""
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    if len({id(p) for p in opt_params}) != len(opt_params):
        raise ValueError("a parameter appears twice in the optimizer's param_groups")
    devices = {p.device for p in opt_params}
    if len(devices) > 1:
        raise ValueError(f"parameters live on several devices {sorted(map(str, devices))}; "
                         "dear needs one device per process (move the model with .to(device))")
    if model is not None and not sparse_as_dense:
        for name, module in model.named_modules():
            if getattr(module, "sparse", False) is True:
                raise ValueError(f"module {name or 'model'} produces sparse gradients "
                                 "(sparse=True); dear reduces dense buckets: use sparse=False or "
                                 "sparse_as_dense=True")
    if named_parameters is None and model is not None:
        named_parameters = model.named_parameters()
    if named_parameters is None:
        names = {id(p): f"param.{i}" for i, p in enumerate(opt_params)}
    else:
        pairs = list(named_parameters)
        if any(not isinstance(x, tuple) or len(x) != 2 for x in pairs):
            raise ValueError("named_parameters must be (name, parameter) pairs, e.g. "
                             "model.named_parameters()")
        seen: dict[str, int] = {}
        for name, _ in pairs:
            seen[name] = seen.get(name, 0) + 1
        dups = sorted(n for n, c in seen.items() if c > 1)
        if dups:
            raise ValueError(f"named_parameters contains duplicate names: {dups}")
        names = {id(p): n for n, p in pairs}
        missing = [i for i, p in enumerate(opt_params) if id(p) not in names]
        if missing:
            shapes = [tuple(opt_params[i].shape) for i in missing[:5]]
            raise ValueError(
                f"{len(missing)} optimizer parameter(s) are missing from named_parameters "
                f"(shapes {shapes}...); pass model.named_parameters() of the model that "
                "owns every parameter in the optimizer")
    return [(names[id(p)], p) for p in opt_params if p.requires_grad]


def check_same_across_ranks(named: list[tuple[str, torch.nn.Parameter]],
                            comm: Communicator) -> None:
    """Every rank must hold the same parameters (names, shapes, dtypes) in the same order."""
    mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in named]
    if comm.size == 1:
        return
    everyone = comm.all_gather_object(mine)
    for r, theirs in enumerate(everyone):
        if theirs == mine:
            continue
        if len(theirs) != len(mine):
            raise ValueError(f"rank {r} has {len(theirs)} trainable parameters, rank "
                             f"{comm.rank} has {len(mine)}: every rank must build the same model")
        for a, b in zip(mine, theirs):
            if a != b:
                raise ValueError(f"parameter {a[0]} differs across ranks: {a[1:]} on rank "
                                 f"{comm.rank}, {b[1:]} on rank {r}; every rank must build the "
                                 "same model")
