// A peer that exits mid-loop on NCCL: NCCL itself reports nothing when a peer on the same host dies
// (the kernels wait), so the watchdog must end the survivors' operations by the deadline (here
// 5 s) with comm::Timeout (or RemoteError where NCCL notices), stop the communicator, and later
// operations must fail at once. Then the survivors shrink: the new communicator has the N-1 of
// them in their old order, made by ncclCommShrink where NCCL has ncclCommRevoke (the watchdog
// revoked the failed communicator and kept it), and its all_reduce gives N-1. Standalone (no
// doctest harness: its end-of-run rendezvous would wait for the dead rank). Run under
// `comm-run -n N` (N >= 2); prints SKIPPED and exits 0 where the GPUs here cannot hold N ranks.
// With --shrink-pending the survivors do not wait for the error: right after the death they issue
// an all_reduce (which cannot complete) and call shrink() at once, so the old communicator still
// runs it: ncclCommShrink with NCCL_SHRINK_ABORT stops it, and its Work fails with RemoteError.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include <comm/backends/nccl.hpp>
#include <comm/communicator.hpp>

using Comm = comm::Communicator<comm::backends::Nccl>;
using namespace std::chrono_literals;

namespace {

/// What ncclCommShrink needs after a failure the watchdog saw first: ncclCommRevoke (else the
/// communicator was aborted and the shrink makes it afresh); 0: nothing to require.
constexpr int kRevokeNeeds = COMM_NCCL_HAS_REVOKE ? comm::detail::nccl::revoke_version : 0;

/// The survivors' shrink after the death: the N-1 survivors in their old order, made by
/// ncclCommShrink where the NCCL loaded has what this path needs (`needs`), and an all_reduce of
/// ones on the new communicator gives N-1. 0 when all holds.
int shrink_and_check(Comm& c, int n, int rank, float* d, const std::vector<float>& host, int needs) {
  const auto s0 = std::chrono::steady_clock::now();
  auto s = c.shrink();
  const double shrink_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count();
  std::printf("rank %d: shrink: rank %d of %d, made by %s, in %.0f ms\n", rank, s.rank(), s.size(),
              std::string(s.backend().made_by()).c_str(), shrink_ms);
  if (s.size() != n - 1 || s.rank() != rank) {
    std::printf("rank %d: wrong membership after the shrink\n", rank);
    return 1;
  }
  const int v = comm::nccl::runtime_version();
  if (COMM_NCCL_HAS_SHRINK && needs > 0 && v >= needs && v >= comm::detail::nccl::compiled_version &&
      s.backend().made_by() != "ncclCommShrink") {
    std::printf("rank %d: NCCL %s has what ncclCommShrink needs here, but the shrink made the communicator afresh\n",
                rank, comm::nccl::version_string(v).c_str());
    return 1;
  }
  const std::size_t count = host.size();
  if (cudaMemcpy(d, host.data(), count * sizeof(float), cudaMemcpyHostToDevice) != cudaSuccess) return 2;
  s.all_reduce(std::span<float>(d, count));
  float last = 0;
  if (cudaMemcpy(&last, d + count - 1, sizeof(float), cudaMemcpyDeviceToHost) != cudaSuccess) return 2;
  if (last != static_cast<float>(n - 1)) {
    std::printf("rank %d: wrong result %f after the shrink\n", rank, static_cast<double>(last));
    return 1;
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const bool shrink_pending = argc > 1 && std::string(argv[1]) == "--shrink-pending";
  const char* ws = std::getenv("WORLD_SIZE");
  const int n = ws ? std::atoi(ws) : 1;
  const int rank = std::getenv("RANK") ? std::atoi(std::getenv("RANK")) : 0;
  const auto dc = comm::nccl::device_count();
  if (n < 2) {
    if (rank == 0) std::printf("SKIPPED: the peer-death test needs at least 2 ranks\n");
    return 0;
  }
  if (dc.count <= 0) {
    if (rank == 0) std::printf("SKIPPED: no usable CUDA device (%s)\n", dc.why.c_str());
    return 0;
  }
  const char* multi = std::getenv("NCCL_MULTI_RANK_GPU_ENABLE");
  if (n > dc.count && (comm::nccl::runtime_version() < 23000 || !multi || std::string(multi) != "1")) {
    if (rank == 0)
      std::printf("SKIPPED: %d ranks would share %d GPU(s); NCCL %s needs >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1\n",
                  n, dc.count, comm::nccl::version_string(comm::nccl::runtime_version()).c_str());
    return 0;
  }

  comm::backends::Nccl::Options o;
  o.timeout = 5s;
  auto c = Comm::from_env(o);
  const int victim = n - 1;
  constexpr int kDeathIteration = 50;
  constexpr std::size_t kCount = 4096;
  float* d = nullptr;
  if (cudaMalloc(&d, kCount * sizeof(float)) != cudaSuccess) return 2;
  std::vector<float> host(kCount, 1.0f);

  auto death = std::chrono::steady_clock::now();
  for (int i = 0; i < 100000; ++i) {
    if (i == kDeathIteration) {
      death = std::chrono::steady_clock::now();
      if (rank == victim) {
        std::printf("rank %d: exiting abruptly before iteration %d\n", rank, i);
        std::fflush(stdout);
        ::_exit(0);
      }
      if (shrink_pending) {
        // Issued before anyone knows of the death (the liveness watch takes longer): still
        // running when shrink() starts, which must stop it (NCCL_SHRINK_ABORT) and fail it.
        comm::Work w;
        int needs = comm::detail::nccl::shrink_version;
        try {
          w = c.all_reduce(std::span<float>(d, kCount), comm::async);
        } catch (const comm::Error& e) {
          std::printf("rank %d: the death was known before the all_reduce was issued (%s); the shrink takes the "
                      "revoked communicator\n",
                      rank, e.what());
          needs = kRevokeNeeds;
        }
        if (const int r = shrink_and_check(c, n, rank, d, host, needs); r != 0) return r;
        if (needs == comm::detail::nccl::shrink_version) {
          if (!w.is_completed()) {
            std::printf("rank %d: the pending all_reduce had not ended when shrink() returned\n", rank);
            return 1;
          }
          try {
            w.synchronize();
            std::printf("rank %d: the pending all_reduce completed without its dead peer\n", rank);
            return 1;
          } catch (const comm::RemoteError& e) {
            std::printf("rank %d: the pending all_reduce failed: %s\n", rank, e.what());
          }
        }
        std::fflush(stdout);
        ::_exit(0);
      }
    }
    try {
      if (cudaMemcpy(d, host.data(), kCount * sizeof(float), cudaMemcpyHostToDevice) != cudaSuccess) return 2;
      c.all_reduce(std::span<float>(d, kCount), comm::async).wait();
      float last = 0;
      if (cudaMemcpy(&last, d + kCount - 1, sizeof(float), cudaMemcpyDeviceToHost) != cudaSuccess) return 2;
      if (last != static_cast<float>(n)) {
        std::printf("rank %d: wrong result %f at iteration %d\n", rank, static_cast<double>(last), i);
        return 1;
      }
    } catch (const comm::Error& e) {
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - death).count();
      const bool timeout = dynamic_cast<const comm::Timeout*>(&e) != nullptr;
      const bool remote = dynamic_cast<const comm::RemoteError*>(&e) != nullptr;
      std::printf("rank %d: %s at iteration %d, %.0f ms after the peer died: %s\n", rank,
                  timeout ? "Timeout" : remote ? "RemoteError" : "UNEXPECTED error kind", i, ms, e.what());
      if (!timeout && !remote) return 1;
      if (ms > 20000) {
        std::printf("rank %d: too slow\n", rank);
        return 1;
      }
      // The communicator is unusable now, at once.
      const auto t0 = std::chrono::steady_clock::now();
      try {
        c.all_reduce(std::span<float>(d, kCount));
        std::printf("rank %d: an operation after the failure did not fail\n", rank);
        return 1;
      } catch (const comm::Error&) {
      }
      if (std::chrono::steady_clock::now() - t0 > 1s) return 1;
      // The survivors go on without the dead rank (the watchdog revoked the failed communicator
      // and kept it where NCCL can: ncclCommShrink with NCCL_SHRINK_DEFAULT). Where NCCL itself
      // reported the death (an asynchronous error), the revoked communicator does not become
      // quiescent, the watchdog aborts it, and the shrink makes the new one afresh.
      int needs = kRevokeNeeds;
      try {
        if (const auto first = c.backend().failure()) std::rethrow_exception(first);
      } catch (const comm::Error& f) {
        if (comm::nccl::nccl_result_of(f)) needs = 0;
      }
      if (const int r = shrink_and_check(c, n, rank, d, host, needs); r != 0) return r;
      std::fflush(stdout);
      // Leave without the harness: the dead peer will never join a final rendezvous.
      ::_exit(0);
    }
  }
  std::printf("rank %d: the peer's death went unnoticed\n", rank);
  return 1;
}
