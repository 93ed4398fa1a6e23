#include "pack_cuda.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "device_table.h"

namespace dear {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocksX = 1024;
constexpr int64_t kMaxBlocksY = 65535;

// One contiguous run of elements: copied from `src`, or filled with `fill` where src is null.
struct Segment {
  const void* src;
  void* dst;
  int64_t numel;
  double fill;
};

template <typename scalar_t>
__global__ void segments_kernel(const Segment* segments, int64_t num_segments) {
  for (int64_t s = blockIdx.y; s < num_segments; s += gridDim.y) {
    const Segment seg = segments[s];
    const scalar_t* src = static_cast<const scalar_t*>(seg.src);
    scalar_t* dst = static_cast<scalar_t*>(seg.dst);
    const scalar_t fill = static_cast<scalar_t>(seg.fill);
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < seg.numel;
         i += stride) {
      dst[i] = src != nullptr ? src[i] : fill;
    }
  }
}

dim3 grid_for(int64_t max_numel, size_t num_segments) {
  const int64_t x = std::max<int64_t>(1, std::min(kMaxBlocksX, (max_numel + kThreads - 1) / kThreads));
  const int64_t y = std::max<int64_t>(1, std::min<int64_t>(kMaxBlocksY, num_segments));
  return dim3(static_cast<unsigned>(x), static_cast<unsigned>(y));
}

void run_segments(const at::Tensor& like, const std::vector<Segment>& segments) {
  if (segments.empty()) return;
  int64_t max_numel = 0;
  for (const auto& s : segments) max_numel = std::max(max_numel, s.numel);
  const c10::cuda::CUDAGuard guard(like.device());
  at::Tensor table = table_on_device(segments, like.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_AND_COMPLEX_TYPES_AND2(
      at::kHalf, at::kBFloat16, like.scalar_type(), "dear_segments", [&] {
        segments_kernel<scalar_t><<<grid_for(max_numel, segments.size()), kThreads, 0, stream>>>(
            reinterpret_cast<const Segment*>(table.const_data_ptr()),
            static_cast<int64_t>(segments.size()));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

bool kernel_copyable(const at::Tensor& t, const at::Tensor& buffer) {
  return t.device() == buffer.device() && t.scalar_type() == buffer.scalar_type() &&
         t.layout() == at::kStrided && t.is_contiguous() && !t.is_conj() && !t.is_neg();
}

}  // namespace

void pack_bucket(const at::Tensor& buffer, const BucketLayout& layout,
                 const std::vector<at::Tensor>& grads, const std::vector<double>& used) {
  char* base = static_cast<char*>(buffer.data_ptr());
  const int64_t esize = buffer.element_size();
  std::vector<Segment> segments;
  segments.reserve(2 * layout.size() + 1);
  for (int64_t j = 0; j < layout.size(); ++j) {
    const at::Tensor& grad = grads[j];
    void* dst = base + layout.offsets[j] * esize;
    if (!grad.defined()) {
      segments.push_back({nullptr, dst, layout.numels[j], 0.0});
    } else if (kernel_copyable(grad, buffer)) {
      segments.push_back({grad.const_data_ptr(), dst, layout.numels[j], 0.0});
    } else {  // another dtype, layout or device: ATen's copy, on the same stream
      buffer.narrow(0, layout.offsets[j], layout.numels[j]).view(grad.sizes()).copy_(grad);
    }
  }
  for (int64_t j = 0; j < layout.size(); ++j) {
    segments.push_back({nullptr, base + (layout.flags_offset + j) * esize, 1, used[j]});
  }
  const int64_t tail = layout.flags_offset + layout.size();
  if (buffer.numel() > tail) segments.push_back({nullptr, base + tail * esize, buffer.numel() - tail, 0.0});
  run_segments(buffer, segments);
}

void unpack_into(const at::Tensor& buffer, const BucketLayout& layout,
                 const std::vector<at::Tensor>& outs) {
  const char* base = static_cast<const char*>(buffer.const_data_ptr());
  const int64_t esize = buffer.element_size();
  std::vector<Segment> segments;
  for (int64_t j = 0; j < layout.size(); ++j) {
    const at::Tensor& out = outs[j];
    TORCH_CHECK(out.numel() == layout.numels[j], "dear: unpack_into: output ", j, " has ",
                out.numel(), " elements, expected ", layout.numels[j]);
    if (kernel_copyable(out, buffer)) {
      segments.push_back({base + layout.offsets[j] * esize, out.data_ptr(), layout.numels[j], 0.0});
    } else {
      out.copy_(buffer.narrow(0, layout.offsets[j], layout.numels[j]).view(out.sizes()));
    }
  }
  run_segments(buffer, segments);
}

}  // namespace cuda
}  // namespace dear
