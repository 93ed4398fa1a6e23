// A small table of plain structs, built on the host, for one kernel launch to read.
#pragma once

#include <ATen/ATen.h>

#include <cstring>
#include <vector>

namespace dear {
namespace cuda {

// The table goes to the device through pinned memory from torch's caching host allocator: the
// non-blocking copy records an event on the pinned block, so the block is not reused before the
// copy has read it, and the host never waits for the GPU.
template <typename T>
at::Tensor table_on_device(const std::vector<T>& table, const at::Device& device) {
  const int64_t bytes = static_cast<int64_t>(table.size() * sizeof(T));
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), table.data(), bytes);
  return host.to(device, /*non_blocking=*/true);
}

}  // namespace cuda
}  // namespace dear
