#pragma once
// The facade's reduction argument: a ReduceOp value, a compile-time op object, premul_sum or a
// user callable, mapped to what a backend receives and checked against (element type, backend):
// op objects when the call compiles, ReduceOp values when it runs (ArgChecks::reduction).

#include <type_traits>
#include <utility>

#include <comm/concepts.hpp>
#include <comm/detail/facade/checks.hpp>
#include <comm/types.hpp>

namespace comm::detail {

/// Maps the op argument of a call on `Backend` with elements of T to what the backend receives.
template <class Backend, class T, class Op>
auto normalize_op(const ArgChecks& checks, Op&& o) {
  using O = std::remove_cvref_t<Op>;
  if constexpr (std::is_same_v<O, ReduceOp>) {
    checks.reduction(o, dtype_of<T>, Backend::supports_reduction(o, dtype_of<T>), Backend::name);
    return ReduceOp{o};
  } else if constexpr (std::is_same_v<O, op::premul_sum_t>) {
    static_assert(floating_element<T>, "comm: premul_sum needs a floating element type");
    static_assert(!floating_element<T> || supports_reduction<Backend, T, ReduceOp::sum>,
                  "comm: this backend does not support sum on this element type");
    return o;
  } else if constexpr (builtin_reduction<O>) {
    constexpr ReduceOp r = reduce_op_of<O>;
    static_assert(!is_bitwise(r) || integral_element<T>,
                  "comm: bitwise reductions (band/bor/bxor) need an integer element type");
    static_assert((is_bitwise(r) && !integral_element<T>) || supports_reduction<Backend, T, r>,
                  "comm: this backend does not support this reduction on this element type");
    return op::builtin<r>{};
  } else {
    static_assert(custom_reduction<O, T>,
                  "comm: a reduction must be a comm::ReduceOp, a comm::op::* object, std::plus<> and friends, or a "
                  "callable T(T, T) for the buffer's element type T");
    static_assert(!custom_reduction<O, T> || supports_custom_reduction<Backend>,
                  "comm: this backend cannot run custom reduction callables; use a comm::op::* object or a "
                  "ReduceOp");
    return custom_op<O>{std::forward<Op>(o)};
  }
}

}  // namespace comm::detail
