// comm's reduction kernels (detail/engine/reduce.hpp), one process: semantics per type and op, aliasing,
// wrap-around without UB, half/bfloat16/fp8 through float, avg finishing, custom callables.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <comm/detail/engine/reduce.hpp>

using comm::ReduceOp;
using comm::detail::combine;

TEST_CASE("reduce kernels: integer sum and prod wrap modulo 2^bits") {
  CHECK(combine<ReduceOp::sum, std::int8_t>(127, 1) == -128);
  CHECK(combine<ReduceOp::sum, std::int32_t>(INT32_MAX, 1) == INT32_MIN);
  CHECK(combine<ReduceOp::sum, std::int64_t>(INT64_MAX, 2) == INT64_MIN + 1);
  CHECK(combine<ReduceOp::prod, std::int8_t>(16, 16) == 0);
  CHECK(combine<ReduceOp::prod, std::int32_t>(65536, 65536) == 0);
  CHECK(combine<ReduceOp::prod, std::int64_t>(-1, INT64_MIN) == INT64_MIN);
  CHECK(combine<ReduceOp::prod, std::uint8_t>(255, 255) == 1);
  CHECK(combine<ReduceOp::sum, std::uint64_t>(UINT64_MAX, 3) == 2);
}

TEST_CASE("reduce kernels: min, max, bitwise") {
  CHECK(combine<ReduceOp::min, float>(2.0f, -3.0f) == -3.0f);
  CHECK(combine<ReduceOp::max, double>(2.0, -3.0) == 2.0);
  CHECK(combine<ReduceOp::min, std::uint32_t>(7, 9) == 7);
  CHECK(combine<ReduceOp::band, std::uint8_t>(0xf0, 0x3c) == 0x30);
  CHECK(combine<ReduceOp::bor, std::int32_t>(0x0f, 0x30) == 0x3f);
  CHECK(combine<ReduceOp::bxor, std::int64_t>(-1, 0) == -1);
}

TEST_CASE("reduce kernels: half and bfloat16 compute in float and round each step") {
  const comm::half a(1.0f), b(2.0f);
  CHECK(static_cast<float>(combine<ReduceOp::sum, comm::half>(a, b)) == 3.0f);
  CHECK(static_cast<float>(combine<ReduceOp::prod, comm::bfloat16>(comm::bfloat16(3.0f), comm::bfloat16(-2.0f))) ==
        -6.0f);
  // 2048 + 1 is not representable in half: rounds to even (2048).
  CHECK(static_cast<float>(combine<ReduceOp::sum, comm::half>(comm::half(2048.0f), comm::half(1.0f))) == 2048.0f);
  CHECK(static_cast<float>(combine<ReduceOp::max, comm::bfloat16>(comm::bfloat16(-1.0f), comm::bfloat16(0.5f))) ==
        0.5f);
}

TEST_CASE("reduce kernels: fp8 computes in float and rounds each step") {
  using E4 = comm::float8_e4m3;
  using E5 = comm::float8_e5m2;
  CHECK(static_cast<float>(combine<ReduceOp::sum, E4>(E4(1.0f), E4(2.0f))) == 3.0f);
  CHECK(static_cast<float>(combine<ReduceOp::prod, E5>(E5(3.0f), E5(-2.0f))) == -6.0f);
  CHECK(static_cast<float>(combine<ReduceOp::min, E4>(E4(-1.0f), E4(0.5f))) == -1.0f);
  CHECK(static_cast<float>(combine<ReduceOp::max, E5>(E5(-1.0f), E5(0.5f))) == 0.5f);
  // 16 + 1 is not representable in e4m3 (spacing 2 above 16): ties to even, 16.
  CHECK(static_cast<float>(combine<ReduceOp::sum, E4>(E4(16.0f), E4(1.0f))) == 16.0f);
  // e4m3 sums saturate at 448 (it has no infinity); e5m2 at 57344.
  CHECK(static_cast<float>(combine<ReduceOp::sum, E4>(E4(448.0f), E4(448.0f))) == 448.0f);
  CHECK(static_cast<float>(combine<ReduceOp::sum, E5>(E5(57344.0f), E5(57344.0f))) == 57344.0f);
  std::vector<E5> acc{E5(1.0f), E5(2.0f), E5(4.0f)}, in{E5(1.0f), E5(-2.0f), E5(4.0f)};
  comm::detail::reduce_kernel<ReduceOp::sum, E5>(acc.data(), acc.data(), in.data(), acc.size());
  CHECK(static_cast<float>(acc[0]) == 2.0f);
  CHECK(static_cast<float>(acc[1]) == 0.0f);
  CHECK(static_cast<float>(acc[2]) == 8.0f);
  std::vector<E4> avg{E4(6.0f), E4(-3.0f)};
  comm::detail::finish_avg<E4>(avg.data(), avg.size(), 4);
  CHECK(static_cast<float>(avg[0]) == 1.5f);
  CHECK(static_cast<float>(avg[1]) == -0.75f);
}

TEST_CASE("reduce kernels: type-erased kernel handles out == a, out == b and distinct buffers") {
  std::vector<std::int32_t> a{1, 2, 3, 4, 5}, b{10, 20, 30, 40, 50}, o(5);
  auto k = comm::detail::reduce_kernel_for<std::int32_t>(ReduceOp::sum);
  REQUIRE(static_cast<bool>(k));
  k(o.data(), a.data(), b.data(), 5);
  CHECK(o == std::vector<std::int32_t>{11, 22, 33, 44, 55});
  k(a.data(), a.data(), b.data(), 5);
  CHECK(a == std::vector<std::int32_t>{11, 22, 33, 44, 55});
  k(b.data(), a.data(), b.data(), 5);
  CHECK(b == std::vector<std::int32_t>{21, 42, 63, 84, 105});
  CHECK_FALSE(static_cast<bool>(comm::detail::reduce_kernel_for<float>(ReduceOp::band)));
  CHECK(static_cast<bool>(comm::detail::reduce_kernel_for<std::uint8_t>(ReduceOp::bxor)));
  // avg reduces as sum; the division happens once at the end.
  const bool same_kernel =
      comm::detail::reduce_kernel_for<double>(ReduceOp::avg) == comm::detail::reduce_kernel_for<double>(ReduceOp::sum);
  CHECK(same_kernel);
}

namespace {

// reduce_many_kernel against a scalar left fold (accumulating as the kernel documents), for 1-5
// inputs, counts around the kernel's block, and `out` distinct or any one of the inputs. Values
// whose result depends on the operands' order (min over signed zeros and NaN) or on when the
// rounding happens (half sums) make a reordered or re-rounded fold fail.
template <ReduceOp R, class T, class Make>
void check_many_kernel(Make make) {
  using A = std::conditional_t<comm::detail::is_half_like_v<T>, float, T>;
  const auto kernel = comm::detail::reduce_many_for<T>(R);
  REQUIRE(static_cast<bool>(kernel));
  for (int n = 1; n <= 5; ++n)
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{63}, std::size_t{64}, std::size_t{130}})
      for (int out_is = -1; out_is < n; ++out_is) {
        std::vector<std::vector<T>> in(static_cast<std::size_t>(n), std::vector<T>(count));
        for (int k = 0; k < n; ++k)
          for (std::size_t i = 0; i < count; ++i) in[static_cast<std::size_t>(k)][i] = make(k, i);
        std::vector<T> want(count);
        for (std::size_t i = 0; i < count; ++i) {
          A a = static_cast<A>(in[0][i]);
          for (int k = 1; k < n; ++k) a = combine<R, A>(a, static_cast<A>(in[static_cast<std::size_t>(k)][i]));
          want[i] = static_cast<T>(a);
        }
        std::vector<T> separate(count);
        std::vector<const void*> srcs;
        for (auto& v : in) srcs.push_back(v.data());
        T* out = out_is < 0 ? separate.data() : in[static_cast<std::size_t>(out_is)].data();
        kernel(out, srcs.data(), n, count);
        for (std::size_t i = 0; i < count; ++i) {
          INFO("n = " << n << ", count = " << count << ", out is input " << out_is << ", element " << i);
          // Bit equality: NaN and signed zeros included.
          CHECK(std::memcmp(&out[i], &want[i], sizeof(T)) == 0);
        }
      }
}

}  // namespace

TEST_CASE("reduce kernels: the n-input kernel folds from the left in every placement") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // min(+0, -0) and min(-0, +0), min(NaN, 1) and min(1, NaN) differ: the order is visible.
  check_many_kernel<ReduceOp::min, float>([&](int k, std::size_t i) {
    const float v[] = {0.0f, -0.0f, nan, 1.0f, -2.0f};
    return v[(static_cast<std::size_t>(k) + i) % 5];
  });
  check_many_kernel<ReduceOp::max, double>([](int k, std::size_t i) {
    const double v[] = {-0.0, 0.0, std::numeric_limits<double>::quiet_NaN(), 3.5};
    return v[(static_cast<std::size_t>(k) * 3 + i) % 4];
  });
  // Float sums that absorb: (1e8 + 1) - 1e8 is 0, (1e8 - 1e8) + 1 is 1, so any other order fails.
  check_many_kernel<ReduceOp::sum, float>([](int k, std::size_t i) {
    const float v[] = {1e8f, 1.0f, -1e8f, 3.0f, -1.0f, 0.5f};
    return v[(static_cast<std::size_t>(k) * 5 + i * 7) % 6];
  });
  // 2048 + 1 + 1 in half: one rounding at the end gives 2050, a rounding per step 2048.
  check_many_kernel<ReduceOp::sum, comm::half>([](int k, std::size_t i) {
    return comm::half(k == 0 ? 2048.0f : static_cast<float>((i % 3) + 1) * 0.5f);
  });
  check_many_kernel<ReduceOp::prod, comm::bfloat16>([](int k, std::size_t i) {
    return comm::bfloat16(1.0f + 0.0078125f * static_cast<float>(k + static_cast<int>(i % 7)));
  });
  check_many_kernel<ReduceOp::sum, std::int32_t>([](int k, std::size_t i) {
    return static_cast<std::int32_t>(k == 0 ? INT32_MAX : static_cast<std::int32_t>(i) - k);
  });
  check_many_kernel<ReduceOp::bxor, std::uint8_t>([](int k, std::size_t i) {
    return static_cast<std::uint8_t>(i * 37 + static_cast<std::size_t>(k) * 11);
  });
}

TEST_CASE("reduce kernels: avg finishing") {
  std::vector<std::int32_t> i{-7, 7, -8, 0, -1};
  comm::detail::finish_avg(i.data(), i.size(), 2);
  CHECK(i == std::vector<std::int32_t>{-4, 3, -4, 0, -1});  // floor division
  std::vector<std::uint8_t> u{7, 255};
  comm::detail::finish_avg(u.data(), u.size(), 2);
  CHECK(u == std::vector<std::uint8_t>{3, 127});
  std::vector<std::int8_t> big{-128, 127, 0};
  comm::detail::finish_avg(big.data(), big.size(), 300);  // more ranks than int8 counts
  CHECK(big == std::vector<std::int8_t>{-1, 0, 0});
  std::vector<float> f{3.0f, -6.0f};
  comm::detail::finish_avg(f.data(), f.size(), 3);
  CHECK(f[0] == 3.0f * (1.0f / 3.0f));
  CHECK(f[1] == -6.0f * (1.0f / 3.0f));
  std::vector<comm::half> h{comm::half(6.0f)};
  comm::detail::finish_avg(h.data(), h.size(), 4);
  CHECK(static_cast<float>(h[0]) == 1.5f);
}

TEST_CASE("reduce kernels: custom callables, aliasing allowed") {
  std::vector<float> a{1, 2, 3}, b{3, 2, 1};
  comm::detail::reduce_custom<float>([](float x, float y) { return x * 10 + y; }, a.data(), a.data(), b.data(), 3);
  CHECK(a == std::vector<float>{13, 22, 31});
}
