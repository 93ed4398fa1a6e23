"""Gradient compression on the wire, with Horovod's names (`dear.Compression.fp16`).

DeAR communicates whole buckets, so compression is decided per bucket:
- fp16: fp32/fp64 buckets travel as fp16 in both the reduce-scatter and the all-gather (half
  the bytes each way), and are averaged in their own dtype in between. No error correction.
- int8 / int4 (`Compression.quantized(...)` for other settings): fp32 buckets travel as
  block-quantized integers with one fp32 scale per block, summed in fp32 by each shard's owner,
  and what rounding dropped is added to the next iteration's gradient (error feedback,
  dear/fusion/quantized.py). A quarter (an eighth) of the bytes, plus the scales.
Horovod's own `hvd.Compression.none/fp16` are accepted.
"""

from __future__ import annotations

from typing import Any

import torch

#: the key of a quantizing optimizer's error-feedback residuals in its state_dict(): this
#: rank's own, never another rank's (dear/engine/feedback.py)
ERROR_FEEDBACK_KEY = "dear_error_feedback"


class Compressor:
    name = "none"
    #: block-quantized buckets (dear/fusion/quantized.py) instead of a wire dtype
    quantizes = False

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def __repr__(self) -> str:
        return f"dear.Compression.{self.name}"


class FP16Compressor(Compressor):
    name = "fp16"

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float16 if dtype in (torch.float32, torch.float64) else dtype


class QuantizedCompressor(Compressor):
    """`bits` 8 or 4; one fp32 scale per `block_size` values; the first `warmup_steps`
    optimizer steps travel in fp32 (as 1-bit Adam's warm-up); `error_feedback=False` drops the
    residuals (to measure what they buy: the default keeps them)."""

    quantizes = True

    def __init__(self, bits: int = 8, block_size: int = 256, warmup_steps: int = 0,
                 error_feedback: bool = True) -> None:
        if bits not in (8, 4):
            raise ValueError(f"quantized compression takes bits=8 or bits=4, got {bits!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        self.bits, self.block_size = bits, block_size
        self.warmup_steps, self.error_feedback = warmup_steps, bool(error_feedback)
        self.name = f"int{bits}"

    def __repr__(self) -> str:
        return (f"dear.Compression.quantized(bits={self.bits}, block_size={self.block_size}, "
                f"warmup_steps={self.warmup_steps}, error_feedback={self.error_feedback})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, QuantizedCompressor) and repr(self) == repr(other)

    def __hash__(self) -> int:
        return hash(repr(self))


class Compression:
    """Namespace like hvd.Compression, plus dear's quantized ones."""

    none: Compressor = Compressor()
    fp16: Compressor = FP16Compressor()
    int8: Compressor = QuantizedCompressor(bits=8, block_size=256)
    int4: Compressor = QuantizedCompressor(bits=4, block_size=128)

    @staticmethod
    def quantized(bits: int = 8, block_size: int = 256, warmup_steps: int = 0,
                  error_feedback: bool = True) -> Compressor:
        return QuantizedCompressor(bits, block_size, warmup_steps, error_feedback)


def resolve(compression: Any) -> Compressor:
    """dear's compressors as they are; Horovod's (classes with compress/decompress) by name."""
    if isinstance(compression, Compressor):
        return compression
    name = getattr(compression, "__name__", type(compression).__name__)
    if name == "NoneCompressor":
        return Compression.none
    if name == "FP16Compressor":
        return Compression.fp16
    raise TypeError(f"unsupported compression {compression!r}: use dear.Compression.none, "
                    ".fp16, .int8, .int4 or .quantized(...) (Horovod's hvd.Compression.none/"
                    "fp16 work too)")
