#pragma once
// Gloo's always-on mismatch check. libgloo terminates the process when a message is longer than
// the receive posted for it (an enforce on its event-loop thread, tcp/pair.cc), and ranks that
// disagree about an operation's count or element type send exactly such messages. comm never lets
// gloo see one, without the desync check and at (almost) no cost:
//
//   - Small operations (every message at most kCheckedMax bytes, at most kCheckedMaxRanks ranks)
//     run comm's own algorithms on frames: a message is the operation's 32-byte fingerprint, then
//     its payload, and every receive is posted for a whole frame, the longest message any rank
//     sends on that slot, so nothing a peer sends can overflow it. The fingerprint of each message
//     is compared with this rank's before its payload is used: a mismatch is a DesyncError naming
//     both calls. Cost: 32 bytes per message and a copy of the payload in and out of the frame.
//   - Large all_reduce, reduce_scatter, broadcast, gather and all_gather send header frames
//     (HeaderFrames: the fingerprint alone) to each rank they send payload to, on the same slot;
//     the payload travels on a slot hashed from the fingerprint (bulk.hpp), so it lands only
//     where the header checks out. A broadcast's, gather's or all_gather's header goes right
//     behind its first segment (post_headed_recvs): one wake-up for both.
//   - The other operations exchange fingerprints first (one message latency; the engine core's
//     desync exchange), through the same frames and slot, so a peer in any regime is caught.
//
// The fingerprint's spare word carries the payload length, or in a header frame the algorithm an
// all_reduce or reduce_scatter picked: ranks whose settings choose different algorithms for the
// same call (COMM_GLOO_ALLREDUCE_SMALL or COMM_GLOO_RS_HALVING_MAX on one rank only) disagree
// there too.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <gloo/common/error.h>
#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <comm/detail/base/copy.hpp>
#include <comm/detail/diagnostics/desync.hpp>
#include <comm/detail/engine/failure.hpp>
#include <comm/detail/gloo/algorithms.hpp>
#include <comm/detail/gloo/direct.hpp>
#include <comm/error.hpp>

namespace comm::detail::gloo {

inline constexpr std::size_t kCheckedMax = std::size_t{256} << 10;  // payload bytes of one message
inline constexpr int kCheckedMaxRanks = 16;  // direct algorithms send up to n-1 messages per rank
inline constexpr std::size_t kFrameBytes = sizeof(Fingerprint) + kCheckedMax;
inline constexpr std::uint8_t kCheckedSlotPrefix = 0x27;

/// Reusable frames of one gloo context, each with its own buffer (a wait then names its peer).
/// The memory is not initialised: pages no message reached cost nothing. With comm's direct
/// connections (direct.hpp) the frames travel there, and gloo's buffers are not made.
class Frames {
 public:
  explicit Frames(DirectLinks* direct = nullptr) noexcept : direct_(direct) {}

  void reserve(const std::shared_ptr<::gloo::Context>& ctx, std::size_t n) {
    if (n <= count_) return;
    bufs_.clear();
    mem_.reset(new std::byte[n * kFrameBytes]);
    count_ = n;
    recv_tickets_.assign(n, 0);
    if (direct_ == nullptr)
      for (std::size_t i = 0; i < n; ++i) bufs_.push_back(ctx->createUnboundBuffer(at(i), kFrameBytes));
  }
  [[nodiscard]] std::byte* at(std::size_t i) const noexcept { return mem_.get() + i * kFrameBytes; }
  [[nodiscard]] static std::byte* payload(std::byte* frame) noexcept { return frame + sizeof(Fingerprint); }
  [[nodiscard]] ::gloo::transport::UnboundBuffer& buffer(std::size_t i) const { return *bufs_[i]; }
  [[nodiscard]] DirectLinks* direct() const noexcept { return direct_; }

  // The direct connections' tickets of the operation in progress: frame i's receive, and each
  // (frame, peer) send (a frame may go to several peers at once).
  void begin_op() noexcept { sends_.clear(); }
  [[nodiscard]] std::uint64_t& recv_ticket(std::size_t i) { return recv_tickets_.at(i); }
  void sent(std::size_t i, int peer, std::uint64_t ticket) { sends_.push_back({i, peer, ticket}); }
  [[nodiscard]] std::uint64_t send_ticket(std::size_t i, int peer) const {
    for (const auto& s : sends_)
      if (s.frame == i && s.peer == peer) return s.ticket;
    throw std::logic_error("comm: wait for a frame that was not sent");
  }

 private:
  struct Sent {
    std::size_t frame;
    int peer;
    std::uint64_t ticket;
  };
  DirectLinks* direct_;
  std::size_t count_ = 0;
  std::unique_ptr<std::byte[]> mem_;
  std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> bufs_;
  std::vector<std::uint64_t> recv_tickets_;
  std::vector<Sent> sends_;
};

/// One checked operation's messages: its slot, deadline and fingerprint.
class FramedOp {
 public:
  FramedOp(const std::shared_ptr<::gloo::Context>& ctx, Frames& frames, std::size_t nframes, std::uint32_t tag,
           const Deadline& deadline, Fingerprint fp, std::size_t payload, const char* op)
      : frames_(frames),
        slot_(static_cast<std::uint64_t>(::gloo::Slot::build(kCheckedSlotPrefix, tag))),
        deadline_(deadline),
        fp_(fp),
        payload_(payload),
        op_(op),
        rank_(ctx->rank) {
    // Header frames (no payload) keep what the caller put there: the algorithm of a headed
    // all_reduce or reduce_scatter, which its ranks pick by their own settings.
    if (payload != 0) fp_.reserved = static_cast<std::uint32_t>(payload);
    frames.reserve(ctx, nframes);
    frames.begin_op();
  }

  [[nodiscard]] std::byte* frame(std::size_t i) const noexcept { return frames_.at(i); }
  [[nodiscard]] std::byte* payload(std::size_t i) const noexcept { return Frames::payload(frames_.at(i)); }
  [[nodiscard]] std::size_t payload_bytes() const noexcept { return payload_; }

  /// Frame i gets this operation's fingerprint, then `src` (payload_bytes(); null: left as is).
  void fill(std::size_t i, const void* src) const {
    std::memcpy(frame(i), &fp_, sizeof(Fingerprint));
    if (src != nullptr) copy_bytes(payload(i), src, payload_);
  }
  void post_recv(std::size_t i, int peer) const {
    if (auto* d = frames_.direct()) {
      frames_.recv_ticket(i) = d->post_recv(peer, frame(i), kFrameBytes);
      return;
    }
    frames_.buffer(i).recv(peer, slot_, 0, kFrameBytes);
  }
  void send(std::size_t i, int peer) const {
    if (auto* d = frames_.direct()) {
      frames_.sent(i, peer, d->send(peer, frame(i), sizeof(Fingerprint) + payload_));
      return;
    }
    frames_.buffer(i).send(peer, slot_, 0, sizeof(Fingerprint) + payload_);
  }

  /// Waits for frame i's message from `peer` and checks its fingerprint.
  void wait_recv(std::size_t i, int peer) const {
    waited(i, peer, false);
    Fingerprint got;
    std::memcpy(&got, frame(i), sizeof got);
    if (valid(got) && same(got, fp_)) return;
    throw DesyncError(op_, rank_, "desync: " + mismatch(got, peer), "rank " + std::to_string(peer));
  }
  /// Waits for frame i's message from `peer` without looking at it (the fingerprint exchange
  /// compares every rank's at once).
  void wait_arrival(std::size_t i, int peer) const { waited(i, peer, false); }
  /// Waits for one send from frame i (to `peer`, named if it fails).
  void wait_send(std::size_t i, int peer) const { waited(i, peer, true); }

  /// "rank 1 called broadcast(float x4, root 0) while rank 0 called all_reduce(float x4, sum)".
  [[nodiscard]] std::string mismatch(const Fingerprint& got, int peer) const {
    if (!valid(got))
      return "rank " + std::to_string(peer) + " sent a message that is not part of op #" + std::to_string(fp_.seq) +
             " (no valid fingerprint)";
    const std::string theirs = describe_call(got), mine = describe_call(fp_);
    std::string msg = "rank " + std::to_string(peer) + " called " + theirs + " while rank " + std::to_string(rank_) +
                      " called " + mine;
    if (got.seq == fp_.seq) msg += " at op #" + std::to_string(fp_.seq);
    if (theirs == mine)
      msg += " (the ranks chose different algorithms, " + std::to_string(got.reserved) + " and " +
             std::to_string(fp_.reserved) +
             " in the fingerprint's spare word; do their COMM_GLOO_ALLREDUCE_SMALL or COMM_GLOO_RS_HALVING_MAX "
             "settings differ?)";
    return msg;
  }

 private:
  void waited(std::size_t i, int peer, bool send) const {
    if (auto* d = frames_.direct()) {
      if (send)
        d->wait_sent(peer, frames_.send_ticket(i, peer), deadline_, op_, fp_.seq);
      else
        d->wait_received(peer, frames_.recv_ticket(i), deadline_, op_, fp_.seq);
      return;
    }
    auto& b = frames_.buffer(i);
    try {
      if (send)
        gloo::wait_send(b, deadline_);
      else
        gloo::wait_recv(b, deadline_);
    } catch (const ::gloo::IoException& e) {
      // A frame that came in before the communicator closed (a peer's failure, announced while
      // this rank had not looked yet) is still read: a mismatch in it is this rank's own
      // DesyncError, not the echo of the failure that mismatch caused elsewhere.
      if (!send && gloo::arrived(b)) return;
      // gloo's text says whether it timed out or the connection closed; add who and what.
      throw ::gloo::IoException(std::string(e.what()) + " [" + (send ? "sending to rank " : "receiving from rank ") +
                                std::to_string(peer) + " in op #" + std::to_string(fp_.seq) + "]");
    }
  }

  Frames& frames_;
  std::uint64_t slot_;
  Deadline deadline_;
  Fingerprint fp_;
  std::size_t payload_;
  const char* op_;
  int rank_;
};

/// The header messages of a large rooted operation (bulk.hpp's Headers) in frames: each is the
/// operation's fingerprint alone, on the operation's checked slot, so a peer that runs this
/// operation on frames (it disagrees about the size) or exchanges fingerprints for it is caught
/// as well. Frame q receives rank q's header; frame r holds this rank's.
class HeaderFrames {
 public:
  HeaderFrames(const FramedOp& f, int rank) : f_(f), me_(static_cast<std::size_t>(rank)) { f_.fill(me_, nullptr); }
  void expect(int peer) const { f_.post_recv(static_cast<std::size_t>(peer), peer); }
  void announce(int peer) const { f_.send(me_, peer); }
  /// Waits for `peer`'s header: DesyncError when it called another operation (one only the
  /// ranks that receive from `peer` see: UnsharedDesync).
  void check(int peer) const {
    try {
      f_.wait_recv(static_cast<std::size_t>(peer), peer);
    } catch (const DesyncError& e) {
      throw UnsharedDesync(e);
    }
  }
  void announced(int peer) const { f_.wait_send(me_, peer); }

 private:
  const FramedOp& f_;
  std::size_t me_;
};

/// All-reduce by recursive doubling over frames (see doubling_all_reduce in algorithms.hpp for the
/// pattern and the canonical order of operands). `in` null: in place in `out`.
inline void checked_all_reduce(const FramedOp& f, int n, int r, const void* in, void* out, std::size_t count,
                               const ReduceFunc& reduce) {
  std::size_t cur = 0, rcv = 1;
  f.fill(cur, in != nullptr ? in : out);
  int p = 1;
  while (p * 2 <= n) p *= 2;
  auto step = [&](int peer, bool send, bool receive) {
    if (receive) f.post_recv(rcv, peer);
    if (send) f.send(cur, peer);
    if (receive) f.wait_recv(rcv, peer);
    if (send) f.wait_send(cur, peer);
    if (!receive) return;
    // The received frame's fingerprint equals this rank's: it stays valid when the frames swap.
    if (r < peer) {
      reduce(f.payload(cur), f.payload(cur), f.payload(rcv), count);
    } else {
      reduce(f.payload(rcv), f.payload(rcv), f.payload(cur), count);
      std::swap(cur, rcv);
    }
  };
  if (r >= p) {  // folded into rank r - p, which sends the result back
    step(r - p, true, false);
    f.post_recv(rcv, r - p);
    f.wait_recv(rcv, r - p);
    cur = rcv;
  } else {
    const bool host = r < n - p;
    if (host) step(r + p, false, true);
    for (int mask = 1; mask < p; mask <<= 1) step(r ^ mask, true, true);
    if (host) {
      f.send(cur, r + p);
      f.wait_send(cur, r + p);
    }
  }
  copy_bytes(out, f.payload(cur), f.payload_bytes());
}

/// Every rank sends its frame (fingerprint, then `mine`) to every other and receives one from each
/// (one message latency; n-1 messages per rank, hence kCheckedMaxRanks). Frame q holds rank q's;
/// `got(q)` runs once it arrived, checked unless `check` is false (the fingerprint exchange
/// compares every rank's at once).
template <class Got>
void all_to_all_frames(const FramedOp& f, int n, int r, const void* mine, bool check, Got&& got) {
  const auto me = static_cast<std::size_t>(r);
  f.fill(me, mine);
  for (int q = 0; q < n; ++q)
    if (q != r) f.post_recv(static_cast<std::size_t>(q), q);
  for (int q = 0; q < n; ++q)
    if (q != r) f.send(me, q);
  for (int q = 0; q < n; ++q) {
    if (q == r) continue;
    if (check)
      f.wait_recv(static_cast<std::size_t>(q), q);
    else
      f.wait_arrival(static_cast<std::size_t>(q), q);
    got(static_cast<std::size_t>(q));
  }
  for (int q = 0; q < n; ++q)
    if (q != r) f.wait_send(me, q);
}

/// All-gather of payload_bytes() per rank. `in` null: the block already sits in `out`'s slot of
/// this rank. With `out` null nothing is copied out (the barrier: frames without payload).
inline void checked_all_gather(const FramedOp& f, int n, int r, const void* in, void* out) {
  const std::size_t b = f.payload_bytes();
  auto* dst = static_cast<std::byte*>(out);
  const auto me = static_cast<std::size_t>(r);
  const void* mine = in != nullptr ? in : (dst != nullptr ? dst + me * b : nullptr);
  all_to_all_frames(f, n, r, mine, true, [&](std::size_t q) {
    if (dst != nullptr) copy_bytes(dst + q * b, f.payload(q), b);
  });
  if (dst != nullptr && in != nullptr && in != dst + me * b) copy_bytes(dst + me * b, in, b);
}

/// Broadcast of payload_bytes() from `root` to every rank, directly.
inline void checked_broadcast(const FramedOp& f, int n, int r, int root, void* data) {
  if (r == root) {
    f.fill(0, data);
    for (int q = 0; q < n; ++q)
      if (q != root) f.send(0, q);
    for (int q = 0; q < n; ++q)
      if (q != root) f.wait_send(0, q);
    return;
  }
  f.post_recv(0, root);
  f.wait_recv(0, root);
  copy_bytes(data, f.payload(0), f.payload_bytes());
}

/// Gather of payload_bytes() per rank to `root` (`out`: n blocks there), directly.
inline void checked_gather(const FramedOp& f, int n, int r, int root, const void* in, void* out) {
  const std::size_t b = f.payload_bytes();
  if (r != root) {
    f.fill(0, in);
    f.send(0, root);
    f.wait_send(0, root);
    return;
  }
  auto* dst = static_cast<std::byte*>(out);
  for (int q = 0; q < n; ++q)
    if (q != r) f.post_recv(static_cast<std::size_t>(q), q);
  for (int q = 0; q < n; ++q) {
    if (q == r) continue;
    f.wait_recv(static_cast<std::size_t>(q), q);
    copy_bytes(dst + static_cast<std::size_t>(q) * b, f.payload(static_cast<std::size_t>(q)), b);
  }
  const auto* mine = static_cast<const std::byte*>(in);
  if (mine != dst + static_cast<std::size_t>(r) * b) copy_bytes(dst + static_cast<std::size_t>(r) * b, in, b);
}

/// Reduce-scatter of `count` elements (payload_bytes()) per rank: block q of every rank's input
/// goes to rank q directly (one message latency; n-1 messages per rank). Frames 0..n-1 receive
/// from rank q, frames n..2n-1 send to rank q (frame n+r holds this rank's own block, so `out` may
/// alias `in + r*count`). Every rank folds the n blocks of its own in rank order.
inline void checked_reduce_scatter(const FramedOp& f, int n, int r, const void* in, void* out, std::size_t count,
                                   const ReduceFunc& reduce) {
  const std::size_t b = f.payload_bytes();
  const auto* src = static_cast<const std::byte*>(in);
  const auto un = static_cast<std::size_t>(n);
  for (int q = 0; q < n; ++q)
    if (q != r) f.post_recv(static_cast<std::size_t>(q), q);
  for (int q = 0; q < n; ++q) {
    const auto uq = static_cast<std::size_t>(q);
    f.fill(un + uq, src + uq * b);
    if (q != r) f.send(un + uq, q);
  }
  for (int q = 0; q < n; ++q) {
    const auto uq = static_cast<std::size_t>(q);
    const std::byte* block = f.payload(un + static_cast<std::size_t>(r));
    if (q != r) {
      f.wait_recv(uq, q);
      block = f.payload(uq);
    }
    if (q == 0)
      copy_bytes(out, block, b);
    else
      reduce(out, out, block, count);
  }
  for (int q = 0; q < n; ++q)
    if (q != r) f.wait_send(un + static_cast<std::size_t>(q), q);
}

}  // namespace comm::detail::gloo
