#pragma once
/// \file
/// The backend concept and the capability traits the facade (`comm::Communicator<B>`) checks at
/// compile time.
///
/// A backend is a *policy type* such as `comm::backends::Gloo` or `comm::backends::Nccl`. It opts
/// in explicitly with a tag alias and must also meet structural requirements; both are needed, so a
/// type that merely happens to have the right members is not taken for a backend, and a type that
/// opts in but forgets a member fails with a diagnostic naming that member.
///
/// ### Requirements of `comm::backend<B>`
/// 1. **Opt-in:** `typename B::backend_concept` names `comm::backend_t` (or a type derived from it).
/// 2. **Identity:** `B::name` is a constant convertible to `std::string_view` ("gloo", "nccl").
/// 3. **Options:** `typename B::Options` is default-constructible and has a member `timeout`
///    convertible to `std::chrono::milliseconds` (the per-operation deadline).
/// 4. **Capabilities,** all usable in constant expressions:
///    - `B::supports_dtype(Dtype) -> bool`: the element types the engine moves;
///    - `B::supports_reduction(ReduceOp, Dtype) -> bool`: the built-in reductions it runs per type;
///    - `B::custom_reductions -> bool`: whether it can run a user callable `T(T, T)`.
/// 5. **Construction:** `B::create(std::shared_ptr<Store>, int rank, int size, const B::Options&)`
///    returns a connected `B`. Other factories (`B::adopt(...)`) are backend-specific and are
///    forwarded by `Communicator<B>::adopt`.
/// 6. **Object:** `B` is move-constructible; `b.rank()` and `b.size()` on a `const B` return `int`.
/// 7. **Operations,** each taking a launch tag last — `comm::blocking` (returns `void`
///    once the operation is complete on this rank) or `comm::async` (returns `comm::Work`):
///    - `b.all_reduce(std::span<const T> in, std::span<T> out, Red, launch)`
///    - `b.reduce_scatter(std::span<const T> in, std::span<T> out, Red, launch)`
///    - `b.all_gather(std::span<const T> in, std::span<T> out, launch)`
///    - `b.broadcast(std::span<T> data, int root, launch)`
///    - `b.gather(std::span<const T> in, std::span<T> out, int root, launch)`
///    - `b.barrier(launch)`
///    where `Red` is a `ReduceOp` value, a `comm::op::builtin<R>` object or, when
///    `B::custom_reductions`, a `comm::custom_op<F>`.
///
/// ### Optional capabilities
/// Detected with requires-expressions, not part of `comm::backend<B>`; the facade method that
/// needs one is a compile error naming it when it is missing (AnyCommunicator: a run-time
/// comm::InvalidArgument).
/// 8. **Subgroups** (`comm::supports_split<B>`, `comm::supports_new_group<B>`):
///    - `b.split(int color, int key) -> std::optional<B>`: collective over every rank of `b`;
///      ranks of one color >= 0 form a communicator ranked by (key, rank in `b`); color < 0 gives
///      nullopt (NCCL: ncclCommSplit, with NCCL_SPLIT_NOCOLOR for a negative color);
///    - `b.new_group(std::span<const int> ranks) -> std::optional<B>`: called by every rank of `b`
///      in the same order, with ranks already validated (in range, no duplicates); members get a
///      communicator ranked in list order, non-members nullopt at once, without communicating.
/// 9. **Monitored barrier** (`comm::supports_monitored_barrier<B>`):
///    `b.monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks)` (timeout 0:
///    the communicator's), throwing comm::Timeout naming the ranks that did not arrive
///    (comm's engine core implements it over the communicator's Store).
/// 11. **The rest of the surface** (`comm::supports_full_surface<B>`), each with a launch tag last:
///    `b.reduce(in, out, root, Red, l)` (in place: in.data() == out.data(); off the root `out` may
///    be empty), `b.scatter(in, out, root, l)`, `b.all_to_all(in, out, l)`,
///    `b.all_to_all_v(in, in_counts, out, out_counts, l)`, `b.send(data, peer, tag, l)`,
///    `b.recv(data, peer, tag, l)`, and `b.batch_isend_irecv(std::span<const P2POp<T>>) ->
///    std::vector<Work>`. Every built-in backend has them (host backends compose what their engine
///    lacks in the engine core).
/// 10. **Flight recorder** (`comm::supports_flight_recorder<B>`): `cb.flight_record() ->
///    comm::FlightRecord` and `cb.dump_flight_record(const std::string& path)`
///    (comm's engine core keeps the ring; the record's format is in <comm/diagnostics.hpp>).
///
/// ### What the concept does *not* check
/// - Requirement 7 is checked for `T = float` with `Red = ReduceOp` and `comm::op::sum_t` only; the
///   other element types and ops are templates the concept cannot enumerate.
/// - Element types: a backend only ever receives the `<cstdint>` 64-bit integers; the facade passes
///   a user's `long long` / `unsigned long long` buffer as std::int64_t / std::uint64_t.
/// - Semantics: the facade has already validated sizes, roots, overlap and (type, op) pairs before
///   calling the backend; the backend may assume valid arguments. Operations issued on one backend
///   object must run in issue order; blocking and completion semantics are the backend's documented
///   contract (host backends: complete on return; NCCL: enqueued on the stream).
/// - That the capability functions agree with what the operations actually accept.

#include <chrono>
#include <cstddef>
#include <concepts>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <comm/diagnostics.hpp>
#include <comm/store.hpp>
#include <comm/types.hpp>
#include <comm/work.hpp>

namespace comm {

/// The tag a backend names as `using backend_concept = comm::backend_t;` to opt in.
struct backend_t {};

// The parts of comm::backend, public so that a backend author can assert them one at a time and
// read which one fails.

/// Requirement 1.
template <class B>
concept backend_opted_in = requires { typename B::backend_concept; } &&
                           std::derived_from<typename B::backend_concept, backend_t>;

/// Requirements 2 and 4.
template <class B>
concept backend_capabilities = requires {
  { B::name } -> std::convertible_to<std::string_view>;
  { B::supports_dtype(Dtype::float32) } -> std::same_as<bool>;
  { B::supports_reduction(ReduceOp::sum, Dtype::float32) } -> std::same_as<bool>;
  { B::custom_reductions } -> std::convertible_to<bool>;
  // Usable in constant expressions (a non-constexpr function makes this ill-formed).
  typename std::bool_constant<B::supports_dtype(Dtype::float32)>;
  typename std::bool_constant<B::supports_reduction(ReduceOp::sum, Dtype::float32)>;
  typename std::bool_constant<static_cast<bool>(B::custom_reductions)>;
};

/// Requirement 3.
template <class B>
concept backend_options = requires(typename B::Options o) {
  requires std::default_initializable<typename B::Options>;
  { o.timeout } -> std::convertible_to<std::chrono::milliseconds>;
};

/// Requirement 5.
template <class B>
concept backend_construction = requires(std::shared_ptr<Store> s, const typename B::Options& o) {
  { B::create(s, 0, 1, o) } -> std::same_as<B>;
};

/// Requirements 6 (rank and size) and 7.
template <class B>
concept backend_operations =
    requires(B& b, const B& cb, std::span<const float> in, std::span<float> out, ReduceOp r, op::sum_t s) {
      { cb.rank() } -> std::same_as<int>;
      { cb.size() } -> std::same_as<int>;
      { b.all_reduce(in, out, r, blocking) } -> std::same_as<void>;
      { b.all_reduce(in, out, s, async) } -> std::same_as<Work>;
      { b.reduce_scatter(in, out, r, blocking) } -> std::same_as<void>;
      { b.reduce_scatter(in, out, s, async) } -> std::same_as<Work>;
      { b.all_gather(in, out, blocking) } -> std::same_as<void>;
      { b.all_gather(in, out, async) } -> std::same_as<Work>;
      { b.broadcast(out, 0, blocking) } -> std::same_as<void>;
      { b.broadcast(out, 0, async) } -> std::same_as<Work>;
      { b.gather(in, out, 0, blocking) } -> std::same_as<void>;
      { b.gather(in, out, 0, async) } -> std::same_as<Work>;
      { b.barrier(blocking) } -> std::same_as<void>;
      { b.barrier(async) } -> std::same_as<Work>;
    };

/// A communication backend policy: see the numbered requirements at the top of this header.
template <class B>
concept backend = backend_opted_in<B> && std::move_constructible<B> && backend_capabilities<B> && backend_options<B> &&
                  backend_construction<B> && backend_operations<B>;

/// Backend `B` moves elements of type `T`.
template <class B, class T>
concept supports_element = backend<B> && element<T> && (B::supports_dtype(dtype_of<T>));

/// Backend `B` runs the built-in reduction `R` on `T`. Bitwise reductions never apply to
/// floating types, whatever the backend says.
template <class B, class T, ReduceOp R>
concept supports_reduction = supports_element<B, T> && (!is_bitwise(R) || integral_element<T>) &&
                             (B::supports_reduction(R, dtype_of<T>));

/// Backend `B` can run a user callable `T(T, T)` as a reduction (Gloo can; NCCL cannot).
template <class B>
concept supports_custom_reduction = backend<B> && static_cast<bool>(B::custom_reductions);

/// Optional capability 8: `b.split(color, key) -> std::optional<B>`.
template <class B>
concept supports_split = backend<B> && requires(B& b) {
  { b.split(0, 0) } -> std::same_as<std::optional<B>>;
};

/// Optional capability 8: `b.new_group(std::span<const int>) -> std::optional<B>`.
template <class B>
concept supports_new_group = backend<B> && requires(B& b, std::span<const int> ranks) {
  { b.new_group(ranks) } -> std::same_as<std::optional<B>>;
};

/// Optional capability 12 (fault tolerance, detail/engine/elastic.hpp): `b.shrink() -> B` (the
/// live members' new communicator), `b.grow() -> B` (members and waiting replacements),
/// `b.revoke(std::string_view)`, `B::join(store, options, timeout) -> B` for a replacement and
/// `b.close_joins()` when the job ends.
template <class B>
concept supports_shrink = backend<B> && requires(B& b) {
  { b.shrink() } -> std::same_as<B>;
};
template <class B>
concept supports_grow = backend<B> && requires(B& b, std::shared_ptr<Store> s, const typename B::Options& o) {
  { b.grow() } -> std::same_as<B>;
  { B::join(s, o, std::chrono::milliseconds(1)) } -> std::same_as<B>;
};
template <class B>
concept supports_revoke = backend<B> && requires(B& b, std::string_view reason) { b.revoke(reason); };
template <class B>
concept supports_close_joins = supports_grow<B> && requires(B& b) { b.close_joins(); };

/// Optional capability 9: `b.monitored_barrier(std::chrono::milliseconds, bool)`.
template <class B>
concept supports_monitored_barrier = backend<B> && requires(B& b, std::chrono::milliseconds t) {
  b.monitored_barrier(t, true);
};

/// Optional capability 11: reduce, scatter, all_to_all, all_to_all_v, send, recv,
/// batch_isend_irecv (checked for T = float, like requirement 7).
template <class B>
concept supports_full_surface =
    backend<B> && requires(B& b, std::span<const float> in, std::span<float> out, std::span<const std::size_t> counts,
                           std::span<const P2POp<float>> ops, op::sum_t s) {
      { b.reduce(in, out, 0, s, blocking) } -> std::same_as<void>;
      { b.reduce(in, out, 0, s, async) } -> std::same_as<Work>;
      { b.scatter(in, out, 0, blocking) } -> std::same_as<void>;
      { b.scatter(in, out, 0, async) } -> std::same_as<Work>;
      { b.all_to_all(in, out, blocking) } -> std::same_as<void>;
      { b.all_to_all(in, out, async) } -> std::same_as<Work>;
      { b.all_to_all_v(in, counts, out, counts, blocking) } -> std::same_as<void>;
      { b.all_to_all_v(in, counts, out, counts, async) } -> std::same_as<Work>;
      { b.send(in, 0, 0, blocking) } -> std::same_as<void>;
      { b.send(in, 0, 0, async) } -> std::same_as<Work>;
      { b.recv(out, 0, 0, blocking) } -> std::same_as<void>;
      { b.recv(out, 0, 0, async) } -> std::same_as<Work>;
      { b.batch_isend_irecv(ops) } -> std::same_as<std::vector<Work>>;
    };

/// Optional capability 10: `cb.flight_record() -> FlightRecord`, `cb.dump_flight_record(path)`.
template <class B>
concept supports_flight_recorder = backend<B> && requires(const B& cb, const std::string& path) {
  { cb.flight_record() } -> std::same_as<FlightRecord>;
  cb.dump_flight_record(path);
};

}  // namespace comm
