"""dear's native path: the C++/CUDA extension built from csrc/ (`dear._native`), if any.

The extension keeps the per-iteration hot path out of Python (gradient-ready bookkeeping per
bucket, multi-tensor pack and unpack; on CUDA builds also kernels, a fused SGD update and an NCCL
communicator). It is optional: where it was not built (no compiler, pip's build isolation hid
torch, a build error) every function here falls back to plain torch and gives the same bytes.
`DEAR_NATIVE=0` makes the buckets take the Python path even where the extension exists.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Optional, Sequence

import torch


def _load() -> tuple[Optional[ModuleType], Optional[str]]:
    try:
        return importlib.import_module("dear._native"), None
    except ImportError as exc:          # not built, or built against another torch
        return None, f"{type(exc).__name__}: {exc}"


_ext, _error = _load()


def native_available() -> bool:
    """Whether the C++ extension was built and loads with this torch."""
    return _ext is not None


def load_error() -> Optional[str]:
    """Why the extension is not available (None when it is)."""
    return _error


def extension() -> Optional[ModuleType]:
    return _ext


def build_info() -> dict[str, Any]:
    """What the loaded extension contains: {"available", "cuda", "nccl", ...}."""
    if _ext is None:
        return {"available": False, "cuda": False, "nccl": False, "error": _error}
    return {"available": True, **_ext.build_info()}


def enabled(wanted: bool = True) -> bool:
    """Whether new buckets use the extension: it is available and `wanted` (the caller passes
    DEAR_NATIVE: this module imports nothing of dear's, so anything may import it)."""
    return _ext is not None and wanted


def grad_ready(buffer: torch.Tensor, offsets: Sequence[int], numels: Sequence[int],
               flags_offset: int, sparse_as_dense: bool) -> Any:
    """The C++ bookkeeping of one bucket (see csrc/grad_ready.h); needs the extension."""
    if _ext is None:
        raise RuntimeError(f"dear's native extension is not available ({_error})")
    return _ext.GradReady(buffer, list(offsets), list(numels), flags_offset, sparse_as_dense)


# --------------------------------------------------------------- functions with a fallback
def pack_bucket(buffer: torch.Tensor, offsets: Sequence[int], numels: Sequence[int],
                flags_offset: int, grads: Sequence[Optional[torch.Tensor]],
                used: Sequence[float]) -> None:
    """Write grads (None: zeros) at their offsets, the usage flags after them, zero padding."""
    if _ext is not None:
        _ext.pack_bucket(buffer, list(offsets), list(numels), flags_offset, list(grads),
                         [float(u) for u in used])
        return
    with torch.no_grad():
        for off, n, grad in zip(offsets, numels, grads):
            view = buffer[off:off + n]
            if grad is None:
                view.zero_()
            else:
                view.view(grad.shape).copy_(grad)
        buffer[flags_offset:flags_offset + len(used)].copy_(
            torch.tensor([float(u) for u in used], dtype=buffer.dtype))
        buffer[flags_offset + len(used):].zero_()


def unpack_into(buffer: torch.Tensor, offsets: Sequence[int], numels: Sequence[int],
                flags_offset: int, outs: Sequence[torch.Tensor]) -> None:
    """Copy each parameter's slice of a gathered buffer into outs[j] (e.g. its .grad)."""
    if _ext is not None:
        _ext.unpack_into(buffer, list(offsets), list(numels), flags_offset, list(outs))
        return
    with torch.no_grad():
        for off, n, out in zip(offsets, numels, outs):
            out.copy_(buffer[off:off + n].view(out.shape))


__all__ = ["build_info", "enabled", "extension", "grad_ready", "load_error",
           "native_available", "pack_bucket", "unpack_into"]
