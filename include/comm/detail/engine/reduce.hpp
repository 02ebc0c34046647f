#pragma once
// comm's own element-wise reduction kernels, shared by host backends.
//
// Semantics (the reference every test checks against):
//   sum, prod      signed integers wrap modulo 2^bits (computed in the unsigned type: no UB);
//                  half/bfloat16/fp8 are widened to float, combined, and rounded back at every step.
//   min, max       `b < a ? b : a` / `a < b ? b : a` (maps onto minps/maxps; a NaN in `b` is
//                  ignored, one in `a` is kept).
//   band/bor/bxor  integers only.
//   avg            sum, then finish_avg(): floating types multiply by 1/size once at the end;
//                  integers use floor division by size (-7 / 2 -> -4).
// The loops are plain loops over __restrict pointers, blocked so that GCC vectorises them at -O2
// as well as -O3 (and Clang at both).

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <gsl/assert>

#include <comm/types.hpp>

namespace comm::detail {

template <class T>
inline constexpr bool is_half_like_v = std::is_same_v<T, half> || std::is_same_v<T, bfloat16> ||
                                      std::is_same_v<T, float8_e4m3> || std::is_same_v<T, float8_e5m2>;

/// One step of reduction `R` on two values of `T`.
template <ReduceOp R, class T>
[[nodiscard]] constexpr T combine(T a, T b) noexcept {
  if constexpr (is_half_like_v<T>) {
    const float x = static_cast<float>(a);
    const float y = static_cast<float>(b);
    return T(combine<R, float>(x, y));
  } else if constexpr (R == ReduceOp::sum || R == ReduceOp::avg) {
    if constexpr (std::is_integral_v<T>) {
      using U = std::make_unsigned_t<T>;
      return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
    } else {
      return a + b;
    }
  } else if constexpr (R == ReduceOp::prod) {
    if constexpr (std::is_integral_v<T>) {
      // uint8 promotes to int (no overflow: 255 * 255 fits); 32/64-bit stay unsigned.
      using U = std::make_unsigned_t<T>;
      using W = std::conditional_t<(sizeof(U) < sizeof(unsigned)), unsigned, U>;
      return static_cast<T>(static_cast<U>(static_cast<W>(static_cast<U>(a)) * static_cast<W>(static_cast<U>(b))));
    } else {
      return a * b;
    }
  } else if constexpr (R == ReduceOp::min) {
    return b < a ? b : a;
  } else if constexpr (R == ReduceOp::max) {
    return a < b ? b : a;
  } else {
    static_assert(std::is_integral_v<T>, "comm: bitwise reductions (band/bor/bxor) need an integer element type");
    if constexpr (R == ReduceOp::band) return static_cast<T>(a & b);
    if constexpr (R == ReduceOp::bor) return static_cast<T>(a | b);
    if constexpr (R == ReduceOp::bxor) return static_cast<T>(a ^ b);
  }
}

/// Inner loops of a fixed trip count: GCC's -O2 cost model ("very cheap") only vectorises loops
/// that need no scalar epilogue, so the kernels run blocks of kBlock elements, then a scalar tail.
inline constexpr std::size_t kBlock = 64;

/// acc[i] = acc[i] R in[i]; with `AccFirst` false acc[i] = in[i] R acc[i], for a fold whose
/// accumulator is its second operand (the order matters to min/max over signed zeros and NaN)
template <ReduceOp R, class T, bool AccFirst = true>
void reduce_into(T* __restrict acc, const T* __restrict in, std::size_t n) noexcept {
  // On values, not through the pointers, so that the loops keep their __restrict.
  auto fold = [](T a, T x) { return AccFirst ? combine<R, T>(a, x) : combine<R, T>(x, a); };
  std::size_t i = 0;
  for (; i + kBlock <= n; i += kBlock)
    for (std::size_t j = 0; j < kBlock; ++j) acc[i + j] = fold(acc[i + j], in[i + j]);
  for (; i < n; ++i) acc[i] = fold(acc[i], in[i]);
}

/// out[i] = a[i] R b[i] (no overlap between any two of them)
template <ReduceOp R, class T>
void reduce_to(T* __restrict out, const T* __restrict a, const T* __restrict b, std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + kBlock <= n; i += kBlock)
    for (std::size_t j = 0; j < kBlock; ++j) out[i + j] = combine<R, T>(a[i + j], b[i + j]);
  for (; i < n; ++i) out[i] = combine<R, T>(a[i], b[i]);
}

/// The type-erased kernel shape engines call (gloo's reduction function has this shape):
/// out = a R b over n elements, where `out` may be identical to `a` or `b` (never partially overlapping).
using reduce_fn = void (*)(void* out, const void* a, const void* b, std::size_t n);

template <ReduceOp R, class T>
void reduce_kernel(void* out, const void* a, const void* b, std::size_t n) noexcept {
  auto* o = static_cast<T*>(out);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  // Built-in ops are commutative, so an alias of either input becomes an accumulate.
  if (o == x)
    reduce_into<R, T>(o, y, n);
  else if (o == y)
    reduce_into<R, T>(o, x, n);
  else
    reduce_to<R, T>(o, x, y, n);
}

/// `pick(std::integral_constant<ReduceOp, R>{})` for the reduction R that runs `r` on `T` (avg:
/// sum), or a null `Fn` when `r` does not apply to `T` (bitwise on floating types): one switch for
/// every kernel shape.
template <element T, class Fn, class Pick>
[[nodiscard]] constexpr Fn kernel_for(ReduceOp r, Pick pick) noexcept {
  using K = ReduceOp;
  switch (r) {
    case K::sum:
    case K::avg: return pick(std::integral_constant<K, K::sum>{});
    case K::prod: return pick(std::integral_constant<K, K::prod>{});
    case K::min: return pick(std::integral_constant<K, K::min>{});
    case K::max: return pick(std::integral_constant<K, K::max>{});
    case K::band:
    case K::bor:
    case K::bxor:
      if constexpr (std::is_integral_v<T>) {
        if (r == K::band) return pick(std::integral_constant<K, K::band>{});
        if (r == K::bor) return pick(std::integral_constant<K, K::bor>{});
        return pick(std::integral_constant<K, K::bxor>{});
      } else {
        return nullptr;
      }
  }
  return nullptr;
}

/// The kernel for reduction `r` on `T`; null when `r` does not apply to `T` (bitwise on floating).
template <element T>
[[nodiscard]] constexpr reduce_fn reduce_kernel_for(ReduceOp r) noexcept {
  return kernel_for<T, reduce_fn>(r, []<ReduceOp R>(std::integral_constant<ReduceOp, R>) -> reduce_fn {
    return &reduce_kernel<R, T>;
  });
}

/// The n-input kernel shape (engines that see every rank's data at once, e.g. Shm):
/// out = srcs[0] R srcs[1] R ... R srcs[n-1] over `count` elements. `out` may be identical to one
/// of the sources (each block of every source is read before that block of `out` is written).
using reduce_many_fn = void (*)(void* out, const void* const* srcs, int n, std::size_t count);

/// half/bfloat16/fp8 accumulate in float across all inputs and round once; the other types
/// combine in their own type (integers wrap, as in combine()). The inputs fold from the left,
/// srcs[0] first, on every rank alike. From three inputs the accumulator block lives in memory
/// (n is known only at run time), so each pass over it costs a load and a store per element: the
/// first pass folds two inputs and each later one two more. Seeded with srcs[0] alone, one input
/// a pass, it took 30-33 us for the 512 KiB slice of Shm's 2-rank 1 MiB all_reduce, where a
/// plain loop took 13.5-15 (benchmarks/RESULTS.md, "The reduction kernel: two inputs a pass").
template <ReduceOp R, class T>
void reduce_many_kernel(void* out, const void* const* srcs, int n, std::size_t count) noexcept {
  Expects(n >= 1);  // srcs[0] seeds the accumulator
  using A = std::conditional_t<is_half_like_v<T>, float, T>;
  auto* o = static_cast<T*>(out);
  auto src = [srcs](int k, std::size_t at) { return static_cast<const T*>(srcs[k]) + at; };
  if (n == 2 && srcs[0] != srcs[1]) {
    // Two inputs (every 2-rank reduction) go straight to `out`, without the accumulator's round
    // trip: 512 KiB 18.2 against 19.5 us (RESULTS.md, as above). combine() rounds a half-like
    // pair once, as the fold below does, and the operands keep their order: the same bits.
    const T* a = src(0, 0);
    const T* b = src(1, 0);
    if (o == a) return reduce_into<R, T>(o, b, count);
    if (o == b) return reduce_into<R, T, false>(o, a, count);
    return reduce_to<R, T>(o, a, b, count);
  }
  std::size_t i = 0;
  A acc[kBlock];
  for (; i + kBlock <= count; i += kBlock) {
    const T* s0 = src(0, i);
    int k = 1;
    if (n == 1) {
      for (std::size_t j = 0; j < kBlock; ++j) acc[j] = static_cast<A>(s0[j]);
    } else {
      const T* s1 = src(1, i);
      for (std::size_t j = 0; j < kBlock; ++j) acc[j] = combine<R, A>(static_cast<A>(s0[j]), static_cast<A>(s1[j]));
      k = 2;
    }
    for (; k + 1 < n; k += 2) {
      const T* sk = src(k, i);
      const T* sl = src(k + 1, i);
      for (std::size_t j = 0; j < kBlock; ++j)
        acc[j] = combine<R, A>(combine<R, A>(acc[j], static_cast<A>(sk[j])), static_cast<A>(sl[j]));
    }
    if (k < n) {
      const T* sk = src(k, i);
      for (std::size_t j = 0; j < kBlock; ++j) acc[j] = combine<R, A>(acc[j], static_cast<A>(sk[j]));
    }
    for (std::size_t j = 0; j < kBlock; ++j) o[i + j] = static_cast<T>(acc[j]);
  }
  for (; i < count; ++i) {
    A a = static_cast<A>(static_cast<const T*>(srcs[0])[i]);
    for (int k = 1; k < n; ++k) a = combine<R, A>(a, static_cast<A>(static_cast<const T*>(srcs[k])[i]));
    o[i] = static_cast<T>(a);
  }
}

/// The n-input kernel for reduction `r` (avg: sum) on `T`; null for bitwise on floating types.
template <element T>
[[nodiscard]] constexpr reduce_many_fn reduce_many_for(ReduceOp r) noexcept {
  return kernel_for<T, reduce_many_fn>(r, []<ReduceOp R>(std::integral_constant<ReduceOp, R>) -> reduce_many_fn {
    return &reduce_many_kernel<R, T>;
  });
}

/// Element-wise application of a user callable `T(T, T)`; `out` may alias `a` or `b`.
template <class T, class F>
void reduce_custom(const F& f, T* out, const T* a, const T* b, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<T>(f(a[i], b[i]));
}

/// Floor division of a signed integer by a positive divisor.
template <class T>
[[nodiscard]] constexpr T floor_div(T a, T d) noexcept {
  if constexpr (std::is_signed_v<T>) {
    T q = static_cast<T>(a / d);
    if ((a % d != 0) && (a < 0)) q = static_cast<T>(q - 1);
    return q;
  } else {
    return static_cast<T>(a / d);
  }
}

/// Turns a sum over `size` ranks into the average, in place: floating types multiply by 1/size;
/// integers use floor division (so the result is the floor of the exact mean of the wrapped sum).
template <element T>
void finish_avg(T* __restrict data, std::size_t n, int size) noexcept {
  Expects(size >= 1);  // a communicator's size; the integer path divides by it
  if constexpr (is_half_like_v<T>) {
    const float scale = 1.0f / static_cast<float>(size);
    for (std::size_t i = 0; i < n; ++i) data[i] = T(static_cast<float>(data[i]) * scale);
  } else if constexpr (std::is_floating_point_v<T>) {
    const T scale = T(1) / static_cast<T>(size);
    for (std::size_t i = 0; i < n; ++i) data[i] *= scale;
  } else {
    const T d = static_cast<T>(size);
    if (static_cast<long long>(d) == static_cast<long long>(size)) {
      for (std::size_t i = 0; i < n; ++i) data[i] = floor_div<T>(data[i], d);
    } else {
      // More ranks than T can count (int8/uint8 beyond 127/255 ranks): every |value| is below
      // size, so the floor of the mean is 0, or -1 for a negative sum.
      for (std::size_t i = 0; i < n; ++i) {
        if constexpr (std::is_signed_v<T>)
          data[i] = static_cast<T>(data[i] < 0 ? -1 : 0);
        else
          data[i] = 0;
      }
    }
  }
}

}  // namespace comm::detail
