#include "pack.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>

#include <cstring>

#ifdef DEAR_WITH_CUDA
#include "cuda/pack_cuda.h"
#endif

namespace dear {
namespace {

bool plain_copy(const at::Tensor& src, const at::Tensor& dst) {
  return src.device() == dst.device() && src.scalar_type() == dst.scalar_type() &&
         src.layout() == at::kStrided && src.is_contiguous() && !src.is_conj() && !src.is_neg();
}

void check_grad(const at::Tensor& grad, const BucketLayout& layout, int64_t j) {
  TORCH_CHECK(grad.numel() == layout.numels[j], "dear: the gradient of parameter ", j,
              " of this bucket has ", grad.numel(), " elements, but the parameter has ",
              layout.numels[j], "; a gradient must have its parameter's shape");
}

void write_flags_cpu(const at::Tensor& buffer, int64_t flags_offset,
                     const std::vector<double>& used) {
  AT_DISPATCH_FLOATING_AND_COMPLEX_TYPES_AND2(
      at::kHalf, at::kBFloat16, buffer.scalar_type(), "dear_write_flags", [&] {
        scalar_t* flags = buffer.data_ptr<scalar_t>() + flags_offset;
        for (size_t j = 0; j < used.size(); ++j) flags[j] = static_cast<scalar_t>(used[j]);
      });
}

std::vector<bool> read_flags_cpu(const at::Tensor& buffer, int64_t flags_offset, int64_t n) {
  std::vector<bool> out(n);
  AT_DISPATCH_FLOATING_AND_COMPLEX_TYPES_AND2(
      at::kHalf, at::kBFloat16, buffer.scalar_type(), "dear_read_flags", [&] {
        const scalar_t* flags = buffer.const_data_ptr<scalar_t>() + flags_offset;
        for (int64_t j = 0; j < n; ++j) out[j] = flags[j] != static_cast<scalar_t>(0);
      });
  return out;
}

void pack_bucket_cpu(const at::Tensor& buffer, const BucketLayout& layout,
                     const std::vector<at::Tensor>& grads, const std::vector<double>& used) {
  char* base = static_cast<char*>(buffer.data_ptr());
  const size_t esize = buffer.element_size();
  for (int64_t j = 0; j < layout.size(); ++j) {
    const at::Tensor& grad = grads[j];
    const int64_t off = layout.offsets[j], n = layout.numels[j];
    if (!grad.defined()) {
      std::memset(base + off * esize, 0, n * esize);
    } else if (plain_copy(grad, buffer)) {
      std::memcpy(base + off * esize, grad.const_data_ptr(), n * esize);
    } else {
      buffer.narrow(0, off, n).view(grad.sizes()).copy_(grad);
    }
  }
  write_flags_cpu(buffer, layout.flags_offset, used);
  const int64_t tail = layout.flags_offset + layout.size();
  std::memset(base + tail * esize, 0, (buffer.numel() - tail) * esize);
}

// Any device, one ATen op per parameter: the fallback where no kernel of ours applies.
void pack_bucket_generic(const at::Tensor& buffer, const BucketLayout& layout,
                         const std::vector<at::Tensor>& grads, const std::vector<double>& used) {
  for (int64_t j = 0; j < layout.size(); ++j) {
    at::Tensor view = buffer.narrow(0, layout.offsets[j], layout.numels[j]);
    if (grads[j].defined()) {
      view.view(grads[j].sizes()).copy_(grads[j]);
    } else {
      view.zero_();
    }
  }
  auto flags = at::tensor(used, at::TensorOptions().dtype(at::kDouble));
  buffer.narrow(0, layout.flags_offset, layout.size()).copy_(flags);
  const int64_t tail = layout.flags_offset + layout.size();
  buffer.narrow(0, tail, buffer.numel() - tail).zero_();
}

}  // namespace

void check_buffer(const at::Tensor& buffer, const BucketLayout& layout, const char* what) {
  TORCH_CHECK(buffer.defined() && buffer.dim() == 1 && buffer.is_contiguous(), "dear: ", what,
              " needs a flat contiguous bucket buffer");
  TORCH_CHECK(layout.numels.size() == layout.offsets.size(), "dear: ", what,
              ": offsets and numels differ in length");
  for (int64_t j = 0; j < layout.size(); ++j) {
    TORCH_CHECK(layout.offsets[j] >= 0 && layout.numels[j] >= 0 &&
                    layout.offsets[j] + layout.numels[j] <= layout.flags_offset,
                "dear: ", what, ": parameter ", j, " does not fit before the usage flags");
  }
  TORCH_CHECK(layout.flags_offset + layout.size() <= buffer.numel(), "dear: ", what,
              ": the buffer (", buffer.numel(), " elements) is too small for its layout");
}

void pack_bucket(const at::Tensor& buffer, const BucketLayout& layout,
                 const std::vector<at::Tensor>& grads, const std::vector<double>& used) {
  TORCH_CHECK(static_cast<int64_t>(grads.size()) == layout.size() &&
                  static_cast<int64_t>(used.size()) == layout.size(),
              "dear: pack_bucket needs one gradient and one flag per parameter");
  for (int64_t j = 0; j < layout.size(); ++j) {
    if (grads[j].defined()) check_grad(grads[j], layout, j);
  }
  if (buffer.device().is_cpu()) {
    pack_bucket_cpu(buffer, layout, grads, used);
#ifdef DEAR_WITH_CUDA
  } else if (buffer.device().is_cuda()) {
    cuda::pack_bucket(buffer, layout, grads, used);
#endif
  } else {
    pack_bucket_generic(buffer, layout, grads, used);
  }
}

void finalize_for_wire(const at::Tensor& buffer, const at::Tensor& wire, double prescale) {
  if (prescale != 1.0) buffer.mul_(prescale);
  if (!wire.is_same(buffer)) wire.copy_(buffer);
}

std::vector<bool> unpack_bucket(const at::Tensor& wire, const at::Tensor& buffer,
                                int64_t flags_offset, int64_t num_params) {
  TORCH_CHECK(flags_offset >= 0 && flags_offset + num_params <= buffer.numel(),
              "dear: unpack_bucket: the usage flags lie outside the buffer");
  if (!wire.is_same(buffer)) buffer.copy_(wire);
  if (buffer.device().is_cpu()) return read_flags_cpu(buffer, flags_offset, num_params);
  at::Tensor nonzero = buffer.narrow(0, flags_offset, num_params).ne(0).to(at::kCPU);
  const bool* flags = nonzero.const_data_ptr<bool>();
  return std::vector<bool>(flags, flags + num_params);
}

std::vector<at::Tensor> grad_views(const at::Tensor& buffer, const BucketLayout& layout,
                                   const std::vector<std::vector<int64_t>>& shapes) {
  check_buffer(buffer, layout, "grad_views");
  TORCH_CHECK(static_cast<int64_t>(shapes.size()) == layout.size(),
              "dear: grad_views needs one shape per parameter");
  std::vector<at::Tensor> views;
  views.reserve(shapes.size());
  for (int64_t j = 0; j < layout.size(); ++j) {
    views.push_back(buffer.narrow(0, layout.offsets[j], layout.numels[j]).view(shapes[j]));
  }
  return views;
}

void unpack_into(const at::Tensor& buffer, const BucketLayout& layout,
                 const std::vector<at::Tensor>& outs) {
  check_buffer(buffer, layout, "unpack_into");
  TORCH_CHECK(static_cast<int64_t>(outs.size()) == layout.size(),
              "dear: unpack_into needs one output tensor per parameter");
#ifdef DEAR_WITH_CUDA
  if (buffer.device().is_cuda()) {
    cuda::unpack_into(buffer, layout, outs);
    return;
  }
#endif
  const char* base = static_cast<const char*>(buffer.const_data_ptr());
  const size_t esize = buffer.element_size();
  for (int64_t j = 0; j < layout.size(); ++j) {
    const at::Tensor& out = outs[j];
    check_grad(out, layout, j);
    const int64_t off = layout.offsets[j], n = layout.numels[j];
    if (buffer.device().is_cpu() && plain_copy(out, buffer)) {
      std::memcpy(out.data_ptr(), base + off * esize, n * esize);
    } else {
      out.copy_(buffer.narrow(0, off, n).view(out.sizes()));
    }
  }
}

}  // namespace dear
