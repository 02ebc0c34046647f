#pragma once
/// \file
/// `comm::AnyCommunicator`: a communicator whose backend is chosen at run time (cdb.hpp's world
/// is one). It has the typed API of `Communicator<B>`: element types are checked at compile time;
/// the backend's capabilities (reductions per type, custom callables) at run time, with a clear
/// comm::InvalidArgument. Each call costs one virtual dispatch. Subgroups (`split`, `new_group`)
/// are AnyCommunicators of the same backend; `monitored_barrier`, `flight_record` and
/// `dump_flight_record` forward to the backend (comm::InvalidArgument where it lacks them).

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <comm/communicator.hpp>
#include <comm/detail/cdb/any_comm.hpp>
#include <comm/diagnostics.hpp>
#include <comm/types.hpp>
#include <comm/work.hpp>

namespace comm {

/// A communicator whose backend is chosen at run time (see the file comment). Move-only.
class AnyCommunicator {
 public:
  /// Takes over a typed communicator (its backend is then a run-time property).
  template <comm::backend B>
  explicit AnyCommunicator(Communicator<B>&& c)
      : impl_(std::make_unique<detail::AnyCommModel<B>>(std::move(c))) {}

  /// This process's rank in the communicator, 0 .. size()-1.
  [[nodiscard]] int rank() const noexcept { return impl_->rank(); }
  /// The number of ranks.
  [[nodiscard]] int size() const noexcept { return impl_->size(); }
  /// The backend behind it: "shm", "gloo", "hierarchical", "mpi", "nccl" (the names of
  /// <comm/backends/list.hpp>); after `init_distributed()` with "auto", the one it chose.
  [[nodiscard]] std::string_view backend() const noexcept { return impl_->backend_name(); }

  /// The typed communicator underneath when its backend is `B`, else nullptr.
  template <comm::backend B>
  [[nodiscard]] Communicator<B>* get_if() noexcept {
    return impl_->backend_type() == &detail::backend_type_id<B> ? static_cast<Communicator<B>*>(impl_->communicator())
                                                                : nullptr;
  }

  /// See Communicator::all_reduce (in place); a run-time ReduceOp or a comm::op object, and
  /// `comm::async` last for a Work.
  template <class Data, class... A>
    requires buffer_range<Data> && reduce_args<A...>
  reduce_result_t<A...> all_reduce(Data&& data, A&&... a) {
    using T = detail::element_value_t<Data>;
    check_output<Data>();
    auto s = detail::as_span(data);
    return reduce_call(detail::reduction_kind::all_reduce, std::span<const T>(s), s, std::forward<A>(a)...);
  }
  /// See Communicator::all_reduce (out of place).
  template <class In, class Out, class... A>
    requires buffer_range<In> && buffer_range<Out> && reduce_args<A...>
  reduce_result_t<A...> all_reduce(In&& in, Out&& out, A&&... a) {
    check_output<Out>();
    using T = detail::element_value_t<Out>;
    return reduce_call(detail::reduction_kind::all_reduce, std::span<const T>(detail::as_span(in)),
                       detail::as_span(out), std::forward<A>(a)...);
  }
  /// See Communicator::reduce_scatter.
  template <class In, class Out, class... A>
    requires buffer_range<In> && buffer_range<Out> && reduce_args<A...>
  reduce_result_t<A...> reduce_scatter(In&& in, Out&& out, A&&... a) {
    check_output<Out>();
    using T = detail::element_value_t<Out>;
    return reduce_call(detail::reduction_kind::reduce_scatter, std::span<const T>(detail::as_span(in)),
                       detail::as_span(out), std::forward<A>(a)...);
  }

  /// See Communicator::all_gather.
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  void all_gather(In&& in, Out&& out) {
    (void)all_gather_call(in, out, false);
  }
  /// all_gather with `comm::async`: returns a Work at once; the buffers must outlive it.
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  Work all_gather(In&& in, Out&& out, async_t) {
    return all_gather_call(in, out, true);
  }
  /// See Communicator::broadcast.
  template <class Data>
    requires buffer_range<Data>
  void broadcast(Data&& data, int root) {
    (void)broadcast_call(data, root, false);
  }
  /// broadcast with `comm::async`: returns a Work at once; the buffer must outlive it.
  template <class Data>
    requires buffer_range<Data>
  Work broadcast(Data&& data, int root, async_t) {
    return broadcast_call(data, root, true);
  }
  /// See Communicator::gather.
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  void gather(In&& in, Out&& out, int root) {
    (void)gather_call(in, out, root, false);
  }
  /// gather with `comm::async`: returns a Work at once; the buffers must outlive it.
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  Work gather(In&& in, Out&& out, int root, async_t) {
    return gather_call(in, out, root, true);
  }
  /// See Communicator::barrier.
  void barrier() { (void)impl_->barrier(false); }
  /// barrier with `comm::async`: returns a Work that completes once every rank has entered it.
  Work barrier(async_t) { return impl_->barrier(true); }

  /// See Communicator::reduce (out of place; `(data, root, ...)` in place). premul_sum is not
  /// offered here: use the typed Communicator (get_if).
  template <class In, class Out, class... A>
    requires buffer_range<In> && buffer_range<Out> && reduce_args<A...>
  reduce_result_t<A...> reduce(In&& in, Out&& out, int root, A&&... a) {
    check_output<Out>();
    using T = detail::element_value_t<Out>;
    return reduce_root_call(std::span<const T>(detail::as_span(in)), detail::as_span(out), root, std::forward<A>(a)...);
  }
  /// reduce in place: only the root's `data` changes.
  template <class Data, class... A>
    requires buffer_range<Data> && reduce_args<A...>
  reduce_result_t<A...> reduce(Data&& data, int root, A&&... a) {
    check_output<Data>();
    using T = detail::element_value_t<Data>;
    std::span<T> s = detail::as_span(data);
    return reduce_root_call(std::span<const T>(s), s, root, std::forward<A>(a)...);
  }
  /// See Communicator::scatter.
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  void scatter(In&& in, Out&& out, int root) {
    (void)two_buffer_call(in, out, [&](Dtype d, auto* i, std::size_t ni, auto* o, std::size_t no) {
      return impl_->scatter(d, i, ni, o, no, root, false);
    });
  }
  /// scatter with `comm::async`: returns a Work at once; the buffers must outlive it.
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  Work scatter(In&& in, Out&& out, int root, async_t) {
    return two_buffer_call(in, out, [&](Dtype d, auto* i, std::size_t ni, auto* o, std::size_t no) {
      return impl_->scatter(d, i, ni, o, no, root, true);
    });
  }
  /// See Communicator::all_to_all.
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  void all_to_all(In&& in, Out&& out) {
    (void)two_buffer_call(in, out, [&](Dtype d, auto* i, std::size_t ni, auto* o, std::size_t no) {
      return impl_->all_to_all(d, i, ni, o, no, false);
    });
  }
  /// all_to_all with `comm::async`: returns a Work at once; the buffers must outlive it.
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  Work all_to_all(In&& in, Out&& out, async_t) {
    return two_buffer_call(in, out, [&](Dtype d, auto* i, std::size_t ni, auto* o, std::size_t no) {
      return impl_->all_to_all(d, i, ni, o, no, true);
    });
  }
  /// See Communicator::all_to_all_v.
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  void all_to_all_v(In&& in, std::span<const std::size_t> in_counts, Out&& out, std::span<const std::size_t> out_counts) {
    (void)two_buffer_call(in, out, [&](Dtype d, auto* i, std::size_t ni, auto* o, std::size_t no) {
      return impl_->all_to_all_v(d, i, ni, in_counts, o, no, out_counts, false);
    });
  }
  /// all_to_all_v with `comm::async`: returns a Work at once; the buffers must outlive it (not the counts).
  template <class In, class Out>
    requires buffer_range<In> && buffer_range<Out>
  Work all_to_all_v(In&& in, std::span<const std::size_t> in_counts, Out&& out, std::span<const std::size_t> out_counts,
                    async_t) {
    return two_buffer_call(in, out, [&](Dtype d, auto* i, std::size_t ni, auto* o, std::size_t no) {
      return impl_->all_to_all_v(d, i, ni, in_counts, o, no, out_counts, true);
    });
  }
  /// See Communicator::send / recv.
  template <class Data>
    requires buffer_range<Data>
  void send(Data&& data, int peer, int tag = 0) {
    (void)send_call(data, peer, tag, false);
  }
  /// send with `comm::async`: returns a Work at once; `data` must outlive it.
  template <class Data>
    requires buffer_range<Data>
  Work send(Data&& data, int peer, int tag, async_t) {
    return send_call(data, peer, tag, true);
  }
  /// See Communicator::recv.
  template <class Data>
    requires buffer_range<Data>
  void recv(Data&& data, int peer, int tag = 0) {
    (void)recv_call(data, peer, tag, false);
  }
  /// recv with `comm::async`: returns a Work at once; `data` must outlive it.
  template <class Data>
    requires buffer_range<Data>
  Work recv(Data&& data, int peer, int tag, async_t) {
    return recv_call(data, peer, tag, true);
  }
  /// See Communicator::batch_isend_irecv.
  template <class T>
  std::vector<Work> batch_isend_irecv(std::span<const P2POp<T>> ops) {
    static_assert(sizeof(detail::checked_element_t<T>) != 0);  // the element message first
    std::vector<P2POp<std::byte>> erased;
    erased.reserve(ops.size());
    for (const auto& o : ops)
      erased.push_back(P2POp<std::byte>{o.op, std::span<std::byte>(reinterpret_cast<std::byte*>(o.buffer.data()),
                                                                   o.buffer.size()),
                                        o.peer, o.tag});
    return impl_->batch_isend_irecv(dtype_of<T>, erased);
  }
  /// batch_isend_irecv of a vector of entries.
  template <class T>
  std::vector<Work> batch_isend_irecv(const std::vector<P2POp<T>>& ops) {
    return batch_isend_irecv(std::span<const P2POp<T>>(ops));
  }
  /// batch_isend_irecv of a braced list: `w.batch_isend_irecv({comm::isend(a, 1), comm::irecv(b, 1)})`.
  template <class T>
  std::vector<Work> batch_isend_irecv(std::initializer_list<P2POp<T>> ops) {
    return batch_isend_irecv(std::span<const P2POp<T>>(ops.begin(), ops.size()));
  }

  /// See Communicator::split: a collective; nullopt for a negative color.
  [[nodiscard]] std::optional<AnyCommunicator> split(int color, int key) { return wrap(impl_->split(color, key)); }
  /// split(color, rank()): the new ranks keep this communicator's order.
  [[nodiscard]] std::optional<AnyCommunicator> split(int color) { return split(color, rank()); }
  /// See Communicator::new_group: non-members get nullopt at once.
  [[nodiscard]] std::optional<AnyCommunicator> new_group(std::span<const int> ranks) {
    return wrap(impl_->new_group(ranks));
  }
  /// new_group of a braced list: `w.new_group({0, 2})`.
  [[nodiscard]] std::optional<AnyCommunicator> new_group(std::initializer_list<int> ranks) {
    return new_group(std::span<const int>(ranks.begin(), ranks.size()));
  }
  /// See Communicator::shrink, grow and revoke (Gloo, Shm, Hierarchical; InvalidArgument on a
  /// backend without them). `c = c.grow();`: afterwards the old object may only be destroyed or
  /// assigned. For cdb's world, comm::shrink_world() and comm::grow_world() (world.hpp).
  [[nodiscard]] AnyCommunicator shrink() { return AnyCommunicator(impl_->shrink()); }
  /// See Communicator::grow: `c = c.grow();`.
  [[nodiscard]] AnyCommunicator grow() { return AnyCommunicator(impl_->grow()); }
  /// See Communicator::revoke.
  void revoke(std::string_view reason = {}) { impl_->revoke(reason); }
  /// See Communicator::close_joins.
  void close_joins() { impl_->close_joins(); }

  /// See Communicator::monitored_barrier.
  void monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks = false) {
    if (timeout.count() <= 0)
      throw InvalidArgument("monitored_barrier", rank(),
                            "timeout " + std::to_string(timeout.count()) + " ms must be positive");
    impl_->monitored_barrier(timeout, wait_all_ranks);
  }
  /// monitored_barrier with the communicator's timeout, naming the first missing rank.
  void monitored_barrier() { impl_->monitored_barrier(std::chrono::milliseconds{0}, false); }
  /// See Communicator::flight_record / dump_flight_record.
  [[nodiscard]] FlightRecord flight_record() const { return impl_->flight_record(); }
  /// Writes the flight record to `path` ("-": stderr); comm::BackendError naming the path on failure.
  void dump_flight_record(const std::string& path) const { impl_->dump_flight_record(path); }

 private:
  explicit AnyCommunicator(std::unique_ptr<detail::AnyCommImpl> impl) noexcept : impl_(std::move(impl)) {}
  static std::optional<AnyCommunicator> wrap(std::unique_ptr<detail::AnyCommImpl> impl) {
    if (!impl) return std::nullopt;
    return AnyCommunicator(std::move(impl));
  }

  template <class Out>
  static constexpr void check_output() {
    static_assert(detail::is_mutable_buffer_v<Out>,
                  "comm: an output buffer must be mutable (std::span<T>, not std::span<const T> or a const container)");
  }
  template <class T>
  static constexpr void check_element() {
    static_assert(sizeof(detail::checked_element_t<T>) != 0);  // types.hpp's one message
  }

  template <class T, class Op>
  static detail::ErasedOp erase_op(const Op& o, std::optional<std::function<T(T, T)>>& holder) {
    using O = std::remove_cvref_t<Op>;
    if constexpr (std::is_same_v<O, ReduceOp>) {
      return {o, nullptr};
    } else if constexpr (builtin_reduction<O>) {
      constexpr ReduceOp r = reduce_op_of<O>;
      static_assert(!is_bitwise(r) || integral_element<T>,
                    "comm: bitwise reductions (band/bor/bxor) need an integer element type");
      return {r, nullptr};
    } else {
      static_assert(custom_reduction<O, T>,
                    "comm: a reduction must be a comm::ReduceOp, a comm::op::* object, std::plus<> and friends, or a "
                    "callable T(T, T) for the buffer's element type T");
      holder.emplace(o);
      return {ReduceOp::sum, &*holder};
    }
  }

  template <class T, class... A>
  reduce_result_t<A...> reduce_call(detail::reduction_kind kind, std::span<const T> in, std::span<T> out,
                                            A&&... a) {
    check_element<T>();
    constexpr bool is_async = detail::reduce_tail_traits<A...>::is_async;
    std::optional<std::function<T(T, T)>> holder;
    detail::ErasedOp op;
    if constexpr (sizeof...(A) == 2 || (sizeof...(A) == 1 && !is_async)) {
      op = erase_op<T>(std::get<0>(std::forward_as_tuple(a...)), holder);
    }
    Work w = kind == detail::reduction_kind::all_reduce
                 ? impl_->all_reduce(dtype_of<T>, in.data(), in.size(), out.data(), out.size(), op, is_async)
                 : impl_->reduce_scatter(dtype_of<T>, in.data(), in.size(), out.data(), out.size(), op, is_async);
    if constexpr (is_async) return w;
  }

  template <class T, class... A>
  reduce_result_t<A...> reduce_root_call(std::span<const T> in, std::span<T> out, int root, A&&... a) {
    check_element<T>();
    constexpr bool is_async = detail::reduce_tail_traits<A...>::is_async;
    std::optional<std::function<T(T, T)>> holder;
    detail::ErasedOp op;
    if constexpr (sizeof...(A) == 2 || (sizeof...(A) == 1 && !is_async)) {
      op = erase_op<T>(std::get<0>(std::forward_as_tuple(a...)), holder);
    }
    Work w = impl_->reduce(dtype_of<T>, in.data(), in.size(), out.data(), out.size(), root, op, is_async);
    if constexpr (is_async) return w;
  }

  template <class In, class Out, class F>
  Work two_buffer_call(In& in_r, Out& out_r, F&& f) {
    check_output<Out>();
    using T = detail::element_value_t<Out>;
    check_element<T>();
    static_assert(std::is_same_v<detail::element_value_t<In>, T>, "comm: input and output buffers must have the same element type");
    std::span<const T> in = detail::as_span(in_r);
    std::span<T> out = detail::as_span(out_r);
    return f(dtype_of<T>, static_cast<const void*>(in.data()), in.size(), static_cast<void*>(out.data()), out.size());
  }
  template <class Data>
  Work send_call(Data& d, int peer, int tag, bool async) {
    using T = detail::element_value_t<Data>;
    check_element<T>();
    std::span<const T> s = detail::as_span(d);
    return impl_->send(dtype_of<T>, s.data(), s.size(), peer, tag, async);
  }
  template <class Data>
  Work recv_call(Data& d, int peer, int tag, bool async) {
    check_output<Data>();
    using T = detail::element_value_t<Data>;
    check_element<T>();
    std::span<T> s = detail::as_span(d);
    return impl_->recv(dtype_of<T>, s.data(), s.size(), peer, tag, async);
  }

  template <class In, class Out>
  Work all_gather_call(In& in_r, Out& out_r, bool async) {
    check_output<Out>();
    using T = detail::element_value_t<Out>;
    check_element<T>();
    std::span<const T> in = detail::as_span(in_r);
    std::span<T> out = detail::as_span(out_r);
    return impl_->all_gather(dtype_of<T>, in.data(), in.size(), out.data(), out.size(), async);
  }
  template <class Data>
  Work broadcast_call(Data& d, int root, bool async) {
    check_output<Data>();
    using T = detail::element_value_t<Data>;
    check_element<T>();
    std::span<T> s = detail::as_span(d);
    return impl_->broadcast(dtype_of<T>, s.data(), s.size(), root, async);
  }
  template <class In, class Out>
  Work gather_call(In& in_r, Out& out_r, int root, bool async) {
    check_output<Out>();
    using T = detail::element_value_t<Out>;
    check_element<T>();
    std::span<const T> in = detail::as_span(in_r);
    std::span<T> out = detail::as_span(out_r);
    return impl_->gather(dtype_of<T>, in.data(), in.size(), out.data(), out.size(), root, async);
  }

  std::unique_ptr<detail::AnyCommImpl> impl_;
};

}  // namespace comm
