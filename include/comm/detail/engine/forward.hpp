#pragma once
// The operations of a backend policy (concepts.hpp, requirements 7 and 11), each forwarded to
// `engine_`: written once for every backend, so a policy is its engine, its options and what
// only it does. A policy that must adapt the buffers of some operations first (Gloo's device
// staging) defines those operations itself; its own hide these.
//
// The policy derives from ForwardOps<Policy>, befriends it and has `engine_` (a pointer to an
// engine with the EngineCore entry points); rank(), size() and timeout() come from here too. Two
// optional hooks, both read where an operation is used (the policy is complete by then), cost
// nothing where absent:
// - `static constexpr bool forwards_full_surface`: false leaves out capability 11 (reduce,
//   scatter, all_to_all(_v), send, recv, batch_isend_irecv), so that `supports_full_surface`
//   answers for the policy (Hierarchical: only where its Inter member has them). Default: true.
// - `void admit(const ForwardCall&) const`: checks an operation before the engine queues it (so a
//   refusal leaves the communicator usable) — what the policy's engine cannot take, e.g. Mpi's
//   thread level for async calls and MPI's int counts.

#include <chrono>
#include <cstddef>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include <comm/detail/diagnostics/flight_recorder.hpp>
#include <comm/detail/engine/op.hpp>
#include <comm/types.hpp>
#include <comm/work.hpp>

namespace comm::detail {

/// An operation as a policy's `admit` hook sees it.
struct ForwardCall {
  OpKind kind;
  bool async = false;
  /// The elements of one rank's block, for the operations whose buffer is one block per rank
  /// (reduce_scatter's output, all_gather's and gather's input, scatter's output, all_to_all's
  /// input divided by the size); 0 for the others.
  std::size_t block = 0;
  /// all_to_all_v's counts (empty for the others).
  std::span<const std::size_t> in_counts{};
  std::span<const std::size_t> out_counts{};
};

/// Whether ForwardOps<Policy> forwards capability 11 (see the file comment).
template <class Policy>
[[nodiscard]] consteval bool forwards_full_surface() {
  if constexpr (requires { Policy::forwards_full_surface; })
    return Policy::forwards_full_surface;
  else
    return true;
}

struct ErasedLaunch;

template <class Policy>
class ForwardOps {
 public:
  [[nodiscard]] int rank() const noexcept { return engine().rank(); }
  [[nodiscard]] int size() const noexcept { return engine().size(); }
  /// The deadline of each operation.
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return engine().timeout(); }

  /// Fails this communicator and wakes its pending waits now, from any thread: what a composite
  /// engine (Hierarchical) does to a member when the composite fails (detail/engine/transport.hpp).
  void stop_transport(const char* why) noexcept {
    try {
      engine().abort(why, std::chrono::milliseconds(0));
    } catch (...) {  // best effort: the member is being abandoned
    }
  }

  template <element T, class Red, class Launch>
  auto all_reduce(std::span<const T> in, std::span<T> out, Red red, Launch l) {
    check_call<Launch>({OpKind::all_reduce});
    return engine().template all_reduce<T>(in, out, std::move(red), l);
  }
  template <element T, class Red, class Launch>
  auto reduce_scatter(std::span<const T> in, std::span<T> out, Red red, Launch l) {
    check_call<Launch>({OpKind::reduce_scatter, false, out.size()});
    return engine().template reduce_scatter<T>(in, out, std::move(red), l);
  }
  template <element T, class Launch>
  auto all_gather(std::span<const T> in, std::span<T> out, Launch l) {
    check_call<Launch>({OpKind::all_gather, false, in.size()});
    return engine().template all_gather<T>(in, out, l);
  }
  template <element T, class Launch>
  auto broadcast(std::span<T> data, int root, Launch l) {
    check_call<Launch>({OpKind::broadcast});
    return engine().template broadcast<T>(data, root, l);
  }
  template <element T, class Launch>
  auto gather(std::span<const T> in, std::span<T> out, int root, Launch l) {
    check_call<Launch>({OpKind::gather, false, in.size()});
    return engine().template gather<T>(in, out, root, l);
  }
  template <class Launch>
  auto barrier(Launch l) {
    check_call<Launch>({OpKind::barrier});
    return engine().barrier(l);
  }

  // ---- capability 11 ----

  template <element T, class Red, class Launch>
    requires(forwards_full_surface<Policy>())
  auto reduce(std::span<const T> in, std::span<T> out, int root, Red red, Launch l) {
    check_call<Launch>({OpKind::reduce});
    return engine().template reduce<T>(in, out, root, std::move(red), l);
  }
  template <element T, class Launch>
    requires(forwards_full_surface<Policy>())
  auto scatter(std::span<const T> in, std::span<T> out, int root, Launch l) {
    check_call<Launch>({OpKind::scatter, false, out.size()});
    return engine().template scatter<T>(in, out, root, l);
  }
  template <element T, class Launch>
    requires(forwards_full_surface<Policy>())
  auto all_to_all(std::span<const T> in, std::span<T> out, Launch l) {
    check_call<Launch>({OpKind::all_to_all, false, in.size() / static_cast<std::size_t>(engine().size())});
    return engine().template all_to_all<T>(in, out, l);
  }
  template <element T, class Launch>
    requires(forwards_full_surface<Policy>())
  auto all_to_all_v(std::span<const T> in, std::span<const std::size_t> in_counts, std::span<T> out,
                    std::span<const std::size_t> out_counts, Launch l) {
    check_call<Launch>({OpKind::all_to_all_v, false, 0, in_counts, out_counts});
    return engine().template all_to_all_v<T>(in, in_counts, out, out_counts, l);
  }
  template <element T, class Launch>
    requires(forwards_full_surface<Policy>())
  auto send(std::span<const T> data, int peer, int tag, Launch l) {
    check_call<Launch>({OpKind::send});
    return engine().template send<T>(data, peer, tag, l);
  }
  template <element T, class Launch>
    requires(forwards_full_surface<Policy>())
  auto recv(std::span<T> data, int peer, int tag, Launch l) {
    check_call<Launch>({OpKind::recv});
    return engine().template recv<T>(data, peer, tag, l);
  }
  /// Always async: its operations progress together on the worker thread.
  template <element T>
    requires(forwards_full_surface<Policy>())
  std::vector<Work> batch_isend_irecv(std::span<const P2POp<T>> ops) {
    check_call<async_t>({OpKind::p2p_batch});
    return engine().template batch_isend_irecv<T>(ops);
  }

 private:
  friend struct ErasedLaunch;

  [[nodiscard]] auto& engine() noexcept { return *static_cast<Policy&>(*this).engine_; }
  [[nodiscard]] const auto& engine() const noexcept { return *static_cast<const Policy&>(*this).engine_; }

  template <class Launch>
  void check_call(ForwardCall call) const {
    if constexpr (requires(const Policy& p) { p.admit(call); }) {
      call.async = std::is_same_v<Launch, async_t>;
      static_cast<const Policy&>(*this).admit(call);
    }
  }
};

/// The erased entry of a policy whose engine is an EngineCore: a ready Op record (op.hpp) goes to
/// the engine's launch after the policy's `admit` hook, with no re-typing on the way. A composing
/// engine (Hierarchical) hands its members their steps this way. What a policy adapts in its own
/// typed operations (Gloo's device staging) is not applied: callers pass host buffers.
struct ErasedLaunch {
  template <class Policy, class Launch>
  static auto launch(Policy& p, Op& op, Launch l) -> decltype(std::declval<ForwardOps<Policy>&>().engine().launch(op, l)) {
    auto& f = static_cast<ForwardOps<Policy>&>(p);
    f.template check_call<Launch>(call_of(op, f.size()));
    return f.engine().launch(op, l);
  }

  /// What `admit` sees of `op` (see ForwardCall).
  [[nodiscard]] static ForwardCall call_of(const Op& op, int size) {
    ForwardCall c{op.desc.kind};
    switch (op.desc.kind) {
      case OpKind::reduce_scatter:
      case OpKind::scatter: c.block = op.out_count; break;
      case OpKind::all_gather:
      case OpKind::gather: c.block = op.in_count; break;
      case OpKind::all_to_all: c.block = op.in_count / static_cast<std::size_t>(size); break;
      case OpKind::all_to_all_v: {
        const std::span<const std::size_t> counts(op.counts);
        c.in_counts = counts.first(counts.size() / 2);
        c.out_counts = counts.subspan(counts.size() / 2);
        break;
      }
      default: break;
    }
    return c;
  }
};

/// Policies whose operations ErasedLaunch can launch (their engine takes Op records).
template <class Policy>
concept erased_launch = requires(Policy& p, Op& op) { ErasedLaunch::launch(p, op, blocking); };

}  // namespace comm::detail
