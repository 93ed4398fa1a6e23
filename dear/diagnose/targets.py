"""What is being traced: the parameters (named, indexed), modules, buckets and the schedule."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from ..interfaces import DearOptimizer


def collect_params(model: Optional[torch.nn.Module], optimizer: Any
                   ) -> list[tuple[str, torch.nn.Parameter]]:
    """Trainable parameters, the model's in registration order, then any other the optimizer
    holds (named by dear's optimizer when it knows the names)."""
    named: list[tuple[str, torch.nn.Parameter]] = []
    seen: set[int] = set()
    if model is not None:
        for name, p in model.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
    for group in getattr(optimizer, "param_groups", ()):
        for p in group["params"]:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                named.append((f"param{len(named)}", p))
    if isinstance(optimizer, DearOptimizer):
        by_id = {id(p): n for n, p in zip(optimizer.dear_parameter_names,
                                          optimizer.dear_parameters)}
        named = [(by_id.get(id(p), n) if n.startswith("param") else n, p) for n, p in named]
    return named


def describe(model: Optional[torch.nn.Module], optimizer: Any,
             params: list[tuple[str, torch.nn.Parameter]],
             modules: list[tuple[str, torch.nn.Module]]) -> dict[str, Any]:
    """The trace's `dear` metadata besides the events: parameters, modules, buckets, schedule."""
    index = {id(p): i for i, (_, p) in enumerate(params)}
    dear_opt = isinstance(optimizer, DearOptimizer)
    layout = optimizer.dear_layout if dear_opt else None
    buckets = [[index.get(id(p), -1) for p in b.params] for b in layout.buckets] \
        if layout is not None else []
    gather_groups = [[b.spec.index for b in g.buckets] for g in layout.gather_groups] \
        if layout is not None else []
    fusion = optimizer.dear_fusion if dear_opt else None
    table = [{"name": name or "<root>", "leaf": next(m.children(), None) is None,
              "params": [index[id(p)] for p in m.parameters(recurse=False) if id(p) in index]}
             for name, m in modules]
    return {"version": 1, "schedule": schedule_of(model, optimizer),
            "params": [{"name": n, "numel": p.numel(), "bytes": p.numel() * p.element_size()}
                       for n, p in params],
            "modules": table, "buckets": buckets, "gather_groups": gather_groups,
            "fusion": dataclasses.asdict(fusion) if fusion is not None else None,
            "fusion_threshold": getattr(fusion, "rs_threshold", None)}


def schedule_of(model: Any, optimizer: Any) -> str:
    if isinstance(optimizer, DearOptimizer):
        return "dear"
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "ddp"
    if hasattr(optimizer, "_allreduce_grad_async"):
        return "horovod"
    return type(optimizer).__name__.lower() if optimizer is not None else "unknown"
