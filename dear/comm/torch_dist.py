"""torch.distributed backend: NCCL's own collectives on GPU, dear's ring exchange on Gloo.

A group with both ("cpu:gloo,cuda:nccl", what dear.init() starts where CUDA is there) takes each
tensor to the backend of its device. On Gloo, reduce-scatter and all-gather run dear's
bandwidth-optimal exchange (`PairwiseExchange`, below) on the communicator's group and, for the
default group, a twin Gloo group that carries the messages from higher to lower ranks: the whole
collective of one gradient's bucket is in this file.

The exchange: Gloo's own reduce_scatter_tensor and all_gather_into_tensor move as many bytes as a
whole all-reduce or more (docs/backends.md), which would make DeAR slower than all-reduce on CPU.
Here each rank sends and receives (N-1)/N of the buffer, the bandwidth-optimal volume, as a ring:
N-1 steps, each sending one shard to the successor and receiving one from the predecessor
(reduce-scatter adds its own shard and passes the partial sum on). One flow into every port at a
time: posting all N-1 messages at once overflows a switch port's shallow queue (docs/backends.md
has the measurements). A step needs the previous one's result, so with more than 2 ranks the steps
run on the exchange's own thread (`StepThread`), one collective after another in issue order; the
training thread only waits. With 2 ranks the one step is posted at issue. Gloo drives a group's
sockets from one transport thread, so every message from a higher to a lower rank travels on the
twin group: sending and receiving run on two threads, faster even on 2 ranks
(docs/backends.md#dearinitbackendauto).

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
import torch.distributed as dist

from . import wire
from .base import (
    CallbackWork,
    Communicator,
    Work,
    all_gather_object_with,
    broadcast_object_with,
    check_all_to_all,
    check_shard_sizes,
    overlaps,
)


class TorchCommunicator(Communicator):
    """Collectives over a torch.distributed process group.

    With Gloo and gloo_collectives="pairwise" on the default group (group=None), constructing it
    creates a second process group, so every rank must construct it, in the same order relative
    to its other new_group calls (dear.init() does). For an explicit subgroup no twin is made
    (dist.new_group would need every rank of the world) and all messages use that group.
    """

    in_place_alone = True                  # _alone(): the same buffer in and out is no copy

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
        alone = _alone(input, output, gather=False) if self._size == 1 else None
        if alone is not None:
            return alone
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
        alone = _alone(output, input, gather=True) if self._size == 1 else None
        if alone is not None:
            return alone
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

    def all_to_all(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        exchange = self._exchange_for(input)
        if exchange is not None:
            return exchange.all_to_all(input, output)
        check_all_to_all(input, output, self._size)
        if self._size == 1:
            output.copy_(input)
            return CallbackWork([])
        return CallbackWork([dist.all_to_all_single(output, input, group=self._group,
                                                    async_op=True)],
                            timeout=self._wait_timeout(input))

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
        # A subgroup (a process set's) is destroyed by its owner; held here, it would keep its
        # rendezvous store alive, and a re-init would read that store's stale addresses.
        if self._group is not None:
            self._group = _Released()  # type: ignore[assignment]
        if exchange is not None:           # its step thread finishes what was submitted
            exchange.close()
        if reverse is not None and dist.is_initialized():
            dist.destroy_process_group(reverse)


def _alone(full: torch.Tensor, shard: torch.Tensor, gather: bool) -> Optional[Work]:
    """A world of one: the collective is one copy (full into shard; `gather`: shard into full),
    made here after the same checks, without the exchange's or NCCL's layers of calls (host
    time a bucket: docs/benchmarks.md#host-cost). None where the buffers
    partly overlap: the general path says what is wrong with that."""
    same = full.data_ptr() == shard.data_ptr()
    if not same and overlaps(full, shard):
        return None
    check_shard_sizes(full, shard, 1)
    if same:
        pass
    elif gather:
        full.copy_(shard)
    else:
        shard.copy_(full)
    return CallbackWork([])


class _Released:
    """Stands in for a subgroup once its communicator was shut down: any use says so."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("dear: this optimizer's process set was shut down (hvd.shutdown() or "
                           "hvd.remove_process_set()); create the optimizer again after "
                           "hvd.init() and hvd.add_process_set()")


def _timeout_of(group: Optional[dist.ProcessGroup]) -> Optional[datetime.timedelta]:
    """The group's collective timeout (DEAR_TIMEOUT via init_process_group), so the twin fails
    as fast as the group it doubles; None (torch's default) if torch hides it."""
    try:
        pg = group if group is not None else dist.group.WORLD
        backend = pg._get_backend(torch.device("cpu"))  # type: ignore[union-attr]  # noqa: SLF001 (torch's)
        return backend.options._timeout  # torch's Gloo options  # noqa: SLF001
    except (AttributeError, RuntimeError):
        return None


def carries_cpu_on_gloo(backend: str) -> bool:
    """Whether a group of this backend ("gloo", "nccl", "cpu:gloo,cuda:nccl") sends CPU
    tensors over Gloo."""
    backend = backend.lower()
    return backend == "gloo" or "cpu:gloo" in backend.replace(" ", "").split(",")


# ----------------------------------------------------------- the ring exchange on Gloo
_TAG_SPACE = 1 << 20


class _StepWork(Work):
    """A collective whose steps run on the exchange's thread."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def finish(self, error: Optional[BaseException]) -> None:
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


class StepThread:
    """Runs collectives' steps one collective at a time, in submission order. `sticky`: after a
    failure every later job fails at once (a ring's peers are out of step); else each job
    fails alone (independent jobs, e.g. decoding what collectives received)."""

    def __init__(self, name: str = "dear-gloo-ring", sticky: bool = True) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._name, self._sticky = name, sticky

    def submit(self, run: Callable[[], None]) -> Work:
        work = _StepWork()
        with self._lock:
            if self._thread is None:
                # The loop holds only the queue: an idle thread keeps no process group alive
                # into the interpreter's teardown (see TorchCommunicator.shutdown).
                self._thread = threading.Thread(target=_run_steps,
                                                args=(self._queue, self._sticky),
                                                name=self._name, daemon=True)
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


def _close_at_exit(ref: "weakref.ref[StepThread]") -> None:
    steps = ref()
    if steps is not None:
        steps.close()


def _run_steps(jobs: queue.SimpleQueue, sticky: bool = True) -> None:
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
                error = exc
                if sticky:
                    failed = exc
        work.finish(error)
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
        self._steps = StepThread()

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

    def all_to_all(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        """Block r of `input` to rank r, block r of `output` from rank r. Step s sends to
        rank me+s and receives from me-s, so every rank receives from one peer at a time
        (the ring's one flow into every port); the steps are independent, so with 2 ranks
        the one step is posted at issue and otherwise they run on the step thread."""
        check_all_to_all(input, output, self.size)
        n, me = self.size, self.rank
        ins, outs = input.view(n, -1), output.view(n, -1)
        outs[me].copy_(ins[me])
        if n == 1:
            return CallbackWork([])
        tag = self._next_tag()
        if n == 2:
            peer = 1 - me
            return CallbackWork(self._post(tag, peer, outs[peer], peer, ins[peer]),
                                timeout=self._timeout)

        def steps() -> None:
            for step in range(1, n):
                src, dst = (me - step) % n, (me + step) % n
                for work in self._post(tag, src, outs[src], dst, ins[dst]):
                    if self._wait_for is not None:
                        work.wait(self._wait_for)
                    else:
                        work.wait()
        return self._steps.submit(steps)
