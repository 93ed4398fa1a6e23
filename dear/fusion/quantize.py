"""Block-wise quantization of a bucket's gradients, with error feedback.

A value is sent as a signed integer of `bits` bits (int8: -127..127, int4: -7..7) times its
block's scale, one fp32 scale per `block` consecutive values: scale = max|x| / qmax, so the
largest value of every block is exact and each value is off by at most scale / 2. What rounding
dropped (`x - q * scale`) is kept per rank as the residual and added to the next iteration's
gradient (error feedback), so nothing is lost, only delayed.

The definition, which the native kernels (csrc/quantize.cpp, csrc/cuda/quantize_kernels.cu)
reproduce bit for bit:

    y = x + residual                    (fp32; no residual: y = x)
    per block:  a = max |y|
                a not finite  -> scale = NaN, q = 0, residual = 0   (NaN travels: GradScaler
                                                                     sees a non-finite sum)
                else             scale = a / qmax   (fp32 division; 0 when a == 0, and also
                                                     when a <= 2**-149 * qmax / 2, a subnormal)
                scale == 0    -> q = 0              (so residual = y: all of it is delayed)
                else          -> q = clamp(round_half_even(y / scale), -qmax, qmax)
                finite a      -> residual = y - q * scale   (fp32; q the rounded float, whose
                                                     sign a zero keeps: y = -0.0 leaves +0.0)
    dequantized value = float(q) * scale

"Bit for bit" is up to a NaN's payload: a NaN stays a NaN, but its bits are the device's (a
GPU's arithmetic writes 0x7fffffff where the CPU passes an operand's NaN on).

int4 packs two values a byte, element 2i in the low nibble (two's complement), 2i + 1 in the
high one. This module is the reference: plain torch, any device, used where the extension is
not built.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import native as _native

QMAX = {8: 127, 4: 7}


def num_blocks(length: int, block: int) -> int:
    return -(-length // block)


def code_bytes(length: int, bits: int) -> int:
    """Bytes of the codes of `length` values."""
    return length if bits == 8 else -(-length // 2)


def _blocks(t: torch.Tensor, block: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Whole blocks as rows, and the last partial block (None if there is none)."""
    whole = t.numel() // block * block
    rows = t[:whole].view(-1, block)
    return rows, (t[whole:].view(1, -1) if whole < t.numel() else None)


def _quantize_rows(y: torch.Tensor, qmax: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes as float, scale per row, dequantized) of the rows of `y`."""
    amax = y.abs().amax(dim=1)
    finite = torch.isfinite(amax)
    # A tensor divisor: CUDA computes tensor / (Python number) as tensor * (1 / number), which
    # is not the fp32 division (nor the CPU's result) for some amax.
    scale = torch.where(finite, amax / torch.full_like(amax, qmax),
                        torch.full_like(amax, float("nan")))
    # scale > 0, not amax > 0: a subnormal amax <= 2**-149 * qmax / 2 gives scale 0, and y / 0
    # would make the code of a zero undefined and its residual NaN.
    used = finite & (scale > 0)
    safe = torch.where(used, scale, torch.ones_like(scale))
    q = torch.round(y / safe[:, None]).clamp_(-qmax, qmax)
    q = torch.where(used[:, None], q, torch.zeros_like(q))
    return q, scale, q * scale[:, None]


def quantize_reference(x: torch.Tensor, residual: Optional[torch.Tensor], codes: torch.Tensor,
                       scales: torch.Tensor, block: int, bits: int) -> None:
    """The definition above in plain torch: fills `codes` (int8 [n], or uint8 [ceil(n/2)] for
    int4) and `scales` (fp32 [ceil(n/block)]), updates `residual` in place."""
    qmax = QMAX[bits]
    y = x if residual is None else x + residual
    q_parts, s_parts = [], []
    for rows in _blocks(y, block):
        if rows is None:
            continue
        q, scale, deq = _quantize_rows(rows, qmax)
        q_parts.append(q.reshape(-1))
        s_parts.append(scale)
        if residual is not None:
            start = sum(p.numel() for p in q_parts[:-1])
            err = rows - deq
            err = torch.where(torch.isfinite(scale)[:, None], err, torch.zeros_like(err))
            residual[start:start + rows.numel()].copy_(err.reshape(-1))
    q_all = torch.cat(q_parts).to(torch.int8) if q_parts else torch.empty(0, dtype=torch.int8,
                                                                          device=x.device)
    scales.copy_(torch.cat(s_parts) if s_parts else scales)
    if bits == 8:
        codes.copy_(q_all)
        return
    nib = (q_all.to(torch.int16) & 0xF).to(torch.uint8)
    if nib.numel() % 2:
        nib = torch.cat([nib, nib.new_zeros(1)])
    pairs = nib.view(-1, 2)
    codes.copy_(pairs[:, 0] | (pairs[:, 1] << 4))


def _unpack(codes: torch.Tensor, length: int, bits: int) -> torch.Tensor:
    if bits == 8:
        return codes.view(torch.int8)[:length].to(torch.float32)
    low = (codes & 0xF).to(torch.int16)
    high = (codes >> 4).to(torch.int16)
    both = torch.stack([low, high], dim=1).reshape(-1)[:length]
    return torch.where(both > 7, both - 16, both).to(torch.float32)


def dequantize_reference(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                         block: int, bits: int, accumulate: bool) -> None:
    """out = float(q) * scale (accumulate: out += that), for out.numel() values."""
    n = out.numel()
    q = _unpack(codes, n, bits)
    per = scales.repeat_interleave(block)[:n] if n else scales[:0]
    value = q * per
    if accumulate:
        out.add_(value)
    else:
        out.copy_(value)


def quantize(x: torch.Tensor, residual: Optional[torch.Tensor], codes: torch.Tensor,
             scales: torch.Tensor, block: int, bits: int) -> None:
    """quantize_reference's result, by the native kernel where it is built."""
    ext = _native.extension()
    kernel = getattr(ext, "quantize_blocks", None)
    if kernel is not None:
        kernel(x, residual, codes, scales, block, bits)
    else:
        quantize_reference(x, residual, codes, scales, block, bits)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int,
               bits: int, accumulate: bool) -> None:
    ext = _native.extension()
    kernel = getattr(ext, "dequantize_blocks", None)
    if kernel is not None:
        kernel(codes, scales, out, block, bits, accumulate)
    else:
        dequantize_reference(codes, scales, out, block, bits, accumulate)
