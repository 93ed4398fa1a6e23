// The term of one 32-bit word in digest.h's portable hash: MurmurHash3's finalizer of the word
// keyed by its position (a bijection of the word for each position), summed mod 2^64 by the
// CPU (digest.cpp) and the GPU (cuda/digest_kernels.cu) alike, so the two digests agree.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DEAR_HOST_DEVICE __host__ __device__
#else
#define DEAR_HOST_DEVICE
#endif

namespace dear {

inline DEAR_HOST_DEVICE uint32_t word_term(uint32_t word, uint64_t position) {
  uint32_t h = word ^ (static_cast<uint32_t>(position) * 0x9e3779b9u);
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

}  // namespace dear
