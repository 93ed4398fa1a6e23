// Python bindings of dear's native path (imported as dear._native by dear/native.py).
#include <torch/extension.h>

#include <optional>
#include <string>
#include <vector>

#include "digest.h"
#include "grad_ready.h"
#include "pack.h"
#include "quantize.h"

#ifdef DEAR_WITH_CUDA
#include "cuda/digest_cuda.h"
#endif
#ifdef DEAR_WITH_NCCL
#include "cuda/nccl_communicator.h"
#endif

namespace py = pybind11;

namespace {

dear::BucketLayout make_layout(std::vector<int64_t> offsets, std::vector<int64_t> numels,
                               int64_t flags_offset) {
  return dear::BucketLayout{std::move(offsets), std::move(numels), flags_offset};
}

std::vector<at::Tensor> defined_or_empty(const std::vector<std::optional<at::Tensor>>& grads) {
  std::vector<at::Tensor> out;
  out.reserve(grads.size());
  for (const auto& g : grads) out.push_back(g.has_value() ? *g : at::Tensor());
  return out;
}

py::dict build_info() {
  py::dict info;
#ifdef DEAR_WITH_CUDA
  info["cuda"] = true;
#else
  info["cuda"] = false;
#endif
#ifdef DEAR_WITH_NCCL
  info["nccl"] = true;
  info["nccl_version"] = dear::nccl_version();
#else
  info["nccl"] = false;
#endif
  info["torch"] = std::string(TORCH_VERSION);
  return info;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dear's native path: bucket bookkeeping, multi-tensor pack/unpack, NCCL";

  py::class_<dear::GradReady, std::shared_ptr<dear::GradReady>>(m, "GradReady")
      .def(py::init<at::Tensor, std::vector<int64_t>, std::vector<int64_t>, int64_t, bool>(),
           py::arg("buffer"), py::arg("offsets"), py::arg("numels"), py::arg("flags_offset"),
           py::arg("sparse_as_dense") = false)
      .def("record", &dear::GradReady::record, py::arg("j"), py::arg("grad"),
           "Record parameter j's gradient (None: none); returns whether the bucket is full.")
      .def("pack", &dear::GradReady::pack, py::call_guard<py::gil_scoped_release>(),
           "Copy the recorded gradients, flags and padding into the full bucket's buffer "
           "(once; the GIL is released meanwhile).")
      .def("recorded", &dear::GradReady::recorded, py::arg("j"))
      .def("full", &dear::GradReady::full)
      .def("num_recorded", &dear::GradReady::num_recorded)
      .def("size", &dear::GradReady::size)
      .def("missing", &dear::GradReady::missing)
      .def("first_edited", &dear::GradReady::first_edited, py::arg("params"),
           py::call_guard<py::gil_scoped_release>(),  // it reads gradients: let comm run
           "First recorded parameter whose .grad was replaced or edited since, or -1.")
      .def("used", &dear::GradReady::used)
      .def("all_used", &dear::GradReady::all_used)
      .def("reset", &dear::GradReady::reset)
      .def("set_pending", &dear::GradReady::set_pending, py::arg("pending"))
      .def("set_digest", &dear::GradReady::set_digest, py::arg("digest"))
      .def("device_fingerprints", &dear::GradReady::device_fingerprints)
      .def("digesting", &dear::GradReady::digesting)
      .def("pending", &dear::GradReady::pending);
  dear::bind_grad_hook(m);

  m.def(
      "pack_bucket",
      [](const at::Tensor& buffer, std::vector<int64_t> offsets, std::vector<int64_t> numels,
         int64_t flags_offset, const std::vector<std::optional<at::Tensor>>& grads,
         const std::vector<double>& used) {
        auto layout = make_layout(std::move(offsets), std::move(numels), flags_offset);
        dear::check_buffer(buffer, layout, "pack_bucket");
        dear::pack_bucket(buffer, layout, defined_or_empty(grads), used);
      },
      py::arg("buffer"), py::arg("offsets"), py::arg("numels"), py::arg("flags_offset"),
      py::arg("grads"), py::arg("used"));
  m.def("finalize_for_wire", &dear::finalize_for_wire, py::arg("buffer"), py::arg("wire"),
        py::arg("prescale"));
  m.def("unpack_bucket", &dear::unpack_bucket, py::arg("wire"), py::arg("buffer"),
        py::arg("flags_offset"), py::arg("num_params"));
  m.def(
      "grad_views",
      [](const at::Tensor& buffer, std::vector<int64_t> offsets, std::vector<int64_t> numels,
         int64_t flags_offset, const std::vector<std::vector<int64_t>>& shapes) {
        return dear::grad_views(
            buffer, make_layout(std::move(offsets), std::move(numels), flags_offset), shapes);
      },
      py::arg("buffer"), py::arg("offsets"), py::arg("numels"), py::arg("flags_offset"),
      py::arg("shapes"));
  m.def(
      "unpack_into",
      [](const at::Tensor& buffer, std::vector<int64_t> offsets, std::vector<int64_t> numels,
         int64_t flags_offset, const std::vector<at::Tensor>& outs) {
        dear::unpack_into(buffer, make_layout(std::move(offsets), std::move(numels), flags_offset),
                          outs);
      },
      py::arg("buffer"), py::arg("offsets"), py::arg("numels"), py::arg("flags_offset"),
      py::arg("outs"));
  m.def(
      "swap_grads",
      [](const std::vector<at::Tensor>& params,
         const std::vector<std::optional<at::Tensor>>& grads) {
        // Set each parameter's .grad (None: no gradient) and return the old ones: the deferred
        // update lends the averaged gradients to the wrapped optimizer and gives the user's back.
        TORCH_CHECK(params.size() == grads.size(), "dear: swap_grads got ", params.size(),
                    " parameters but ", grads.size(), " gradients");
        std::vector<std::optional<at::Tensor>> old;
        old.reserve(params.size());
        for (size_t i = 0; i < params.size(); ++i) {
          at::Tensor& slot = params[i].mutable_grad();
          old.push_back(slot.defined() ? std::optional<at::Tensor>(slot) : std::nullopt);
          slot = grads[i].has_value() ? *grads[i] : at::Tensor();
        }
        return old;
      },
      py::arg("params"), py::arg("grads"));
  m.def(
      "digests",
      [](const std::vector<at::Tensor>& tensors, bool portable) {
        // dear/guards/written.py's fingerprint of each CPU tensor, in one call without the GIL
        // (digest() refuses any other tensor; the error crosses the release as any other).
        py::gil_scoped_release no_gil;
        std::vector<uint64_t> out;
        out.reserve(tensors.size());
        for (const auto& t : tensors) out.push_back(dear::digest(t, portable));
        return out;
      },
      py::arg("tensors"), py::arg("portable") = false,
      "The content digest (csrc/digest.h) of each dense CPU tensor (portable: the hash used "
      "where the CPU has no CRC-32C instruction).");
#ifdef DEAR_WITH_CUDA
  m.def("digests_cuda", &dear::cuda::digests, py::arg("tensors"),
        "The content digests of dense tensors on one CUDA device, as one int64 tensor there: "
        "digest.h's portable hash, one kernel on the current stream.");
#endif
  m.def("quantize_blocks", &dear::quantize_blocks, py::arg("x"), py::arg("residual"),
        py::arg("codes"), py::arg("scales"), py::arg("block"), py::arg("bits"),
        py::call_guard<py::gil_scoped_release>(),  // called from the communication thread
        "Block-wise int8/int4 quantization of x (+ residual, renewed in place: error feedback) "
        "into codes and scales; dear/fusion/quantize.py's quantize_reference, bit for bit.");
  m.def("dequantize_blocks", &dear::dequantize_blocks, py::arg("codes"), py::arg("scales"),
        py::arg("out"), py::arg("block"), py::arg("bits"), py::arg("accumulate"),
        py::call_guard<py::gil_scoped_release>(),
        "out = float(code) * its block's scale (accumulate: out += that); "
        "dear/fusion/quantize.py's dequantize_reference, bit for bit.");
  m.def("build_info", &build_info, "What this build of the extension contains.");

#ifdef DEAR_WITH_NCCL
  dear::bind_nccl(m);
#endif
}
