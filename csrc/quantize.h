// Block-wise int8/int4 quantization with error feedback: the definition in
// dear/fusion/quantize.py (its module docstring), reproduced bit for bit on the CPU
// (csrc/quantize.cpp) and on CUDA (csrc/cuda/quantize_kernels.cu).
//
// Per block of `block` consecutive values: y = x + residual, a = max|y|; a not finite: scale NaN,
// codes 0, residual 0; else scale = a / qmax (fp32 division), and where scale > 0
// q = clamp(round_half_even(y / scale), -qmax, qmax) (else q = 0), residual = y - q * scale.
// qmax is 127 for bits 8 (codes int8, one a value) and 7 for bits 4 (codes uint8, two a byte:
// value 2i in the low nibble, 2i + 1 in the high one, two's complement; an odd last value leaves
// the high nibble 0). The arithmetic is fp32, each operation rounded once: the file is compiled
// with -ffp-contract=off (setup.py) so that no multiply and add fuse, and the CUDA kernels use the
// _rn intrinsics, which nvcc never fuses.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace dear {

// x: fp32, 1-D, contiguous, n values (a view: its storage offset is honoured). residual: none,
// or fp32 [n], contiguous, not overlapping x, updated in place. codes: int8 [n] (bits 8) or
// uint8 [ceil(n / 2)] (bits 4). scales: fp32 [ceil(n / block)]. All on one device (CPU, or CUDA
// where the extension was built with it); on CUDA the kernel runs on the current stream.
void quantize_blocks(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                     const at::Tensor& codes, const at::Tensor& scales, int64_t block,
                     int64_t bits);

// For i < out.numel(): v = float(q_i) * scales[i / block]; out[i] = v, or out[i] += v where
// `accumulate`. codes and scales as quantize_blocks wrote them for out.numel() values.
void dequantize_blocks(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& out,
                       int64_t block, int64_t bits, bool accumulate);

}  // namespace dear
