"""Writes dear cannot let through silently: a tensor it took, or will read, changed behind it.

dear takes each gradient as backward produces it and applies each bucket's update in the next
forward. A `.grad` edited after backward (step() refuses it, dear/deferred.py) or a parameter
written between step() and the forward that applies its update (the update would land on the
written values: under DDP the write comes after the update) would give another model than DDP.
An in-place write moves autograd's version counter, but a write through `.data` does not, so
the contents are compared too, by `fingerprint`.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from . import native as _native

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


class PendingWrites:
    """The parameters of each bucket as step() left them, checked when its update runs.

    A write moving the version counter is refused right there, before the update (no host
    sync: the counters are integers). A write through `.data` shows only in the contents: their
    fingerprints are taken at step() and before the update, and compared at the next check
    (`written_since_step`, called by the next step()), where a GPU syncs anyway: that error
    comes one iteration late, after the update landed on the written values."""

    def __init__(self) -> None:
        self._at_step: dict[int, tuple[list[int], list[Fingerprint]]] = {}
        self._applied: list[tuple[Sequence[torch.nn.Parameter], list[Fingerprint],
                                  list[Fingerprint]]] = []

    def note_step(self, key: int, params: Sequence[torch.nn.Parameter],
                  prints: Optional[list[Fingerprint]] = None) -> None:
        """step() started the all-gathers of this bucket's update (`prints`: the parameters'
        fingerprints, where this step() already took them)."""
        self._at_step[key] = ([p._version for p in params],
                              prints if prints is not None else fingerprints(params))

    def before_update(self, key: int, params: Sequence[torch.nn.Parameter]) -> Optional[int]:
        """The update of bucket `key` is about to run: the index of a parameter written in
        place since step(), or None (the contents are compared later)."""
        noted = self._at_step.pop(key, None)
        if noted is None:
            return None
        versions, before = noted
        for j, (p, version) in enumerate(zip(params, versions)):
            if p._version != version:
                return j
        self._applied.append((params, before, fingerprints(params)))
        return None

    def written_since_step(self) -> Optional[torch.nn.Parameter]:
        """A parameter whose contents changed between a step() and its update (through
        `.data`), since the last call, or None."""
        applied, self._applied = self._applied, []
        before = [f for _, b, _ in applied for f in b]
        after = [f for _, _, a in applied for f in a]
        k = first_changed(before, after)
        if k is None:
            return None
        params = [p for ps, _, _ in applied for p in ps]
        return params[k]

    def forget(self) -> None:
        self._at_step = {}
        self._applied = []
