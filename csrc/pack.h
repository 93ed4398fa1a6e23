// Multi-tensor pack of gradients into a flat bucket buffer and unpack of a gathered buffer.
//
// Every function gives the same bytes as the Python path in dear/fusion/bucket.py: plain copies
// (memcpy on CPU, one kernel per bucket on CUDA) where the dtypes match, ATen's own kernels for
// scaling and dtype conversion, so results are bit-identical by construction, not by tolerance.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "grad_ready.h"

namespace dear {

// Write grads[j] (undefined: zeros) at layout.offsets[j], used[j] as the usage flags at
// layout.flags_offset, and zeros in the rest of the buffer (the padding).
void pack_bucket(const at::Tensor& buffer, const BucketLayout& layout,
                 const std::vector<at::Tensor>& grads, const std::vector<double>& used);

// Prepare a packed bucket for the reduce-scatter: buffer *= prescale (unless 1), then, when the
// wire is a different tensor (fp16 compression), wire <- buffer converted to the wire dtype.
void finalize_for_wire(const at::Tensor& buffer, const at::Tensor& wire, double prescale);

// After the all-gather: buffer <- wire (converted back) when they differ; return which of the
// `num_params` usage flags at `flags_offset` are non-zero (some rank produced a gradient).
std::vector<bool> unpack_bucket(const at::Tensor& wire, const at::Tensor& buffer,
                                int64_t flags_offset, int64_t num_params);

// Per-parameter views of the buffer, shaped like the parameters (no copy).
std::vector<at::Tensor> grad_views(const at::Tensor& buffer, const BucketLayout& layout,
                                   const std::vector<std::vector<int64_t>>& shapes);

// Copy each parameter's slice of the buffer into outs[j] (e.g. into .grad).
void unpack_into(const at::Tensor& buffer, const BucketLayout& layout,
                 const std::vector<at::Tensor>& outs);

// Checks shared by the entry points: a flat contiguous buffer that holds the layout.
void check_buffer(const at::Tensor& buffer, const BucketLayout& layout, const char* what);

}  // namespace dear
