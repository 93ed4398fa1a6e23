// CUDA versions of the bucket pack/unpack (csrc/cuda/pack_kernels.cu).
// Each call issues one small host-to-device copy of a segment table and one kernel on the
// caller's current stream, whatever the number of parameters in the bucket.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "../grad_ready.h"

namespace dear {
namespace cuda {

void pack_bucket(const at::Tensor& buffer, const BucketLayout& layout,
                 const std::vector<at::Tensor>& grads, const std::vector<double>& used);

void unpack_into(const at::Tensor& buffer, const BucketLayout& layout,
                 const std::vector<at::Tensor>& outs);

}  // namespace cuda
}  // namespace dear
