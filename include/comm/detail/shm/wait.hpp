#pragma once
// How a Shm rank waits for a peer without burning a core or missing its death: a pause
// instruction for the spinning phase, a futex for the sleeping phase, and a watch on the peer's
// process.

#include <linux/futex.h>
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
