#pragma once
// What the collective tests of every backend share: deterministic inputs that make reductions
// exact in every element type, and element comparison.

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <comm/types.hpp>

namespace comm::test {

template <class T>
inline constexpr bool is_int = std::is_integral_v<T>;

template <class T>
inline constexpr bool is_fp8 = std::is_same_v<T, comm::float8_e4m3> || std::is_same_v<T, comm::float8_e5m2>;

/// A 64-bit mixer (splitmix64's finalizer): bit patterns for the bitwise reductions.
inline std::uint64_t mix(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

/// Rank `rank`'s input element `i` for reduction `op`: small integers, so that every sum, product,
/// min and max over up to 8 ranks is exact in every element type and independent of the order of
/// reduction (prod: values in {1, 2, -1}); bitwise ops get mixed bit patterns. fp8 sums use -2..2:
/// every partial sum of 4 ranks stays within +-8, exact in e5m2 (3 significant bits) and e4m3; the
/// other ops' values (-8..8, products up to 16) are exact in both.
template <class T>
T input_value(int rank, std::size_t i, ReduceOp op) {
  const auto r = static_cast<long long>(rank);
  const auto k = static_cast<long long>(i % 1000003);
  long long v = 0;
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: v = is_fp8<T> ? (r * 7 + k * 3) % 5 - 2 : (r * 7 + k * 3) % 11 - 5; break;
    case ReduceOp::prod: {
      const long long m = (r + k) % 3;  // {1, 2, -1}: |product over 4 ranks| <= 16
      v = m == 0 ? 1 : (m == 1 ? 2 : -1);
      break;
    }
    case ReduceOp::min:
    case ReduceOp::max: v = (r * 13 + k * 5) % 17 - 8; break;
    case ReduceOp::band:
    case ReduceOp::bor:
    case ReduceOp::bxor:
      if constexpr (is_int<T>) return static_cast<T>(mix(static_cast<std::uint64_t>(r * 1000003 + k)));
      break;
  }
  if constexpr (std::is_unsigned_v<T>) v = v < 0 ? -v : v;
  if constexpr (is_int<T>)
    return static_cast<T>(v);
  else
    return T(static_cast<float>(v));
}

/// Equal elements: the same value (NaN equals NaN) for float and double, the same bits otherwise.
template <class T>
bool same(T a, T b) {
  if constexpr (std::is_floating_point_v<T>)
    return a == b || (a != a && b != b);
  else
    return a == b;
}

}  // namespace comm::test
