// Gradient-ready bookkeeping of one fusion bucket (the C++ side of dear/fusion/bucket.py).
//
// The backward hooks of the Python path pay one tensor op per parameter. Here a hook only
// records a reference to the gradient; once the bucket is full, pack() copies every recorded
// gradient into the flat buffer in one call, writes the usage flags after them and zero-fills
// the padding: the same bytes the Python path writes, in a different order. pack() is separate
// from record() so that the copy can run on the thread that issues the reduce-scatter (the
// planned schedule's executor), not in backward: a GPU copies on a side stream, the CPU here
// would otherwise lengthen backward by the copy of every gradient.
//
// GradHook, below: the post-accumulate-grad hook of one parameter on the native path (the C++
// side of the engine's post_backward in dear/engine/engine.py).
//
// With a Python hook per parameter, a model of 1000 small tensors pays 1000 Python calls per
// backward. A GradHook records the gradient in its bucket's GradReady without a Python frame and
// calls back into Python only when the bucket is full (to start its reduce-scatter, in order).
// Everything unusual (no buckets yet, several backward passes per step, a bucket whose update is
// still pending, gradients after clip_grad_norm_) goes to the Python hook, which the optimizer
// selects by clearing HookSwitch::fast.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/extension.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace dear {

// Layout of one bucket buffer: [gradients | one usage flag per parameter | padding].
struct BucketLayout {
  std::vector<int64_t> offsets;  // element offset of each parameter's gradient
  std::vector<int64_t> numels;
  int64_t flags_offset = 0;      // first usage flag

  int64_t size() const { return static_cast<int64_t>(offsets.size()); }
};

// What moves when a device gradient's contents do (dear/guards/written.py's fingerprint), as a tensor
// there: on CUDA (built with it) its digest (cuda/digest_cuda.h, one kernel); else two sums,
// the bit patterns as wrapping integers (any one changed element shows) and, for floating point,
// the float sum's bits. CPU gradients get a digest (digest.h) instead.
at::Tensor fingerprint(const at::Tensor& grad);

class GradReady {
 public:
  // `buffer` is the bucket's flat buffer (kept for the bucket's life).
  GradReady(at::Tensor buffer, std::vector<int64_t> offsets, std::vector<int64_t> numels,
            int64_t flags_offset, bool sparse_as_dense);

  // Record parameter j's gradient for this iteration (nullopt: this rank has none; it counts as
  // zero with usage flag 0). A second record of j before reset() is ignored. Returns full().
  bool record(int64_t j, const std::optional<at::Tensor>& grad);

  // Copy the recorded gradients, the usage flags and zero padding into the buffer and drop the
  // references (so autograd may accumulate into .grad in place again). The bucket must be full;
  // a second call before reset() does nothing. Needs no Python: called without the GIL.
  void pack();

  bool recorded(int64_t j) const;
  bool full() const { return num_recorded_ == layout_.size(); }
  int64_t num_recorded() const { return num_recorded_; }
  int64_t size() const { return layout_.size(); }
  const BucketLayout& layout() const { return layout_; }
  // Parameters not recorded yet, in bucket order.
  std::vector<int64_t> missing() const;
  // 1.0 for each parameter recorded with a gradient, 0.0 otherwise.
  const std::vector<double>& used() const { return used_; }
  // Every parameter was recorded with a gradient (one call, not a list per bucket).
  bool all_used() const { return num_used_ == size(); }

  // The first parameter whose .grad is no longer what record() saw (replaced, set to None,
  // edited in place: its version counter moved, or, for a CPU gradient, written through
  // .data: its digest changed), or -1. `params` are the bucket's parameters.
  // Such an edit after dear took the gradient would be silently ignored: the caller refuses it.
  int64_t first_edited(const std::vector<at::Tensor>& params) const;

  // (j, fingerprint) of each device gradient record() fingerprinted: the caller compares
  // them with the gradients' fingerprints now on the device, where the answer can wait for a
  // later step (dear/guards/written.py's Verdict): comparing here would stop the host for the GPU.
  std::vector<std::tuple<int64_t, at::Tensor>> device_fingerprints() const;

  // Forget this iteration's records (after the bucket's update was applied); clears pending.
  void reset();

  // The bucket's all-gather is issued and its update not applied yet (set by Python): a
  // gradient arriving now must go through the Python hook, which applies the update first.
  bool pending() const { return pending_; }
  void set_pending(bool pending) { pending_ = pending; }

  // Whether record() keeps what each gradient held (its digest), for first_edited's check of
  // writes through `.data`: set per iteration by Python (dear/engine/checks.py says which
  // iterations compare contents). Without it record() keeps only the tensor and its version.
  bool digesting() const { return digest_; }
  void set_digest(bool digest) { digest_ = digest; }

 private:
  void check_index(int64_t j) const;

  at::Tensor buffer_;
  BucketLayout layout_;
  bool sparse_as_dense_;
  std::vector<uint8_t> recorded_;
  std::vector<double> used_;
  std::vector<at::Tensor> grads_;  // undefined where the rank has no gradient
  // What each recorded .grad was: its TensorImpl, held weakly so that its address cannot be
  // reused by another tensor, and its version (none: the rank had no gradient).
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> stamps_;
  std::vector<int64_t> versions_;
  // What each dense gradient held when record() took it, on the training thread: every rank
  // sees a later edit alike, whenever pack() runs. A CPU gradient's digest (digest.h;
  // has_digest_ set), a device one's fingerprint() (undefined: none, or sparse).
  std::vector<uint8_t> has_digest_;
  std::vector<uint64_t> digests_;
  std::vector<at::Tensor> fingerprints_;
  int64_t num_recorded_ = 0;
  int64_t num_used_ = 0;
  bool packed_ = false;
  bool pending_ = false;
  bool digest_ = true;
};

// Shared by an optimizer's hooks; written by Python between iterations.
struct HookSwitch {
  bool fast = false;  // the C++ path may record gradients
  bool any = false;   // a gradient was recorded through it since the last clear
};

class GradHook {
 public:
  GradHook(std::shared_ptr<HookSwitch> hook_switch, int64_t index, std::string name,
           pybind11::object slow, pybind11::object launch);

  // Record into parameter j of `ready` from now on (after the buckets are (re)built).
  void bind(std::shared_ptr<GradReady> ready, int64_t j);
  void unbind();

  // Called by autograd with the parameter once its .grad is accumulated.
  void operator()(const pybind11::object& param);

 private:
  std::shared_ptr<HookSwitch> switch_;
  int64_t index_;
  std::string name_;
  pybind11::object slow_;    // slow(index, param): the Python hook
  pybind11::object launch_;  // launch(): start the reduce-scatters that are ready
  std::shared_ptr<GradReady> ready_;
  int64_t j_ = -1;
};

void bind_grad_hook(pybind11::module_& m);

}  // namespace dear
