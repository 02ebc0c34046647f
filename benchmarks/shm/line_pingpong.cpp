// comm-bench-line-pingpong: what one cache line costs to move between two CPUs right now. Two
// threads, pinned to CPUs A and B, hand a counter in one line back and forth; the time per
// hand-over is one line transfer plus a load. Every small Shm operation between two ranks moves
// lines this way, so on a VM whose host moves its vCPUs this number changes from one second to
// the next, and it explains which of its two states a 2-rank run of small operations is in
// (benchmarks/RESULTS.md, "The two states of a 2-rank run").
//
//   comm-bench-line-pingpong [A [B [HANDOVERS]]]   (default: CPUs 0 and 1, 200000 hand-overs)
//
// Prints the ns per hand-over. Exits 2 when a CPU cannot be pinned.

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

namespace {

// Its own pair of lines: an adjacent-line prefetcher must not pull a neighbour in with it.
alignas(128) std::atomic<long> token{0};

bool pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (cpu < 0 || cpu >= CPU_SETSIZE) return false;
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  const int a = argc > 1 ? std::atoi(argv[1]) : 0;
  const int b = argc > 2 ? std::atoi(argv[2]) : 1;
  const long n = argc > 3 ? std::atol(argv[3]) : 200000;
  if (n < 2) {
    std::fprintf(stderr, "HANDOVERS must be at least 2\n");
    return 2;
  }
  std::atomic<bool> pinned{true};
  // The partner answers every odd value with the next even one; main sends the odd ones.
  std::thread partner([&] {
    if (!pin(b)) pinned = false;
    for (long v = 1; v < n; v += 2) {
      while (token.load(std::memory_order_acquire) != v) {
        if (!pinned.load(std::memory_order_relaxed)) return;
      }
      token.store(v + 1, std::memory_order_release);
    }
  });
  if (!pin(a)) pinned = false;
  const auto t0 = std::chrono::steady_clock::now();
  for (long v = 0; v + 1 < n && pinned.load(std::memory_order_relaxed); v += 2) {
    token.store(v + 1, std::memory_order_release);
    while (token.load(std::memory_order_acquire) != v + 2) {
      if (!pinned.load(std::memory_order_relaxed)) break;
    }
  }
  const auto t1 = std::chrono::steady_clock::now();
  partner.join();
  if (!pinned) {
    std::fprintf(stderr, "cannot pin to CPUs %d and %d\n", a, b);
    return 2;
  }
  const long handovers = n / 2 * 2;
  std::printf("%.1f\n", std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(handovers));
  return 0;
}
