"""K-FAC's communication: its own transport (all-reduce, reduce to one rank, broadcast), the
upper-triangle packing of symmetric factors, and flat buckets of named slots.

dear's `Communicator` has no reduce-to-one-rank, which PAD needs. On torch.distributed the
transport therefore talks to torch directly, on process groups of its own (made once, by every
rank, in KFAC's constructor), so its collectives never interleave with the optimizer's. Gloo's
own `reduce` is slow for this use: two concurrent reduces to different roots took longer than
one all-reduce of both, and far longer than direct sends
(docs/benchmarks.md#k-facs-reduce-on-gloo), so on Gloo a reduce is direct
sends to the root (irecv-first; messages from a higher to a lower rank on a second group, so
each direction has its own Gloo transport thread) and a local sum. With PAD each rank is the
root of its own layers, so the reduces of all owners together move what a reduce-scatter moves.
On NCCL `dist.reduce` is used. On other backends (Horovod) a reduce is an all-reduce: correct,
without the saving.
"""

from __future__ import annotations

import datetime
import functools
import logging
import statistics
import sys
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import runtime, wire
from ..comm.base import CallbackWork, Communicator, DoneWork, Work
from ..comm.flight import FlightChannel
from ..comm.link import measure_link
from ..comm.local import LocalCommunicator
from ..comm.torch_dist import carries_cpu_on_gloo
from .costs import NetworkModel

log = logging.getLogger("dear")
_TAG_OFFSET = 1 << 24     # above the tags dear's communicator uses on a shared group
_SHARED: dict[tuple[int, int], tuple[Any, Transport]] = {}


def group_timeout() -> datetime.timedelta:
    """K-FAC's own process groups fail a collective after DEAR_TIMEOUT, as dear's do: torch's
    new_group gives them its 30-minute default whatever the default group's timeout, and a
    rank stuck in one kept its process alive that long after the fault."""
    from ..config import Config
    seconds = (runtime.config() if runtime.is_initialized() else Config.from_env()).timeout
    return datetime.timedelta(seconds=seconds)


class Transport:
    """Async collectives on flat tensors, issued in the same order on every rank."""

    def __init__(self, comm: Communicator | None = None,
                 group: dist.ProcessGroup | None = None, torch_dist: bool = False) -> None:
        self._comm = comm
        self._torch = torch_dist
        self._tag = 0
        self._reverse: dist.ProcessGroup | None = None
        self._group = group
        self._owned: list[dist.ProcessGroup] = []
        if torch_dist:
            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
            # CPU tensors on Gloo (also of a "cpu:gloo,cuda:nccl" group) take the
            # point-to-point reduce below; CUDA tensors take the backend's own.
            self._gloo = carries_cpu_on_gloo(str(dist.get_backend(group)))
            if group is None and self.size > 1:        # groups of our own: every rank, now
                self._group = dist.new_group(group_desc="dear_kfac", timeout=group_timeout())
                self._owned.append(self._group)
                if self._gloo:
                    self._reverse = dist.new_group(backend="gloo", group_desc="dear_kfac_rev",
                                                   timeout=group_timeout())
                    self._owned.append(self._reverse)
        else:
            assert comm is not None
            self.rank, self.size, self._gloo = comm.rank, comm.size, False
        self.name = (f"torch-{dist.get_backend(self._group)}" if torch_dist
                     else getattr(comm, "name", "local"))
        # Collectives on groups of our own get a flight record of their own (dear's
        # communicator records the others), so a stalled peer is named here too.
        self._flight = self._flight_channel() if torch_dist and self.size > 1 else None

    @property
    def on_torch_distributed(self) -> bool:
        """Its groups are torch.distributed's (else dear's communicator of another backend)."""
        return self._torch

    def _flight_channel(self) -> FlightChannel | None:
        world = dist.get_world_size()
        members = (dist.get_process_group_ranks(self._group) if self._group is not None
                   else list(range(world)))
        name = "dear.KFAC's group" + ("" if len(members) == world else f" of ranks {members}")
        return runtime.flight_channel(name, members)

    def _issued(self, kind: str, tensor: Tensor, issue: Callable[[], Work]) -> Work:
        return (self._flight.recorded(kind, tensor, issue) if self._flight is not None
                else issue())

    @classmethod
    def from_environment(cls) -> Transport:
        """dear's communicator if dear.init() ran; else torch.distributed's default group (DDP
        users); else Horovod if hvd.init() ran; else a world of one."""
        from ..comm.flight import backend_of
        from ..comm.torch_dist import TorchCommunicator
        if runtime.is_initialized():
            comm = runtime.communicator()
            backend = backend_of(comm)
            if isinstance(backend, TorchCommunicator):
                return cls._shared(backend.group)
            return cls(comm)
        if dist.is_available() and dist.is_initialized():
            return cls._shared(None)
        hvd = sys.modules.get("horovod.torch")
        if hvd is not None and getattr(hvd, "is_initialized", lambda: False)():
            from ..comm.horovod import HorovodCommunicator
            return cls(HorovodCommunicator())
        return cls(LocalCommunicator())

    @classmethod
    def _shared(cls, group: dist.ProcessGroup | None) -> Transport:
        """One transport (and so one pair of groups) per torch group and process: every KFAC
        instance made on every rank in the same order shares it, in the same order."""
        key = (id(dist.group.WORLD), id(group))
        cached = _SHARED.get(key)
        if cached is None or cached[0] is not dist.group.WORLD:
            cached = (dist.group.WORLD, cls(group=group, torch_dist=True))
            _SHARED[key] = cached
        return cached[1]

    def peer(self, index: int) -> int:
        return dist.get_global_rank(self._group, index) if self._group is not None else index

    def all_reduce(self, tensor: Tensor) -> Work:
        if self.size == 1:
            return DoneWork()
        if not self._torch:
            return self._comm.all_reduce(tensor)  # type: ignore[union-attr]
        return self._issued("all_reduce", tensor, lambda: CallbackWork(
            [dist.all_reduce(tensor, group=self._group, async_op=True)]))

    def broadcast(self, tensor: Tensor, root: int) -> Work:
        if self.size == 1:
            return DoneWork()
        if not self._torch:
            return self._comm.broadcast(tensor, root)  # type: ignore[union-attr]
        return self._issued("broadcast", tensor, lambda: CallbackWork(
            [dist.broadcast(tensor, self.peer(root), group=self._group, async_op=True)]))

    def reduce(self, tensor: Tensor, root: int) -> Work:
        """Sum `tensor` over ranks into rank `root`'s copy; other ranks' copies are unspecified."""
        if self.size == 1:
            return DoneWork()
        if not self._torch:
            _log_reduce_fallback(self.name)
            return self._comm.all_reduce(tensor)  # type: ignore[union-attr]
        return self._issued("reduce", tensor, lambda: self._reduce(tensor, root))

    def _reduce(self, tensor: Tensor, root: int) -> Work:
        if not self._gloo or tensor.is_cuda:
            return CallbackWork([dist.reduce(tensor, self.peer(root), group=self._group,
                                             async_op=True)])
        self._tag = (self._tag + 1) % (1 << 20)
        tag, me = _TAG_OFFSET + self._tag, self.rank
        if me != root:
            group = self._group if me < root or self._reverse is None else self._reverse
            return CallbackWork([dist.isend(tensor, self.peer(root), group, tag)])
        scratch = [(src, torch.empty_like(tensor)) for src in range(self.size) if src != me]
        works = [dist.irecv(buf, self.peer(src), self._group if src < me or self._reverse
                            is None else self._reverse, tag) for src, buf in scratch]

        def finish() -> None:
            for _, buf in scratch:               # fixed order: ranks ascending
                tensor.add_(buf)

        return CallbackWork(works, finish)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        if self.size == 1:
            return obj
        if not self._torch:
            return self._comm.broadcast_object(obj, root)  # type: ignore[union-attr]
        box: list[Any] = [wire.encode(obj) if self.rank == root else None]  # torch: bytes

        def call() -> None:
            dist.broadcast_object_list(box, src=self.peer(root), group=self._group)
        if self._flight is not None:
            self._flight.blocking("broadcast_object", call)
        else:
            call()
        return obj if self.rank == root else wire.decode(box[0])

    def shutdown(self) -> None:
        """Release the groups this transport made (not the caller's)."""
        while self._owned:
            group = self._owned.pop()
            if dist.is_initialized():
                dist.destroy_process_group(group)


@functools.cache
def _log_reduce_fallback(name: str) -> None:
    log.info("dear.KFAC: the %s backend has no reduce; PAD reduces factors with all-reduce",
             name)


# ----------------------------------------------------------------- symmetric packing

@functools.lru_cache(maxsize=64)
def _triu_index(dim: int, device: torch.device) -> tuple[Tensor, Tensor]:
    rows, cols = torch.triu_indices(dim, dim, device=device)
    return rows * dim + cols, cols * dim + rows


def packed_size(dim: int, diagonal: bool, symmetric: bool) -> int:
    if diagonal:
        return dim
    return dim * (dim + 1) // 2 if symmetric else dim * dim


def pack(factor: Tensor, out: Tensor, diagonal: bool, symmetric: bool) -> None:
    """Write a factor into `out`: a diagonal as is, a symmetric matrix as its upper triangle."""
    if diagonal or not symmetric:
        out.copy_(factor.reshape(-1))
    else:
        upper, _ = _triu_index(factor.shape[0], factor.device)
        torch.index_select(factor.reshape(-1), 0, upper, out=out)


def unpack(flat: Tensor, dim: int, diagonal: bool, symmetric: bool) -> Tensor:
    """A new full factor from its packed form."""
    if diagonal:
        return flat.clone()
    if not symmetric:
        return flat.reshape(dim, dim).clone()
    upper, lower = _triu_index(dim, flat.device)
    full = flat.new_empty(dim * dim)
    full.index_copy_(0, lower, flat)
    full.index_copy_(0, upper, flat)
    return full.reshape(dim, dim)


# ----------------------------------------------------------------- buckets

class FlatBucket:
    """One flat buffer holding named slots, then one flag per slot (1 where this rank filled the
    slot). Summed over ranks, a flag counts the ranks that contributed, so an average divides by
    the contributors and a slot nobody filled is recognised (as dear's optimizer does for
    unused parameters). `root` None: all-reduced; else reduced to / broadcast from `root`."""

    def __init__(self, slots: Sequence[tuple[Hashable, int]], dtype: torch.dtype,
                 root: int | None = None, device: torch.device | None = None) -> None:
        self.keys = [k for k, _ in slots]
        self._index = {k: i for i, k in enumerate(self.keys)}
        self.offsets: dict[Hashable, tuple[int, int]] = {}
        offset = 0
        for key, numel in slots:
            self.offsets[key] = (offset, numel)
            offset += numel
        self.data_numel = offset
        self.root = root
        self.buffer = torch.zeros(offset + len(slots), dtype=dtype, device=device)
        self.flags = self.buffer[offset:]
        self.filled = 0
        self.work: Work | None = None

    def view(self, key: Hashable) -> Tensor:
        offset, numel = self.offsets[key]
        return self.buffer[offset:offset + numel]

    def mark(self, key: Hashable) -> None:
        index = self._index[key]
        if self.flags[index].item() == 0:
            self.filled += 1
        self.flags[index] = 1

    def count(self, key: Hashable) -> float:
        return float(self.flags[self._index[key]].item())

    @property
    def full(self) -> bool:
        return self.filled == len(self.keys)

    @property
    def started(self) -> bool:
        return self.work is not None

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()

    def reset(self) -> None:
        self.buffer.zero_()
        self.filled = 0
        self.work = None


def split_into_buckets(items: Sequence[tuple[Hashable, int, Any]], cap_numel: int
                       ) -> list[tuple[list[tuple[Hashable, int]], Any]]:
    """Consecutive items (key, numel, group) with the same group (e.g. root and dtype) share a
    bucket of up to cap_numel elements (a larger item gets a bucket of its own)."""
    buckets: list[tuple[list[tuple[Hashable, int]], Any]] = []
    current: list[tuple[Hashable, int]] = []
    size, group = 0, None
    for key, numel, g in items:
        if current and (g != group or size + numel > cap_numel):
            buckets.append((current, group))
            current, size = [], 0
        current.append((key, numel))
        size += numel
        group = g
    if current:
        buckets.append((current, group))
    return buckets


def measure_network(transport: Transport, large_numel: int = 1 << 18, repeats: int = 3,
                    device: torch.device | str = "cpu") -> NetworkModel:
    """alpha and beta from timed all-reduces of 1 and `large_numel` floats on `device`, where
    the factors live (an NCCL group takes CUDA tensors only), by dear/comm/link.py's
    `measure_link` (the median of `repeats`); a collective: rank 0's figures are returned on
    every rank so all ranks plan alike."""
    n = transport.size
    if n == 1:
        return NetworkModel()
    cuda = torch.device(device).type == "cuda"
    buffers = {4: torch.zeros(1, device=device), 4 * large_numel: torch.zeros(large_numel,
                                                                            device=device)}

    def run(kind: str, nbytes: int) -> None:
        transport.all_reduce(buffers[nbytes]).wait()
        if cuda:                                         # wait() only orders the stream
            torch.cuda.synchronize(device)

    for nbytes in buffers:                               # warm-up, and a loose barrier
        run("all_reduce", nbytes)
    link = measure_link(run, ("all_reduce",), sorted(buffers), n, repeats, pick=statistics.median)
    rate = link.rate["all_reduce"]
    model = NetworkModel(link.alpha["all_reduce"], 1.0 / rate if rate > 0 else 1e-9)
    return transport.broadcast_object(model, 0)
