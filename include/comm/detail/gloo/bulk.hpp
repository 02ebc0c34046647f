#pragma once
// comm's own algorithms for the messages above the frames' limit (checked.hpp): all_gather,
// broadcast and gather, on gloo's unbound buffers. They replace gloo's collectives of the same
// names so that every wait of an operation goes through the communicator's WaitGate (waits.hpp):
// a dead peer then ends every survivor's operation at once, a send libgloo began writing included.
//
// Messages are cut into segments (forward_segment: quarters, at least kSegmentBytes) where
// forwarding one can start before the next arrives (the ring, the chain, the tree; a 2-rank
// broadcast goes whole);
// every receive is posted up front, so no sender waits for a receive-ready notice, and gloo
// completes one slot's messages from one peer in the order they were posted.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <comm/detail/base/copy.hpp>
#include <comm/detail/gloo/reduce_scatter.hpp>
#include <comm/detail/gloo/waits.hpp>

namespace comm::detail::gloo {

inline constexpr std::uint8_t kRingAllGatherSlotPrefix = 0x28;
inline constexpr std::uint8_t kTreeBroadcastSlotPrefix = 0x29;
inline constexpr std::uint8_t kDirectGatherSlotPrefix = 0x2a;
// The same algorithms with header frames: their payload slots are hashed (hashed_slot), not tagged.
inline constexpr std::uint8_t kHeadedBroadcastSlotPrefix = 0x2d;
inline constexpr std::uint8_t kHeadedGatherSlotPrefix = 0x2e;
inline constexpr std::uint8_t kHeadedAllGatherSlotPrefix = 0x2f;

/// `bytes` cut into segments of at most `size` bytes.
struct Segments {
  std::size_t bytes;
  std::size_t size = kSegmentBytes;
  [[nodiscard]] std::size_t count() const noexcept { return (bytes + size - 1) / size; }
  [[nodiscard]] std::size_t offset(std::size_t j) const noexcept { return j * size; }
  [[nodiscard]] std::size_t length(std::size_t j) const noexcept { return std::min(size, bytes - j * size); }
};

/// The segment size of a message that ranks forward as it arrives (the chain, the tree, the
/// all-gather ring): a quarter of it, at least kSegmentBytes. Every segment costs a message, the
/// receiver's ready notice and a wake-up of the forwarding thread; with three or four ranks on two
/// cores, 512 KiB segments made a 16 MiB broadcast 1.11-1.16x raw gloo's whole messages, quarters
/// 0.97-1.02x (benchmarks/RESULTS.md, 2026-11-28). Four segments keep most of what the pipeline
/// gains where links are the limit: a forward starts after a quarter of the message.
[[nodiscard]] constexpr std::size_t forward_segment(std::size_t bytes) noexcept {
  constexpr std::size_t kPage = 4096;
  return std::max(kSegmentBytes, (bytes / 4 + kPage - 1) / kPage * kPage);
}

/// A slot of `prefix` (gloo's Slot layout: the top byte) whose lower 56 bits hash the 32 bytes at
/// `what` (a fingerprint, a point-to-point header): ranks that agree about them meet on it, a rank
/// that does not sends where no receive of the others waits (but for a 2^-56 chance).
[[nodiscard]] inline std::uint64_t hashed_slot(std::uint8_t prefix, const void* what) noexcept {
  std::uint64_t words[4];
  std::memcpy(words, what, sizeof(words));
  std::uint64_t x = 0x9e3779b97f4a7c15ull;
  for (std::uint64_t w : words) {  // splitmix64's finalizer over each word in turn
    x ^= w;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    x ^= x >> 31;
  }
  return (static_cast<std::uint64_t>(prefix) << 56) | (x & ((std::uint64_t{1} << 56) - 1));
}

/// RingAllGather's default `after_first`: nothing to post.
struct NoHook {
  void operator()() const noexcept {}
};

/// Ring all-gather in place: `out` holds n chunks of `chunk_bytes`, this rank's already in its
/// slot. In step s, rank r forwards chunk (r-s) mod n to rank r+1 and receives chunk (r-s-1) mod n
/// from rank r-1, segment by segment: (n-1)/n of the output in and out of each rank.
/// Constructing it posts every receive; send_own_through() sends this rank's chunk (step 0) as far
/// as it is ready, run() sends the rest of it, forwards, and waits for everything. (Sending the
/// chunk behind an all_reduce's reduce-scatter, segment by segment, measured no faster on 2 cores:
/// benchmarks/RESULTS.md, 2026-11-27.)
class RingAllGather {
 public:
  RingAllGather(const std::shared_ptr<::gloo::Context>& ctx, std::uint32_t tag, const Deadline& deadline, void* out,
                std::size_t chunk_bytes, std::size_t seg_bytes)
      : RingAllGather(ctx, static_cast<std::uint64_t>(::gloo::Slot::build(kRingAllGatherSlotPrefix, tag)), deadline,
                      out, chunk_bytes, seg_bytes) {}
  /// The same on slot `slot` (a hashed one: hashed_slot). `after_first` runs once the first
  /// receive is posted (where a header's goes: post_headed_recvs).
  template <class AfterFirst = NoHook>
  RingAllGather(const std::shared_ptr<::gloo::Context>& ctx, std::uint64_t slot, const Deadline& deadline, void* out,
                std::size_t chunk_bytes, std::size_t seg_bytes, const AfterFirst& after_first = {})
      : n_(ctx->size), r_(ctx->rank), deadline_(deadline), chunk_bytes_(chunk_bytes), seg_{chunk_bytes, seg_bytes} {
    if (n_ == 1 || chunk_bytes == 0) return;
    right_ = (r_ + 1) % n_;
    slot_ = slot;
    buf_ = ctx->createUnboundBuffer(out, static_cast<std::size_t>(n_) * chunk_bytes);
    const int left = (r_ + n_ - 1) % n_;
    for (int s = 1; s < n_; ++s)
      for (std::size_t j = 0; j < seg_.count(); ++j) {
        buf_->recv(left, slot_, chunk_at(s) + seg_.offset(j), seg_.length(j));
        if (s == 1 && j == 0) after_first();
      }
  }

  /// Sends, in order, this rank's segments that start before byte `end` of its chunk.
  void send_own_through(std::size_t end) {
    if (!buf_) return;
    for (; own_sent_ < seg_.count() && seg_.offset(own_sent_) < end; ++own_sent_, ++sends_)
      buf_->send(right_, slot_, chunk_at(0) + seg_.offset(own_sent_), seg_.length(own_sent_));
  }

  void run() {
    if (!buf_) return;
    send_own_through(chunk_bytes_);
    for (int s = 1; s < n_; ++s) {
      for (std::size_t j = 0; j < seg_.count(); ++j) {
        wait_recv(*buf_, deadline_);
        // The chunk received in step s is the one forwarded in step s+1, except the last.
        if (s + 1 < n_) {
          buf_->send(right_, slot_, chunk_at(s) + seg_.offset(j), seg_.length(j));
          ++sends_;
        }
      }
    }
    for (; sends_ > 0; --sends_) wait_send(*buf_, deadline_);
  }

 private:
  [[nodiscard]] std::size_t chunk_at(int s) const noexcept {
    return static_cast<std::size_t>((r_ - s + 2 * n_) % n_) * chunk_bytes_;
  }
  int n_, r_, right_ = 0;
  const Deadline& deadline_;
  std::size_t chunk_bytes_;
  Segments seg_;
  std::uint64_t slot_ = 0;
  std::unique_ptr<::gloo::transport::UnboundBuffer> buf_;
  std::size_t own_sent_ = 0, sends_ = 0;
};

/// Posts the receives of `seg` from `peer`, with the header's right behind the first segment's:
/// the sender sends its header right behind its first segment too. On gloo's pairs a peer's
/// messages arrive in the order they were sent, and a sender holds each until the receiver's
/// notice for it has come (the notices travel in the order the receives were posted), so the
/// header lands after the first segment whoever is ahead: the wait for the header is the only
/// wake-up before the first segment can be used, where the header first cost two. A sender that
/// disagrees sends its payload to a slot nobody posted (it stays with the sender), and its header
/// still arrives at once: the check raises the DesyncError without waiting for the payload.
/// (With comm's direct connections the header travels apart from the payload and is read by the
/// waiting thread itself; the order does not matter there.)
template <class Headers>
void post_headed_recvs(::gloo::transport::UnboundBuffer& buf, std::uint64_t slot, const Segments& seg, int peer,
                       const Headers& headers) {
  for (std::size_t j = 0; j < seg.count(); ++j) {
    buf.recv(peer, slot, seg.offset(j), seg.length(j));
    if (j == 0) headers.expect(peer);
  }
}

/// Pipelined chain broadcast: relative rank v receives each segment from v-1 and forwards it to
/// v+1. Every rank sends the message at most once, where the tree's root sends it log2(n) times;
/// the pipeline fills in n-1 hops of a segment, which the quarters (forward_segment) make long
/// above a few ranks, so the engine takes the chain at 3 and 4 ranks and the tree above. At 4
/// ranks on the 2-core machine: 1.00 / 1.02 / 1.02x raw gloo at 1 / 4 / 16 MiB against the tree's
/// 1.03 / 1.06 / 1.04x (16 rounds, benchmarks/RESULTS.md 2026-11-28). At 2 ranks nobody
/// forwards, and the message goes whole, as gloo's own broadcast sends it: segments there only add
/// messages (a receive-ready notice, a send and a wakeup each). Measured on the loaded 2-core
/// machine: 0-9 % less CPU time at 4 MiB, wall time within the noise (benchmarks/RESULTS.md,
/// "Gloo above the frames' limit", 2026-11-27, last subsection).
template <class Headers = NoHeaders>
void chain_broadcast(const std::shared_ptr<::gloo::Context>& ctx, std::uint64_t slot, const Deadline& deadline,
                     void* out, std::size_t bytes, int root, const Headers& headers = {}) {
  const int n = ctx->size;
  const int r = ctx->rank;
  if (n == 1 || bytes == 0) return;
  const int v = (r - root + n) % n;
  const int prev = v == 0 ? -1 : (r + n - 1) % n;
  const int next = v + 1 < n ? (r + 1) % n : -1;
  auto buf = ctx->createUnboundBuffer(out, bytes);
  const Segments seg{bytes, n == 2 ? bytes : forward_segment(bytes)};
  if (prev >= 0) post_headed_recvs(*buf, slot, seg, prev, headers);
  if (prev >= 0) headers.check(prev);
  std::size_t sends = 0;
  for (std::size_t j = 0; j < seg.count(); ++j) {
    if (prev >= 0) wait_recv(*buf, deadline);
    if (next >= 0) {
      buf->send(next, slot, seg.offset(j), seg.length(j));
      ++sends;
      if (j == 0) headers.announce(next);
    }
  }
  if (next >= 0) headers.announced(next);
  for (; sends > 0; --sends) wait_send(*buf, deadline);
}

/// Binomial-tree broadcast of `bytes` from `root`, segment by segment: a rank forwards a segment
/// to its children as soon as it has it.
template <class Headers = NoHeaders>
void tree_broadcast(const std::shared_ptr<::gloo::Context>& ctx, std::uint64_t slot, const Deadline& deadline,
                    void* out, std::size_t bytes, int root, const Headers& headers = {}) {
  const int n = ctx->size;
  const int r = ctx->rank;
  if (n == 1 || bytes == 0) return;
  // Ranks relative to the root: v's parent is v without its highest bit, its children v + m for
  // every power of two m above v.
  const int v = (r - root + n) % n;
  int above = 1;
  while (above <= v) above <<= 1;
  const int parent = v == 0 ? -1 : (v - above / 2 + root) % n;
  // The children nearest the root first (the largest subtree: a forwarder gets its data before
  // the leaves), as gloo does. With 512 KiB segments the leaf-most first had measured faster at 4
  // ranks on the 2-core machine (1.14/1.19x raw at 1/4 MiB against 1.61/1.45, 4 rounds,
  // 2026-11-27); with quarters and the header behind the first segment it is the slower one
  // (1.05/1.05x against 0.99/1.03, 16 rounds, benchmarks/RESULTS.md 2026-11-28).
  std::vector<int> children;
  for (int m = above; v + m < n; m <<= 1) children.push_back((v + m + root) % n);

  auto buf = ctx->createUnboundBuffer(out, bytes);
  const Segments seg{bytes, forward_segment(bytes)};
  if (parent >= 0) post_headed_recvs(*buf, slot, seg, parent, headers);
  if (parent >= 0) headers.check(parent);
  std::size_t sends = 0;
  for (std::size_t j = 0; j < seg.count(); ++j) {
    if (parent >= 0) wait_recv(*buf, deadline);
    for (int c : children) {
      buf->send(c, slot, seg.offset(j), seg.length(j));
      ++sends;
      if (j == 0) headers.announce(c);
    }
  }
  for (int c : children) headers.announced(c);
  for (; sends > 0; --sends) wait_send(*buf, deadline);
}

/// Gather to `root`: every rank sends its `chunk_bytes` straight to the root's slot for it.
/// `out` is read at the root only.
template <class Headers = NoHeaders>
void direct_gather(const std::shared_ptr<::gloo::Context>& ctx, std::uint64_t slot, const Deadline& deadline,
                   const void* in, void* out, std::size_t chunk_bytes, int root, const Headers& headers = {}) {
  const int n = ctx->size;
  const int r = ctx->rank;
  if (r != root) {
    if (chunk_bytes == 0) return;
    auto buf = ctx->createUnboundBuffer(const_cast<void*>(in), chunk_bytes);
    buf->send(root, slot, 0, chunk_bytes);
    headers.announce(root);  // behind the payload: see post_headed_recvs
    headers.announced(root);
    wait_send(*buf, deadline);
    return;
  }
  auto* mine = static_cast<std::byte*>(out) + static_cast<std::size_t>(root) * chunk_bytes;
  if (n == 1 || chunk_bytes == 0) {
    if (mine != in) move_bytes(mine, in, chunk_bytes);
    return;
  }
  auto buf = ctx->createUnboundBuffer(out, static_cast<std::size_t>(n) * chunk_bytes);
  for (int q = 0; q < n; ++q) {
    if (q == root) continue;
    buf->recv(q, slot, static_cast<std::size_t>(q) * chunk_bytes, chunk_bytes);
    headers.expect(q);
  }
  // The root's own chunk is copied while the peers' arrive (its slot is no receive's).
  if (mine != in) move_bytes(mine, in, chunk_bytes);
  for (int q = 0; q < n; ++q)
    if (q != root) headers.check(q);
  for (int i = 1; i < n; ++i) wait_recv(*buf, deadline);
}

}  // namespace comm::detail::gloo
