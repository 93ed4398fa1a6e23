#include "quantize_cuda.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

namespace dear {
namespace cuda {
namespace {

// Every operation is one of the _rn intrinsics (or rintf, fabsf, fminf, fmaxf, which do not
// round): nvcc fuses a plain `y - q * scale` into an FMA by default (--fmad=true), and the
// reference rounds the product and the difference separately. Round half to even is rintf's.
constexpr int kMaxThreads = 256;
constexpr int64_t kMaxGrid = int64_t{1} << 30;
constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;  // |y| bits at or above: inf or NaN

__host__ __device__ int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }

// A power of two from 32 to kMaxThreads, about one thread per value of a block.
int threads_for(int64_t values) {
  int threads = 32;
  while (threads < kMaxThreads && threads < values) threads *= 2;
  return threads;
}

unsigned grid_for(int64_t tasks) {
  return static_cast<unsigned>(tasks < kMaxGrid ? tasks : kMaxGrid);
}

// The maximum of v over the thread block (blockDim.x a multiple of 32), in every thread.
__device__ uint32_t block_max(uint32_t v) {
  __shared__ uint32_t warp_max[kMaxThreads / 32];
  __shared__ uint32_t result;
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = max(v, __shfl_down_sync(0xffffffffu, v, offset));
  }
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x >> 5) ? warp_max[lane] : 0u;
    for (int offset = 16; offset > 0; offset >>= 1) {
      v = max(v, __shfl_down_sync(0xffffffffu, v, offset));
    }
    if (lane == 0) result = v;
  }
  __syncthreads();
  return result;
}

// Value i's code under its block's scale; its residual written.
template <int kBits, bool kResidual>
__device__ __forceinline__ int quantize_one(const float* __restrict__ x, float* __restrict__ res,
                                            int64_t i, float scale) {
  constexpr float qmax = kBits == 8 ? 127.0f : 7.0f;
  const float y = kResidual ? __fadd_rn(x[i], res[i]) : x[i];
  if (isnan(scale)) {  // the block was not finite: nothing sent, nothing kept
    if (kResidual) res[i] = 0.0f;
    return 0;
  }
  if (scale == 0.0f) {  // all zeros, or too small a subnormal: q = 0, residual = y - 0 = y
    if (kResidual) res[i] = y;
    return 0;
  }
  // rintf keeps the sign of a zero (-0.3 -> -0.0), as torch.round does: the residual of -0.0 is
  // then -0.0 - (-0.0 * scale) = +0.0, the reference's.
  const float q = fmaxf(fminf(rintf(__fdiv_rn(y, scale)), qmax), -qmax);
  if (kResidual) res[i] = __fsub_rn(y, __fmul_rn(q, scale));
  return static_cast<int>(q);
}

// One thread block per quantization block, or per two of them (`per` 2) for int4 with an odd
// block size, so that no byte of codes is written by two thread blocks: the range of values of
// a thread block then starts at an even value. First the block reduction of max|y| (as the bits
// of |y|: for non-negative floats their order is the integers', and every NaN lies above inf),
// then the codes and residuals.
template <int kBits, bool kResidual>
__global__ void quantize_kernel(const float* __restrict__ x, float* __restrict__ res,
                                uint8_t* __restrict__ codes, float* __restrict__ scales,
                                int64_t n, int64_t block, int64_t nb, int per) {
  constexpr float qmax = kBits == 8 ? 127.0f : 7.0f;
  __shared__ float group_scales[2];
  const int64_t groups = ceil_div(nb, per);
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {
    const int64_t first = g * per;
    const int64_t last = min(nb, first + per);
    for (int64_t b = first; b < last; ++b) {
      const int64_t begin = b * block;
      const int64_t end = min(n, begin + block);
      uint32_t m = 0;
      for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
        const float y = kResidual ? __fadd_rn(x[i], res[i]) : x[i];
        m = max(m, __float_as_uint(y) & kAbsMask);
      }
      m = block_max(m);
      if (threadIdx.x == 0) {
        const float scale = m >= kInfBits ? __uint_as_float(0x7fc00000u)  // quiet NaN
                                          : __fdiv_rn(__uint_as_float(m), qmax);
        scales[b] = scale;
        group_scales[b - first] = scale;
      }
    }
    __syncthreads();
    const int64_t begin = first * block;
    const int64_t end = min(n, last * block);
    auto code = [&](int64_t i) {  // value i's code under its own block's scale
      return quantize_one<kBits, kResidual>(x, res, i, group_scales[i - begin < block ? 0 : 1]);
    };
    if (kBits == 8) {
      for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
        codes[i] = static_cast<uint8_t>(static_cast<int8_t>(code(i)));
      }
    } else {  // a byte a thread: values 2j (low nibble) and 2j + 1 (high; 0 past the end)
      for (int64_t j = begin / 2 + threadIdx.x; 2 * j < end; j += blockDim.x) {
        const int low = code(2 * j);
        const int high = 2 * j + 1 < end ? code(2 * j + 1) : 0;
        codes[j] = static_cast<uint8_t>((low & 0xF) | ((high & 0xF) << 4));
      }
    }
    __syncthreads();  // group_scales is rewritten by the next group
  }
}

template <int kBits>
__device__ __forceinline__ float code_at(const uint8_t* __restrict__ codes, int64_t i) {
  if (kBits == 8) return static_cast<float>(static_cast<int8_t>(codes[i]));
  const uint8_t byte = codes[i >> 1];
  // The nibble moved to the top of an int8, then an arithmetic shift: two's complement -8..7.
  const int8_t top = static_cast<int8_t>((i & 1) ? (byte & 0xF0) : (byte << 4));
  return static_cast<float>(top >> 4);
}

// One thread block per quantization block.
template <int kBits, bool kAccumulate>
__global__ void dequantize_kernel(const uint8_t* __restrict__ codes,
                                  const float* __restrict__ scales, float* __restrict__ out,
                                  int64_t n, int64_t block, int64_t nb) {
  for (int64_t b = blockIdx.x; b < nb; b += gridDim.x) {
    const float scale = scales[b];
    const int64_t begin = b * block;
    const int64_t end = min(n, begin + block);
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const float v = __fmul_rn(code_at<kBits>(codes, i), scale);
      out[i] = kAccumulate ? __fadd_rn(out[i], v) : v;
    }
  }
}

}  // namespace

void quantize_blocks(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& codes,
                     const at::Tensor& scales, int64_t block, int64_t bits) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  const int64_t nb = ceil_div(n, block);
  const int per = (bits == 4 && block % 2 == 1) ? 2 : 1;
  const float* xp = x.const_data_ptr<float>();
  float* rp = residual.defined() ? residual.mutable_data_ptr<float>() : nullptr;
  auto* cp = static_cast<uint8_t*>(codes.mutable_data_ptr());
  float* sp = scales.mutable_data_ptr<float>();
  const unsigned grid = grid_for(ceil_div(nb, per));
  const int threads = threads_for(block);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (bits == 8) {
    if (rp != nullptr) {
      quantize_kernel<8, true><<<grid, threads, 0, stream>>>(xp, rp, cp, sp, n, block, nb, per);
    } else {
      quantize_kernel<8, false><<<grid, threads, 0, stream>>>(xp, rp, cp, sp, n, block, nb, per);
    }
  } else {
    if (rp != nullptr) {
      quantize_kernel<4, true><<<grid, threads, 0, stream>>>(xp, rp, cp, sp, n, block, nb, per);
    } else {
      quantize_kernel<4, false><<<grid, threads, 0, stream>>>(xp, rp, cp, sp, n, block, nb, per);
    }
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dequantize_blocks(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& out,
                       int64_t block, int64_t bits, bool accumulate) {
  const c10::cuda::CUDAGuard guard(out.device());
  const int64_t n = out.numel();
  const int64_t nb = ceil_div(n, block);
  const auto* cp = static_cast<const uint8_t*>(codes.const_data_ptr());
  const float* sp = scales.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const unsigned grid = grid_for(nb);
  const int threads = threads_for(block);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (bits == 8) {
    if (accumulate) {
      dequantize_kernel<8, true><<<grid, threads, 0, stream>>>(cp, sp, op, n, block, nb);
    } else {
      dequantize_kernel<8, false><<<grid, threads, 0, stream>>>(cp, sp, op, n, block, nb);
    }
  } else {
    if (accumulate) {
      dequantize_kernel<4, true><<<grid, threads, 0, stream>>>(cp, sp, op, n, block, nb);
    } else {
      dequantize_kernel<4, false><<<grid, threads, 0, stream>>>(cp, sp, op, n, block, nb);
    }
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace dear
