"""MPI backend (`dear.init(backend="mpi")`): dear's collectives as MPI non-blocking collectives.

Reduce-scatter is MPI_Ireduce_scatter_block, all-gather MPI_Iallgather (MPI_IN_PLACE when the
input is this rank's slice of the output, as in a bucket), all-reduce MPI_Iallreduce, broadcast
MPI_Ibcast, all through mpi4py on the numpy views of CPU tensors (no copy), on a duplicate of
COMM_WORLD so dear's collectives never match a user's. Objects go through mpi4py's pickling
bcast / allgather. Every dtype dear's buckets use: all-gathers and broadcasts move raw bytes, so
bfloat16 and float16 travel as 16-bit integers; MPI has no 16-bit float sum, so reductions of
bfloat16 / float16 are up-cast to float32 (twice the bytes on the wire; a float32 sum rounded
once, at least as exact as torch's Gloo sum in 16 bits).

Progress. MPI advances a non-blocking collective only while some thread is inside MPI (unless
the library runs its own progress thread: MPICH's MPIR_CVAR_ASYNC_PROGRESS=1, which spins a
core). Without help, a reduce-scatter issued in backward would move its data only when step()
waits on it, and nothing would overlap. So by default (DEAR_MPI_PROGRESS=thread) a helper thread
calls MPI_Testsome on the requests in flight, sleeping DEAR_MPI_PROGRESS_INTERVAL seconds between
calls while any is in flight and blocking on a condition when none is (no CPU spent idle); it is
the only thread that completes requests, and wait() waits on an event it sets. mpi4py releases
the GIL inside MPI calls, so the training thread keeps computing. DEAR_MPI_PROGRESS=none makes
progress only in wait() (what a plain MPI loop gets; for comparison).

MPI calls from dear's two threads never run concurrently: one lock serialises them, so
MPI_THREAD_SERIALIZED is enough (mpi4py asks for MPI_THREAD_MULTIPLE by default).

Failure. MPI waits forever for a peer that stalls, and a peer that dies takes the job down only
when the launcher notices. wait() therefore waits at most DEAR_TIMEOUT seconds, then raises
TimeoutError naming the collective; the communicator is then broken (every later call raises at
once) and MPI_Finalize is skipped at exit, since it would wait for the dead peer.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import Any, Callable, Optional

import numpy as np
import torch

from . import wire
from .base import CallbackWork, Communicator, Work, check_flat, check_shard_sizes, overlaps

log = logging.getLogger("dear")

# Reinterpretation for moving bytes; reductions of the 16-bit floats are up-cast instead.
_RAW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.bool: torch.uint8}
_UPCAST = {torch.bfloat16: torch.float32, torch.float16: torch.float32}
_SUMMABLE = (torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32,
             torch.int64)


def _mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise RuntimeError("backend 'mpi' needs mpi4py and an MPI library: "
                           "pip install mpi4py mpich (or `pip install .[mpi]`), then launch "
                           "with mpirun -np N") from exc
    return MPI


def _numpy(tensor: torch.Tensor, raw: bool = False) -> np.ndarray:
    """The numpy view of a contiguous CPU tensor (shares its memory); `raw`: 16-bit floats and
    bools as same-sized integers (for collectives that only move bytes)."""
    if tensor.device.type != "cpu":
        raise TypeError(f"backend 'mpi' communicates CPU tensors; got one on {tensor.device} "
                        "(use backend 'torch' or 'nccl' for GPU tensors)")
    if raw and tensor.dtype in _RAW:
        tensor = tensor.view(_RAW[tensor.dtype])
    elif tensor.dtype in _RAW:
        raise TypeError(f"MPI cannot sum {tensor.dtype} directly")  # callers up-cast first
    return tensor.detach().numpy()


class MPIRequest:
    """One MPI request in flight: completed by the progress thread (which sets `event`), or by
    wait() itself without one. `wait()` blocks at most DEAR_TIMEOUT seconds."""

    def __init__(self, comm: "MPICommunicator", request: Any, what: str, keep: tuple) -> None:
        self._comm = comm
        self.request = request
        self.what = what
        self.keep = keep                         # buffers MPI reads or writes until completion
        self.event = threading.Event()
        self._done = False

    def wait(self) -> None:
        if not self._done:
            self._comm.complete(self)
            self.keep = ()
            self._done = True


class MPIWork(CallbackWork):
    """dear's Work for an MPI collective: waits for its request, then runs the finishing copy
    (up-cast results, a scratch output). Shaped as CallbackWork so dear.diagnose's watcher can
    stamp the real completion time (it waits on the request from its own thread)."""


class MPICommunicator(Communicator):
    """dear's collectives over an MPI communicator (a duplicate of COMM_WORLD by default)."""

    # Calls stay on the training thread: with the progress thread beside them, a third thread
    # issuing MPI calls aborted 3-rank runs at exit ("terminate called without an active
    # exception", MPICH, twice in ~20 runs); so no planned schedule on MPI for now.
    issue_from_any_thread = False

    def __init__(self, comm: Any = None, *, timeout: float = 300.0, progress: str = "thread",
                 interval: float = 1e-4) -> None:
        MPI = _mpi()
        self._MPI = MPI
        if progress not in ("thread", "none"):
            raise ValueError(f"progress must be 'thread' or 'none', got {progress!r}")
        level = MPI.Query_thread()
        if progress == "thread" and level < MPI.THREAD_SERIALIZED:
            log.warning("dear: MPI was initialised with thread level %d (< SERIALIZED): no "
                        "progress thread, collectives progress only in wait()", level)
            progress = "none"
        self._comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()
        self._rank, self._size = self._comm.Get_rank(), self._comm.Get_size()
        self._local_rank = _node_rank(self._comm, MPI)   # a collective: here, on every rank
        self._timeout = timeout
        self._interval = interval
        self.progress = progress
        self._lock = threading.Lock()            # serialises every MPI call of this object
        self._cond = threading.Condition()
        self._pending: list[MPIRequest] = []
        self._broken: Optional[str] = None
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        if progress == "thread" and self._size > 1:
            self._thread = threading.Thread(target=self._progress_loop, name="dear-mpi-progress",
                                            daemon=True)
            self._thread.start()
        self.name = "mpi" if progress == "thread" else "mpi-noprogress"
        self._store = self._open_store(timeout) if self._size > 1 else None
        log.info("dear: MPI backend on %s, progress=%s", MPI.Get_library_version().split("\n")[0],
                 progress)

    def _open_store(self, timeout: float) -> Optional[Any]:
        """A TCPStore on rank 0, listening on the launch address only (MASTER_ADDR, which dear's
        launcher sets under mpirun: 127.0.0.1 on one host), for the hang report: MPI itself has
        no channel outside its collectives, and a stuck one is what the report must explain.
        All ranks keep it or none does (a collective: every rank calls it once)."""
        from . import launch
        from .gloo_bootstrap import open_store
        store, where, problems = open_store(
            self._rank, self._size, self.broadcast_object, self.all_gather_object, timeout,
            host=launch.process_env().master_addr, origin="MASTER_ADDR")
        if problems or where is None:
            if self._rank == 0:
                log.warning("dear: the MPI backend runs without a rendezvous store, so a hang "
                            "report cannot name the missing rank: %s", "; ".join(problems))
            return None
        return store

    # ------------------------------------------------------------------------- properties
    @property
    def rendezvous_store(self) -> Optional[Any]:
        return self._store

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def local_rank(self) -> int:
        return self._local_rank

    def check_dtype(self, dtype: torch.dtype) -> None:
        if dtype not in _SUMMABLE and dtype not in _UPCAST:
            raise TypeError(f"backend 'mpi' cannot reduce {dtype}")

    # ----------------------------------------------------------------------- progress
    def _check(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"dear's MPI communicator is broken since {self._broken}; "
                               "restart the job")

    def _issue(self, what: str, start: Callable[[], Any], keep: tuple,
               finish: Optional[Callable[[], object]] = None) -> Work:
        return MPIWork([self._start(what, start, keep)], finish)

    def _start(self, what: str, start: Callable[[], Any], keep: tuple) -> MPIRequest:
        self._check()
        with self._lock:
            request = MPIRequest(self, start(), what, keep)
        if self._thread is not None:
            with self._cond:
                self._pending.append(request)
                self._cond.notify()
        return request

    def _progress_loop(self) -> None:
        """Drive MPI in the background: test what is in flight, mark what completed, sleep a
        little; block on the condition when nothing is in flight."""
        MPI = self._MPI
        while True:
            with self._cond:
                # A waiter may have completed a request itself (see _wait).
                self._pending = [w for w in self._pending if not w.event.is_set()]
                while not self._pending and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                works = list(self._pending)
            try:
                with self._lock:
                    done = MPI.Request.Testsome([w.request for w in works])
            except Exception as exc:             # noqa: BLE001 - an MPI error: fail the waits
                self._broken = f"an MPI error in the progress thread: {exc}"
                for w in works:
                    w.event.set()
                return
            for i in done or ():
                works[i].event.set()
            if done:
                continue                         # test again at once: more may be ready
            time.sleep(self._interval)

    def complete(self, work: MPIRequest) -> None:
        """Until the request completes: the waiting thread drives MPI itself (MPI_Test, backing
        off from 20 us to 1 ms), since it has nothing else to do; the progress thread may
        complete it too. At most DEAR_TIMEOUT seconds."""
        deadline = time.monotonic() + self._timeout
        delay = 2e-5
        while not work.event.is_set():
            self._check()
            with self._lock:
                if not work.event.is_set() and work.request.Test():
                    work.event.set()
            if work.event.is_set():
                break
            if time.monotonic() >= deadline:
                self._fail(work)
            work.event.wait(delay)
            delay = min(2 * delay, 1e-3)
        self._check()

    def _fail(self, work: MPIRequest) -> None:
        self._broken = f"{work.what} did not complete within {self._timeout:g} s"
        _skip_finalize(self._MPI)
        raise TimeoutError(f"MPI {work.what} not complete after {self._timeout:g} s "
                           "(DEAR_TIMEOUT): another rank stalled or died")

    # ----------------------------------------------------------------------- collectives
    def reduce_scatter(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        check_shard_sizes(input, output, self._size)
        if self._size == 1:
            output.copy_(input)
            return MPIWork([])
        MPI, dtype = self._MPI, input.dtype
        self.check_dtype(dtype)
        if dtype in _UPCAST:
            send = input.to(_UPCAST[dtype])
            recv = torch.empty(output.numel(), dtype=send.dtype)
            return self._issue("reduce-scatter", lambda: self._comm.Ireduce_scatter_block(
                _numpy(send), _numpy(recv), op=MPI.SUM), (send, recv),
                lambda: output.copy_(recv))
        if overlaps(input, output):
            recv = torch.empty_like(output)
            return self._issue("reduce-scatter", lambda: self._comm.Ireduce_scatter_block(
                _numpy(input), _numpy(recv), op=MPI.SUM), (input, recv),
                lambda: output.copy_(recv))
        return self._issue("reduce-scatter", lambda: self._comm.Ireduce_scatter_block(
            _numpy(input), _numpy(output), op=MPI.SUM), (input, output))

    def all_gather(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        check_shard_sizes(output, input, self._size)
        shard = input.numel()
        own = output[self._rank * shard:(self._rank + 1) * shard]
        if own.data_ptr() != input.data_ptr():
            own.copy_(input)
        if self._size == 1:
            return MPIWork([])
        MPI = self._MPI
        return self._issue("all-gather", lambda: self._comm.Iallgather(
            MPI.IN_PLACE, _numpy(output, raw=True)), (output,))

    def all_reduce(self, tensor: torch.Tensor) -> Work:
        check_flat(tensor.view(-1), "the all-reduced tensor")
        if self._size == 1:
            return MPIWork([])
        MPI, dtype = self._MPI, tensor.dtype
        self.check_dtype(dtype)
        flat = tensor.view(-1)
        if dtype in _UPCAST:
            wide = flat.to(_UPCAST[dtype])
            return self._issue("all-reduce", lambda: self._comm.Iallreduce(
                MPI.IN_PLACE, _numpy(wide), op=MPI.SUM), (wide,), lambda: flat.copy_(wide))
        return self._issue("all-reduce", lambda: self._comm.Iallreduce(
            MPI.IN_PLACE, _numpy(flat), op=MPI.SUM), (flat,))

    def broadcast(self, tensor: torch.Tensor, root: int) -> Work:
        if not 0 <= root < self._size:
            raise ValueError(f"root rank {root} does not exist in a world of size {self._size}")
        if self._size == 1:
            return MPIWork([])
        flat = tensor.view(-1)
        if not flat.is_contiguous():
            raise ValueError("the broadcast tensor must be contiguous")
        return self._issue("broadcast", lambda: self._comm.Ibcast(
            _numpy(flat, raw=True), root=root), (flat,))

    def broadcast_object(self, obj: Any, root: int) -> Any:
        if not 0 <= root < self._size:
            raise ValueError(f"root rank {root} does not exist in a world of size {self._size}")
        if self._size == 1:
            return obj
        # Two non-blocking broadcasts: the encoded length, then the bytes.
        data = wire.encode(obj) if self._rank == root else b""
        length = torch.tensor([len(data)], dtype=torch.int64)
        self.broadcast(length, root).wait()
        buf = torch.empty(int(length.item()), dtype=torch.uint8)
        if self._rank == root:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.broadcast(buf, root).wait()
        return obj if self._rank == root else wire.decode(buf.numpy().tobytes())

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self._size == 1:
            return [obj]
        data = wire.encode(obj)
        lengths = torch.zeros(self._size, dtype=torch.int64)
        lengths[self._rank] = len(data)
        self.all_gather(lengths[self._rank:self._rank + 1], lengths).wait()
        width = int(lengths.max().item())
        rows = torch.zeros(self._size * width, dtype=torch.uint8)
        mine = rows[self._rank * width:self._rank * width + len(data)]
        mine.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.all_gather(rows[self._rank * width:(self._rank + 1) * width], rows).wait()
        table = rows.view(self._size, width).numpy()
        return [wire.decode(table[r, :int(lengths[r])].tobytes()) for r in range(self._size)]

    def barrier(self) -> None:
        if self._size == 1:
            return
        self._start("barrier", self._comm.Ibarrier, ()).wait()

    def shutdown(self) -> None:
        """Stop the progress thread and free the duplicate communicator (not MPI itself: mpi4py
        finalizes MPI at exit)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._broken is None and self._comm is not None:
            with self._lock:
                self._comm.Free()
        self._comm = None
        self._store = None


def _node_rank(comm: Any, MPI: Any) -> int:
    """This rank's index among the ranks on its host (MPI-3's shared-memory split)."""
    try:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    except Exception:                            # noqa: BLE001 - an MPI without MPI-3 types
        return 0
    try:
        return int(node.Get_rank())
    finally:
        node.Free()


_finalize_skipped = False


def _skip_finalize(MPI: Any) -> None:
    """After a timeout MPI_Finalize would wait for the dead peer: leave without it. mpi4py
    finalizes after Python's atexit handlers, so ours ends the process first, with exit code 1
    (a collective failed)."""
    global _finalize_skipped
    if _finalize_skipped:
        return
    _finalize_skipped = True

    def leave() -> None:
        import os
        import sys
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    atexit.register(leave)


__all__ = ["MPICommunicator", "MPIRequest", "MPIWork"]
