// Content digests of CUDA tensors (csrc/cuda/digest_kernels.cu): digest.h's portable hash
// (MurmurHash3's finalizer of each 32-bit word, keyed by its position, summed mod 2^64), so a
// CUDA tensor's digest equals that of its bytes on the CPU with `portable`. One call digests
// any number of tensors with one kernel, on the current stream, without waiting for the GPU.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace dear {
namespace cuda {

// A 1-D int64 tensor on the tensors' device (all on one): element k is the digest of tensor k's
// elements in memory order (a copy first where they are not dense).
at::Tensor digests(const std::vector<at::Tensor>& tensors);

}  // namespace cuda
}  // namespace dear
