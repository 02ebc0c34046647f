// comm-bench-kernel-*: the element-wise reduction kernels alone, single thread.
//
// Gloo calls the reduction function it is given; comm passes its own kernels (detail/engine/reduce.hpp),
// compiled in the user's translation unit with the user's flags; raw Gloo users pass gloo::sum<T>
// (gloo/math.h), also compiled in the caller. This measures both at three compiler settings
// (the same source built as comm-bench-kernel-O2, -O3 and -native) so the effect of the flags and of
// the kernel's shape can be told apart. Prints GB/s (3 x bytes moved per call: two reads, one write),
// best of many repetitions, which is robust against other load on the machine.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <vector>

#include <gloo/math.h>

#include <comm/detail/engine/reduce.hpp>

#ifndef COMM_KERNEL_FLAGS
#define COMM_KERNEL_FLAGS "?"
#endif

namespace {

using Fn = void (*)(void*, const void*, const void*, std::size_t);

template <class F>
double best_gbs(F&& f, std::size_t bytes) {
  const std::size_t reps = std::max<std::size_t>(5, (std::size_t{256} << 20) / bytes);
  double best = 1e30;
  for (int round = 0; round < 5; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t r = 0; r < reps; ++r) f();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
    best = std::min(best, s);
  }
  return 3.0 * bytes / best / 1e9;
}

}  // namespace

int main() {
  const Fn comm_fn = &comm::detail::reduce_kernel<comm::ReduceOp::sum, float>;
  const Fn gloo_fn = &::gloo::sum<float>;
  std::printf("# float sum kernels, flags: %s; GB/s (3 x bytes per call), best of 5 rounds\n", COMM_KERNEL_FLAGS);
  std::printf("# %10s %12s %12s %12s %12s\n", "size", "comm a+=b", "gloo a+=b", "comm c=a+b", "gloo c=a+b");
  for (std::size_t bytes : {std::size_t{4} << 10, std::size_t{256} << 10, std::size_t{16} << 20}) {
    const std::size_t n = bytes / sizeof(float);
    std::vector<float> a(n, 1.0f), b(n, 2.0f), c(n, 0.0f);
    // In place (what gloo's ring does: out == first input) and out of place.
    const double ci = best_gbs([&] { comm_fn(a.data(), a.data(), b.data(), n); }, bytes);
    const double gi = best_gbs([&] { gloo_fn(a.data(), a.data(), b.data(), n); }, bytes);
    const double co = best_gbs([&] { comm_fn(c.data(), a.data(), b.data(), n); }, bytes);
    const double go = best_gbs([&] { gloo_fn(c.data(), a.data(), b.data(), n); }, bytes);
    std::printf("  %10zu %12.2f %12.2f %12.2f %12.2f\n", bytes, ci, gi, co, go);
    std::fflush(stdout);
    if (a[0] < 0) std::printf("%f\n", static_cast<double>(c[0]));  // keep the results alive
  }
  return 0;
}
