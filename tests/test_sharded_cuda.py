"""shard_optimizer_state on a GPU: the update on segments at arbitrary offsets gives the bits of
the unsharded step with torch's CUDA kernels (foreach, fused), and a world of one on the NCCL
group dear.init() starts trains like plain torch. Skipped without a GPU."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from tests.test_cuda_torch_dist import torchrun_world_of_one  # noqa: F401  (fixture)
from tests.test_sharded import ELEMENTWISE, emulated_ranks_match
from tests.workloads import assert_trains_like_one_process

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA_KERNELS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=0.01, foreach=True),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, fused=True),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
    "sgd_foreach": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=True),
}


@pytest.mark.parametrize("name", sorted({**ELEMENTWISE, **CUDA_KERNELS}))
def test_update_on_segments_is_the_unsharded_update_on_cuda(name: str) -> None:
    make = {**ELEMENTWISE, **CUDA_KERNELS}[name]
    for world in (2, 3, 5):
        emulated_ranks_match(make, world, "cuda")


@pytest.mark.parametrize("name", ["adam_foreach", "adam_fused"])
def test_world_of_one_trains_like_torch(torchrun_world_of_one, name: str) -> None:  # noqa: F811
    assert_trains_like_one_process(CUDA_KERNELS[name], "cuda", shard_optimizer_state=True)
