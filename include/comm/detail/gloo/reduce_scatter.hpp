#pragma once
// Bandwidth-optimal ring reduce-scatter on gloo's unbound buffers.
//
// With n ranks and m elements per output, rank r ends with the reduction of chunk r (elements
// [r*m, (r+1)*m) of every rank's input). In step s = 0..n-2, rank r sends chunk (r-s-1) mod n to
// rank r+1 and receives chunk (r-s-2) mod n from rank r-1, which it reduces with its own copy of
// that chunk; the chunk received in the last step is chunk r, reduced straight into the output.
// Each rank sends and receives (n-1)*m elements: (n-1)/n of its input, the lower bound.
//
// Chunks are cut into segments of kSegmentBytes; the (step, segment) units form one pipeline:
// kRecvDepth receives are always posted ahead (each into its own slot of `tmp`), and a unit's forward send is
// posted as soon as its reduction is done, so the network and the reduction kernel overlap.
// Units go block by block (kBlockSegments segments through every step, then the next block), and
// a block's partial results alternate between two halves of a scratch buffer by step parity; a
// position is only rewritten after the send that read it has completed. The scratch is thus
// kRecvDepth + 2 x kBlockSegments segments (5 MiB) at most, whatever the message size (it used to be two
// whole chunks: 32 MiB kept after one 64 MiB reduce_scatter on 4 ranks).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include <gloo/common/error.h>
#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <comm/detail/base/copy.hpp>
#include <comm/detail/gloo/waits.hpp>

namespace comm::detail::gloo {

/// out = a R b over n elements; `out` may be identical to `a` or `b`.
using ReduceFunc = std::function<void(void*, const void*, const void*, std::size_t)>;

/// Slot prefix for comm's own algorithms (gloo's built-in collectives use 0x01..0x08).
inline constexpr std::uint8_t kRingReduceScatterSlotPrefix = 0x21;
inline constexpr std::uint8_t kRingPartialSlotPrefix = 0x25;
// The same in headed operations (engine.hpp, headed()): hashed from the fingerprint (hashed_slot).
inline constexpr std::uint8_t kHeadedRingInSlotPrefix = 0x31;
inline constexpr std::uint8_t kHeadedRingPartialSlotPrefix = 0x32;
inline constexpr std::size_t kSegmentBytes = std::size_t{512} << 10;
/// Segments that go through all steps together (bounds the scratch: 2 x this many segments).
inline constexpr std::size_t kBlockSegments = 4;
/// Receives posted ahead of the one being reduced. Deeper (4) measured no better on the 2-core
/// machine (benchmarks/RESULTS.md, "Gloo above the frames' limit", 2026-11-27): the ring is
/// CPU-bound there, and more data in flight only moves the same copies around.
inline constexpr std::size_t kRecvDepth = 2;

/// The header messages of comm's algorithms (here and in bulk.hpp): without them (the
/// fingerprints were exchanged first) nothing. With them (HeaderFrames, checked.hpp) each sender
/// announces the operation's fingerprint to each of its receivers, and a receiver checks its
/// sender's before it waits for a byte of payload, which travels on a slot hashed from the
/// fingerprint.
struct NoHeaders {
  void expect(int) const noexcept {}
  void announce(int) const noexcept {}
  void check(int) const noexcept {}
  void announced(int) const noexcept {}
};

/// The headers of an operation made of several exchanges (the ring all_reduce: a ring
/// reduce-scatter, the remainder's exchange with every rank, a ring all-gather): each peer's
/// header is expected and this rank's announced once, up front (`from`, `to`); a peer's is
/// checked before the first wait for its payload; finish() waits for the announcements.
template <class Headers>
class OnceHeaders {
 public:
  OnceHeaders(const Headers& h, int n, const std::vector<int>& from, const std::vector<int>& to)
      : h_(h), to_(to), checked_(static_cast<std::size_t>(n), false) {
    for (int q : from) h_.expect(q);
    for (int q : to_) h_.announce(q);
  }
  void expect(int) const noexcept {}
  void announce(int) const noexcept {}
  void check(int peer) const {
    if (checked_[static_cast<std::size_t>(peer)]) return;
    h_.check(peer);
    checked_[static_cast<std::size_t>(peer)] = true;
  }
  void announced(int) const noexcept {}
  void finish() const {
    for (int q : to_) h_.announced(q);
  }

 private:
  const Headers& h_;
  std::vector<int> to_;
  mutable std::vector<bool> checked_;
};

/// The two slots of a ring reduce-scatter: the first step's messages (from the input) and the
/// partial results'.
struct RingSlots {
  std::uint64_t in, acc;
  /// The slots of operation tag `tag`.
  [[nodiscard]] static RingSlots of_tag(std::uint32_t tag) noexcept {
    return {static_cast<std::uint64_t>(::gloo::Slot::build(kRingReduceScatterSlotPrefix, tag)),
            static_cast<std::uint64_t>(::gloo::Slot::build(kRingPartialSlotPrefix, tag))};
  }
};

/// `in` holds size*count elements of `elem_size` bytes; `out` (count elements) may be exactly
/// `in + rank*count` (in-place). `scratch` is reused across calls (grown as needed).
/// `on_final(offset, bytes)` runs once a segment of `out` holds its final value. With `headers`,
/// this rank announces itself to its right neighbour and checks its left one's before it waits
/// for the first message: every partial result that reaches a rank came through ranks that agree
/// with it.
template <class OnFinal, class Headers = NoHeaders>
void ring_reduce_scatter_hooked(const std::shared_ptr<::gloo::Context>& ctx, RingSlots slots,
                                const Deadline& deadline, const void* in, void* out, std::size_t count,
                                std::size_t elem_size, const ReduceFunc& reduce, std::vector<std::byte>& scratch,
                                OnFinal&& on_final, const Headers& headers = {}) {
  const int n = ctx->size;
  const int r = ctx->rank;
  const std::size_t chunk_bytes = count * elem_size;
  const auto* in_bytes = static_cast<const std::byte*>(in);
  auto* out_bytes = static_cast<std::byte*>(out);
  if (count == 0) return;
  if (n == 1) {
    if (out_bytes != in_bytes) move_bytes(out_bytes, in_bytes, chunk_bytes);
    return;
  }
  const std::size_t seg_elems = std::max<std::size_t>(1, kSegmentBytes / elem_size);
  const std::size_t seg_bytes = seg_elems * elem_size;
  const std::size_t k = (count + seg_elems - 1) / seg_elems;  // segments per chunk
  const std::size_t steps = static_cast<std::size_t>(n - 1);
  const int right = (r + 1) % n;
  const int left = (r + n - 1) % n;
  auto send_chunk = [&](std::size_t s) { return static_cast<std::size_t>((r + 2 * n - 1 - static_cast<int>(s)) % n); };
  auto recv_chunk = [&](std::size_t s) { return static_cast<std::size_t>((r + 2 * n - 2 - static_cast<int>(s)) % n); };
  auto seg_len = [&](std::size_t j) { return std::min(seg_bytes, chunk_bytes - j * seg_bytes); };

  const std::size_t w = std::min(kBlockSegments, k);  // segments per block
  const std::size_t slot_bytes = std::min(seg_bytes, chunk_bytes);
  const std::size_t units = steps * k;
  const std::size_t depth = std::min(kRecvDepth, units);
  const std::size_t acc_bytes = n > 2 ? 2 * w * slot_bytes : 0;
  if (scratch.size() < depth * slot_bytes + acc_bytes) scratch.resize(depth * slot_bytes + acc_bytes);
  std::byte* tmp = scratch.data();
  std::byte* acc = scratch.data() + depth * slot_bytes;

  const std::uint64_t in_slot = slots.in, acc_slot = slots.acc;
  auto in_buf = ctx->createUnboundBuffer(const_cast<std::byte*>(in_bytes), static_cast<std::size_t>(n) * chunk_bytes);
  std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> tmp_buf(depth);
  for (std::size_t i = 0; i < depth; ++i) tmp_buf[i] = ctx->createUnboundBuffer(tmp + i * slot_bytes, slot_bytes);
  std::unique_ptr<::gloo::transport::UnboundBuffer> acc_buf;
  if (acc_bytes > 0) acc_buf = ctx->createUnboundBuffer(acc, acc_bytes);

  struct Unit {
    std::size_t s, j;
  };
  auto unit = [&](std::size_t u) {
    const std::size_t b = u / (steps * w);        // block
    const std::size_t first = b * w;               // its first segment
    const std::size_t bw = std::min(w, k - first);  // its width (the last block may be narrower)
    const std::size_t i = u - b * steps * w;       // index inside the block
    return Unit{i / bw, first + i % bw};
  };
  auto post_recv = [&](std::size_t u) {
    const Unit x = unit(u);
    tmp_buf[u % depth]->recv(left, x.s == 0 ? in_slot : acc_slot, 0, seg_len(x.j));
  };
  auto acc_pos = [&](const Unit& x) { return (x.s % 2) * w * slot_bytes + (x.j % w) * slot_bytes; };

  std::vector<std::size_t> last_reader(2 * w, 0);  // per acc position: 1 + the acc send that read it
  std::size_t in_sends = 0, acc_sends_posted = 0, acc_sends_done = 0;
  headers.expect(left);
  for (std::size_t u = 0; u < depth; ++u) post_recv(u);
  headers.announce(right);
  for (std::size_t j = 0; j < k; ++j, ++in_sends)
    in_buf->send(right, in_slot, send_chunk(0) * chunk_bytes + j * seg_bytes, seg_len(j));
  headers.check(left);

  for (std::size_t u = 0; u < units; ++u) {
    const Unit x = unit(u);
    const std::size_t len = seg_len(x.j);
    wait_recv(*tmp_buf[u % depth], deadline);
    const bool last = x.s + 1 == steps;
    std::byte* dst = last ? out_bytes + x.j * seg_bytes : acc + acc_pos(x);
    if (!last) {
      // The send that last read this position must be done (sends to one peer complete in order).
      const std::size_t need = last_reader[acc_pos(x) / slot_bytes];
      for (; acc_sends_done < need; ++acc_sends_done) wait_send(*acc_buf, deadline);
    }
    reduce(dst, in_bytes + recv_chunk(x.s) * chunk_bytes + x.j * seg_bytes, tmp + (u % depth) * slot_bytes,
           len / elem_size);
    if (u + depth < units) post_recv(u + depth);
    if (!last) {
      acc_buf->send(right, acc_slot, acc_pos(x), len);
      last_reader[acc_pos(x) / slot_bytes] = ++acc_sends_posted;
    } else {
      on_final(x.j * seg_bytes, len);
    }
  }
  headers.announced(right);
  for (; in_sends > 0; --in_sends) wait_send(*in_buf, deadline);
  for (; acc_sends_done < acc_sends_posted; ++acc_sends_done) wait_send(*acc_buf, deadline);
}

template <class Headers = NoHeaders>
void ring_reduce_scatter(const std::shared_ptr<::gloo::Context>& ctx, RingSlots slots, const Deadline& deadline,
                         const void* in, void* out, std::size_t count, std::size_t elem_size,
                         const ReduceFunc& reduce, std::vector<std::byte>& scratch, const Headers& headers = {}) {
  ring_reduce_scatter_hooked(ctx, slots, deadline, in, out, count, elem_size, reduce, scratch,
                             [](std::size_t, std::size_t) {}, headers);
}

}  // namespace comm::detail::gloo
