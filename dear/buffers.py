"""DDP's `broadcast_buffers=True` under DeAR: every rank takes one rank's module buffers
(BatchNorm's running statistics, num_batches_tracked, any registered buffer), so evaluation and
checkpoints do not depend on the rank.

DDP broadcasts rank 0's buffers at the start of every forward that follows a forward with
gradients enabled (so at the first forward after a training step, evaluation included). dear
receives them inside step() (or synchronize()), after the reduce-scatters have finished and before
the all-gathers start: a point every rank reaches in the same order relative to dear's other
collectives, where nothing else is in flight (a broadcast at the next forward would wait behind
the all-gathers that overlap it). It puts them in place where DDP does, at the next forward,
so between step() and that forward every rank holds its own buffers, as under
DDP (timm's distribute_bn and EMA updates read them there). Buffers change only in forwards, so
the values are DDP's; a buffer a rank changed in between (distribute_bn's average) keeps its new
value. What differs: between the forwards of one step (backward_passes_per_step > 1) each rank's
buffers evolve from its own values (DDP under no_sync: the same), and the root's values come from
the last step(), where DDP's come from the last micro-batch's forward.

Under dear.join() the root is the highest rank that has not joined, as DDP's Join does.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from . import model_guard, runtime
from .comm.base import Communicator


def issue_pending() -> None:
    """Before a collective issued from the main thread inside dear (buffers, sparse gradients,
    dear.join): every optimizer's collective thread has issued what backward gave it, so this
    collective keeps its place in the order on every rank (as runtime._flush_all does for the
    user's collectives)."""
    for opt in runtime.optimizers():
        opt.dear_schedule.drain()


class BufferBroadcast:
    """Callable: broadcast `model`'s buffers from `root` to every rank, in place."""

    def __init__(self, model: torch.nn.Module, comm: Communicator) -> None:
        self._model = model
        self._comm = comm
        self.root = 0                          # dear.join() moves it to an active rank
        self._staged: list[tuple[list[torch.Tensor], list[int], torch.Tensor]] = []
        mine = [(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()]
        for dtype in {b.dtype for b in model.buffers()}:
            comm.check_dtype(dtype)
        if comm.size > 1:                      # same buffers everywhere, or the copy corrupts
            for r, theirs in enumerate(comm.all_gather_object(mine)):
                if theirs != mine:
                    raise ValueError(
                        f"the model's buffers differ between rank {comm.rank} and rank {r} "
                        f"({len(mine)} vs {len(theirs)} buffers, or other shapes/dtypes); "
                        "broadcast_buffers=True needs the same model on every rank")

    @staticmethod
    def wanted(model: Optional[torch.nn.Module], broadcast_buffers: bool) -> bool:
        return bool(broadcast_buffers and model is not None
                    and next(model.buffers(), None) is not None)

    def __call__(self) -> None:
        """In step(): receive the root's buffers into a staging copy (`apply_staged` puts them
        in place at the next forward, DDP's point)."""
        if self._comm.size == 1:
            return
        issue_pending()
        # Read the buffers again each time: a module may have reassigned one.
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        with model_guard.quiet():
            for buf in self._model.buffers():
                by_kind.setdefault((buf.dtype, buf.device), []).append(buf)
        pending = []
        with torch.no_grad():
            for bufs in by_kind.values():
                flat = _flatten_dense_tensors(bufs)
                pending.append((bufs, flat, self._comm.broadcast(flat, self.root)))
            staged = []
            for bufs, flat, work in pending:
                work.wait()
                if self._comm.rank != self.root:
                    staged.append((bufs, [b._version for b in bufs], flat))
        self._staged = staged

    def apply_staged(self) -> None:
        """At the next forward, in any mode (DDP broadcasts at the start of a forward that
        follows one with gradients: here the training forward before step()), every buffer
        takes the root's value from step(), except one this rank changed since (e.g. timm's
        distribute_bn averaging the statistics on every rank at an epoch's end), which keeps
        its new value, as DDP's broadcast would give it when every rank changed it alike."""
        if not self._staged:
            return
        staged, self._staged = self._staged, []
        with torch.no_grad():                  # on the forward's critical path: one kernel
            for bufs, versions, flat in staged:
                pairs = [(buf, value) for buf, version, value
                         in zip(bufs, versions, _unflatten_dense_tensors(flat, bufs))
                         if buf._version == version]
                if pairs:
                    torch._foreach_copy_([b for b, _ in pairs], [v for _, v in pairs])
