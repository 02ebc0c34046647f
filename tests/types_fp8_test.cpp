// comm::float8_e4m3 and comm::float8_e5m2: every bit pattern decoded against the OCP formulas,
// every pattern round-tripped, rounding checked against a nearest-value search over all finite
// values (ties to even), saturation and NaN rules, and, where the CUDA toolkit's headers are
// available, bit-for-bit agreement with CUDA's own host conversions (__NV_SATFINITE).
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <comm/types.hpp>

#if defined(COMM_TEST_CUDA_FP8)
#include <cuda_fp8.h>
#endif

namespace {

struct Format {
  int exp_bits;
  int mant_bits;
  bool ieee;  // top exponent reserved for inf/NaN (e5m2) vs only S.1111.111 is NaN (e4m3)
  double max;
};

template <class F>
constexpr Format format_of() {
  if constexpr (std::is_same_v<F, comm::float8_e4m3>)
    return {4, 3, false, 448.0};
  else
    return {5, 2, true, 57344.0};
}

template <class F>
bool is_nan_pattern(std::uint8_t b) {
  constexpr Format f = format_of<F>();
  if (!f.ieee) return (b & 0x7f) == 0x7f;
  return ((b >> f.mant_bits) & ((1 << f.exp_bits) - 1)) == (1 << f.exp_bits) - 1 && (b & ((1 << f.mant_bits) - 1)) != 0;
}

/// The value of a bit pattern by the OCP formulas, computed in double independently of comm.
template <class F>
double reference_value(std::uint8_t b) {
  constexpr Format f = format_of<F>();
  const int bias = (1 << (f.exp_bits - 1)) - 1;
  const int e = (b >> f.mant_bits) & ((1 << f.exp_bits) - 1);
  const int m = b & ((1 << f.mant_bits) - 1);
  const double s = (b & 0x80) != 0 ? -1.0 : 1.0;
  if (is_nan_pattern<F>(b)) return std::numeric_limits<double>::quiet_NaN();
  if (f.ieee && e == (1 << f.exp_bits) - 1) return s * std::numeric_limits<double>::infinity();
  if (e == 0) return s * std::ldexp(static_cast<double>(m), 1 - bias - f.mant_bits);
  return s * std::ldexp(1.0 + m / static_cast<double>(1 << f.mant_bits), e - bias);
}

/// The non-negative finite values in increasing order, each with its bit pattern.
template <class F>
std::vector<std::pair<double, std::uint8_t>> finite_table() {
  std::vector<std::pair<double, std::uint8_t>> t;
  for (int b = 0; b < 0x80; ++b) {
    const double v = reference_value<F>(static_cast<std::uint8_t>(b));
    if (std::isfinite(v)) t.emplace_back(v, static_cast<std::uint8_t>(b));
  }
  std::sort(t.begin(), t.end());
  return t;
}

/// The expected encoding of `x` (finite): the nearest finite value, ties to the even pattern,
/// beyond the largest: the largest (saturation); signed like x, zero included.
template <class F>
std::uint8_t reference_encode(float x, const std::vector<std::pair<double, std::uint8_t>>& t) {
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= t.back().first) return static_cast<std::uint8_t>(sign | t.back().second);
  const auto hi = std::upper_bound(t.begin(), t.end(), std::pair<double, std::uint8_t>{a, 0xff});
  const auto lo = hi - 1;
  const double dlo = a - lo->first, dhi = hi->first - a;
  std::uint8_t b = 0;
  if (dlo < dhi)
    b = lo->second;
  else if (dhi < dlo)
    b = hi->second;
  else
    b = (lo->second & 1) == 0 ? lo->second : hi->second;
  return static_cast<std::uint8_t>(sign | b);
}

template <class F>
std::uint8_t enc(float x) {
  return F(x).bits;
}

}  // namespace

TEST_CASE_TEMPLATE("fp8: traits", F, comm::float8_e4m3, comm::float8_e5m2) {
  static_assert(sizeof(F) == 1 && alignof(F) == 1);
  static_assert(std::is_trivially_copyable_v<F> && std::is_standard_layout_v<F>);
  static_assert(comm::element<F> && comm::floating_element<F> && !comm::integral_element<F>);
  CHECK(comm::size_of(comm::dtype_of<F>) == 1);
  CHECK(comm::is_floating(comm::dtype_of<F>));

  CHECK(comm::to_string(comm::dtype_of<comm::float8_e4m3>) == "float8_e4m3");
  CHECK(comm::to_string(comm::dtype_of<comm::float8_e5m2>) == "float8_e5m2");
  // Conversions are usable in constant expressions, like half's.
  static_assert(static_cast<float>(F(1.5f)) == 1.5f);
  static_assert(F(-2.0f).bits == (F(2.0f).bits | 0x80));
}

TEST_CASE_TEMPLATE("fp8: every bit pattern decodes to its OCP value and round-trips", F, comm::float8_e4m3,
                   comm::float8_e5m2) {
  for (int i = 0; i < 256; ++i) {
    const auto b = static_cast<std::uint8_t>(i);
    const float got = static_cast<float>(F::from_bits(b));
    const double want = reference_value<F>(b);
    CAPTURE(i);
    if (std::isnan(want)) {
      CHECK(std::isnan(got));
      CHECK(enc<F>(got) == 0x7f);  // NaN stays NaN, canonical (as CUDA)
    } else if (std::isinf(want)) {
      CHECK(got == static_cast<float>(want));
    } else {
      CHECK(static_cast<double>(got) == want);
      CHECK(enc<F>(got) == b);  // -0 included
    }
  }
}

TEST_CASE("fp8: known values, e4m3") {
  using F = comm::float8_e4m3;
  CHECK(enc<F>(0.0f) == 0x00);
  CHECK(enc<F>(-0.0f) == 0x80);
  CHECK(enc<F>(1.0f) == 0x38);
  CHECK(enc<F>(-1.0f) == 0xb8);
  CHECK(enc<F>(0.5f) == 0x30);
  CHECK(enc<F>(448.0f) == 0x7e);
  CHECK(enc<F>(-448.0f) == 0xfe);
  CHECK(enc<F>(0x1p-6f) == 0x08);  // smallest normal
  CHECK(enc<F>(0x1p-9f) == 0x01);  // smallest subnormal
  CHECK(enc<F>(0x7p-9f) == 0x07);  // largest subnormal
  CHECK(static_cast<float>(F::from_bits(0x7e)) == 448.0f);
  CHECK(static_cast<float>(F::from_bits(0x01)) == 0x1p-9f);
  CHECK(std::isnan(static_cast<float>(F::from_bits(0x7f))));
  CHECK(std::isnan(static_cast<float>(F::from_bits(0xff))));
  CHECK_FALSE(std::isinf(static_cast<float>(F::from_bits(0x78))));  // S.1111.000 is 256, not inf
  CHECK(static_cast<float>(F::from_bits(0x78)) == 256.0f);
}

TEST_CASE("fp8: known values, e5m2") {
  using F = comm::float8_e5m2;
  CHECK(enc<F>(1.0f) == 0x3c);
  CHECK(enc<F>(-2.0f) == 0xc0);
  CHECK(enc<F>(57344.0f) == 0x7b);
  CHECK(enc<F>(0x1p-14f) == 0x04);  // smallest normal
  CHECK(enc<F>(0x1p-16f) == 0x01);  // smallest subnormal
  CHECK(static_cast<float>(F::from_bits(0x7c)) == std::numeric_limits<float>::infinity());
  CHECK(static_cast<float>(F::from_bits(0xfc)) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(static_cast<float>(F::from_bits(0x7d))));
  CHECK(std::isnan(static_cast<float>(F::from_bits(0x7e))));
  // e5m2 is the top byte of a binary16.
  for (int i = 0; i < 256; ++i) {
    const float h = static_cast<float>(comm::half::from_bits(static_cast<std::uint16_t>(i << 8)));
    const float f = static_cast<float>(F::from_bits(static_cast<std::uint8_t>(i)));
    CHECK((f == h || (std::isnan(f) && std::isnan(h))));
  }
}

TEST_CASE("fp8: rounding to nearest even") {
  using E4 = comm::float8_e4m3;
  using E5 = comm::float8_e5m2;
  // e4m3 near 1: spacing 1/8.
  CHECK(enc<E4>(1.0625f) == 0x38);  // halfway 1 .. 1.125: to even (1.000)
  CHECK(enc<E4>(1.1875f) == 0x3a);  // halfway 1.125 .. 1.25: to even (1.010)
  CHECK(enc<E4>(std::nextafter(1.0625f, 2.0f)) == 0x39);
  CHECK(enc<E4>(std::nextafter(1.0625f, 0.0f)) == 0x38);
  CHECK(enc<E4>(15.5f) == 0x58);        // 15 .. 16 at the exponent boundary: carries to 16
  CHECK(enc<E4>(0x1p-10f) == 0x00);     // half the smallest subnormal: ties to zero
  CHECK(enc<E4>(0x3p-10f) == 0x02);     // 1.5 units: to even (2 units)
  CHECK(enc<E4>(0x1.08p-10f) == 0x01);  // just above half a unit
  CHECK(enc<E4>(0xfp-10f) == 0x08);     // 7.5 units: rounds up into the smallest normal
  CHECK(enc<E4>(-0x1p-12f) == 0x80);    // underflow keeps the sign
  // e5m2 near 1: spacing 1/4.
  CHECK(enc<E5>(1.125f) == 0x3c);
  CHECK(enc<E5>(1.375f) == 0x3e);
  CHECK(enc<E5>(0x1p-17f) == 0x00);
  CHECK(enc<E5>(0x3p-17f) == 0x02);
}

TEST_CASE("fp8: saturation and NaN") {
  using E4 = comm::float8_e4m3;
  using E5 = comm::float8_e5m2;
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(enc<E4>(464.0f) == 0x7e);  // halfway to the (NaN) pattern above 448: to even, 448
  CHECK(enc<E4>(465.0f) == 0x7e);  // saturates instead of becoming NaN
  CHECK(enc<E4>(1e30f) == 0x7e);
  CHECK(enc<E4>(-1e30f) == 0xfe);
  CHECK(enc<E4>(inf) == 0x7e);  // no infinity in e4m3
  CHECK(enc<E4>(-inf) == 0xfe);
  CHECK(enc<E4>(std::numeric_limits<float>::max()) == 0x7e);
  CHECK(enc<E4>(nan) == 0x7f);
  CHECK(enc<E4>(-nan) == 0x7f);      // canonical, sign dropped (as CUDA)
  CHECK(enc<E5>(61440.0f) == 0x7b);  // halfway to 65536: to even, 57344
  CHECK(enc<E5>(70000.0f) == 0x7b);
  CHECK(enc<E5>(inf) == 0x7b);  // as CUDA's __NV_SATFINITE constructors
  CHECK(enc<E5>(-inf) == 0xfb);
  CHECK(enc<E5>(nan) == 0x7f);
  CHECK(enc<E5>(-nan) == 0x7f);
  CHECK(enc<E5>(std::bit_cast<float>(0xff800001u)) == 0x7f);  // signalling, negative
  CHECK(enc<E4>(std::numeric_limits<float>::denorm_min()) == 0x00);
  CHECK(enc<E5>(-std::numeric_limits<float>::denorm_min()) == 0x80);
}

TEST_CASE_TEMPLATE("fp8: float sweep against a nearest-value search", F, comm::float8_e4m3, comm::float8_e5m2) {
  const auto table = finite_table<F>();
  long bad = 0;
  // A stride prime to 2^32 visits every exponent and many mantissas; the midpoints and their
  // neighbours are added explicitly, since a sweep rarely lands on an exact tie.
  std::vector<float> xs;
  for (std::uint64_t u = 0; u < (1ull << 32); u += 65521)
    xs.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(u)));
  for (std::size_t i = 0; i + 1 < table.size(); ++i) {
    const auto mid = static_cast<float>((table[i].first + table[i + 1].first) / 2);
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f), static_cast<float>(table[i].first)}) {
      xs.push_back(x);
      xs.push_back(-x);
    }
  }
  for (float x : xs) {
    if (std::isnan(x) || std::isinf(x)) continue;
    const std::uint8_t want = reference_encode<F>(x, table);
    const std::uint8_t got = enc<F>(x);
    if (got != want && ++bad <= 5)
      MESSAGE("x = ", x, " (", std::bit_cast<std::uint32_t>(x), "): got ", int(got), ", want ", int(want));
  }
  CHECK(bad == 0);
}

#if defined(COMM_TEST_CUDA_FP8)
TEST_CASE_TEMPLATE("fp8: bit-for-bit with CUDA's host conversions (__NV_SATFINITE)", F, comm::float8_e4m3,
                   comm::float8_e5m2) {
  constexpr auto kind = std::is_same_v<F, comm::float8_e4m3> ? __NV_E4M3 : __NV_E5M2;
  long bad = 0;
  for (std::uint64_t u = 0; u < (1ull << 32); u += 4099) {
    const float x = std::bit_cast<float>(static_cast<std::uint32_t>(u));
    const auto want = static_cast<std::uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, kind));
    const std::uint8_t got = enc<F>(x);
    if (got != want && ++bad <= 5) MESSAGE("x = ", x, " (", u, "): comm ", int(got), ", CUDA ", int(want));
  }
  CHECK(bad == 0);
  for (int i = 0; i < 256; ++i) {
    const auto b = static_cast<std::uint8_t>(i);
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), kind);
    const float want = static_cast<float>(comm::half::from_bits(h.x));
    const float got = static_cast<float>(F::from_bits(b));
    CAPTURE(i);
    CHECK((got == want || (std::isnan(got) && std::isnan(want))));
  }
}
#endif
