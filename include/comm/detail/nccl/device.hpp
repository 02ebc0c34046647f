#pragma once
// CUDA devices and streams for the NCCL backend: which device a rank uses, whether any is usable,
// the caller's "current stream" (a thread-local that comm::nccl::StreamGuard sets), a guard that
// restores the caller's device, and the check that a buffer is device memory.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

#include <comm/detail/base/env.hpp>
#include <comm/detail/nccl/errors.hpp>
#include <comm/error.hpp>

namespace comm::detail::nccl {
/// This thread's current stream (comm::nccl::current_stream).
inline thread_local cudaStream_t tls_current_stream = nullptr;
}  // namespace comm::detail::nccl

namespace comm::nccl {

/// The stream comm treats as this thread's current stream: operations are ordered after the work
/// already queued on it, and the blocking forms (and Work::wait) order it after the operation.
/// Default: the default stream (nullptr, legacy or per-thread as this program's CUDA flags say).
[[nodiscard]] inline cudaStream_t current_stream() noexcept { return detail::nccl::tls_current_stream; }

/// Sets this thread's current stream (see current_stream); prefer StreamGuard.
inline void set_current_stream(cudaStream_t s) noexcept { detail::nccl::tls_current_stream = s; }

/// Makes `s` this thread's current stream for a scope, then restores the previous one.
class StreamGuard {
 public:
  explicit StreamGuard(cudaStream_t s) noexcept : prev_(current_stream()) { set_current_stream(s); }
  ~StreamGuard() { set_current_stream(prev_); }
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  cudaStream_t prev_;
};

/// What cudaGetDeviceCount says: the number of devices, or 0 and why none is usable.
struct DeviceCount {
  int count = 0;
  cudaError_t error = cudaSuccess;
  std::string why;  ///< empty when count > 0
};

/// Counts the CUDA devices; never throws. With no driver or no device, count is 0 and `why` reads
/// "cudaGetDeviceCount: <CUDA's text> [<name> = <code>]" or "cudaGetDeviceCount: no device".
[[nodiscard]] inline DeviceCount device_count() noexcept {
  DeviceCount r;
  int n = 0;
  r.error = cudaGetDeviceCount(&n);
  if (r.error != cudaSuccess) {
    (void)cudaGetLastError();
    try {
      r.why = "cudaGetDeviceCount: " + detail::nccl::describe(r.error);
    } catch (...) {  // out of memory while formatting: keep the code
    }
    return r;
  }
  r.count = n;
  if (n <= 0) r.why = "cudaGetDeviceCount: no device";
  return r;
}

}  // namespace comm::nccl

namespace comm::detail::nccl {

/// Sets the device for a scope and restores the caller's afterwards (cheap when they match).
class DeviceGuard {
 public:
  DeviceGuard(int device, const std::string& op, int rank) {
    COMM_CUDA_CHECK(cudaGetDevice(&prev_), op, rank);
    if (prev_ != device) COMM_CUDA_CHECK(cudaSetDevice(device), op, rank);
  }
  ~DeviceGuard() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != prev_) (void)cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
};

/// The comm::Error for "no usable CUDA device", with the CUDA code when there is one.
[[noreturn]] inline void throw_no_device(const comm::nccl::DeviceCount& dc, const std::string& op, int rank) {
  const std::string detail = "no usable CUDA device (" + dc.why + "); the NCCL backend needs a GPU";
  if (dc.error != cudaSuccess)
    throw EngineError<BackendError>(NativeEngine::cuda, static_cast<int>(dc.error), op, rank, detail);
  throw BackendError(op, rank, detail);
}

/// The device a rank uses: `requested` if >= 0 (checked against the count), else
/// LOCAL_RANK % count, else rank % count. Throws when no device is usable.
[[nodiscard]] inline int select_device(int requested, int rank, const std::string& op) {
  const auto dc = comm::nccl::device_count();
  if (dc.count <= 0) throw_no_device(dc, op, rank);
  if (requested >= 0) {
    if (requested >= dc.count)
      throw InvalidArgument(op, rank,
                            "device " + std::to_string(requested) + " does not exist (" + std::to_string(dc.count) +
                                " CUDA device(s))");
    return requested;
  }
  const auto local = env_nonneg_int("LOCAL_RANK", op);
  return (local ? *local : rank) % dc.count;
}

/// Checks that `p` (`bytes` long) is memory the communicator's device can use: device memory of
/// that device, managed memory, or mapped pinned host memory. Pageable host memory and another
/// device's memory throw InvalidArgument naming the buffer.
inline void check_device_buffer(const void* p, std::size_t bytes, int device, const char* what, const std::string& op,
                                int rank) {
  if (bytes == 0) return;
  if (p == nullptr) throw InvalidArgument(op, rank, std::string(what) + " is a null pointer");
  cudaPointerAttributes a{};
  const cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw EngineError<InvalidArgument>(NativeEngine::cuda, static_cast<int>(e), op, rank,
                                       std::string(what) + " is not memory CUDA knows: cudaPointerGetAttributes: " +
                                           describe(e));
  }
  switch (a.type) {
    case cudaMemoryTypeDevice:
      if (a.device != device)
        throw InvalidArgument(op, rank,
                              std::string(what) + " is memory of device " + std::to_string(a.device) +
                                  " but the communicator uses device " + std::to_string(device));
      return;
    case cudaMemoryTypeManaged: return;
    case cudaMemoryTypeHost:
      if (a.devicePointer == p) return;
      throw InvalidArgument(op, rank,
                            std::string(what) +
                                " is pinned host memory that is not mapped at the same address on the device");
    case cudaMemoryTypeUnregistered: break;
  }
  throw InvalidArgument(op, rank,
                        std::string(what) +
                            " is host memory; the NCCL backend needs device memory (cudaMalloc), managed memory or "
                            "mapped pinned memory (set Options::check_pointers = false on systems where the GPU "
                            "reads pageable memory)");
}

/// Checks that `stream` (when it is an ordinary stream) belongs to `device`.
inline void check_stream_device([[maybe_unused]] cudaStream_t stream, [[maybe_unused]] int device,
                                [[maybe_unused]] const std::string& op, [[maybe_unused]] int rank) {
#if CUDART_VERSION >= 12080
  if (stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread) return;
  int d = -1;
  COMM_CUDA_CHECK(cudaStreamGetDevice(stream, &d), op, rank);
  if (d != device)
    throw InvalidArgument(op, rank,
                          "the stream belongs to device " + std::to_string(d) + " but the communicator uses device " +
                              std::to_string(device));
#endif
}

}  // namespace comm::detail::nccl
