#pragma once
/// \file
/// `comm::Work`: the handle an async collective returns.

#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include <comm/error.hpp>

namespace comm {

/// Shared completion state between the thread that runs an operation and the Work that waits on
/// it: what a backend makes a comm::Work from. Backends with extra wait semantics (NCCL: make the
/// caller's stream wait) derive from it.
class WorkState {
 public:
  /// The state of operation `op` on `rank`, waited on for at most `timeout` by Work::wait.
  WorkState(std::string op, int rank, std::chrono::milliseconds timeout)
      : op_(std::move(op)), rank_(rank), timeout_(timeout) {}
  virtual ~WorkState() = default;
  WorkState(const WorkState&) = delete;
  WorkState& operator=(const WorkState&) = delete;

  /// Marks the operation finished without error and wakes the waiters.
  void complete() { finish(nullptr); }
  /// Marks the operation failed with `e` (rethrown by Work::wait) and wakes the waiters.
  void fail(std::exception_ptr e) { finish(std::move(e)); }

  /// Whether complete() or fail() was called. Never blocks on the operation.
  [[nodiscard]] bool done() const {
    std::lock_guard lock(mu_);
    return done_;
  }

  /// Waits until the operation finished or `deadline` passed; true when finished.
  template <class Clock, class Duration>
  bool wait_until(const std::chrono::time_point<Clock, Duration>& deadline) {
    std::unique_lock lock(mu_);
    return cv_.wait_until(lock, deadline, [&] { return done_; });
  }

  /// The first error, or null. Valid once done().
  [[nodiscard]] std::exception_ptr error() const {
    std::lock_guard lock(mu_);
    return error_;
  }

  /// Called by Work::wait after a successful host wait; NCCL overrides it to order the
  /// caller's current stream after the operation.
  virtual void on_waited() {}

  /// Called by Work::wait before any host wait. A backend whose operations run on a device stream
  /// makes the caller's current stream wait for the operation and returns true: the host does not
  /// block, and a later failure surfaces through the backend's watchdog. Host backends return false.
  virtual bool wait_on_stream() { return false; }

  /// Called by Work::wait / Work::synchronize when their deadline passed with the operation still
  /// running, before they throw comm::Timeout. A backend whose engine could go on writing into the
  /// caller's buffers stops the operation here (bounded); when it ended, its own error is
  /// reported instead. Returns a note for the Timeout's message. Default: nothing to stop.
  virtual std::string on_wait_timeout() { return {}; }

  /// The operation's name, for messages.
  [[nodiscard]] const std::string& op() const noexcept { return op_; }
  /// The rank, for messages.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// How long Work::wait and Work::synchronize wait before comm::Timeout.
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return timeout_; }

 private:
  void finish(std::exception_ptr e) {
    {
      std::lock_guard lock(mu_);
      if (done_) return;  // the first outcome wins; a later abort does not replace the cause
      done_ = true;
      error_ = std::move(e);
    }
    cv_.notify_all();
  }

  std::string op_;
  int rank_;
  std::chrono::milliseconds timeout_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

/// Handle to an operation started with `comm::async`. Move-only.
///
/// - `wait()` on host backends (Gloo) blocks until the operation finished, then rethrows its error
///   if it failed; it gives up after the communicator's timeout with comm::Timeout naming the op and
///   rank. On NCCL it makes the caller's current stream wait for the operation and returns at once
///   (an error already known is rethrown; a later one fails the communicator's next call).
/// - `synchronize()` blocks the host until the operation finished, on every backend.
/// - `wait_for(d)` returns false if the operation is still running after `d`; the operation keeps
///   running and may be waited on again. It rethrows the operation's error once it finished.
/// - `is_completed()` never blocks and never throws.
/// A default-constructed Work is already completed.
class [[nodiscard]] Work {
 public:
  Work() = default;
  /// A Work for the operation whose completion `state` carries (what a backend returns).
  explicit Work(std::shared_ptr<WorkState> state) noexcept : state_(std::move(state)) {}
  /// Moves; the moved-from Work is completed.
  Work(Work&&) noexcept = default;
  /// Moves; the moved-from Work is completed.
  Work& operator=(Work&&) noexcept = default;
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;
  ~Work() = default;

  /// See the class comment: blocks until the operation finished (host backends) or makes the caller's
  /// current stream wait (NCCL), then rethrows its error; comm::Timeout after the communicator's timeout.
  void wait() {
    if (!state_) return;
    if (!state_->done() && state_->wait_on_stream()) return;
    synchronize();
  }

  /// Blocks the calling thread until the operation finished (on every backend, NCCL included),
  /// then rethrows its error. Gives up after the communicator's timeout with comm::Timeout.
  void synchronize() {
    if (!state_) return;
    const auto deadline = std::chrono::steady_clock::now() + state_->timeout();
    if (!state_->wait_until(deadline)) {
      std::string note = state_->on_wait_timeout();
      if (!state_->done())
        throw Timeout(state_->op(), state_->rank(),
                      "Work::wait gave up after " + std::to_string(state_->timeout().count()) +
                          " ms; the operation did not complete" + note);
    }
    finish();
  }

  /// Waits at most `d`: false while the operation still runs (it may be waited on again), true once
  /// it finished; then rethrows its error.
  bool wait_for(std::chrono::milliseconds d) {
    if (!state_) return true;
    if (!state_->wait_until(std::chrono::steady_clock::now() + d)) return false;
    finish();
    return true;
  }

  /// Whether the operation finished (successfully or not). Never blocks, never throws.
  [[nodiscard]] bool is_completed() const { return !state_ || state_->done(); }

  /// True when the operation finished with an error (does not throw).
  [[nodiscard]] bool failed() const { return state_ && state_->done() && state_->error() != nullptr; }

  /// The operation's error once it finished with one; nullptr while it runs or when it succeeded.
  /// Never throws, never blocks (like torch.distributed's Work.exception()).
  [[nodiscard]] std::exception_ptr error() const noexcept {
    if (!state_) return nullptr;
    try {
      return state_->done() ? state_->error() : nullptr;
    } catch (...) {  // a mutex that cannot be locked: nothing to report
      return nullptr;
    }
  }

  /// The text of error(): the comm::Error message naming the operation, rank and cause; "" when
  /// there is none yet. Never throws.
  [[nodiscard]] std::string exception() const noexcept {
    try {
      if (auto e = error()) return detail::exception_text(e, "unknown exception");
    } catch (...) {  // out of memory while copying the text
    }
    return {};
  }

 private:
  void finish() {
    if (auto e = state_->error()) std::rethrow_exception(e);
    state_->on_waited();
  }

  std::shared_ptr<WorkState> state_;
};

}  // namespace comm
