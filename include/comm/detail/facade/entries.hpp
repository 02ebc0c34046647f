#pragma once
// The entry points behind comm::Communicator's operations (communicator.hpp): each one splits the
// trailing arguments, runs the compile-time checks (whose static_assert messages are what a user
// reads for a wrong buffer or element type), the run-time argument checks (checks.hpp, shared with
// AnyCommunicator), and calls the backend. Free functions over the backend object, so that the
// public header keeps only the operations' declarations and their contracts.

#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <comm/buffers.hpp>
#include <comm/concepts.hpp>
#include <comm/detail/facade/checks.hpp>
#include <comm/detail/facade/reduction.hpp>
#include <comm/types.hpp>
#include <comm/work.hpp>

namespace comm::detail::facade {

// ---- compile-time checks with messages that say what is wrong ----

template <class Backend, class R, bool Output, bool IsAsync>
constexpr void check_buffer() {
  using T = element_value_t<R>;
  if constexpr (element<T>)
    static_assert(supports_element<Backend, T>, "comm: this backend does not support this element type");
  if constexpr (Output)
    static_assert(is_mutable_buffer_v<R>,
                  "comm: an output buffer must be mutable (std::span<T>, not std::span<const T> or a const container)");
  if constexpr (IsAsync)
    static_assert(std::ranges::borrowed_range<R>,
                  "comm: an async collective needs buffers that outlive the call: pass an lvalue container or a "
                  "std::span, not a temporary");
}

template <class Backend>
constexpr void check_full_surface() {
  static_assert(supports_full_surface<Backend>,
                "comm: this backend lacks reduce/scatter/all_to_all/send/recv (the optional capability "
                "supports_full_surface, see concepts.hpp)");
}

/// The run-time checks of operation `name` on `b`, for elements of T.
template <class T = std::byte, class Backend>
[[nodiscard]] ArgChecks checks(const Backend& b, const char* name) {
  return ArgChecks{name, b.rank(), b.size(), sizeof(T)};
}

template <class T>
[[nodiscard]] ArgBuf buf(std::span<T> s) noexcept {
  return ArgBuf{s.data(), s.size()};
}

template <class Launch>
inline constexpr bool is_async_v = std::is_same_v<Launch, async_t>;

/// The spans of an (input, output) pair, after the compile-time checks of an operation.
template <class Backend, class In, class Out, bool IsAsync>
auto in_out(In& in_r, Out& out_r) {
  using T = element_value_t<Out>;
  check_buffer<Backend, In, false, IsAsync>();
  check_buffer<Backend, Out, true, IsAsync>();
  static_assert(same_element_v<In, Out>, "comm: input and output buffers must have the same element type");
  return std::pair<std::span<const T>, std::span<T>>(as_span(in_r), as_span(out_r));
}

// ---- entry points: split the trailing arguments, check, call the backend ----

template <class Backend, class T, class Op, class Launch>
auto reduce_checked(Backend& b, reduction_kind kind, std::span<const T> in, std::span<T> out, Op&& o, Launch l) {
  const bool ar = kind == reduction_kind::all_reduce;
  const char* name = ar ? "all_reduce" : "reduce_scatter";
  auto red = normalize_op<Backend, T>(checks(b, name), std::forward<Op>(o));
  if (ar) {
    checks<T>(b, name).all_reduce(buf(in), buf(out));
    return b.all_reduce(in, out, std::move(red), l);
  }
  checks<T>(b, name).reduce_scatter(buf(in), buf(out));
  return b.reduce_scatter(in, out, std::move(red), l);
}

template <class Backend, class T, class... A>
auto reduce_entry(Backend& b, reduction_kind kind, std::span<const T> in, std::span<T> out, A&&... a) {
  if constexpr (sizeof...(A) == 0) {
    return reduce_checked<Backend, T>(b, kind, in, out, comm::op::sum, blocking);
  } else if constexpr (sizeof...(A) == 1) {
    if constexpr ((async_tag<A> && ...))
      return reduce_checked<Backend, T>(b, kind, in, out, comm::op::sum, async);
    else
      return reduce_checked<Backend, T>(b, kind, in, out, std::forward<A>(a)..., blocking);
  } else {
    return reduce_checked<Backend, T>(b, kind, in, out, std::forward<A>(a)...);
  }
}

template <class Backend, class In, class Out, class Launch>
auto all_gather_entry(Backend& b, In& in_r, Out& out_r, Launch l) {
  using T = element_value_t<Out>;
  auto [in, out] = in_out<Backend, In, Out, is_async_v<Launch>>(in_r, out_r);
  checks<T>(b, "all_gather").all_gather(buf(in), buf(out));
  return b.all_gather(in, out, l);
}

template <class Backend, class Data, class Launch>
auto broadcast_entry(Backend& b, Data& data_r, int root, Launch l) {
  using T = element_value_t<Data>;
  check_buffer<Backend, Data, true, is_async_v<Launch>>();
  checks(b, "broadcast").root(root);
  return b.broadcast(std::span<T>(as_span(data_r)), root, l);
}

template <class Backend, class In, class Out, class Launch>
auto gather_entry(Backend& b, In& in_r, Out& out_r, int root, Launch l) {
  using T = element_value_t<Out>;
  auto [in, out] = in_out<Backend, In, Out, is_async_v<Launch>>(in_r, out_r);
  checks<T>(b, "gather").gather(buf(in), buf(out), root);
  return b.gather(in, out, root, l);
}

// ---- the rest of the surface (capability 11) ----

template <class Backend, class T, class... A>
auto reduce_root_entry(Backend& b, std::span<const T> in, std::span<T> out, int root, A&&... a) {
  check_full_surface<Backend>();
  checks<T>(b, "reduce").reduce(buf(in), buf(out), root);
  return with_reduce_tail(
      [&](auto&& o, auto l) {
        auto red = normalize_op<Backend, T>(checks(b, "reduce"), std::forward<decltype(o)>(o));
        if constexpr (supports_full_surface<Backend>) return b.reduce(in, out, root, std::move(red), l);
      },
      std::forward<A>(a)...);
}

template <class Backend, class In, class Out, class Launch>
auto scatter_entry(Backend& b, In& in_r, Out& out_r, int root, Launch l) {
  using T = element_value_t<Out>;
  check_full_surface<Backend>();
  auto [in, out] = in_out<Backend, In, Out, is_async_v<Launch>>(in_r, out_r);
  checks<T>(b, "scatter").scatter(buf(in), buf(out), root);
  if constexpr (supports_full_surface<Backend>) return b.scatter(in, out, root, l);
}

template <class Backend, class In, class Out, class Launch>
auto all_to_all_entry(Backend& b, In& in_r, Out& out_r, Launch l) {
  using T = element_value_t<Out>;
  check_full_surface<Backend>();
  auto [in, out] = in_out<Backend, In, Out, is_async_v<Launch>>(in_r, out_r);
  checks<T>(b, "all_to_all").all_to_all(buf(in), buf(out));
  if constexpr (supports_full_surface<Backend>) return b.all_to_all(in, out, l);
}

template <class Backend, class In, class Out, class Launch>
auto all_to_all_v_entry(Backend& b, In& in_r, std::span<const std::size_t> in_counts, Out& out_r,
                        std::span<const std::size_t> out_counts, Launch l) {
  using T = element_value_t<Out>;
  check_full_surface<Backend>();
  auto [in, out] = in_out<Backend, In, Out, is_async_v<Launch>>(in_r, out_r);
  checks<T>(b, "all_to_all_v").all_to_all_v(buf(in), in_counts, buf(out), out_counts);
  if constexpr (supports_full_surface<Backend>) return b.all_to_all_v(in, in_counts, out, out_counts, l);
}

template <class Backend, class Data, class Launch>
auto send_entry(Backend& b, Data& data_r, int peer, int tag, Launch l) {
  using T = element_value_t<Data>;
  check_full_surface<Backend>();
  check_buffer<Backend, Data, false, is_async_v<Launch>>();
  checks(b, "send").peer(peer, tag);
  if constexpr (supports_full_surface<Backend>) return b.send(std::span<const T>(as_span(data_r)), peer, tag, l);
}

template <class Backend, class Data, class Launch>
auto recv_entry(Backend& b, Data& data_r, int peer, int tag, Launch l) {
  using T = element_value_t<Data>;
  check_full_surface<Backend>();
  check_buffer<Backend, Data, true, is_async_v<Launch>>();
  const std::span<T> data = as_span(data_r);  // (not in the return: the static_assert above must show)
  checks(b, "recv").peer(peer, tag);
  if constexpr (supports_full_surface<Backend>) return b.recv(data, peer, tag, l);
}

template <class Backend, class T>
std::vector<Work> batch_entry(Backend& b, std::span<const P2POp<T>> ops) {
  using C = checked_element_t<T>;
  if constexpr (!std::is_same_v<C, T>) {
    // long long entries: the same buffers, viewed as the 64-bit type the backend takes.
    std::vector<P2POp<C>> same;
    same.reserve(ops.size());
    for (const auto& o : ops)
      same.push_back(P2POp<C>{o.op, std::span<C>(reinterpret_cast<C*>(o.buffer.data()), o.buffer.size()), o.peer,
                              o.tag});
    return batch_entry<Backend, C>(b, std::span<const P2POp<C>>(same));
  } else {
    check_full_surface<Backend>();
    if constexpr (element<T>)
      static_assert(supports_element<Backend, T>, "comm: this backend does not support this element type");
    checks<T>(b, "batch_isend_irecv").p2p_batch(ops);
    if constexpr (supports_full_surface<Backend>)
      return b.batch_isend_irecv(ops);
    else
      return std::vector<Work>{};
  }
}

}  // namespace comm::detail::facade
