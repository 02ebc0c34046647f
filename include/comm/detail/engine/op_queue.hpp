#pragma once
// Runs one communicator's operations strictly in issue order.
//
// Async operations go to a FIFO served by one worker thread, started on the first async call and
// retired after kIdleExit without work.
// A blocking operation runs on the caller's thread: at once when nothing is queued or running
// (the common case: no thread hop, lowest latency), otherwise after the queue has drained.
// Every operation gets two numbers when it is issued, under the same lock that fixes its place in
// the order: `id`, counting every operation of this rank (the flight recorder's), and `seq`, the
// collective sequence number, which counts collectives only, so that it matches across ranks
// that issue the same collectives whatever point-to-point operations some of them run in between.
// Point-to-point operations get kP2PSeq | (their own count) instead. The owner's
// `issue(op, id, seq, started)` runs under that lock too (the flight recorder's "queued"; for an
// operation that runs inline at once also its "started", so `execute(..., started)` need not
// record it again). Engines derive their collective message tags from `seq`.
// A blocking call with nothing queued takes the lock twice and signals the condition variable
// only when a thread waits on it (waiters_): that is the whole cost of the queue on the fast path.
// The lock is a YieldLock (base/yield_lock.hpp: one exchange to take, a store to give back, where a
// pthread mutex costs about 60 instructions and two atomic read-modify-writes, twice per call), so
// the condition variable is a condition_variable_any: its waits are the slow path (async work
// queued), where its own internal mutex does not matter.
// shutdown() lets the worker finish everything already queued, then joins it.
//
// Nothing here is a template: the queue holds one task type (an Op record and its Work state) and
// calls its owner through two function pointers, so it is compiled once per translation unit.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#include <comm/detail/base/yield_lock.hpp>
#include <comm/detail/engine/op.hpp>
#include <comm/work.hpp>

namespace comm::detail {

/// The queue's lock: held only for a few stores (issue, hand-over), by the caller's thread and the
/// worker.
using QueueLock = YieldLock;

class OpQueue {
 public:
  /// `started`: the issue step recorded the start already (an inline operation).
  using ExecuteFn = void (*)(void* owner, Op& op, std::uint64_t id, std::uint64_t seq, bool started);
  using IssueFn = void (*)(void* owner, const Op& op, std::uint64_t id, std::uint64_t seq, bool started);
  /// The bit that marks a point-to-point operation's `seq`.
  static constexpr std::uint64_t kP2PSeq = std::uint64_t{1} << 63;

  OpQueue(void* owner, ExecuteFn execute, IssueFn issue) noexcept : owner_(owner), execute_(execute), issue_(issue) {}
  OpQueue(const OpQueue&) = delete;
  OpQueue& operator=(const OpQueue&) = delete;
  ~OpQueue() { shutdown(); }

  /// Runs `op` on this thread once every earlier operation finished; rethrows what it threw.
  void run_inline(Op& op) {
    std::uint64_t id = 0, seq = 0;
    {
      std::unique_lock<QueueLock> lock(mu_);
      if (!queue_.empty() || running_) wait(lock, [&] { return queue_.empty() && !running_; });
      running_ = true;
      id = next_id_++;
      seq = next_seq(op);
      issue_(owner_, op, id, seq, true);
    }
    struct Release {
      OpQueue* q;
      ~Release() {
        bool wake = false;
        {
          std::lock_guard<QueueLock> lock(q->mu_);
          q->running_ = false;
          wake = q->waiters_ != 0;
        }
        if (wake) q->cv_.notify_all();
      }
    } release{this};
    execute_(owner_, op, id, seq, true);
  }

  /// Queues `op`; `state` is completed with its outcome (failed with what it threw).
  void submit(Op&& op, std::shared_ptr<WorkState> state) {
    {
      std::lock_guard<QueueLock> lock(mu_);
      if (!worker_alive_) {
        // A worker that retired after idling has left serve() and needs no lock: join is immediate.
        if (worker_.joinable()) worker_.join();
        // Started before the operation is numbered and queued: a thread that cannot be created
        // (std::system_error: a process or thread limit) leaves nothing behind that no worker
        // would ever run, and the next call tries again. The new worker waits for this lock.
        worker_ = std::thread(&OpQueue::serve, this);
        worker_alive_ = true;
      }
      const std::uint64_t id = next_id_++;
      const std::uint64_t seq = next_seq(op);
      issue_(owner_, op, id, seq, false);
      queue_.push_back(Task{std::move(op), std::move(state), id, seq});
    }
    cv_.notify_all();
  }

  /// Finishes the queued operations, then stops the worker. Idempotent.
  void shutdown() {
    {
      std::lock_guard<QueueLock> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
  }

  /// Waits until nothing is running or queued, or until `deadline`; true when idle.
  bool wait_idle_until(std::chrono::steady_clock::time_point deadline) {
    std::unique_lock<QueueLock> lock(mu_);
    const Waiting w(waiters_);
    return cv_.wait_until(lock, deadline, [&] { return queue_.empty() && !running_; });
  }

 private:
  /// A worker with nothing to do for this long exits (the next async call starts a new one), so
  /// idle communicators hold no thread.
  static constexpr std::chrono::milliseconds kIdleExit{2000};

  struct Task {
    Op op;
    std::shared_ptr<WorkState> state;
    std::uint64_t id = 0;
    std::uint64_t seq = 0;
  };

  /// Counts a thread waiting on cv_ (under mu_), so that the end of an inline operation signals
  /// only when someone waits.
  struct Waiting {
    explicit Waiting(int& n) noexcept : n_(n) { ++n_; }
    ~Waiting() { --n_; }
    Waiting(const Waiting&) = delete;
    Waiting& operator=(const Waiting&) = delete;
    int& n_;
  };

  template <class Pred>
  void wait(std::unique_lock<QueueLock>& lock, Pred pred) {
    const Waiting w(waiters_);
    cv_.wait(lock, pred);
  }

  [[nodiscard]] std::uint64_t next_seq(const Op& op) noexcept {
    return is_p2p(op.desc.kind) ? (kP2PSeq | next_p2p_++) : next_seq_++;
  }

  void serve() {
    std::unique_lock<QueueLock> lock(mu_);
    for (;;) {
      bool ready = false;
      {
        const Waiting w(waiters_);
        ready = cv_.wait_for(lock, kIdleExit, [&] {
          return (!queue_.empty() && !running_) || (stopping_ && queue_.empty());
        });
      }
      if (queue_.empty()) {
        if (!ready && running_) continue;  // an inline op is running: not idle
        worker_alive_ = false;  // stopping and drained, or idle for kIdleExit
        return;
      }
      if (!ready) continue;
      Task task = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
      lock.unlock();
      std::exception_ptr error;
      try {
        execute_(owner_, task.op, task.id, task.seq, false);
      } catch (...) {
        error = std::current_exception();
      }
      auto state = std::move(task.state);
      // Release captured buffers/callables before the op counts as finished.
      { Task done = std::move(task); }
      if (error)
        state->fail(std::move(error));
      else
        state->complete();
      state.reset();
      lock.lock();
      running_ = false;
      cv_.notify_all();
    }
  }

  void* owner_;
  ExecuteFn execute_;
  IssueFn issue_;
  QueueLock mu_;
  std::condition_variable_any cv_;
  std::deque<Task> queue_;
  bool running_ = false;
  bool stopping_ = false;
  int waiters_ = 0;  // threads in a wait on cv_ (under mu_)
  std::uint64_t next_id_ = 0;
  std::uint64_t next_seq_ = 0;
  std::uint64_t next_p2p_ = 0;
  bool worker_alive_ = false;
  std::thread worker_;
};

}  // namespace comm::detail
