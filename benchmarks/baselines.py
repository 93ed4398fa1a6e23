"""The schedules dear is measured against that neither torch nor Horovod ships as such, and
FSDP2's wrapping per block (the registry that builds every method: benchmarks/methods.py).

- `AllReduceAfterBackward`: one all-reduce of the whole flattened gradient after backward (no
  overlap).
- `WFBP`: wait-free backprop, Horovod's schedule: gradients fused into buckets in the order
  backward produces them, each bucket all-reduced as soon as it fills, all waited for in step().
- `fsdp2_wrap`: fully_shard(reshard_after_forward=False) per block: reduce-scatter in backward,
  all-gather of PARAMETERS with prefetch in forward; DeAR's overlap, the other thing gathered.
All use the same Communicator / process group as dear, so only the schedule differs.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from dear.comm.base import Work
from dear.fusion.planner import plan_buckets
from dear.comm.runtime import communicator


class AllReduceAfterBackward:
    """step(): flatten every gradient, one all-reduce, unflatten, update."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = optimizer
        self.flat = torch.zeros(sum(p.numel() for p in self.params))

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> None:
        offset = 0
        for p in self.params:
            self.flat[offset:offset + p.numel()].copy_(p.grad.view(-1))
            offset += p.numel()
        communicator().all_reduce(self.flat).wait()
        self.flat.div_(communicator().size)
        offset = 0
        for p in self.params:
            p.grad.copy_(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.optimizer.step()


class WFBP:
    """All-reduce each bucket from the backward hook that fills it, in a fixed order."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 threshold: int = 25 * 2**20) -> None:
        self.optimizer = optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        order = list(reversed(range(len(self.params))))      # roughly backward order
        self.specs = plan_buckets(self.params, order, threshold, 1)
        self.buffers = [torch.zeros(s.padded_numel) for s in self.specs]
        self.where: dict[int, tuple[int, int]] = {}
        for b, spec in enumerate(self.specs):
            for j, i in enumerate(spec.params):
                self.where[i] = (b, j)
        self.filled = [0] * len(self.specs)
        self.works: list[Optional[Work]] = [None] * len(self.specs)
        self.next = 0
        self.hooks = [p.register_post_accumulate_grad_hook(lambda p, i=i: self._on_grad(i, p))
                      for i, p in enumerate(self.params)]

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        b, j = self.where[i]
        spec = self.specs[b]
        self.buffers[b][spec.offsets[j]:spec.offsets[j] + spec.numels[j]].copy_(p.grad.view(-1))
        self.filled[b] += 1
        while (self.next < len(self.specs)
               and self.filled[self.next] == len(self.specs[self.next].params)):
            self.works[self.next] = communicator().all_reduce(self.buffers[self.next])
            self.next += 1

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> None:
        size = communicator().size
        for b, spec in enumerate(self.specs):
            work = self.works[b]
            if work is None:                     # a parameter got no gradient: send what we have
                work = communicator().all_reduce(self.buffers[b])
            work.wait()
            self.buffers[b].div_(size)
            for j, i in enumerate(spec.params):
                p = self.params[i]
                start = spec.offsets[j]
                p.grad = self.buffers[b][start:start + spec.numels[j]].view_as(p).clone()
        self.filled = [0] * len(self.specs)
        self.works = [None] * len(self.specs)
        self.next = 0
        self.optimizer.step()


def fsdp2_wrap(model: torch.nn.Module, blocks: Callable[[torch.nn.Module], list[torch.nn.Module]]
               ) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model
