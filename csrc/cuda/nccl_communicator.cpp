#include "nccl_communicator.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cstring>

namespace py = pybind11;

namespace dear {
namespace {

#define DEAR_NCCL_CHECK(expr)                                                               \
  do {                                                                                      \
    ncclResult_t result_ = (expr);                                                          \
    TORCH_CHECK(result_ == ncclSuccess, "dear: NCCL error in " #expr ": ",                 \
                ncclGetErrorString(result_), " (", static_cast<int>(result_),               \
                "); NCCL_DEBUG=INFO tells more");                                           \
  } while (0)

ncclDataType_t nccl_type(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kChar: return ncclInt8;
    case at::kByte: return ncclUint8;
    default:
      TORCH_CHECK(false, "dear: the NCCL communicator cannot communicate ", type);
  }
}

}  // namespace

int nccl_version() {
  int version = 0;
  DEAR_NCCL_CHECK(ncclGetVersion(&version));
  return version;
}

std::string nccl_unique_id() {
  ncclUniqueId id;
  DEAR_NCCL_CHECK(ncclGetUniqueId(&id));
  return std::string(id.internal, NCCL_UNIQUE_ID_BYTES);
}

Event::Event(c10::DeviceIndex device) : device_(device) {
  const c10::cuda::CUDAGuard guard(device_);
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
}

Event::~Event() {
  // No guard and no check: a destructor must not throw, e.g. at exit after CUDA's teardown.
  if (event_ != nullptr) {
    (void)cudaEventDestroy(event_);
    (void)cudaGetLastError();
  }
}

void Event::record(cudaStream_t stream) { C10_CUDA_CHECK(cudaEventRecord(event_, stream)); }

void Event::block(cudaStream_t stream) const {
  C10_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0));
}

bool Event::query() const {
  const cudaError_t err = cudaEventQuery(event_);
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();  // not an error: clear it
    return false;
  }
  C10_CUDA_CHECK(err);
  return true;
}

void Event::synchronize() const { C10_CUDA_CHECK(cudaEventSynchronize(event_)); }

NcclWork::NcclWork(std::shared_ptr<Event> done, c10::DeviceIndex device, ncclComm_t comm)
    : done_(std::move(done)), device_(device), comm_(comm) {}

void NcclWork::wait() { done_->block(c10::cuda::getCurrentCUDAStream(device_).stream()); }

bool NcclWork::query() const {
  ncclResult_t async_error = ncclSuccess;
  DEAR_NCCL_CHECK(ncclCommGetAsyncError(comm_, &async_error));
  TORCH_CHECK(async_error == ncclSuccess, "dear: NCCL reported an asynchronous error: ",
              ncclGetErrorString(async_error));
  return done_->query();
}

void NcclWork::synchronize() { done_->synchronize(); }

NcclCommunicator::NcclCommunicator(int rank, int size, const std::string& unique_id, int device)
    : rank_(rank),
      size_(size),
      device_(static_cast<c10::DeviceIndex>(device)),
      stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false,
                                           static_cast<c10::DeviceIndex>(device))) {
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "dear: rank ", rank,
              " does not exist in a world of size ", size);
  TORCH_CHECK(unique_id.size() == NCCL_UNIQUE_ID_BYTES, "dear: an NCCL unique id has ",
              NCCL_UNIQUE_ID_BYTES, " bytes, got ", unique_id.size());
  const c10::cuda::CUDAGuard guard(device_);
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), NCCL_UNIQUE_ID_BYTES);
  DEAR_NCCL_CHECK(ncclCommInitRank(&comm_, size, id, rank));
}

NcclCommunicator::~NcclCommunicator() {
  try {
    destroy();
  } catch (...) {
  }
}

void NcclCommunicator::destroy() {
  if (comm_ == nullptr) {
    return;
  }
  const c10::cuda::CUDAGuard guard(device_);
  C10_CUDA_CHECK(cudaStreamSynchronize(stream_.stream()));
  ncclComm_t comm = comm_;
  comm_ = nullptr;
  DEAR_NCCL_CHECK(ncclCommDestroy(comm));
}

int64_t NcclCommunicator::stream_handle() const {
  return reinterpret_cast<int64_t>(stream_.stream());
}

void NcclCommunicator::check_tensor(const at::Tensor& t, const char* what) const {
  TORCH_CHECK(comm_ != nullptr, "dear: the NCCL communicator was destroyed");
  TORCH_CHECK(t.is_cuda() && t.device().index() == device_, "dear: the ", what,
              " must be on cuda:", static_cast<int>(device_), ", got ", t.device());
  TORCH_CHECK(t.is_contiguous(), "dear: the ", what, " must be contiguous");
}

template <typename Call>
NcclWork NcclCommunicator::launch(const std::vector<at::Tensor>& tensors, Call&& call) {
  const c10::cuda::CUDAGuard guard(device_);
  const cudaStream_t raw = stream_.stream();
  Event ready(device_);
  ready.record(c10::cuda::getCurrentCUDAStream(device_).stream());
  ready.block(raw);
  DEAR_NCCL_CHECK(call(raw));
  for (const auto& t : tensors) {
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream_);
  }
  auto done = std::make_shared<Event>(device_);
  done->record(raw);
  return NcclWork(std::move(done), device_, comm_);
}

NcclWork NcclCommunicator::reduce_scatter(const at::Tensor& input, const at::Tensor& output) {
  check_tensor(input, "reduce-scatter input");
  check_tensor(output, "reduce-scatter output");
  TORCH_CHECK(input.numel() == output.numel() * size_ && input.scalar_type() == output.scalar_type(),
              "dear: reduce-scatter input must hold world size x output elements of one dtype");
  return launch({input, output}, [&](cudaStream_t s) {
    return ncclReduceScatter(input.const_data_ptr(), output.data_ptr(), output.numel(),
                             nccl_type(input.scalar_type()), ncclSum, comm_, s);
  });
}

NcclWork NcclCommunicator::all_gather(const at::Tensor& input, const at::Tensor& output) {
  check_tensor(input, "all-gather input");
  check_tensor(output, "all-gather output");
  TORCH_CHECK(output.numel() == input.numel() * size_ && input.scalar_type() == output.scalar_type(),
              "dear: all-gather output must hold world size x input elements of one dtype");
  return launch({input, output}, [&](cudaStream_t s) {
    return ncclAllGather(input.const_data_ptr(), output.data_ptr(), input.numel(),
                         nccl_type(input.scalar_type()), comm_, s);
  });
}

NcclWork NcclCommunicator::all_reduce(const at::Tensor& tensor) {
  check_tensor(tensor, "all-reduce tensor");
  return launch({tensor}, [&](cudaStream_t s) {
    return ncclAllReduce(tensor.const_data_ptr(), tensor.data_ptr(), tensor.numel(),
                         nccl_type(tensor.scalar_type()), ncclSum, comm_, s);
  });
}

NcclWork NcclCommunicator::broadcast(const at::Tensor& tensor, int root) {
  check_tensor(tensor, "broadcast tensor");
  TORCH_CHECK(root >= 0 && root < size_, "dear: root rank ", root,
              " does not exist in a world of size ", size_);
  return launch({tensor}, [&](cudaStream_t s) {
    return ncclBroadcast(tensor.const_data_ptr(), tensor.data_ptr(), tensor.numel(),
                         nccl_type(tensor.scalar_type()), root, comm_, s);
  });
}

void bind_nccl(py::module_& m) {
  py::class_<NcclWork>(m, "NcclWork")
      .def("wait", &NcclWork::wait)
      .def("query", &NcclWork::query)
      .def("synchronize", &NcclWork::synchronize, py::call_guard<py::gil_scoped_release>());
  py::class_<NcclCommunicator>(m, "NcclCommunicator")
      .def(py::init([](int rank, int size, py::bytes unique_id, int device) {
             std::string id = unique_id;
             py::gil_scoped_release no_gil;  // ncclCommInitRank waits for every rank
             return std::make_unique<NcclCommunicator>(rank, size, id, device);
           }),
           py::arg("rank"), py::arg("size"), py::arg("unique_id"), py::arg("device"))
      .def("reduce_scatter", &NcclCommunicator::reduce_scatter, py::arg("input"),
           py::arg("output"))
      .def("all_gather", &NcclCommunicator::all_gather, py::arg("input"), py::arg("output"))
      .def("all_reduce", &NcclCommunicator::all_reduce, py::arg("tensor"))
      .def("broadcast", &NcclCommunicator::broadcast, py::arg("tensor"), py::arg("root"))
      .def("destroy", &NcclCommunicator::destroy, py::call_guard<py::gil_scoped_release>())
      .def("stream_handle", &NcclCommunicator::stream_handle)
      .def_property_readonly("rank", &NcclCommunicator::rank)
      .def_property_readonly("size", &NcclCommunicator::size);
  m.def("nccl_unique_id", [] { return py::bytes(nccl_unique_id()); });
  m.def("nccl_version", &nccl_version);
}

}  // namespace dear
