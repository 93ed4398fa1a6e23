#include "grad_hook.h"

#include <stdexcept>
#include <utility>

namespace py = pybind11;

namespace dear {

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
    // The same words as DistributedOptimizer._post_backward's (dear/deferred.py).
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
