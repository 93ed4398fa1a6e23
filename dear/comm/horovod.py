"""Horovod backend: Horovod is the control plane, dear's pairwise exchange over Gloo the data plane.

Horovod 0.28.1 over Gloo is not bandwidth-optimal for DeAR's two halves: hvd.reducescatter,
hvd.allgather and an alltoall plus a local sum each take longer than an hvd.allreduce of the
whole buffer (docs/benchmarks.md#horovods-data-plane). So by default (DataPlane.GLOO,
DEAR_HOROVOD_DATA_PLANE=gloo) the reduce-scatters and all-gathers of CPU tensors run dear's
pairwise exchange (`PairwiseExchange`, torch_dist.py) on a private pair of Gloo groups that rank 0
starts and announces through Horovod (gloo_bootstrap.py); torch.distributed's default group stays
the user's. Everything else (rank, size, broadcasts, all-reduces, objects, barriers) stays
Horovod's, so a Horovod script sees Horovod, and the groups carry bfloat16 where Horovod has no
bfloat16. CUDA tensors always take Horovod's path (NCCL there).

DataPlane.HOROVOD uses Horovod's own collectives. Its reduce-scatter is an all-to-all plus a local
sum, not hvd.reducescatter: with Horovod 0.28.1 on Gloo, two reducescatter_async calls in flight
that total about 44 MB (fp32, 2 ranks) return garbage on rank 0, with or without tensor fusion
(16 MB in flight is fine); alltoall_async is correct under the same load. Horovod returns new
tensors, so results are copied into the caller's buffers when the handle completes. Buffers are
flat and padded to a multiple of the world size, so Horovod's uneven split (lower ranks get one
more row) never applies. Every op is named from a counter that advances identically on every
rank, which is how Horovod matches them.

Horovod waits forever for a rank that stalls (its stall check only warns), so `wait()` polls the
handle against a deadline (DEAR_TIMEOUT) instead of blocking in hvd.synchronize: the backoff
starts at 20 us and stops growing at 1 ms, Horovod's own cycle time. A rank that dies makes
Horovod shut down, and the wait raises at once. The Gloo groups fail a wait after DEAR_TIMEOUT,
and at once when a peer's connection drops.
"""

from __future__ import annotations

import enum
import logging
import time
from typing import Any, Callable, Optional, Union

import torch

from . import gloo_bootstrap, launch
from .base import (
    CallbackWork,
    Communicator,
    DoneWork,
    Work,
    all_gather_object_with,
    broadcast_object_with,
    check_all_to_all,
    check_shard_sizes,
    register_recoverable,
)
from .torch_dist import PairwiseExchange

_UNSUPPORTED = (torch.bfloat16,)

log = logging.getLogger("dear")
_timeout_warned = False


def _warn_if_gloo_timeout_default(hvd: Any, timeout: float) -> None:
    """Once per process, where the script started Horovod on Gloo before dear could set its
    Gloo timeout from DEAR_TIMEOUT (launch.align_horovod_timeout): say so, naming the
    variable. Runs when dear takes the started Horovod, never per iteration."""
    global _timeout_warned
    if _timeout_warned:
        return
    try:
        on_gloo = bool(hvd.gloo_enabled())
    except Exception:
        return
    message = launch.horovod_timeout_too_long(timeout) if on_gloo else None
    if message is not None:
        _timeout_warned = True
        log.warning(message)


def _hvd() -> Any:
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise RuntimeError("backend 'horovod' needs Horovod with its torch extension: run "
                           "`make horovod` (see README)") from exc
    if not hasattr(hvd, "init"):
        raise RuntimeError("horovod.torch has no init(): Horovod was built without its torch "
                           "extension; rebuild it with `make horovod`")
    return hvd


class DataPlane(enum.Enum):
    """What carries the Horovod backend's reduce-scatters and all-gathers."""

    GLOO = "gloo"          # dear's pairwise exchange on private Gloo groups (CPU tensors)
    HOROVOD = "horovod"    # Horovod's alltoall (+ local sum) and allgather


class HorovodWork(Work):
    def __init__(self, handle: Any, finish: Optional[Callable[[Any], object]] = None,
                 timeout: float = 300.0) -> None:
        self.handle = handle                   # Horovod's (dear.diagnose polls it)
        self._finish = finish
        self._timeout = timeout
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        hvd = _hvd()
        deadline, delay = time.monotonic() + self._timeout, 2e-5
        while not hvd.poll(self.handle):
            if time.monotonic() > deadline:
                message = (f"Horovod collective not complete after {self._timeout:g} s "
                           "(DEAR_TIMEOUT): another rank stalled or died")
                if launch.horovod_elastic():   # hvd.elastic.run restores and resets on it
                    from horovod.common.exceptions import HorovodInternalError
                    raise HorovodInternalError(message)
                raise TimeoutError(message)
            time.sleep(delay)
            delay = min(2 * delay, 1e-3)
        result = hvd.synchronize(self.handle)
        if self._finish is not None:
            self._finish(result)
        self._done = True


class HorovodCommunicator(Communicator):
    """Collectives through horovod.torch's async API (initialised with hvd.init()).

    With DataPlane.GLOO and more than one rank, constructing it starts the Gloo groups: a
    collective, so every rank constructs it, in the same order relative to its other Horovod
    calls (dear.init() does)."""

    def __init__(self, timeout: float = 300.0,
                 data_plane: Union[DataPlane, str, None] = None,
                 process_set: Any = None) -> None:
        self._hvd = _hvd()
        self._timeout = timeout                # seconds a wait may take (DEAR_TIMEOUT)
        self._owns = not self._hvd.is_initialized() and process_set is None
        if self._owns:
            launch.align_horovod_timeout(timeout)
            self._hvd.init()
        elif process_set is None:
            _warn_if_gloo_timeout_default(self._hvd, timeout)
        # Over some ranks only (Horovod's process_set=): ranks are the set's, every Horovod
        # call names the set, and a broadcast's root is given to Horovod as a global rank.
        self._set = process_set
        self._in_set: dict[str, Any] = {} if process_set is None else {
            "process_set": process_set}
        self._count = 0
        if data_plane is None:
            from ..config import Config
            data_plane = Config.from_env().horovod_data_plane
        self._elastic = launch.horovod_elastic() and process_set is None
        if self._elastic:
            # Horovod re-forms its world in place when ranks leave or join; its own
            # collectives follow it, a Gloo pair started for the old world would not.
            if DataPlane(data_plane) is DataPlane.GLOO:
                log.info("dear: under Horovod Elastic the collectives are Horovod's own "
                         "(DEAR_HOROVOD_DATA_PLANE=gloo needs a fixed world)")
            data_plane = DataPlane.HOROVOD
            from horovod.common.exceptions import HorovodInternalError

            from . import horovod_elastic
            register_recoverable(HorovodInternalError)   # hvd.elastic.run restores on it
            horovod_elastic.install()
        self._joined = (self.rank, self.size)
        self.data_plane = DataPlane(data_plane)
        self._gloo: Optional[gloo_bootstrap.GlooPair] = None
        self._exchange: Optional[PairwiseExchange] = None
        if self.data_plane is DataPlane.GLOO:
            if self.size > 1:
                self._gloo = gloo_bootstrap.start(self.rank, self.size, self.broadcast_object,
                                                  self.all_gather_object, timeout)
            self._exchange = PairwiseExchange(
                self.rank, self.size, self._gloo and self._gloo.forward,
                self._gloo and self._gloo.reverse)
        self.name = "horovod-gloo-pairwise" if self._exchange is not None else "horovod"

    @property
    def rendezvous_store(self) -> Optional[Any]:
        return self._gloo.store if self._gloo is not None else None

    @property
    def elastic(self) -> bool:
        return self._elastic

    @property
    def moved(self) -> bool:
        return self._elastic and (self.rank, self.size) != self._joined

    def rejoin(self) -> None:
        """Horovod re-formed its world: collectives are named from 1 again (Horovod matches
        them by name across ranks, and a new rank starts there)."""
        self._count = 0
        self._joined = (self.rank, self.size)

    @property
    def rank(self) -> int:
        return int(self._hvd.rank() if self._set is None else self._set.rank())

    @property
    def size(self) -> int:
        return int(self._hvd.size() if self._set is None else self._set.size())

    @property
    def local_rank(self) -> int:
        return int(self._hvd.local_rank())

    def _name(self, kind: str) -> str:
        self._count += 1
        where = "" if self._set is None else f"set{self._set.process_set_id}."
        return f"dear.{where}{kind}.{self._count}"

    def check_dtype(self, dtype: torch.dtype) -> None:
        if dtype in _UNSUPPORTED and self._exchange is None:
            raise TypeError(f"Horovod does not support {dtype}: use the Gloo data plane "
                            "(DEAR_HOROVOD_DATA_PLANE=gloo, the default) or the torch backend "
                            "(dear.init(backend='torch')) for bfloat16 gradients")

    def _check_dtype(self, tensor: torch.Tensor) -> None:
        if tensor.dtype in _UNSUPPORTED:
            raise TypeError(f"Horovod does not support {tensor.dtype}"
                            + (" on the GPU" if self._exchange is not None else "")
                            + ": use the torch backend (dear.init(backend='torch')) for "
                              "bfloat16 gradients")

    def _on_gloo(self, tensor: torch.Tensor) -> bool:
        """CPU tensors go through the Gloo exchange on DataPlane.GLOO."""
        return self._exchange is not None and tensor.device.type == "cpu"

    def reduce_scatter(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        if self._on_gloo(input):
            return self._exchange.reduce_scatter(input, output)   # type: ignore[union-attr]
        check_shard_sizes(input, output, self.size)
        self._check_dtype(input)
        handle = self._hvd.alltoall_async(input, name=self._name("rs"), **self._in_set)
        n = self.size

        def finish(res: Any) -> None:
            received = res[0] if isinstance(res, tuple) else res
            torch.sum(received.view(n, -1), dim=0, out=output)   # rank order: deterministic

        return HorovodWork(handle, finish, self._timeout)

    def pieces_in_place(self, tensor: torch.Tensor) -> bool:
        return self._on_gloo(tensor)

    def reduce_scatter_columns(self, input: torch.Tensor, output: torch.Tensor, start: int,
                               length: int) -> Work:
        if self._on_gloo(input):
            return self._exchange.reduce_scatter_columns(  # type: ignore[union-attr]
                input, output, start, length)
        return super().reduce_scatter_columns(input, output, start, length)

    def all_gather(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        if self._on_gloo(input):
            return self._exchange.all_gather(input, output)       # type: ignore[union-attr]
        check_shard_sizes(output, input, self.size)
        self._check_dtype(input)
        handle = self._hvd.allgather_async(input, name=self._name("ag"), **self._in_set)
        return HorovodWork(handle, lambda res: output.copy_(res.view(-1)), self._timeout)

    def all_gather_columns(self, input: torch.Tensor, output: torch.Tensor, start: int,
                           length: int) -> Work:
        if self._on_gloo(input):
            return self._exchange.all_gather_columns(  # type: ignore[union-attr]
                input, output, start, length)
        return super().all_gather_columns(input, output, start, length)

    def all_to_all(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        if self._on_gloo(input):
            return self._exchange.all_to_all(input, output)       # type: ignore[union-attr]
        check_all_to_all(input, output, self.size)
        self._check_dtype(input)
        handle = self._hvd.alltoall_async(input, name=self._name("a2a"), **self._in_set)
        return HorovodWork(handle, lambda res: output.copy_(
            (res[0] if isinstance(res, tuple) else res).view(-1)), self._timeout)

    def _gloo_only(self, tensor: torch.Tensor) -> bool:
        """A dtype Horovod lacks (bfloat16), on CPU: the Gloo groups carry it instead."""
        return tensor.dtype in _UNSUPPORTED and self._on_gloo(tensor)

    def all_reduce(self, tensor: torch.Tensor) -> Work:
        if self._gloo_only(tensor):
            if self._gloo is None:             # a world of one
                return DoneWork()
            return CallbackWork([self._gloo.forward.allreduce([tensor])])
        self._check_dtype(tensor)
        handle = self._hvd.allreduce_async_(tensor, name=self._name("ar"), op=self._hvd.Sum,
                                            **self._in_set)
        return HorovodWork(handle, timeout=self._timeout)

    def broadcast(self, tensor: torch.Tensor, root: int) -> Work:
        if not 0 <= root < self.size:
            raise ValueError(f"root rank {root} does not exist in a world of size {self.size}")
        if self._gloo_only(tensor):
            if self._gloo is None:
                return DoneWork()
            return CallbackWork([self._gloo.forward.broadcast(tensor, root)])
        self._check_dtype(tensor)
        root_rank = root if self._set is None else self._set.ranks[root]
        handle = self._hvd.broadcast_async_(tensor, root_rank, name=self._name("bc"),
                                            **self._in_set)
        return HorovodWork(handle, timeout=self._timeout)

    def broadcast_object(self, obj: Any, root: int) -> Any:
        # An explicit name: Horovod's default comes from the object's type, which may differ
        # between root and the others (None elsewhere) and then deadlocks.
        # Through tensors and this class's waits, so DEAR_TIMEOUT bounds it (Horovod's own
        # broadcast_object waits forever for a rank that never joins).
        return broadcast_object_with(self, obj, root)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return all_gather_object_with(self, obj)

    def barrier(self) -> None:
        self._hvd.barrier(**self._in_set)

    def shutdown(self) -> None:
        gloo, self._gloo, exchange, self._exchange = self._gloo, None, self._exchange, None
        if exchange is not None:               # its step thread finishes what was submitted
            exchange.close()
        if gloo is not None:
            gloo.close()
        if self._owns:                         # a user's hvd.init() is the user's to undo
            self._hvd.shutdown()
