#pragma once
// The NCCL engine's core, under the operations of engine.hpp: the communicator handle, its
// stream, the issue path of every operation, split, monitored_barrier, the watchdog target and the
// communicator's lifetime. Identity, the membership check, the flight recorder and its dumps, the
// first-failure record and the liveness watch are CommCore's (detail/engine/comm_core.hpp), shared
// with the host engines.
//
// Per operation (under the engine's lock: NCCL allows one thread at a time per communicator):
//   1. the communicator's stream waits for the caller's current stream (an event, skipped when
//      they are the same stream);
//   2. the NCCL call is enqueued on the communicator's stream; a non-blocking communicator may
//      answer ncclInProgress, then ncclCommGetAsyncError is polled until it is enqueued (bounded by
//      the deadline);
//   3. a completion event is recorded and handed to the watchdog with the deadline;
//   4. blocking form: the caller's current stream waits for that event (no host wait; barrier
//      also waits on the host); async form: a Work on the event is returned.
// With the desync check on, step 1 is preceded by an ncclAllGather of every rank's 32-byte
// fingerprint of the operation on the communicator's stream, which the host waits for (so the
// operation waits for the earlier ones) before it compares them (desync_check.hpp).
// Point-to-point operations (send, recv, batch_isend_irecv) involve two ranks, not the group: they
// skip the desync check and take no collective sequence number (the fingerprint's), so that it
// matches across ranks whatever point-to-point operations some of them run in between.
//
// Every operation (and split, monitored_barrier) gets the next sequence number under the lock and
// goes into the flight recorder: queued when issued, started when it reaches the head of the
// stream (the watchdog saw its predecessors complete), completed or failed as the watchdog sees it.
// A failure (the watchdog's verdict, or a peer's death seen by the liveness watch) is recorded in
// the core, stops the NCCL communicator's kernels (ncclCommAbort when the engine may; a root
// communicator where NCCL has ncclCommRevoke is revoked and kept for ncclCommShrink instead:
// shrink.hpp) and then fails every pending operation.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include <comm/detail/engine/comm_core.hpp>
#include <comm/detail/diagnostics/flight_recorder.hpp>
#include <comm/detail/base/logging.hpp>
#include <comm/detail/nccl/bootstrap.hpp>
#include <comm/detail/nccl/comms_timing.hpp>
#include <comm/detail/nccl/desync_check.hpp>
#include <comm/detail/nccl/device.hpp>
#include <comm/detail/nccl/errors.hpp>
#include <comm/detail/nccl/reduction.hpp>
#include <comm/detail/nccl/shrink.hpp>
#include <comm/detail/nccl/types.hpp>
#include <comm/detail/nccl/watchdog.hpp>
#include <comm/detail/nccl/work.hpp>
#include <comm/detail/diagnostics/nvtx.hpp>
#include <comm/diagnostics.hpp>
#include <comm/error.hpp>
#include <comm/store.hpp>
#include <comm/types.hpp>
#include <comm/work.hpp>

namespace comm::detail::nccl {

/// What the engine needs from the backend options besides the core's (CoreConfig), resolved.
struct Settings {
  GatherAlgorithm gather = GatherAlgorithm::p2p;  ///< native or p2p (never automatic)
  bool check_pointers = true;
  bool may_abort = true;  ///< the watchdog may ncclCommAbort the communicator after a failure
  /// After a failure the watchdog stops the kernels with ncclCommRevoke and keeps the communicator
  /// (where NCCL has it), as the parent of a later ncclCommShrink; root communicators only (they
  /// alone can shrink). Off, or where revoking fails or does not settle: ncclCommAbort.
  bool may_keep = false;
  WatchdogTiming timing{};
};

/// The error for a subgroup or monitored_barrier on a communicator without a store.
[[nodiscard]] inline InvalidArgument no_store_error(const std::string& op, int rank) {
  return InvalidArgument(op, rank,
                         "this communicator was adopted from an ncclComm_t and has no store; " + op +
                             " needs one (create the communicator with create() or from_env(); split works "
                             "without a store)");
}

class NcclCore : public WatchTarget, public CommCore, public DesyncCheck<NcclCore>, public Shrinkable<NcclCore> {
  // Both work on the handle, the stream, the lock, the watchdog and the deadline.
  friend class DesyncCheck<NcclCore>;
  friend class Shrinkable<NcclCore>;

 public:
  /// Takes `comm` (destroyed, or aborted after a failure, by the engine when `owns_comm`; else left
  /// to its owner) and runs on `stream`, or on a stream of its own when there is none.
  /// `place`: its store and key prefix (join_store), or adopted_place(); a root communicator on a
  /// TcpStore starts the liveness watch.
  NcclCore(ncclComm_t comm, bool owns_comm, int rank, int size, int device, std::optional<cudaStream_t> stream,
           Settings settings, const CoreConfig& core, CommPlace place)
      : CommCore(std::move(place), rank, size, core, "nccl"),
        comm_(comm),
        owns_comm_(owns_comm),
        device_(device),
        settings_(std::move(settings)),
        events_(std::make_shared<EventPool>(device)),
        watchdog_(*this, rank, settings_.timing) {
    try {
      const std::string op = "nccl.init";
      DeviceGuard guard(device_, op, rank);
      if (stream) {
        stream_ = *stream;
      } else {
        COMM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), op, rank);
        owns_stream_ = true;
      }
      COMM_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), op, rank);
      COMM_CUDA_CHECK(cudaMalloc(&scratch_, sizeof(float)), op, rank);
      COMM_CUDA_CHECK(cudaMemsetAsync(scratch_, 0, sizeof(float), stream_), op, rank);
      int cc_major = 0, cc_minor = 0;
      COMM_CUDA_CHECK(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, device_), op, rank);
      COMM_CUDA_CHECK(cudaDeviceGetAttribute(&cc_minor, cudaDevAttrComputeCapabilityMinor, device_), op, rank);
      rules_ = ReductionRules(rank, device_, cc_major, cc_minor);
      if (desync_check()) allocate_fingerprints(size, op, rank);
      comms_.attach(file_rank(), rank, size, name());  // COMM_COMMS_LOG / COMM_TRACE
    } catch (...) {
      release(/*healthy=*/false);
      throw;
    }
    watchdog_.start();
    // Last: its news may come at once and goes through the watchdog.
    start_liveness_once([this](int peer, const std::string& why, bool echo) { peer_failed(peer, why, echo); });
  }

  NcclCore(const NcclCore&) = delete;
  NcclCore& operator=(const NcclCore&) = delete;

  /// Lets issued operations finish (each ends by its deadline; a peer's death seen by the liveness
  /// watch ends them sooner), stops the watch and the watchdog, then finalizes and destroys an
  /// owned communicator (aborting it if that does not finish in time).
  ~NcclCore() override {
    never_keep();  // never used again: a failure now aborts, never revokes
    (void)watchdog_.wait_idle(Clock::now() + timeout() + std::chrono::seconds(5));
    stop_liveness();  // before the watchdog: the watch calls into it
    watchdog_.stop();
    comms_.finish(device_);  // the comms log's last operations and summary
    dump_at_end();
    release(/*healthy=*/!watchdog_.failed());
  }

  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }
  [[nodiscard]] GatherAlgorithm gather_algorithm() const noexcept { return settings_.gather; }
  [[nodiscard]] bool owns_comm() const noexcept { return owns_comm_; }
  /// The NCCL communicator (null once aborted; after a failure a revoked one may stay, see
  /// Settings::may_keep).
  [[nodiscard]] ncclComm_t comm() const {
    std::lock_guard lock(nccl_mu_);
    return comm_;
  }
  /// Operations issued and not yet seen complete.
  [[nodiscard]] std::size_t pending() const { return watchdog_.pending(); }
  /// The first failure of the communicator, or null.
  [[nodiscard]] std::exception_ptr failure() const { return watchdog_.failure(); }

  /// The liveness watch's news (detail/engine/liveness.hpp): the communicator's failure, RemoteError
  /// naming `peer`; the watchdog then aborts the NCCL communicator (when it may) and fails every
  /// pending operation, as after any other failure. Any thread.
  void peer_failed(int peer, const std::string& why, bool /*echo: NCCL ranks announce no closed connection*/ = false) {
    if (auto f = note_peer_failure(peer, why))
      watchdog_.fail(std::make_exception_ptr(RemoteError("liveness", rank(), f->what, f->peer)));
  }

  // shrink, grow, revoke (detail/engine/elastic.hpp): Shrinkable's (shrink.hpp).

  /// Blocks the host until every operation issued so far has completed (bounded by the timeout),
  /// then throws the communicator's failure if it has one.
  void synchronize() { wait_issued("synchronize"); }

  /// ncclCommSplit, a collective over every rank (an operation "split" in the sequence, with the
  /// desync check when on): the new communicator (the caller owns it), or null for a negative
  /// color. Ends by the timeout; a failure or the deadline fails (and aborts) this communicator,
  /// as a failed operation does, and aborts the half-made new one.
  [[nodiscard]] ncclComm_t split(int color, int key, const InitConfig& config) {
    constexpr const char* op = "split";
    const OpDesc d{OpKind::split, OpDesc::none, OpDesc::none, -1, 0};
    throw_if_failed(op);  // before the lock as well, as in issue_state
    std::lock_guard lock(nccl_mu_);
    throw_if_failed(op);
    if (comm_ == nullptr) throw BackendError(op, rank(), "the NCCL communicator is no longer usable");
    DeviceGuard guard(device_, op, rank());
    const std::uint64_t seq = seq_++;
    const std::uint64_t coll = coll_seq_++;
    const nvtx::ScopedRange range(op, 0, OpDesc::none, seq);  // COMM_NVTX=1 (detail/diagnostics/nvtx.hpp)
    recorder().issued(seq, d);
    op_deadline_ = Clock::now() + timeout();
    try {
      if (desync_check()) check_desync(d, seq, coll);
      recorder().started(seq);
      ncclComm_t child = split_comm(color, key, config, seq);
      recorder().completed(seq);
      return child;
    } catch (...) {
      op_error(seq, std::current_exception());
      throw;
    }
  }

  /// See detail/diagnostics/monitored_barrier.hpp: through the store, after every operation issued so far has
  /// completed (waited for on the host, bounded by this communicator's timeout).
  void monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks) {
    constexpr const char* op = "monitored_barrier";
    if (!store()) throw no_store_error(op, rank());
    std::uint64_t seq = 0, index = 0;
    nvtx::ScopedRange range;  // COMM_NVTX=1 (detail/diagnostics/nvtx.hpp)
    {
      std::lock_guard lock(nccl_mu_);
      throw_if_failed(op);
      seq = seq_++;
      range.push(op, 0, OpDesc::none, seq);
      index = next_monitored_barrier();
      recorder().issued(seq, OpDesc{OpKind::monitored_barrier, OpDesc::none, OpDesc::none, -1, 0});
    }
    try {
      wait_issued(op);
      recorder().started(seq);
      store_barrier(index, timeout, wait_all_ranks);
      recorder().completed(seq);
    } catch (const std::exception& e) {
      recorder().failed(seq, e.what());
      dump_after_error();
      throw;
    }
  }

  // ---- WatchTarget ----

  void on_watchdog_start() noexcept override { (void)cudaSetDevice(device_); }

  std::optional<Fault> async_error() noexcept override {
    std::unique_lock lock(nccl_mu_, std::try_to_lock);
    if (!lock.owns_lock() || comm_ == nullptr) return std::nullopt;  // busy issuing: it checks itself
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r == ncclSuccess && (state == ncclSuccess || state == ncclInProgress)) return std::nullopt;
    Fault f;
    f.engine = NativeEngine::nccl;
    const ncclResult_t bad = r != ncclSuccess ? r : state;
    f.code = static_cast<int>(bad);
    f.kind = bad == ncclRemoteError ? Fault::Kind::remote : Fault::Kind::backend;
    try {
      f.detail = (r != ncclSuccess ? "ncclCommGetAsyncError failed: " : "NCCL reported an asynchronous error: ") +
                 describe(bad, comm_) + "; the watchdog aborted the communicator";
    } catch (...) {
    }
    return f;
  }

  void abort() noexcept override {
    // An adopted communicator is its owner's to abort (checked before locking: a blocking adopted
    // communicator may hold the lock inside an NCCL call that waits for a dead peer).
    if (!settings_.may_abort) return;
    std::lock_guard lock(nccl_mu_);
    if (comm_ == nullptr) return;
    int prev = -1;
    const bool restore = cudaGetDevice(&prev) == cudaSuccess && prev != device_;
    if (restore) (void)cudaSetDevice(device_);
    // A failed root communicator may be revoked and kept for the shrink that usually follows.
    if (!revoke_and_keep()) {
      (void)ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    if (restore) (void)cudaSetDevice(prev);
  }

  void op_started(std::uint64_t seq) noexcept override { recorder().started(seq); }
  void op_completed(std::uint64_t seq) noexcept override { recorder().completed(seq); }
  void op_failed(std::uint64_t seq, const std::exception_ptr& e) noexcept override { record_op_failed(seq, e); }
  /// The core's failure record follows the watchdog's (which keeps the exception itself, with
  /// NCCL's or CUDA's native code); a death the liveness watch reported is recorded already.
  void failure_handled(const std::exception_ptr& cause) noexcept override {
    try {
      try {
        std::rethrow_exception(cause);
      } catch (const Error& e) {
        (void)record_failure(comm::detail::kind_of(e), e.what(), e.peer());
      } catch (...) {
        (void)record_failure(FailureKind::backend, what_of(cause), {});
      }
    } catch (...) {  // no memory for the text: the watchdog's record stands
    }
    dump_after_error();
  }

 protected:
  [[nodiscard]] const ReductionRules& rules() const noexcept { return rules_; }
  /// The barrier's all_reduce buffer (one float on the device).
  [[nodiscard]] float* scratch() const noexcept { return scratch_; }

  // ---- the common path of every operation ----

  template <class Launch, class Enqueue>
  auto issue(const OpDesc& d, Launch, bool empty, Enqueue&& enqueue, bool host_wait = false) {
    constexpr bool is_async = std::is_same_v<Launch, async_t>;
    // COMM_NVTX=1: "comm.<op> count=<n> type=<t> seq=<s>" around the host side, up to the return
    // (a blocking barrier's host wait included); off, one branch (detail/diagnostics/nvtx.hpp).
    nvtx::ScopedRange range;
    std::shared_ptr<NcclOp> state = issue_state(d, is_async, empty, enqueue, range);
    if constexpr (is_async) {
      if (host_wait) state->wait_on_host();  // an async barrier's Work::wait blocks, as torch's does
      return Work(std::move(state));
    } else {
      if (host_wait) wait_host(*state);
    }
  }

  /// Steps 1-3 of every operation (see the top of this file), and step 4 of the blocking form
  /// (`is_async` false: the caller's current stream waits for the operation): the issued
  /// operation's state, followed by the watchdog. Point-to-point operations (send, recv,
  /// batch_isend_irecv) take no collective sequence number and skip the desync check.
  template <class Enqueue>
  std::shared_ptr<NcclOp> issue_state(const OpDesc& d, bool is_async, bool empty, Enqueue& enqueue,
                                      nvtx::ScopedRange& range) {
    const char* op = op_name(d.kind);
    std::shared_ptr<NcclOp> state;
    // Checked before the lock too: after a failure the watchdog holds nccl_mu_ while NCCL aborts
    // (which can take a second), and a later call must fail at once with the first cause.
    throw_if_failed(op);
    std::lock_guard lock(nccl_mu_);
    throw_if_failed(op);
    if (comm_ == nullptr)  // adopted and failed, or aborted: failure() says why
      throw BackendError(op, rank(), "the NCCL communicator is no longer usable");
    DeviceGuard guard(device_, op, rank());
    const std::uint64_t seq = seq_++;
    const bool p2p = is_p2p(d.kind);
    const std::uint64_t coll = p2p ? 0 : coll_seq_++;
    range.push(op, d.count, d.dtype, seq);
    recorder().issued(seq, d);
    op_deadline_ = Clock::now() + timeout();
    const cudaStream_t caller = comm::nccl::current_stream();
    const bool same_stream = caller == stream_;
    try {
      if (desync_check() && !p2p) check_desync(d, seq, coll);
      if (!same_stream) {
        COMM_CUDA_CHECK(cudaEventRecord(ready_, caller), op, rank());
        COMM_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0), op, rank());
      }
      state = std::make_shared<NcclOp>(op, rank(), timeout(), seq, events_, stream_);
      // COMM_COMMS_LOG / COMM_TRACE: timing events around the NCCL call, read later (comms_timing.hpp).
      const cudaEvent_t log_start = comms_.on() ? comms_.begin(stream_) : nullptr;
      if (!empty) enqueue_checked(op, seq, enqueue);
      if (log_start != nullptr) comms_.end(log_start, stream_, d, p2p ? seq : coll);
      try {
        COMM_CUDA_CHECK(cudaEventRecord(state->event(), stream_), op, rank());
        watchdog_.track(state, op_deadline_);
      } catch (...) {
        // Issued but no longer followed: nothing could tell when it ends, so the communicator
        // cannot be trusted any more.
        fail_comm(seq, std::current_exception());
        throw;
      }
    } catch (...) {
      op_error(seq, std::current_exception());
      throw;
    }
    if (!is_async && !same_stream) COMM_CUDA_CHECK(cudaStreamWaitEvent(caller, state->event(), 0), op, rank());
    return state;
  }

  /// Runs the NCCL call(s); InvalidArgument leaves the communicator usable (NCCL did nothing),
  /// every other failure is the communicator's failure.
  template <class Enqueue>
  void enqueue_checked(const char* op, std::uint64_t seq, Enqueue& enqueue) {
    try {
      if (enqueue(comm_, stream_) == ncclInProgress) wait_enqueued(op);
    } catch (const InvalidArgument&) {
      throw;
    } catch (...) {
      fail_comm(seq, std::current_exception());
      throw;
    }
  }

  /// Operation `seq` failed on the issuing thread: the flight recorder says so (a desync, after
  /// which the communicator stays usable, is also dumped).
  void op_error(std::uint64_t seq, const std::exception_ptr& e) noexcept {
    record_op_failed(seq, e);
    try {
      std::rethrow_exception(e);
    } catch (const DesyncError&) {
      dump_after_error();
    } catch (...) {
    }
  }

  /// Operation `seq` failed and takes the communicator with it: recorded before the watchdog
  /// aborts and dumps.
  void fail_comm(std::uint64_t seq, std::exception_ptr e) {
    record_op_failed(seq, e);
    watchdog_.fail(std::move(e));
  }

  void record_op_failed(std::uint64_t seq, const std::exception_ptr& e) noexcept {
    try {
      recorder().failed(seq, what_of(e).c_str());
    } catch (...) {  // no memory for the text: the state alone says it failed
      recorder().failed(seq, nullptr);
    }
  }

  /// Host wait until every operation issued so far completed (bounded), then the failure if any.
  void wait_issued(const char* op) {
    const auto limit = timeout() + std::chrono::seconds(2);
    if (!watchdog_.wait_idle(Clock::now() + limit))
      throw Timeout(op, rank(), "operations still running after " + std::to_string(limit.count()) + " ms");
    throw_if_failed(op);
  }

  /// The NCCL part of split (under nccl_mu_, device set). See split().
  ncclComm_t split_comm([[maybe_unused]] int color, [[maybe_unused]] int key,
                        [[maybe_unused]] const InitConfig& config, [[maybe_unused]] std::uint64_t seq) {
    constexpr const char* op = "split";
#if NCCL_VERSION_CODE >= 21800
    ncclConfig_t cfg = make_config(config);
    // A non-blocking split runs on NCCL's own thread, which writes the new communicator here when
    // it ends: on the heap, so that a split abandoned at its deadline cannot write into a dead frame.
    auto* slot = new ncclComm_t(nullptr);
    bool job_done = false;  // NCCL no longer writes *slot
    try {
      const ncclResult_t r = ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, slot, &cfg);
      if (r != ncclSuccess && r != ncclInProgress) {
        job_done = true;
        throw_nccl(r, "ncclCommSplit", op, rank(), comm_);
      }
      wait_ready(comm_, op, "ncclCommSplit", std::chrono::microseconds(200), std::chrono::milliseconds(20),
                 "ncclCommSplit did not complete",
                 " (a rank that did not call split, or failed); the communicator was aborted", &job_done);
      const ncclComm_t child = *slot;
      delete slot;
      slot = nullptr;
      if (color < 0) {
        if (child != nullptr) abort_comm(child, device_);  // not expected: NCCL makes none
        return nullptr;
      }
      if (child == nullptr)
        throw BackendError(op, rank(), "ncclCommSplit succeeded but returned no communicator for color " +
                                          std::to_string(color));
      try {
        wait_ready(child, op, "ncclCommSplit", std::chrono::microseconds(100), std::chrono::milliseconds(20),
                   "the communicator made by ncclCommSplit was not ready", "; the communicator was aborted");
      } catch (...) {
        abort_comm(child, device_);
        throw;
      }
      return child;
    } catch (...) {
      if (settings_.may_abort && comm_ != nullptr) {
        // Also stops NCCL's split thread and joins it (the parent's abort reaches the child).
        (void)ncclCommAbort(comm_);
        comm_ = nullptr;
        job_done = true;
      }
      if (slot != nullptr && job_done) {
        abort_comm(*slot, device_);
        delete slot;
      }  // else NCCL may still write *slot: left allocated on purpose
      fail_comm(seq, std::current_exception());
      throw;
    }
#else
    throw InvalidArgument(op, rank(),
                          "split needs ncclCommSplit (NCCL >= 2.18); comm was compiled against NCCL " +
                              version_string(compiled_version));
#endif
  }

  /// A non-blocking communicator answered ncclInProgress: poll until the call is enqueued.
  void wait_enqueued(const char* op) {
    wait_ready(comm_, op, "ncclCommGetAsyncError", std::chrono::microseconds(5), std::chrono::milliseconds(1),
               "NCCL did not finish enqueuing the operation",
               " (a peer that never issued it, or died); the communicator was aborted");
  }

  /// Polls ncclCommGetAsyncError(`comm`) until it leaves ncclInProgress (a non-blocking call that
  /// NCCL finishes on its own thread): returns at ncclSuccess; throws NCCL's error (as a failure of
  /// `call`), the communicator's failure, or past op_deadline_ comm::Timeout "<late> within <t> ms
  /// <why>". `settled`, when given, becomes true once NCCL reported anything but ncclInProgress.
  /// `watch_failure` false: the communicator's own failure does not end the wait (shrink_comm runs
  /// on a communicator that retire() failed on purpose).
  void wait_ready(ncclComm_t comm, const char* op, const char* call, std::chrono::microseconds first,
                  std::chrono::microseconds max, const char* late, const char* why, bool* settled = nullptr,
                  bool watch_failure = true) {
    Backoff backoff(first, max);
    for (;;) {
      ncclResult_t state = ncclInProgress;
      COMM_NCCL_CHECK(ncclCommGetAsyncError(comm, &state), op, rank(), comm);
      if (state != ncclInProgress && settled != nullptr) *settled = true;
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) throw_nccl(state, call, op, rank(), comm);
      if (watch_failure) throw_if_failed(op);
      if (Clock::now() >= op_deadline_)
        throw Timeout(op, rank(),
                      std::string(late) + " within " + std::to_string(timeout().count()) + " ms" + why);
      backoff.pause();
    }
  }

  /// Host wait for a blocking barrier. The watchdog ends the operation by its deadline; wait a
  /// little longer so that its verdict (after the abort) is the one reported.
  void wait_host(NcclOp& s) {
    const auto limit = timeout() + std::chrono::seconds(2);
    if (!s.wait_until(Clock::now() + limit))
      throw Timeout(s.op(), rank(), "did not complete within " + std::to_string(limit.count()) + " ms");
    if (auto e = s.error()) std::rethrow_exception(e);
  }

  /// CommCore's, from the watchdog's record: the error keeps NCCL's or CUDA's native code.
  void throw_if_failed(const char* op) const {
    if (!watchdog_.failed()) [[likely]]
      return;
    std::rethrow_exception(
        derived_error(watchdog_.failure(), op, rank(), "the communicator is unusable after an earlier failure"));
  }

  void check_buffer(const char* op, const void* p, std::size_t bytes, const char* what) const {
    if (settings_.check_pointers) check_device_buffer(p, bytes, device_, what, op, rank());
  }

 private:
  /// Frees what the engine owns. `healthy`: the communicator may be finalized (else aborted).
  void release(bool healthy) noexcept {
    int prev = -1;
    const bool restore = cudaGetDevice(&prev) == cudaSuccess && prev != device_;
    if (restore) (void)cudaSetDevice(device_);
    {
      std::lock_guard lock(nccl_mu_);
      if (comm_ != nullptr && owns_comm_) {
        if (healthy)
          finalize_or_abort(comm_, timeout(), rank());
        else
          (void)ncclCommAbort(comm_);
      }
      comm_ = nullptr;
    }
    if (scratch_ != nullptr) (void)cudaFree(scratch_);
    if (ready_ != nullptr) (void)cudaEventDestroy(ready_);
    free_fingerprints();
    if (owns_stream_ && stream_ != nullptr) (void)cudaStreamDestroy(stream_);
    scratch_ = nullptr;
    ready_ = nullptr;
    stream_ = nullptr;
    (void)cudaGetLastError();
    if (restore) (void)cudaSetDevice(prev);
  }

  mutable std::mutex nccl_mu_;  // one thread at a time on the communicator (NCCL's rule)
  ncclComm_t comm_;
  bool owns_comm_;
  int device_;
  Settings settings_;
  cudaStream_t stream_ = nullptr;
  bool owns_stream_ = false;
  cudaEvent_t ready_ = nullptr;  // caller's stream -> communicator's stream; reused under nccl_mu_
  float* scratch_ = nullptr;     // the barrier's all_reduce buffer
  ReductionRules rules_;
  std::uint64_t seq_ = 0;  // the next operation's number (0, 1, ...), under nccl_mu_
  // The next collective's number (point-to-point operations take none: they involve two ranks, so
  // their count differs by rank), the desync fingerprint's sequence number; under nccl_mu_.
  std::uint64_t coll_seq_ = 0;
  Clock::time_point op_deadline_{};
  CommsTimer comms_;       // COMM_COMMS_LOG, COMM_TRACE; under nccl_mu_
  std::shared_ptr<EventPool> events_;
  Watchdog watchdog_;  // last: stopped explicitly in the destructor, before the rest goes
};

}  // namespace comm::detail::nccl
