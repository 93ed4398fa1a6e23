"""dear: decoupled all-reduce (reduce-scatter in backward, all-gather in the next forward).

The packages are the layers, each importing only those below it (docs/ARCHITECTURE.md;
tests/test_architecture.py checks): comm (backends, dear.init, the launcher, the hang report)
-> fusion (buckets, layouts, the schedule) -> diagnose (tracer, replay) -> autotune -> guards
(the contract's checks) -> shardops (work on the reduced shards) -> sharding -> engine (the
optimizer and its data path) -> kfac, horovod and the integrations (lightning.py,
huggingface.py); config.py, native.py, checkpoint.py and interfaces.py sit under all of them.
"""

from . import diagnose  # the dear.diagnose subpackage: trace, report, simulate
from .checkpoint import atomic_save
from .comm import launch
from .comm.base import ReduceOp
from .comm.compression import Compression
from .comm.runtime import (
                           allreduce,
                           broadcast_optimizer_state,
                           broadcast_parameters,
                           init,
                           is_initialized,
                           local_rank,
                           rank,
                           shutdown,
                           size,
)
from .engine.join import join
from .engine.optimizer import DistributedOptimizer
from .kfac import KFAC
from .native import native_available

launch.align_horovod_timeout()      # before a script's hvd.init(): DEAR_TIMEOUT governs Horovod's

Average = ReduceOp.Average
Sum = ReduceOp.Sum

__version__ = "0.1.0"

__all__ = [
    "Average", "Compression", "DistributedOptimizer", "KFAC", "ReduceOp", "Sum", "allreduce",
    "atomic_save", "broadcast_optimizer_state", "broadcast_parameters", "diagnose", "init",
    "is_initialized", "join", "local_rank", "native_available", "rank", "shutdown", "size",
]
