#include "grad_ready.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <stdexcept>
#include <utility>

#include "digest.h"
#include "pack.h"

#ifdef DEAR_WITH_CUDA
#include "cuda/digest_cuda.h"
#endif

namespace py = pybind11;

namespace dear {

GradReady::GradReady(at::Tensor buffer, std::vector<int64_t> offsets, std::vector<int64_t> numels,
                     int64_t flags_offset, bool sparse_as_dense)
    : buffer_(std::move(buffer)),
      layout_{std::move(offsets), std::move(numels), flags_offset},
      sparse_as_dense_(sparse_as_dense),
      recorded_(layout_.offsets.size(), 0),
      used_(layout_.offsets.size(), 0.0),
      grads_(layout_.offsets.size()),
      stamps_(layout_.offsets.size(), c10::weak_intrusive_ptr<c10::TensorImpl>(
                                          c10::intrusive_ptr<c10::TensorImpl>())),
      versions_(layout_.offsets.size(), -1),
      has_digest_(layout_.offsets.size(), 0),
      digests_(layout_.offsets.size(), 0),
      fingerprints_(layout_.offsets.size()) {
  check_buffer(buffer_, layout_, "GradReady");
}

at::Tensor fingerprint(const at::Tensor& grad) {
  const at::Tensor g = grad.detach();
#ifdef DEAR_WITH_CUDA
  if (g.is_cuda() && g.layout() == at::kStrided) return cuda::digests({g});  // one kernel
#endif
  at::ScalarType bits = at::kByte;
  switch (g.element_size()) {
    case 8: bits = at::kLong; break;
    case 4: bits = at::kInt; break;
    case 2: bits = at::kShort; break;
    default: break;
  }
  at::Tensor whole = g.view(bits).sum(bits);
  if (!g.is_floating_point()) return whole.reshape({1});
  at::Tensor value = g.sum(at::kFloat).view(at::kInt);  // its bits: NaN equals NaN
  if (whole.scalar_type() != at::kInt) {                // float32 needs no conversion
    whole = whole.to(at::kLong);
    value = value.to(at::kLong);
  }
  return at::stack({whole, value});  // three kernels for float32: this runs for every gradient
}

void GradReady::check_index(int64_t j) const {
  TORCH_CHECK(j >= 0 && j < size(), "dear: parameter index ", j, " is outside this bucket of ",
              size(), " parameters");
}

bool GradReady::record(int64_t j, const std::optional<at::Tensor>& grad) {
  check_index(j);
  if (recorded_[j]) return full();
  if (grad.has_value() && grad->defined()) {
    stamps_[j] = c10::weak_intrusive_ptr<c10::TensorImpl>(grad->getIntrusivePtr());
    versions_[j] = static_cast<int64_t>(grad->_version());
    at::Tensor g = *grad;
    if (digest_ && !g.is_sparse()) {
      if (g.device().is_cpu() && g.layout() == at::kStrided) {  // dear/guards/written.py's test
        has_digest_[j] = 1;
        digests_[j] = digest(g);
      } else {
        fingerprints_[j] = fingerprint(g);
      }
    }
    if (g.is_sparse()) {
      TORCH_CHECK(sparse_as_dense_,
                  "dear.DistributedOptimizer got a sparse gradient; dear reduces dense buckets. "
                  "Use a dense layer (nn.Embedding(sparse=False)) or pass sparse_as_dense=True.");
      g = g.to_dense();
    }
    TORCH_CHECK(g.numel() == layout_.numels[j], "dear: the gradient of parameter ", j,
                " of this bucket has ", g.numel(), " elements, but the parameter has ",
                layout_.numels[j]);
    grads_[j] = std::move(g);
    used_[j] = 1.0;
    ++num_used_;
  }
  recorded_[j] = 1;
  ++num_recorded_;
  return full();
}

void GradReady::pack() {
  TORCH_CHECK(full(), "dear: bucket packed with ", num_recorded_, " of ", size(),
              " gradients recorded");
  if (packed_) return;
  pack_bucket(buffer_, layout_, grads_, used_);
  for (auto& g : grads_) g = at::Tensor();
  packed_ = true;
}

bool GradReady::recorded(int64_t j) const {
  check_index(j);
  return recorded_[j] != 0;
}

int64_t GradReady::first_edited(const std::vector<at::Tensor>& params) const {
  TORCH_CHECK(static_cast<int64_t>(params.size()) == size(), "dear: first_edited got ",
              params.size(), " parameters for a bucket of ", size());
  for (int64_t j = 0; j < size(); ++j) {
    if (!recorded_[j]) continue;
    const at::Tensor& now = params[j].grad();
    if (versions_[j] < 0) {
      if (now.defined()) return j;        // a gradient appeared where there was none
      continue;
    }
    if (!now.defined() || stamps_[j]._unsafe_get_target() != now.unsafeGetTensorImpl() ||
        stamps_[j].expired() || static_cast<int64_t>(now._version()) != versions_[j]) {
      return j;
    }
    if (has_digest_[j] && digest(now) != digests_[j]) return j;
  }
  return -1;
}

std::vector<std::tuple<int64_t, at::Tensor>> GradReady::device_fingerprints() const {
  std::vector<std::tuple<int64_t, at::Tensor>> out;
  for (int64_t j = 0; j < size(); ++j) {
    if (recorded_[j] && fingerprints_[j].defined()) out.emplace_back(j, fingerprints_[j]);
  }
  return out;
}

std::vector<int64_t> GradReady::missing() const {
  std::vector<int64_t> out;
  for (int64_t j = 0; j < size(); ++j) {
    if (!recorded_[j]) out.push_back(j);
  }
  return out;
}

void GradReady::reset() {
  std::fill(recorded_.begin(), recorded_.end(), 0);
  std::fill(used_.begin(), used_.end(), 0.0);
  for (auto& g : grads_) g = at::Tensor();
  for (auto& s : stamps_) s = c10::weak_intrusive_ptr<c10::TensorImpl>(
                              c10::intrusive_ptr<c10::TensorImpl>());
  std::fill(versions_.begin(), versions_.end(), -1);
  std::fill(has_digest_.begin(), has_digest_.end(), 0);
  for (auto& f : fingerprints_) f = at::Tensor();
  num_recorded_ = 0;
  num_used_ = 0;
  packed_ = false;
  pending_ = false;
}

// ------------------------------------------------------------------ the hook
GradHook::GradHook(std::shared_ptr<HookSwitch> hook_switch, int64_t index, std::string name,
                   py::object slow, py::object launch)
    : switch_(std::move(hook_switch)),
      index_(index),
      name_(std::move(name)),
      slow_(std::move(slow)),
      launch_(std::move(launch)) {
  TORCH_CHECK(switch_ != nullptr, "dear: GradHook needs a HookSwitch");
}

void GradHook::bind(std::shared_ptr<GradReady> ready, int64_t j) {
  TORCH_CHECK(ready != nullptr && j >= 0 && j < ready->size(), "dear: GradHook bound to index ",
              j, " outside its bucket");
  ready_ = std::move(ready);
  j_ = j;
}

void GradHook::unbind() {
  ready_.reset();
  j_ = -1;
}

void GradHook::operator()(const py::object& param) {
  if (!switch_->fast || !ready_ || ready_->pending()) {
    slow_(index_, param);
    return;
  }
  if (ready_->recorded(j_)) {
    // The same words as the engine's _passes_error (dear/engine/engine.py).
    throw std::runtime_error(
        "gradient of " + name_ + " was computed 2 times since this optimizer's last step(), "
        "but backward_passes_per_step=1. dear reduces each gradient as backward produces it, "
        "so a backward that reaches these parameters counts even if its gradients are meant "
        "to be thrown away: typically another model's loss backpropagating through this one "
        "(a GAN's generator loss through the discriminator). Keep that backward away from "
        "these parameters (e.g. p.requires_grad_(False) for them around it, or detach the "
        "input), call step() after each backward, or raise backward_passes_per_step if the "
        "passes are meant to accumulate");
  }
  const at::Tensor& p = THPVariable_Unpack(param.ptr());
  switch_->any = true;
  if (ready_->record(j_, p.grad())) launch_();
}

void bind_grad_hook(py::module_& m) {
  py::class_<HookSwitch, std::shared_ptr<HookSwitch>>(m, "HookSwitch")
      .def(py::init<>())
      .def_readwrite("fast", &HookSwitch::fast)
      .def_readwrite("any", &HookSwitch::any);
  py::class_<GradHook, std::shared_ptr<GradHook>>(m, "GradHook")
      .def(py::init<std::shared_ptr<HookSwitch>, int64_t, std::string, py::object, py::object>(),
           py::arg("switch"), py::arg("index"), py::arg("name"), py::arg("slow"),
           py::arg("launch"))
      .def("bind", &GradHook::bind, py::arg("ready"), py::arg("j"))
      .def("unbind", &GradHook::unbind)
      .def("__call__", &GradHook::operator(), py::arg("param"));
}

}  // namespace dear
