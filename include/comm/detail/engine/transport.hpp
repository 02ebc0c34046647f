#pragma once
// Stopping a member communicator's transport from another thread, without naming its engine: a
// composite engine (Hierarchical) calls abort_transport(member) when another thread gave up on an
// operation, so that the member's pending waits end now and its peers fail fast.
//
// An engine whose transport can be stopped that way says so by specializing TransportAbort for its
// policy type (the Gloo engine: detail/gloo/abort.hpp). Every other member ends its step by its own
// deadline, and the composite's executing thread then destroys it.

namespace comm::detail {

/// Primary: nothing to stop from outside.
template <class Member>
struct TransportAbort {
  static constexpr bool stops = false;
  static void abort(Member& /*m*/) noexcept {}
};

/// A member over an engine core (ForwardOps: Shm, Mpi, ...) is stopped through its engine: its
/// failure is recorded and its transport closed, which wakes its pending waits at once (Shm: the
/// segment's abort word). Gloo's own specialization (detail/gloo/abort.hpp) takes precedence.
template <class Member>
  requires requires(Member& x) { x.stop_transport("why"); } && (!requires(Member& x) { x.num_devices(); })
struct TransportAbort<Member> {
  static constexpr bool stops = true;
  static void abort(Member& m) noexcept { m.stop_transport("the composite communicator failed"); }
};

/// Stops `m`'s connections (bounded, never throws); see TransportAbort.
template <class Member>
void abort_transport(Member& m) noexcept {
  TransportAbort<Member>::abort(m);
}

}  // namespace comm::detail
