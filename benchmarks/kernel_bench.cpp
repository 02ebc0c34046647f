// comm-bench-kernel-*: the element-wise reduction kernels alone, single thread.
//
// Gloo calls the reduction function it is given; comm passes its own kernels (detail/engine/reduce.hpp),
// compiled in the user's translation unit with the user's flags; raw Gloo users pass gloo::sum<T>
// (gloo/math.h), also compiled in the caller. This measures both at three compiler settings
// (the same source built as comm-bench-kernel-O2, -O3 and -native) so the effect of the flags and of
// the kernel's shape can be told apart. Prints GB/s (3 x bytes moved per call: two reads, one write),
// best of many repetitions, which is robust against other load on the machine. A second table
// times the n-input kernel Shm and Hierarchical reduce with (reduce_many_kernel, n known only at
// run time, through a pointer as the engines call it) beside the shape it had until 2026-12-06
// (`one a pass`: the accumulator seeded with the first input, then one input per pass over it),
// in GB/s of (n + 1) x bytes per call.

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
using ManyFn = comm::detail::reduce_many_fn;

// The n-input kernel's earlier shape, kept here as the reference it is measured against.
void one_a_pass(void* out, const void* const* srcs, int n, std::size_t count) noexcept {
  constexpr std::size_t kB = comm::detail::kBlock;
  auto* o = static_cast<float*>(out);
  float acc[kB];
  std::size_t i = 0;
  for (; i + kB <= count; i += kB) {
    const float* s0 = static_cast<const float*>(srcs[0]) + i;
    for (std::size_t j = 0; j < kB; ++j) acc[j] = s0[j];
    for (int k = 1; k < n; ++k) {
      const float* s = static_cast<const float*>(srcs[k]) + i;
      for (std::size_t j = 0; j < kB; ++j) acc[j] = acc[j] + s[j];
    }
    for (std::size_t j = 0; j < kB; ++j) o[i + j] = acc[j];
  }
  for (; i < count; ++i) {
    float a = 0.f;
    for (int k = 0; k < n; ++k) a += static_cast<const float*>(srcs[k])[i];
    o[i] = a;
  }
}

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
  // Through volatile pointers: the engines call the kernel so, with n a run-time value.
  ManyFn volatile many = &comm::detail::reduce_many_kernel<comm::ReduceOp::sum, float>;
  ManyFn volatile old = &one_a_pass;
  std::printf("# n-input float sum, out of place; GB/s ((n + 1) x bytes per call), best of 5 rounds\n");
  std::printf("# %10s %3s %12s %12s\n", "size", "n", "comm", "one a pass");
  for (std::size_t bytes : {std::size_t{256} << 10, std::size_t{512} << 10, std::size_t{16} << 20}) {
    const std::size_t count = bytes / sizeof(float);
    std::vector<std::vector<float>> in(4, std::vector<float>(count, 1.0f));
    std::vector<float> out(count, 0.0f);
    const void* srcs[4] = {in[0].data(), in[1].data(), in[2].data(), in[3].data()};
    for (int n : {2, 3, 4}) {
      const double scale = (n + 1) / 3.0;  // best_gbs counts 3 x bytes
      const double m = scale * best_gbs([&] { many(out.data(), srcs, n, count); }, bytes);
      const double o = scale * best_gbs([&] { old(out.data(), srcs, n, count); }, bytes);
      std::printf("  %10zu %3d %12.2f %12.2f\n", bytes, n, m, o);
      std::fflush(stdout);
      if (out[0] != static_cast<float>(n)) std::printf("wrong: %f\n", static_cast<double>(out[0]));
    }
  }
  return 0;
}
