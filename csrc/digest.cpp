#include "digest.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <cstring>

#include "word_hash.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define DEAR_CRC_X86 1
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#define DEAR_CRC_ARM 1
#endif

namespace dear {
namespace {

inline uint64_t load8(const char* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);  // any alignment: a bf16 slice may start at an odd half-word
  return w;
}

inline uint64_t combine(uint32_t a, uint32_t b, uint32_t c) {
  const uint32_t c_rotated = (c << 16) | (c >> 16);
  return static_cast<uint64_t>(a) | (static_cast<uint64_t>(b ^ c_rotated) << 32);
}

// ---------------------------------------------------------------- CRC-32C, three streams
#if defined(DEAR_CRC_X86) || defined(DEAR_CRC_ARM)
#ifdef DEAR_CRC_X86
#define DEAR_CRC_TARGET __attribute__((target("sse4.2")))
DEAR_CRC_TARGET inline uint32_t crc8(uint32_t crc, uint64_t w) {
  return static_cast<uint32_t>(_mm_crc32_u64(crc, w));
}
DEAR_CRC_TARGET inline uint32_t crc1(uint32_t crc, uint8_t v) { return _mm_crc32_u8(crc, v); }
#else
#define DEAR_CRC_TARGET
inline uint32_t crc8(uint32_t crc, uint64_t w) { return __crc32cd(crc, w); }
inline uint32_t crc1(uint32_t crc, uint8_t v) { return __crc32cb(crc, v); }
#endif

DEAR_CRC_TARGET uint64_t crc_streams(const char* src, size_t nbytes) {
  const size_t m = nbytes / 24;  // 8-byte words per stream
  const char* sa = src;
  const char* sb = src + 8 * m;
  const char* sc = src + 16 * m;
  uint32_t a = 0xffffffffu, b = 0x6a09e667u, c = 0xbb67ae85u;
  for (size_t k = 0; k < m; ++k) {
    const uint64_t wa = load8(sa + 8 * k), wb = load8(sb + 8 * k), wc = load8(sc + 8 * k);
    a = crc8(a, wa);
    b = crc8(b, wb);
    c = crc8(c, wc);
  }
  for (size_t k = 24 * m; k < nbytes; ++k) {
    c = crc1(c, static_cast<uint8_t>(src[k]));
  }
  return combine(a, b, c);
}

bool have_crc() {
#ifdef DEAR_CRC_X86
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
#else
  return true;
#endif
}
#else
bool have_crc() { return false; }
uint64_t crc_streams(const char*, size_t) { return 0; }
#endif

// ---------------------------------------------------------------- the portable hash
uint64_t hashed_words(const char* src, size_t nbytes) {
  constexpr int kLanes = 8;  // independent sums: the compiler keeps them in vector registers
  const size_t nwords = nbytes / 4;
  uint64_t acc[kLanes] = {0};
  size_t i = 0;
  for (; i + kLanes <= nwords; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      uint32_t w;
      std::memcpy(&w, src + 4 * (i + l), 4);
      acc[l] += word_term(w, i + l);
    }
  }
  uint64_t sum = 0;
  for (; i <= nwords; ++i) {  // the last whole words, then the 0-3 bytes left, zero-padded
    const size_t n = i < nwords ? 4 : nbytes - 4 * nwords;
    if (n == 0) break;
    uint32_t w = 0;
    std::memcpy(&w, src + 4 * i, n);
    sum += word_term(w, i);
  }
  for (int l = 0; l < kLanes; ++l) sum += acc[l];
  return sum;
}

}  // namespace

uint64_t digest_bytes(const void* data, size_t nbytes, bool portable) {
  const char* bytes = static_cast<const char*>(data);
  return have_crc() && !portable ? crc_streams(bytes, nbytes) : hashed_words(bytes, nbytes);
}

uint64_t digest(const at::Tensor& t, bool portable) {
  TORCH_CHECK(t.defined() && t.device().is_cpu() && t.layout() == at::kStrided,
              "dear: digest() takes a dense CPU tensor, got ", t.toString());
  // Dense without overlap: the numel() elements fill [data_ptr, + nbytes) in some order of the
  // dimensions (strides are never negative); otherwise (an expanded or sliced view) a copy.
  if (t.is_non_overlapping_and_dense()) {
    return digest_bytes(t.const_data_ptr(), t.numel() * t.element_size(), portable);
  }
  c10::AutoGradMode no_grad(false);  // a parameter's copy needs no autograd history
  const at::Tensor dense = t.contiguous();
  return digest_bytes(dense.const_data_ptr(), dense.numel() * dense.element_size(), portable);
}

}  // namespace dear
