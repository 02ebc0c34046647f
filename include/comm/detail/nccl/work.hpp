#pragma once
// The Work state of an NCCL operation: a CUDA event recorded on the communicator's stream after
// the operation. The watchdog completes the state when the event completes; Work::wait then
// orders the caller's current stream after the event (on_waited).

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <comm/detail/nccl/device.hpp>
#include <comm/detail/nccl/errors.hpp>
#include <comm/detail/nccl/watchdog.hpp>

namespace comm::detail::nccl {

/// Completion events of one device, reused across operations (creating one costs a few us).
class EventPool {
 public:
  static constexpr std::size_t max_cached = 256;

  explicit EventPool(int device) noexcept : device_(device) {}
  ~EventPool() {
    int prev = -1;
    const bool restore = cudaGetDevice(&prev) == cudaSuccess && prev != device_;
    if (restore) (void)cudaSetDevice(device_);
    for (auto e : free_) (void)cudaEventDestroy(e);  // errors at process exit are expected
    if (restore) (void)cudaSetDevice(prev);
  }
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  /// An event of this pool's device; the caller has made that device current.
  [[nodiscard]] cudaEvent_t acquire(const std::string& op, int rank) {
    {
      std::lock_guard lock(mu_);
      if (!free_.empty()) {
        auto e = free_.back();
        free_.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    COMM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), op, rank);
    return e;
  }

  void release(cudaEvent_t e) noexcept {
    if (e == nullptr) return;
    {
      std::lock_guard lock(mu_);
      if (free_.size() < max_cached) {
        try {
          free_.push_back(e);
          return;
        } catch (...) {  // no memory to cache it: destroy it instead
        }
      }
    }
    (void)cudaEventDestroy(e);
  }

  [[nodiscard]] int device() const noexcept { return device_; }

 private:
  int device_;
  std::mutex mu_;
  std::vector<cudaEvent_t> free_;
};

/// One operation issued on the communicator's stream.
class NcclOp final : public TrackedOp {
 public:
  NcclOp(std::string op, int rank, std::chrono::milliseconds timeout, std::uint64_t seq,
         std::shared_ptr<EventPool> pool, cudaStream_t stream)
      : TrackedOp(std::move(op), rank, timeout, seq), pool_(std::move(pool)), stream_(stream) {
    event_ = pool_->acquire(this->op(), rank);
  }
  ~NcclOp() override { pool_->release(event_); }

  [[nodiscard]] cudaEvent_t event() const noexcept { return event_; }

  Progress query(Fault& fault) noexcept override {
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaSuccess) return Progress::done;
    if (e == cudaErrorNotReady) return Progress::running;
    fault.kind = Fault::Kind::backend;
    fault.engine = NativeEngine::cuda;
    fault.code = static_cast<int>(e);
    try {
      fault.detail = "the operation failed on the device: cudaEventQuery: " + describe(e);
    } catch (...) {
    }
    return Progress::failed;
  }

  /// Work::wait: work the caller queues on its current stream (comm::nccl::current_stream() of the
  /// waiting thread) runs after the operation; the host does not block, except for a barrier
  /// (wait_on_host), whose point is that every rank has reached it.
  bool wait_on_stream() override {
    if (host_wait_) return false;
    order_caller_stream();
    return true;
  }

  /// Work::wait blocks the host until the operation completed (set before the Work is returned).
  void wait_on_host() noexcept { host_wait_ = true; }

  /// After a host wait (Work::synchronize, wait_for): the dependency is already satisfied, but
  /// adding it keeps the stream rule true for the caller's stream in every case.
  void on_waited() override { order_caller_stream(); }

 private:
  void order_caller_stream() {
    const cudaStream_t caller = comm::nccl::current_stream();
    if (caller == stream_) return;
    DeviceGuard guard(pool_->device(), op(), rank());
    COMM_CUDA_CHECK(cudaStreamWaitEvent(caller, event_, 0), op(), rank());
  }

  std::shared_ptr<EventPool> pool_;
  cudaStream_t stream_;
  cudaEvent_t event_ = nullptr;
  bool host_wait_ = false;
};

}  // namespace comm::detail::nccl
