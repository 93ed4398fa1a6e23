"""The small interface every communication backend implements.

All collectives work on flat, contiguous 1-D tensors and only SUM: averaging, pre-division and
compression belong to the caller, so every backend gives bit-comparable results. Every call is
asynchronous and returns a `Work` whose `wait()` completes it; callers must issue collectives in
the same order on every rank.
"""

from __future__ import annotations

import abc
import datetime
import enum
from typing import Any, Callable, Optional

import torch

from . import wire


class ReduceOp(enum.Enum):
    """How gradients from different ranks combine (Horovod's names)."""

    Average = "average"
    Sum = "sum"


_HOROVOD_OPS = {0: "Average", 1: "Sum", 2: "Adasum"}   # horovod.torch's constants


def resolve_op(op: Any) -> ReduceOp:
    """dear.Average / dear.Sum, or Horovod's hvd.Average / hvd.Sum; Adasum is refused."""
    if isinstance(op, ReduceOp):
        return op
    name = _HOROVOD_OPS.get(op) if isinstance(op, int) and not isinstance(op, bool) else None
    if name is None and isinstance(op, str):
        name = {"average": "Average", "sum": "Sum", "adasum": "Adasum"}.get(op.lower())
    if name == "Adasum":
        raise ValueError("op=Adasum is not supported by dear: use dear.Average or dear.Sum")
    if name is None:
        raise TypeError(f"op must be dear.Average or dear.Sum, got {op!r}")
    return ReduceOp[name]


#: errors a collective raises on this rank alone as it is called, before anything is sent (bad
#: arguments): a refusal, not a failed peer
REFUSED_AT_ISSUE = (ValueError, TypeError)


class Work(abc.ABC):
    """Handle of one asynchronous collective."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until the result is in the output tensor."""


class DoneWork(Work):
    """A collective that completed when it was issued (size-1 groups, synchronous paths)."""

    def wait(self) -> None:
        return None


class CallbackWork(Work):
    """Waits on inner handles, then runs a finishing step (e.g. a local reduction) once."""

    def __init__(self, inner: list[Any], finish: Optional[Callable[[], object]] = None,
                 timeout: Optional[float] = None) -> None:
        self.inner = inner                  # public: dear.diagnose's tracer relays them
        self._finish = finish
        self._done = False
        # DEAR_TIMEOUT for torch.distributed handles: the process group's own timeout may be
        # torch's default (30 minutes) when the user created the group.
        self._timeout = None if timeout is None else datetime.timedelta(seconds=timeout)

    def wait(self) -> None:
        if self._done:
            return
        for work in self.inner:
            if self._timeout is not None and not isinstance(work, Work):
                work.wait(self._timeout)
            else:
                work.wait()
        if self._finish is not None:
            self._finish()
        self._done = True


class Communicator(abc.ABC):
    """Collectives over one group of ranks."""

    #: short name shown in logs and benchmark tables ("gloo-pairwise", "nccl", "horovod", ...)
    name: str = "abstract"
    #: whether collectives may be issued from dear's executor thread (dear/fusion/schedule.py)
    #: as well as from the training thread; False keeps every call on the training thread
    #: (and dear's planned schedule off).
    issue_from_any_thread: bool = True
    #: whether waiting for a collective on CUDA tensors only makes the current stream wait
    #: (NCCL), never the host; the planned schedule then issues its chunks on a side stream.
    stream_ordered: bool = False
    #: whether, in a world of one, a reduce-scatter or all-gather whose output is its input is
    #: done as issued; buckets then keep their shard in their buffer (dear/fusion/bucket.py).
    in_place_alone: bool = False

    @property
    def rendezvous_store(self) -> Optional[Any]:
        """A key-value store (torch's Store interface) every rank of the group reaches outside
        its collectives, for the hang report and out-of-band meetings (dear/comm/hang.py); None
        where the backend has none of its own (torch.distributed's default store serves)."""
        return None

    @property
    @abc.abstractmethod
    def rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def size(self) -> int: ...

    @property
    def local_rank(self) -> int:
        return 0

    @abc.abstractmethod
    def reduce_scatter(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        """Sum `input` (numel = size * output.numel()) over ranks; this rank keeps shard `rank`."""

    def reduce_scatter_columns(self, input: torch.Tensor, output: torch.Tensor, start: int,
                               length: int) -> Work:
        """Sum columns [start, start + length) of `input` viewed as (size, output.numel())
        over ranks into output[start:start + length]: one piece of a reduce-scatter, so a
        bucket larger than the fusion threshold can travel in pieces. Backends that read the
        pieces in place override this and `pieces_in_place`; here a contiguous copy and a
        reduce-scatter."""
        check_shard_sizes(input, output, self.size)
        if start == 0 and length == output.numel():
            return self.reduce_scatter(input, output)
        staging = [input.view(self.size, -1)[:, start:start + length].contiguous().view(-1)]
        work = self.reduce_scatter(staging[0], output[start:start + length])
        # The copy lives until the collective is waited for (a backend may not hold it; on a
        # GPU the wait orders the current stream after the collective, so reuse is safe).
        return CallbackWork([work], staging.clear)

    def pieces_in_place(self, tensor: torch.Tensor) -> bool:
        """Whether reduce_scatter_columns sends `tensor`'s pieces from where they lie (no
        copy); only then does a bucket larger than the threshold travel in pieces."""
        return False

    @abc.abstractmethod
    def all_gather(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        """Concatenate every rank's `input` into `output` (numel = size * input.numel())."""

    def all_gather_columns(self, input: torch.Tensor, output: torch.Tensor, start: int,
                           length: int) -> Work:
        """All-gather elements [start, start + length) of every rank's `input` (a shard) into
        the same columns of `output` viewed as (size, input.numel()): one chunk of an
        all-gather, so a large one can travel in pieces. Backends that gather into place
        override this; here a contiguous gather and a copy."""
        check_shard_sizes(output, input, self.size)
        if start == 0 and length == input.numel():
            return self.all_gather(input, output)
        staging = input.new_empty(self.size * length)
        work = self.all_gather(input[start:start + length], staging)

        def place() -> None:
            output.view(self.size, -1)[:, start:start + length].copy_(
                staging.view(self.size, length))
            if staging.is_cuda:    # read on the waiting stream, maybe not where it was made
                staging.record_stream(torch.cuda.current_stream(staging.device))
        return CallbackWork([work], place)

    def all_to_all(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        """Block r of `input` (size equal blocks) goes to rank r; block r of `output` comes
        from rank r: the one-hop exchange of a quantized reduce-scatter, where every value is
        quantized once and summed in full precision by its owner (dear/fusion/quantized.py).
        Backends without one say so: `supports_all_to_all`."""
        raise NotImplementedError(f"the {self.name} backend has no all-to-all")

    @property
    def supports_all_to_all(self) -> bool:
        return type(self).all_to_all is not Communicator.all_to_all

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor) -> Work:
        """Sum `tensor` over ranks, in place."""

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int) -> Work:
        """Copy `tensor` from rank `root` to every rank, in place."""

    @abc.abstractmethod
    def broadcast_object(self, obj: Any, root: int) -> Any:
        """Return rank `root`'s picklable `obj` on every rank (blocking)."""

    @abc.abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Return every rank's picklable `obj`, indexed by rank (blocking)."""

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raise a clear TypeError for a dtype this backend cannot communicate."""

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1)).wait()

    def shutdown(self) -> None:
        """Release the group's resources (the backend may own them)."""

    # ---------------------------------------------- a world that changes (Horovod Elastic)
    @property
    def elastic(self) -> bool:
        """The world may change under it while the process lives (Horovod Elastic): ranks
        leave and join, and Horovod is re-initialised in place (dear/comm/horovod_elastic.py)."""
        return False

    @property
    def moved(self) -> bool:
        """The world changed since the last `rejoin()` (or the start): a collective of it
        failed, or this rank's rank or the size are not what they were."""
        return False

    def rejoin(self) -> None:
        """Every rank, at the same point, after the world changed: its collectives start
        over (names, failure records) in the world as it is now."""


#: Errors of failed collectives that a launcher recovers from in place (Horovod Elastic's
#: HorovodInternalError, which hvd.elastic.run catches): dear adds its text and keeps the type.
_recoverable: list[type[BaseException]] = []


def register_recoverable(kind: type[BaseException]) -> None:
    if kind not in _recoverable:
        _recoverable.append(kind)


def recoverable_errors() -> tuple[type[BaseException], ...]:
    """The error types of failed collectives a launcher recovers from (for `except`: empty
    when none is registered)."""
    return tuple(_recoverable)


def collective_error(message: str, cause: BaseException) -> Exception:
    """dear's error for a failed collective (`raise collective_error(...) from cause`): a
    RuntimeError, or the cause's own type where that is one a launcher recovers from."""
    for kind in _recoverable:
        if isinstance(cause, kind):
            try:
                error = type(cause)(message)
            except Exception:                  # noqa: BLE001 - a constructor of its own
                break
            if isinstance(error, Exception):
                return error
    return RuntimeError(message)


class WrappedCommunicator(Communicator):
    """A communicator around another (`inner`): rank, size and the backend's own extras
    (`.group`, ...) are the inner one's. dear's flight record (comm/flight.py) and the
    diagnose tracer (diagnose/comm.py) wrap this way; subclasses define the collectives."""

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner
        self.name = inner.name

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    @property
    def local_rank(self) -> int:
        return self.inner.local_rank

    @property
    def in_place_alone(self) -> bool:  # type: ignore[override]
        return self.inner.in_place_alone

    def __getattr__(self, name: str) -> Any:        # backend extras (.group, ...)
        if name == "inner":                          # not set yet (unpickling, __init__)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def check_dtype(self, dtype: torch.dtype) -> None:
        self.inner.check_dtype(dtype)

    @property
    def supports_all_to_all(self) -> bool:
        return self.inner.supports_all_to_all

    def shutdown(self) -> None:
        self.inner.shutdown()

    @property
    def elastic(self) -> bool:
        return self.inner.elastic

    @property
    def moved(self) -> bool:
        return self.inner.moved

    def rejoin(self) -> None:
        self.inner.rejoin()


def broadcast_object_with(comm: Communicator, obj: Any, root: int) -> Any:
    """`broadcast_object` through the communicator's own broadcast (which honours DEAR_TIMEOUT):
    the encoded size (dear/comm/wire.py), then the bytes. CPU tensors: for backends that move
    CPU tensors."""
    if comm.size == 1:
        return obj
    payload = wire.encode(obj) if comm.rank == root else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    comm.broadcast(size, root).wait()
    data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if comm.rank == root
            else torch.empty(int(size.item()), dtype=torch.uint8))
    if data.numel():
        comm.broadcast(data, root).wait()
    return obj if comm.rank == root else wire.decode(data.numpy().tobytes())


def all_gather_object_with(comm: Communicator, obj: Any) -> list[Any]:
    """`all_gather_object` through the communicator's own all-gather (DEAR_TIMEOUT): sizes,
    then the bytes padded to the largest."""
    if comm.size == 1:
        return [obj]
    payload = wire.encode(obj)
    sizes = torch.empty(comm.size, dtype=torch.int64)
    comm.all_gather(torch.tensor([len(payload)], dtype=torch.int64), sizes).wait()
    width = int(sizes.max().item())
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    table = torch.empty(comm.size * width, dtype=torch.uint8)
    comm.all_gather(mine, table).wait()
    rows = table.view(comm.size, width)
    return [wire.decode(rows[r, :int(sizes[r])].numpy().tobytes()) for r in range(comm.size)]


def check_flat(tensor: torch.Tensor, what: str) -> None:
    if tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(f"{what} must be a contiguous 1-D tensor, got shape {tuple(tensor.shape)}")


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of two (contiguous) tensors overlaps."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def check_all_to_all(input: torch.Tensor, output: torch.Tensor, size: int) -> None:
    check_flat(input, "all_to_all input")
    check_flat(output, "all_to_all output")
    if input.numel() != output.numel() or input.numel() % size or input.dtype != output.dtype:
        raise ValueError(f"all_to_all: input and output must be {size} equal blocks of one "
                         f"dtype, got {input.numel()} {input.dtype} and {output.numel()} "
                         f"{output.dtype} elements")
    if overlaps(input, output):
        raise ValueError("all_to_all: the output overlaps the input; pass separate buffers")


def check_shard_sizes(full: torch.Tensor, shard: torch.Tensor, size: int) -> None:
    check_flat(full, "the full buffer")
    check_flat(shard, "the shard buffer")
    if full.numel() != shard.numel() * size:
        raise ValueError(
            f"full buffer has {full.numel()} elements, expected {size} x {shard.numel()} "
            f"(pad buckets to a multiple of the world size)")
    if full.dtype != shard.dtype or full.device != shard.device:
        raise ValueError("full and shard buffers must share dtype and device")
