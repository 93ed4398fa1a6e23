"""Horovod's torch API without Horovod: `import dear.horovod as hvd`.

For scripts written against horovod.torch 0.28 (the last release), run by torchrun, srun or
mpirun on torch.distributed (Gloo for CPU tensors, NCCL for CUDA tensors); Horovod need not be
installed and is never imported. The collectives keep Horovod's signatures and semantics (new
tensors, averaging by default, prescale/postscale factors, process sets, async handles,
autograd); every collective first agrees with the other ranks on what it is (negotiate.py), so a
mismatch is an error on every rank instead of a hang. DistributedOptimizer is
dear.DistributedOptimizer (decoupled reduce-scatter / all-gather) behind Horovod's arguments.
docs/horovod-api.md says what differs.
"""

from . import elastic as elastic
from .autograd import (
                       allgather,
                       allreduce,
                       alltoall,
                       broadcast,
                       grouped_allgather,
                       grouped_allreduce,
                       grouped_reducescatter,
                       reducescatter,
)
from .basics import (
                       ProcessSet,
                       add_process_set,
                       ccl_built,
                       cross_rank,
                       cross_size,
                       cuda_built,
                       ddl_built,
                       global_process_set,
                       gloo_built,
                       gloo_enabled,
                       init,
                       is_homogeneous,
                       is_initialized,
                       local_rank,
                       local_size,
                       mpi_built,
                       mpi_enabled,
                       mpi_threads_supported,
                       nccl_built,
                       rank,
                       remove_process_set,
                       rocm_built,
                       shutdown,
                       size,
                       start_timeline,
                       stop_timeline,
)
from .compression import Compression
from .control import HorovodInternalError
from .functions import (
                       DistributedOptimizer,
                       SyncBatchNorm,
                       allgather_object,
                       broadcast_object,
                       broadcast_optimizer_state,
                       broadcast_parameters,
)
from .handles import poll, synchronize
from .ops import (
                       Adasum,
                       Average,
                       Max,
                       Min,
                       Product,
                       Sum,
                       allgather_async,
                       allreduce_,
                       allreduce_async,
                       allreduce_async_,
                       alltoall_async,
                       barrier,
                       broadcast_,
                       broadcast_async,
                       broadcast_async_,
                       grouped_allgather_async,
                       grouped_allreduce_,
                       grouped_allreduce_async,
                       grouped_allreduce_async_,
                       grouped_reducescatter_async,
                       join,
                       reducescatter_async,
                       sparse_allreduce_async,
)

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max",
    "Min", "ProcessSet", "Product", "Sum", "SyncBatchNorm", "add_process_set", "allgather",
    "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async", "remove_process_set",
    "rocm_built", "shutdown", "size", "sparse_allreduce_async", "start_timeline",
    "stop_timeline", "synchronize",
]
