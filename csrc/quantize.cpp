// Block-wise int8/int4 quantization with error feedback on the CPU (see quantize.h and
// dear/fusion/quantize.py, whose quantize_reference this matches bit for bit).
//
// Bit-identity with torch's reference rests on: fp32 arithmetic with each operation rounded
// once (setup.py compiles the C++ sources with -ffp-contract=off: `y - q * scale` and
// `out + q * scale` must not become fused multiply-adds); a true division for both `a / qmax` and
// `y / scale`; round half to even in the default rounding mode (torch.round); the sign of a code
// rounded to zero kept until the residual (torch.round(-0.3) is -0.0, and the reference's
// residual is y - (-0.0) * scale); max|y| taken exactly (a maximum does not round).
//
// Blocks are spread over torch's intra-op threads with at::parallel_for, whose OpenMP version is
// inline: it runs in parallel only because setup.py adds -fopenmp (torch's OpenMP backend).
#include "quantize.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#ifdef DEAR_WITH_CUDA
#include "cuda/quantize_cuda.h"
#endif

namespace dear {
namespace {

// Values per task of at::parallel_for: a tensor under this stays on the calling thread.
constexpr int64_t kGrainValues = int64_t{1} << 15;
constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;  // |y| bits at or above: inf or NaN

int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }

int64_t code_bytes(int64_t n, int64_t bits) { return bits == 8 ? n : ceil_div(n, 2); }

inline uint32_t bits_of(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

inline float float_of(uint32_t u) {
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// clamp(round_half_even(v), -qmax, qmax) for a finite v with |v| < 2^23 (here |v| <= 2 qmax):
// |v| + 2^23 lies where fp32 values are the integers, so the addition rounds the fraction away,
// half to even, as nearbyint does in the default rounding mode, and the subtraction is exact.
// The sign is v's, also for a zero: torch.round(-0.3) is -0.0. Unlike a call of nearbyintf this
// vectorizes on any x86-64 (SSE2).
inline float round_clamp(float v, float qmax) {
  const float a = std::fabs(v);
  const float r = (a + 8388608.0f) - 8388608.0f;
  return std::copysign(std::min(r, qmax), v);
}

// ------------------------------------------------------------------------------ checks
void check_args(int64_t block, int64_t bits, const char* what) {
  TORCH_CHECK(bits == 8 || bits == 4, "dear: ", what, ": bits must be 8 or 4, got ", bits);
  TORCH_CHECK(block > 0, "dear: ", what, ": block must be positive, got ", block);
}

void check_device(const at::Tensor& t, const char* name, const char* what) {
  const bool supported = t.device().is_cpu()
#ifdef DEAR_WITH_CUDA
                         || t.device().is_cuda()
#endif
      ;
  TORCH_CHECK(supported, "dear: ", what, ": ", name, " is on ", t.device(),
              "; this build of the extension takes CPU"
#ifdef DEAR_WITH_CUDA
              " or CUDA"
#endif
              " tensors");
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "torch.float32";
    case at::kChar:
      return "torch.int8";
    case at::kByte:
      return "torch.uint8";
    default:
      return c10::toString(t);
  }
}

// A dense 1-D contiguous tensor of `dtype` on `device` with `numel` values (why: how numel
// follows from the other arguments, for the message).
void check_flat(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t numel,
                const at::Device& device, const std::string& why, const char* what) {
  TORCH_CHECK(t.defined(), "dear: ", what, ": ", name, " is an undefined tensor");
  TORCH_CHECK(t.layout() == at::kStrided, "dear: ", what, ": ", name,
              " must be a dense (strided) tensor, got layout ", t.layout());
  TORCH_CHECK(t.scalar_type() == dtype, "dear: ", what, ": ", name, " must be ",
              dtype_name(dtype), ", got ", dtype_name(t.scalar_type()));
  TORCH_CHECK(t.dim() == 1, "dear: ", what, ": ", name, " must be 1-D, got sizes ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), "dear: ", what, ": ", name,
              " must be contiguous (stride 1), got stride ", t.stride(0));
  TORCH_CHECK(t.device() == device, "dear: ", what, ": ", name, " is on ", t.device(),
              " but the other tensors are on ", device);
  TORCH_CHECK(numel < 0 || t.numel() == numel, "dear: ", what, ": ", name, " must have ",
              numel, " elements (", why, "), got ", t.numel());
}

void check_apart(const at::Tensor& a, const char* a_name, const at::Tensor& b,
                 const char* b_name, const char* what) {
  const auto status = at::get_overlap_status(a, b);
  TORCH_CHECK(status != at::MemOverlapStatus::Full && status != at::MemOverlapStatus::Partial,
              "dear: ", what, ": ", a_name, " and ", b_name,
              " share memory; they must be separate tensors");
}

std::string values_of(int64_t n) { return "x.numel() = " + std::to_string(n); }

// ------------------------------------------------------------------------------ kernels
// Blocks [b0, b1) of n values. For bits 4 the range starts at an even value (see the caller),
// so no byte is shared with another task: an even value writes its byte (high nibble 0), the
// odd value after it, in this range, ORs its nibble in.
template <int kBits, bool kResidual>
void quantize_range(const float* x, float* res, uint8_t* codes, float* scales, int64_t n,
                    int64_t block, int64_t b0, int64_t b1) {
  constexpr float qmax = kBits == 8 ? 127.0f : 7.0f;
  auto put = [codes](int64_t i, float q) {
    const int c = static_cast<int>(q);
    if constexpr (kBits == 8) {
      codes[i] = static_cast<uint8_t>(static_cast<int8_t>(c));
    } else if ((i & 1) == 0) {
      codes[i >> 1] = static_cast<uint8_t>(c & 0xF);
    } else {
      codes[i >> 1] = static_cast<uint8_t>(codes[i >> 1] | ((c & 0xF) << 4));
    }
  };
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t begin = b * block;
    const int64_t end = std::min(n, begin + block);
    // max|y| as the bits of |y|: for non-negative floats their order is the integers', and
    // every NaN lies above inf, so one integer maximum (it vectorizes) tells both.
    uint32_t amax_bits = 0;
    for (int64_t i = begin; i < end; ++i) {
      const float y = kResidual ? x[i] + res[i] : x[i];
      amax_bits = std::max(amax_bits, bits_of(y) & kAbsMask);
    }
    if (amax_bits >= kInfBits) {  // inf or NaN: nothing of the block is sent or kept
      scales[b] = std::numeric_limits<float>::quiet_NaN();
      for (int64_t i = begin; i < end; ++i) put(i, 0.0f);
      if constexpr (kResidual) std::fill(res + begin, res + end, 0.0f);
      continue;
    }
    const float scale = float_of(amax_bits) / qmax;
    scales[b] = scale;
    if (scale == 0.0f) {  // all zeros, or too small a subnormal: q = 0, residual = y - 0 = y
      for (int64_t i = begin; i < end; ++i) {
        put(i, 0.0f);
        if constexpr (kResidual) res[i] = x[i] + res[i];
      }
      continue;
    }
    if constexpr (kBits == 8) {
      int8_t* out = reinterpret_cast<int8_t*>(codes);
      for (int64_t i = begin; i < end; ++i) {
        const float y = kResidual ? x[i] + res[i] : x[i];
        const float q = round_clamp(y / scale, qmax);
        out[i] = static_cast<int8_t>(static_cast<int>(q));
        if constexpr (kResidual) {
          const float sent = q * scale;
          res[i] = y - sent;
        }
      }
    } else {
      for (int64_t i = begin; i < end; ++i) {
        const float y = kResidual ? x[i] + res[i] : x[i];
        const float q = round_clamp(y / scale, qmax);
        put(i, q);
        if constexpr (kResidual) {
          const float sent = q * scale;
          res[i] = y - sent;
        }
      }
    }
  }
}

template <int kBits>
inline float code_at(const uint8_t* codes, int64_t i) {
  if constexpr (kBits == 8) return static_cast<float>(static_cast<int8_t>(codes[i]));
  const uint8_t byte = codes[i >> 1];
  // The nibble moved to the top of an int8, then an arithmetic shift: two's complement -8..7.
  const int8_t top = static_cast<int8_t>((i & 1) ? (byte & 0xF0) : (byte << 4));
  return static_cast<float>(top >> 4);
}

template <int kBits, bool kAccumulate>
void dequantize_range(const uint8_t* codes, const float* scales, float* out, int64_t n,
                      int64_t block, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t begin = b * block;
    const int64_t end = std::min(n, begin + block);
    const float scale = scales[b];
    for (int64_t i = begin; i < end; ++i) {
      const float v = code_at<kBits>(codes, i) * scale;
      if constexpr (kAccumulate) {
        out[i] = out[i] + v;
      } else {
        out[i] = v;
      }
    }
  }
}

void quantize_cpu(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& codes,
                  const at::Tensor& scales, int64_t block, int64_t bits) {
  const int64_t n = x.numel();
  const int64_t nb = ceil_div(n, block);
  const float* xp = x.const_data_ptr<float>();
  float* rp = residual.defined() ? residual.mutable_data_ptr<float>() : nullptr;
  auto* cp = static_cast<uint8_t*>(codes.mutable_data_ptr());
  float* sp = scales.mutable_data_ptr<float>();
  // Tasks of whole bytes: int4 with an odd block takes blocks two at a time, so that every task
  // starts at an even value.
  const int64_t per = (bits == 4 && block % 2 == 1) ? 2 : 1;
  const int64_t grain = std::max<int64_t>(1, kGrainValues / block / per);
  at::parallel_for(0, ceil_div(nb, per), grain, [&](int64_t u0, int64_t u1) {
    const int64_t b0 = u0 * per, b1 = std::min(nb, u1 * per);
    if (bits == 8) {
      rp ? quantize_range<8, true>(xp, rp, cp, sp, n, block, b0, b1)
         : quantize_range<8, false>(xp, rp, cp, sp, n, block, b0, b1);
    } else {
      rp ? quantize_range<4, true>(xp, rp, cp, sp, n, block, b0, b1)
         : quantize_range<4, false>(xp, rp, cp, sp, n, block, b0, b1);
    }
  });
}

void dequantize_cpu(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& out,
                    int64_t block, int64_t bits, bool accumulate) {
  const int64_t n = out.numel();
  const int64_t nb = ceil_div(n, block);
  const auto* cp = static_cast<const uint8_t*>(codes.const_data_ptr());
  const float* sp = scales.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrainValues / block);
  at::parallel_for(0, nb, grain, [&](int64_t b0, int64_t b1) {
    if (bits == 8) {
      accumulate ? dequantize_range<8, true>(cp, sp, op, n, block, b0, b1)
                 : dequantize_range<8, false>(cp, sp, op, n, block, b0, b1);
    } else {
      accumulate ? dequantize_range<4, true>(cp, sp, op, n, block, b0, b1)
                 : dequantize_range<4, false>(cp, sp, op, n, block, b0, b1);
    }
  });
}

}  // namespace

void quantize_blocks(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                     const at::Tensor& codes, const at::Tensor& scales, int64_t block,
                     int64_t bits) {
  const char* what = "quantize_blocks";
  check_args(block, bits, what);
  TORCH_CHECK(x.defined(), "dear: ", what, ": x is an undefined tensor");
  check_device(x, "x", what);
  const at::Device device = x.device();
  check_flat(x, "x", at::kFloat, -1, device, "", what);
  const int64_t n = x.numel();
  at::Tensor res;  // undefined: no residual
  if (residual.has_value()) {
    res = *residual;
    check_flat(res, "residual", at::kFloat, n, device, values_of(n), what);
    check_apart(x, "x", res, "residual", what);
  }
  check_flat(codes, "codes", bits == 8 ? at::kChar : at::kByte, code_bytes(n, bits), device,
             bits == 8 ? "bits 8: an int8 code per value, " + values_of(n)
                       : "bits 4: two codes a uint8, ceil(n / 2) with " + values_of(n),
             what);
  check_flat(scales, "scales", at::kFloat, ceil_div(n, block), device,
             "ceil(n / block), " + values_of(n) + ", block = " + std::to_string(block), what);
  check_apart(codes, "codes", x, "x", what);
  check_apart(scales, "scales", x, "x", what);
  check_apart(codes, "codes", scales, "scales", what);
  if (res.defined()) {
    check_apart(codes, "codes", res, "residual", what);
    check_apart(scales, "scales", res, "residual", what);
  }
  if (n == 0) return;
#ifdef DEAR_WITH_CUDA
  if (device.is_cuda()) {
    cuda::quantize_blocks(x, res, codes, scales, block, bits);
    return;
  }
#endif
  quantize_cpu(x, res, codes, scales, block, bits);
}

void dequantize_blocks(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& out,
                       int64_t block, int64_t bits, bool accumulate) {
  const char* what = "dequantize_blocks";
  check_args(block, bits, what);
  TORCH_CHECK(out.defined(), "dear: ", what, ": out is an undefined tensor");
  check_device(out, "out", what);
  const at::Device device = out.device();
  check_flat(out, "out", at::kFloat, -1, device, "", what);
  const int64_t n = out.numel();
  const std::string values = "out.numel() = " + std::to_string(n);
  check_flat(codes, "codes", bits == 8 ? at::kChar : at::kByte, code_bytes(n, bits), device,
             bits == 8 ? "bits 8: an int8 code per value, " + values
                       : "bits 4: two codes a uint8, ceil(n / 2) with " + values,
             what);
  check_flat(scales, "scales", at::kFloat, ceil_div(n, block), device,
             "ceil(n / block), " + values + ", block = " + std::to_string(block), what);
  check_apart(out, "out", codes, "codes", what);
  check_apart(out, "out", scales, "scales", what);
  if (n == 0) return;
#ifdef DEAR_WITH_CUDA
  if (device.is_cuda()) {
    cuda::dequantize_blocks(codes, scales, out, block, bits, accumulate);
    return;
  }
#endif
  dequantize_cpu(codes, scales, out, block, bits, accumulate);
}

}  // namespace dear
