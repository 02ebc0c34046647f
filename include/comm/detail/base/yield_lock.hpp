#pragma once
// A lock for sections of a few stores that two threads rarely contend for: one exchange to take,
// one store to give back, where a pthread mutex costs about 55-60 instructions and two atomic
// read-modify-writes per lock and unlock. A waiter yields, so a holder that was descheduled costs
// time slices, not a spinning core. The engine core's operation queue and the flight recorder
// take one on every operation.

#include <atomic>
#include <thread>

namespace comm::detail {

class YieldLock {
 public:
  void lock() noexcept {
    while (busy_.exchange(true, std::memory_order_acquire))
      while (busy_.load(std::memory_order_relaxed)) std::this_thread::yield();
  }
  void unlock() noexcept { busy_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> busy_{false};
};

}  // namespace comm::detail
