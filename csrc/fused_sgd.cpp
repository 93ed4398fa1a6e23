#include "fused_sgd.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/util/Exception.h>

#ifdef DEAR_WITH_CUDA
#include "cuda/pack_cuda.h"
#endif

namespace dear {
namespace {

void check_inputs(const std::vector<at::Tensor>& params,
                  const std::vector<at::Tensor>& momentum_buffers, const at::Tensor& buffer,
                  const std::vector<int64_t>& offsets, const std::vector<bool>& used,
                  const SgdHyper& hyper) {
  TORCH_CHECK(params.size() == offsets.size() && params.size() == used.size(),
              "dear: fused_sgd_update needs one offset and one usage flag per parameter");
  TORCH_CHECK(hyper.momentum == 0.0 || momentum_buffers.size() == params.size(),
              "dear: fused_sgd_update with momentum needs one momentum buffer per parameter");
  TORCH_CHECK(!hyper.nesterov || (hyper.momentum > 0.0 && hyper.dampening == 0.0),
              "dear: Nesterov momentum requires a momentum and zero dampening (as torch.optim.SGD)");
  TORCH_CHECK(buffer.dim() == 1 && buffer.is_contiguous(),
              "dear: fused_sgd_update needs a flat contiguous bucket buffer");
  for (size_t j = 0; j < params.size(); ++j) {
    const at::Tensor& p = params[j];
    TORCH_CHECK(p.is_contiguous() && p.scalar_type() == buffer.scalar_type() &&
                    p.device() == buffer.device(),
                "dear: fused_sgd_update: parameter ", j,
                " must be contiguous, with the bucket's dtype and device");
    TORCH_CHECK(offsets[j] >= 0 && offsets[j] + p.numel() <= buffer.numel(),
                "dear: fused_sgd_update: parameter ", j, " lies outside the buffer");
    if (hyper.momentum != 0.0) {
      const at::Tensor& m = momentum_buffers[j];
      TORCH_CHECK(m.is_contiguous() && m.numel() == p.numel() &&
                      m.scalar_type() == p.scalar_type() && m.device() == p.device(),
                  "dear: fused_sgd_update: momentum buffer ", j, " must match its parameter");
    }
  }
}

void fused_sgd_cpu(const std::vector<at::Tensor>& params,
                   const std::vector<at::Tensor>& momentum_buffers, const at::Tensor& buffer,
                   const std::vector<int64_t>& offsets, const std::vector<bool>& used,
                   const SgdHyper& hyper, bool first_step) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, buffer.scalar_type(), "dear_sgd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* grads = buffer.const_data_ptr<scalar_t>();
    for (size_t j = 0; j < params.size(); ++j) {
      if (!used[j]) continue;
      scalar_t* p = params[j].data_ptr<scalar_t>();
      scalar_t* m = hyper.momentum != 0.0 ? momentum_buffers[j].data_ptr<scalar_t>() : nullptr;
      const scalar_t* g = grads + offsets[j];
      const int64_t n = params[j].numel();
      for (int64_t i = 0; i < n; ++i) {
        acc_t param = static_cast<acc_t>(p[i]);
        acc_t buf = m != nullptr ? static_cast<acc_t>(m[i]) : acc_t(0);
        sgd_element<acc_t>(param, buf, static_cast<acc_t>(g[i]), hyper, first_step);
        p[i] = static_cast<scalar_t>(param);
        if (m != nullptr) m[i] = static_cast<scalar_t>(buf);
      }
    }
  });
}

}  // namespace

void fused_sgd_update(const std::vector<at::Tensor>& params,
                      const std::vector<at::Tensor>& momentum_buffers, const at::Tensor& buffer,
                      const std::vector<int64_t>& offsets, const std::vector<bool>& used,
                      const SgdHyper& hyper, bool first_step) {
  check_inputs(params, momentum_buffers, buffer, offsets, used, hyper);
  if (buffer.device().is_cpu()) {
    fused_sgd_cpu(params, momentum_buffers, buffer, offsets, used, hyper, first_step);
    return;
  }
#ifdef DEAR_WITH_CUDA
  if (buffer.device().is_cuda()) {
    cuda::fused_sgd_update(params, momentum_buffers, buffer, offsets, used, hyper, first_step);
    return;
  }
#endif
  TORCH_CHECK(false, "dear: fused_sgd_update has no kernel for device ", buffer.device(),
              " in this build");
}

}  // namespace dear
