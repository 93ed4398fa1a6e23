#include "digest_cuda.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "../word_hash.h"
#include "device_table.h"

namespace dear {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunkWords = int64_t{1} << 16;  // 256 KB of one tensor per block

// Words [begin, end) of the tensor whose `nbytes` bytes start at `data`; the sum goes to
// out[index].
struct Chunk {
  const unsigned char* data;
  int64_t nbytes;
  int64_t begin;
  int64_t end;
  int64_t index;
};

// Word i, little-endian; the 0-3 bytes past the last whole word zero-padded (digest.cpp's
// hashed_words). A tensor need not start on a 4-byte boundary (a bf16 or int8 slice).
__device__ __forceinline__ uint32_t word_at(const unsigned char* data, int64_t nbytes, int64_t i,
                                            bool aligned) {
  const int64_t at = 4 * i;
  if (aligned && at + 4 <= nbytes) return reinterpret_cast<const uint32_t*>(data)[i];
  uint32_t w = 0;
  for (int b = 0; b < 4 && at + b < nbytes; ++b) {
    w |= static_cast<uint32_t>(data[at + b]) << (8 * b);
  }
  return w;
}

__global__ void digest_kernel(const Chunk* chunks, unsigned long long* out) {
  const Chunk c = chunks[blockIdx.x];
  const bool aligned = (reinterpret_cast<uintptr_t>(c.data) & 3u) == 0;
  unsigned long long sum = 0;
  for (int64_t i = c.begin + threadIdx.x; i < c.end; i += blockDim.x) {
    const uint32_t w = word_at(c.data, c.nbytes, i, aligned);
    sum += word_term(w, static_cast<uint64_t>(i));
  }
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, offset);
  __shared__ unsigned long long warp_sums[kThreads / 32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = sum;
  __syncthreads();
  if (warp == 0) {
    sum = lane < kThreads / 32 ? warp_sums[lane] : 0ull;
    for (int offset = 16; offset > 0; offset >>= 1) {
      sum += __shfl_down_sync(0xffffffffu, sum, offset);
    }
    if (lane == 0) atomicAdd(out + c.index, sum);  // wraps mod 2^64, as the CPU's sum
  }
}

}  // namespace

at::Tensor digests(const std::vector<at::Tensor>& tensors) {
  TORCH_CHECK(!tensors.empty(), "dear: digests_cuda() needs at least one tensor");
  const at::Device device = tensors[0].device();
  const c10::cuda::CUDAGuard guard(device);
  c10::AutoGradMode no_grad(false);  // a parameter's dense copy needs no autograd history
  std::vector<at::Tensor> dense;     // alive until the kernel is queued (the same stream)
  dense.reserve(tensors.size());
  std::vector<Chunk> chunks;
  for (size_t k = 0; k < tensors.size(); ++k) {
    const at::Tensor& t = tensors[k];
    TORCH_CHECK(t.defined() && t.device() == device && t.layout() == at::kStrided,
                "dear: digests_cuda() takes dense tensors on one CUDA device (", device,
                "), got ", t.defined() ? t.toString() : std::string("an undefined tensor"),
                " at position ", k);
    dense.push_back(t.is_non_overlapping_and_dense() ? t : t.contiguous());
    const at::Tensor& d = dense.back();
    const int64_t nbytes = d.numel() * static_cast<int64_t>(d.element_size());
    const int64_t words = (nbytes + 3) / 4;
    const auto* data = static_cast<const unsigned char*>(d.const_data_ptr());
    for (int64_t begin = 0; begin < words; begin += kChunkWords) {
      chunks.push_back({data, nbytes, begin, std::min(words, begin + kChunkWords),
                        static_cast<int64_t>(k)});
    }
  }
  at::Tensor out = at::zeros({static_cast<int64_t>(tensors.size())},
                             at::TensorOptions().dtype(at::kLong).device(device));
  if (chunks.empty()) return out;  // empty tensors: digest 0, as on the CPU
  at::Tensor table = table_on_device(chunks, device);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  digest_kernel<<<static_cast<unsigned>(chunks.size()), kThreads, 0, stream>>>(
      reinterpret_cast<const Chunk*>(table.const_data_ptr()),
      reinterpret_cast<unsigned long long*>(out.data_ptr<int64_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace cuda
}  // namespace dear
