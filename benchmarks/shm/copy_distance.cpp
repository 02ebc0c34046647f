// comm-bench-copy-distance: what a copy costs by the distance between its destination and its
// source modulo 4096, with glibc's memcpy and with comm::detail::copy_bytes (detail/base/copy.hpp,
// what the Shm engine copies with). On x86 glibc moves 2 KiB to about 1 MiB with `rep movsb`,
// which some CPUs run many times slower when the destination lies a few bytes past the source
// modulo 4096; copy_bytes then copies in 2 KiB pieces. The last two columns are the kernel's
// copy of the same bytes by process_vm_readv and process_vm_writev (this process reading and
// writing itself), which Shm's single copy runs on: it pays the same distances at every size
// (shm/cma.hpp, cma_copy).
//
//   comm-bench-copy-distance [SIZES...]   (bytes; default 4096 32768 262144 1048576)
//
// For each size and each distance 0, 4, 8, 12, 16, 64: the best of 5 runs of back-to-back copies
// between two cache-resident (or, above the cache, memory-resident) buffers, us per copy.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <sys/uio.h>
#include <unistd.h>

#include <comm/detail/base/copy.hpp>

namespace {

template <class F>
double best_us(std::size_t bytes, F&& copy) {
  const int reps = static_cast<int>(std::clamp<std::size_t>((std::size_t{64} << 20) / std::max<std::size_t>(bytes, 1), 4, 2000));
  double best = 1e300;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) {
      copy();
      asm volatile("" ::: "memory");  // every copy happens
    }
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / reps;
    best = std::min(best, us);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::size_t> sizes;
  for (int i = 1; i < argc; ++i) {
    char* end = nullptr;
    const unsigned long long v = std::strtoull(argv[i], &end, 10);
    if (end == argv[i] || *end != '\0' || v == 0 || v > (1ull << 30)) {
      std::fprintf(stderr, "comm-bench-copy-distance: a size is bytes in 1 .. 2^30, not '%s'\n", argv[i]);
      return 2;
    }
    sizes.push_back(static_cast<std::size_t>(v));
  }
  if (sizes.empty()) sizes = {4096, 32768, 262144, 1048576};
  std::printf("%10s %9s %12s %15s %8s %11s %12s\n", "bytes", "distance", "memcpy (us)", "copy_bytes (us)", "ratio", "readv (us)",
              "writev (us)");
  for (const std::size_t n : sizes) {
    // Both buffers page-aligned plus 64, so the distance is exactly `d`.
    std::vector<std::byte> src(n + 8192), dst(n + 8192);
    std::memset(src.data(), 1, src.size());
    std::memset(dst.data(), 2, dst.size());
    const auto page = [](std::vector<std::byte>& v) {
      const auto a = reinterpret_cast<std::uintptr_t>(v.data());
      return v.data() + ((4096 - (a & 4095u)) & 4095u) + 64;
    };
    std::byte* s = page(src);
    for (const std::size_t d : {0, 4, 8, 12, 16, 64}) {
      std::byte* t = page(dst) + d;
      const double libc = best_us(n, [&] { std::memcpy(t, s, n); });
      const double ours = best_us(n, [&] { comm::detail::copy_bytes(t, s, n); });
      // The kernel's copy: `t` the destination, `s` the source, in both calls.
      const iovec to{t, n}, from{s, n};
      // -1: the kernel refused (seccomp; or a partial copy) and there is no time to give.
      const bool cma = ::process_vm_readv(::getpid(), &to, 1, &from, 1, 0) == static_cast<ssize_t>(n) &&
                       ::process_vm_writev(::getpid(), &from, 1, &to, 1, 0) == static_cast<ssize_t>(n);
      const double readv = cma ? best_us(n, [&] { (void)::process_vm_readv(::getpid(), &to, 1, &from, 1, 0); }) : -1;
      const double writev = cma ? best_us(n, [&] { (void)::process_vm_writev(::getpid(), &from, 1, &to, 1, 0); }) : -1;
      std::printf("%10zu %9zu %12.2f %15.2f %8.2f %11.2f %12.2f\n", n, d, libc, ours, ours / libc, readv, writev);
    }
  }
  return 0;
}
