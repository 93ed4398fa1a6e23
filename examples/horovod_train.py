"""A Horovod training script; `--dear` swaps hvd.DistributedOptimizer for dear's, nothing else.

    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_train.py [--dear]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import horovod.torch as hvd

import dear


class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, padding=1)
        self.fc1 = torch.nn.Linear(16 * 4 * 4, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def batch(step: int, rank: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(size, 1, 16, 16, generator=g)
    return x, (x.mean((1, 2, 3)) * 20).long().clamp(-5, 4) + 5


def train(optimizer_name: str = "sgd", compression: str = "none", backward_passes: int = 1,
          use_dear: bool = False, steps: int = 8, clip: float = 0.0) -> dict[str, torch.Tensor]:
    """`clip` > 0: clip the AVERAGED gradients, the Horovod way (synchronize, edit .grad, then
    step inside skip_synchronize), as K-FAC and clipping loops do."""
    torch.manual_seed(42)
    model = ConvNet()
    if optimizer_name == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    comp = hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none
    if use_dear:
        optimizer = dear.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                              compression=comp,
                                              backward_passes_per_step=backward_passes,
                                              model=model)
    else:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=comp,
                                             backward_passes_per_step=backward_passes)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for step in range(steps):
        optimizer.zero_grad()
        for k in range(backward_passes):
            x, y = batch(step * backward_passes + k, hvd.rank())
            (F.cross_entropy(model(x), y) / backward_passes).backward()
        if clip:
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dear", action="store_true")
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    parser.add_argument("--compression", default="none", choices=["none", "fp16"])
    parser.add_argument("--backward-passes", type=int, default=1)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    hvd.init()
    state = train(args.optimizer, args.compression, args.backward_passes, args.dear)
    if args.out and hvd.rank() == 0:
        torch.save(state, args.out)
    print(f"rank {hvd.rank()}: done ({'dear' if args.dear else 'horovod'})")


if __name__ == "__main__":
    main()
