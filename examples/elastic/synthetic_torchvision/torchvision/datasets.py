"""MNIST's shapes without MNIST: DEAR_SYNTHETIC_MNIST samples (default 2048 train, 512 test)."""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch


class MNIST(torch.utils.data.Dataset):
    def __init__(self, root: str, train: bool = True, download: bool = False,
                 transform: Optional[Callable[[Any], Any]] = None) -> None:
        n = int(os.environ.get("DEAR_SYNTHETIC_MNIST", "2048"))
        n = n if train else max(n // 4, 1)
        # a pattern per class (the same for the train and test sets) plus noise
        pattern = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(0))
        g = torch.Generator().manual_seed(1 if train else 2)
        self.targets = torch.randint(0, 10, (n,), generator=g)
        self.data = (pattern[self.targets] + 0.5 * torch.randn(n, 1, 28, 28, generator=g))
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = self.data[i]
        if self.transform is not None:
            x = self.transform(x)
        return x, int(self.targets[i])
