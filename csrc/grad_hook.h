// The post-accumulate-grad hook of one parameter on the native path (the C++ side of
// DistributedOptimizer._post_backward in dear/deferred.py).
//
// With a Python hook per parameter, a model of 1000 small tensors pays 1000 Python calls per
// backward. A GradHook records the gradient in its bucket's GradReady without a Python frame and
// calls back into Python only when the bucket is full (to start its reduce-scatter, in order).
// Everything unusual (no buckets yet, several backward passes per step, a bucket whose update is
// still pending, gradients after clip_grad_norm_) goes to the Python hook, which the optimizer
// selects by clearing HookSwitch::fast.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <string>

#include "grad_ready.h"

namespace dear {

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
