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
// two receives are always posted ahead (double-buffered in `tmp`), and a unit's forward send is
// posted as soon as its reduction is done, so the network and the reduction kernel overlap.
// Partial results alternate between two halves of a scratch buffer, so a half is only rewritten
// after the send that reads it has completed.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

namespace comm::detail::gloo {

/// out = a R b over n elements; `out` may be identical to `a` or `b`.
using ReduceFunc = std::function<void(void*, const void*, const void*, std::size_t)>;

/// Slot prefix for comm's own algorithms (gloo's built-in collectives use 0x01..0x08).
inline constexpr std::uint8_t kRingReduceScatterSlotPrefix = 0x21;
inline constexpr std::size_t kSegmentBytes = std::size_t{512} << 10;

/// `in` holds size*count elements of `elem_size` bytes; `out` (count elements) may be exactly
/// `in + rank*count` (in-place). `scratch` is reused across calls (grown as needed).
inline void ring_reduce_scatter(const std::shared_ptr<::gloo::Context>& ctx, std::uint32_t tag,
                                std::chrono::milliseconds timeout, const void* in, void* out, std::size_t count,
                                std::size_t elem_size, const ReduceFunc& reduce, std::vector<std::byte>& scratch) {
  const int n = ctx->size;
  const int r = ctx->rank;
  const std::size_t chunk_bytes = count * elem_size;
  const auto* in_bytes = static_cast<const std::byte*>(in);
  auto* out_bytes = static_cast<std::byte*>(out);
  if (count == 0) return;
  if (n == 1) {
    if (out_bytes != in_bytes) std::memmove(out_bytes, in_bytes, chunk_bytes);
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto remaining = [&] {
    return std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                      deadline - std::chrono::steady_clock::now()));
  };

  const std::size_t seg_elems = std::max<std::size_t>(1, kSegmentBytes / elem_size);
  const std::size_t seg_bytes = seg_elems * elem_size;
  const std::size_t k = (count + seg_elems - 1) / seg_elems;  // segments per chunk
  const std::size_t steps = static_cast<std::size_t>(n - 1);
  const std::size_t units = steps * k;
  const int right = (r + 1) % n;
  const int left = (r + n - 1) % n;
  auto send_chunk = [&](std::size_t s) { return static_cast<std::size_t>((r + 2 * n - 1 - static_cast<int>(s)) % n); };
  auto recv_chunk = [&](std::size_t s) { return static_cast<std::size_t>((r + 2 * n - 2 - static_cast<int>(s)) % n); };
  auto seg_len = [&](std::size_t j) { return std::min(seg_bytes, chunk_bytes - j * seg_bytes); };

  // scratch: [ tmp: 2 segments | acc: 2 chunks (only when there are intermediate steps) ]
  const std::size_t acc_halves = n > 2 ? 2 : 0;
  const std::size_t tmp_bytes = 2 * std::min(seg_bytes, chunk_bytes);
  if (scratch.size() < tmp_bytes + acc_halves * chunk_bytes) scratch.resize(tmp_bytes + acc_halves * chunk_bytes);
  std::byte* tmp = scratch.data();
  std::byte* acc = scratch.data() + tmp_bytes;
  const std::size_t tmp_half = tmp_bytes / 2;

  const auto slot = static_cast<std::uint64_t>(::gloo::Slot::build(kRingReduceScatterSlotPrefix, tag));
  auto in_buf = ctx->createUnboundBuffer(const_cast<std::byte*>(in_bytes), static_cast<std::size_t>(n) * chunk_bytes);
  auto tmp_buf = ctx->createUnboundBuffer(tmp, tmp_bytes);
  std::unique_ptr<::gloo::transport::UnboundBuffer> acc_buf;
  if (acc_halves > 0) acc_buf = ctx->createUnboundBuffer(acc, acc_halves * chunk_bytes);

  auto post_recv = [&](std::size_t u) { tmp_buf->recv(left, slot, (u % 2) * tmp_half, seg_len(u % k)); };
  std::size_t in_sends = 0, acc_sends_posted = 0, acc_sends_done = 0;

  // Step 0 forwards this rank's own input: no dependency, post it all.
  for (std::size_t u = 0; u < std::min<std::size_t>(2, units); ++u) post_recv(u);
  for (std::size_t j = 0; j < k; ++j, ++in_sends) in_buf->send(right, slot, send_chunk(0) * chunk_bytes + j * seg_bytes, seg_len(j));

  for (std::size_t u = 0; u < units; ++u) {
    const std::size_t s = u / k;
    const std::size_t j = u % k;
    const std::size_t len = seg_len(j);
    tmp_buf->waitRecv(remaining());
    const bool last = s + 1 == steps;
    std::byte* dst = last ? out_bytes + j * seg_bytes : acc + (s % 2) * chunk_bytes + j * seg_bytes;
    if (!last && s >= 2) {
      // dst was sent forward in unit u-k (acc send number u-2k); that send must be done.
      while (acc_sends_done < u - 2 * k + 1) {
        acc_buf->waitSend(remaining());
        ++acc_sends_done;
      }
    }
    reduce(dst, in_bytes + recv_chunk(s) * chunk_bytes + j * seg_bytes, tmp + (u % 2) * tmp_half, len / elem_size);
    if (u + 2 < units) post_recv(u + 2);
    if (!last) {
      acc_buf->send(right, slot, (s % 2) * chunk_bytes + j * seg_bytes, len);
      ++acc_sends_posted;
    }
  }
  for (; in_sends > 0; --in_sends) in_buf->waitSend(remaining());
  for (; acc_sends_done < acc_sends_posted; ++acc_sends_done) acc_buf->waitSend(remaining());
}

}  // namespace comm::detail::gloo
