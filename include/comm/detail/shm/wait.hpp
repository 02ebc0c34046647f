#pragma once
// How a Shm rank waits for a peer without burning a core or missing its death: a pause
// instruction for the spinning phase, a futex for the sleeping phase, the fence a waiter issues on
// behalf of its peers before it sleeps, and a watch on the peer's process.

#include <linux/futex.h>
#include <linux/membarrier.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <ctime>
#include <utility>

namespace comm::detail::shm {

// The pause instruction through the compiler's builtin: <immintrin.h> for _mm_pause would cost
// every Shm includer ~45k preprocessed lines of intrinsics.
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

inline void futex_wait(std::atomic<std::uint32_t>* w, std::uint32_t expected, std::chrono::nanoseconds t) noexcept {
  timespec ts{static_cast<time_t>(t.count() / 1000000000), static_cast<long>(t.count() % 1000000000)};
  (void)::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(w), FUTEX_WAIT, expected, &ts, nullptr, 0);
}
inline void futex_wake_all(std::atomic<std::uint32_t>* w) noexcept {
  (void)::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(w), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// ---- the asymmetric fence of a publish and a waiter about to sleep ----
//
// A publisher stores its step, then reads whether a peer sleeps on it; a waiter counts itself as
// a sleeper, then reads the step. Each side must see the other's write, so one of them needs a
// full fence between its write and its read. A fence on every publish (a locked store on x86)
// makes the publisher wait for the ownership of its header line, which the reader holds: a whole
// line transfer on every small step. Waiters sleep rarely (after spinning and ~2 ms of yielding),
// so they take the cost instead: membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED) makes every CPU that
// runs a registered process pass a full fence before it returns, which orders a publisher's
// store, wherever it ran, against its read of the sleeper count as its own fence would. Every
// process of a segment must register first, or the publishes stay fenced (engine.hpp agrees on it).

/// Registers this process to be fenced by its peers' waits; false where the kernel lacks the
/// commands or a seccomp policy forbids them.
[[nodiscard]] inline bool register_peer_fence() noexcept {
  const long cmds = ::syscall(SYS_membarrier, MEMBARRIER_CMD_QUERY, 0, 0);
  constexpr long need = MEMBARRIER_CMD_GLOBAL_EXPEDITED | MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED;
  return cmds >= 0 && (cmds & need) == need &&
         ::syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED, 0, 0) == 0;
}

/// The waiter's side: a full fence on every CPU that runs a registered process (~1 us).
inline void fence_peers() noexcept { (void)::syscall(SYS_membarrier, MEMBARRIER_CMD_GLOBAL_EXPEDITED, 0, 0); }

/// Watches whether a process exists: a pidfd (readable once the process has exited, zombie or
/// not), else kill(pid, 0).
class ProcessWatch {
 public:
  ProcessWatch() = default;
  explicit ProcessWatch(std::int64_t pid) : pid_(static_cast<pid_t>(pid)) {
#if defined(SYS_pidfd_open)
    fd_ = static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0));
#endif
  }
  ProcessWatch(ProcessWatch&& o) noexcept : pid_(o.pid_), fd_(std::exchange(o.fd_, -1)) {}
  ProcessWatch& operator=(ProcessWatch&& o) noexcept {
    std::swap(pid_, o.pid_);
    std::swap(fd_, o.fd_);
    return *this;
  }
  ~ProcessWatch() {
    if (fd_ >= 0) ::close(fd_);
  }
  [[nodiscard]] bool exited() const noexcept {
    if (pid_ <= 0) return false;
    if (fd_ >= 0) {
      pollfd p{fd_, POLLIN, 0};
      return ::poll(&p, 1, 0) > 0;
    }
    return ::kill(pid_, 0) != 0 && errno == ESRCH;
  }
  [[nodiscard]] pid_t pid() const noexcept { return pid_; }

 private:
  pid_t pid_ = 0;
  int fd_ = -1;
};

}  // namespace comm::detail::shm
