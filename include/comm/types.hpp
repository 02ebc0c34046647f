#pragma once
/// \file
/// Element types, reduction ops (runtime values and compile-time objects) and their traits.

#include <bit>
#include <cstdint>
#include <cstring>
#include <functional>
#include <ranges>
#include <span>
#include <string_view>
#include <type_traits>

#include <comm/error.hpp>

namespace comm {

/// A reduction chosen at run time (from a config, through AnyCommunicator). Checked against the
/// element type and backend at run time; an unsupported pair throws comm::InvalidArgument.
enum class ReduceOp : std::uint8_t { sum, prod, min, max, avg, band, bor, bxor };

/// The op's name, as comm's messages and the flight recorder write it ("sum", "bxor").
[[nodiscard]] constexpr std::string_view to_string(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::prod: return "prod";
    case ReduceOp::min: return "min";
    case ReduceOp::max: return "max";
    case ReduceOp::avg: return "avg";
    case ReduceOp::band: return "band";
    case ReduceOp::bor: return "bor";
    case ReduceOp::bxor: return "bxor";
  }
  return "unknown";
}

/// Whether `op` is bitwise (band, bor, bxor): integer element types only.
[[nodiscard]] constexpr bool is_bitwise(ReduceOp op) noexcept {
  return op == ReduceOp::band || op == ReduceOp::bor || op == ReduceOp::bxor;
}

/// IEEE 754 binary16, bit-compatible with CUDA `__half`. Arithmetic goes through float.
struct half {
  /// The binary16 bits.
  std::uint16_t bits = 0;

  half() = default;
  /// Converts from float, rounding to nearest even (overflow: infinity).
  constexpr half(float f) noexcept : bits(from_float(f)) {}  // NOLINT: implicit like __half
  /// The value whose binary16 bits are `b`.
  [[nodiscard]] static constexpr half from_bits(std::uint16_t b) noexcept {
    half h;
    h.bits = b;
    return h;
  }
  /// The value as float (exact).
  constexpr operator float() const noexcept { return to_float(bits); }  // NOLINT
  /// Bitwise equality: +0 and -0 differ, a NaN equals a NaN of the same bits.
  friend constexpr bool operator==(half a, half b) noexcept { return a.bits == b.bits; }

 private:
  static constexpr std::uint16_t from_float(float f) noexcept {
    const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
    const std::uint32_t sign = (x >> 16) & 0x8000u;
    const std::uint32_t absx = x & 0x7fffffffu;
    if (absx >= 0x7f800000u)  // inf or nan; keep nan quiet and non-zero
      return static_cast<std::uint16_t>(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0u));
    if (absx >= 0x477ff000u)  // rounds to a value >= 65520: overflow to inf
      return static_cast<std::uint16_t>(sign | 0x7c00u);
    if (absx < 0x38800000u) {  // below the smallest normal half: subnormal or zero
      if (absx < 0x33000000u) return static_cast<std::uint16_t>(sign);
      const std::uint32_t mant = (absx & 0x7fffffu) | 0x800000u;
      const int shift = 126 - static_cast<int>(absx >> 23);  // 14..24 for this range
      std::uint32_t v = mant >> shift;
      const std::uint32_t rem = mant & ((1u << shift) - 1u);
      const std::uint32_t halfway = 1u << (shift - 1);
      if (rem > halfway || (rem == halfway && (v & 1u))) ++v;
      return static_cast<std::uint16_t>(sign | v);
    }
    // Normal: rebias exponent, round to nearest even on the 13 dropped bits.
    std::uint32_t v = ((absx >> 13) - (112u << 10));
    const std::uint32_t rem = absx & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (v & 1u))) ++v;
    return static_cast<std::uint16_t>(sign | v);
  }
  static constexpr float to_float(std::uint16_t h) noexcept {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    const std::uint32_t exp = (h >> 10) & 0x1fu;
    std::uint32_t mant = h & 0x3ffu;
    std::uint32_t out = 0;
    if (exp == 0x1f) {
      out = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
      out = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
      out = sign;
    } else {  // subnormal half: normalise into a float
      std::uint32_t e = 113;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --e;
      }
      out = sign | (e << 23) | ((mant & 0x3ffu) << 13);
    }
    return std::bit_cast<float>(out);
  }
};

/// bfloat16 (the top half of an IEEE float), bit-compatible with CUDA `__nv_bfloat16`.
struct bfloat16 {
  /// The bfloat16 bits (the high half of a float's).
  std::uint16_t bits = 0;

  bfloat16() = default;
  /// Converts from float, rounding to nearest even (NaN stays NaN).
  constexpr bfloat16(float f) noexcept : bits(from_float(f)) {}  // NOLINT: implicit like __nv_bfloat16
  /// The value whose bfloat16 bits are `b`.
  [[nodiscard]] static constexpr bfloat16 from_bits(std::uint16_t b) noexcept {
    bfloat16 h;
    h.bits = b;
    return h;
  }
  /// The value as float (exact).
  constexpr operator float() const noexcept {  // NOLINT
    return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
  }
  /// Bitwise equality: +0 and -0 differ, a NaN equals a NaN of the same bits.
  friend constexpr bool operator==(bfloat16 a, bfloat16 b) noexcept { return a.bits == b.bits; }

 private:
  static constexpr std::uint16_t from_float(float f) noexcept {
    const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
    const std::uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);  // nearest even
    return static_cast<std::uint16_t>((x + rounding) >> 16);
  }
};

static_assert(sizeof(half) == 2 && sizeof(bfloat16) == 2);

namespace detail {
/// Encoding of an OCP 8-bit float with `E` exponent and `M` mantissa bits (bias 2^(E-1) - 1), as
/// CUDA's `__nv_fp8_*` constructors do it (__NV_SATFINITE), so that host and device agree bit for
/// bit: round to nearest even; finite values beyond the largest and infinities saturate to +-max;
/// every NaN becomes 0x7f. `MaxBits` is the largest finite magnitude's pattern; `Ieee`: the top
/// exponent is reserved for inf/NaN (e5m2), else only S.1111.111 is NaN (e4m3).
template <int E, int M, std::uint8_t MaxBits, bool Ieee>
struct fp8_codec {
  static constexpr int bias = (1 << (E - 1)) - 1;
  static constexpr int exp_mask = (1 << E) - 1;

  [[nodiscard]] static constexpr std::uint8_t encode(float f) noexcept {
    const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
    const auto sign = static_cast<std::uint8_t>((x >> 24) & 0x80u);
    const std::uint32_t absx = x & 0x7fffffffu;
    // Every NaN becomes the canonical 0x7f (a NaN in both formats), sign dropped, as CUDA does.
    if (absx > 0x7f800000u) return 0x7fu;
    const int e = static_cast<int>(absx >> 23) - 127;  // float subnormals give -127: flush below
    std::uint32_t v = 0;
    if (e >= 1 - bias) {
      // Inf and huge values make v exceed MaxBits here and saturate below; no overflow in 32 bits.
      const int drop = 23 - M;
      v = (absx >> drop) - (static_cast<std::uint32_t>(127 - bias) << M);
      const std::uint32_t rem = absx & ((1u << drop) - 1u);
      const std::uint32_t halfway = 1u << (drop - 1);
      if (rem > halfway || (rem == halfway && (v & 1u))) ++v;  // a carry into the exponent is right
    } else {
      // Subnormal target: v counts units of 2^(1 - bias - M); at most 24 bits are shifted out.
      const int shift = 23 + 1 - bias - M - e;
      if (shift > 24) return sign;
      const std::uint32_t mant = (absx & 0x7fffffu) | 0x800000u;
      v = mant >> shift;
      const std::uint32_t rem = mant & ((1u << shift) - 1u);
      const std::uint32_t halfway = 1u << (shift - 1);
      if (rem > halfway || (rem == halfway && (v & 1u))) ++v;
    }
    if (v > MaxBits) v = MaxBits;
    return static_cast<std::uint8_t>(sign | v);
  }

  [[nodiscard]] static constexpr float decode(std::uint8_t b) noexcept {
    const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x80u) << 24;
    const std::uint32_t ef = (b >> M) & static_cast<std::uint32_t>(exp_mask);
    const std::uint32_t m = b & ((1u << M) - 1u);
    if constexpr (Ieee) {
      if (ef == static_cast<std::uint32_t>(exp_mask)) return std::bit_cast<float>(sign | 0x7f800000u | (m << (23 - M)));
    } else {
      if ((b & 0x7fu) == 0x7fu) return std::bit_cast<float>(sign | 0x7fc00000u);
    }
    if (ef == 0) {
      // Subnormal: m units of 2^(1 - bias - M), a product float represents exactly.
      const float unit = std::bit_cast<float>(static_cast<std::uint32_t>(127 + 1 - bias - M) << 23);
      const float mag = static_cast<float>(m) * unit;
      return sign != 0 ? -mag : mag;
    }
    return std::bit_cast<float>(sign | ((ef - static_cast<std::uint32_t>(bias) + 127u) << 23) | (m << (23 - M)));
  }
};
}  // namespace detail

/// OCP FP8 E4M3 ("e4m3fn"), bit-compatible with CUDA `__nv_fp8_e4m3`: 1 sign, 4 exponent (bias 7)
/// and 3 mantissa bits; no infinity; NaN is S.1111.111; largest finite 448, smallest subnormal
/// 2^-9. From float, as CUDA's constructor: round to nearest even; beyond +-448 and +-inf saturate
/// to +-448; every NaN becomes 0x7f. Arithmetic goes through float.
struct float8_e4m3 {
  /// The FP8 bits.
  std::uint8_t bits = 0;

  float8_e4m3() = default;
  /// Converts from float as CUDA's constructor does (see above).
  constexpr float8_e4m3(float f) noexcept : bits(codec::encode(f)) {}  // NOLINT: implicit like __nv_fp8_e4m3
  /// The value whose FP8 bits are `b`.
  [[nodiscard]] static constexpr float8_e4m3 from_bits(std::uint8_t b) noexcept {
    float8_e4m3 h;
    h.bits = b;
    return h;
  }
  /// The value as float (exact).
  constexpr operator float() const noexcept { return codec::decode(bits); }  // NOLINT
  /// Bitwise equality: +0 and -0 differ, a NaN equals a NaN of the same bits.
  friend constexpr bool operator==(float8_e4m3 a, float8_e4m3 b) noexcept { return a.bits == b.bits; }

 private:
  using codec = detail::fp8_codec<4, 3, 0x7e, false>;
};

/// OCP FP8 E5M2, bit-compatible with CUDA `__nv_fp8_e5m2`: 1 sign, 5 exponent (bias 15) and 2
/// mantissa bits, IEEE-like (the top half of a binary16): +-inf, NaNs, largest finite 57344,
/// smallest subnormal 2^-16. From float, as CUDA's constructor: round to nearest even; beyond
/// +-57344 and +-inf saturate to +-57344 (an infinity is from_bits(0x7c)); every NaN becomes 0x7f.
/// Arithmetic goes through float.
struct float8_e5m2 {
  /// The FP8 bits.
  std::uint8_t bits = 0;

  float8_e5m2() = default;
  /// Converts from float as CUDA's constructor does (see above).
  constexpr float8_e5m2(float f) noexcept : bits(codec::encode(f)) {}  // NOLINT: implicit like __nv_fp8_e5m2
  /// The value whose FP8 bits are `b`.
  [[nodiscard]] static constexpr float8_e5m2 from_bits(std::uint8_t b) noexcept {
    float8_e5m2 h;
    h.bits = b;
    return h;
  }
  /// The value as float (exact).
  constexpr operator float() const noexcept { return codec::decode(bits); }  // NOLINT
  /// Bitwise equality: +0 and -0 differ, a NaN equals a NaN of the same bits.
  friend constexpr bool operator==(float8_e5m2 a, float8_e5m2 b) noexcept { return a.bits == b.bits; }

 private:
  using codec = detail::fp8_codec<5, 2, 0x7b, true>;
};

static_assert(sizeof(float8_e4m3) == 1 && sizeof(float8_e5m2) == 1);
static_assert(std::is_trivially_copyable_v<float8_e4m3> && std::is_trivially_copyable_v<float8_e5m2>);

/// Runtime tag of an element type, used in messages, fingerprints and type-erased calls.
/// New entries go last: the values are flight-recorder and desync-fingerprint codes.
enum class Dtype : std::uint8_t {
  int8, uint8, int32, uint32, int64, uint64, float16, bfloat16, float32, float64, float8_e4m3, float8_e5m2
};

/// The element type's name, as comm's messages write it ("float", "bfloat16").
[[nodiscard]] constexpr std::string_view to_string(Dtype d) noexcept {
  switch (d) {
    case Dtype::int8: return "int8";
    case Dtype::uint8: return "uint8";
    case Dtype::int32: return "int32";
    case Dtype::uint32: return "uint32";
    case Dtype::int64: return "int64";
    case Dtype::uint64: return "uint64";
    case Dtype::float16: return "half";
    case Dtype::bfloat16: return "bfloat16";
    case Dtype::float32: return "float";
    case Dtype::float64: return "double";
    case Dtype::float8_e4m3: return "float8_e4m3";
    case Dtype::float8_e5m2: return "float8_e5m2";
  }
  return "unknown";
}

namespace detail {
template <class T> struct dtype_of_impl {};
template <> struct dtype_of_impl<std::int8_t> { static constexpr Dtype value = Dtype::int8; };
template <> struct dtype_of_impl<std::uint8_t> { static constexpr Dtype value = Dtype::uint8; };
template <> struct dtype_of_impl<std::int32_t> { static constexpr Dtype value = Dtype::int32; };
template <> struct dtype_of_impl<std::uint32_t> { static constexpr Dtype value = Dtype::uint32; };
template <> struct dtype_of_impl<std::int64_t> { static constexpr Dtype value = Dtype::int64; };
template <> struct dtype_of_impl<std::uint64_t> { static constexpr Dtype value = Dtype::uint64; };
template <> struct dtype_of_impl<half> { static constexpr Dtype value = Dtype::float16; };
template <> struct dtype_of_impl<bfloat16> { static constexpr Dtype value = Dtype::bfloat16; };
template <> struct dtype_of_impl<float> { static constexpr Dtype value = Dtype::float32; };
template <> struct dtype_of_impl<double> { static constexpr Dtype value = Dtype::float64; };
template <> struct dtype_of_impl<float8_e4m3> { static constexpr Dtype value = Dtype::float8_e4m3; };
template <> struct dtype_of_impl<float8_e5m2> { static constexpr Dtype value = Dtype::float8_e5m2; };

// The 64-bit integers a user spells otherwise: `long long` is not int64_t on LP64 Linux (int64_t is
// `long` there), `long` is not int64_t where int64_t is `long long`. MPI and NCCL users pass them
// as the 64-bit types; the facade hands backends the <cstdint> type (see canonical_element_t).
template <class T>
inline constexpr bool is_other_int64 = (std::is_same_v<T, long> || std::is_same_v<T, long long>) &&
                                       sizeof(T) == 8 && !std::is_same_v<T, std::int64_t>;
template <class T>
inline constexpr bool is_other_uint64 = (std::is_same_v<T, unsigned long> || std::is_same_v<T, unsigned long long>) &&
                                        sizeof(T) == 8 && !std::is_same_v<T, std::uint64_t>;
template <class T>
  requires is_other_int64<T>
struct dtype_of_impl<T> {
  static constexpr Dtype value = Dtype::int64;
};
template <class T>
  requires is_other_uint64<T>
struct dtype_of_impl<T> {
  static constexpr Dtype value = Dtype::uint64;
};
}  // namespace detail

/// The element types comm moves: int8..uint64 (`long long` and `unsigned long long` are the
/// 64-bit ones), float, double, half, bfloat16, float8_e4m3, float8_e5m2.
template <class T>
concept element = requires { detail::dtype_of_impl<std::remove_cv_t<T>>::value; };

namespace detail {
/// The type a backend receives for element `T`: `T` itself, except the 64-bit integers spelt
/// otherwise (`long long` on LP64), which become std::int64_t / std::uint64_t of the same size
/// and representation, so no backend needs a second type map.
template <class T>
struct canonical_element {
  using type = T;
};
template <class T>
  requires is_other_int64<T>
struct canonical_element<T> {
  using type = std::int64_t;
};
template <class T>
  requires is_other_uint64<T>
struct canonical_element<T> {
  using type = std::uint64_t;
};
template <class T>
using canonical_element_t = typename canonical_element<T>::type;

/// canonical_element_t<T> with the element concept's message when `T` is no element. An alias
/// to a class template's member: naming it instantiates the class at once, so this message comes
/// before any error that the rest of the operation would cause with the wrong type (a static_assert
/// in a function body would be instantiated only at the end of the translation unit).
template <class T>
struct checked_element {
  static_assert(element<T>,
                "comm: unsupported element type; use int8_t, uint8_t, int32_t, uint32_t, int64_t (long long), "
                "uint64_t (unsigned long long), float, double, comm::half, comm::bfloat16, comm::float8_e4m3 or "
                "comm::float8_e5m2");
  using type = canonical_element_t<T>;
};
template <class T>
using checked_element_t = typename checked_element<std::remove_cv_t<T>>::type;
}  // namespace detail

/// The run-time Dtype of element type `T`.
template <element T>
inline constexpr Dtype dtype_of = detail::dtype_of_impl<std::remove_cv_t<T>>::value;

/// Floating element types (bitwise reductions are rejected for these).
template <class T>
concept floating_element = element<T> && (std::is_floating_point_v<std::remove_cv_t<T>> ||
                                          std::is_same_v<std::remove_cv_t<T>, half> ||
                                          std::is_same_v<std::remove_cv_t<T>, bfloat16> ||
                                          std::is_same_v<std::remove_cv_t<T>, float8_e4m3> ||
                                          std::is_same_v<std::remove_cv_t<T>, float8_e5m2>);

template <class T>
concept integral_element = element<T> && std::is_integral_v<std::remove_cv_t<T>>;

/// Bytes of one element of type `d`.
[[nodiscard]] constexpr std::size_t size_of(Dtype d) noexcept {
  switch (d) {
    case Dtype::int8:
    case Dtype::uint8:
    case Dtype::float8_e4m3:
    case Dtype::float8_e5m2: return 1;
    case Dtype::float16:
    case Dtype::bfloat16: return 2;
    case Dtype::int32:
    case Dtype::uint32:
    case Dtype::float32: return 4;
    case Dtype::int64:
    case Dtype::uint64:
    case Dtype::float64: return 8;
  }
  return 0;
}

/// Whether `d` is a floating type (half, bfloat16, the FP8 formats, float, double).
[[nodiscard]] constexpr bool is_floating(Dtype d) noexcept {
  return d == Dtype::float16 || d == Dtype::bfloat16 || d == Dtype::float32 || d == Dtype::float64 ||
         d == Dtype::float8_e4m3 || d == Dtype::float8_e5m2;
}

namespace detail {
/// The one place a runtime Dtype becomes its element type: returns
/// `f.template operator()<T>()` with T the type `d` names. Everything that re-types an erased
/// operation (AnyCommunicator, Hierarchical's steps, the runtime reduction table) goes through
/// here, so a new element type is one case here, not one per layer. `op` and `rank` name the
/// caller in the error for a code no Dtype has (a corrupt record).
template <class F>
decltype(auto) visit_dtype(Dtype d, F&& f, const char* op = "dispatch", int rank = -1) {
  switch (d) {
    case Dtype::int8: return f.template operator()<std::int8_t>();
    case Dtype::uint8: return f.template operator()<std::uint8_t>();
    case Dtype::int32: return f.template operator()<std::int32_t>();
    case Dtype::uint32: return f.template operator()<std::uint32_t>();
    case Dtype::int64: return f.template operator()<std::int64_t>();
    case Dtype::uint64: return f.template operator()<std::uint64_t>();
    case Dtype::float16: return f.template operator()<half>();
    case Dtype::bfloat16: return f.template operator()<bfloat16>();
    case Dtype::float32: return f.template operator()<float>();
    case Dtype::float64: return f.template operator()<double>();
    case Dtype::float8_e4m3: return f.template operator()<float8_e4m3>();
    case Dtype::float8_e5m2: return f.template operator()<float8_e5m2>();
  }
  throw InvalidArgument(op, rank, "unknown element type code " + std::to_string(static_cast<int>(d)));
}
}  // namespace detail

/// Whether a batch_isend_irecv entry sends or receives.
enum class P2PKind : std::uint8_t { isend, irecv };

/// One entry of `Communicator::batch_isend_irecv` (torch.distributed's P2POp): send `buffer` to
/// `peer`, or receive into it from `peer`, with `tag` (CPU backends match it; NCCL takes tag 0
/// only). Make them with comm::isend / comm::irecv. The buffer must outlive the returned Works.
template <class T>
struct P2POp {
  /// The element type.
  using value_type = T;
  /// Send or receive.
  P2PKind op = P2PKind::isend;
  /// What is sent, or where the message is received.
  std::span<T> buffer;
  /// The other rank.
  int peer = -1;
  /// Matched against the peer's tag (CPU backends; NCCL: 0 only).
  int tag = 0;
};

/// A batch_isend_irecv entry that sends `data` (not modified) to `peer`.
template <class R>
  requires std::ranges::contiguous_range<R> && std::ranges::sized_range<R>
[[nodiscard]] auto isend(R&& data, int peer, int tag = 0) {
  using T = std::remove_cv_t<std::remove_reference_t<std::ranges::range_reference_t<R>>>;
  return P2POp<T>{P2PKind::isend, std::span<T>(const_cast<T*>(std::ranges::data(data)), std::ranges::size(data)),
                  peer, tag};
}

/// A batch_isend_irecv entry that receives into `data` from `peer`.
template <class R>
  requires std::ranges::contiguous_range<R> && std::ranges::sized_range<R> &&
           (!std::is_const_v<std::remove_reference_t<std::ranges::range_reference_t<R>>>)
[[nodiscard]] auto irecv(R&& data, int peer, int tag = 0) {
  using T = std::remove_cv_t<std::remove_reference_t<std::ranges::range_reference_t<R>>>;
  return P2POp<T>{P2PKind::irecv, std::span<T>(std::ranges::data(data), std::ranges::size(data)), peer, tag};
}

/// Tag: pass `comm::async` as the last argument of a collective to get a `comm::Work` back.
struct async_t {
  explicit async_t() = default;
};
/// Pass as the last argument of an operation to get a comm::Work back instead of waiting.
inline constexpr async_t async{};

/// Tag: the blocking form of a backend operation (returns once the operation is complete on this
/// rank, on NCCL once enqueued). Backend authors receive it (see concepts.hpp); users never pass it.
struct blocking_t {
  explicit blocking_t() = default;
};
/// The blocking tag's value (backend authors only).
inline constexpr blocking_t blocking{};

/// A user reduction callable `T(T, T)` after the facade has checked it; backends with
/// `custom_reductions` receive this (never a bare callable).
template <class F>
struct custom_op {
  /// The user's callable, called as `T fn(T, T)`; must be associative and commutative.
  F fn;
};

/// Compile-time reduction ops: each is an object of its own type, checked against
/// (element type, backend) when the call is compiled.
namespace op {
/// A built-in reduction as a type of its own; `value` is its ReduceOp.
template <ReduceOp R>
struct builtin {
  /// The run-time op this type stands for.
  static constexpr ReduceOp value = R;
};
/// The type of each built-in reduction object.
///@{
using sum_t = builtin<ReduceOp::sum>;
using prod_t = builtin<ReduceOp::prod>;
using min_t = builtin<ReduceOp::min>;
using max_t = builtin<ReduceOp::max>;
using avg_t = builtin<ReduceOp::avg>;
using band_t = builtin<ReduceOp::band>;
using bor_t = builtin<ReduceOp::bor>;
using bxor_t = builtin<ReduceOp::bxor>;
///@}
/// The built-in reductions, to pass to all_reduce, reduce and reduce_scatter: `comm::op::sum`, ...
///@{
inline constexpr sum_t sum{};
inline constexpr prod_t prod{};
inline constexpr min_t min{};
inline constexpr max_t max{};
inline constexpr avg_t avg{};
inline constexpr band_t band{};
inline constexpr bor_t bor{};
inline constexpr bxor_t bxor{};
///@}

/// The sum of `factor * x` over ranks (NCCL's ncclRedOpCreatePreMulSum; a scaled gradient sum),
/// for floating element types. On NCCL the factor is applied on the device; host backends scale a
/// copy of the input (half-like types in float) and then sum.
struct premul_sum_t {
  /// Multiplies every input element by this before the sum.
  double factor = 1.0;
};
/// A premultiplied sum: the sum over ranks of `factor * x`.
[[nodiscard]] constexpr premul_sum_t premul_sum(double factor) noexcept { return premul_sum_t{factor}; }
}  // namespace op

namespace detail {
template <class Op> struct builtin_op_of { static constexpr bool known = false; };
template <ReduceOp R> struct builtin_op_of<op::builtin<R>> {
  static constexpr bool known = true;
  static constexpr ReduceOp value = R;
};
template <class T> struct builtin_op_of<std::plus<T>> {
  static constexpr bool known = true;
  static constexpr ReduceOp value = ReduceOp::sum;
};
template <class T> struct builtin_op_of<std::multiplies<T>> {
  static constexpr bool known = true;
  static constexpr ReduceOp value = ReduceOp::prod;
};
template <class T> struct builtin_op_of<std::bit_and<T>> {
  static constexpr bool known = true;
  static constexpr ReduceOp value = ReduceOp::band;
};
template <class T> struct builtin_op_of<std::bit_or<T>> {
  static constexpr bool known = true;
  static constexpr ReduceOp value = ReduceOp::bor;
};
template <class T> struct builtin_op_of<std::bit_xor<T>> {
  static constexpr bool known = true;
  static constexpr ReduceOp value = ReduceOp::bxor;
};
}  // namespace detail

/// An op object that maps to a built-in ReduceOp (comm::op::*, std::plus<> and friends).
template <class Op>
concept builtin_reduction = detail::builtin_op_of<std::remove_cvref_t<Op>>::known;

/// The ReduceOp that a built-in op object (`comm::op::sum`, `std::plus<>`, ...) stands for.
template <builtin_reduction Op>
inline constexpr ReduceOp reduce_op_of = detail::builtin_op_of<std::remove_cvref_t<Op>>::value;

/// A user callable `T(T, T)` used as a custom reduction (backends that can run one: Gloo).
template <class Op, class T>
concept custom_reduction = !builtin_reduction<Op> && !std::is_same_v<std::remove_cvref_t<Op>, ReduceOp> &&
                           std::is_invocable_r_v<T, const std::remove_cvref_t<Op>&, T, T>;

}  // namespace comm
