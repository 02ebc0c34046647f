#pragma once
// Waits on gloo's unbound buffers that closing the communicator cuts short.
//
// libgloo's pair-level abort (abort.hpp) wakes the receives and the sends not yet started, but
// not a send its event loop already began writing: tcp/pair.cc signals only the old bound buffers
// of its transmit queue, so that wait lasts until its own timeout (a survivor of a dead peer
// waiting the whole COMM_TIMEOUT). Every wait of comm's algorithms goes through the
// communicator's WaitGate, which knows the buffers being waited on and aborts those waits when the
// communicator closes (a death seen by the liveness watch, abort(), a failed operation).
//
// The gate closes after abort_context() closed the connections under their pairs' locks, so no
// event loop still reads or writes the caller's memory when a woken operation returns.

#include <algorithm>
#include <chrono>
#include <mutex>
#include <vector>

#include <gloo/common/error.h>
#include <gloo/transport/unbound_buffer.h>

namespace comm::detail::gloo {

class WaitGate {
 public:
  /// One receive (send) completion on `b` within `timeout`; false: the gate closed.
  /// Throws what gloo throws (a timeout, a closed connection).
  [[nodiscard]] bool wait(::gloo::transport::UnboundBuffer& b, bool send, std::chrono::milliseconds timeout) {
    {
      std::lock_guard lock(mu_);
      if (closed_) return false;
      waiting_.push_back(&b);
    }
    struct Leave {
      WaitGate& g;
      ::gloo::transport::UnboundBuffer* b;
      ~Leave() {
        std::lock_guard lock(g.mu_);
        g.waiting_.erase(std::find(g.waiting_.begin(), g.waiting_.end(), b));
      }
    } leave{*this, &b};
    return send ? b.waitSend(timeout) : b.waitRecv(timeout);
  }

  /// From any thread: every pending wait, and every later one, returns false at once.
  void close() noexcept {
    std::lock_guard lock(mu_);
    closed_ = true;
    for (auto* b : waiting_) {
      b->abortWaitRecv();
      b->abortWaitSend();
    }
  }

 private:
  std::mutex mu_;  // waiting_ between the operation's thread and close() (any thread)
  // Ops run one at a time, but the gate does not rely on it: a wait leaves what it entered.
  std::vector<::gloo::transport::UnboundBuffer*> waiting_;
  bool closed_ = false;
};

/// One deadline for all the waits of an operation (gloo's own waits each get the full timeout),
/// and the gate that can end them early.
class Deadline {
 public:
  Deadline(std::chrono::milliseconds timeout, WaitGate& gate)
      : at_(std::chrono::steady_clock::now() + timeout), gate_(&gate) {}
  [[nodiscard]] std::chrono::milliseconds left() const {
    return std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                      at_ - std::chrono::steady_clock::now()));
  }
  [[nodiscard]] bool expired() const noexcept { return std::chrono::steady_clock::now() >= at_; }
  [[nodiscard]] WaitGate& gate() const noexcept { return *gate_; }

 private:
  std::chrono::steady_clock::time_point at_;
  WaitGate* gate_;
};

inline void wait_recv(::gloo::transport::UnboundBuffer& b, const Deadline& d) {
  if (!d.gate().wait(b, false, d.left())) throw ::gloo::IoException("receive aborted");
}
inline void wait_send(::gloo::transport::UnboundBuffer& b, const Deadline& d) {
  if (!d.gate().wait(b, true, d.left())) throw ::gloo::IoException("send aborted");
}

/// After a receive's wait failed (the gate closed, the connection failed): whether the message
/// came in all the same, taking its completion. libgloo answers a zero wait that finds none as a
/// timeout and fails the context's pairs, which a failing communicator does anyway. Twice: a gate
/// that closed just as an earlier wait succeeded leaves an abort flag the first call takes.
[[nodiscard]] inline bool arrived(::gloo::transport::UnboundBuffer& b) noexcept {
  try {
    for (int i = 0; i < 2; ++i)
      if (b.waitRecv(std::chrono::milliseconds(0))) return true;
  } catch (...) {  // nothing came in (libgloo's timeout), or the pair's error
  }
  return false;
}

}  // namespace comm::detail::gloo
