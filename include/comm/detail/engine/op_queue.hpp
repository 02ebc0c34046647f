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
// A blocking call from the queue's owner thread (the first thread that made one) takes no lock and
// no locked instruction while no other thread needs the queue: it marks itself busy, reads that the
// fast path is open (closers_ == 0), numbers, issues and runs the operation, and marks itself idle.
// Anything else that would touch the queue's state (the worker thread, a blocking call from another
// thread, wait_idle_until) first closes the fast path under the lock and, unless it runs on the
// owner thread, fences every thread of the process (base/process_fence.hpp) before it reads the
// owner's busy mark; so either the owner sees the closure or the closer sees the owner busy and
// waits for it to finish (the owner wakes it). On x86 the two locked exchanges of a lock taken at
// issue and again at the end each wait for the store buffer to drain, the Shm step's header line
// written just before among them: ~20 ns of a 2-rank 8-byte broadcast of ~100 (benchmarks/
// RESULTS.md, "The operation queue without a lock on the calling thread"). A blocking call from a
// thread that is not the owner closes the fast path for good (the queue then works as a plain
// locked queue, as before): another thread's calls are rare, and each closure costs a fence of the
// whole process (~1-3 us). The worker closes it while it lives; an async call from the owner thread
// needs no fence (it cannot be inside a fast operation at the same time).
// The slow path takes the lock twice and signals the condition variable only when a thread waits
// on it (waiters_). The lock is a YieldLock (base/yield_lock.hpp: one exchange to take, a store to
// give back, where a pthread mutex costs about 60 instructions and two atomic read-modify-writes,
// twice per call), so the condition variable is a condition_variable_any: its waits are the slow
// path, where its own internal mutex does not matter.
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

#include <comm/detail/base/process_fence.hpp>
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
    if (on_owner_thread()) {
      fast_busy_.store(true, std::memory_order_relaxed);
      // Only the compiler is kept from moving the load above the store: the CPU's order comes
      // from a closer's fence of every thread (see the top of this file).
      std::atomic_signal_fence(std::memory_order_seq_cst);
      if (closers_.load(std::memory_order_acquire) == 0) {
        const FastExit done{this};
        const std::uint64_t id = next_id_++;
        const std::uint64_t seq = next_seq(op);
        issue_(owner_, op, id, seq, true);
        execute_(owner_, op, id, seq, true);
        return;
      }
      leave_fast();
    }
    std::uint64_t id = 0, seq = 0;
    {
      std::unique_lock<QueueLock> lock(mu_);
      if (!on_owner_thread()) share(lock);
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
      std::unique_lock<QueueLock> lock(mu_);
      // Numbered after the owner's fast operation, if one runs: another thread's submit waits for
      // it (bounded by that operation's deadline) and shares the queue from then on.
      if (!on_owner_thread()) share(lock);
      if (!worker_alive_) {
        // A worker that retired after idling has left serve() and needs no lock: join is immediate.
        if (worker_.joinable()) worker_.join();
        // Started before the operation is numbered and queued: a thread that cannot be created
        // (std::system_error: a process or thread limit) leaves nothing behind that no worker
        // would ever run, and the next call tries again. The new worker waits for this lock.
        worker_ = std::thread(&OpQueue::serve, this);
        worker_alive_ = true;
        close();  // the worker runs operations: the owner's calls queue behind them while it lives
        wait_fast_done(lock);
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
    close();
    bool idle = false;
    {
      const Waiting w(waiters_);
      idle = cv_.wait_until(lock, deadline, [&] { return queue_.empty() && !running_ && !fast_busy(); });
    }
    reopen();
    return idle;
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

  // ---- the owner thread's fast path (see the top of this file) ----

  /// A token unique to each live thread: the address of a thread-local.
  [[nodiscard]] static const void* this_thread_token() noexcept {
    static thread_local const char token = 0;
    return &token;
  }
  /// Whether the caller is the owner thread; the first thread to ask becomes it (where the fence
  /// of every thread is available: elsewhere no thread owns the queue).
  [[nodiscard]] bool on_owner_thread() noexcept {
    const void* me = this_thread_token();
    const void* owner = owner_thread_.load(std::memory_order_relaxed);
    if (owner == me) return true;
    if (owner != nullptr || !process_fence_available()) return false;
    return owner_thread_.compare_exchange_strong(owner, me, std::memory_order_relaxed);
  }
  [[nodiscard]] bool fast_busy() const noexcept { return fast_busy_.load(std::memory_order_acquire); }

  /// The owner leaves its fast path (done, or it found the path closed): a closer waiting for it
  /// is woken. The load after the store is ordered by the closer's fence, as on entry.
  void leave_fast() noexcept {
    fast_busy_.store(false, std::memory_order_release);
    std::atomic_signal_fence(std::memory_order_seq_cst);
    if (closers_.load(std::memory_order_relaxed) != 0) {
      { const std::lock_guard<QueueLock> lock(mu_); }  // a closer is in its wait, or sees us idle
      cv_.notify_all();
    }
  }
  struct FastExit {
    OpQueue* q;
    ~FastExit() { q->leave_fast(); }
  };

  /// Closes the owner's fast path (under mu_). The first closure from another thread fences every
  /// thread, so that from here on this thread sees the owner's busy mark if the owner did not see
  /// the closure. The owner may still be inside a fast operation: see wait_fast_done().
  void close() noexcept {
    const bool first = closers_.fetch_add(1, std::memory_order_acq_rel) == 0;
    // Without the fence no thread owns the queue (on_owner_thread): nothing to fence against.
    if (first && process_fence_available() && owner_thread_.load(std::memory_order_relaxed) != this_thread_token() &&
        !fence_process_threads())
      std::this_thread::sleep_for(std::chrono::milliseconds(1));  // no fence (cannot happen once registered)
  }
  void reopen() noexcept { closers_.fetch_sub(1, std::memory_order_acq_rel); }
  /// After close(): waits until the owner has left a fast operation it was in. Its deadline is that
  /// operation's own, as for a queued call behind a running one.
  void wait_fast_done(std::unique_lock<QueueLock>& lock) {
    if (fast_busy()) wait(lock, [&] { return !fast_busy(); });
  }
  /// Another thread uses the queue: the fast path closes for good (once).
  void share(std::unique_lock<QueueLock>& lock) {
    if (shared_) return;
    shared_ = true;
    close();
    wait_fast_done(lock);
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
        reopen();
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
  std::atomic<const void*> owner_thread_{nullptr};  // this_thread_token() of the owner thread
  std::atomic<bool> fast_busy_{false};  // the owner runs an operation on its fast path
  std::atomic<int> closers_{0};  // why the fast path is closed (changed under mu_): worker, waits, sharing
  bool shared_ = false;  // another thread has used the queue: closed for good (under mu_)
  std::uint64_t next_id_ = 0;
  std::uint64_t next_seq_ = 0;
  std::uint64_t next_p2p_ = 0;
  bool worker_alive_ = false;
  std::thread worker_;
};

}  // namespace comm::detail
