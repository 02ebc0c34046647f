#pragma once
// The NCCL engine's desync check (options.desync_check): before each collective, every rank's
// 32-byte fingerprint of the operation (detail/diagnostics/desync.hpp) is all-gathered with
// ncclAllGather on the communicator's stream and compared on the host. It runs on the device
// because an NCCL communicator may have no store (adopted), and on the stream so that it orders
// like the operation it precedes; the host waits for it, which also makes each operation wait for
// the earlier ones (a debugging mode).
//
// DesyncCheck is a CRTP base of NcclCore, which names it a friend: the exchange runs on the core's
// communicator, stream and deadline; the base keeps only the exchange's buffers.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <string>

#include <comm/detail/diagnostics/desync.hpp>
#include <comm/detail/nccl/bootstrap.hpp>
#include <comm/detail/nccl/errors.hpp>
#include <comm/detail/nccl/watchdog.hpp>
#include <comm/diagnostics.hpp>
#include <comm/error.hpp>

namespace comm::detail::nccl {

/// NcclCore's desync check (see the top of this file). `Core` is NcclCore.
template <class Core>
class DesyncCheck {
 protected:
  DesyncCheck() = default;

  /// The exchange's buffers, for a communicator of `size` ranks with the check on (constructor:
  /// `op`, `rank` name a failure): every rank's fingerprint in fp_dev_[0, size), this rank's own at
  /// [size], and the same in pinned host memory.
  void allocate_fingerprints(int size, const std::string& op, int rank) {
    const std::size_t bytes = (static_cast<std::size_t>(size) + 1) * sizeof(Fingerprint);
    COMM_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&fp_dev_), bytes), op, rank);
    COMM_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&fp_host_), bytes, cudaHostAllocDefault), op, rank);
    COMM_CUDA_CHECK(cudaEventCreateWithFlags(&fp_done_, cudaEventDisableTiming), op, rank);
  }

  /// Frees the buffers (the core's release; the device is set).
  void free_fingerprints() noexcept {
    if (fp_dev_ != nullptr) (void)cudaFree(fp_dev_);
    if (fp_host_ != nullptr) (void)cudaFreeHost(fp_host_);
    if (fp_done_ != nullptr) (void)cudaEventDestroy(fp_done_);
    fp_dev_ = nullptr;
    fp_host_ = nullptr;
    fp_done_ = nullptr;
  }

  /// The desync check (under nccl_mu_, on the device): an ncclAllGather of every rank's
  /// fingerprint of operation `seq` (the flight recorder's number; the fingerprint carries `coll`,
  /// the collective sequence number, which matches across ranks whatever point-to-point operations
  /// some of them ran), waited for on the host, then the comparison. A mismatch throws DesyncError
  /// on every rank and leaves the communicator usable (nothing of the operation was sent); a failed
  /// or late exchange is the communicator's failure. Never called for point-to-point operations.
  void check_desync(const OpDesc& d, std::uint64_t seq, std::uint64_t coll) {
    auto& c = core();
    const char* op = op_name(d.kind);
    constexpr std::size_t fp = sizeof(Fingerprint);
    const std::size_t n = static_cast<std::size_t>(c.size());
    try {
      Fingerprint* mine = fp_host_ + n;
      *mine = fingerprint(coll, d);
      std::byte* dev_mine = fp_dev_ + n * fp;
      COMM_CUDA_CHECK(cudaMemcpyAsync(dev_mine, mine, fp, cudaMemcpyHostToDevice, c.stream_), op, c.rank());
      if (COMM_NCCL_CHECK(ncclAllGather(dev_mine, fp_dev_, fp, ncclUint8, c.comm_, c.stream_), op, c.rank(),
                          c.comm_) == ncclInProgress)
        c.wait_enqueued(op);
      COMM_CUDA_CHECK(cudaMemcpyAsync(fp_host_, fp_dev_, n * fp, cudaMemcpyDeviceToHost, c.stream_), op, c.rank());
      COMM_CUDA_CHECK(cudaEventRecord(fp_done_, c.stream_), op, c.rank());
      Backoff backoff(std::chrono::microseconds(2), std::chrono::milliseconds(1));
      for (;;) {
        const cudaError_t e = cudaEventQuery(fp_done_);
        if (e == cudaSuccess) break;
        if (e != cudaErrorNotReady) {
          (void)cudaGetLastError();
          throw_cuda(e, "cudaEventQuery", op, c.rank(), "the desync check's fingerprint exchange failed: ");
        }
        ncclResult_t state = ncclSuccess;
        COMM_NCCL_CHECK(ncclCommGetAsyncError(c.comm_, &state), op, c.rank(), c.comm_);
        if (state != ncclSuccess && state != ncclInProgress)
          throw_nccl(state, "ncclCommGetAsyncError", op, c.rank(), c.comm_);
        c.throw_if_failed(op);
        if (Clock::now() >= c.op_deadline_)
          throw Timeout(op, c.rank(),
                        "the desync check's fingerprint exchange before op #" + std::to_string(seq) +
                            " did not complete within " + std::to_string(c.timeout().count()) +
                            " ms (a rank is late, hung, or runs without the check: it must be on for every rank "
                            "or none); the communicator was aborted");
        backoff.pause();
      }
    } catch (...) {
      c.fail_comm(seq, std::current_exception());
      throw;
    }
    check_fingerprints(std::span<const Fingerprint>(fp_host_, n), op, c.rank());
  }

 private:
  [[nodiscard]] Core& core() noexcept { return static_cast<Core&>(*this); }

  std::byte* fp_dev_ = nullptr;     // (size + 1) fingerprints on the device
  Fingerprint* fp_host_ = nullptr;  // and in pinned host memory
  cudaEvent_t fp_done_ = nullptr;   // the exchange's end on the stream
};

}  // namespace comm::detail::nccl
