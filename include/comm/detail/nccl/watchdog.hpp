#pragma once
// The watchdog of an NCCL communicator: one thread that
//   - completes operations in issue order as their CUDA events complete (this is what wakes
//     Work::wait and is_completed),
//   - fails an operation that is still running at its deadline with comm::Timeout,
//   - polls the engine's asynchronous error (ncclCommGetAsyncError) and fails with
//     comm::RemoteError / comm::BackendError,
// and after the first failure aborts the engine (ncclCommAbort) and fails every pending operation,
// each error naming its own operation and the rank. NCCL reports nothing when a peer on the same
// host dies (the kernels just wait), so the deadline is what ends such an operation. It also tells
// the engine when each operation started (reached the head of the communicator's stream: its
// predecessors completed), completed or failed, and when a failure has been handled (the flight
// recorder and its dump on failure).
//
// It knows nothing of CUDA or NCCL: the operations (TrackedOp) and the engine (WatchTarget) are
// interfaces, so the logic runs with fakes on machines without a GPU.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include <comm/detail/base/logging.hpp>
#include <comm/detail/nccl/errors.hpp>
#include <comm/error.hpp>
#include <comm/work.hpp>

namespace comm::detail::nccl {

using Clock = std::chrono::steady_clock;

/// A failure seen by the watchdog or the issuing thread, before it becomes an exception.
struct Fault {
  enum class Kind { timeout, remote, backend };
  Kind kind = Kind::backend;
  std::string detail;
  NativeEngine engine = NativeEngine::nccl;
  int code = -1;  ///< native code, -1 when there is none
};

/// The comm::Error for `f` during `op` on `rank` (with the native code when it has one).
[[nodiscard]] inline std::exception_ptr make_error(const Fault& f, const std::string& op, int rank) {
  try {
    if (f.code >= 0) {
      switch (f.kind) {
        case Fault::Kind::timeout: throw EngineError<Timeout>(f.engine, f.code, op, rank, f.detail);
        case Fault::Kind::remote: throw EngineError<RemoteError>(f.engine, f.code, op, rank, f.detail);
        case Fault::Kind::backend: throw EngineError<BackendError>(f.engine, f.code, op, rank, f.detail);
      }
    }
    switch (f.kind) {
      case Fault::Kind::timeout: throw Timeout(op, rank, f.detail);
      case Fault::Kind::remote: throw RemoteError(op, rank, f.detail);
      case Fault::Kind::backend: break;
    }
    throw BackendError(op, rank, f.detail);
  } catch (...) {
    return std::current_exception();
  }
}

/// The kind of an error (for errors derived from an earlier one).
[[nodiscard]] inline Fault::Kind kind_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const Timeout&) {
    return Fault::Kind::timeout;
  } catch (const RemoteError&) {
    return Fault::Kind::remote;
  } catch (...) {
  }
  return Fault::Kind::backend;
}

[[nodiscard]] inline std::string what_of(const std::exception_ptr& e) { return exception_text(e, "unknown error"); }

/// An error for `op` that follows an earlier failure `cause` of the communicator: same kind,
/// and the message quotes the first cause.
[[nodiscard]] inline std::exception_ptr derived_error(const std::exception_ptr& cause, const std::string& op, int rank,
                                                      const std::string& what_happened) {
  Fault f;
  f.kind = kind_of(cause);
  f.detail = what_happened + ": " + what_of(cause);
  return make_error(f, op, rank);
}

/// Progress of a tracked operation.
enum class Progress { running, done, failed };

/// A Work state the watchdog can probe without blocking.
class TrackedOp : public WorkState {
 public:
  TrackedOp(std::string op, int rank, std::chrono::milliseconds timeout, std::uint64_t seq)
      : WorkState(std::move(op), rank, timeout), seq_(seq) {}

  /// Non-blocking probe, called from the watchdog thread only; on `failed`, fills `fault`.
  virtual Progress query(Fault& fault) noexcept = 0;

  /// The operation's number on its communicator (1, 2, ...).
  [[nodiscard]] std::uint64_t seq() const noexcept { return seq_; }

 private:
  std::uint64_t seq_;
};

/// The engine the watchdog watches: NCCL (engine.hpp), or a fake in tests.
class WatchTarget {
 public:
  virtual ~WatchTarget() = default;
  /// Runs first on the watchdog thread (the engine selects its device there).
  virtual void on_watchdog_start() noexcept {}
  /// The engine's asynchronous error, if any; nullopt when healthy or when it cannot tell now.
  virtual std::optional<Fault> async_error() noexcept = 0;
  /// Aborts the engine after the first failure; called once, from the watchdog thread (or from
  /// stop() when the thread is gone). Must not throw.
  virtual void abort() noexcept = 0;

  // Progress of the operations, in issue order, for the flight recorder. Called from the watchdog
  // thread or from track() (under the watchdog's lock: they must only take leaf locks), never
  // throwing.
  /// Operation `seq` reached the head of the queue: every earlier operation completed.
  virtual void op_started(std::uint64_t /*seq*/) noexcept {}
  virtual void op_completed(std::uint64_t /*seq*/) noexcept {}
  virtual void op_failed(std::uint64_t /*seq*/, const std::exception_ptr& /*error*/) noexcept {}
  /// The first failure has been handled: the engine aborted, every pending operation failed.
  virtual void failure_handled(const std::exception_ptr& /*cause*/) noexcept {}
};

/// Timing of the watchdog.
struct WatchdogTiming {
  std::chrono::milliseconds async_poll{50};     ///< how often the async error is polled
  std::chrono::microseconds min_backoff{5};     ///< first pause while an operation runs
  std::chrono::microseconds max_backoff{1000};  ///< longest pause while an operation runs
  /// Pauses shorter than this yield instead of sleeping (a timed sleep costs ~50 us of timer
  /// slack), so that short operations are seen complete within microseconds.
  std::chrono::microseconds spin_below{50};
};

class Watchdog {
 public:
  Watchdog(WatchTarget& target, int rank, WatchdogTiming timing = {})
      : target_(target), rank_(rank), timing_(timing) {}
  ~Watchdog() { stop(); }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  /// Starts the thread (separate from construction so the target can finish constructing).
  void start() {
    std::lock_guard lock(mu_);
    if (thread_.joinable() || stopping_) return;
    thread_ = std::thread([this] { run(); });
  }

  /// Tracks an issued operation until it completes, fails or passes `deadline`. After the
  /// communicator failed, the operation fails at once.
  void track(std::shared_ptr<TrackedOp> op, Clock::time_point deadline) {
    std::exception_ptr late;
    {
      std::lock_guard lock(mu_);
      if (failure_) {
        late = derived_error(failure_, op->op(), rank_, "not run: the communicator failed earlier");
      } else {
        const bool was_idle = pending_.empty();
        const auto seq = op->seq();
        pending_.push_back({std::move(op), deadline});
        if (was_idle) {
          target_.op_started(seq);
          cv_.notify_all();
        }
        return;
      }
    }
    target_.op_failed(op->seq(), late);
    op->fail(std::move(late));
  }

  /// Whether the communicator failed (cheap: no lock).
  [[nodiscard]] bool failed() const noexcept { return failed_flag_.load(std::memory_order_acquire); }

  /// The communicator's first failure, or null.
  [[nodiscard]] std::exception_ptr failure() const {
    std::lock_guard lock(mu_);
    return failure_;
  }

  /// Records `cause` as the communicator's failure (the first one wins) and has the thread abort
  /// the engine and fail every pending operation. Safe to call from any thread, also while holding
  /// the engine's own locks: the abort runs on the watchdog thread.
  ///
  /// `hold`: new operations fail at once, but the abort and the pending operations' failure wait
  /// for release() (or stop()). NCCL's shrink uses it: ncclCommShrink with NCCL_SHRINK_ABORT needs
  /// the old communicator alive, and stops its kernels itself; only then may the operations report
  /// failure (their buffers may be freed then). Returns whether this call recorded the failure.
  bool fail(std::exception_ptr cause, bool hold = false) {
    {
      std::lock_guard lock(mu_);
      if (failure_) return false;
      failure_ = std::move(cause);
      culprit_ = kNoCulprit;
      held_ = hold;
      failed_flag_.store(true, std::memory_order_release);
    }
    cv_.notify_all();
    return true;
  }

  /// Ends a hold (fail(cause, true)): the thread now aborts and fails the pending operations.
  void release() {
    {
      std::lock_guard lock(mu_);
      if (!held_) return;
      held_ = false;
    }
    cv_.notify_all();
  }

  /// Whether a failure is recorded and held (see fail()).
  [[nodiscard]] bool held() const {
    std::lock_guard lock(mu_);
    return held_;
  }

  /// Blocks until no operation is pending (all completed, or failed after an abort) or `deadline`;
  /// true when none is pending.
  bool wait_idle(Clock::time_point deadline) {
    std::unique_lock lock(mu_);
    return idle_cv_.wait_until(lock, deadline,
                              [&] { return !handling_ && (pending_.empty() || (failure_ && aborted_)); });
  }

  /// Number of operations not yet completed.
  [[nodiscard]] std::size_t pending() const {
    std::lock_guard lock(mu_);
    return pending_.size();
  }

  /// Stops the thread. A failure recorded but not yet handled (held or not) is handled here
  /// (abort, fail the pending operations); operations still running are left as they are.
  void stop() noexcept {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
    std::unique_lock lock(mu_);
    held_ = false;
    if (failure_ && !aborted_) handle_failure(lock);
  }

 private:
  struct Pending {
    std::shared_ptr<TrackedOp> op;
    Clock::time_point deadline;
  };

  void run() noexcept {
    target_.on_watchdog_start();
    std::unique_lock lock(mu_);
    auto next_async = Clock::now() + timing_.async_poll;
    auto backoff = timing_.min_backoff;
    while (!stopping_) {
      if (failure_) {
        if (held_) {  // until release() or stop()
          cv_.wait(lock, [&] { return !held_ || stopping_; });
          continue;
        }
        if (!aborted_) handle_failure(lock);
        cv_.wait(lock, [&] { return stopping_; });
        break;
      }
      bool progressed = false;
      // 1. The engine's asynchronous error (not tied to one operation).
      auto now = Clock::now();
      if (now >= next_async) {
        next_async = now + timing_.async_poll;
        lock.unlock();
        auto fault = target_.async_error();
        lock.lock();
        if (fault && !failure_) {
          const std::string op = pending_.empty() ? std::string("nccl.watchdog") : pending_.front().op->op();
          record(make_error(*fault, op, rank_), pending_.empty() ? kNoCulprit : pending_.front().op->seq());
          continue;
        }
      }
      // 2. Operations complete in issue order: probe the oldest until one is still running.
      while (!pending_.empty() && !failure_ && !stopping_) {
        auto front = pending_.front();
        lock.unlock();
        Fault fault;
        const Progress p = front.op->query(fault);
        lock.lock();
        if (p == Progress::done) {
          pending_.pop_front();
          progressed = true;
          target_.op_completed(front.op->seq());
          if (!pending_.empty()) target_.op_started(pending_.front().op->seq());
          lock.unlock();
          front.op->complete();
          lock.lock();
          if (pending_.empty()) idle_cv_.notify_all();
          continue;
        }
        if (p == Progress::failed) {
          record(make_error(fault, front.op->op(), rank_), front.op->seq());
        } else if (Clock::now() >= front.deadline) {
          Fault t;
          t.kind = Fault::Kind::timeout;
          t.detail = "operation #" + std::to_string(front.op->seq()) + " did not complete within " +
                     std::to_string(front.op->timeout().count()) +
                     " ms (a peer that died, hangs or issued different collectives); the watchdog aborted the "
                     "communicator";
          record(make_error(t, front.op->op(), rank_), front.op->seq());
        }
        break;
      }
      if (failure_ || stopping_) continue;
      // 3. Sleep: briefly while an operation runs (backing off), else until the next async poll.
      if (progressed) backoff = timing_.min_backoff;
      if (!pending_.empty() && backoff < timing_.spin_below) {
        const auto until = Clock::now() + backoff;
        backoff *= 2;
        lock.unlock();
        while (Clock::now() < until) std::this_thread::yield();
        lock.lock();
        continue;
      }
      auto wake = next_async;
      if (!pending_.empty()) {
        wake = std::min({wake, Clock::now() + backoff, pending_.front().deadline});
        backoff = std::min(backoff * 2, timing_.max_backoff);
      }
      cv_.wait_until(lock, wake);
    }
  }

  /// Records the first failure; the loop then aborts and fails the pending operations.
  void record(std::exception_ptr e, std::uint64_t culprit) {
    if (failure_) return;
    failure_ = std::move(e);
    culprit_ = culprit;
    failed_flag_.store(true, std::memory_order_release);
  }

  /// Aborts the engine, then fails every pending operation (the culprit with the cause itself,
  /// the others with an error derived from it). Called with `lock` held; releases it meanwhile.
  void handle_failure(std::unique_lock<std::mutex>& lock) noexcept {
    aborted_ = true;
    handling_ = true;  // pending_ is empty from here on, but its operations are not failed yet
    const auto cause = failure_;
    const auto culprit = culprit_;
    std::deque<Pending> victims;
    victims.swap(pending_);
    lock.unlock();
    try {
      log(LogLevel::warn, "nccl watchdog: " + what_of(cause) + " [aborting; " + std::to_string(victims.size()) +
                              " pending operation(s) fail]");
    } catch (...) {  // a bad COMM_DEBUG or no memory: the errors still reach the Work
    }
    // Abort first: once a Work reports failure its buffers may be freed, so the kernels must be
    // gone by then.
    target_.abort();
    for (auto& v : victims) {
      std::exception_ptr e = cause;
      try {
        if (v.op->seq() != culprit)
          e = derived_error(cause, v.op->op(), rank_, "aborted after a failure of the communicator");
      } catch (...) {  // out of memory while building the message: still end the operation
      }
      target_.op_failed(v.op->seq(), e);
      v.op->fail(std::move(e));
    }
    target_.failure_handled(cause);
    lock.lock();
    handling_ = false;
    idle_cv_.notify_all();
  }

  WatchTarget& target_;
  int rank_;
  WatchdogTiming timing_;
  mutable std::mutex mu_;
  std::condition_variable cv_;       // wakes the thread: new work, failure, stop
  std::condition_variable idle_cv_;  // wakes wait_idle
  std::deque<Pending> pending_;
  static constexpr std::uint64_t kNoCulprit = ~std::uint64_t{0};

  std::exception_ptr failure_;
  std::uint64_t culprit_ = kNoCulprit;
  std::atomic<bool> failed_flag_{false};
  bool aborted_ = false;
  // handle_failure is aborting and failing the operations it took from pending_: wait_idle must
  // not report idle before their Work says so (first seen on a GPU: shrink returned with its
  // queued operation not yet failed).
  bool handling_ = false;
  bool held_ = false;  // fail(cause, true) until release()
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace comm::detail::nccl
