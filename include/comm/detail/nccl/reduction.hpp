#pragma once
// Which reductions the NCCL engine runs, as the enqueue step needs them (RedArg), checked at
// compile time where the reduction is a type and at run time where it is a value or depends on the
// loaded NCCL and the device (fp8).

#include <nccl.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include <comm/concepts.hpp>
#include <comm/detail/diagnostics/flight_recorder.hpp>
#include <comm/detail/nccl/errors.hpp>
#include <comm/detail/nccl/types.hpp>
#include <comm/error.hpp>
#include <comm/types.hpp>

namespace comm::detail::nccl {

template <class>
inline constexpr bool always_false = false;

/// A reduction as the enqueue step needs it: a built-in NCCL op, or the scalar of a
/// pre-multiplied sum (in the element type, as ncclRedOpCreatePreMulSum reads it) from which
/// with_red_op makes an NCCL op around the call. `code`: the OpDesc reduction code (premul_sum is
/// OpDesc::custom, as in the host engine core: the factor may differ by rank, the kind may not).
struct RedArg {
  ncclRedOp_t op = ncclSum;
  bool premul = false;
  alignas(8) unsigned char scalar[8] = {};
  std::uint8_t code = OpDesc::none;
};

/// Whether NCCL's one-rank kernel (ncclLaunchOneRank, which runs a pre-multiplied sum on a
/// communicator of one rank: avg on floating types, premul_sum) writes all `n` elements of size
/// `elt`. It launches min(32, bytes / 16 KiB rounded up) blocks, each taking n / blocks elements
/// rounded up to a 16-byte pack; where that rounding adds nothing, the last n % blocks elements
/// are never written. Seen on an H200 with NCCL 2.28.3 and 2.28.9: avg of 2^20 + 3 floats left the
/// last three as they were (benchmarks/RESULTS.md, "The first GPU run").
[[nodiscard]] constexpr bool one_rank_kernel_covers(std::size_t n, std::size_t elt) noexcept {
  if (n == 0 || elt == 0 || 16 % elt != 0) return true;
  constexpr std::size_t block_bytes = std::size_t{16} << 10;
  const std::size_t blocks = std::min<std::size_t>(32, (n * elt + block_bytes - 1) / block_bytes);
  const std::size_t pack = 16 / elt;
  const std::size_t per_block = (n / blocks + pack - 1) / pack * pack;
  return blocks * per_block >= n;
}

/// Where to cut a one-rank pre-multiplied sum of `n` elements that the kernel would not cover
/// into two calls that it does: a head of whole 16 KiB (each block's share then is whole packs)
/// and a tail under 16 KiB (one block). `n` when one call is covered.
[[nodiscard]] constexpr std::size_t one_rank_head(std::size_t n, std::size_t elt) noexcept {
  if (one_rank_kernel_covers(n, elt)) return n;
  constexpr std::size_t block_bytes = std::size_t{16} << 10;
  return n * elt / block_bytes * (block_bytes / elt);
}

/// The reduction checks of one communicator: its rank (named in errors), device and the device's
/// compute capability.
class ReductionRules {
 public:
  ReductionRules() = default;
  ReductionRules(int rank, int device, int cc_major, int cc_minor) noexcept
      : rank_(rank), device_(device), cc_major_(cc_major), cc_minor_(cc_minor) {}

  /// The comm::ReduceOp of a reduction argument: a runtime value (checked here too, for callers
  /// that bypass the facade) or a compile-time op (checked when the call compiles).
  template <class T, class Red>
  ReduceOp checked_op(const char* op, const Red& red) const {
    ReduceOp r{};
    if constexpr (std::is_same_v<Red, ReduceOp>) {
      r = red;
      if (!reduction_supported(r, dtype_of<T>))
        throw InvalidArgument(op, rank_,
                              "reduction " + std::string(to_string(r)) + " is not supported for element type " +
                                  std::string(to_string(dtype_of<T>)) + " by the nccl backend: " +
                                  reduction_unsupported_reason(r, dtype_of<T>));
    } else if constexpr (builtin_reduction<Red>) {
      static_assert(reduction_supported(reduce_op_of<Red>, dtype_of<T>),
                    "comm: the nccl backend does not support this reduction on this element type");
      r = reduce_op_of<Red>;
    } else {
      static_assert(always_false<Red>, "comm: the nccl backend cannot run custom reduction callables");
    }
    check_reduction_runtime<T>(op);
    return r;
  }

  /// The RedArg of a reduction argument: what checked_op accepts, or comm::op::premul_sum_t on a
  /// floating type whose sum NCCL runs (fp8: NCCL >= 2.24 and compute capability >= 9.0, as for
  /// its other reductions; NCCL itself computes fp8 avg as a PreMulSum).
  template <class T, class Red>
  RedArg reduction_arg(const char* op, const Red& red) const {
    RedArg a;
    if constexpr (std::is_same_v<Red, op::premul_sum_t>) {
      static_assert(floating_element<T>, "comm: premul_sum needs a floating element type");
      static_assert(reduction_supported(ReduceOp::sum, dtype_of<T>),
                    "comm: the nccl backend does not support this reduction on this element type");
      static_assert(sizeof(T) <= sizeof(a.scalar));
      check_reduction_runtime<T>(op);
      const T scalar = premul_scalar<T>(red.factor);
      std::memcpy(a.scalar, &scalar, sizeof(T));
      a.premul = true;
      a.code = OpDesc::custom;
    } else {
      const ReduceOp r = checked_op<T>(op, red);
      a.op = nccl_op(r);
      a.code = static_cast<std::uint8_t>(r);
    }
    return a;
  }

  /// The premul_sum factor in the element type: double as is, float rounded once, half, bfloat16
  /// and fp8 through float (round to nearest even, fp8 saturating: what CUDA's __float2half,
  /// __float2bfloat16 and __nv_cvt_float_to_fp8(..., __NV_SATFINITE, ...) give).
  template <class T>
  [[nodiscard]] static T premul_scalar(double factor) noexcept {
    if constexpr (std::is_same_v<T, double>)
      return factor;
    else if constexpr (std::is_same_v<T, float>)
      return static_cast<float>(factor);
    else
      return T(static_cast<float>(factor));
  }

  /// fp8 reductions need NCCL >= 2.24 at run time and a device of compute capability >= 9.0.
  template <class T>
  void check_reduction_runtime([[maybe_unused]] const char* op) const {
    if constexpr (is_fp8(dtype_of<T>)) {
      if (runtime_version() < fp8_version)
        throw InvalidArgument(op, rank_,
                              "fp8 reductions need NCCL >= 2.24; the loaded NCCL is " +
                                  version_string(runtime_version()));
      if (cc_major_ < 9)
        throw InvalidArgument(op, rank_,
                              "fp8 reductions need a device of compute capability >= 9.0; device " +
                                  std::to_string(device_) + " is " + std::to_string(cc_major_) + "." +
                                  std::to_string(cc_minor_));
    }
  }
 private:
  int rank_ = -1;
  int device_ = -1;
  int cc_major_ = 0;
  int cc_minor_ = 0;
};

}  // namespace comm::detail::nccl
