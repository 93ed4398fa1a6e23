"""Which modules dear hooks (dear/engine/hooks.py, issue 51): every module holding trained
parameters while a layout is new, in the iterations that compare contents and whenever the
modules did not keep their first forward's order; else only each bucket's first module and the
root. Training must equal single-process training on the global batch either way.

- a fixed-order model narrows to a few hooks after the first 8 iterations, and trains as one
  process does (float32 judged against float64 by independent float32 runs);
- a model that runs a module before its bucket's first module (a branch taken first in some
  iterations) keeps every hook and trains as one process does;
- with DEAR_CHECK_EVERY=1 no iteration narrows;
- dear's pre-hook runs before the module's own pre-hooks (torch.nn.utils.weight_norm computes
  the weight from g and v in one): the weight is computed from updated g and v.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.nn.functional as F

import dear
from tests.distributed import run_distributed
from tests.workloads import assert_float32_close

STEPS = 24
PER_RANK = 4


class Chain(torch.nn.Module):
    """Eight Linear layers; `swap(step)` runs layer 1 before layer 0 (on an input of its own),
    so that a module of the first bucket can run before that bucket's first module."""

    def __init__(self, swap_steps: tuple[int, ...] = (), norm: bool = False) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(8))
        if norm:
            self.layers[2] = torch.nn.utils.weight_norm(self.layers[2])
        self.swap_steps = swap_steps
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.step in self.swap_steps:
            side = self.layers[1](x)           # before layer 0, in this iteration only
            h = torch.tanh(self.layers[0](x)) + side
        else:
            h = torch.tanh(self.layers[0](x))
            h = h + self.layers[1](x)
        for layer in self.layers[2:]:
            h = torch.tanh(layer(h))
        return h


def _make(swap_steps: tuple[int, ...], norm: bool, dtype: torch.dtype = torch.float32) -> Chain:
    torch.manual_seed(0)
    return Chain(swap_steps, norm).to(dtype)


def _batch(step: int, rank: Optional[int], world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(PER_RANK * world, 8, generator=g), torch.randn(PER_RANK * world, 8,
                                                                         generator=g)
    if rank is None:
        return x, y
    return x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]


def _reference(swap_steps: tuple[int, ...], norm: bool, world: int,
               dtype: torch.dtype) -> dict[str, torch.Tensor]:
    model = _make(swap_steps, norm, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        model.step = step
        opt.zero_grad()
        x, y = _batch(step, None, world)
        F.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
        opt.step()
    return {k: v.detach().clone().float() for k, v in model.state_dict().items()}


def _train(swap_steps: tuple[int, ...], norm: bool) -> dict:
    dear.init()
    rank, world = dear.rank(), dear.size()
    model = _make(swap_steps, norm)
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    model=model, fusion_threshold=600)
    hooked = []
    for step in range(STEPS):
        model.step = step
        opt.zero_grad()
        x, y = _batch(step, rank, world)
        F.mse_loss(model(x), y).backward()
        opt.step()
        hooks = opt.dear_engine.hooks
        hooked.append(sum(h.attached for h in hooks.modules.values()))
    out = {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
           "hooked": hooked, "modules": len(opt.dear_engine.hooks.modules),
           "buckets": len(opt.dear_engine.buckets), "varies": opt.dear_engine.layout.order_varies,
           "compared": None}
    dear.shutdown()
    return out


def _check(results: list[dict], swap_steps: tuple[int, ...], norm: bool) -> None:
    exact = _reference(swap_steps, norm, 2, torch.float64)
    peer = _reference(swap_steps, norm, 2, torch.float32)
    for r, res in enumerate(results):
        assert_float32_close(res["params"], exact, peer, what=f"rank {r}")


def test_fixed_order_narrows_to_each_buckets_first_module() -> None:
    results = run_distributed(_train, 2, (), False, timeout=120)
    _check(results, (), False)
    for res in results:
        assert res["buckets"] >= 3, res["buckets"]
        assert res["hooked"][:7] == [res["modules"]] * 7, "narrowed while the layout was new"
        narrowed = [n for n in res["hooked"][8:] if n < res["modules"]]
        assert narrowed, f"never narrowed: {res['hooked']}"
        assert max(narrowed) <= res["buckets"] + 1, res["hooked"]   # firsts and the root
        assert not res["varies"]


def test_a_module_before_its_buckets_first_module_keeps_every_hook() -> None:
    swaps = (3, 17)
    results = run_distributed(_train, 2, swaps, False, timeout=120)
    _check(results, swaps, False)
    for res in results:
        assert res["varies"], "the module that ran first was not seen"
        assert res["hooked"][3:] == [res["modules"]] * (STEPS - 3), res["hooked"]


def test_check_every_one_never_narrows() -> None:
    results = run_distributed(_train, 2, (), False, timeout=120, env={"DEAR_CHECK_EVERY": "1"})
    for res in results:
        assert res["hooked"] == [res["modules"]] * STEPS, res["hooked"]


@pytest.mark.filterwarnings("ignore::FutureWarning")   # torch.nn.utils.weight_norm is legacy
def test_weight_norm_computes_the_weight_after_the_update() -> None:
    results = run_distributed(_train, 2, (), True, timeout=120)
    _check(results, (), True)
