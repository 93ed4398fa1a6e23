// Content digests: how dear sees a write through `.data` (which leaves autograd's version
// counter alone) to a gradient it took or a parameter whose update is pending.
//
// The digest of n bytes is three CRC-32C, of the first, second and last third of the whole
// 8-byte words (the 0-7 bytes left over go into the last), combined into 64 bits; three
// streams so that the CPU's CRC instruction (SSE4.2, ARMv8 CRC) runs at memory speed: a digest
// costs what one reduction of the tensor does (dear/guards/written.py's two sums cost two). Without
// that instruction, a vectorizable hash (MurmurHash3's finalizer of each
// 32-bit word, keyed by its position, summed). Either way any one changed element of up to 4
// bytes always changes the digest (a CRC sees every burst of up to 32 bits; the hash term of a
// position is a bijection of its word), and any other change, including a permutation or sign
// flips of many elements, goes unseen only by a 1-in-2^32 coincidence. Digests are compared
// only within one process, so which method a machine uses does not matter.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>

namespace dear {

// The digest of `nbytes` bytes at `data` (`portable`: the hash even where CRC-32C is there;
// for tests).
uint64_t digest_bytes(const void* data, size_t nbytes, bool portable = false);

// The digest of a CPU tensor's elements in memory order (a copy first where they are not
// dense). Two calls agree when the tensor's bytes and strides did not change.
uint64_t digest(const at::Tensor& t, bool portable = false);

}  // namespace dear
