#pragma once
// The Work of an async host operation, and the handle through which its wait aborts the
// communicator (engine-neutral: it knows the engine only through a function pointer).

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include <comm/work.hpp>

namespace comm::detail {

/// Lets a Work whose wait gave up stop the operation; outlives the engine (a Work may).
class AbortHandle {
 public:
  using AbortFn = void (*)(void* engine, const std::string& why, std::chrono::milliseconds grace);
  AbortHandle(void* engine, AbortFn fn) noexcept : engine_(engine), fn_(fn) {}
  /// Aborts the communicator's operations; false when the engine is gone.
  bool abort(const std::string& why, std::chrono::milliseconds grace) {
    std::lock_guard lock(mu_);
    if (engine_ == nullptr) return false;
    fn_(engine_, why, grace);
    return true;
  }
  void detach() noexcept {
    std::lock_guard lock(mu_);
    engine_ = nullptr;
  }

 private:
  std::mutex mu_;
  void* engine_;
  AbortFn fn_;
};

/// The Work state of an async host operation. When Work::wait's (or synchronize's) deadline passes
/// it aborts the communicator and waits (bounded: at most timeout + 2 s more) for the operation to
/// end, so that the Timeout reaches the caller only once the engine no longer touches the
/// operation's buffers. Work::wait_for() lets the operation run on, as documented.
class EngineWorkState final : public WorkState {
 public:
  EngineWorkState(const char* op, int rank, std::chrono::milliseconds timeout, std::shared_ptr<AbortHandle> abort)
      : WorkState(op, rank, timeout), abort_(std::move(abort)) {}

  std::string on_wait_timeout() override {
    const std::string why = "Work::wait gave up after " + std::to_string(timeout().count()) +
                            " ms: the operation did not complete; the communicator was aborted";
    const auto bound = timeout() + std::chrono::seconds(2);
    // (A communicator already destroyed has drained its queue: the operation has ended.)
    (void)abort_->abort(why, bound);
    if (wait_until(std::chrono::steady_clock::now() + bound)) return {};
    return "; the communicator was aborted, and the operation did not stop within " + std::to_string(bound.count()) +
           " ms more: its buffers may still be in use";
  }

 private:
  std::shared_ptr<AbortHandle> abort_;
};

}  // namespace comm::detail
