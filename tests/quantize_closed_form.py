"""Block quantization written out in numpy from its definition, with no code of dear's: the
independent reference for dear/fusion/quantize.py's reference, the native kernels and the
quantized training tests.

Per block of `block` consecutive values of y = x + residual (float32 throughout):
scale = max|y| / qmax (qmax 127 for int8, 7 for int4; a float32 division), q = clip(rint(y /
scale), -qmax, qmax) (numpy's rint rounds half to even), dequantized = q * scale, new residual
= y - q * scale. A block whose maximum is not finite sends scale NaN and codes 0 and keeps a
zero residual; a block whose scale is 0 (all zeros, or a maximum so small that the division
underflows) sends codes 0 and keeps all of y. q stays a float until the residual, so a value
rounded to zero keeps its sign there (y = -0.0 leaves +0.0, as -0.0 - (-0.0)). int4 codes go two
a byte, element 2i in the low nibble, two's complement.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

QMAX = {8: 127, 4: 7}


def _blocks(v: np.ndarray, block: int) -> np.ndarray:
    """v as rows of `block`, the last one padded with zeros (a zero changes no maximum)."""
    rows = -(-v.size // block)
    out = np.zeros(rows * block, dtype=np.float32)
    out[:v.size] = v
    return out.reshape(rows, block)


def quantize(x: np.ndarray, residual: Optional[np.ndarray], block: int, bits: int
             ) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """(q as float32 values, one scale per block, new residual or None) of x (float32, 1-D)."""
    qmax = np.float32(QMAX[bits])
    x = np.asarray(x, dtype=np.float32)
    n = x.size
    y = x if residual is None else x + np.asarray(residual, dtype=np.float32)
    rows = _blocks(y, block)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore", under="ignore"):
        amax = np.abs(rows).max(axis=1) if n else np.zeros(0, dtype=np.float32)
        finite = np.isfinite(amax)
        scale = np.where(finite, amax / qmax, np.float32(np.nan)).astype(np.float32)
        used = finite & (scale > 0)
        safe = np.where(used, scale, np.float32(1.0)).astype(np.float32)
        q = np.clip(np.rint(rows / safe[:, None]), -qmax, qmax).astype(np.float32)
        q[~used] = np.float32(0.0)
        new = None
        if residual is not None:
            err = (rows - q * scale[:, None]).astype(np.float32)
            err[~finite] = np.float32(0.0)
            new = err.reshape(-1)[:n]
    return q.reshape(-1)[:n], scale, new


def dequantize(q: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray:
    """q * its block's scale, float32."""
    per = np.repeat(np.asarray(scales, dtype=np.float32), block)[:q.size]
    with np.errstate(invalid="ignore", over="ignore"):
        return (np.asarray(q, dtype=np.float32) * per).astype(np.float32)


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """The codes' bytes: int8 for bits 8, uint8 nibble pairs for bits 4."""
    ints = np.asarray(q).astype(np.int64)
    if bits == 8:
        return ints.astype(np.int8)
    nib = (ints & 0xF).astype(np.uint8)
    if nib.size % 2:
        nib = np.concatenate([nib, np.zeros(1, dtype=np.uint8)])
    return (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8)


def unpack(codes: np.ndarray, n: int, bits: int) -> np.ndarray:
    """The n codes as float32 integers (int4: nibbles as two's complement)."""
    if bits == 8:
        return np.asarray(codes).view(np.int8)[:n].astype(np.float32)
    b = np.asarray(codes).view(np.uint8).astype(np.int64)
    both = np.stack([b & 0xF, b >> 4], axis=1).reshape(-1)[:n]
    return np.where(both > 7, both - 16, both).astype(np.float32)


def round_trip(x: np.ndarray, residual: Optional[np.ndarray], block: int, bits: int
               ) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """(what the receiver dequantizes, the sender's new residual) for x sent once."""
    q, scales, new = quantize(x, residual, block, bits)
    return dequantize(q, scales, block), new
