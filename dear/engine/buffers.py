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

import operator
from typing import Any, Callable, Iterable, Optional

import torch

from ..comm.base import Communicator
from ..fusion.executor import issue_pending
from ..guards import model_guard


class BufferBroadcast:
    """Callable: broadcast `model`'s buffers from `root` to every rank, in place.

    The buffers of one device travel as the bytes of one flat tensor (whatever their dtypes:
    one broadcast, not one per dtype); the root packs them, the others receive into an empty
    one. The list of buffers is walked once and re-walked when a module reassigned one (each
    call compares the cached tensors with the modules' own, a dict lookup each) or when the
    caller asks (`rescan`: the engine's iterations that compare contents)."""

    _ALIGN = 16                                # every slice starts where any dtype may view it

    def __init__(self, model: torch.nn.Module, comm: Communicator) -> None:
        self._model = model
        self._comm = comm
        self.root = 0                          # dear.join() moves it to an active rank
        self._staged: list[tuple[_Group, list[int], list[int]]] = []
        self._groups: list[_Group] = []
        self._scanned = False
        # Each buffer as the walk found it: its module's `_buffers` dict, its name there, the
        # tensor and its memory (columns, for _current's map()s).
        self._dicts: list[dict[str, Any]] = []
        self._names: list[str] = []
        self._bufs: list[torch.Tensor] = []
        self._ptrs: list[int] = []
        comm.check_dtype(torch.uint8)
        for dtype in {b.dtype for b in model.buffers()}:
            comm.check_dtype(dtype)
        if not comm.elastic:                   # else when the ranks (re)join a world
            self.check_same(comm)

    def check_same(self, comm: Communicator) -> None:
        """The same buffers on every rank, or the copy corrupts them (a collective)."""
        mine = [(n, tuple(b.shape), str(b.dtype)) for n, b in self._model.named_buffers()]
        if comm.size > 1:
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

    def _scan(self) -> None:
        """The buffers (each module's `_buffers` dict and name, in model.buffers()' order) and,
        per device, one flat byte tensor with each buffer's slice in it, viewed both as bytes
        (what the root packs into) and as the buffer's dtype and shape (what the others put in
        place): built once, reused by every call until a buffer is reassigned."""
        dicts: list[dict[str, Any]] = []
        names: list[str] = []
        found: list[torch.Tensor] = []
        seen: set[int] = set()
        with model_guard.quiet():
            for module in self._model.modules():
                for name, buf in module._buffers.items():
                    if buf is not None and id(buf) not in seen:
                        seen.add(id(buf))
                        dicts.append(module._buffers)
                        names.append(name)
                        found.append(buf)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for buf in found:
            by_device.setdefault(buf.device, []).append(buf)
        groups = []
        for device, bufs in by_device.items():
            ranges, end = [], 0
            for buf in bufs:
                start = -(-end // self._ALIGN) * self._ALIGN
                end = start + buf.numel() * buf.element_size()
                ranges.append((start, end))
            flat = torch.zeros(end, dtype=torch.uint8, device=device)
            groups.append(_Group(flat, bufs, [flat[a:b] for a, b in ranges],
                                 [flat[a:b].view(buf.dtype).view(buf.shape)
                                  for buf, (a, b) in zip(bufs, ranges)],
                                 [_bytes_of(b) if b.is_contiguous() else None for b in bufs]))
        self._groups = groups
        self._dicts, self._names, self._bufs = dicts, names, found
        self._ptrs = list(map(_DATA_PTR, found))
        self._scanned = True

    def _current(self, rescan: bool) -> None:
        """The cached buffers are the modules' own, in the same memory (else re-walked: a
        module reassigned one, or set its `.data`). Compared by C-level map()s over the
        cached lists, so a steady iteration runs no Python frame per buffer."""
        if rescan or not self._scanned:
            self._scan()
            return
        now = list(map(dict.get, self._dicts, self._names))
        if not all(map(operator.is_, now, self._bufs)) \
                or list(map(_DATA_PTR, now)) != self._ptrs:
            self._scan()

    def __call__(self, rescan: bool = True) -> None:
        """In step(): receive the root's buffers into the staging bytes (`apply_staged` puts
        them in place at the next forward, DDP's point)."""
        if self._comm.size == 1:
            return
        issue_pending()
        self._current(rescan)
        root = self._comm.rank == self.root
        pending = []
        with torch.no_grad():
            for group in self._groups:
                if root:
                    torch._foreach_copy_(group.bytes, group.own_bytes or
                                         [_bytes_of(b) if s is None else s
                                          for b, s in zip(group.bufs, group.sources)])
                pending.append((group, self._comm.broadcast(group.flat, self.root)))
            staged = []
            for group, work in pending:
                work.wait()
                if not root:
                    staged.append((group, list(map(_VERSION, group.bufs)),
                                   list(map(_DATA_PTR, group.bufs))))
        self._staged = staged

    def apply_staged(self) -> None:
        """At the next forward, in any mode (DDP broadcasts at the start of a forward that
        follows one with gradients: here the training forward before step()), every buffer
        takes the root's value from step(), except one this rank changed since (e.g. timm's
        distribute_bn averaging the statistics on every rank at an epoch's end), which keeps
        its new value (also one given new memory through .data), as DDP's broadcast would give it
        when every rank changed it alike."""
        if not self._staged:
            return
        staged, self._staged = self._staged, []
        with torch.no_grad():                  # on the forward's critical path: few kernels
            for group, versions, ptrs in staged:
                if list(map(_VERSION, group.bufs)) == versions \
                        and list(map(_DATA_PTR, group.bufs)) == ptrs:   # none changed since:
                    for dst, src in group.by_dtype:               # one copy per dtype
                        torch._foreach_copy_(dst, src)
                    continue
                kept = [(buf, value) for buf, version, ptr, value
                        in zip(group.bufs, versions, ptrs, group.values)
                        if buf._version == version and buf.data_ptr() == ptr]
                for dst, src in _by_dtype(kept):
                    torch._foreach_copy_(dst, src)


_VERSION = operator.attrgetter("_version")
_DATA_PTR: Callable[[Any], int] = torch.Tensor.data_ptr


class _Group:
    """One device's buffers and their slices of one flat byte tensor."""

    def __init__(self, flat: torch.Tensor, bufs: list[torch.Tensor],
                 byte_views: list[torch.Tensor], values: list[torch.Tensor],
                 sources: list[Optional[torch.Tensor]]) -> None:
        self.flat, self.bufs, self.bytes, self.values = flat, bufs, byte_views, values
        # each buffer's own memory as bytes (None: not contiguous, copied at each call)
        self.sources = sources
        # all of them (every buffer contiguous), or None
        self.own_bytes = [s for s in sources if s is not None] \
            if all(s is not None for s in sources) else None
        # apply_staged's copies when no buffer changed since step()
        self.by_dtype = _by_dtype(zip(bufs, values))


def _by_dtype(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]
              ) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """(buffers, the values to copy into them) grouped by dtype: one _foreach_copy_ each."""
    grouped: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for buf, value in pairs:
        dst, src = grouped.setdefault(buf.dtype, ([], []))
        dst.append(buf)
        src.append(value)
    return list(grouped.values())


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A buffer's elements as bytes (a view of its memory where it is contiguous)."""
    return t.detach().contiguous().view(-1).view(torch.uint8)
