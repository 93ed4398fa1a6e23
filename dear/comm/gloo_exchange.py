"""Bandwidth-optimal reduce-scatter and all-gather as point-to-point messages over Gloo.

Gloo's own reduce_scatter_tensor and all_gather_into_tensor (and Horovod's reducescatter and
allgather over Gloo) move as many bytes as a whole all-reduce or more (see ENVIRONMENT.md and
benchmarks/results/collectives*.md), which would make DeAR slower than an all-reduce on CPU. Here
each rank sends (N-1)/N of the buffer and receives as much, the bandwidth-optimal volume, as a
ring: N-1 steps, in each of which a rank sends one shard to its successor and receives one from
its predecessor (reduce-scatter adds its own shard to what it received and passes the partial sum
on). One flow into every port at a time matters: posting all N-1 messages at once (the pairwise
schedule this module had) overflows a switch port's shallow queue when N-1 peers send to one
rank. Measured on benchmarks.cluster's emulated switch, 8 ranks, 500 Mbit/s, as a multiple of
Gloo's all_reduce of the same buffer (ideal 0.5; /tmp prototype, 2026-11-24):
    12 MB:  all-at-once reduce-scatter 1.22, all-gather 1.10;  ring 0.50, 0.50
    1.5 MB: all-at-once 4.46, 2.87;                           ring 0.51, 0.46
    4 ranks, 12 MB, 1 Gbit/s: all-at-once 0.57, 0.53; ring 0.52, 0.51. 2 ranks: identical.
A step needs the previous one's result, so with more than 2 ranks the steps run on the exchange's
own thread (`_StepThread`), one collective after another in issue order (the order every rank
shares); the training thread only waits. With 2 ranks there is one step: it is posted at issue
and no thread is involved.

Gloo drives all of a process group's sockets from one transport thread, so on one group a rank's
outgoing and incoming messages are copied through the kernel by the same thread, one after the
other. Given a twin group, every message from a higher to a lower rank travels on the twin, so
sending and receiving run on two threads. Measured on 2 ranks, loopback, 100 MB fp32
(benchmarks/collectives.py): the exchange took 15-25% less time than on one group.

The groups are anything with Gloo's `send([tensor], dst, tag)` / `recv([tensor], src, tag)`:
torch.distributed's ProcessGroup objects (TorchCommunicator) or bare ProcessGroupGloo backends that
no torch.distributed registry knows of (the Horovod backend's private data plane). Ranks are the
group's own; messages are plain bytes, so every dtype works.
"""

from __future__ import annotations

import atexit
import datetime
import queue
import threading
import warnings
import weakref
from typing import Any, Callable, Optional

import torch

from .base import CallbackWork, Work, check_shard_sizes, overlaps

_TAG_SPACE = 1 << 20


class _StepWork(Work):
    """A collective whose steps run on the exchange's thread."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def _finish(self, error: Optional[BaseException]) -> None:
        with self._lock:
            self._error = error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception as exc:  # an observer's bug must not stop the collectives
                warnings.warn(f"dear: a collective's done-callback failed: {exc!r}")

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Run `callback` (on the step thread) when the collective ends, or now if it has:
        dear.diagnose stamps completion times this way without blocking anyone."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def wait(self) -> None:
        # The thread's own waits are bounded (DEAR_TIMEOUT or the group's timeout) and a
        # failure fails every later collective at once, so this wait ends.
        self._done.wait()
        if self._error is not None:
            raise RuntimeError(f"dear: a reduce-scatter or all-gather failed: {self._error}") \
                from self._error


class _StepThread:
    """Runs collectives' steps one collective at a time, in submission order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def submit(self, run: Callable[[], None]) -> Work:
        work = _StepWork()
        with self._lock:
            if self._thread is None:
                # The loop holds only the queue: an idle thread keeps no process group alive
                # into the interpreter's teardown (see TorchCommunicator.shutdown).
                self._thread = threading.Thread(target=_run_steps, args=(self._queue,),
                                                name="dear-gloo-ring", daemon=True)
                self._thread.start()
                atexit.register(_close_at_exit, weakref.ref(self))
            self._queue.put((run, work))
        return work

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)


def _close_at_exit(ref: "weakref.ref[_StepThread]") -> None:
    steps = ref()
    if steps is not None:
        steps.close()


def _run_steps(jobs: queue.SimpleQueue) -> None:
    failed: Optional[BaseException] = None
    while True:
        item = jobs.get()
        if item is None:
            return
        run, work = item
        del item
        error: Optional[BaseException] = None
        if failed is not None:        # the ring's peers are out of step: fail fast, every rank
            error = RuntimeError(f"an earlier collective failed ({failed})")
        else:
            try:
                run()
            except BaseException as exc:
                failed = error = exc
        work._finish(error)
        del run, work                 # drop the groups the job referenced


class PairwiseExchange:
    """Reduce-scatter and all-gather of flat buffers between the `size` ranks of `group`."""

    def __init__(self, rank: int, size: int, group: Any, reverse: Optional[Any] = None,
                 timeout: Optional[float] = None) -> None:
        self.rank, self.size = rank, size
        self._timeout = timeout                # DEAR_TIMEOUT on every wait
        self._wait_for = None if timeout is None else datetime.timedelta(seconds=timeout)
        self._group, self._reverse = group, reverse
        self._tag = 0
        self._steps = _StepThread()

    def close(self) -> None:
        """Stop the step thread (after the collectives already submitted)."""
        self._steps.close()

    def _next_tag(self) -> int:
        # Every rank issues collectives in the same order, so the counters agree and a tag
        # pairs each send with its receive even when several exchanges are in flight.
        self._tag = (self._tag + 1) % _TAG_SPACE
        return self._tag

    def _post(self, tag: int, src: int, into: torch.Tensor, dst: int,
              data: torch.Tensor) -> list[Any]:
        """Post one receive (from rank src), then one send (to rank dst).

        A message from rank a to rank b travels on the first group if a < b, else on the twin:
        sender and receiver pick the same group, and a rank's sends and receives are driven by
        different Gloo threads. Receive first: a peer's "ready to receive" then never queues
        behind our own outgoing data (cluster.py measured the difference)."""
        me = self.rank
        into_group = self._group if src < me or self._reverse is None else self._reverse
        out_group = self._group if me < dst or self._reverse is None else self._reverse
        return [into_group.recv([into], src, tag), out_group.send([data], dst, tag)]

    def _step(self, tag: int, into: torch.Tensor, data: torch.Tensor) -> None:
        """One ring step, on the step thread: receive from the predecessor, send on."""
        n, me = self.size, self.rank
        for work in self._post(tag, (me - 1) % n, into, (me + 1) % n, data):
            if self._wait_for is not None:
                work.wait(self._wait_for)
            else:
                work.wait()

    def reduce_scatter(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        """Sum `input` over ranks; this rank keeps shard `rank` in `output`."""
        return self.reduce_scatter_columns(input, output, 0, output.numel())

    def reduce_scatter_columns(self, input: torch.Tensor, output: torch.Tensor, start: int,
                               length: int) -> Work:
        """Columns [start, start + length) of every rank's shard of `input`, summed into the
        same columns of `output`: a piece of a reduce-scatter, its messages read in place."""
        check_shard_sizes(input, output, self.size)
        n, me, shard = self.size, self.rank, output.numel()
        chunks = [input[r * shard + start:r * shard + start + length] for r in range(n)]
        into = output[start:start + length]
        if n == 1:
            into.copy_(chunks[0])
            return CallbackWork([])
        if overlaps(input, output):
            if output.data_ptr() != input.data_ptr() + me * shard * input.element_size():
                raise ValueError("reduce_scatter: the output overlaps the input other than as "
                                 "this rank's own shard of it; pass a separate output buffer")
            chunks[me] = chunks[me].clone()   # in place: received data lands on our shard
        tag = self._next_tag()
        if n == 2:
            peer = 1 - me
            return CallbackWork(self._post(tag, peer, into, peer, chunks[peer]),
                                lambda: into.add_(chunks[me]), self._timeout)

        def ring() -> None:
            # Step s receives the partial sum of shard me-s-1 and adds ours to it; the last
            # step's shard is our own, received into `into`. Buffers alternate so that a
            # step never receives into what it sends. Each shard is summed along one chain
            # in a fixed order, so all ranks agree bitwise after the all-gather (and a piece
            # sums each element exactly as the whole collective would).
            scratch = torch.empty_like(into)
            data = chunks[(me - 1) % n]
            for step in range(1, n):
                target = into if (n - 1 - step) % 2 == 0 else scratch
                self._step(tag, target, data)
                target.add_(chunks[(me - step - 1) % n])
                data = target
        return self._steps.submit(ring)

    def all_gather_columns(self, input: torch.Tensor, output: torch.Tensor, start: int,
                           length: int) -> Work:
        """Elements [start, start + length) of every rank's shard `input`, received straight
        into their place in `output` (size x input.numel()): a chunk of an all-gather."""
        check_shard_sizes(output, input, self.size)
        n, me, shard = self.size, self.rank, input.numel()
        parts = [output[r * shard + start:r * shard + start + length] for r in range(n)]
        if parts[me].data_ptr() != input.data_ptr() + start * input.element_size():
            parts[me].copy_(input[start:start + length])
        if n == 1:
            return CallbackWork([])
        tag = self._next_tag()
        if n == 2:
            peer = 1 - me
            return CallbackWork(self._post(tag, peer, parts[peer], peer, parts[me]),
                                timeout=self._timeout)

        def ring() -> None:
            # Step s forwards the shard of rank me-s and receives that of rank me-s-1.
            for step in range(n - 1):
                self._step(tag, parts[(me - step - 1) % n], parts[(me - step) % n])
        return self._steps.submit(ring)

    def all_gather(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        """Every rank's `input` into `output`, in rank order (`input` may be our own slice)."""
        return self.all_gather_columns(input, output, 0, input.numel())
