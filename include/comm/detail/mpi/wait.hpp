#pragma once
// How the MPI engine waits for a request: MPI has no blocking call with a deadline, so every wait
// is MPI_Test in a loop that ends by the operation's deadline, with the spin / yield / sleep
// phases below so that a quick operation costs no more than MPI's own blocking call.

#include <chrono>
#include <thread>

namespace comm::detail::mpi {

/// An operation's deadline, read from the clock only when first needed: a quick operation never
/// reads the clock (each read costs about as much as an MPI_Test).
class Deadline {
  using Clock = std::chrono::steady_clock;

 public:
  explicit Deadline(std::chrono::milliseconds timeout) noexcept : timeout_(timeout) {}
  [[nodiscard]] static Deadline from_now(std::chrono::milliseconds timeout) {
    Deadline d(timeout);
    (void)d.at();
    return d;
  }
  [[nodiscard]] Clock::time_point at() {
    if (!set_) {
      at_ = Clock::now() + timeout_;
      set_ = true;
    }
    return at_;
  }

 private:
  std::chrono::milliseconds timeout_;
  Clock::time_point at_{};
  bool set_ = false;
};

/// Only spin (MPI_Test back to back, as MPI's own blocking calls do) for this long: yielding
/// earlier hands a whole time slice to any other busy process on a loaded machine, which costs
/// milliseconds per operation. When ranks oversubscribe the cores, OpenMPI's progress engine
/// already yields inside MPI_Test (mpi_yield_when_idle, set by mpirun --oversubscribe).
inline constexpr std::chrono::milliseconds kSpinFor{2};
/// Sleep between tests once an operation has waited this long (a late peer, not a slow link).
inline constexpr std::chrono::milliseconds kSleepAfter{100};
inline constexpr std::chrono::microseconds kSleep{50};
/// How often a waiting operation probes for failure notices.
inline constexpr std::chrono::milliseconds kLookEvery{1};

/// Calls `test` until it returns true (true) or `deadline` passes (false): spinning for
/// kSpinFor, then a yield between tests, then short sleeps once the wait is long. `look` runs every
/// kLookEvery. The clock is read every 32 tests only, so a quick operation never reads it.
template <class Test, class Look>
bool poll(Test&& test, Look&& look, Deadline& deadline) {
  using Clock = std::chrono::steady_clock;
  Clock::time_point start{}, next_look{};
  for (unsigned i = 1;; ++i) {
    if (test()) return true;
    if (i % 32 != 0) continue;
    const auto now = Clock::now();
    if (i == 32) {
      start = now;
      next_look = now + kLookEvery;
    }
    if (now >= next_look) {
      next_look = now + kLookEvery;
      look();
    }
    if (now >= deadline.at()) return false;
    const auto waited = now - start;
    if (waited >= kSleepAfter)
      std::this_thread::sleep_for(kSleep);
    else if (waited >= kSpinFor)
      std::this_thread::yield();
  }
}

}  // namespace comm::detail::mpi
