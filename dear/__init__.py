"""dear: decoupled all-reduce (reduce-scatter in backward, all-gather in the next forward)."""

from . import launch
from .checkpoint import atomic_save
from .comm.base import ReduceOp
from .compression import Compression
from . import diagnose  # the dear.diagnose subpackage: trace, report, simulate
from .join import join
from .kfac import KFAC
from .native import native_available
from .optimizer import DistributedOptimizer
from .runtime import (allreduce, broadcast_optimizer_state, broadcast_parameters, init,
                      is_initialized, local_rank, rank, shutdown, size)

launch.align_horovod_timeout()      # before a script's hvd.init(): DEAR_TIMEOUT governs Horovod's

Average = ReduceOp.Average
Sum = ReduceOp.Sum

__version__ = "0.1.0"

__all__ = [
    "Average", "Compression", "DistributedOptimizer", "KFAC", "ReduceOp", "Sum", "allreduce",
    "atomic_save", "broadcast_optimizer_state", "broadcast_parameters", "diagnose", "init",
    "is_initialized", "join", "local_rank", "native_available", "rank", "shutdown", "size",
]
