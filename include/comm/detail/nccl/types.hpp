#pragma once
// Element types and reductions as NCCL sees them, NCCL versions, and the choice of gather path.
// Everything here is usable without a GPU.
//
// fp8: NCCL has ncclFloat8e4m3/ncclFloat8e5m2 from 2.24 (reductions on compute capability >= 9.0
// only); with an older nccl.h comm's fp8 types (always there, types.hpp) are moved as bytes only.

#include <nccl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <comm/detail/base/env.hpp>
#include <comm/error.hpp>
#include <comm/types.hpp>

/// 1 when fp8 reductions can be compiled: nccl.h has the dtypes.
#if NCCL_VERSION_CODE >= 22400
#define COMM_NCCL_FP8_REDUCTIONS 1
#else
#define COMM_NCCL_FP8_REDUCTIONS 0
#endif

/// 1 when nccl.h declares ncclGather (NCCL >= 2.28).
#if NCCL_VERSION_CODE >= 22800
#define COMM_NCCL_HAS_GATHER 1
#else
#define COMM_NCCL_HAS_GATHER 0
#endif

/// 1 when nccl.h declares ncclCommShrink (NCCL >= 2.27): shrink() makes the survivors'
/// communicator from the old one (backends/nccl.hpp, "Fault tolerance").
#if NCCL_VERSION_CODE >= 22700 && defined(NCCL_SHRINK_DEFAULT) && defined(NCCL_SHRINK_ABORT)
#define COMM_NCCL_HAS_SHRINK 1
#else
#define COMM_NCCL_HAS_SHRINK 0
#endif

/// 1 when nccl.h declares ncclCommRevoke (NCCL_REVOKE_DEFAULT comes with it): after a failure the
/// watchdog stops the communicator's kernels without freeing it, so that shrink() can still use it.
#if COMM_NCCL_HAS_SHRINK && defined(NCCL_REVOKE_DEFAULT)
#define COMM_NCCL_HAS_REVOKE 1
#else
#define COMM_NCCL_HAS_REVOKE 0
#endif

namespace comm::detail::nccl {

// ---- versions ------------------------------------------------------------------------------

/// NCCL_VERSION(major, minor, patch) as a constant expression (2.8 and older: 1000s, later: 10000s).
[[nodiscard]] constexpr int version_code(int major, int minor, int patch) noexcept {
  return (major <= 2 && minor <= 8) ? major * 1000 + minor * 100 + patch : major * 10000 + minor * 100 + patch;
}
static_assert(version_code(2, 28, 9) == 22809 && version_code(2, 8, 4) == 2804);

/// The NCCL version comm was compiled against (nccl.h).
inline constexpr int compiled_version = NCCL_VERSION_CODE;

/// First versions of the features chosen at run time.
inline constexpr int gather_version = version_code(2, 28, 0);
inline constexpr int fp8_version = version_code(2, 24, 0);
inline constexpr int multi_rank_gpu_version = version_code(2, 30, 0);
inline constexpr int shrink_version = version_code(2, 27, 0);
/// ncclCommRevoke is in nccl.h from 2.28 (its first release with it is not documented to the
/// patch: the library loaded must be at least the one compiled against, and at least 2.28).
inline constexpr int revoke_version = version_code(2, 28, 0);

/// "2.28.9" from a version code.
[[nodiscard]] inline std::string version_string(int code) {
  int major = 0, minor = 0, patch = 0;
  if (code >= 10000) {
    major = code / 10000;
    minor = (code % 10000) / 100;
    patch = code % 100;
  } else {
    major = code / 1000;
    minor = (code % 1000) / 100;
    patch = code % 100;
  }
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

/// The version of the NCCL library loaded at run time (ncclGetVersion; it needs no GPU).
[[nodiscard]] inline int runtime_version() noexcept {
  static const int v = [] {
    int x = 0;
    return ncclGetVersion(&x) == ncclSuccess ? x : 0;
  }();
  return v;
}

// ---- element types ---------------------------------------------------------------------------

/// The NCCL datatype of a comm element type.
[[nodiscard]] constexpr ncclDataType_t nccl_dtype(Dtype d) noexcept {
  switch (d) {
    case Dtype::int8: return ncclInt8;
    case Dtype::uint8: return ncclUint8;
    case Dtype::int32: return ncclInt32;
    case Dtype::uint32: return ncclUint32;
    case Dtype::int64: return ncclInt64;
    case Dtype::uint64: return ncclUint64;
    case Dtype::float16: return ncclFloat16;
    case Dtype::bfloat16: return ncclBfloat16;
    case Dtype::float32: return ncclFloat32;
    case Dtype::float64: return ncclFloat64;
#if COMM_NCCL_FP8_REDUCTIONS
    case Dtype::float8_e4m3: return ncclFloat8e4m3;
    case Dtype::float8_e5m2: return ncclFloat8e5m2;
#else
    // Older nccl.h: fp8 is only moved (as bytes), never reduced; see transfer_dtype.
    case Dtype::float8_e4m3:
    case Dtype::float8_e5m2: return ncclUint8;
#endif
  }
  return ncclUint8;
}

/// Whether `d` is one of the fp8 types.
[[nodiscard]] constexpr bool is_fp8(Dtype d) noexcept {
  return d == Dtype::float8_e4m3 || d == Dtype::float8_e5m2;
}

/// The datatype used by collectives that only move data (all_gather, broadcast, gather): the
/// element's own, except fp8, which moves as bytes so that it works on every NCCL and every GPU.
[[nodiscard]] constexpr ncclDataType_t transfer_dtype(Dtype d) noexcept {
  return is_fp8(d) ? ncclUint8 : nccl_dtype(d);
}

/// Every comm element type can be moved by NCCL.
[[nodiscard]] constexpr bool dtype_supported(Dtype) noexcept { return true; }

// ---- reductions -------------------------------------------------------------------------------

[[nodiscard]] constexpr bool is_signed_integer(Dtype d) noexcept {
  return d == Dtype::int8 || d == Dtype::int32 || d == Dtype::int64;
}

/// The reductions NCCL runs on element type `d`, as comm defines them:
/// - sum, prod, min, max on every type (fp8 only with an nccl.h that has fp8);
/// - avg on floating types and unsigned integers. NCCL's integer avg rounds toward zero, while
///   comm's contract is floor division; they agree for unsigned types only, so avg on signed
///   integers is rejected rather than give a different answer than the other backends;
/// - no bitwise ops (NCCL has none).
[[nodiscard]] constexpr bool reduction_supported(ReduceOp op, Dtype d) noexcept {
  if (is_fp8(d) && !COMM_NCCL_FP8_REDUCTIONS) return false;
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::prod:
    case ReduceOp::min:
    case ReduceOp::max: return true;
    case ReduceOp::avg: return !is_signed_integer(d);
    case ReduceOp::band:
    case ReduceOp::bor:
    case ReduceOp::bxor: return false;
  }
  return false;
}

/// The NCCL op of a supported comm reduction.
[[nodiscard]] constexpr ncclRedOp_t nccl_op(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::prod: return ncclProd;
    case ReduceOp::min: return ncclMin;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::avg: return ncclAvg;
    case ReduceOp::band:
    case ReduceOp::bor:
    case ReduceOp::bxor: break;
  }
  return ncclSum;  // unreachable for supported ops; callers check reduction_supported first
}

/// Why NCCL cannot run `op` on `d` (for messages), or "" when it can.
[[nodiscard]] inline std::string reduction_unsupported_reason(ReduceOp op, Dtype d) {
  if (reduction_supported(op, d)) return {};
  if (is_bitwise(op)) return "NCCL has no bitwise reductions";
  if (op == ReduceOp::avg && is_signed_integer(d))
    return "NCCL's integer avg rounds toward zero but comm's avg floors; use sum and divide";
  if (is_fp8(d)) return "fp8 reductions need an nccl.h of 2.24 or newer at compile time";
  return "not a reduction NCCL runs";
}

// ---- gather ---------------------------------------------------------------------------------

/// How gather is carried out.
enum class GatherAlgorithm : std::uint8_t {
  automatic,  ///< ncclGather where NCCL >= 2.28 (compiled and loaded), else p2p
  native,     ///< ncclGather (an error where NCCL is older)
  p2p,        ///< ncclSend/ncclRecv in one group call; the root receives each rank's block
};

[[nodiscard]] constexpr std::string_view to_string(GatherAlgorithm g) noexcept {
  switch (g) {
    case GatherAlgorithm::automatic: return "auto";
    case GatherAlgorithm::native: return "native";
    case GatherAlgorithm::p2p: return "p2p";
  }
  return "unknown";
}

/// COMM_NCCL_GATHER: unset/empty/"auto" -> automatic, "native"/"nccl" -> native, "p2p" -> p2p.
[[nodiscard]] inline GatherAlgorithm gather_from_env(int rank) {
  auto v = getenv_str("COMM_NCCL_GATHER");
  if (!v) return GatherAlgorithm::automatic;
  const auto s = trim(*v);
  if (s.empty() || s == "auto") return GatherAlgorithm::automatic;
  if (s == "native" || s == "nccl") return GatherAlgorithm::native;
  if (s == "p2p") return GatherAlgorithm::p2p;
  bad_env("nccl.init", rank, "COMM_NCCL_GATHER", *v, "not auto, native or p2p");
}

/// The gather path for a request (an explicit option wins over COMM_NCCL_GATHER), given whether
/// ncclGather was compiled in and the NCCL version loaded. Never returns `automatic`.
[[nodiscard]] inline GatherAlgorithm choose_gather(GatherAlgorithm requested, bool compiled, int runtime, int rank) {
  if (requested == GatherAlgorithm::automatic) requested = gather_from_env(rank);
  const bool native_ok = compiled && runtime >= gather_version;
  switch (requested) {
    case GatherAlgorithm::automatic: return native_ok ? GatherAlgorithm::native : GatherAlgorithm::p2p;
    case GatherAlgorithm::p2p: return GatherAlgorithm::p2p;
    case GatherAlgorithm::native:
      if (native_ok) return GatherAlgorithm::native;
      throw InvalidArgument("nccl.init", rank,
                            "gather 'native' needs ncclGather (NCCL >= 2.28); compiled against " +
                                version_string(compiled_version) + (compiled ? "" : " (no ncclGather)") +
                                ", running " + version_string(runtime));
  }
  return GatherAlgorithm::p2p;
}

}  // namespace comm::detail::nccl
