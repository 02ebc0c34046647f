#pragma once
// A full fence on every thread of this process, run by the one thread that needs it, so that a
// hot path on another thread can order a store before a later load without a fence of its own.
//
// The pattern (Dekker's, made asymmetric): the hot thread stores its flag and reads the other
// side's with plain instructions; the rare side stores its flag, calls fence_process_threads(),
// then reads the hot thread's flag. membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) makes every CPU
// that runs a thread of this process pass a full fence before it returns (a thread not running
// passes one when it is next scheduled), so at least one side sees the other's store. On x86 the
// fence the hot side saves is a locked instruction, which waits for the store buffer to drain:
// with a Shm step's header line just written (the peer polls it) that is a line transfer on the
// caller's path (benchmarks/RESULTS.md, "The operation queue without a lock on the calling
// thread"). The Shm engine's wait (shm/wait.hpp) plays the same trick across processes.

#if defined(__linux__)
#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace comm::detail {

/// Whether fence_process_threads() works here: registers this process for it once; false where
/// the kernel lacks the command or a seccomp policy forbids it (callers then fence as usual).
[[nodiscard]] inline bool process_fence_available() noexcept {
#if defined(__linux__) && defined(SYS_membarrier)
  static const bool on = [] {
    const long cmds = ::syscall(SYS_membarrier, MEMBARRIER_CMD_QUERY, 0, 0);
    constexpr long need = MEMBARRIER_CMD_PRIVATE_EXPEDITED | MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED;
    return cmds >= 0 && (cmds & need) == need &&
           ::syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0;
  }();
  return on;
#else
  return false;
#endif
}

/// A full fence on every thread of this process (~1-3 us: one interrupt per CPU that runs one).
/// Only after process_fence_available() returned true; false if the call failed.
[[nodiscard]] inline bool fence_process_threads() noexcept {
#if defined(__linux__) && defined(SYS_membarrier)
  return ::syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) == 0;
#else
  return false;
#endif
}

}  // namespace comm::detail
