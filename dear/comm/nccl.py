"""Direct NCCL backend (`dear.init(backend="nccl")`): collectives without ProcessGroupNCCL.

Reduce-scatters and all-gathers run on one dedicated CUDA stream per communicator (issue order
is NCCL order, the same on every rank). Each collective first waits, on the GPU, for an event
recorded on the caller's current (compute) stream, so it reads the gradients only once the
kernels that produced them are done; its `Work.wait()` makes the caller's stream wait for the
collective's completion event, so the host is never blocked. Tensors are marked as used by the
communication stream, so the caching allocator does not hand their memory out too early.

The communicator is the one in csrc/ (`dear._native.NcclCommunicator`) when the extension was
built with CUDA and NCCL, else nccl4py (`pip install 'dear[nccl]'`). Ranks meet through a
torch.distributed store: the default group's when torch.distributed is initialised, else a
TCPStore from MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE (what torchrun sets); rank 0 puts the NCCL
unique id there. No MPI. Picklable objects (broadcast_object, all_gather_object) go through
the same store.
"""

from __future__ import annotations

import datetime
import importlib.util
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import native
from . import launch, wire
from .base import Communicator, Work, check_flat, check_shard_sizes

_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
              torch.uint8, torch.int32, torch.int64)


def availability() -> str:
    """'csrc', 'nccl4py', or 'no (<why>)': what backend='nccl' would use here."""
    if not torch.cuda.is_available():
        return "no (needs a CUDA GPU)"
    if native.build_info().get("nccl"):
        return "csrc"
    if importlib.util.find_spec("nccl") is not None:
        return "nccl4py"
    return "no (neither dear's extension with NCCL nor nccl4py: pip install 'dear[nccl]')"


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(
            "dear.init(backend='nccl') needs a CUDA GPU, and torch.cuda.is_available() is False "
            f"here (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}). On "
            "CPU use backend='torch' (Gloo) or 'auto'.")


class _EventWork(Work):
    """Done when `event` (recorded on the communication stream) has happened."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self._event)


class _Nccl4pyComm:
    """nccl4py behind the same small interface as the csrc communicator."""

    def __init__(self, rank: int, size: int, uid: bytes, device: torch.device) -> None:
        from nccl import core as nccl_core
        self._core = nccl_core
        self._comm = nccl_core.Communicator.init(size, rank, nccl_core.UniqueId.from_bytes(uid))
        self._device = device
        self._stream = torch.cuda.Stream(device=device)

    @staticmethod
    def unique_id() -> bytes:
        from nccl import core as nccl_core
        return bytes(nccl_core.get_unique_id())

    def _launch(self, tensors: list[torch.Tensor], call: Any) -> Work:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self._device))
        self._stream.wait_event(ready)
        with torch.cuda.stream(self._stream):
            call(self._stream.cuda_stream)
        for t in tensors:
            t.record_stream(self._stream)
        done = torch.cuda.Event()
        done.record(self._stream)
        return _EventWork(done)

    def reduce_scatter(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        return self._launch([input, output], lambda s: self._comm.reduce_scatter(
            input, output, self._core.SUM, stream=s))

    def all_gather(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        return self._launch([input, output], lambda s: self._comm.allgather(input, output,
                                                                            stream=s))

    def all_reduce(self, tensor: torch.Tensor) -> Work:
        return self._launch([tensor], lambda s: self._comm.allreduce(tensor, tensor,
                                                                     self._core.SUM, stream=s))

    def broadcast(self, tensor: torch.Tensor, root: int) -> Work:
        return self._launch([tensor], lambda s: self._comm.broadcast(tensor, tensor, root,
                                                                     stream=s))

    def destroy(self) -> None:
        self._comm.destroy()


class _CsrcComm:
    """dear._native.NcclCommunicator (csrc/cuda/nccl_communicator.cpp)."""

    def __init__(self, rank: int, size: int, uid: bytes, device: torch.device) -> None:
        ext = native.extension()
        assert ext is not None
        self._comm = ext.NcclCommunicator(rank, size, uid, device.index)

    @staticmethod
    def unique_id() -> bytes:
        ext = native.extension()
        assert ext is not None
        return bytes(ext.nccl_unique_id())

    def reduce_scatter(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        return self._comm.reduce_scatter(input, output)

    def all_gather(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        return self._comm.all_gather(input, output)

    def all_reduce(self, tensor: torch.Tensor) -> Work:
        return self._comm.all_reduce(tensor)

    def broadcast(self, tensor: torch.Tensor, root: int) -> Work:
        return self._comm.broadcast(tensor, root)

    def destroy(self) -> None:
        self._comm.destroy()


def _store(rank: int, size: int, timeout: float) -> dist.Store:
    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    place = launch.process_env()
    missing = [v for v, value in (("MASTER_ADDR", place.master_addr),
                                  ("MASTER_PORT", place.master_port)) if value is None]
    if missing and size > 1:
        raise RuntimeError(f"dear.init(backend='nccl') needs {', '.join(missing)} (set by "
                           "torchrun) or an initialised torch.distributed to find the other ranks")
    if size == 1:
        return dist.HashStore()
    assert place.master_addr is not None and place.master_port is not None
    return dist.TCPStore(place.master_addr, place.master_port, size,
                         is_master=rank == 0, timeout=datetime.timedelta(seconds=timeout),
                         wait_for_workers=False)


class NcclCommunicator(Communicator):
    """All ranks of the job on NCCL, one GPU per rank (LOCAL_RANK picks it)."""

    name = "nccl"
    stream_ordered = True

    def __init__(self, rank: int, size: int, store: dist.Store, *,
                 implementation: Optional[str] = None) -> None:
        _require_cuda()
        implementation = implementation or availability()
        if implementation not in ("csrc", "nccl4py"):
            raise RuntimeError(f"dear.init(backend='nccl') cannot start: {implementation}")
        impl_cls = _CsrcComm if implementation == "csrc" else _Nccl4pyComm
        self._rank, self._size = rank, size
        self._store = dist.PrefixStore("dear_nccl", store)
        self._device = torch.device("cuda", torch.cuda.current_device())
        self._counter = 0
        self._refuse_shared_gpu()
        if rank == 0:
            self._store.set("unique_id", impl_cls.unique_id())  # type: ignore[arg-type]
        uid = self._store.get("unique_id")
        self._impl: Any = impl_cls(rank, size, uid, self._device)
        self.implementation = implementation
        self.name = f"nccl-{implementation}"

    def _refuse_shared_gpu(self) -> None:
        """NCCL cannot put two ranks on one GPU; its init then waited forever here (measured on
        one H200 with NCCL 2.28.9: no error, no return), so compare the GPUs first."""
        props = torch.cuda.get_device_properties(self._device)
        mine = str(getattr(props, "uuid", "")) or f"{props.name}/{self._device.index}"
        self._store.set(f"gpu/{self._rank}", mine)
        try:
            gpus = [self._store.get(f"gpu/{r}").decode() for r in range(self._size)]
        except Exception as exc:               # noqa: BLE001 - the store's own timeout
            raise RuntimeError(
                "dear.init(backend='nccl'): not every rank reached NCCL's start-up within "
                f"DEAR_TIMEOUT (a rank failed or stalled before it; see its own error): {exc}. "
                "Without this check NCCL's init would wait for it forever") from exc
        shared = [r for r, gpu in enumerate(gpus) if gpu == mine and r != self._rank]
        if shared:
            raise RuntimeError(
                f"dear.init(backend='nccl'): rank {self._rank} and rank(s) {shared} are on the "
                f"same GPU ({mine}); NCCL needs one GPU per rank. Give each local rank its own "
                "GPU (torch.cuda.set_device(LOCAL_RANK), or CUDA_VISIBLE_DEVICES), or use "
                "backend='torch' with Gloo for several ranks on one GPU")

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def local_rank(self) -> int:
        return self._device.index or 0

    def check_dtype(self, dtype: torch.dtype) -> None:
        if dtype not in _SUPPORTED:
            raise TypeError(f"the nccl backend cannot communicate {dtype}; supported: "
                            f"{', '.join(str(d) for d in _SUPPORTED)}")

    def _check_device(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.device != self._device:
                raise ValueError(f"the nccl backend works on tensors on {self._device}, got one "
                                 f"on {t.device}; move the model to its GPU before wrapping")

    def reduce_scatter(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        check_shard_sizes(input, output, self._size)
        self._check_device(input, output)
        return self._impl.reduce_scatter(input, output)

    def all_gather(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        check_shard_sizes(output, input, self._size)
        self._check_device(input, output)
        return self._impl.all_gather(input, output)

    def all_reduce(self, tensor: torch.Tensor) -> Work:
        check_flat(tensor.view(-1), "the all-reduce tensor")
        self._check_device(tensor)
        return self._impl.all_reduce(tensor.view(-1))

    def broadcast(self, tensor: torch.Tensor, root: int) -> Work:
        if not 0 <= root < self._size:
            raise ValueError(f"root rank {root} does not exist in a world of size {self._size}")
        self._check_device(tensor)
        if not tensor.is_contiguous():
            raise ValueError("the nccl backend broadcasts contiguous tensors only")
        return self._impl.broadcast(tensor.view(-1), root)

    def _key(self) -> str:
        # Every rank makes the same object calls in the same order, so the counters agree.
        self._counter += 1
        return f"obj{self._counter}"

    def broadcast_object(self, obj: Any, root: int) -> Any:
        if not 0 <= root < self._size:
            raise ValueError(f"root rank {root} does not exist in a world of size {self._size}")
        key = self._key()
        if self._rank == root:
            self._store.set(key, wire.encode(obj))  # type: ignore[arg-type]  # bytes: fine
            return obj
        return wire.decode(self._store.get(key))

    def all_gather_object(self, obj: Any) -> list[Any]:
        key = self._key()
        self._store.set(f"{key}/{self._rank}", wire.encode(obj))  # type: ignore[arg-type]
        return [obj if r == self._rank else wire.decode(self._store.get(f"{key}/{r}"))
                for r in range(self._size)]

    def barrier(self) -> None:
        self.all_gather_object(None)

    def shutdown(self) -> None:
        impl, self._impl = self._impl, None
        if impl is not None:
            torch.cuda.synchronize(self._device)
            impl.destroy()


def create(timeout: float) -> NcclCommunicator:
    """The communicator for dear.init(backend='nccl'), from torchrun's variables."""
    _require_cuda()
    if dist.is_available() and dist.is_initialized():
        rank, size = dist.get_rank(), dist.get_world_size()
    else:
        place = launch.process_env()       # torchrun's, or srun's/mpirun's via setup_env
        rank, size = place.rank, place.size
    if launch.local_rank_given():
        local, gpus = launch.process_env().local_rank, torch.cuda.device_count()
        if local >= gpus:
            raise RuntimeError(
                f"dear.init(backend='nccl') needs one GPU per local rank: LOCAL_RANK={local} but "
                f"{gpus} GPU(s) are visible here (NCCL cannot put two ranks on one GPU); start "
                "at most that many ranks per machine, or use backend='torch' (Gloo) for CPU "
                "training")
        torch.cuda.set_device(local)
    return NcclCommunicator(rank, size, _store(rank, size, timeout))
