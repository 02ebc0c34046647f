#pragma once
/// \file
/// What the facade accepts as buffers and trailing arguments: `comm::buffer_range`,
/// `comm::reduce_args`, `comm::p2p_op_range`, `comm::reduce_result_t`, and how a buffer becomes
/// the span a backend receives. Included by <comm/communicator.hpp>.
///
/// ### Buffers
/// Every buffer parameter takes a `std::span<T>` (`std::span<const T>` for inputs) or any contiguous
/// sized range of an element type — `std::vector<float>&`, `std::array`, a `std::span<float>` for an
/// input — so `c.all_reduce(v)` and `c.all_gather(std::span<float>(v), out)` both work. Inputs and
/// outputs must have the same element type. Async calls need buffers that outlive the call (an lvalue
/// container or a span, never a temporary) and must not be touched until the Work completes.

#include <concepts>
#include <cstddef>
#include <ranges>
#include <span>
#include <type_traits>
#include <utility>

#include <comm/types.hpp>
#include <comm/work.hpp>

namespace comm {

/// Anything the facade accepts as a buffer: a contiguous sized range (std::span, std::vector,
/// std::array...). Its element type is checked by the operation, with the element concept's message.
template <class R>
concept buffer_range = std::ranges::contiguous_range<R> && std::ranges::sized_range<R>;

namespace detail {

template <buffer_range R>
using buffer_value_t = std::remove_cv_t<std::remove_reference_t<std::ranges::range_reference_t<R>>>;

template <buffer_range R>
inline constexpr bool is_mutable_buffer_v = !std::is_const_v<std::remove_reference_t<std::ranges::range_reference_t<R>>>;

template <class X>
concept async_tag = std::same_as<std::remove_cvref_t<X>, async_t>;

template <class X>
concept runtime_op = std::same_as<std::remove_cvref_t<X>, ReduceOp>;

/// A compile-time reduction argument: a built-in op object or a would-be custom callable (checked
/// later with a clear message). Buffers, tags, numbers and ReduceOp values are not.
template <class X>
concept op_object = !runtime_op<X> && !async_tag<X> && !buffer_range<X> &&
                    !std::is_arithmetic_v<std::remove_cvref_t<X>> && std::is_object_v<std::remove_cvref_t<X>>;

template <class X>
concept reduction_arg = runtime_op<X> || op_object<X>;

template <class... A>
struct reduce_tail_traits {
  static constexpr bool valid = false;
  static constexpr bool is_async = false;
};
template <>
struct reduce_tail_traits<> {
  static constexpr bool valid = true;
  static constexpr bool is_async = false;
};
template <class A>
struct reduce_tail_traits<A> {
  static constexpr bool valid = reduction_arg<A> || async_tag<A>;
  static constexpr bool is_async = async_tag<A>;
};
template <class A, class B>
struct reduce_tail_traits<A, B> {
  static constexpr bool valid = reduction_arg<A> && async_tag<B>;
  static constexpr bool is_async = true;
};

template <class X>
inline constexpr bool is_p2p_op = false;
template <class T>
inline constexpr bool is_p2p_op<P2POp<T>> = true;

}  // namespace detail

/// What may follow the buffers of a reducing collective: `[op] [comm::async]`, where op is a
/// ReduceOp, a compile-time op object or a callable (checked by the operation).
template <class... A>
concept reduce_args = detail::reduce_tail_traits<A...>::valid;

/// A range of comm::P2POp entries (comm::isend / comm::irecv), for batch_isend_irecv.
template <class R>
concept p2p_op_range = buffer_range<R> && detail::is_p2p_op<std::remove_cvref_t<std::ranges::range_reference_t<R>>>;

/// What a reducing collective returns for the trailing arguments `A...` (`[op] [comm::async]`):
/// `comm::Work` when they end with comm::async, else `void`.
template <class... A>
using reduce_result_t = std::conditional_t<detail::reduce_tail_traits<A...>::is_async, Work, void>;

namespace detail {

/// The element type a buffer hands the backend (see canonical_element_t); naming it for a range
/// of anything else is the element concept's message, before any other error of the call.
template <buffer_range R>
using element_value_t = checked_element_t<buffer_value_t<R>>;

template <class In, class Out>
inline constexpr bool same_element_v = std::is_same_v<element_value_t<In>, element_value_t<Out>>;

/// The buffer as a span of the type the backend receives: `long long` elements are viewed as
/// std::int64_t (same size and representation: what MPI_LONG_LONG and ncclInt64 read).
template <buffer_range R>
[[nodiscard]] constexpr auto as_span(R&& r) noexcept {
  using E = std::remove_reference_t<std::ranges::range_reference_t<R>>;
  using C = canonical_element_t<std::remove_cv_t<E>>;
  if constexpr (std::is_same_v<C, std::remove_cv_t<E>>) {
    return std::span<E>(std::ranges::data(r), std::ranges::size(r));
  } else {
    using V = std::conditional_t<std::is_const_v<E>, const C, C>;
    static_assert(sizeof(C) == sizeof(E) && alignof(C) == alignof(E));
    return std::span<V>(reinterpret_cast<V*>(std::ranges::data(r)), std::ranges::size(r));
  }
}

enum class reduction_kind { all_reduce, reduce_scatter };

/// Calls f(op, launch) from the trailing arguments `[op] [comm::async]` of a reducing call.
template <class F, class... A>
auto with_reduce_tail(F&& f, A&&... a) {
  if constexpr (sizeof...(A) == 0) {
    return f(op::sum, blocking);
  } else if constexpr (sizeof...(A) == 1) {
    if constexpr ((async_tag<A> && ...))
      return f(op::sum, async);
    else
      return f(std::forward<A>(a)..., blocking);
  } else {
    return f(std::forward<A>(a)...);
  }
}

}  // namespace detail

}  // namespace comm
