"""Seeing dear's collectives without touching the optimizer: a Communicator proxy.

`TracingCommunicator` wraps the communicator the optimizer calls (`optimizer.dear_communicator`)
and records every collective: kind, bytes, bucket, issue time and completion time. The
completion time is never obtained by blocking the training loop:

- Gloo point-to-point (dear's pairwise reduce-scatter / all-gather) has no completion callback
  and `is_completed()` stays False until someone waits. A watcher thread therefore does the
  waiting: the transport handles inside dear's `CallbackWork` are swapped for relays, the watcher
  calls the real `wait()` (which releases the GIL), stamps the time and releases the relay; the
  training thread still runs the local finishing step (the shard sum) itself, as untraced.
  Precision: the stamp is taken when the watcher thread gets the GIL back, i.e. within
  `sys.getswitchinterval()` of completion in the worst case (the training thread in pure
  Python) and far sooner when the training thread is inside torch kernels, which release the
  GIL (docs/benchmarks.md#the-watchers-precision). One watcher
  serves collectives in issue order, so a collective that finishes before an earlier one is stamped
  when the earlier one finishes (Gloo carries them over one connection in order anyway).
- torch collectives with a future (all_reduce; NCCL): a done-callback stamps the time (runs on
  the backend's thread; same GIL bound; on CUDA it fires when the watchdog sees the kernel end).
- dear's ring exchange (3 or more Gloo ranks): its step thread calls back when a collective's
  last step ends.
- Horovod handles: the watcher polls `hvd.poll(handle)` every 0.5 ms.
- Anything else: the time the training thread's `wait()` returned (an upper bound).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Optional

import torch

from ..comm.base import Communicator, DoneWork, Work, WrappedCommunicator
from ..comm.horovod import HorovodWork
from .recorder import CollectiveKind, CollectiveRecord, Ev, Recorder

_POLL_S = 0.0005


class _Relay:
    """Stands in for a transport handle inside dear's CallbackWork; released by the watcher."""

    __slots__ = ("_event", "_error")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._error: Optional[BaseException] = None

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        self._event.wait()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._event.is_set()

    def release(self, error: Optional[BaseException] = None) -> None:
        self._error = error
        self._event.set()


class CompletionWatcher:
    """One daemon thread that waits on (or polls) in-flight collectives in issue order."""

    def __init__(self, clock: Callable[[], int]) -> None:
        self._clock = clock
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="dear-trace-watcher", daemon=True)
        self._thread.start()

    def wait_for(self, rec: CollectiveRecord, handles: list[Any], relays: list[_Relay]) -> None:
        self._queue.put(("wait", rec, handles, relays))

    def poll_for(self, rec: CollectiveRecord, poll: Callable[[], bool]) -> None:
        self._queue.put(("poll", rec, poll, None))

    def close(self, timeout: float = 600.0) -> bool:
        """Finish what is in flight (relays must be released), then stop; False on timeout."""
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            how, rec, what, relays = item
            if how == "poll":
                try:
                    while not what():
                        time.sleep(_POLL_S)
                    rec.complete(self._clock(), "watcher")
                except Exception:       # the handle was already synchronized (consumed):
                    rec.complete(self._clock(), "wait")     # it ended before, an upper bound
                continue
            error: Optional[BaseException] = None
            for handle, relay in zip(what, relays):
                if error is None:
                    try:
                        handle.wait()
                    except BaseException as exc:    # relayed to the training thread
                        error = exc
                relay.release(error)
            if error is None:
                rec.complete(self._clock(), "watcher")


class TracedWork(Work):
    """The Work the optimizer gets back: its wait() is a traced span of the training thread,
    filed under the iteration being recorded when it waits (dear waits for an all-gather in
    the iteration after the one that issued it)."""

    __slots__ = ("_inner", "_rec", "_recorder", "_active")

    def __init__(self, inner: Work, rec: CollectiveRecord, recorder: Recorder,
                 active: Callable[[], Optional[int]]) -> None:
        self._inner = inner
        self._rec = rec
        self._recorder = recorder
        self._active = active

    def wait(self) -> None:
        clock = self._recorder.clock
        start = clock()
        self._inner.wait()
        end = clock()
        rec = self._rec
        iteration = self._active()
        if iteration is not None:
            self._recorder.events.append((Ev.WAIT, iteration, start, end, rec.seq))
        rec.complete(end, "wait")


class TracingCommunicator(WrappedCommunicator):
    """Delegates every call to `inner`; records collectives while `active()` says so."""

    def __init__(self, inner: Communicator, recorder: Recorder, watcher: CompletionWatcher,
                 active: Callable[[], Optional[int]],
                 bucket_of: Callable[[torch.Tensor], Optional[int]],
                 buffer_bytes_of: Callable[[torch.Tensor], Optional[int]] = lambda t: None
                 ) -> None:
        super().__init__(inner)
        self._recorder = recorder
        self._watcher = watcher
        self._active = active          # the iteration being recorded, or None
        self._bucket_of = bucket_of
        self._buffer_bytes_of = buffer_bytes_of     # a compressed wire's bucket bytes

    def _traced(self, kind: CollectiveKind, buffer: torch.Tensor,
                issue: Callable[[], Work]) -> Work:
        iteration = self._active()
        if iteration is None:
            return issue()
        nbytes = buffer.numel() * buffer.element_size()
        rec = self._recorder.collective(kind, nbytes, self._bucket_of(buffer), iteration)
        rec.buffer_bytes = self._buffer_bytes_of(buffer)
        work = issue()
        self._track(rec, work, buffer.is_cuda)
        return TracedWork(work, rec, self._recorder, self._active)

    def _track(self, rec: CollectiveRecord, issued: Work, cuda: bool) -> None:
        work: Any = getattr(issued, "backend_work", issued)    # under the flight record
        inner = getattr(work, "inner", None)            # dear.comm.base.CallbackWork
        handle = work.handle if isinstance(work, HorovodWork) else None
        if isinstance(work, DoneWork) or (isinstance(inner, list) and not inner):
            rec.complete(self._recorder.clock(), "issue")
        elif isinstance(inner, list) and all(hasattr(h, "wait") for h in inner):
            # On CUDA a handle's wait() returns before the kernel ends: only the future
            # tells the end. On CPU blocking in the watcher is as precise and needs no future.
            futures = [_future_of(h) for h in inner] if cuda else []
            if cuda and all(f is not None for f in futures):
                _stamp_when_all_done(rec, futures, self._recorder.clock)
            else:
                relays = [_Relay() for _ in inner]
                work.inner = relays                      # type: ignore[attr-defined]
                self._watcher.wait_for(rec, inner, relays)
        elif callable(getattr(work, "add_done_callback", None)):   # dear's ring exchange
            clock = self._recorder.clock
            work.add_done_callback(lambda: rec.complete(clock(), "callback"))  # type: ignore
        elif handle is not None:
            poll = _horovod_poll(handle)
            if poll is not None:
                self._watcher.poll_for(rec, poll)

    def reduce_scatter(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        return self._traced(CollectiveKind.REDUCE_SCATTER, input,
                            lambda: self.inner.reduce_scatter(input, output))

    def pieces_in_place(self, tensor: torch.Tensor) -> bool:
        return False       # one collective per bucket: what the replay maps a bucket to

    def all_gather(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        return self._traced(CollectiveKind.ALL_GATHER, output,
                            lambda: self.inner.all_gather(input, output))

    def all_to_all(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        # A quantized bucket's reduce phase: the same link volume as a ring reduce-scatter of
        # its bytes, which is how the replay costs it (Bucket.reduce_bytes).
        return self._traced(CollectiveKind.REDUCE_SCATTER, input,
                            lambda: self.inner.all_to_all(input, output))

    def all_reduce(self, tensor: torch.Tensor) -> Work:
        return self._traced(CollectiveKind.ALL_REDUCE, tensor,
                            lambda: self.inner.all_reduce(tensor))

    def broadcast(self, tensor: torch.Tensor, root: int) -> Work:
        return self._traced(CollectiveKind.BROADCAST, tensor,
                            lambda: self.inner.broadcast(tensor, root))

    def broadcast_object(self, obj: Any, root: int) -> Any:
        return self.inner.broadcast_object(obj, root)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.inner.all_gather_object(obj)

    def barrier(self) -> None:
        self.inner.barrier()



def _future_of(handle: Any) -> Optional[Any]:
    try:
        return handle.get_future()
    except (AttributeError, RuntimeError):
        return None


def _stamp_when_all_done(rec: CollectiveRecord, futures: list[Any],
                         clock: Callable[[], int]) -> None:
    remaining = [len(futures)]
    lock = threading.Lock()

    def done(_: Any) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            rec.complete(clock(), "callback")

    for fut in futures:
        fut.add_done_callback(done)


def _horovod_poll(handle: Any) -> Optional[Callable[[], bool]]:
    try:
        import horovod.torch as hvd
    except ImportError:
        return None
    return lambda: bool(hvd.poll(handle))


def ddp_comm_hook(slot: list) -> Callable:
    """A DDP comm hook equal to torch's default (divide, all-reduce) that records each bucket's
    all-reduce for the tracer in `slot[0]` (None: not tracing); the future's callback stamps
    the end."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def traced_allreduce(process_group, bucket):  # type: ignore[no-untyped-def]
        # (no annotations: DDP compares them with dist.GradBucket, and ours are strings)
        tracer = slot[0]
        iteration = tracer.recording if tracer is not None else None
        if iteration is None:
            return allreduce_hook(process_group, bucket)
        recorder: Recorder = tracer.recorder
        buf = bucket.buffer()
        rec = recorder.collective(CollectiveKind.ALL_REDUCE, buf.numel() * buf.element_size(),
                                  bucket.index(), iteration)
        fut = allreduce_hook(process_group, bucket)

        def stamp(f: torch.futures.Future) -> torch.Tensor:
            rec.complete(recorder.clock(), "callback")
            return f.value()

        return fut.then(stamp)

    return traced_allreduce
