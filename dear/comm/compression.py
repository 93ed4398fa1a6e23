"""Gradient compression on the wire, with Horovod's names (`dear.Compression.fp16`).

DeAR communicates whole buckets, so compression is a wire dtype per bucket: fp32/fp64 buckets
travel as fp16 in both the reduce-scatter and the all-gather (half the bytes each way), and are
averaged in their own dtype in between. Horovod's own `hvd.Compression.none/fp16` are accepted.
"""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    name = "none"

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def __repr__(self) -> str:
        return f"dear.Compression.{self.name}"


class FP16Compressor(Compressor):
    name = "fp16"

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float16 if dtype in (torch.float32, torch.float64) else dtype


class Compression:
    """Namespace like hvd.Compression."""

    none: Compressor = Compressor()
    fp16: Compressor = FP16Compressor()


def resolve(compression: Any) -> Compressor:
    """dear's compressors as they are; Horovod's (classes with compress/decompress) by name."""
    if isinstance(compression, Compressor):
        return compression
    name = getattr(compression, "__name__", type(compression).__name__)
    if name == "NoneCompressor":
        return Compression.none
    if name == "FP16Compressor":
        return Compression.fp16
    raise TypeError(f"unsupported compression {compression!r}: use dear.Compression.none or "
                    "dear.Compression.fp16 (Horovod's hvd.Compression.none/fp16 work too)")
