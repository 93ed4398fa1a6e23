"""Writes dear cannot let through silently: a tensor it took, or will read, changed behind it.

dear takes each gradient as backward produces it and applies each bucket's update in the next
forward. A `.grad` edited after backward (step() refuses it, dear/engine/steps.py) or a parameter
written between step() and the forward that applies its update (the update would land on the
written values: under DDP the write comes after the update) would give another model than DDP.
An in-place write moves autograd's version counter, but a write through `.data` does not, so
the contents are compared too, by `fingerprint`.
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Sequence, TypeVar, Union

import torch

from .. import native as _native

_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

# A CPU tensor's digest (csrc/digest.h) where the extension is built; a CUDA tensor's digest
# computed there (csrc/cuda/digest_cuda.h, with a CUDA build), in a 1-tuple of a tensor on the
# GPU; else two sums in tensors. Tensors are compared without a host sync until first_changed.
Fingerprint = Union[int, tuple[torch.Tensor, ...]]


def fingerprint(tensor: torch.Tensor) -> Fingerprint:
    """What moves when the tensor's contents do: one read of it, for every gradient and
    parameter in every iteration."""
    return fingerprints([tensor])[0]


def fingerprints(tensors: Sequence[torch.Tensor]) -> list[Fingerprint]:
    """With the extension, a 64-bit digest (csrc/digest.h): any one changed element always
    shows, any other change is missed only by a 1-in-2^32 coincidence, at the speed of one
    reduction; CUDA tensors with one kernel per call and device, whatever their number (a GPU
    spends microseconds per launch). Otherwise two sums: the bit patterns as wrapping integers
    (exact: any one changed element shows) and the float sum of the values (a sign flip of an
    even number of elements); an edit that keeps both (a permutation, say) goes unseen."""
    ext = _native.extension()
    if ext is None:
        return [_sums(t) for t in tensors]
    host = [t.device.type == "cpu" and t.layout == torch.strided for t in tensors]
    if all(host):
        return list(ext.digests(list(tensors)))      # one call, without the GIL
    out: dict[int, Fingerprint] = {}
    on_host = [k for k, h in enumerate(host) if h]
    out.update(zip(on_host, ext.digests([tensors[k] for k in on_host])))
    on_gpu: dict[torch.device, list[int]] = {}
    for k, t in enumerate(tensors):
        if host[k]:
            continue
        if t.is_cuda and t.layout == torch.strided and hasattr(ext, "digests_cuda"):
            on_gpu.setdefault(t.device, []).append(k)
        else:
            out[k] = _sums(t)
    for ks in on_gpu.values():
        digests = ext.digests_cuda([tensors[k] for k in ks]).unbind()
        out.update((k, (d,)) for k, d in zip(ks, digests))
    return [out[k] for k in range(len(tensors))]


def _sums(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    t = tensor.detach()
    bits = _BITS[t.element_size()]
    whole = t.view(bits).sum(dtype=bits)
    if not t.is_floating_point():
        return (whole,)
    return (whole, t.sum(dtype=torch.float32).view(torch.int32))   # bits: NaN == NaN


def first_changed(before: Sequence[Fingerprint], after: Sequence[Fingerprint]) -> Optional[int]:
    """The first k whose fingerprints differ, or None; the sums in tensors are compared once
    per dtype and device when none differs (a GPU syncs once or twice)."""
    groups: dict[tuple[torch.dtype, torch.device],
                 tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for b, a in zip(before, after):
        if _sums_alike(b, a):
            for x, y in zip(b, a):      # type: ignore[arg-type]
                pair = groups.setdefault((x.dtype, x.device), ([], []))
                pair[0].append(x)
                pair[1].append(y)
    sums_same = all(torch.equal(torch.stack(xs), torch.stack(ys)) for xs, ys in groups.values())
    return next((k for k, (b, a) in enumerate(zip(before, after))
                 if not (sums_same and _sums_alike(b, a)) and _differs(b, a)), None)


def _sums_alike(b: Fingerprint, a: Fingerprint) -> bool:
    """Both are sums in tensors of the same dtypes and devices (one stack compares them)."""
    return (isinstance(b, tuple) and isinstance(a, tuple) and len(b) == len(a)
            and all((x.dtype, x.device) == (y.dtype, y.device) for x, y in zip(b, a)))


def _differs(b: Fingerprint, a: Fingerprint) -> bool:
    if isinstance(b, int) or isinstance(a, int):
        return b != a
    return not _sums_alike(b, a) or any(not torch.equal(x, y) for x, y in zip(b, a))


#: Fingerprints held on these kinds of device are compared there and their verdict read later
#: (`Verdict`): a GPU's host must not wait for the device in a steady iteration. Tests add
#: "cpu" to run that path on CPU tensors.
DEFERRED_DEVICES: set[str] = {"cuda"}


def _device_of(prints: Sequence[Fingerprint]) -> Optional[torch.device]:
    for f in prints:
        if isinstance(f, tuple) and f and f[0].device.type in DEFERRED_DEVICES:
            return f[0].device
    return None


class Verdict:
    """Which of two lists of fingerprints differ. Integers and host tensors are compared now;
    fingerprints on a deferred device (a GPU) are compared there, and the answer comes back
    through a pinned copy and an event, read once the device has got there (`ready`): checking
    never makes the host wait for the device."""

    def __init__(self, before: Sequence[Fingerprint], after: Sequence[Fingerprint]) -> None:
        self._first: Optional[int] = None
        self._answer: Optional[tuple[torch.Tensor, Any]] = None
        device = _device_of(before) or _device_of(after)
        if device is None:
            self._first = first_changed(before, after)
            return
        host = [k for k, (b, a) in enumerate(zip(before, after)) if not _on(b, a, device)]
        self._first = next((k for k in host if _differs(before[k], after[k])), None)
        if self._first is not None:
            return
        device_items = [k for k in range(len(before)) if k not in set(host)]
        flags = torch.zeros(len(before), dtype=torch.int32, device=device)
        groups: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor], list[int]]] = {}
        for k in device_items:
            for x, y in zip(before[k], after[k]):      # type: ignore[arg-type]
                xs, ys, owners = groups.setdefault(x.dtype, ([], [], []))
                xs.append(x.reshape(()))
                ys.append(y.reshape(()))
                owners.append(k)
        pinned = device.type == "cuda"        # host memory the device copies from / to async
        for xs, ys, owners in groups.values():
            owner = torch.tensor(owners, dtype=torch.int64)
            owner = (owner.pin_memory() if pinned else owner).to(device, non_blocking=pinned)
            flags.index_add_(0, owner, torch.stack(xs).ne(torch.stack(ys)).to(torch.int32))
        index = torch.arange(len(before), device=device)
        first = torch.where(flags > 0, index, len(before)).min()
        out = torch.empty((), dtype=torch.int64, pin_memory=pinned)
        out.copy_(first, non_blocking=pinned)
        event = None
        if pinned:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        self._answer = (out, event)
        self._size = len(before)

    @property
    def on_device(self) -> bool:
        """The answer is being computed on the device (not known yet on the host)."""
        return self._answer is not None

    @property
    def ready(self) -> bool:
        """The answer can be read without waiting."""
        return self._answer is None or self._answer[1] is None or self._answer[1].query()

    def first(self) -> Optional[int]:
        """An index whose fingerprints differ, or None (waits for the device if not ready)."""
        if self._answer is not None:
            out, event = self._answer
            if event is not None:
                event.synchronize()
            k = int(out.numpy())           # a host tensor: no dispatcher read
            self._first = None if k >= self._size else k
            self._answer = None
        return self._first


def _on(b: Fingerprint, a: Fingerprint, device: torch.device) -> bool:
    """Both fingerprints are tensors on `device`."""
    return (isinstance(b, tuple) and isinstance(a, tuple) and len(b) == len(a)
            and all(x.device == device and y.device == device and x.dtype == y.dtype
                    for x, y in zip(b, a)))


_VERSION = operator.attrgetter("_version")



_Item = TypeVar("_Item")


def first_settled(queued: list[tuple[Sequence[_Item], Verdict]], wait: bool = False
                  ) -> tuple[Optional[_Item], list[tuple[Sequence[_Item], Verdict]]]:
    """The first item found changed among the queued verdicts that are in (`wait`: all of
    them), and the queue of those still out."""
    kept, found = [], None
    for items, verdict in queued:
        if not (wait or verdict.ready):
            kept.append((items, verdict))           # the device has not got there yet
            continue
        k = verdict.first()
        if k is not None and found is None:
            found = items[k]
    return found, kept


class PendingWrites:
    """The parameters of each bucket as step() left them, checked when its update runs.

    A write moving the version counter is refused right there, before the update (no host
    sync: the counters are integers). A write through `.data` shows only in the contents: their
    fingerprints are taken at step() and before the update, compared there (on a GPU, on the
    device: `Verdict`) and the answer read at the next step() (`written_since_step`): that
    error comes one iteration late, after the update landed on the written values."""

    def __init__(self) -> None:
        self._at_step: dict[int, tuple[list[int], Optional[list[Fingerprint]]]] = {}
        self._applied: list[tuple[Sequence[torch.nn.Parameter], Verdict]] = []

    def note_step(self, key: int, params: Sequence[torch.nn.Parameter],
                  prints: Optional[list[Fingerprint]] = None, contents: bool = True) -> None:
        """step() started the all-gathers of this bucket's update (`prints`: the parameters'
        fingerprints, where this step() already took them). Without `contents` only the
        version counters are noted (an iteration that compares no contents: checks.py)."""
        if contents and prints is None:
            prints = fingerprints(params)
        self._at_step[key] = (list(map(_VERSION, params)), prints)

    def before_update(self, key: int, params: Sequence[torch.nn.Parameter]) -> Optional[int]:
        """The update of bucket `key` is about to run: the index of a parameter written in
        place since step(), or None (the contents are compared later)."""
        noted = self._at_step.pop(key, None)
        if noted is None:
            return None
        versions, before = noted
        if list(map(_VERSION, params)) != versions:
            return next(j for j, (p, v) in enumerate(zip(params, versions)) if p._version != v)
        if before is not None:
            self._applied.append((params, Verdict(before, fingerprints(params))))
        return None

    def written_since_step(self, wait: bool = False) -> Optional[torch.nn.Parameter]:
        """A parameter whose contents changed between a step() and its update (through
        `.data`), among the updates whose verdict is in (`wait`: all of them), or None."""
        found, self._applied = first_settled(self._applied, wait)
        return found

    def forget(self) -> None:
        self._at_step = {}
        self._applied = []
