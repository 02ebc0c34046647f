#pragma once
// Stopping a gloo context from another thread.
//
// gloo::Context::closeConnections() only closes the sockets: the thread running an operation
// stays blocked in its waits until their own timeouts, and until then the event loop may still be
// mid-way through a receive into the caller's buffer. What gloo does when one of its own waits
// times out is stronger: every pair of the context gets an exception, which wakes the waits
// pending on it (receives and not-yet-started sends) and closes the socket under the pair's lock,
// so that no receive into a user buffer can follow. The entry point for that is not public (and
// Debian's headers for the TCP pair are incomplete), so it is reached through gloo's public API:
// a wait of 1 ms on a fresh buffer with nothing posted times out, and gloo then signals every pair.
//
// Known gap (libgloo, docs/RELIABILITY.md): a send that the event loop already started writing is
// not woken; its wait ends by its own timeout.

#include <chrono>
#include <cstddef>
#include <memory>
#include <type_traits>

#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

#include <comm/detail/engine/transport.hpp>

namespace comm::detail::gloo {

/// Fails every pending wait on `ctx`'s connections ("Application timeout caused pair closure")
/// and closes them. Takes about 1 ms.
inline void abort_context(::gloo::Context& ctx) noexcept {
  try {
    char probe = 0;
    auto buf = ctx.createUnboundBuffer(&probe, 1);
    (void)buf->waitRecv(nullptr, std::chrono::milliseconds(1));
  } catch (...) {  // the expected outcome: gloo's timeout, after it signalled every pair
  }
  try {
    ctx.closeConnections();
  } catch (...) {  // best effort: the connections are being abandoned anyway
  }
}

}  // namespace comm::detail::gloo

namespace comm::detail {

/// A communicator that exposes its gloo contexts (comm::backends::Gloo) is stopped by aborting
/// each one (see detail/engine/transport.hpp).
template <class Member>
  requires requires(Member& x) {
    { x.context(std::size_t{0}) } -> std::convertible_to<const std::shared_ptr<::gloo::Context>&>;
    x.num_devices();
  }
struct TransportAbort<Member> {
  static constexpr bool stops = true;
  static void abort(Member& m) noexcept {
    // Through the engine where there is one: it also closes comm's direct connections (a wait on
    // them is no gloo wait, and aborting the contexts alone left it to its deadline).
    if constexpr (requires { m.stop_transport("why"); }) {
      m.stop_transport("the composite communicator failed");
    } else {
      for (std::size_t i = 0; i < m.num_devices(); ++i)
        if (const auto& ctx = m.context(i)) gloo::abort_context(*ctx);
    }
  }
};

}  // namespace comm::detail
