"""One fusion bucket's life in an iteration:

    pack (backward) -> reduce-scatter -> scale the shard -> all-gather -> update (next forward)

The same flat buffer carries the local gradients into the reduce-scatter and the averaged
gradients out of the all-gather: once the reduce-scatter is done the local gradients are no
longer needed, so the bucket costs one buffer plus one shard of memory (in a world of one, whose
backend takes a collective from a buffer into itself, the shard is the buffer and neither
collective is issued: one buffer, `alone`).

Backward's hooks only take references to the gradients (`pack`); they are copied into the
buffer right before the reduce-scatter is issued (`fill`), by whichever thread issues it. Under
the planned schedule that is the collective executor (dear/fusion/executor.py), so the copy of
every gradient runs beside backward instead of lengthening it, as a GPU's copy on a side
stream would. With gradient_as_bucket_view (dear/fusion/views.py) the gradients already live in
the buffer (`user_views`) and there is nothing to copy.
"""

from __future__ import annotations

import enum
import threading
from typing import Callable, Optional, Sequence, TypeVar

import torch

from .. import native as _native
from ..comm import runtime as _runtime
from ..comm.base import (
    REFUSED_AT_ISSUE,
    CallbackWork,
    Communicator,
    DoneWork,
    Work,
    collective_error,
)
from .plan import chunk_columns
from .planner import BucketSpec

_T = TypeVar("_T")


class Stage(enum.Enum):
    IDLE = "idle"                # nothing in flight; the buffer may be packed
    REDUCING = "reducing"        # reduce-scatter issued
    GATHERING = "gathering"      # all-gather issued; the update is pending


class Bucket:
    """Buffers and state of one bucket. Not thread-safe: driven by the optimizer's hooks."""

    chunkable = True             # its all-gather may be cut into column chunks (schedule.py)
    views_supported = True       # .grad may be a view of the buffer (dear/fusion/views.py)

    def __init__(self, spec: BucketSpec, params: Sequence[torch.nn.Parameter],
                 wire_dtype: Optional[torch.dtype] = None, sparse_as_dense: bool = False,
                 native: Optional[bool] = None, views: bool = False,
                 piece_bytes: int = 0, shard_in_buffer: bool = False) -> None:
        self.spec = spec
        self.sparse_as_dense = sparse_as_dense
        self.params = list(params)
        self.buffer = torch.zeros(spec.padded_numel, dtype=spec.dtype, device=spec.device)
        compressed = wire_dtype is not None and wire_dtype != spec.dtype
        # `shard_in_buffer` (a world of one whose backend takes a collective from a buffer into
        # itself as done: Communicator.in_place_alone): the shard is the buffer, so both
        # collectives would leave it as it is and are not issued (Horovod issues none at one
        # rank either), and the bucket costs one buffer, not two.
        self.alone = shard_in_buffer and spec.world_size == 1 and not compressed
        self.shard = (self.buffer if self.alone
                      else torch.empty(spec.shard_numel, dtype=spec.dtype, device=spec.device))
        # Compression: what travels is a copy in the wire dtype; averaging stays in spec.dtype.
        self.wire, self.wire_shard = self.buffer, self.shard
        if compressed:
            self.wire = torch.empty(spec.padded_numel, dtype=wire_dtype, device=spec.device)
            self.wire_shard = torch.empty(spec.shard_numel, dtype=wire_dtype, device=spec.device)
        # A bucket larger than `piece_bytes` (the fusion threshold: a parameter larger than a
        # bucket, or an explicit group) is reduce-scattered in pieces of at most that size,
        # column ranges of the shard (Communicator.reduce_scatter_columns; where the backend
        # sends them in place, see _reduce), so no message is larger than a bucket; the
        # shards, and so the numerics, are those of one collective.
        self.rs_pieces = [(0, spec.shard_numel)]
        if spec.world_size > 1 and 0 < piece_bytes < self.reduce_bytes:
            columns = max(1, piece_bytes // (spec.world_size * self.wire.element_size()))
            self.rs_pieces = chunk_columns(spec.shard_numel, columns)
        self.grad_views = [self.buffer[o:o + n].view(p.shape)
                           for o, n, p in zip(spec.offsets, spec.numels, self.params)]
        self.flags = self.buffer[spec.flags_offset:spec.flags_offset + len(self.params)]
        # gradient_as_bucket_view: the parameters' .grad are `user_views`, views of an alias of
        # the buffer with its own version counter (Tensor.data), so only autograd's and the
        # user's writes move it; `taken_version` is where it stood when backward handed over the
        # last gradient, `zero_after_update` the views zero_grad() zeroes once the pending update
        # has read them.
        self.exposes_views = views and self.views_supported
        self.user_views: list[torch.Tensor] = []
        self._user: Optional[torch.Tensor] = None
        self.taken_version: Optional[int] = None
        self.zero_after_update: set[int] = set()
        if self.exposes_views:
            native = False                 # the C++ hooks keep per-parameter versions
        self.packed = [False] * len(self.params)
        self.used = [0.0] * len(self.params)
        self._held: list[Optional[torch.Tensor]] = [None] * len(self.params)
        self.num_packed = 0
        self._filled = False                       # fill() ran this iteration
        self.stage = Stage.IDLE
        # What a gradient transform did to the packed gradients before the reduce-scatter
        # (dear.KFAC's eigenbasis rotation, dear/kfac/overlap.py), undone after the all-gather.
        self.transformed: Optional[object] = None
        self._work: Optional[Work] = None          # the reduce-scatter
        self._gathers: list[Work] = []              # all-gathers (whole, grouped or chunks)
        # What the all-gather sends in place of the averaged shard: with
        # shard_optimizer_state, this rank's updated parameters (dear/sharding/state.py).
        self.outgoing: Optional[torch.Tensor] = None
        self._averaged = False                      # finish_reduce_scatter ran
        # On a GPU the averaging may run on the planned schedule's side stream: a stream that
        # reads the shard later waits for this event first.
        self._averaged_event: Optional[torch.cuda.Event] = None
        # This rank had a gradient for every parameter (read when the reduce-scatter starts):
        # then every flag is non-zero after the all-gather, and reading them back (a host sync
        # on a GPU, in the forward that applies the update) is skipped.
        self._all_used_here = False
        # The reduce-scatter may be finished by the thread that issues planned all-gather
        # chunks (dear/fusion/schedule.py) or by step(): whichever comes first, once.
        self._finish_lock = threading.Lock()
        # Native path (csrc/, `native` None: DEAR_NATIVE and whether it was built): hooks only
        # record gradients; C++ packs the bucket, flags and padding when the last one arrives.
        use_native = _native.enabled(_runtime.config().native) if native is None else native
        self.ready = (_native.grad_ready(self.buffer, spec.offsets, spec.numels,
                                          spec.flags_offset, sparse_as_dense)
                       if use_native else None)
        if self.ready is not None:        # the hooks call C++ directly: no Python frame
            self.pack = self.ready.record  # type: ignore[method-assign]

    def expose_views(self) -> list[torch.Tensor]:
        """The views the parameters' .grad point at (gradient_as_bucket_view)."""
        assert self.exposes_views
        if self._user is None:
            self._user = self.buffer.data      # same memory, its own version counter
            self.user_views = [self._user[o:o + n].view(p.shape) for o, n, p
                               in zip(self.spec.offsets, self.spec.numels, self.params)]
        return self.user_views

    def user_version(self) -> int:
        assert self._user is not None
        return self._user._version

    def swap_grads(self, grads: Sequence[Optional[torch.Tensor]]
                   ) -> list[Optional[torch.Tensor]]:
        """Set each parameter's .grad (None: none) and return the previous ones: the update lends
        the parameters the averaged gradients and gives the user's back. The C++ version skips
        the Python setter's checks (1000 small tensors: two setter calls each per update), so the
        caller guarantees matching shape, dtype and device."""
        ext = _native.extension()
        if ext is not None:
            return ext.swap_grads(list(self.params), list(grads))
        saved = [p.grad for p in self.params]
        for p, g in zip(self.params, grads):
            p.grad = g
        return saved

    def zero_pending_views(self) -> None:
        """Zero what zero_grad() asked for while the update was pending (after it ran)."""
        for j in self.zero_after_update:
            self.grad_views[j].zero_()
        self.zero_after_update = set()

    @property
    def reduce_bytes(self) -> int:
        """What its reduce phase puts on the link, as a reduce-scatter of that many bytes (the
        planned schedule's link model)."""
        return self.wire.numel() * self.wire.element_size()

    @property
    def full(self) -> bool:
        if self.ready is not None:
            return self.ready.full()
        return self.num_packed == len(self.params)

    def pack(self, j: int, grad: Optional[torch.Tensor]) -> None:
        """Take parameter j's local gradient (None: this rank has none, counts as zero); it is
        copied into the buffer by fill()."""
        if self.ready is not None:
            self.ready.record(j, grad)
            return
        if self.packed[j]:
            return
        if grad is not None:
            if grad.is_sparse:
                if not self.sparse_as_dense:
                    raise RuntimeError(
                        "dear.DistributedOptimizer got a sparse gradient; dear reduces dense "
                        "buckets. Use a dense layer (nn.Embedding(sparse=False)) or pass "
                        "sparse_as_dense=True.")
                grad = grad.to_dense()
            if grad.numel() != self.grad_views[j].numel():
                raise RuntimeError(
                    f"dear: the gradient of parameter {j} of bucket {self.spec.index} has "
                    f"{grad.numel()} elements, but the parameter has "
                    f"{self.grad_views[j].numel()}")
        self._held[j] = grad
        self.used[j] = 0.0 if grad is None else 1.0
        self.packed[j] = True
        self.num_packed += 1

    def local_used(self) -> list[float]:
        """Which parameters this rank had a gradient for, this iteration (1.0 or 0.0)."""
        return list(self.ready.used()) if self.ready is not None else list(self.used)

    @property
    def all_used_here(self) -> bool:
        """This rank had a gradient for every parameter (known once the reduce-scatter began)."""
        return self._all_used_here

    def fill(self) -> None:
        """Copy the taken gradients, the usage flags and zero padding into the buffer (once an
        iteration; the bucket must be full). Drops the references to the gradients."""
        if self._filled:
            return
        assert self.full, "bucket filled before every gradient was taken"
        if self.ready is not None:
            self.ready.pack()                 # C++, without the GIL
        else:
            mine: Sequence[Optional[torch.Tensor]] = self.user_views or [None] * len(self.params)
            for view, grad, own in zip(self.grad_views, self._held, mine):
                if grad is None:
                    view.zero_()
                elif grad is not own:          # a view of this buffer is already in place
                    view.copy_(grad)
            self._held = [None] * len(self.params)
            if all(u != 0 for u in self.used):
                self.flags.fill_(1.0)
            else:  # from pinned memory: a pageable host-to-device copy waits for the device
                pinned = self.flags.is_cuda
                used = torch.tensor(self.used, dtype=self.flags.dtype, pin_memory=pinned)
                self.flags.copy_(used, non_blocking=pinned)
            self.buffer[self.spec.flags_offset + len(self.params):].zero_()
        self._filled = True

    def pack_missing(self) -> None:
        """Parameters whose hook did not fire this iteration contribute their .grad, or zero."""
        if self.ready is not None:
            for j in self.ready.missing():
                self.ready.record(j, self.params[j].grad)
            return
        for j, p in enumerate(self.params):
            if not self.packed[j]:
                self.pack(j, p.grad)

    @property
    def wires(self) -> tuple[torch.Tensor, ...]:
        """The tensors its collectives send from or receive into (the tracer's bucket map)."""
        return (self.wire, self.wire_shard)

    def holds(self, ptr: int) -> bool:
        """Whether address `ptr` lies in one of this bucket's buffers (the hang report)."""
        return any(t.data_ptr() <= ptr < t.data_ptr() + t.numel() * t.element_size()
                   for t in (self.buffer, self.shard, *self.wires))

    def start_reduce_scatter(self, comm: Communicator, prescale: float,
                             submit: Optional[Callable[..., Work]] = None) -> None:
        """`submit` (the schedule's executor) fills the buffer and issues the collective in its
        thread, in order; without it, this thread does both now."""
        assert self.stage is Stage.IDLE and self.full, "bucket reduced twice or before it is full"
        self._all_used_here = (self.ready.all_used() if self.ready is not None
                               else all(u != 0 for u in self.used))

        def issue() -> Work:
            self.fill()
            if prescale != 1.0:
                self.buffer.mul_(prescale)
            return self._reduce(comm)
        if submit is not None:                 # a failure to issue surfaces at the wait
            self._work = submit(issue)
        else:
            self._work = self.issued("reduce-scatter", issue)
        self._averaged = False
        self.stage = Stage.REDUCING

    def _reduce(self, comm: Communicator) -> Work:
        """The collective(s) of the filled, prescaled buffer (a row-sparse table sends its
        rows). In pieces only where the backend reads them in place: elsewhere each piece
        would first be copied, memory spent for no measurable gain
        (docs/benchmarks.md#fusion-thresholds-and-pieces)."""
        if self.alone:
            return DoneWork()
        if self.wire is not self.buffer:
            self.wire.copy_(self.buffer)
        if len(self.rs_pieces) == 1 or not comm.pieces_in_place(self.wire):
            return comm.reduce_scatter(self.wire, self.wire_shard)
        return CallbackWork([comm.reduce_scatter_columns(self.wire, self.wire_shard, start, n)
                             for start, n in self.rs_pieces])

    def _wait(self, what: str, work: Optional[Work] = None) -> None:
        work = self._work if work is None else work
        assert work is not None
        try:
            work.wait()
        except Exception as exc:
            raise self.failure(what, exc) from exc

    def issued(self, what: str, issue: Callable[[], _T]) -> _T:
        """`issue()`, a collective of this bucket issued on this thread: a peer that is gone
        already fails it here, not at its wait, and the error says which bucket, as there.
        Bad arguments (ValueError, TypeError) are raised as they are."""
        try:
            return issue()
        except REFUSED_AT_ISSUE:
            raise
        except Exception as exc:
            raise self.failure(what, exc) from exc

    def failure(self, what: str, exc: BaseException) -> Exception:
        """The error of a failed collective of this bucket."""
        mb = self.buffer.numel() * self.buffer.element_size() / 2**20
        return collective_error(
            f"dear: {what} of bucket {self.spec.index} ({len(self.params)} parameters, "
            f"{mb:.2f} MB) failed; another rank probably died or stalled: {exc}", exc)

    def finish_reduce_scatter(self, postscale: float) -> None:
        """Wait for the reduce-scatter and average this rank's shard, exactly once."""
        with self._finish_lock:
            if self._averaged:
                if self._averaged_event is not None:
                    torch.cuda.current_stream(self.shard.device).wait_event(
                        self._averaged_event)
                return
            assert self.stage in (Stage.REDUCING, Stage.GATHERING)
            self._wait("reduce-scatter")
            self._sum_into_shard(postscale)
            if postscale != 1.0:
                self.shard.mul_(postscale)
            if self.shard.is_cuda:
                if self._averaged_event is None:    # one a bucket, recorded each iteration
                    self._averaged_event = torch.cuda.Event()
                self._averaged_event.record(torch.cuda.current_stream(self.shard.device))
            self._averaged = True

    def _sum_into_shard(self, postscale: float) -> None:
        """The reduce-scatter's result into `shard` (not yet scaled by `postscale`)."""
        if self.wire_shard is not self.shard:
            self.shard.copy_(self.wire_shard)

    def outgoing_shard(self) -> torch.Tensor:
        """This rank's averaged shard, in the wire dtype, ready to be all-gathered (or what
        replaces it: `outgoing`)."""
        if self.outgoing is not None:
            return self.outgoing
        if self.wire_shard is not self.shard:
            self.wire_shard.copy_(self.shard)
        return self.wire_shard

    def start_all_gather(self, comm: Communicator) -> None:
        if self.alone and self.outgoing is None:
            self.gathering(DoneWork())
            return
        self.gathering(comm.all_gather(self.outgoing_shard(), self.wire))

    @property
    def gather_numel(self) -> int:
        """Elements of this rank's all-gather message (wire_shard): what chunk columns count
        (a quantized bucket's are the bytes of its slot)."""
        return self.wire_shard.numel()

    def gather_columns(self, comm: Communicator, start: int, length: int) -> Work:
        """All-gather one chunk of the shard, columns [start, start + length); the shard must
        be averaged already (finish_reduce_scatter) and sent in the wire dtype."""
        if self.outgoing is not None:
            return comm.all_gather_columns(self.outgoing, self.wire, start, length)
        if start == 0 and self.wire_shard is not self.shard:
            self.wire_shard.copy_(self.shard)          # compression: the whole shard, once
        return comm.all_gather_columns(self.wire_shard, self.wire, start, length)

    def forget_early_gathers(self) -> None:
        """Chunks gathered in backward that must be sent again (an early update was undone):
        wait for them, so nothing lands in the buffer later, and drop them."""
        for work in self._gathers:
            self._wait("all-gather", work)
        self._gathers = []

    def gather_early(self, work: Work) -> None:
        """A chunk's all-gather issued during backward (a planned schedule): the bucket stays
        REDUCING, its update is not pending yet; step() adds the rest."""
        self._gathers.append(work)

    def take_gathers(self) -> list[Work]:
        """The all-gathers issued so far (chunks in backward), handed over: the caller makes
        them part of the work it passes to gathering() (a quantized bucket decodes once the
        last has landed)."""
        gathers, self._gathers = self._gathers, []
        return gathers

    def gathering(self, work: Optional[Work] = None) -> None:
        """An all-gather filling (the rest of) `wire` is `work` (possibly shared with other
        buckets; None: chunks issued earlier filled it all): the update is now pending."""
        if work is not None:
            self._gathers.append(work)
        self.stage = Stage.GATHERING
        if self.ready is not None:        # its C++ hooks hand gradients to Python now
            self.ready.set_pending(True)

    def finish_all_gather(self) -> list[bool]:
        """Wait for the averaged gradients; return which parameters any rank produced one for."""
        assert self.stage is Stage.GATHERING
        for work in self._gathers:
            self._wait("all-gather", work)
        self._gathers = []
        self._work = None
        return self.land()

    def land(self) -> list[bool]:
        """The gathered wire into the buffer; which parameters any rank produced one for
        (finish_all_gather, once its all-gathers are done)."""
        if self._all_used_here:                # some rank (this one) used each: no flag read
            if self.wire is not self.buffer:
                self.buffer.copy_(self.wire)
            return [True] * len(self.params)
        if self.ready is not None:
            ext = _native.extension()          # loaded: it made self.ready
            assert ext is not None
            return ext.unpack_bucket(self.wire, self.buffer, self.spec.flags_offset,
                                     len(self.params))
        if self.wire is not self.buffer:
            self.buffer.copy_(self.wire)
        return (self.flags != 0).tolist()

    def drop(self) -> None:
        """Forget this iteration's gradients once nothing is in flight any more (a skipped or
        refused step): the collectives were issued on every rank, so they are completed."""
        try:
            if self.stage is not Stage.IDLE and self._work is not None:
                self._wait("reduce-scatter")
            for work in self._gathers:
                self._wait("all-gather", work)
        finally:
            self.reset()

    def reset(self) -> None:
        if self.ready is not None:
            self.ready.reset()
        self.packed = [False] * len(self.params)
        self.used = [0.0] * len(self.params)
        self._held = [None] * len(self.params)
        self.num_packed = 0
        self._filled = False
        self.stage = Stage.IDLE
        self.transformed = None
        self._gathers = []
        self._averaged = False
        self._all_used_here = False
        self.taken_version = None
        self.outgoing = None
