#pragma once
/// \file
/// `comm::Communicator<Backend>`: the typed facade over a backend policy (comm::backends::Gloo,
/// comm::backends::Nccl). It checks arguments and maps element types and reduction ops at compile
/// time, then calls the backend directly (no virtual calls).
///
/// ### Buffers
/// Any contiguous sized range of an element type (see <comm/buffers.hpp>).
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
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <comm/buffers.hpp>
#include <comm/concepts.hpp>
#include <comm/detail/facade/entries.hpp>
#include <comm/detail/init/rejoin.hpp>
#include <comm/diagnostics.hpp>
#include <comm/error.hpp>
#include <comm/init.hpp>
#include <comm/store.hpp>
#include <comm/types.hpp>
#include <comm/work.hpp>

namespace comm {

/// A group of ranks and the collectives among them, over backend policy `Backend`.
/// Move-only. A moved-from Communicator may only be destroyed or assigned to.
template <class Backend>
class Communicator {
  static_assert(backend<Backend>,
                "comm: Communicator<Backend>: Backend does not satisfy the comm::backend concept (see concepts.hpp)");

 public:
  /// The backend policy (comm::backends::Gloo, ...).
  using backend_type = Backend;
  /// The backend's options (`Backend::Options`).
  using options_type = typename Backend::Options;

  /// Wraps a constructed backend object.
  explicit Communicator(Backend b) noexcept(std::is_nothrow_move_constructible_v<Backend>) : b_(std::move(b)) {}

  /// env:// rendezvous (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rank 0 hosts the TcpStore
  /// unless COMM_AGENT_STORE=1 says the launcher does), then the backend's connection. Blocking;
  /// ends by the options' timeout. In a process started to replace a dead rank
  /// (COMM_RESTART_COUNT > 0, comm-run --max-restarts) on a backend that can grow, it joins the
  /// job instead: it returns when the members next call grow(), with the rank and size it has
  /// there (use rank() and size(), not RANK).
  [[nodiscard]] static Communicator from_env(options_type options = {}) {
    if constexpr (supports_grow<Backend>) {
      if (detail::elastic_restart_count() > 0) {
        const auto timeout = options.timeout.count() > 0 ? std::chrono::milliseconds(options.timeout) : timeout_from_env();
        return Communicator(Backend::join(detail::join_store_from_env(timeout), options, timeout));
      }
    }
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

  /// This process's rank in the communicator, 0 .. size()-1.
  [[nodiscard]] int rank() const noexcept { return b_.rank(); }
  /// The number of ranks.
  [[nodiscard]] int size() const noexcept { return b_.size(); }
  /// The backend object, for backend-specific calls.
  [[nodiscard]] Backend& backend() noexcept { return b_; }
  /// The backend object, read-only.
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
      detail::facade::check_buffer<Backend, Data, true, detail::reduce_tail_traits<A...>::is_async>();
      const std::span<T> s = detail::as_span(data);
      return detail::facade::reduce_entry<Backend, T>(b_, detail::reduction_kind::all_reduce, std::span<const T>(s), s,
                                                      std::forward<A>(a)...);
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
      auto [i, o] = detail::facade::in_out<Backend, In, Out, detail::reduce_tail_traits<A...>::is_async>(in, out);
      return detail::facade::reduce_entry<Backend, T>(b_, detail::reduction_kind::all_reduce, i, o,
                                                      std::forward<A>(a)...);
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
      auto [i, o] = detail::facade::in_out<Backend, In, Out, detail::reduce_tail_traits<A...>::is_async>(in, out);
      return detail::facade::reduce_entry<Backend, T>(b_, detail::reduction_kind::reduce_scatter, i, o,
                                                      std::forward<A>(a)...);
    }
  }

  // ---------------------------------------------------------------------------------------------
  /// all_gather: `out` (size()*in.size() elements) receives every rank's `in`, in rank order.
  /// `in` may be exactly this rank's slot of `out` (in place), and must not overlap it otherwise.
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  void all_gather(In&& in, Out&& out) {
    detail::facade::all_gather_entry<Backend, In, Out>(b_, in, out, blocking);
  }
  /// all_gather with `comm::async`: returns a Work at once; the buffers must outlive it.
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  Work all_gather(In&& in, Out&& out, async_t) {
    return detail::facade::all_gather_entry<Backend, In, Out>(b_, in, out, async);
  }

  /// broadcast: every rank's `data` becomes the `root` rank's `data` (same size on every rank).
  template <class Data>
    requires buffer_range<Data>
  void broadcast(Data&& data, int root) {
    detail::facade::broadcast_entry<Backend, Data>(b_, data, root, blocking);
  }
  /// broadcast with `comm::async`: returns a Work at once; the buffer must outlive it.
  template <class Data>
    requires buffer_range<Data>
  Work broadcast(Data&& data, int root, async_t) {
    return detail::facade::broadcast_entry<Backend, Data>(b_, data, root, async);
  }

  /// gather: on `root`, `out` (size()*in.size() elements) receives every rank's `in` in rank order;
  /// elsewhere `out` is not used and may be empty.
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  void gather(In&& in, Out&& out, int root) {
    detail::facade::gather_entry<Backend, In, Out>(b_, in, out, root, blocking);
  }
  /// gather with `comm::async`: returns a Work at once; the buffers must outlive it.
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  Work gather(In&& in, Out&& out, int root, async_t) {
    return detail::facade::gather_entry<Backend, In, Out>(b_, in, out, root, async);
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
      auto [i, o] = detail::facade::in_out<Backend, In, Out, detail::reduce_tail_traits<A...>::is_async>(in, out);
      return detail::facade::reduce_root_entry<Backend, T>(b_, i, o, root, std::forward<A>(a)...);
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
      detail::facade::check_buffer<Backend, Data, true, detail::reduce_tail_traits<A...>::is_async>();
      const std::span<T> d = detail::as_span(data);
      return detail::facade::reduce_root_entry<Backend, T>(b_, std::span<const T>(d), d, root, std::forward<A>(a)...);
    }
  }

  /// scatter: on `root`, `in` holds size()*out.size() elements and rank r's `out` receives
  /// `in[r*out.size(), (r+1)*out.size())`; elsewhere `in` is not used and may be empty. On the
  /// root `out` may be exactly its own slice of `in`.
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  void scatter(In&& in, Out&& out, int root) {
    detail::facade::scatter_entry<Backend, In, Out>(b_, in, out, root, blocking);
  }
  /// scatter with `comm::async`: returns a Work at once; the buffers must outlive it.
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  Work scatter(In&& in, Out&& out, int root, async_t) {
    return detail::facade::scatter_entry<Backend, In, Out>(b_, in, out, root, async);
  }

  /// all_to_all: `in` and `out` hold size() equal blocks; block p of this rank's `in` goes to
  /// rank p, and block q of `out` comes from rank q (MPI_Alltoall). `in` and `out` must not
  /// overlap.
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  void all_to_all(In&& in, Out&& out) {
    detail::facade::all_to_all_entry<Backend, In, Out>(b_, in, out, blocking);
  }
  /// all_to_all with `comm::async`: returns a Work at once; the buffers must outlive it.
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  Work all_to_all(In&& in, Out&& out, async_t) {
    return detail::facade::all_to_all_entry<Backend, In, Out>(b_, in, out, async);
  }

  /// all_to_all_v: this rank sends `in_counts[p]` elements to rank p and receives
  /// `out_counts[q]` from rank q; blocks lie in rank order, at the prefix sums of the counts
  /// (MPI_Alltoallv with packed displacements). Each count must match the peer's; a mismatch is
  /// comm::DesyncError. The counts are copied (an async call need not keep them).
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  void all_to_all_v(In&& in, std::span<const std::size_t> in_counts, Out&& out,
                    std::span<const std::size_t> out_counts) {
    detail::facade::all_to_all_v_entry<Backend, In, Out>(b_, in, in_counts, out, out_counts, blocking);
  }
  /// all_to_all_v with `comm::async`: returns a Work at once; the buffers must outlive it (not the counts).
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  Work all_to_all_v(In&& in, std::span<const std::size_t> in_counts, Out&& out,
                    std::span<const std::size_t> out_counts, async_t) {
    return detail::facade::all_to_all_v_entry<Backend, In, Out>(b_, in, in_counts, out, out_counts, async);
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
    detail::facade::send_entry<Backend, Data>(b_, data, peer, tag, blocking);
  }
  /// send with tag 0 and `comm::async`: returns a Work at once; `data` must outlive it.
  template <class Data>
    requires buffer_range<Data>
  Work send(Data&& data, int peer, async_t) {
    return detail::facade::send_entry<Backend, Data>(b_, data, peer, 0, async);
  }
  /// send with `comm::async`: returns a Work at once; `data` must outlive it.
  template <class Data>
    requires buffer_range<Data>
  Work send(Data&& data, int peer, int tag, async_t) {
    return detail::facade::send_entry<Backend, Data>(b_, data, peer, tag, async);
  }

  /// recv: `data` from rank `peer`'s matching send (see send).
  template <class Data>
    requires buffer_range<Data>
  void recv(Data&& data, int peer, int tag = 0) {
    detail::facade::recv_entry<Backend, Data>(b_, data, peer, tag, blocking);
  }
  /// recv with tag 0 and `comm::async`: returns a Work at once; `data` must outlive it.
  template <class Data>
    requires buffer_range<Data>
  Work recv(Data&& data, int peer, async_t) {
    return detail::facade::recv_entry<Backend, Data>(b_, data, peer, 0, async);
  }
  /// recv with `comm::async`: returns a Work at once; `data` must outlive it.
  template <class Data>
    requires buffer_range<Data>
  Work recv(Data&& data, int peer, int tag, async_t) {
    return detail::facade::recv_entry<Backend, Data>(b_, data, peer, tag, async);
  }

  /// batch_isend_irecv: the sends and receives of `ops` (made with comm::isend / comm::irecv) as
  /// one operation in which they all progress at once, so exchanges in both directions cannot
  /// deadlock. Returns one Work per entry (they complete together). Buffers must outlive them.
  template <class R>
    requires p2p_op_range<R>
  std::vector<Work> batch_isend_irecv(R&& ops) {
    using P = detail::buffer_value_t<R>;
    return detail::facade::batch_entry<Backend, typename P::value_type>(
        b_, std::span<const P>(std::ranges::data(ops), std::ranges::size(ops)));
  }
  /// batch_isend_irecv of a braced list: `c.batch_isend_irecv({comm::isend(a, 1), comm::irecv(b, 1)})`.
  template <class T>
  std::vector<Work> batch_isend_irecv(std::initializer_list<P2POp<T>> ops) {
    return detail::facade::batch_entry<Backend, T>(b_, std::span<const P2POp<T>>(ops.begin(), ops.size()));
  }

  /// barrier: returns once every rank has entered it (blocking form; the async one completes then).
  void barrier() { b_.barrier(blocking); }
  /// barrier with `comm::async`: returns a Work that completes once every rank has entered it.
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
      detail::facade::checks(b_, "new_group").group_ranks(ranks);
      auto g = b_.new_group(ranks);
      if (!g) return std::nullopt;
      return std::optional<Communicator>(std::in_place, std::move(*g));
    } else {
      return std::nullopt;
    }
  }
  /// new_group of a braced list: `c.new_group({0, 2})`.
  [[nodiscard]] std::optional<Communicator> new_group(std::initializer_list<int> ranks) {
    return new_group(std::span<const int>(ranks.begin(), ranks.size()));
  }

  /// Fault tolerance (optional capability 12; Gloo, Shm, Hierarchical). After a failure (or
  /// whenever the application decides), the live members call shrink() and get a new communicator
  /// over themselves, ranks renumbered in their old order. The members agree through the store on
  /// who is alive (a rank that died, also during the shrink, is left out; members never get
  /// different memberships); it ends by the timeout with comm::Timeout naming the ranks that neither
  /// took part nor are known dead. This communicator's queued and running operations end with their
  /// error first, and it stays failed. Needs a store that outlives every rank (comm-run hosts it)
  /// and the liveness watch (a TcpStore).
  [[nodiscard]] Communicator shrink() {
    static_assert(supports_shrink<Backend>,
                  "comm: this backend cannot shrink communicators (it lacks the optional capability "
                  "`B shrink()`, see concepts.hpp)");
    if constexpr (supports_shrink<Backend>) return Communicator(b_.shrink());
  }

  /// A collective of the members and every process waiting to join (a replacement's from_env()):
  /// newcomers are ranked after the members, who keep their ranks. With nobody waiting it costs one
  /// store round trip and returns this communicator itself, so it may be called at every step
  /// boundary. Write `c = c.grow();`: afterwards this object may only be destroyed or assigned.
  [[nodiscard]] Communicator grow() {
    static_assert(supports_grow<Backend>,
                  "comm: this backend cannot grow communicators (it lacks the optional capability "
                  "`B grow()`, see concepts.hpp)");
    if constexpr (supports_grow<Backend>) return Communicator(b_.grow());
  }

  /// Ends every member's pending and future operations on this communicator at once, with
  /// comm::RemoteError naming this rank (and `reason`): what a rank calls when the group must
  /// reconfigure (a bad result, an operator's request). The members then shrink().
  void revoke(std::string_view reason = {}) {
    static_assert(supports_revoke<Backend>,
                  "comm: this backend cannot revoke communicators (it lacks the optional capability "
                  "`void revoke(std::string_view)`, see concepts.hpp)");
    if constexpr (supports_revoke<Backend>) b_.revoke(reason);
  }

  /// At the end of an elastic job (any member, once): processes waiting to join, and any started
  /// later, get comm::InvalidArgument ("join: the job has finished") instead of waiting for their
  /// timeout.
  void close_joins() {
    static_assert(supports_close_joins<Backend>,
                  "comm: this backend cannot grow communicators (it lacks the optional capability "
                  "`void close_joins()`, see concepts.hpp)");
    if constexpr (supports_close_joins<Backend>) b_.close_joins();
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
      detail::facade::checks(b_, "monitored_barrier")
          .invalid("timeout " + std::to_string(timeout.count()) + " ms must be positive");
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
  Backend b_;
};

}  // namespace comm
