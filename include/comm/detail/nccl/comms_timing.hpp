#pragma once
// The comms log and trace of the NCCL engine (COMM_COMMS_LOG, COMM_TRACE; detail/diagnostics/comms_log.hpp).
// An NCCL call returns when the operation is enqueued, so its time is the GPU's: a pair of CUDA
// timing events is recorded on the communicator's stream around the NCCL call(s), and read with
// cudaEventElapsedTime once cudaEventQuery says the second one completed: at the next operations'
// issue (under the engine's lock, a query of the oldest pairs, no wait) and at the communicator's
// destroy (after the watchdog saw every operation end). Nothing here synchronizes a stream.
//
// The start written to the log and trace is an estimate: the later of the host time at which the
// operation was enqueued and the previous logged operation's end (operations on the stream run in
// order); the duration is exact (the events' elapsed time).
// all_to_all_v and batch_isend_irecv log bytes 0 here (their per-peer counts are not in the
// operation's description).

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include <comm/detail/diagnostics/comms_log.hpp>
#include <comm/detail/diagnostics/flight_recorder.hpp>

namespace comm::detail::nccl {

class CommsTimer {
 public:
  using Clock = std::chrono::steady_clock;
  /// Operations not yet seen complete beyond this many are not logged (a GPU far behind).
  static constexpr std::size_t max_pending = 4096;

  CommsTimer() = default;
  CommsTimer(const CommsTimer&) = delete;
  CommsTimer& operator=(const CommsTimer&) = delete;
  ~CommsTimer() { destroy_events(); }

  /// One branch per operation when the log is off.
  [[nodiscard]] bool on() const noexcept { return log_.on(); }

  void attach(int file_rank, int rank, int size, const std::string& name) {
    log_.attach("nccl", file_rank, rank, size, name);
    size_ = size;
  }

  /// Before the NCCL call (device current, engine lock held): the start event, recorded on
  /// `stream`; null when none could be had (the operation is then not logged).
  [[nodiscard]] cudaEvent_t begin(cudaStream_t stream) noexcept {
    if (pending_.size() >= max_pending) drain();
    if (pending_.size() >= max_pending) return nullptr;
    cudaEvent_t e = acquire();
    if (e != nullptr && cudaEventRecord(e, stream) != cudaSuccess) {
      release(e);
      return nullptr;
    }
    return e;
  }

  /// After the NCCL call: the end event, then the operations that completed so far are logged.
  /// `seq` is the collective sequence number (a point-to-point operation's own number).
  void end(cudaEvent_t start, cudaStream_t stream, const OpDesc& d, std::uint64_t seq) noexcept {
    if (start == nullptr) return;
    cudaEvent_t e = acquire();
    if (e == nullptr || cudaEventRecord(e, stream) != cudaSuccess) {
      release(start);
      release(e);
      return;
    }
    try {
      pending_.push_back(Pending{start, e, d, seq, Clock::now()});
    } catch (...) {
      release(start);
      release(e);
      return;
    }
    drain();
  }

  /// At the communicator's destroy, once its operations ended: logs what completed (a pair that
  /// did not complete, after a failure, is dropped), writes the summary and frees the events on
  /// `device`.
  void finish(int device) noexcept {
    if (!on()) return;
    int prev = -1;
    const bool restore = cudaGetDevice(&prev) == cudaSuccess && prev != device;
    if (restore) (void)cudaSetDevice(device);
    drain();
    for (const Pending& p : pending_) {
      release(p.start);
      release(p.end);
    }
    pending_.clear();
    destroy_events();
    if (restore) (void)cudaSetDevice(prev);
    log_.finish();
  }

 private:
  struct Pending {
    cudaEvent_t start;
    cudaEvent_t end;
    OpDesc desc;
    std::uint64_t seq;
    Clock::time_point issued;
  };

  /// Logs the completed operations at the front (in issue order), without waiting.
  void drain() noexcept {
    while (!pending_.empty()) {
      const Pending& p = pending_.front();
      const cudaError_t q = cudaEventQuery(p.end);
      if (q == cudaErrorNotReady) return;
      float ms = 0.0f;
      if (q == cudaSuccess && cudaEventElapsedTime(&ms, p.start, p.end) == cudaSuccess) {
        const auto dur = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::milli>(ms));
        const Clock::time_point start = p.issued > last_end_ ? p.issued : last_end_;
        last_end_ = start + dur;
        const std::size_t elem = dtype_bytes(p.desc.dtype);
        const bool counted = p.desc.kind != OpKind::all_to_all_v && p.desc.kind != OpKind::p2p_batch;
        log_.record(p.desc, traffic(p.desc.kind, counted ? p.desc.count : 0, elem, size_), p.seq, start, dur);
      } else {
        (void)cudaGetLastError();  // a failed operation: the watchdog reports it
      }
      release(p.start);
      release(p.end);
      pending_.pop_front();
    }
  }

  [[nodiscard]] cudaEvent_t acquire() noexcept {
    if (!free_.empty()) {
      cudaEvent_t e = free_.back();
      free_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    if (cudaEventCreateWithFlags(&e, cudaEventDefault) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    return e;
  }

  void release(cudaEvent_t e) noexcept {
    if (e == nullptr) return;
    try {
      free_.push_back(e);
    } catch (...) {
      (void)cudaEventDestroy(e);
    }
  }

  void destroy_events() noexcept {
    for (cudaEvent_t e : free_) (void)cudaEventDestroy(e);
    free_.clear();
  }

  CommsLog log_;
  int size_ = 1;
  std::deque<Pending> pending_;     // issued, not yet seen complete; under the engine's lock
  std::vector<cudaEvent_t> free_;   // timing events for reuse
  Clock::time_point last_end_{};
};

}  // namespace comm::detail::nccl
