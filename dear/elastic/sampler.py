"""ElasticSampler: Horovod's sampler (same signature, same state_dict) on dear's ranks.

Each epoch is one permutation of the dataset (seeded by `seed + epoch`, the same on every
rank). `processed_num` counts the samples of it already trained on, a prefix of the
permutation; `record_batch` adds a global batch (batch_size x the number of ranks) to it. The
rest of the permutation is dealt out round-robin to the ranks of the moment (rank r takes
positions r, r + N, ...), so after a change of the number of ranks the new ranks share exactly
what no rank trained on: within an epoch nothing committed is trained on twice and nothing is
skipped.

The one exception, as Horovod's and torch's DistributedSampler: where the remaining samples do
not divide among the N ranks, the first `N - remainder` of them are dealt again at the end, so
that every rank runs the same number of batches (a rank that ran out would leave the others
waiting in a collective). Fewer than N samples are then trained on twice, in the last global
batch of the epoch (`padding()` says which). A dataset whose length divides by every size the
job runs at never pads.
"""

from __future__ import annotations

import math
import random
from typing import Any, Callable, Iterator, Optional, Sized

import torch.distributed as dist
import torch.utils.data


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ElasticSampler(torch.utils.data.Sampler):
    """Partitions a dataset across the ranks of the moment and repartitions what is left of
    the epoch after a change (Horovod's `hvd.elastic.ElasticSampler`).

    Put it in the elastic state (`State(sampler=...)` / `TorchState(sampler=...)`), call
    `record_batch()` after each batch, and `set_epoch()` at the END of each epoch (it clears
    the processed count). `rank_size` replaces how the ranks are found (default:
    torch.distributed's default group, a world of one without it).
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0, *,
                 rank_size: Optional[Callable[[], tuple[int, int]]] = None) -> None:
        if not hasattr(dataset, "__len__"):
            raise TypeError("ElasticSampler needs a dataset with a length (a map-style "
                            f"dataset), got {type(dataset).__name__}")
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self._rank_size = rank_size or _world
        self.epoch = 0
        self.processed_indices: set[int] = set()     # Horovod's attribute, unused there too
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` (a new permutation) with nothing processed. Call it at the end of
        an epoch, not at its start: a restart in the middle of an epoch must keep its count."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one global batch as trained on: `batch_size` samples on each rank."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        return dict(epoch=self.epoch, processed_num=self.processed_num)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        try:
            epoch, processed = int(state_dict["epoch"]), int(state_dict["processed_num"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError("ElasticSampler.load_state_dict expects {'epoch': int, "
                             f"'processed_num': int}}, got {state_dict!r}") from exc
        if processed < 0:
            raise ValueError(f"processed_num must be >= 0, got {processed}")
        self.epoch, self.processed_num = epoch, processed
        self.reset()

    def reset(self) -> None:
        """Deal what is left of the epoch to the ranks of the moment (after a change)."""
        self.rank, self.num_replicas = self._rank_size()
        self.remaining_indices = self.permutation()[self.processed_num:]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def permutation(self) -> list[int]:
        """The epoch's order of the whole dataset (Horovod's: random.Random(seed + epoch))."""
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)
        return indices

    def padding(self) -> list[int]:
        """The samples dealt a second time at the end of this stretch of the epoch (fewer
        than the number of ranks; none when the rest divides evenly)."""
        extra = self.total_size - len(self.remaining_indices)
        return self.remaining_indices[:extra]

    def __iter__(self) -> Iterator[int]:
        indices = self.remaining_indices + self.padding()
        assert len(indices) == self.total_size
        mine = indices[self.rank:self.total_size:self.num_replicas]
        assert len(mine) == self.num_samples
        self.indices = mine
        return iter(mine)

    def __len__(self) -> int:
        return self.num_samples


__all__ = ["ElasticSampler"]
