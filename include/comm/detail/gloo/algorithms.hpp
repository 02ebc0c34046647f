#pragma once
// all_reduce and reduce_scatter: which algorithm runs, and comm's own latency-bound ones.
//
// Measured on the project's 2-core machine (benchmarks/analysis.md, section 5), gloo's ring
// all_reduce costs 2(n-1) message latencies plus a recv-ready handshake per message; for small
// buffers the number of latencies is what counts:
//   - 2 ranks, up to `exchange_max` bytes: one exchange of the whole buffer (1 latency instead of 2
//     ring steps, the same bytes on the wire);
//   - more ranks, up to `doubling_max` bytes: recursive doubling (log2(n) exchanges of the whole
//     buffer; a non-power-of-two world folds its extra ranks in first and out at the end);
//   - above: comm's ring (bandwidth-optimal; ring_all_reduce).
// reduce_scatter: recursive halving (log2(n) steps, the data halves every step) up to
// `halving_max` bytes per rank's input when the world is a power of two, else comm's ring
// (reduce_scatter.hpp).
//
// Every rank must compute bit-identical results (min/max of a NaN or of -0/+0 are not symmetric),
// so each combination is evaluated in one canonical order, lower rank's operand first, on both
// sides of an exchange.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <gloo/common/error.h>
#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <comm/detail/base/copy.hpp>
#include <comm/detail/base/env.hpp>
#include <comm/detail/gloo/bulk.hpp>
#include <comm/detail/gloo/reduce_scatter.hpp>
#include <comm/detail/gloo/waits.hpp>
#include <comm/error.hpp>

namespace comm::detail::gloo {

/// Thresholds of the algorithm choice, in bytes of one rank's buffer (0 disables an algorithm).
struct AlgorithmConfig {
  // At 2 ranks an exchange moves the same bytes as the ring (the whole buffer each way) in one
  // latency instead of two ring steps; measured better up to 256 KiB (benchmarks/analysis.md).
  std::size_t exchange_max = std::size_t{256} << 10;  // all_reduce, 2 ranks
  std::size_t doubling_max = std::size_t{256} << 10;  // all_reduce, > 2 ranks
  std::size_t halving_max = std::size_t{1} << 20;     // reduce_scatter input, power-of-two worlds
};

/// Defaults, overridden by COMM_GLOO_ALLREDUCE_SMALL (bytes up to which all_reduce uses the
/// exchange / recursive doubling; 0: always the ring) and COMM_GLOO_RS_HALVING_MAX.
[[nodiscard]] inline AlgorithmConfig algorithm_config_default() {
  AlgorithmConfig c;
  if (const auto v = env_nonneg_int("COMM_GLOO_ALLREDUCE_SMALL")) c.exchange_max = c.doubling_max = static_cast<std::size_t>(*v);
  if (const auto v = env_nonneg_int("COMM_GLOO_RS_HALVING_MAX")) c.halving_max = static_cast<std::size_t>(*v);
  return c;
}

/// Reusable buffers of comm's algorithms (operations of a communicator run one at a time).
using Scratch = std::vector<std::byte>;

inline constexpr std::uint8_t kExchangeSlotPrefix = 0x23;
inline constexpr std::uint8_t kHalvingSlotPrefix = 0x24;
// The same in headed operations (engine.hpp, headed()): hashed from the fingerprint (hashed_slot).
inline constexpr std::uint8_t kHeadedHalvingSlotPrefix = 0x30;
inline constexpr std::uint8_t kHeadedExchangeSlotPrefix = 0x33;

[[nodiscard]] inline std::byte* scratch_bytes(Scratch& s, std::size_t n) {
  if (s.size() < n) s.resize(n);
  return s.data();
}

/// The slot of recursive doubling for operation tag `tag`.
[[nodiscard]] inline std::uint64_t doubling_slot(std::uint32_t tag) noexcept {
  return static_cast<std::uint64_t>(::gloo::Slot::build(kExchangeSlotPrefix, tag));
}

/// The ranks that recursive doubling exchanges with (it sends to and receives from the same).
[[nodiscard]] inline std::vector<int> doubling_peers(int n, int r) {
  std::vector<int> peers;
  int p = 1;
  while (p * 2 <= n) p *= 2;
  if (r >= p) {
    peers.push_back(r - p);
    return peers;
  }
  if (r < n - p) peers.push_back(r + p);
  for (int mask = 1; mask < p; mask <<= 1) peers.push_back(r ^ mask);
  return peers;
}

/// All-reduce by recursive doubling (an exchange of the whole buffer with rank r ^ 2^k in step k);
/// at 2 ranks that is the single exchange. `in` null: in place in `out`. With `headers`, a
/// peer's is checked before this rank waits for its message (OnceHeaders announced it).
template <class Headers = NoHeaders>
void doubling_all_reduce(const std::shared_ptr<::gloo::Context>& ctx, std::uint64_t slot, const Deadline& deadline,
                         const void* in, void* out, std::size_t bytes, std::size_t elem_size,
                         const ReduceFunc& reduce, Scratch& scratch, const Headers& headers = {}) {
  const int n = ctx->size;
  const int r = ctx->rank;
  const std::size_t count = bytes / elem_size;
  if (in != nullptr && in != out) copy_bytes(out, in, bytes);
  if (n == 1) return;
  int p = 1;
  while (p * 2 <= n) p *= 2;
  // Two buffers change roles: `cur` holds this rank's partial result, the other receives the
  // peer's. The higher rank of a pair combines into the received buffer (lower operand first),
  // which then becomes `cur`.
  std::byte* recv = scratch_bytes(scratch, bytes);
  std::byte* bufs[2] = {static_cast<std::byte*>(out), recv};
  std::unique_ptr<::gloo::transport::UnboundBuffer> ubufs[2] = {ctx->createUnboundBuffer(out, bytes),
                                                                ctx->createUnboundBuffer(recv, bytes)};
  int ci = 0;
  int ri = 1;
  auto step = [&](int peer, bool send, bool receive) {
    if (receive) ubufs[ri]->recv(peer, slot, 0, bytes);
    if (send) ubufs[ci]->send(peer, slot, 0, bytes);
    if (receive) {
      headers.check(peer);
      wait_recv(*ubufs[ri], deadline);
    }
    if (send) wait_send(*ubufs[ci], deadline);
    if (!receive) return;
    if (r < peer) {
      reduce(bufs[ci], bufs[ci], bufs[ri], count);
    } else {
      reduce(bufs[ri], bufs[ri], bufs[ci], count);
      std::swap(ci, ri);
    }
  };

  const bool extra = r >= p;        // folded into rank r - p
  const bool host = r < n - p;      // hosts extra rank r + p
  if (extra) {
    step(r - p, true, false);
    // The final result comes back from r - p.
    ubufs[ri]->recv(r - p, slot, 0, bytes);
    headers.check(r - p);
    wait_recv(*ubufs[ri], deadline);
    ci = ri;
  } else {
    if (host) step(r + p, false, true);
    for (int mask = 1; mask < p; mask <<= 1) step(r ^ mask, true, true);
    if (host) {
      ubufs[ci]->send(r + p, slot, 0, bytes);
      wait_send(*ubufs[ci], deadline);
    }
  }
  if (ci != 0) copy_bytes(out, bufs[ci], bytes);
}

/// The slots of an all_reduce: tagged, or (headed) hashed from the fingerprint. The ring's
/// remainder exchange uses the doubling slot (an operation runs one algorithm or the other).
struct ArSlots {
  std::uint64_t doubling;
  RingSlots reduce_scatter;
  std::uint64_t all_gather;
  [[nodiscard]] static ArSlots of_tag(std::uint32_t tag) noexcept {
    return {doubling_slot(tag), RingSlots::of_tag(tag),
            static_cast<std::uint64_t>(::gloo::Slot::build(kRingAllGatherSlotPrefix, tag))};
  }
};

/// The last `rest` (< n) elements of an all_reduce that the ring's equal chunks leave over:
/// every rank sends its copy to every other and folds all n in rank order (so every rank's
/// result is bit-identical). Posted before the ring and finished after its reduce-scatter, the
/// exchange rides along with the ring: recursive doubling of the remainder instead cost its
/// log2(n) latencies after it, three at 3 ranks (1.11-1.14x raw gloo at 1 MiB, 0.88-0.90x at a
/// count the ranks divide; benchmarks/RESULTS.md, 2026-11-28).
class RemainderExchange {
 public:
  RemainderExchange(const std::shared_ptr<::gloo::Context>& ctx, std::uint64_t slot, std::byte* tail,
                    std::size_t bytes)
      : n_(ctx->size), r_(ctx->rank), tail_(tail), bytes_(bytes), copies_(static_cast<std::size_t>(n_) * bytes) {
    copy_bytes(copies_.data() + static_cast<std::size_t>(r_) * bytes, tail, bytes);
    buf_ = ctx->createUnboundBuffer(copies_.data(), copies_.size());
    for (int q = 0; q < n_; ++q)
      if (q != r_) buf_->recv(q, slot, static_cast<std::size_t>(q) * bytes, bytes);
    for (int q = 0; q < n_; ++q)
      if (q != r_) buf_->send(q, slot, static_cast<std::size_t>(r_) * bytes, bytes);
  }

  template <class Headers>
  void finish(const Deadline& deadline, std::size_t elem_size, const ReduceFunc& reduce, const Headers& headers) {
    for (int q = 0; q < n_; ++q)
      if (q != r_) headers.check(q);
    for (int i = 1; i < n_; ++i) wait_recv(*buf_, deadline);
    for (int i = 1; i < n_; ++i) wait_send(*buf_, deadline);
    copy_bytes(tail_, copies_.data(), bytes_);
    for (int q = 1; q < n_; ++q)
      reduce(tail_, tail_, copies_.data() + static_cast<std::size_t>(q) * bytes_, bytes_ / elem_size);
  }

 private:
  int n_, r_;
  std::byte* tail_;
  std::size_t bytes_;
  std::vector<std::byte> copies_;
  std::unique_ptr<::gloo::transport::UnboundBuffer> buf_;
};

/// Bandwidth-optimal all_reduce: comm's ring reduce-scatter of the first n*floor(count/n)
/// elements in place (rank r ends with chunk r reduced), the remainder (fewer than n elements) by
/// an exchange that travels with it (RemainderExchange), then a ring all-gather of the chunks.
/// 2(n-1)/n of the buffer in and out of each rank, and every wait on the communicator's gate
/// (gloo's own ring would not be woken when a peer dies mid-send: waits.hpp). With `headers`
/// (OnceHeaders: the left neighbour, and every rank when there is a remainder), the all-gather
/// needs no check of its own: its receives are posted after the reduce-scatter checked the left
/// neighbour, the only rank that sends to this one.
template <class Headers = NoHeaders>
void ring_all_reduce(const std::shared_ptr<::gloo::Context>& ctx, const ArSlots& slots, const Deadline& deadline,
                     const void* in, void* out, std::size_t count, std::size_t elem_size, const ReduceFunc& reduce,
                     Scratch& scratch, const Headers& headers = {}) {
  const auto n = static_cast<std::size_t>(ctx->size);
  auto* o = static_cast<std::byte*>(out);
  if (in != nullptr && in != out) copy_bytes(out, in, count * elem_size);
  const std::size_t m = count / n;
  const std::size_t chunk = m * elem_size;
  const std::size_t rest = count - n * m;
  std::optional<RemainderExchange> tail;
  if (rest > 0) tail.emplace(ctx, slots.doubling, o + n * chunk, rest * elem_size);
  if (m > 0)
    ring_reduce_scatter(ctx, slots.reduce_scatter, deadline, o, o + static_cast<std::size_t>(ctx->rank) * chunk, m,
                        elem_size, reduce, scratch, headers);
  if (tail) tail->finish(deadline, elem_size, reduce, headers);
  if (m > 0) {
    RingAllGather ag(ctx, slots.all_gather, deadline, o, chunk, kSegmentBytes);
    ag.run();
  }
}

inline constexpr std::uint8_t kRingReduceGatherSlotPrefix = 0x2b;

/// Reduce to `root`, bandwidth-optimal: comm's ring reduce-scatter of the first n*floor(count/n)
/// elements, each rank sending every segment of its reduced chunk to the root as soon as it is
/// final (the root's receives are posted before the ring starts); the remainder (fewer than n
/// elements) by recursive doubling. Each rank sends (n-1)/n of its input in the ring plus 1/n to
/// the root, where an all_reduce would send 2(n-1)/n. `out` is written at the root only;
/// `chunk_scratch` holds a non-root's chunk (1/n of the input), reused across calls.
inline void ring_reduce(const std::shared_ptr<::gloo::Context>& ctx, std::uint32_t tag, const Deadline& deadline,
                        const void* in, void* out, std::size_t count, std::size_t elem_size,
                        const ReduceFunc& reduce, int root, Scratch& scratch, Scratch& chunk_scratch) {
  const auto n = static_cast<std::size_t>(ctx->size);
  const int r = ctx->rank;
  const std::size_t m = count / n;
  const std::size_t chunk = m * elem_size;
  const std::size_t rest_bytes = (count - n * m) * elem_size;
  const auto* src = static_cast<const std::byte*>(in);
  const bool is_root = r == root;
  std::byte* mine = is_root ? static_cast<std::byte*>(out) + static_cast<std::size_t>(r) * chunk
                            : scratch_bytes(chunk_scratch, chunk + rest_bytes);
  std::byte* rest_out = is_root ? static_cast<std::byte*>(out) + n * chunk : mine + chunk;
  const auto slot = static_cast<std::uint64_t>(::gloo::Slot::build(kRingReduceGatherSlotPrefix, tag));
  const Segments seg{chunk, std::max<std::size_t>(1, kSegmentBytes / elem_size) * elem_size};
  std::unique_ptr<::gloo::transport::UnboundBuffer> buf;
  std::size_t pending = 0;  // the root's receives, or a non-root's sends
  if (m > 0) {
    if (is_root) {
      buf = ctx->createUnboundBuffer(out, n * chunk);
      for (std::size_t q = 0; q < n; ++q) {
        if (static_cast<int>(q) == r) continue;
        for (std::size_t j = 0; j < seg.count(); ++j, ++pending)
          buf->recv(static_cast<int>(q), slot, q * chunk + seg.offset(j), seg.length(j));
      }
    } else {
      buf = ctx->createUnboundBuffer(mine, chunk);
    }
    ring_reduce_scatter_hooked(ctx, RingSlots::of_tag(tag), deadline, src, mine, m, elem_size, reduce, scratch,
                               [&](std::size_t off, std::size_t len) {
                                 if (is_root) return;
                                 buf->send(root, slot, off, len);
                                 ++pending;
                               });
  }
  if (rest_bytes > 0)
    doubling_all_reduce(ctx, doubling_slot(tag), deadline, src + n * chunk, rest_out, rest_bytes, elem_size, reduce,
                        scratch);
  for (; pending > 0; --pending) {
    if (is_root)
      wait_recv(*buf, deadline);
    else
      wait_send(*buf, deadline);
  }
}

/// all_reduce's algorithms. Each rank picks by its own settings (COMM_GLOO_ALLREDUCE_SMALL); a
/// headed operation puts the pick in its fingerprint, so ranks that pick differently disagree.
enum class ArAlgorithm : std::uint32_t { doubling = 1, ring = 2 };

[[nodiscard]] inline ArAlgorithm ar_algorithm(int n, std::size_t bytes, const AlgorithmConfig& cfg) noexcept {
  return n == 1 || bytes <= (n == 2 ? cfg.exchange_max : cfg.doubling_max) ? ArAlgorithm::doubling : ArAlgorithm::ring;
}

/// all_reduce of `count` elements by `algo`: `in` null means in place in `out`. With `headers`
/// (HeaderFrames), every rank this one receives from is expected and this rank announced to every
/// one it sends to, once (OnceHeaders): the left neighbour and the doubling peers.
template <class Headers = NoHeaders>
void run_all_reduce(const std::shared_ptr<::gloo::Context>& ctx, ArAlgorithm algo, const ArSlots& slots,
                    const Deadline& deadline, const void* in, void* out, std::size_t count, std::size_t elem_size,
                    const ReduceFunc& reduce, Scratch& scratch, const Headers& headers = {}) {
  const std::size_t bytes = count * elem_size;
  if constexpr (std::is_same_v<Headers, NoHeaders>) {
    if (algo == ArAlgorithm::doubling)
      doubling_all_reduce(ctx, slots.doubling, deadline, in, out, bytes, elem_size, reduce, scratch);
    else
      ring_all_reduce(ctx, slots, deadline, in, out, count, elem_size, reduce, scratch);
  } else {
    const int n = ctx->size;
    const int r = ctx->rank;
    std::vector<int> from, to;
    auto add = [](std::vector<int>& v, int q) {
      if (std::find(v.begin(), v.end(), q) == v.end()) v.push_back(q);
    };
    const bool ring = algo == ArAlgorithm::ring;
    if (ring && count >= static_cast<std::size_t>(n)) {
      add(from, (r + n - 1) % n);
      add(to, (r + 1) % n);
    }
    if (ring && count % static_cast<std::size_t>(n) != 0)  // the remainder goes to and from every rank
      for (int q = 0; q < n; ++q)
        if (q != r) {
          add(from, q);
          add(to, q);
        }
    if (!ring)
      for (int q : doubling_peers(n, r)) {
        add(from, q);
        add(to, q);
      }
    const OnceHeaders<Headers> once(headers, n, from, to);
    if (!ring)
      doubling_all_reduce(ctx, slots.doubling, deadline, in, out, bytes, elem_size, reduce, scratch, once);
    else
      ring_all_reduce(ctx, slots, deadline, in, out, count, elem_size, reduce, scratch, once);
    once.finish();
  }
}

/// Reduce-scatter by recursive halving (power-of-two worlds): in step k this rank keeps half of
/// the chunks it is still responsible for, sends the other half to rank r ^ (n/2^(k+1)) and
/// reduces that rank's copy of its own half into it: log2(n) messages, (n-1)/n of the input sent.
/// Scratch: the input's size (half for partial results, half for receives). With `headers`, this
/// rank announces itself to each of its log2(n) peers at once and checks a peer's before it waits
/// for that peer's message, so every partial result it receives came through ranks that agree.
template <class Headers = NoHeaders>
void halving_reduce_scatter(const std::shared_ptr<::gloo::Context>& ctx, std::uint64_t slot,
                            const Deadline& deadline, const void* in, void* out, std::size_t count,
                            std::size_t elem_size, const ReduceFunc& reduce, Scratch& scratch,
                            const Headers& headers = {}) {
  const int n = ctx->size;
  const int r = ctx->rank;
  const std::size_t cb = count * elem_size;
  const std::size_t half_bytes = static_cast<std::size_t>(n / 2) * cb;
  std::byte* acc = scratch_bytes(scratch, 2 * half_bytes);
  std::byte* tmp = acc + half_bytes;
  auto in_buf = ctx->createUnboundBuffer(const_cast<void*>(in), static_cast<std::size_t>(n) * cb);
  auto acc_buf = ctx->createUnboundBuffer(acc, half_bytes);
  auto tmp_buf = ctx->createUnboundBuffer(tmp, half_bytes);
  for (int mask = n / 2; mask >= 1; mask /= 2) headers.expect(r ^ mask);
  for (int mask = n / 2; mask >= 1; mask /= 2) headers.announce(r ^ mask);
  // `src` holds chunks [src_lo, src_lo + width) that this rank still reduces.
  const auto* src = static_cast<const std::byte*>(in);
  ::gloo::transport::UnboundBuffer* src_buf = in_buf.get();
  int src_lo = 0;
  int width = n;
  for (int mask = n / 2; mask >= 1; mask /= 2) {
    const int peer = r ^ mask;
    const int half = width / 2;
    const int mine = (r & mask) != 0 ? src_lo + half : src_lo;
    const int other = (r & mask) != 0 ? src_lo : src_lo + half;
    const std::size_t bytes = static_cast<std::size_t>(half) * cb;
    tmp_buf->recv(peer, slot, 0, bytes);
    src_buf->send(peer, slot, static_cast<std::size_t>(other - src_lo) * cb, bytes);
    headers.check(peer);
    wait_recv(*tmp_buf, deadline);
    wait_send(*src_buf, deadline);
    void* dst = mask == 1 ? out : static_cast<void*>(acc);
    reduce(dst, src + static_cast<std::size_t>(mine - src_lo) * cb, tmp, static_cast<std::size_t>(half) * count);
    src = acc;
    src_buf = acc_buf.get();
    src_lo = mine;
    width = half;
  }
  for (int mask = n / 2; mask >= 1; mask /= 2) headers.announced(r ^ mask);
}

/// reduce_scatter's algorithms. Each rank picks by its own settings (COMM_GLOO_RS_HALVING_MAX);
/// a headed operation puts the pick in its fingerprint, so ranks that pick differently disagree.
enum class RsAlgorithm : std::uint32_t { halving = 1, ring = 2 };

[[nodiscard]] inline RsAlgorithm rs_algorithm(int n, std::size_t count, std::size_t elem_size,
                                              const AlgorithmConfig& cfg) noexcept {
  const std::size_t in_bytes = static_cast<std::size_t>(n) * count * elem_size;
  return n > 1 && (n & (n - 1)) == 0 && in_bytes <= cfg.halving_max ? RsAlgorithm::halving : RsAlgorithm::ring;
}

/// The slots of a reduce_scatter: tagged, or (headed) hashed from the fingerprint.
struct RsSlots {
  std::uint64_t halving;
  RingSlots ring;
  [[nodiscard]] static RsSlots of_tag(std::uint32_t tag) noexcept {
    return {static_cast<std::uint64_t>(::gloo::Slot::build(kHalvingSlotPrefix, tag)), RingSlots::of_tag(tag)};
  }
};

/// reduce_scatter by `algo`: `in` holds size*count elements; `out` (count elements) may be
/// `in + rank*count`.
template <class Headers = NoHeaders>
void run_reduce_scatter(const std::shared_ptr<::gloo::Context>& ctx, RsAlgorithm algo, const RsSlots& slots,
                        const Deadline& deadline, const void* in, void* out, std::size_t count, std::size_t elem_size,
                        const ReduceFunc& reduce, Scratch& scratch, const Headers& headers = {}) {
  if (algo == RsAlgorithm::halving)
    halving_reduce_scatter(ctx, slots.halving, deadline, in, out, count, elem_size, reduce, scratch, headers);
  else
    ring_reduce_scatter(ctx, slots.ring, deadline, in, out, count, elem_size, reduce, scratch, headers);
}

}  // namespace comm::detail::gloo
