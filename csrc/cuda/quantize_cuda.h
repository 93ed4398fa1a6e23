// CUDA versions of the block-wise quantization (csrc/cuda/quantize_kernels.cu): the definition of
// csrc/quantize.h and dear/fusion/quantize.py, bit for bit. Each call queues one kernel on the
// caller's current stream and does not wait for the GPU.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace dear {
namespace cuda {

// The arguments as dear::quantize_blocks checked them (csrc/quantize.cpp), all on one CUDA
// device, at least one value; `residual` undefined: none.
void quantize_blocks(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& codes,
                     const at::Tensor& scales, int64_t block, int64_t bits);

void dequantize_blocks(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& out,
                       int64_t block, int64_t bits, bool accumulate);

}  // namespace cuda
}  // namespace dear
