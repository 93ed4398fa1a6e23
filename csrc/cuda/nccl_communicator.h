// An NCCL communicator on its own CUDA stream, ordered after the caller's stream by events.
//
// Each collective: record an event on the caller's current (compute) stream, make the
// communication stream wait for it (so NCCL reads gradients only after the kernels that wrote
// them), enqueue the NCCL call, record a completion event. NcclWork::wait() makes the caller's
// current stream wait for that event: the host never blocks, and kernels that read the result
// run after it. Tensors are recorded on the communication stream for the caching allocator, so
// that stream comes from torch's pool and is never destroyed: the allocator records an event on
// it when such a tensor is freed, possibly after destroy() (a destroyed stream crashed the
// process at exit, seen on an H100).
// The original DeAR code had no such dependency between its compute and communication streams.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <vector>

namespace dear {

int nccl_version();
std::string nccl_unique_id();  // NCCL_UNIQUE_ID_BYTES bytes, for the store

// A CUDA event without timing (c10's event classes differ between torch versions).
class Event {
 public:
  explicit Event(c10::DeviceIndex device);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(cudaStream_t stream);
  void block(cudaStream_t stream) const;  // `stream` waits for the event
  bool query() const;
  void synchronize() const;

 private:
  c10::DeviceIndex device_;
  cudaEvent_t event_ = nullptr;
};

class NcclWork {
 public:
  NcclWork(std::shared_ptr<Event> done, c10::DeviceIndex device, ncclComm_t comm);
  // The caller's current stream waits for the collective (the host does not).
  void wait();
  // Whether the collective has completed; raises on an asynchronous NCCL error.
  bool query() const;
  // The host waits for the collective.
  void synchronize();

 private:
  std::shared_ptr<Event> done_;
  c10::DeviceIndex device_;
  ncclComm_t comm_;
};

class NcclCommunicator {
 public:
  NcclCommunicator(int rank, int size, const std::string& unique_id, int device);
  ~NcclCommunicator();
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  NcclWork reduce_scatter(const at::Tensor& input, const at::Tensor& output);
  NcclWork all_gather(const at::Tensor& input, const at::Tensor& output);
  NcclWork all_reduce(const at::Tensor& tensor);
  NcclWork broadcast(const at::Tensor& tensor, int root);
  void destroy();

  int rank() const { return rank_; }
  int size() const { return size_; }
  // The dedicated communication stream (for tests of the ordering).
  int64_t stream_handle() const;

 private:
  template <typename Call>
  NcclWork launch(const std::vector<at::Tensor>& tensors, Call&& call);
  void check_tensor(const at::Tensor& t, const char* what) const;

  int rank_;
  int size_;
  c10::DeviceIndex device_;
  ncclComm_t comm_ = nullptr;
  c10::cuda::CUDAStream stream_;
};

void bind_nccl(pybind11::module_& m);

}  // namespace dear
