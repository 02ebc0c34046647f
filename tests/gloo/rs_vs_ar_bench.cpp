// reduce_scatter vs all_reduce of the same input (default: 16 MiB of float) over Gloo.
// Usage: comm-run -n 4 gloo_rs_vs_ar_bench [MiB] [runs]. Prints the median of `runs` timings
// (after warm-up) on rank 0.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <comm/backends/gloo.hpp>
#include <comm/communicator.hpp>

using Comm = comm::Communicator<comm::backends::Gloo>;

int main(int argc, char** argv) {
  const double mib = argc > 1 ? std::atof(argv[1]) : 16.0;
  const int runs = argc > 2 ? std::atoi(argv[2]) : 11;
  auto c = Comm::from_env();
  const auto n = static_cast<std::size_t>(c.size());
  const std::size_t count = static_cast<std::size_t>(mib * 1024 * 1024 / sizeof(float)) / n * n;
  std::vector<float> in(count, 1.0f), out(count / n), ar(count);
  auto time = [&](auto&& op) {
    op();  // warm-up
    op();
    std::vector<double> ms;
    for (int i = 0; i < runs; ++i) {
      c.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      op();
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };
  const double rs = time([&] { c.reduce_scatter(in, out); });
  const double all = time([&] { c.all_reduce(std::span<const float>(in), std::span<float>(ar)); });
  if (out[0] != static_cast<float>(n) || ar[0] != static_cast<float>(n)) {
    std::printf("wrong result\n");
    return 1;
  }
  if (c.rank() == 0)
    std::printf("%zu ranks, %.1f MiB float input: reduce_scatter median %.2f ms, all_reduce median %.2f ms "
                "(ratio %.2f) over %d runs\n",
                n, static_cast<double>(count * sizeof(float)) / (1024.0 * 1024.0), rs, all, rs / all, runs);
  return 0;
}
