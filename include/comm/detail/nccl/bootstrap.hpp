#pragma once
// Creating an NCCL communicator through a comm::Store:
//   1. each rank counts its NCCL communicators on the store ("comm/nccl/seq/<rank>"), so ranks
//      that create communicators in the same order agree on a key prefix, and checks the world
//      size of every rank (join_store, detail/engine/comm_core.hpp);
//   2. rank 0 creates the ncclUniqueId and publishes it under "<prefix>uid"; the others wait for
//      it (bounded by the deadline);
//   3. every rank calls ncclCommInitRankConfig with blocking = 0 and polls ncclCommGetAsyncError
//      until the communicator is ready, a peer published a failure, or the deadline passed (then
//      the half-made communicator is aborted and comm::Timeout thrown).
// A rank that fails on the way publishes "<prefix>failed" so that the others stop waiting at once
// with comm::RemoteError naming it instead of running into their deadline.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>

#include <comm/detail/base/logging.hpp>
#include <comm/detail/base/env.hpp>
#include <comm/detail/nccl/device.hpp>
#include <comm/detail/nccl/errors.hpp>
#include <comm/detail/nccl/types.hpp>
#include <comm/detail/nccl/watchdog.hpp>
#include <comm/error.hpp>
#include <comm/store.hpp>

namespace comm::detail::nccl {

/// Sleeps with exponential backoff between polls.
class Backoff {
 public:
  Backoff(std::chrono::microseconds first, std::chrono::microseconds max) noexcept : next_(first), max_(max) {}
  void pause() {
    std::this_thread::sleep_for(next_);
    next_ = std::min(next_ * 2, max_);
  }

 private:
  std::chrono::microseconds next_;
  std::chrono::microseconds max_;
};

/// The ncclConfig_t choices comm exposes (see NcclOptions).
struct InitConfig {
  int cga_cluster_size = -1;
  int min_ctas = -1;
  int max_ctas = -1;
  std::string net_name;
  std::function<void(ncclConfig_t&)> configure;
};

/// The store keys of one communicator's rendezvous (its CommPlace: join_store). The communicator
/// keeps the store and the prefix afterwards (subgroups, monitored_barrier).
struct Rendezvous {
  std::shared_ptr<Store> store;
  std::string prefix;     ///< "comm/nccl/<n>/"
  std::int64_t number = 1;  ///< n: this rank's NCCL communicators on this store so far
  [[nodiscard]] std::string uid_key() const { return prefix + "uid"; }
  [[nodiscard]] std::string failed_key() const { return prefix + "failed"; }
};

/// ncclCommAbort on `device` (the caller's device is restored).
inline void abort_comm(ncclComm_t comm, int device) noexcept {
  if (comm == nullptr) return;
  int prev = -1;
  const bool restore = cudaGetDevice(&prev) == cudaSuccess && prev != device;
  if (restore) (void)cudaSetDevice(device);
  (void)ncclCommAbort(comm);
  if (restore) (void)cudaSetDevice(prev);
}

/// ncclCommFinalize (flushes the communicator's work), polled until done or `timeout`, then
/// ncclCommDestroy; ncclCommAbort when finalizing fails or takes too long (`rank`: for the log).
inline void finalize_or_abort(ncclComm_t comm, std::chrono::milliseconds timeout, int rank) noexcept {
  ncclResult_t r = ncclCommFinalize(comm);
  ncclResult_t state = r;
  if (r == ncclSuccess || r == ncclInProgress) {
    const auto deadline = Clock::now() + timeout;
    Backoff backoff(std::chrono::microseconds(50), std::chrono::milliseconds(10));
    for (;;) {
      if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) state = ncclInternalError;
      if (state != ncclInProgress || Clock::now() >= deadline) break;
      try {
        backoff.pause();
      } catch (...) {
      }
    }
  }
  if (state == ncclSuccess) {
    (void)ncclCommDestroy(comm);
    return;
  }
  try {
    log(LogLevel::warn, "nccl on rank " + std::to_string(rank) + ": finalizing the communicator " +
                            (state == ncclInProgress ? "timed out" : "failed") + "; aborting it");
  } catch (...) {
  }
  (void)ncclCommAbort(comm);
}

/// Tells the other ranks that this one failed (best effort: the store may be gone too).
inline void publish_failure(const Rendezvous& rv, int rank, const std::string& what) noexcept {
  try {
    rv.store->set(rv.failed_key(), "rank " + std::to_string(rank) + ": " + what);
  } catch (...) {
  }
}

/// The failure another rank published, if any (store errors count as none).
[[nodiscard]] inline std::optional<std::string> peer_failure(const Rendezvous& rv) noexcept {
  try {
    if (!rv.store->check(rv.failed_key())) return std::nullopt;
    auto v = rv.store->get(rv.failed_key());
    return std::string(v.begin(), v.end());
  } catch (...) {
    return std::nullopt;
  }
}

[[noreturn]] inline void throw_peer_failure(const std::string& published, int rank) {
  std::string peer;
  if (published.starts_with("rank ")) peer = published.substr(5, published.find(':') - 5);
  throw RemoteError("nccl.init", rank, "another rank failed to create the communicator: " + published, peer);
}

/// Rank 0 creates and publishes the unique id; the others wait for it until `deadline`.
[[nodiscard]] inline ncclUniqueId exchange_unique_id(const Rendezvous& rv, int rank, Clock::time_point deadline,
                                                     std::chrono::milliseconds timeout) {
  ncclUniqueId id{};
  if (rank == 0) {
    COMM_NCCL_CHECK(ncclGetUniqueId(&id), "nccl.init", rank, nullptr);
    rv.store->set(rv.uid_key(), std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(&id), sizeof(id)));
    return id;
  }
  Backoff backoff(std::chrono::milliseconds(1), std::chrono::milliseconds(50));
  for (;;) {
    if (rv.store->check(rv.uid_key())) break;
    if (auto f = peer_failure(rv)) throw_peer_failure(*f, rank);
    if (Clock::now() >= deadline)
      throw Timeout("nccl.init", rank,
                    "rank 0 did not publish the NCCL unique id (store key '" + rv.uid_key() + "') within " +
                        std::to_string(timeout.count()) + " ms",
                    "0");
    backoff.pause();
  }
  const auto v = rv.store->get(rv.uid_key());
  if (v.size() != sizeof(id))
    throw BackendError("nccl.init", rank,
                       "store key '" + rv.uid_key() + "' holds " + std::to_string(v.size()) + " bytes, expected an " +
                           std::to_string(sizeof(id)) + "-byte ncclUniqueId");
  std::memcpy(&id, v.data(), sizeof(id));
  return id;
}

/// A hint for init failures when local ranks outnumber the GPUs (NCCL < 2.30 refuses that).
[[nodiscard]] inline std::string sharing_hint() {
  const auto dc = comm::nccl::device_count();
  int local = -1;
  try {
    local = env_nonneg_int("LOCAL_WORLD_SIZE").value_or(-1);
  } catch (...) {
  }
  if (dc.count <= 0 || local <= dc.count) return {};
  return std::to_string(local) + " local ranks share " + std::to_string(dc.count) +
         " GPU(s): NCCL before 2.30 refuses several ranks on one GPU; from 2.30 set NCCL_MULTI_RANK_GPU_ENABLE=1";
}

/// The ncclConfig_t of a new communicator (non-blocking: its deadline depends on it). It points
/// into `c` (netName), which must outlive its use.
[[nodiscard]] inline ncclConfig_t make_config(const InitConfig& c) {
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  if (c.cga_cluster_size >= 0) cfg.cgaClusterSize = c.cga_cluster_size;
  if (c.min_ctas >= 0) cfg.minCTAs = c.min_ctas;
  if (c.max_ctas >= 0) cfg.maxCTAs = c.max_ctas;
  if (!c.net_name.empty()) cfg.netName = c.net_name.c_str();
  if (c.configure) c.configure(cfg);
  cfg.blocking = 0;  // whatever `configure` did
  return cfg;
}

/// ncclCommInitRankConfig (non-blocking) on `device`, polled until ready or `deadline`.
[[nodiscard]] inline ncclComm_t init_comm(const ncclUniqueId& id, int rank, int size, int device,
                                          const InitConfig& c, const Rendezvous* rv, Clock::time_point deadline,
                                          std::chrono::milliseconds timeout) {
  const std::string op = "nccl.init";
  DeviceGuard guard(device, op, rank);
  ncclConfig_t cfg = make_config(c);

  ncclComm_t comm = nullptr;
  auto fail = [&](ncclResult_t r, const char* call) {
    // Take NCCL's text before the abort frees the communicator.
    std::string detail = std::string(call) + " failed: " + describe(r, comm);
    if (const auto hint = sharing_hint(); !hint.empty()) detail += " (" + hint + ")";
    if (comm != nullptr) (void)ncclCommAbort(comm);
    const int code = static_cast<int>(r);
    if (r == ncclInvalidArgument || r == ncclInvalidUsage)
      throw EngineError<InvalidArgument>(NativeEngine::nccl, code, op, rank, detail);
    if (r == ncclRemoteError) throw EngineError<RemoteError>(NativeEngine::nccl, code, op, rank, detail);
    throw EngineError<BackendError>(NativeEngine::nccl, code, op, rank, detail);
  };

  const ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) fail(r, "ncclCommInitRankConfig");
  Backoff backoff(std::chrono::microseconds(200), std::chrono::milliseconds(20));
  auto next_peer_check = Clock::now();
  bool store_usable = rv != nullptr;
  for (;;) {
    ncclResult_t state = ncclInProgress;
    const ncclResult_t q = ncclCommGetAsyncError(comm, &state);
    if (q != ncclSuccess) fail(q, "ncclCommGetAsyncError");
    if (state == ncclSuccess) return comm;
    if (state != ncclInProgress) fail(state, "ncclCommInitRankConfig");
    const auto now = Clock::now();
    if (now >= deadline) {
      (void)ncclCommAbort(comm);
      throw Timeout(op, rank,
                    "ncclCommInitRankConfig did not complete within " + std::to_string(timeout.count()) +
                        " ms (ranks that never joined, or a peer that failed); the communicator was aborted");
    }
    // A peer that failed before joining publishes it; the store may legitimately go away once
    // rank 0 is done, so store errors only stop this check.
    if (store_usable && now >= next_peer_check) {
      next_peer_check = now + std::chrono::milliseconds(100);
      try {
        if (rv->store->check(rv->failed_key())) {
          auto v = rv->store->get(rv->failed_key());
          (void)ncclCommAbort(comm);
          throw_peer_failure(std::string(v.begin(), v.end()), rank);
        }
      } catch (const RemoteError& e) {
        if (e.op() == "nccl.init") throw;
        store_usable = false;
      } catch (const Error&) {
        store_usable = false;
      }
    }
    backoff.pause();
  }
}

}  // namespace comm::detail::nccl
