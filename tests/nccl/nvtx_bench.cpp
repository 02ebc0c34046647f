// Cost of comm's NVTX ranges (detail/diagnostics/nvtx.hpp) per operation, on the CPU: an
// "operation" (an out-of-line function doing a counter update) with the range as the NCCL engine
// opens it, against the same function without it. Built twice: nccl_nvtx_bench (NVTX3 headers
// found: run with COMM_NVTX unset for "off", COMM_NVTX=1 for "on") and
// nccl_nvtx_bench_compiled_out (COMM_NO_NVTX). Prints one RESULT line; benchmarks/RESULTS.md
// "NVTX ranges" has the figures and the command.
//
//   nccl_nvtx_bench [--iters N] [--rounds R]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <comm/detail/diagnostics/nvtx.hpp>

namespace nvtx = comm::detail::nvtx;

namespace {

volatile std::uint64_t sink = 0;
constexpr auto f32 = static_cast<std::uint8_t>(comm::Dtype::float32);

[[gnu::noinline]] void plain_op(std::uint64_t seq) { sink = sink + seq; }

// As in the NCCL engine's issue(): an inactive range before the locked block, push() once the
// sequence number is known, popped at the end.
[[gnu::noinline]] void ranged_op(std::uint64_t seq) {
  nvtx::ScopedRange range;
  range.push("all_reduce", 1024, f32, seq);
  sink = sink + seq;
}

template <class F>
double ns_per_call(F f, std::uint64_t iters) {
  const auto t0 = std::chrono::steady_clock::now();
  for (std::uint64_t i = 0; i < iters; ++i) f(i);
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(iters);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::uint64_t iters = 20'000'000;
  int rounds = 9;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--iters") == 0) iters = std::strtoull(argv[i + 1], nullptr, 10);
    if (std::strcmp(argv[i], "--rounds") == 0) rounds = std::atoi(argv[i + 1]);
  }
  const bool on = nvtx::enabled();
  if (on) iters = std::max<std::uint64_t>(iters / 50, 1000);  // formatting + NVTX calls: much slower
  std::vector<double> plain, ranged;
  (void)ns_per_call(plain_op, iters / 10);  // warm up
  (void)ns_per_call(ranged_op, iters / 10);
  for (int r = 0; r < rounds; ++r) {
    plain.push_back(ns_per_call(plain_op, iters));
    ranged.push_back(ns_per_call(ranged_op, iters));
  }
  const double p = median(plain), q = median(ranged);
  const char* mode = !nvtx::compiled_in ? "compiled_out" : on ? "on" : "off";
  const char* tool = std::getenv("NVTX_INJECTION64_PATH");
  std::printf("RESULT mode=%s tool=%s iters=%llu rounds=%d plain_ns=%.3f ranged_ns=%.3f delta_ns=%.3f\n", mode,
              tool != nullptr && *tool != '\0' ? "yes" : "no", static_cast<unsigned long long>(iters), rounds, p, q,
              q - p);
  return 0;
}
