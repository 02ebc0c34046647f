#pragma once
// A 64-bit value that two processes are unlikely to share: for names and nonces that only need to
// differ, not to be secret (the Gloo direct connections' secret draws its own bytes and fails
// without the kernel's source). <random> would cost every includer ~18k preprocessed lines.

#include <sys/random.h>

#include <chrono>
#include <cstdint>

namespace comm::detail {

/// From the kernel's random source; where that fails (no getrandom), the steady clock.
[[nodiscard]] inline std::uint64_t random_u64() noexcept {
  std::uint64_t r = 0;
  if (::getrandom(&r, sizeof r, GRND_NONBLOCK) != static_cast<ssize_t>(sizeof r))
    r = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return r;
}

}  // namespace comm::detail
