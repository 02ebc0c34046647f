#pragma once
/// \file
/// `comm::Communicator<Backend>`: the typed facade over a backend policy (comm::backends::Gloo,
/// comm::backends::Nccl). It checks arguments and maps element types and reduction ops at compile
/// time, then calls the backend directly (no virtual calls).
///
/// ### Buffers
/// Every buffer parameter takes a `std::span<T>` (`std::span<const T>` for inputs) or any contiguous
/// sized range of an element type — `std::vector<float>&`, `std::array`, a `std::span<float>` for an
/// input — so `c.all_reduce(v)` and `c.all_gather(std::span<float>(v), out)` both work. Inputs and
/// outputs must have the same element type. Async calls need buffers that outlive the call (an lvalue
/// container or a span, never a temporary) and must not be touched until the Work completes.
///
/// ### Reductions
/// `op` is a runtime `comm::ReduceOp` (default `sum`), a compile-time op (`comm::op::sum`...,
/// `std::plus<>{}`, `std::multiplies<>{}`, `std::bit_and<>{}`, `std::bit_or<>{}`, `std::bit_xor<>{}`),
/// or a user callable `T(T, T)` (custom reduction: associative, commutative, must not throw;
/// only on backends that run one, e.g. Gloo). Compile-time ops are checked when the call compiles;
/// `ReduceOp` values are checked when the call runs and throw comm::InvalidArgument.
///   - sum/prod on signed integers wrap around (two's complement), never UB.
///   - half/bfloat16/float8_e4m3/float8_e5m2 reduce in float and round to the element type after every step.
///   - bitwise ops (band/bor/bxor) need an integer element type.
///   - **avg** is the sum divided by size(): floating types multiply by 1/size() at the end;
///     **integer types use floor division** (an average of -7 over 2 ranks is -4, not -3).
///
/// ### Completion, order, errors
/// - The blocking form returns when the operation is complete on this rank on host backends
///   (Gloo); on NCCL it returns once the operation is enqueued on the communicator's stream.
/// - Each operation has an overload taking `comm::async` last that returns a `comm::Work`.
/// - Operations of one communicator run in the order they are issued, and every rank must issue the
///   same collectives in the same order with matching sizes.
/// - Arguments are checked before anything is sent: a bad size, root or overlap throws
///   comm::InvalidArgument naming the operation, the rank and the sizes, and the communicator stays
///   usable. Engine failures throw comm::Timeout / comm::RemoteError / comm::BackendError.
/// - Every operation ends by the communicator's timeout (backend options, else COMM_TIMEOUT, else
///   30 minutes).
///
/// ### Subgroups and diagnostics (optional backend capabilities, see concepts.hpp)
/// `split` and `new_group` make communicators over subsets of the ranks; `monitored_barrier` names
/// the ranks that did not arrive; `flight_record` / `dump_flight_record` show the last operations
/// (<comm/diagnostics.hpp>). With the backend option `desync_check` (default on with
/// COMM_DEBUG=DETAIL) every operation first compares (sequence number, operation, element type,
/// count, root, reduction) across ranks and throws comm::DesyncError on every rank on a mismatch.
/// Calling one of these on a backend without the capability is a compile error that says so.

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <comm/concepts.hpp>
#include <comm/diagnostics.hpp>
#include <comm/error.hpp>
#include <comm/init.hpp>
#include <comm/store.hpp>
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

[[nodiscard]] inline bool overlap(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) noexcept {
  if (a_bytes == 0 || b_bytes == 0) return false;
  const auto pa = reinterpret_cast<std::uintptr_t>(a);
  const auto pb = reinterpret_cast<std::uintptr_t>(b);
  return pa < pb + b_bytes && pb < pa + a_bytes;
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

/// A group of ranks and the collectives among them, over backend policy `Backend`.
/// Move-only. A moved-from Communicator may only be destroyed or assigned to.
template <class Backend>
class Communicator {
  static_assert(backend<Backend>,
                "comm: Communicator<Backend>: Backend does not satisfy the comm::backend concept (see concepts.hpp)");

 public:
  using backend_type = Backend;
  using options_type = typename Backend::Options;

  /// Wraps a constructed backend object.
  explicit Communicator(Backend b) noexcept(std::is_nothrow_move_constructible_v<Backend>) : b_(std::move(b)) {}

  /// env:// rendezvous (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rank 0 hosts the TcpStore),
  /// then the backend's connection. Blocking; ends by the options' timeout.
  [[nodiscard]] static Communicator from_env(options_type options = {}) {
    InitResult r = init_env(std::chrono::milliseconds(options.timeout));
    return create(std::move(r.store), r.rank, r.size, options);
  }

  /// Connects `size` ranks that share `store`; this process is `rank`. Blocking. Every rank must
  /// create its communicators over one store in the same order.
  [[nodiscard]] static Communicator create(std::shared_ptr<Store> store, int rank, int size, options_type options = {}) {
    return Communicator(Backend::create(std::move(store), rank, size, options));
  }

  /// Wraps an existing engine group: the arguments go to `Backend::adopt` (Gloo: a connected
  /// `std::shared_ptr<gloo::Context>` and optional options; NCCL: a communicator and a stream).
  template <class... Args>
    requires requires(Args&&... args) { Backend::adopt(std::forward<Args>(args)...); }
  [[nodiscard]] static Communicator adopt(Args&&... args) {
    return Communicator(Backend::adopt(std::forward<Args>(args)...));
  }

  [[nodiscard]] int rank() const noexcept { return b_.rank(); }
  [[nodiscard]] int size() const noexcept { return b_.size(); }
  /// The backend object, for backend-specific calls.
  [[nodiscard]] Backend& backend() noexcept { return b_; }
  [[nodiscard]] const Backend& backend() const noexcept { return b_; }

  // ---------------------------------------------------------------------------------------------
  /// all_reduce in place: every rank's `data` becomes the element-wise reduction over all ranks.
  /// Forms: `(data)`, `(data, op)`, `(data, comm::async)`, `(data, op, comm::async)`.
  template <class Data, class... A>
    requires buffer_range<Data> && reduce_args<A...>
  reduce_result_t<A...> all_reduce(Data&& data, A&&... a) {
    using T = detail::element_value_t<Data>;
    if constexpr (!element<T>) {
      return reduce_result_t<A...>();  // the element message above is the only error
    } else {
      check_buffer<Data, true, detail::reduce_tail_traits<A...>::is_async>("all_reduce");
      const std::span<T> s = detail::as_span(data);
      return reduce_entry<T>(detail::reduction_kind::all_reduce, std::span<const T>(s), s, std::forward<A>(a)...);
    }
  }

  /// all_reduce out of place: `out` (same size as `in`) receives the reduction of every rank's
  /// `in`. `in` and `out` may be the same buffer, not partially overlapping ones.
  template <class In, class Out, class... A>
    requires buffer_range<In> && buffer_range<Out> && reduce_args<A...>
  reduce_result_t<A...> all_reduce(In&& in, Out&& out, A&&... a) {
    using T = detail::element_value_t<Out>;
    if constexpr (!element<T>) {
      return reduce_result_t<A...>();  // the element message above is the only error
    } else {
      constexpr bool is_async = detail::reduce_tail_traits<A...>::is_async;
      check_buffer<In, false, is_async>("all_reduce");
      check_buffer<Out, true, is_async>("all_reduce");
      static_assert(detail::same_element_v<In, Out>, "comm: input and output buffers must have the same element type");
      return reduce_entry<T>(detail::reduction_kind::all_reduce, std::span<const T>(detail::as_span(in)),
                             std::span<T>(detail::as_span(out)), std::forward<A>(a)...);
    }
  }

  /// reduce_scatter: `in` holds size()*out.size() elements; rank r's `out` receives the reduction
  /// over all ranks of `in[r*out.size(), (r+1)*out.size())`. `out` may be exactly that slice of
  /// `in` (in place), and must not overlap `in` otherwise. Each rank sends and receives about
  /// (size()-1)/size() of `in` (ring algorithm on Gloo).
  template <class In, class Out, class... A>
    requires buffer_range<In> && buffer_range<Out> && reduce_args<A...>
  reduce_result_t<A...> reduce_scatter(In&& in, Out&& out, A&&... a) {
    using T = detail::element_value_t<Out>;
    if constexpr (!element<T>) {
      return reduce_result_t<A...>();  // the element message above is the only error
    } else {
      constexpr bool is_async = detail::reduce_tail_traits<A...>::is_async;
      check_buffer<In, false, is_async>("reduce_scatter");
      check_buffer<Out, true, is_async>("reduce_scatter");
      static_assert(detail::same_element_v<In, Out>, "comm: input and output buffers must have the same element type");
      return reduce_entry<T>(detail::reduction_kind::reduce_scatter, std::span<const T>(detail::as_span(in)),
                             std::span<T>(detail::as_span(out)), std::forward<A>(a)...);
    }
  }

  // ---------------------------------------------------------------------------------------------
  /// all_gather: `out` (size()*in.size() elements) receives every rank's `in`, in rank order.
  /// `in` may be exactly this rank's slot of `out` (in place), and must not overlap it otherwise.
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  void all_gather(In&& in, Out&& out) {
    all_gather_entry<In, Out>(in, out, blocking);
  }
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  Work all_gather(In&& in, Out&& out, async_t) {
    return all_gather_entry<In, Out>(in, out, async);
  }

  /// broadcast: every rank's `data` becomes the `root` rank's `data` (same size on every rank).
  template <class Data>
    requires buffer_range<Data>
  void broadcast(Data&& data, int root) {
    broadcast_entry<Data>(data, root, blocking);
  }
  template <class Data>
    requires buffer_range<Data>
  Work broadcast(Data&& data, int root, async_t) {
    return broadcast_entry<Data>(data, root, async);
  }

  /// gather: on `root`, `out` (size()*in.size() elements) receives every rank's `in` in rank order;
  /// elsewhere `out` is not used and may be empty.
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  void gather(In&& in, Out&& out, int root) {
    gather_entry<In, Out>(in, out, root, blocking);
  }
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  Work gather(In&& in, Out&& out, int root, async_t) {
    return gather_entry<In, Out>(in, out, root, async);
  }

  // ---------------------------------------------------------------------------------------------
  /// reduce: the `root` rank's `out` (same size as `in`) receives the element-wise reduction of
  /// every rank's `in`; elsewhere `out` is not used and may be empty. Forms:
  /// `(in, out, root)`, `(in, out, root, op)`, `(..., comm::async)`.
  template <class In, class Out, class... A>
    requires buffer_range<In> && buffer_range<Out> && reduce_args<A...>
  reduce_result_t<A...> reduce(In&& in, Out&& out, int root, A&&... a) {
    using T = detail::element_value_t<Out>;
    if constexpr (!element<T>) {
      return reduce_result_t<A...>();  // the element message above is the only error
    } else {
      constexpr bool is_async = detail::reduce_tail_traits<A...>::is_async;
      check_buffer<In, false, is_async>("reduce");
      check_buffer<Out, true, is_async>("reduce");
      static_assert(detail::same_element_v<In, Out>, "comm: input and output buffers must have the same element type");
      return reduce_root_entry<T>(std::span<const T>(detail::as_span(in)), std::span<T>(detail::as_span(out)), root,
                                  std::forward<A>(a)...);
    }
  }
  /// reduce in place: the `root` rank's `data` becomes the reduction; other ranks' `data` is left
  /// as it was. Forms: `(data, root)`, `(data, root, op)`, `(..., comm::async)`.
  template <class Data, class... A>
    requires buffer_range<Data> && reduce_args<A...>
  reduce_result_t<A...> reduce(Data&& data, int root, A&&... a) {
    using T = detail::element_value_t<Data>;
    if constexpr (!element<T>) {
      return reduce_result_t<A...>();  // the element message above is the only error
    } else {
      check_buffer<Data, true, detail::reduce_tail_traits<A...>::is_async>("reduce");
      const std::span<T> d = detail::as_span(data);
      return reduce_root_entry<T>(std::span<const T>(d), d, root, std::forward<A>(a)...);
    }
  }

  /// scatter: on `root`, `in` holds size()*out.size() elements and rank r's `out` receives
  /// `in[r*out.size(), (r+1)*out.size())`; elsewhere `in` is not used and may be empty. On the
  /// root `out` may be exactly its own slice of `in`.
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  void scatter(In&& in, Out&& out, int root) {
    scatter_entry<In, Out>(in, out, root, blocking);
  }
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  Work scatter(In&& in, Out&& out, int root, async_t) {
    return scatter_entry<In, Out>(in, out, root, async);
  }

  /// all_to_all: `in` and `out` hold size() equal blocks; block p of this rank's `in` goes to
  /// rank p, and block q of `out` comes from rank q (MPI_Alltoall). `in` and `out` must not
  /// overlap.
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  void all_to_all(In&& in, Out&& out) {
    all_to_all_entry<In, Out>(in, out, blocking);
  }
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  Work all_to_all(In&& in, Out&& out, async_t) {
    return all_to_all_entry<In, Out>(in, out, async);
  }

  /// all_to_all_v: this rank sends `in_counts[p]` elements to rank p and receives
  /// `out_counts[q]` from rank q; blocks lie in rank order, at the prefix sums of the counts
  /// (MPI_Alltoallv with packed displacements). Each count must match the peer's; a mismatch is
  /// comm::DesyncError. The counts are copied (an async call need not keep them).
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  void all_to_all_v(In&& in, std::span<const std::size_t> in_counts, Out&& out,
                    std::span<const std::size_t> out_counts) {
    all_to_all_v_entry<In, Out>(in, in_counts, out, out_counts, blocking);
  }
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  Work all_to_all_v(In&& in, std::span<const std::size_t> in_counts, Out&& out,
                    std::span<const std::size_t> out_counts, async_t) {
    return all_to_all_v_entry<In, Out>(in, in_counts, out, out_counts, async);
  }

  /// send: `data` to rank `peer`, received there by a recv (or a batch's irecv) with the same
  /// tag, element type and count. Messages between two ranks are matched in the order they are
  /// sent; a mismatch is comm::DesyncError on the receiver, after which the communicator is
  /// unusable (the unread message stays in the way); the sender's operation completes or fails
  /// with RemoteError. Like every operation, send runs in the communicator's issue order: a rank
  /// that sends and receives at once uses batch_isend_irecv.
  /// The blocking form returns once `data` may be reused (host backends: the message was copied
  /// or written out; Shm buffers up to two chunks). Tags are >= 0 (NCCL: 0 only).
  template <class Data>
    requires buffer_range<Data>
  void send(Data&& data, int peer, int tag = 0) {
    send_entry<Data>(data, peer, tag, blocking);
  }
  template <class Data>
    requires buffer_range<Data>
  Work send(Data&& data, int peer, async_t) {
    return send_entry<Data>(data, peer, 0, async);
  }
  template <class Data>
    requires buffer_range<Data>
  Work send(Data&& data, int peer, int tag, async_t) {
    return send_entry<Data>(data, peer, tag, async);
  }

  /// recv: `data` from rank `peer`'s matching send (see send).
  template <class Data>
    requires buffer_range<Data>
  void recv(Data&& data, int peer, int tag = 0) {
    recv_entry<Data>(data, peer, tag, blocking);
  }
  template <class Data>
    requires buffer_range<Data>
  Work recv(Data&& data, int peer, async_t) {
    return recv_entry<Data>(data, peer, 0, async);
  }
  template <class Data>
    requires buffer_range<Data>
  Work recv(Data&& data, int peer, int tag, async_t) {
    return recv_entry<Data>(data, peer, tag, async);
  }

  /// batch_isend_irecv: the sends and receives of `ops` (made with comm::isend / comm::irecv) as
  /// one operation in which they all progress at once, so exchanges in both directions cannot
  /// deadlock. Returns one Work per entry (they complete together). Buffers must outlive them.
  template <class R>
    requires p2p_op_range<R>
  std::vector<Work> batch_isend_irecv(R&& ops) {
    using P = detail::buffer_value_t<R>;
    return batch_entry<typename P::value_type>(std::span<const P>(std::ranges::data(ops), std::ranges::size(ops)));
  }
  template <class T>
  std::vector<Work> batch_isend_irecv(std::initializer_list<P2POp<T>> ops) {
    return batch_entry<T>(std::span<const P2POp<T>>(ops.begin(), ops.size()));
  }

  /// barrier: returns once every rank has entered it (blocking form; the async one completes then).
  void barrier() { b_.barrier(blocking); }
  Work barrier(async_t) { return b_.barrier(async); }

  // ---------------------------------------------------------------------------------------------
  /// Splits this communicator, like MPI_Comm_split / ncclCommSplit: a collective that every rank
  /// calls (in the same place of its sequence of operations). Ranks that pass the same `color` >= 0
  /// get a new communicator among themselves, ranked by (`key`, rank here); a negative color joins
  /// no group and gets nullopt. The new communicator has this one's options and is independent of
  /// it (its own operation sequence; either may be destroyed first). Blocking, including the
  /// connection of the new group; ends by the timeout. Groups may be split again.
  [[nodiscard]] std::optional<Communicator> split(int color, int key) {
    static_assert(supports_split<Backend>,
                  "comm: this backend cannot split communicators (it lacks the optional capability "
                  "`std::optional<B> split(int color, int key)`, see concepts.hpp)");
    if constexpr (supports_split<Backend>) {
      auto g = b_.split(color, key);
      if (!g) return std::nullopt;
      return std::optional<Communicator>(std::in_place, std::move(*g));
    } else {
      return std::nullopt;
    }
  }
  /// split(color, rank()): the new ranks keep this communicator's order.
  [[nodiscard]] std::optional<Communicator> split(int color) { return split(color, rank()); }

  /// A communicator of the ranks listed (ranks of this communicator, ranked in the order given),
  /// like torch.distributed.new_group: every rank calls it, with the same list, in the same order
  /// as its other new_group/split calls. Members connect among themselves (blocking, ends by the
  /// timeout); non-members get nullopt at once, without communicating. An empty list, a rank out of
  /// range or a rank listed twice throws comm::InvalidArgument (nothing is sent).
  [[nodiscard]] std::optional<Communicator> new_group(std::span<const int> ranks) {
    static_assert(supports_new_group<Backend>,
                  "comm: this backend cannot make groups (it lacks the optional capability "
                  "`std::optional<B> new_group(std::span<const int> ranks)`, see concepts.hpp)");
    if constexpr (supports_new_group<Backend>) {
      check_group_ranks(ranks);
      auto g = b_.new_group(ranks);
      if (!g) return std::nullopt;
      return std::optional<Communicator>(std::in_place, std::move(*g));
    } else {
      return std::nullopt;
    }
  }
  [[nodiscard]] std::optional<Communicator> new_group(std::initializer_list<int> ranks) {
    return new_group(std::span<const int>(ranks.begin(), ranks.size()));
  }

  /// A barrier that says who is missing: rank 0 collects every rank's arrival (through the
  /// communicator's store, not the data connections) and, when some have not arrived within
  /// `timeout`, throws comm::Timeout naming them — the first missing rank, or with
  /// `wait_all_ranks` every one — and tells the others, which throw comm::Timeout with the same
  /// names (a rank arriving after that verdict too). Ranks other than 0 give rank 0 up to
  /// min(timeout, 10 s) more before they throw comm::Timeout naming rank 0. Ordered after this
  /// communicator's queued operations. A non-positive timeout is comm::InvalidArgument.
  void monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks = false) {
    static_assert(supports_monitored_barrier<Backend>,
                  "comm: this backend has no monitored_barrier (it lacks the optional capability "
                  "`void monitored_barrier(std::chrono::milliseconds, bool)`, see concepts.hpp)");
    if (timeout.count() <= 0)
      invalid("monitored_barrier", "timeout " + std::to_string(timeout.count()) + " ms must be positive");
    if constexpr (supports_monitored_barrier<Backend>) b_.monitored_barrier(timeout, wait_all_ranks);
  }
  /// monitored_barrier with the communicator's timeout.
  void monitored_barrier() {
    static_assert(supports_monitored_barrier<Backend>,
                  "comm: this backend has no monitored_barrier (it lacks the optional capability "
                  "`void monitored_barrier(std::chrono::milliseconds, bool)`, see concepts.hpp)");
    if constexpr (supports_monitored_barrier<Backend>) b_.monitored_barrier(std::chrono::milliseconds{0}, false);
  }

  /// The flight recorder's record of the last operations of this communicator, oldest first
  /// (see <comm/diagnostics.hpp>).
  [[nodiscard]] FlightRecord flight_record() const {
    static_assert(supports_flight_recorder<Backend>,
                  "comm: this backend has no flight recorder (it lacks the optional capability "
                  "`FlightRecord flight_record() const`, see concepts.hpp)");
    if constexpr (supports_flight_recorder<Backend>)
      return b_.flight_record();
    else
      return {};
  }
  /// Writes the flight record as text to `path` ("-": stderr). Throws comm::BackendError naming
  /// the path when it cannot be written.
  void dump_flight_record(const std::string& path) const {
    static_assert(supports_flight_recorder<Backend>,
                  "comm: this backend has no flight recorder (it lacks the optional capability "
                  "`void dump_flight_record(const std::string&) const`, see concepts.hpp)");
    if constexpr (supports_flight_recorder<Backend>) b_.dump_flight_record(path);
  }

 private:
  // ---- compile-time checks with messages that say what is wrong ----

  template <class R, bool Output, bool IsAsync>
  static constexpr void check_buffer(const char* /*op*/) {
    using T = detail::element_value_t<R>;
    if constexpr (element<T>)
      static_assert(supports_element<Backend, T>, "comm: this backend does not support this element type");
    if constexpr (Output)
      static_assert(detail::is_mutable_buffer_v<R>,
                    "comm: an output buffer must be mutable (std::span<T>, not std::span<const T> or a const container)");
    if constexpr (IsAsync)
      static_assert(std::ranges::borrowed_range<R>,
                    "comm: an async collective needs buffers that outlive the call: pass an lvalue container or a "
                    "std::span, not a temporary");
  }

  /// Maps the op argument to what the backend receives, checking it (at compile time for op
  /// objects, at run time for ReduceOp values).
  template <class T, class Op>
  auto normalize_op(const char* name, Op&& o) const {
    using O = std::remove_cvref_t<Op>;
    if constexpr (std::is_same_v<O, ReduceOp>) {
      check_runtime_op<T>(name, o);
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

  template <class T>
  void check_runtime_op(const char* name, ReduceOp r) const {
    if (static_cast<unsigned>(r) > static_cast<unsigned>(ReduceOp::bxor))
      throw InvalidArgument(name, rank(),
                            "reduction value " + std::to_string(static_cast<unsigned>(r)) + " is not a ReduceOp");
    if (is_bitwise(r) && !integral_element<T>)
      throw InvalidArgument(name, rank(),
                            "reduction " + std::string(to_string(r)) + " is not supported for element type " +
                                std::string(to_string(dtype_of<T>)) +
                                ": bitwise reductions (band/bor/bxor) need an integer element type");
    if (!Backend::supports_reduction(r, dtype_of<T>))
      throw InvalidArgument(name, rank(),
                            "reduction " + std::string(to_string(r)) + " is not supported for element type " +
                                std::string(to_string(dtype_of<T>)) + " by the " + std::string(Backend::name) +
                                " backend");
  }

  [[noreturn]] void invalid(const char* name, const std::string& what) const {
    throw InvalidArgument(name, rank(), what);
  }

  static std::string n_elems(std::size_t n) { return std::to_string(n) + (n == 1 ? " element" : " elements"); }

  void check_group_ranks(std::span<const int> ranks) const {
    if (ranks.empty()) invalid("new_group", "the list of ranks is empty: a group needs at least one rank");
    std::vector<char> seen(static_cast<std::size_t>(size()), 0);
    for (const int r : ranks) {
      if (r < 0 || r >= size())
        invalid("new_group", "rank " + std::to_string(r) + " is out of range [0, " + std::to_string(size()) + ")");
      if (seen[static_cast<std::size_t>(r)]++)
        invalid("new_group", "rank " + std::to_string(r) + " is listed twice");
    }
  }

  void check_root(const char* name, int root) const {
    if (root < 0 || root >= size())
      invalid(name, "root " + std::to_string(root) + " is out of range [0, " + std::to_string(size()) + ")");
  }

  /// `part` must be disjoint from `whole`, or exactly this rank's slot of it.
  template <class T>
  void check_slot_overlap(const char* name, std::span<const T> part, std::span<const T> whole, const char* part_name,
                          const char* whole_name) const {
    const T* slot = whole.data() + static_cast<std::size_t>(rank()) * part.size();
    if (part.data() != slot && detail::overlap(part.data(), part.size_bytes(), whole.data(), whole.size_bytes()))
      invalid(name, std::string(part_name) + " overlaps " + whole_name + " other than exactly at this rank's slot (" +
                        whole_name + " + rank()*" + part_name + ".size())");
  }

  // ---- entry points: split the trailing arguments, check, call the backend ----

  template <class T, class... A>
  auto reduce_entry(detail::reduction_kind kind, std::span<const T> in, std::span<T> out, A&&... a) {
    if constexpr (sizeof...(A) == 0) {
      return reduce_checked<T>(kind, in, out, op::sum, blocking);
    } else if constexpr (sizeof...(A) == 1) {
      if constexpr ((detail::async_tag<A> && ...))
        return reduce_checked<T>(kind, in, out, op::sum, async);
      else
        return reduce_checked<T>(kind, in, out, std::forward<A>(a)..., blocking);
    } else {
      return reduce_checked<T>(kind, in, out, std::forward<A>(a)...);
    }
  }

  template <class T, class Op, class Launch>
  auto reduce_checked(detail::reduction_kind kind, std::span<const T> in, std::span<T> out, Op&& o, Launch l) {
    const bool ar = kind == detail::reduction_kind::all_reduce;
    const char* name = ar ? "all_reduce" : "reduce_scatter";
    auto red = normalize_op<T>(name, std::forward<Op>(o));
    const auto n = static_cast<std::size_t>(size());
    if (ar) {
      if (in.size() != out.size())
        invalid(name, "input has " + n_elems(in.size()) + " but output has " + std::to_string(out.size()) +
                          "; they must be equal");
      if (in.data() != out.data() && detail::overlap(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
        invalid(name, "input and output overlap partially; pass one buffer for an in-place all_reduce");
      return b_.all_reduce(in, out, std::move(red), l);
    }
    if (in.size() != n * out.size())
      invalid(name, "input has " + n_elems(in.size()) + ", expected size()*output = " +
                        std::to_string(n * out.size()) + " (size() = " + std::to_string(n) + ", output has " +
                        n_elems(out.size()) + ")");
    check_slot_overlap<T>(name, std::span<const T>(out), in, "output", "input");
    return b_.reduce_scatter(in, out, std::move(red), l);
  }

  template <class In, class Out, class Launch>
  auto all_gather_entry(In& in_r, Out& out_r, Launch l) {
    using T = detail::element_value_t<Out>;
    constexpr bool is_async = std::is_same_v<Launch, async_t>;
    check_buffer<In, false, is_async>("all_gather");
    check_buffer<Out, true, is_async>("all_gather");
    static_assert(detail::same_element_v<In, Out>, "comm: input and output buffers must have the same element type");
    const std::span<const T> in = detail::as_span(in_r);
    const std::span<T> out = detail::as_span(out_r);
    const auto n = static_cast<std::size_t>(size());
    if (out.size() != n * in.size())
      invalid("all_gather", "output has " + n_elems(out.size()) + ", expected size()*input = " +
                                std::to_string(n * in.size()) + " (size() = " + std::to_string(n) + ", input has " +
                                n_elems(in.size()) + ")");
    check_slot_overlap<T>("all_gather", in, std::span<const T>(out), "input", "output");
    return b_.all_gather(in, out, l);
  }

  template <class Data, class Launch>
  auto broadcast_entry(Data& data_r, int root, Launch l) {
    using T = detail::element_value_t<Data>;
    check_buffer<Data, true, std::is_same_v<Launch, async_t>>("broadcast");
    check_root("broadcast", root);
    return b_.broadcast(std::span<T>(detail::as_span(data_r)), root, l);
  }

  template <class In, class Out, class Launch>
  auto gather_entry(In& in_r, Out& out_r, int root, Launch l) {
    using T = detail::element_value_t<Out>;
    constexpr bool is_async = std::is_same_v<Launch, async_t>;
    check_buffer<In, false, is_async>("gather");
    check_buffer<Out, true, is_async>("gather");
    static_assert(detail::same_element_v<In, Out>, "comm: input and output buffers must have the same element type");
    const std::span<const T> in = detail::as_span(in_r);
    const std::span<T> out = detail::as_span(out_r);
    check_root("gather", root);
    if (rank() == root) {
      const auto n = static_cast<std::size_t>(size());
      if (out.size() != n * in.size())
        invalid("gather", "output has " + n_elems(out.size()) + " on the root, expected size()*input = " +
                              std::to_string(n * in.size()) + " (size() = " + std::to_string(n) + ", input has " +
                              n_elems(in.size()) + ")");
      check_slot_overlap<T>("gather", in, std::span<const T>(out), "input", "output");
    }
    return b_.gather(in, out, root, l);
  }

  // ---- the rest of the surface (capability 11) ----

  static constexpr void check_full_surface() {
    static_assert(supports_full_surface<Backend>,
                  "comm: this backend lacks reduce/scatter/all_to_all/send/recv (the optional capability "
                  "supports_full_surface, see concepts.hpp)");
  }

  void check_peer(const char* name, int peer, int tag) const {
    if (peer < 0 || peer >= size())
      invalid(name, "peer " + std::to_string(peer) + " is out of range [0, " + std::to_string(size()) + ")");
    if (peer == rank())
      invalid(name, "peer " + std::to_string(peer) + " is this rank; a rank cannot send to or receive from itself");
    if (tag < 0) invalid(name, "tag " + std::to_string(tag) + " is negative; tags are >= 0");
  }

  template <class T, class... A>
  auto reduce_root_entry(std::span<const T> in, std::span<T> out, int root, A&&... a) {
    check_full_surface();
    check_root("reduce", root);
    if (rank() == root) {
      if (out.size() != in.size())
        invalid("reduce", "output has " + n_elems(out.size()) + " on the root but input has " + n_elems(in.size()) +
                              "; they must be equal");
      if (in.data() != out.data() && detail::overlap(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
        invalid("reduce", "input and output overlap partially; pass one buffer for an in-place reduce");
    }
    return detail::with_reduce_tail(
        [&](auto&& o, auto l) {
          auto red = normalize_op<T>("reduce", std::forward<decltype(o)>(o));
          if constexpr (supports_full_surface<Backend>)
            return b_.reduce(in, out, root, std::move(red), l);
        },
        std::forward<A>(a)...);
  }

  template <class In, class Out, class Launch>
  auto scatter_entry(In& in_r, Out& out_r, int root, Launch l) {
    using T = detail::element_value_t<Out>;
    check_full_surface();
    constexpr bool is_async = std::is_same_v<Launch, async_t>;
    check_buffer<In, false, is_async>("scatter");
    check_buffer<Out, true, is_async>("scatter");
    static_assert(detail::same_element_v<In, Out>, "comm: input and output buffers must have the same element type");
    const std::span<const T> in = detail::as_span(in_r);
    const std::span<T> out = detail::as_span(out_r);
    check_root("scatter", root);
    if (rank() == root) {
      const auto n = static_cast<std::size_t>(size());
      if (in.size() != n * out.size())
        invalid("scatter", "input has " + n_elems(in.size()) + " on the root, expected size()*output = " +
                               std::to_string(n * out.size()) + " (size() = " + std::to_string(n) + ", output has " +
                               n_elems(out.size()) + ")");
      check_slot_overlap<T>("scatter", std::span<const T>(out), in, "output", "input");
    }
    if constexpr (supports_full_surface<Backend>) return b_.scatter(in, out, root, l);
  }

  template <class In, class Out, class Launch>
  auto all_to_all_entry(In& in_r, Out& out_r, Launch l) {
    using T = detail::element_value_t<Out>;
    check_full_surface();
    constexpr bool is_async = std::is_same_v<Launch, async_t>;
    check_buffer<In, false, is_async>("all_to_all");
    check_buffer<Out, true, is_async>("all_to_all");
    static_assert(detail::same_element_v<In, Out>, "comm: input and output buffers must have the same element type");
    const std::span<const T> in = detail::as_span(in_r);
    const std::span<T> out = detail::as_span(out_r);
    const auto n = static_cast<std::size_t>(size());
    if (in.size() != out.size() || in.size() % n != 0)
      invalid("all_to_all", "input has " + n_elems(in.size()) + " and output " + n_elems(out.size()) +
                                "; both must hold size() = " + std::to_string(n) + " equal blocks");
    if (detail::overlap(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
      invalid("all_to_all", "input and output overlap; all_to_all needs separate buffers");
    if constexpr (supports_full_surface<Backend>) return b_.all_to_all(in, out, l);
  }

  template <class In, class Out, class Launch>
  auto all_to_all_v_entry(In& in_r, std::span<const std::size_t> in_counts, Out& out_r,
                          std::span<const std::size_t> out_counts, Launch l) {
    using T = detail::element_value_t<Out>;
    check_full_surface();
    constexpr bool is_async = std::is_same_v<Launch, async_t>;
    check_buffer<In, false, is_async>("all_to_all_v");
    check_buffer<Out, true, is_async>("all_to_all_v");
    static_assert(detail::same_element_v<In, Out>, "comm: input and output buffers must have the same element type");
    const std::span<const T> in = detail::as_span(in_r);
    const std::span<T> out = detail::as_span(out_r);
    const auto n = static_cast<std::size_t>(size());
    if (in_counts.size() != n || out_counts.size() != n)
      invalid("all_to_all_v", "in_counts has " + std::to_string(in_counts.size()) + " entries and out_counts " +
                                  std::to_string(out_counts.size()) + "; both need size() = " + std::to_string(n));
    auto total = [&](std::span<const std::size_t> c, const char* what) {
      std::size_t t = 0;
      for (const std::size_t x : c) {
        if (x > std::numeric_limits<std::size_t>::max() - t)
          invalid("all_to_all_v", std::string(what) + " overflow when summed");
        t += x;
      }
      return t;
    };
    const std::size_t ti = total(in_counts, "in_counts"), to = total(out_counts, "out_counts");
    if (ti != in.size())
      invalid("all_to_all_v", "in_counts sum to " + std::to_string(ti) + " but input has " + n_elems(in.size()));
    if (to != out.size())
      invalid("all_to_all_v", "out_counts sum to " + std::to_string(to) + " but output has " + n_elems(out.size()));
    const auto r = static_cast<std::size_t>(rank());
    if (in_counts[r] != out_counts[r])
      invalid("all_to_all_v", "this rank sends itself " + std::to_string(in_counts[r]) + " but receives " +
                                  std::to_string(out_counts[r]) + " (in_counts[rank()] != out_counts[rank()])");
    if (detail::overlap(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
      invalid("all_to_all_v", "input and output overlap; all_to_all_v needs separate buffers");
    if constexpr (supports_full_surface<Backend>) return b_.all_to_all_v(in, in_counts, out, out_counts, l);
  }

  template <class Data, class Launch>
  auto send_entry(Data& data_r, int peer, int tag, Launch l) {
    using T = detail::element_value_t<Data>;
    check_full_surface();
    check_buffer<Data, false, std::is_same_v<Launch, async_t>>("send");
    check_peer("send", peer, tag);
    if constexpr (supports_full_surface<Backend>)
      return b_.send(std::span<const T>(detail::as_span(data_r)), peer, tag, l);
  }

  template <class Data, class Launch>
  auto recv_entry(Data& data_r, int peer, int tag, Launch l) {
    using T = detail::element_value_t<Data>;
    check_full_surface();
    check_buffer<Data, true, std::is_same_v<Launch, async_t>>("recv");
    const std::span<T> data = detail::as_span(data_r);  // (not in the return: the static_assert above must show)
    check_peer("recv", peer, tag);
    if constexpr (supports_full_surface<Backend>) return b_.recv(data, peer, tag, l);
  }

  template <class T>
  std::vector<Work> batch_entry(std::span<const P2POp<T>> ops) {
    using C = detail::checked_element_t<T>;
    if constexpr (!std::is_same_v<C, T>) {
      // long long entries: the same buffers, viewed as the 64-bit type the backend takes.
      std::vector<P2POp<C>> same;
      same.reserve(ops.size());
      for (const auto& o : ops)
        same.push_back(P2POp<C>{o.op, std::span<C>(reinterpret_cast<C*>(o.buffer.data()), o.buffer.size()), o.peer,
                                o.tag});
      return batch_entry<C>(std::span<const P2POp<C>>(same));
    } else {
      check_full_surface();
      if constexpr (element<T>)
        static_assert(supports_element<Backend, T>, "comm: this backend does not support this element type");
      for (const auto& o : ops) {
        if (o.op != P2PKind::isend && o.op != P2PKind::irecv)
          invalid("batch_isend_irecv", "an entry's op is neither isend nor irecv");
        check_peer("batch_isend_irecv", o.peer, o.tag);
      }
      if constexpr (supports_full_surface<Backend>)
        return b_.batch_isend_irecv(ops);
      else
        return std::vector<Work>{};
    }
  }

  Backend b_;
};

}  // namespace comm
