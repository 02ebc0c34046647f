#pragma once
// Shrinking an NCCL communicator in place (ncclCommShrink, NCCL >= 2.27) and what keeps the old
// communicator usable for it: NcclCore's part of shrink(), revoke() and retire()
// (detail/engine/elastic.hpp), and the steps of Nccl::shrink_from_members (backends/nccl.hpp).
//
// ncclCommShrink needs the old communicator intact, but the watchdog must stop a failed
// communicator's kernels before it fails the pending Work (the caller may free their buffers then),
// and ncclCommAbort frees the communicator. Hence two ways to stop the kernels and keep it:
//  (a) shrink() holds its own failure of the old communicator (hold_next_retire, retire): later
//      operations fail at once, the pending ones wait until ncclCommShrink has stopped the kernels
//      (NCCL_SHRINK_ABORT) or the members chose a fresh create(); end_retire() then lets the
//      watchdog abort it (it is never used again) and fail the pending operations.
//  (b) a failure seen before shrink() (a deadline, NCCL's error, a peer's death, revoke()) on a
//      root communicator (Settings::may_keep) where NCCL has ncclCommRevoke: the watchdog revokes
//      it and keeps the handle instead of aborting it (revoke_and_keep), so that the shrink that
//      usually follows can still give it to ncclCommShrink.
// A grace period before the abort was not chosen: a Work must not report failure while kernels
// may still write its buffers.
//
// Shrinkable is a CRTP base of NcclCore, which names it a friend: the machinery works on the
// core's communicator handle, lock, watchdog and deadline, and keeps only its own three flags.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <comm/detail/base/logging.hpp>
#include <comm/detail/engine/comm_core.hpp>
#include <comm/detail/nccl/bootstrap.hpp>
#include <comm/detail/nccl/device.hpp>
#include <comm/detail/nccl/errors.hpp>
#include <comm/detail/nccl/types.hpp>
#include <comm/detail/nccl/watchdog.hpp>
#include <comm/error.hpp>
#include <comm/store.hpp>

namespace comm::detail::nccl {

/// shrink()'s choice between ncclCommShrink and a fresh ncclCommInitRankConfig, which every member
/// of the new communicator (`rank` of `size`) must make alike: each says whether it can (`mine`)
/// under "nccl_shrink/<rank>" on `store` (the shrink's own keys), then reads everyone's (one
/// multi_get, bounded by `timeout`). True only when every member can. A member that does not say
/// in time is named in comm::Timeout (op "shrink"): it died during the shrink, or is not running
/// this version of comm.
[[nodiscard]] inline bool agree_all(Store& store, int rank, int size, bool mine, std::chrono::milliseconds timeout) {
  constexpr const char* op = "shrink";
  const std::string base = "nccl_shrink/";
  std::vector<std::string> keys;
  keys.reserve(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) keys.push_back(base + std::to_string(r));
  std::vector<Store::Bytes> says;
  try {
    store.set(keys[static_cast<std::size_t>(rank)], std::string_view(mine ? "1" : "0"));
    says = store.multi_get(keys, timeout);
  } catch (const Error& err) {
    std::string missing;
    try {
      for (int r = 0; r < size; ++r)
        if (!store.check(keys[static_cast<std::size_t>(r)])) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    } catch (...) {  // the store itself is gone: its error says so
    }
    throw Timeout(op, rank,
                  (missing.empty() ? std::string("the members") : "new rank(s) " + missing) +
                      " did not say within " + std::to_string(timeout.count()) +
                      " ms whether they can call ncclCommShrink (died during the shrink?): " + err.what());
  }
  bool all = true;
  for (const auto& v : says) all = all && v.size() == 1 && v[0] == '1';
  return all;
}

/// ncclCommShrink's exclude list: the ranks of the old communicator (of `old_size`) that are not
/// in `members` (old ranks, ascending).
[[nodiscard]] inline std::vector<int> excluded_ranks(const std::vector<int>& members, int old_size) {
  std::vector<int> exclude;
  for (int r = 0, i = 0; r < old_size; ++r) {
    if (i < static_cast<int>(members.size()) && members[static_cast<std::size_t>(i)] == r)
      ++i;
    else
      exclude.push_back(r);
  }
  return exclude;
}

/// NcclCore's shrink, revoke and retire (see the top of this file). `Core` is NcclCore.
template <class Core>
class Shrinkable {
 public:
  /// The next retire() holds the failure (Nccl::shrink): see retire().
  void hold_next_retire() noexcept { hold_retire_.store(true, std::memory_order_release); }

  /// Ends this communicator for a reconfiguration: later operations fail at once, the watchdog
  /// fails the pending ones and ends the NCCL communicator (ncclCommAbort: it is not used again).
  /// After hold_next_retire() the watchdog holds (Watchdog::fail): the communicator stays intact
  /// for ncclCommShrink, which stops its kernels (NCCL_SHRINK_ABORT); end_retire() then lets the
  /// watchdog abort it and fail the pending operations.
  void retire(const std::string& why) {
    auto& c = core();
    retiring_.store(true, std::memory_order_release);
    const bool hold = hold_retire_.exchange(false, std::memory_order_acq_rel);
    if (c.record_failure(FailureKind::remote, why, {}))
      (void)c.watchdog_.fail(std::make_exception_ptr(RemoteError("shrink", c.rank(), why, {})), hold);
  }
  /// Ends retire()'s hold, if any (idempotent).
  void end_retire() {
    hold_retire_.store(false, std::memory_order_release);
    core().watchdog_.release();
  }
  [[nodiscard]] bool wait_retired(std::chrono::milliseconds grace) {
    return core().watchdog_.wait_idle(Clock::now() + grace);
  }

  /// Whether ncclCommShrink can make a communicator from this one now: compiled and loaded NCCL
  /// >= 2.27, an owned communicator not aborted (healthy, held by retire(), or revoked by the
  /// watchdog after a failure).
  [[nodiscard]] bool can_shrink_natively() const {
#if COMM_NCCL_HAS_SHRINK
    const auto& c = core();
    std::lock_guard lock(c.nccl_mu_);
    return c.comm_ != nullptr && c.owns_comm_ && runtime_version() >= shrink_version &&
           (revoked_ || !c.watchdog_.failed() || c.watchdog_.held());
#else
    return false;
#endif
  }

  /// ncclCommShrink of this (retired) communicator without the ranks `exclude` (old ranks, at least
  /// one; every remaining member passes the same list): the new communicator, which the caller
  /// owns. NCCL_SHRINK_ABORT while operations may still run on it (pending, held by retire()): NCCL
  /// stops its kernels first; NCCL_SHRINK_DEFAULT when it is quiet (none pending, or revoked by the
  /// watchdog). Non-blocking, polled until the timeout; on a failure or past it this communicator
  /// and the half-made one are aborted and the error thrown (comm::Timeout, or NCCL's). `flag`:
  /// the flag used, for the log.
  [[nodiscard]] ncclComm_t shrink_comm(std::vector<int> exclude, const InitConfig& config, int& flag) {
    constexpr const char* op = "shrink";
    auto& c = core();
#if COMM_NCCL_HAS_SHRINK
    std::lock_guard lock(c.nccl_mu_);
    if (c.comm_ == nullptr)
      throw BackendError(op, c.rank(), "the NCCL communicator was aborted before ncclCommShrink could use it");
    if (exclude.empty())
      throw InvalidArgument(op, c.rank(), "ncclCommShrink needs at least one rank to leave out");
    DeviceGuard guard(c.device_, op, c.rank());
    flag = !revoked_ && c.watchdog_.pending() > 0 ? NCCL_SHRINK_ABORT : NCCL_SHRINK_DEFAULT;
    ncclConfig_t cfg = make_config(config);
    c.op_deadline_ = Clock::now() + c.timeout();
    // As in split_comm: NCCL's own thread writes the new communicator here when it ends.
    auto* slot = new ncclComm_t(nullptr);
    bool job_done = false;  // NCCL no longer writes *slot
    try {
      const ncclResult_t r =
          ncclCommShrink(c.comm_, exclude.data(), static_cast<int>(exclude.size()), slot, &cfg, flag);
      if (r != ncclSuccess && r != ncclInProgress) {
        job_done = true;
        throw_nccl(r, "ncclCommShrink", op, c.rank(), c.comm_);
      }
      c.wait_ready(c.comm_, op, "ncclCommShrink", std::chrono::microseconds(200), std::chrono::milliseconds(20),
                   "ncclCommShrink did not complete",
                   " (a member that did not call it, or failed); both communicators were aborted", &job_done,
                   /*watch_failure=*/false);
      const ncclComm_t child = *slot;
      delete slot;
      slot = nullptr;
      if (child == nullptr)
        throw BackendError(op, c.rank(), "ncclCommShrink succeeded but returned no communicator");
      try {
        c.wait_ready(child, op, "ncclCommShrink", std::chrono::microseconds(100), std::chrono::milliseconds(20),
                     "the communicator made by ncclCommShrink was not ready", "; both communicators were aborted",
                     nullptr, /*watch_failure=*/false);
      } catch (...) {
        abort_comm(child, c.device_);
        throw;
      }
      return child;
    } catch (...) {
      // Also stops NCCL's shrink thread and joins it (the parent's abort reaches the child).
      (void)ncclCommAbort(c.comm_);
      c.comm_ = nullptr;
      job_done = true;
      if (slot != nullptr) {
        abort_comm(*slot, c.device_);
        delete slot;
      }
      throw;
    }
#else
    (void)exclude;
    (void)config;
    (void)flag;
    throw InvalidArgument(op, c.rank(),
                          "ncclCommShrink needs NCCL >= 2.27; comm was compiled against NCCL " +
                              version_string(compiled_version));
#endif
  }

  void revoke(const std::string& reason) {
    auto& c = core();
    const std::string why = c.publish_revoke(reason);
    const std::string by = "rank " + std::to_string(c.rank());
    if (c.record_failure(FailureKind::remote, why, by))
      c.watchdog_.fail(std::make_exception_ptr(RemoteError("revoke", c.rank(), why, by)));
  }

  /// Nccl::shrink_from_members' choice, made alike by every member of the new communicator
  /// (`rank` of `size`) through `store` (agree_all): true when all of them can give their old
  /// communicator to ncclCommShrink without `exclude`. False: the hold ends (the watchdog aborts the
  /// old communicator and fails its operations, waited for until `retired_by`) and the caller makes
  /// the new communicator afresh.
  [[nodiscard]] bool agree_native(const std::vector<int>& exclude, Store& store, int rank, int size,
                                  std::chrono::milliseconds timeout, Clock::time_point retired_by) {
    const bool mine = !exclude.empty() && can_shrink_natively();
    if (agree_all(store, rank, size, mine, timeout)) return true;
    end_retire();
    // The watchdog's abort of the old communicator may outlast the grace (on an H200, with the
    // grace as the bound, an operation queued behind a 300 ms host step was not yet failed when
    // shrink returned). The pending operations must end before shrink returns: the communicator's
    // timeout bounds the wait instead.
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(retired_by - Clock::now());
    if (!wait_retired(std::max(left, timeout)))
      detail::log(LogLevel::warn, "nccl: shrink on rank " + std::to_string(core().rank()) +
                              ": an operation of the old communicator still runs (it ends by its own deadline)");
    return false;
  }

  /// After agree_native: shrink_comm, then the end of the hold (NCCL stopped the old
  /// communicator's kernels: its operations may now report their failure), then the checks that
  /// the new communicator is `rank` of `size` and `stream` (if any) is on this device. The new
  /// communicator (the caller owns it); on any failure it is aborted and the error thrown.
  [[nodiscard]] ncclComm_t shrink_to(const std::vector<int>& exclude, const InitConfig& config, int rank, int size,
                                     std::optional<cudaStream_t> stream, int& flag) {
    constexpr const char* op = "shrink";
    const int device = core().device_;
    ncclComm_t child = nullptr;
    try {
      child = shrink_comm(exclude, config, flag);
    } catch (...) {
      end_retire();
      throw;
    }
    end_retire();
    if (!wait_retired(core().timeout()))
      detail::log(LogLevel::warn, "nccl: shrink on rank " + std::to_string(core().rank()) +
                                      ": an operation of the old communicator still runs (it ends by its own deadline)");
    int new_rank = -1, new_size = 0;
    try {
      COMM_NCCL_CHECK(ncclCommUserRank(child, &new_rank), op, rank, child);
      COMM_NCCL_CHECK(ncclCommCount(child, &new_size), op, rank, child);
      if (new_rank != rank || new_size != size)
        throw BackendError(op, rank,
                           "ncclCommShrink made rank " + std::to_string(new_rank) + " of " + std::to_string(new_size) +
                               ", the members agreed on rank " + std::to_string(rank) + " of " + std::to_string(size));
      if (stream) check_stream_device(*stream, device, op, rank);
    } catch (...) {
      abort_comm(child, device);
      throw;
    }
    return child;
  }

 protected:
  Shrinkable() = default;

  /// From now on a failure aborts the communicator, never revokes it: it is not used again
  /// (retire(), destruction).
  void never_keep() noexcept { retiring_.store(true, std::memory_order_release); }

  /// The watchdog's abort of a failed communicator (under nccl_mu_, device set): true when it was
  /// revoked and kept for a later ncclCommShrink (a root communicator not retired, where NCCL can
  /// revoke); false: the caller aborts it.
  [[nodiscard]] bool revoke_and_keep() noexcept {
    const auto& c = core();
    if (!c.settings_.may_keep || !c.owns_comm_ || retiring_.load(std::memory_order_acquire)) return false;
    revoked_ = revoke_quietly();
    return revoked_;
  }

 private:
  [[nodiscard]] Core& core() noexcept { return static_cast<Core&>(*this); }
  [[nodiscard]] const Core& core() const noexcept { return static_cast<const Core&>(*this); }

  /// ncclCommRevoke (under nccl_mu_, device set): stops the communicator's kernels and keeps it;
  /// true once NCCL reports it quiescent (ncclSuccess) within kRevokeSettle. False where NCCL has
  /// no revoke, it fails, or it does not settle (a communicator that had an asynchronous error
  /// keeps reporting it): the caller aborts then.
  bool revoke_quietly() noexcept {
#if COMM_NCCL_HAS_REVOKE
    const ncclComm_t comm = core().comm_;
    if (runtime_version() < revoke_version || runtime_version() < compiled_version) return false;
    const ncclResult_t r = ncclCommRevoke(comm, NCCL_REVOKE_DEFAULT);
    if (r != ncclSuccess && r != ncclInProgress) return false;
    const auto deadline = Clock::now() + std::min<std::chrono::milliseconds>(core().timeout(), kRevokeSettle);
    try {
      Backoff backoff(std::chrono::microseconds(20), std::chrono::milliseconds(5));
      for (;;) {
        ncclResult_t state = ncclInProgress;
        if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) return false;
        if (state == ncclSuccess) return true;
        if (state != ncclInProgress || Clock::now() >= deadline) return false;
        backoff.pause();
      }
    } catch (...) {
      return false;
    }
#else
    return false;
#endif
  }

  /// How long the watchdog waits for a revoked communicator to become quiescent before it aborts it.
  static constexpr std::chrono::milliseconds kRevokeSettle{5000};

  bool revoked_ = false;                  // the watchdog revoked comm_ after a failure and kept it; under nccl_mu_
  std::atomic<bool> retiring_{false};     // retire() ran: a failure aborts, never revokes
  std::atomic<bool> hold_retire_{false};  // hold_next_retire()
};

}  // namespace comm::detail::nccl
