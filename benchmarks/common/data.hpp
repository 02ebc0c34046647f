#pragma once
// Inputs and expected results for --check. Values are small integers, exact in every element type
// (half and bfloat16 included), so sums, products, minima and maxima are exact; avg on floating
// types is compared with a relative tolerance (it multiplies by 1/n). fp8 (3 or 4 significant bits)
// rounds sums and products of several ranks at every step: its reductions are compared with a
// relative tolerance of 1/4, its moves (all_gather, gather, broadcast) exactly.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>

#include <comm/types.hpp>

#include "bench.hpp"

namespace comm::bench {

/// comm's floating types narrower than float: half, bfloat16, fp8.
template <class T>
inline constexpr bool narrow_float_v = std::is_same_v<T, comm::half> || std::is_same_v<T, comm::bfloat16> ||
                                       std::is_same_v<T, comm::float8_e4m3> || std::is_same_v<T, comm::float8_e5m2>;

template <class T>
[[nodiscard]] constexpr double to_double(T v) noexcept {
  if constexpr (narrow_float_v<T>)
    return static_cast<double>(static_cast<float>(v));
  else
    return static_cast<double>(v);
}

template <class T>
[[nodiscard]] constexpr T from_double(double v) noexcept {
  if constexpr (narrow_float_v<T>)
    return T(static_cast<float>(v));
  else
    return static_cast<T>(v);
}

/// Element i of `rank`'s input. Reductions use 1..3 (products of 4 ranks stay below 127);
/// the other ops use 1..97 so a block in the wrong slot is seen.
[[nodiscard]] inline double input_value(bool reduction, int rank, std::size_t i) noexcept {
  if (reduction) return static_cast<double>((static_cast<std::size_t>(rank) + i) % 3 + 1);
  return static_cast<double>((static_cast<std::size_t>(rank) * 5 + i) % 97 + 1);
}

/// Fills `buf` as rank `rank`'s input where element j is global element `first + j`.
template <class T>
void fill(std::span<T> buf, bool reduction, int rank, std::size_t first = 0) {
  for (std::size_t j = 0; j < buf.size(); ++j) buf[j] = from_double<T>(input_value(reduction, rank, first + j));
}

/// The reduction of global element `i` over `n` ranks, as comm defines it.
template <class T>
[[nodiscard]] double expected_reduction(comm::ReduceOp op, int n, std::size_t i) {
  double acc = input_value(true, 0, i);
  for (int r = 1; r < n; ++r) {
    const double v = input_value(true, r, i);
    switch (op) {
      case comm::ReduceOp::sum:
      case comm::ReduceOp::avg: acc += v; break;
      case comm::ReduceOp::prod: acc *= v; break;
      case comm::ReduceOp::min: acc = v < acc ? v : acc; break;
      case comm::ReduceOp::max: acc = v > acc ? v : acc; break;
      case comm::ReduceOp::band: acc = static_cast<double>(static_cast<long>(acc) & static_cast<long>(v)); break;
      case comm::ReduceOp::bor: acc = static_cast<double>(static_cast<long>(acc) | static_cast<long>(v)); break;
      case comm::ReduceOp::bxor: acc = static_cast<double>(static_cast<long>(acc) ^ static_cast<long>(v)); break;
    }
  }
  if (op == comm::ReduceOp::avg) {
    if constexpr (std::is_integral_v<T>)
      acc = std::floor(acc / n);
    else
      acc = acc / n;
  }
  return acc;
}

template <class T>
[[nodiscard]] bool same(T got, double want, bool approx) noexcept {
  const double g = to_double(got);
  if (!approx) return g == to_double(from_double<T>(want));
  const double rel = sizeof(T) == 1 ? 0.25 : (sizeof(T) == 2 ? 1e-2 : 1e-5);
  const double tol = rel * (want < 0 ? -want : want) + 1e-12;
  return (g - want <= tol) && (want - g <= tol);
}

/// Wrong elements in this rank's result of `op`.
///   all_reduce: out[i] = R_r in_r[i]          reduce_scatter: out[i] = R_r in_r[rank*block + i]
///   all_gather/gather (root): out[q*block + i] = in_q[i]     broadcast: data[i] = in_root[i]
///   reduce (root): out[i] = R_r in_r[i]       scatter: out[i] = in_root[rank*block + i]
///   all_to_all: out[q*block + i] = in_q[rank*block + i]
template <class T>
[[nodiscard]] long count_wrong(Op op, comm::ReduceOp redop, std::span<const T> out, const Layout& l, int rank, int n,
                               int root) {
  long wrong = 0;
  const bool approx = !std::is_integral_v<T> && (redop == comm::ReduceOp::avg || sizeof(T) == 1);
  switch (op) {
    case Op::all_reduce:
      for (std::size_t i = 0; i < l.count; ++i) wrong += !same(out[i], expected_reduction<T>(redop, n, i), approx);
      break;
    case Op::reduce_scatter: {
      const std::size_t base = static_cast<std::size_t>(rank) * l.block;
      for (std::size_t i = 0; i < l.block; ++i)
        wrong += !same(out[i], expected_reduction<T>(redop, n, base + i), approx);
      break;
    }
    case Op::all_gather:
    case Op::gather:
      if (op == Op::gather && rank != root) break;
      for (int q = 0; q < n; ++q)
        for (std::size_t i = 0; i < l.block; ++i)
          wrong += !same(out[static_cast<std::size_t>(q) * l.block + i], input_value(false, q, i), false);
      break;
    case Op::broadcast:
      for (std::size_t i = 0; i < l.count; ++i) wrong += !same(out[i], input_value(false, root, i), false);
      break;
    case Op::reduce:
      if (rank != root) break;
      for (std::size_t i = 0; i < l.count; ++i) wrong += !same(out[i], expected_reduction<T>(redop, n, i), approx);
      break;
    case Op::scatter: {
      const std::size_t base = static_cast<std::size_t>(rank) * l.block;
      for (std::size_t i = 0; i < l.block; ++i) wrong += !same(out[i], input_value(false, root, base + i), false);
      break;
    }
    case Op::all_to_all: {
      const std::size_t base = static_cast<std::size_t>(rank) * l.block;
      for (int q = 0; q < n; ++q)
        for (std::size_t i = 0; i < l.block; ++i)
          wrong += !same(out[static_cast<std::size_t>(q) * l.block + i], input_value(false, q, base + i), false);
      break;
    }
    case Op::all_to_all_v:  // per-peer counts: verify_view (views.hpp)
    case Op::send_recv:     // the partner: verify_view
    case Op::barrier: break;
  }
  return wrong;
}

[[nodiscard]] inline std::optional<comm::ReduceOp> parse_redop(std::string_view s) {
  for (auto op : {comm::ReduceOp::sum, comm::ReduceOp::prod, comm::ReduceOp::min, comm::ReduceOp::max,
                  comm::ReduceOp::avg, comm::ReduceOp::band, comm::ReduceOp::bor, comm::ReduceOp::bxor})
    if (s == comm::to_string(op)) return op;
  return std::nullopt;
}

/// Calls `f(T{})` for the element type named `dtype`; false when the name is unknown.
template <class F>
bool with_dtype(std::string_view dtype, F&& f) {
  if (dtype == "float" || dtype == "float32") return f(float{}), true;
  if (dtype == "double" || dtype == "float64") return f(double{}), true;
  if (dtype == "half" || dtype == "float16") return f(comm::half{}), true;
  if (dtype == "bfloat16" || dtype == "bf16") return f(comm::bfloat16{}), true;
  if (dtype == "float8_e4m3" || dtype == "fp8_e4m3" || dtype == "f8e4m3" || dtype == "e4m3")
    return f(comm::float8_e4m3{}), true;
  if (dtype == "float8_e5m2" || dtype == "fp8_e5m2" || dtype == "f8e5m2" || dtype == "e5m2")
    return f(comm::float8_e5m2{}), true;
  if (dtype == "int8") return f(std::int8_t{}), true;
  if (dtype == "uint8") return f(std::uint8_t{}), true;
  if (dtype == "int32" || dtype == "int") return f(std::int32_t{}), true;
  if (dtype == "uint32") return f(std::uint32_t{}), true;
  if (dtype == "int64") return f(std::int64_t{}), true;
  if (dtype == "uint64") return f(std::uint64_t{}), true;
  return false;
}

template <class T>
[[nodiscard]] constexpr std::string_view dtype_name() noexcept {
  return comm::to_string(comm::dtype_of<T>);
}

}  // namespace comm::bench
