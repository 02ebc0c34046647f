#pragma once
// The kinds of failure an engine remembers after its first error, so that every later operation
// fails at once with the same kind of comm::Error and the first cause (backend-neutral).

#include <charconv>
#include <string>

#include <comm/error.hpp>

namespace comm::detail {

// A desync keeps its class after it failed the communicator: the later calls that fail with it
// as the first cause are DesyncError too, as a Timeout's are Timeout (they were BackendError).
enum class FailureKind { timeout, remote, desync, backend };

/// A DesyncError that only the ranks next to the disagreement can see: a header one receiver
/// checks alone (the Gloo engine's headed operations). The core publishes it on the liveness
/// channel as it does a closed connection (core.hpp, run()): a rank whose own peers agree with it
/// learns of the desync only through closed connections otherwise, and those leave a receive
/// libgloo had begun reading (or a send it had begun writing) waiting for its deadline.
class UnsharedDesync : public DesyncError {
 public:
  explicit UnsharedDesync(const DesyncError& e) : DesyncError(e) {}
};

[[noreturn]] inline void throw_as(FailureKind kind, const std::string& op, int rank, const std::string& text,
                                  const std::string& peer = {}) {
  switch (kind) {
    case FailureKind::timeout: throw Timeout(op, rank, text, peer);
    case FailureKind::remote: throw RemoteError(op, rank, text, peer);
    case FailureKind::desync: throw DesyncError(op, rank, text, peer);
    case FailureKind::backend: break;
  }
  throw BackendError(op, rank, text, peer);
}

[[nodiscard]] inline FailureKind kind_of(const Error& e) {
  if (dynamic_cast<const Timeout*>(&e) != nullptr) return FailureKind::timeout;
  if (dynamic_cast<const RemoteError*>(&e) != nullptr) return FailureKind::remote;
  if (dynamic_cast<const DesyncError*>(&e) != nullptr) return FailureKind::desync;
  return FailureKind::backend;
}

/// N of an error's peer "rank N"; -1 for any other peer (an address, a device) or none.
[[nodiscard]] inline int rank_named(const std::string& peer) {
  if (!peer.starts_with("rank ")) return -1;
  int r = -1;
  const char* end = peer.data() + peer.size();
  const auto [p, ec] = std::from_chars(peer.data() + 5, end, r);
  return ec == std::errc() && p == end ? r : -1;
}

}  // namespace comm::detail
