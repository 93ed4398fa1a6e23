"""The world of one process: every collective is a local copy (or nothing)."""

from __future__ import annotations

from typing import Any

import torch

from .base import Communicator, DoneWork, Work, check_all_to_all, check_shard_sizes


class LocalCommunicator(Communicator):
    """Size 1: lets the same training script run without a launcher."""

    name = "local"

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return 1

    def reduce_scatter(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        check_shard_sizes(input, output, 1)
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return DoneWork()

    def all_gather(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        check_shard_sizes(output, input, 1)
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return DoneWork()

    def all_to_all(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        check_all_to_all(input, output, 1)
        output.copy_(input)
        return DoneWork()

    def all_reduce(self, tensor: torch.Tensor) -> Work:
        return DoneWork()

    def broadcast(self, tensor: torch.Tensor, root: int) -> Work:
        if root != 0:
            raise ValueError(f"root rank {root} does not exist in a world of size 1")
        return DoneWork()

    def broadcast_object(self, obj: Any, root: int) -> Any:
        if root != 0:
            raise ValueError(f"root rank {root} does not exist in a world of size 1")
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]
