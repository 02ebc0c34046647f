#pragma once
// Runs one communicator's operations strictly in issue order.
//
// Async operations go to a FIFO served by one worker thread, started on the first async call and
// retired after kIdleExit without work.
// A blocking operation runs on the caller's thread: at once when nothing is queued or running
// (the common case: no thread hop, lowest latency), otherwise after the queue has drained.
// Every operation gets the next sequence number when it is issued, under the same lock that fixes
// its place in the order, so numbers follow execution order and match across ranks that issue the
// same ops; an `on_issue(seq)` hook runs under that lock too (the flight recorder's "queued").
// The engine derives each operation's gloo tag from its sequence number.
// shutdown() lets the worker finish everything already queued, then joins it.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#include <comm/work.hpp>

namespace comm::detail::gloo {

class OpQueue {
 public:
  OpQueue() = default;
  OpQueue(const OpQueue&) = delete;
  OpQueue& operator=(const OpQueue&) = delete;
  ~OpQueue() { shutdown(); }

  /// Runs `f(seq)` on this thread once every earlier operation finished; returns its result.
  template <class F, class OnIssue>
  decltype(auto) run_inline(F&& f, OnIssue&& on_issue) {
    std::uint64_t seq = 0;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return queue_.empty() && !running_; });
      running_ = true;
      seq = next_seq_++;
      on_issue(seq);
    }
    struct Release {
      OpQueue* q;
      ~Release() {
        {
          std::lock_guard lock(q->mu_);
          q->running_ = false;
        }
        q->cv_.notify_all();
      }
    } release{this};
    return std::forward<F>(f)(seq);
  }

  /// Queues `f(seq)`; `state` is completed with f's outcome (failed with what f threw).
  template <class F, class OnIssue>
  void submit(F&& f, std::shared_ptr<WorkState> state, OnIssue&& on_issue) {
    auto task = std::make_unique<Task<std::decay_t<F>>>(std::forward<F>(f), std::move(state));
    {
      std::lock_guard lock(mu_);
      task->seq = next_seq_++;
      on_issue(task->seq);
      queue_.push_back(std::move(task));
      if (!worker_alive_) {
        // A worker that retired after idling has left serve() and needs no lock: join is immediate.
        if (worker_.joinable()) worker_.join();
        worker_alive_ = true;
        worker_ = std::thread([this] { serve(); });
      }
    }
    cv_.notify_all();
  }

  /// Finishes the queued operations, then stops the worker. Idempotent.
  void shutdown() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
  }

 private:
  /// A worker with nothing to do for this long exits (the next async call starts a new one), so
  /// idle communicators hold no thread.
  static constexpr std::chrono::milliseconds kIdleExit{2000};

  struct TaskBase {
    virtual ~TaskBase() = default;
    virtual void run() noexcept = 0;
    std::uint64_t seq = 0;
  };

  template <class F>
  struct Task final : TaskBase {
    Task(F f, std::shared_ptr<WorkState> s) : fn(std::move(f)), state(std::move(s)) {}
    void run() noexcept override {
      try {
        fn(this->seq);
        state->complete();
      } catch (...) {
        state->fail(std::current_exception());
      }
    }
    F fn;
    std::shared_ptr<WorkState> state;
  };

  void serve() {
    std::unique_lock lock(mu_);
    for (;;) {
      const bool ready = cv_.wait_for(lock, kIdleExit, [&] {
        return (!queue_.empty() && !running_) || (stopping_ && queue_.empty());
      });
      if (queue_.empty()) {
        if (!ready && running_) continue;  // an inline op is running: not idle
        worker_alive_ = false;  // stopping and drained, or idle for kIdleExit
        return;
      }
      if (!ready) continue;
      auto task = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
      lock.unlock();
      task->run();
      task.reset();  // release captured buffers/callables before the op counts as finished
      lock.lock();
      running_ = false;
      cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<TaskBase>> queue_;
  bool running_ = false;
  bool stopping_ = false;
  std::uint64_t next_seq_ = 0;
  bool worker_alive_ = false;
  std::thread worker_;
};

}  // namespace comm::detail::gloo
