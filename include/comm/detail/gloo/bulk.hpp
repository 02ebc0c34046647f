#pragma once
// comm's own algorithms for the messages above the frames' limit (checked.hpp): all_gather,
// broadcast and gather, on gloo's unbound buffers. They replace gloo's collectives of the same
// names so that every wait of an operation goes through the communicator's WaitGate (waits.hpp):
// a dead peer then ends every survivor's operation at once, a send libgloo began writing included.
//
// Messages are cut into segments of kSegmentBytes (reduce_scatter.hpp) where forwarding one can
// start before the next arrives (the ring, the chain, the tree; a 2-rank broadcast goes whole);
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
  /// The same on slot `slot` (a hashed one: hashed_slot).
  RingAllGather(const std::shared_ptr<::gloo::Context>& ctx, std::uint64_t slot, const Deadline& deadline, void* out,
                std::size_t chunk_bytes, std::size_t seg_bytes)
      : n_(ctx->size), r_(ctx->rank), deadline_(deadline), chunk_bytes_(chunk_bytes), seg_{chunk_bytes, seg_bytes} {
    if (n_ == 1 || chunk_bytes == 0) return;
    right_ = (r_ + 1) % n_;
    slot_ = slot;
    buf_ = ctx->createUnboundBuffer(out, static_cast<std::size_t>(n_) * chunk_bytes);
    const int left = (r_ + n_ - 1) % n_;
    for (int s = 1; s < n_; ++s)
      for (std::size_t j = 0; j < seg_.count(); ++j) buf_->recv(left, slot_, chunk_at(s) + seg_.offset(j), seg_.length(j));
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

/// Pipelined chain broadcast: relative rank v receives each segment from v-1 and forwards it to
/// v+1. At 3 ranks it spreads the root's two copies over two ranks (the root sends the message
/// once, the middle rank receives and forwards it in different threads), where the tree's root
/// sends it twice; above, the chain's n-1 hops lose to the tree's log2(n). At 2 ranks nobody
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
  const Segments seg{bytes, n == 2 ? bytes : kSegmentBytes};
  if (prev >= 0) {
    headers.expect(prev);
    for (std::size_t j = 0; j < seg.count(); ++j) buf->recv(prev, slot, seg.offset(j), seg.length(j));
  }
  if (next >= 0) headers.announce(next);
  if (prev >= 0) headers.check(prev);
  std::size_t sends = 0;
  for (std::size_t j = 0; j < seg.count(); ++j) {
    if (prev >= 0) wait_recv(*buf, deadline);
    if (next >= 0) {
      buf->send(next, slot, seg.offset(j), seg.length(j));
      ++sends;
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
  // The children in reverse (the leaf-most first): serving the largest subtree first, as gloo
  // does, measured slower at 4 ranks on the 2-core machine (1.61/1.45 x raw at 1/4 MiB against
  // 1.14/1.19, 4 rounds, benchmarks/RESULTS.md 2026-11-27); why is not established.
  std::vector<int> children;
  for (int m = above; v + m < n; m <<= 1) children.push_back((v + m + root) % n);
  std::reverse(children.begin(), children.end());

  auto buf = ctx->createUnboundBuffer(out, bytes);
  const Segments seg{bytes, kSegmentBytes};
  if (parent >= 0) {
    headers.expect(parent);
    for (std::size_t j = 0; j < seg.count(); ++j) buf->recv(parent, slot, seg.offset(j), seg.length(j));
  }
  for (int c : children) headers.announce(c);
  if (parent >= 0) headers.check(parent);
  std::size_t sends = 0;
  for (std::size_t j = 0; j < seg.count(); ++j) {
    if (parent >= 0) wait_recv(*buf, deadline);
    for (int c : children) {
      buf->send(c, slot, seg.offset(j), seg.length(j));
      ++sends;
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
    headers.announce(root);
    buf->send(root, slot, 0, chunk_bytes);
    headers.announced(root);
    wait_send(*buf, deadline);
    return;
  }
  auto* mine = static_cast<std::byte*>(out) + static_cast<std::size_t>(root) * chunk_bytes;
  if (n == 1 || chunk_bytes == 0) {
    if (mine != in) std::memmove(mine, in, chunk_bytes);
    return;
  }
  auto buf = ctx->createUnboundBuffer(out, static_cast<std::size_t>(n) * chunk_bytes);
  for (int q = 0; q < n; ++q) {
    if (q == root) continue;
    headers.expect(q);
    buf->recv(q, slot, static_cast<std::size_t>(q) * chunk_bytes, chunk_bytes);
  }
  // The root's own chunk is copied while the peers' arrive (its slot is no receive's).
  if (mine != in) std::memmove(mine, in, chunk_bytes);
  for (int q = 0; q < n; ++q)
    if (q != root) headers.check(q);
  for (int i = 1; i < n; ++i) wait_recv(*buf, deadline);
}

}  // namespace comm::detail::gloo
