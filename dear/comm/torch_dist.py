"""torch.distributed backend: NCCL's own collectives on GPU, dear's exchange on Gloo.

On Gloo, reduce-scatter and all-gather run dear's bandwidth-optimal exchange (a ring of
point-to-point messages: gloo_exchange.py says why and what it measured) on the communicator's
group and, for the default group, a twin Gloo group that carries the messages from higher to
lower ranks. A group with both ("cpu:gloo,cuda:nccl", what dear.init() starts where CUDA is
there) takes each tensor to the backend of its device.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import launch
from . import wire
from .base import (CallbackWork, Communicator, Work, all_gather_object_with,
                   broadcast_object_with, check_shard_sizes)
from .gloo_exchange import PairwiseExchange


class TorchCommunicator(Communicator):
    """Collectives over a torch.distributed process group.

    With Gloo and gloo_collectives="pairwise" on the default group (group=None), constructing it
    creates a second process group, so every rank must construct it, in the same order relative
    to its other new_group calls (dear.init() does). For an explicit subgroup no twin is made
    (dist.new_group would need every rank of the world) and all messages use that group.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, *,
                 gloo_collectives: str = "pairwise", timeout: Optional[float] = None) -> None:
        self._group = group
        self._timeout = timeout                # DEAR_TIMEOUT on every wait (None: the group's)
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)
        self._backend = str(dist.get_backend(group)).lower()
        self._gloo_cpu = carries_cpu_on_gloo(self._backend)
        self._pairwise = self._gloo_cpu and gloo_collectives == "pairwise"
        self.stream_ordered = "nccl" in self._backend       # CUDA tensors go to NCCL
        self._reverse: Optional[dist.ProcessGroup] = None
        self._exchange: Optional[PairwiseExchange] = None
        if self._pairwise:
            if group is None and self._size > 1:
                twin = (_timeout_of(group) if timeout is None
                        else datetime.timedelta(seconds=timeout))
                self._reverse = dist.new_group(backend="gloo", timeout=twin,
                                               group_desc="dear_pairwise_reverse")
            # The exchange talks to the ProcessGroup objects directly, in group ranks.
            self._exchange = PairwiseExchange(self._rank, self._size, self._process_group,
                                              self._reverse, timeout)
        self.name = f"{self._backend}-pairwise" if self._pairwise else self._backend

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        return self._group

    def _peer(self, index: int) -> int:
        return dist.get_global_rank(self._group, index) if self._group is not None else index

    def _wait_timeout(self, tensor: torch.Tensor) -> Optional[float]:
        """DEAR_TIMEOUT on the waits of CPU collectives. None for CUDA tensors: NCCL's wait() with
        a timeout blocks the host until the collective ends, where without one it only orders the
        current stream after it (what lets the host run ahead); NCCL's watchdog enforces the
        group's timeout, which dear.init() sets to DEAR_TIMEOUT when it starts the group."""
        return None if tensor.is_cuda else self._timeout

    def _exchange_for(self, tensor: torch.Tensor) -> Optional[PairwiseExchange]:
        """dear's exchange where it carries this tensor (a CPU tensor on Gloo), else None."""
        return self._exchange if tensor.device.type == "cpu" else None

    def reduce_scatter(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        exchange = self._exchange_for(input)
        if exchange is not None:
            return exchange.reduce_scatter(input, output)
        check_shard_sizes(input, output, self._size)
        if self._size == 1:
            output.copy_(input)
            return CallbackWork([])
        return CallbackWork([dist.reduce_scatter_tensor(
            output, input, op=dist.ReduceOp.SUM, group=self._group, async_op=True)],
            timeout=self._wait_timeout(input))

    def pieces_in_place(self, tensor: torch.Tensor) -> bool:
        return self._exchange_for(tensor) is not None

    def reduce_scatter_columns(self, input: torch.Tensor, output: torch.Tensor, start: int,
                               length: int) -> Work:
        exchange = self._exchange_for(input)
        if exchange is not None:
            return exchange.reduce_scatter_columns(input, output, start, length)
        return super().reduce_scatter_columns(input, output, start, length)

    def all_gather(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        exchange = self._exchange_for(input)
        if exchange is not None:
            return exchange.all_gather(input, output)
        check_shard_sizes(output, input, self._size)
        shard = input.numel()
        own = output[self._rank * shard:(self._rank + 1) * shard]
        if own.data_ptr() != input.data_ptr():
            own.copy_(input)
        if self._size == 1:
            return CallbackWork([])
        return CallbackWork([dist.all_gather_into_tensor(
            output, own, group=self._group, async_op=True)], timeout=self._wait_timeout(own))

    def all_gather_columns(self, input: torch.Tensor, output: torch.Tensor, start: int,
                           length: int) -> Work:
        exchange = self._exchange_for(input)
        if exchange is not None:
            return exchange.all_gather_columns(input, output, start, length)
        return super().all_gather_columns(input, output, start, length)

    @property
    def _process_group(self) -> dist.ProcessGroup:
        """The ProcessGroup object itself (the default one when the group is None)."""
        group = self._group if self._group is not None else dist.group.WORLD
        assert group is not None
        return group

    def _bounded(self, tensor: torch.Tensor) -> Optional[datetime.timedelta]:
        """DEAR_TIMEOUT for the Gloo operation itself (CPU tensors), not only for our wait: on
        a group the user made with torch's 30 minutes, a collective a stalled peer never joins
        would otherwise hold Gloo's worker thread, and the process after it raised, that long."""
        if self._timeout is None or tensor.device.type != "cpu" or not self._gloo_cpu:
            return None
        return datetime.timedelta(seconds=self._timeout)

    def all_reduce(self, tensor: torch.Tensor) -> Work:
        bound = self._bounded(tensor)
        if bound is not None:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
            opts.timeout = bound
            return CallbackWork([self._process_group.allreduce([tensor], opts)],
                                timeout=self._wait_timeout(tensor))
        return CallbackWork([dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._group,
                                             async_op=True)], timeout=self._wait_timeout(tensor))

    def broadcast(self, tensor: torch.Tensor, root: int) -> Work:
        if not 0 <= root < self._size:
            raise ValueError(f"root rank {root} does not exist in a world of size {self._size}")
        bound = self._bounded(tensor)
        if bound is not None:
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor, opts.timeout = root, 0, bound
            return CallbackWork([self._process_group.broadcast([tensor], opts)],
                                timeout=self._wait_timeout(tensor))
        return CallbackWork([dist.broadcast(tensor, self._peer(root), group=self._group,
                                            async_op=True)], timeout=self._wait_timeout(tensor))

    def broadcast_object(self, obj: Any, root: int) -> Any:
        if not 0 <= root < self._size:
            raise ValueError(f"root rank {root} does not exist in a world of size {self._size}")
        if self._gloo_cpu:                     # bounded by DEAR_TIMEOUT, as every wait
            return broadcast_object_with(self, obj, root)
        box: list[Any] = [wire.encode(obj) if self._rank == root else None]  # torch unpickles:
        dist.broadcast_object_list(box, src=self._peer(root), group=self._group)  # bytes
        return obj if self._rank == root else wire.decode(box[0])

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self._gloo_cpu:
            return all_gather_object_with(self, obj)
        out: list[Any] = [None] * self._size
        dist.all_gather_object(out, wire.encode(obj), group=self._group)
        return [obj if r == self._rank else wire.decode(b) for r, b in enumerate(out)]

    def barrier(self) -> None:
        dist.barrier(group=self._group)

    def shutdown(self) -> None:
        """Release the twin group (the caller owns `group` and the default group) and every
        reference to a group: a ProcessGroupGloo still referenced when the interpreter tears
        down is destroyed during finalization, which aborts the process now and then
        ("terminate called without an active exception", seen at exit after dear.shutdown()
        while an optimizer, kept alive by a reference cycle, still held this communicator)."""
        reverse, exchange = self._reverse, self._exchange
        self._reverse = self._exchange = None
        if exchange is not None:           # its step thread finishes what was submitted
            exchange.close()
        if reverse is not None and dist.is_initialized():
            dist.destroy_process_group(reverse)


def _timeout_of(group: Optional[dist.ProcessGroup]) -> Optional[datetime.timedelta]:
    """The group's collective timeout (DEAR_TIMEOUT via init_process_group), so the twin fails
    as fast as the group it doubles; None (torch's default) if torch hides it."""
    try:
        pg = group if group is not None else dist.group.WORLD
        backend = pg._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
        return backend.options._timeout
    except (AttributeError, RuntimeError):
        return None


def carries_cpu_on_gloo(backend: str) -> bool:
    """Whether a group of this backend ("gloo", "nccl", "cpu:gloo,cuda:nccl") sends CPU
    tensors over Gloo."""
    backend = backend.lower()
    return backend == "gloo" or "cpu:gloo" in backend.replace(" ", "").split(",")


def default_backend() -> str:
    """What dear.init() starts from torchrun's variables: Gloo for CPU tensors, and NCCL for
    CUDA tensors where CUDA is there (torch's own default). The same on every rank, whatever
    each rank's model lives on: a CPU model on a GPU machine (two ranks on one GPU, say) must
    not be handed to NCCL alone."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init_process_group_from_env(timeout: float) -> None:
    """Start the default group from torchrun's variables (default_backend()). Under Slurm, where
    dear derived the port, the store is dear's: a rank refuses a store that another job or
    step started on the same port, instead of joining its group."""
    wait = datetime.timedelta(seconds=timeout)
    job = launch.job_identity()
    if job is None:
        dist.init_process_group(backend=default_backend(), timeout=wait)
        return
    place = launch.process_env()
    assert place.master_addr is not None and place.master_port is not None  # export() set them
    store = dist.TCPStore(place.master_addr, place.master_port, place.size,
                          is_master=place.rank == 0, timeout=wait, wait_for_workers=False)
    if place.rank == 0:
        store.set("dear/job", job)
    else:
        owner = store.get("dear/job").decode()
        if owner != job:
            raise RuntimeError(
                f"dear.init(): the rendezvous at {place.master_addr}:{place.master_port} "
                f"belongs to {owner}, not to this {job}: two jobs derived the same port. "
                "Set MASTER_PORT to a free port for this step (the same on every task)")
    dist.init_process_group(backend=default_backend(), store=store, rank=place.rank,
                            world_size=place.size, timeout=wait)
