"""The wrap's settings, as one value the engine is built from (dear/engine/optimizer.py settles
them from the arguments and the DEAR_* variables, dear/config.py)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from ..comm.base import Communicator
from ..comm.compression import Compressor
from ..config import Autotune
from ..fusion.fusion_config import FusionConfig


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    fusion: FusionConfig              # the first layout's thresholds
    compression: Compressor
    passes: int                       # backward_passes_per_step at the wrap
    prescale: float                   # before the reduce-scatter (1 / gradient_predivide_factor)
    average: bool                     # op=Average: the sum is divided by the world's size
    predivide: float                  # gradient_predivide_factor (the sum is multiplied by it)
    overlap: bool                     # the all-gathers overlap the next forward (model= given)
    views: bool                       # gradient_as_bucket_view
    sharded: bool                     # shard_optimizer_state
    sparse_as_dense: bool
    groups: Any                       # Horovod's groups=: parameter indices, N, or None
    row_sparse: Any                   # row_sparse= (or DEAR_ROW_SPARSE's value)
    row_sparse_explicit: bool         # given as an argument (else a missing model= is fine)
    planned: bool                     # the planned schedule (else DeAR's order)
    autotune: Autotune
    check_every: int                  # DEAR_CHECK_EVERY (dear/engine/checks.py)
    #: the world may change in place (Horovod Elastic: dear/comm/horovod_elastic.py)
    elastic: bool = False
    #: the wrap's cross-rank checks, run again by every rank when it (re)joins a world
    rejoin_checks: Optional[Callable[[Communicator], None]] = None


__all__ = ["EngineOptions"]
