// SGD with momentum applied straight from a gathered bucket buffer: one pass over each
// parameter reads its averaged gradient from the buffer, updates the momentum buffer and the
// parameter, instead of installing .grad views and running torch.optim.SGD op by op.
//
// The element rule is torch.optim.SGD's (weight decay, dampening, Nesterov, maximize; the first
// step copies the gradient into the momentum buffer). It is compiled for the host and, in the
// CUDA build, for the device, so the CPU tests check the arithmetic the kernel runs.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#if defined(__CUDACC__)
#define DEAR_HOST_DEVICE __host__ __device__
#else
#define DEAR_HOST_DEVICE
#endif

namespace dear {

struct SgdHyper {
  double lr = 0.0;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool maximize = false;
};

// acc_t: the type the arithmetic runs in (float for half and bfloat16 parameters).
template <typename acc_t>
DEAR_HOST_DEVICE inline void sgd_element(acc_t& param, acc_t& momentum_buf, acc_t grad,
                                         const SgdHyper& h, bool first_step) {
  if (h.maximize) grad = -grad;
  if (h.weight_decay != 0.0) grad = grad + static_cast<acc_t>(h.weight_decay) * param;
  if (h.momentum != 0.0) {
    const acc_t m = static_cast<acc_t>(h.momentum);
    momentum_buf = first_step
                       ? grad
                       : m * momentum_buf + static_cast<acc_t>(1.0 - h.dampening) * grad;
    grad = h.nesterov ? grad + m * momentum_buf : momentum_buf;
  }
  param = param - static_cast<acc_t>(h.lr) * grad;
}

// Update params[j] (and momentum_buffers[j] when momentum != 0) from the averaged gradient at
// offsets[j] of `buffer`. Parameters whose usage flag is false (no rank produced a gradient)
// are left alone, as torch.optim.SGD leaves a parameter whose .grad is None.
void fused_sgd_update(const std::vector<at::Tensor>& params,
                      const std::vector<at::Tensor>& momentum_buffers, const at::Tensor& buffer,
                      const std::vector<int64_t>& offsets, const std::vector<bool>& used,
                      const SgdHyper& hyper, bool first_step);

}  // namespace dear
