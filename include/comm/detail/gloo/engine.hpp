#pragma once
// The Gloo engine behind comm::backends::Gloo: the connected gloo contexts (one per network
// device) and the gloo calls. Everything else — issue order, async Work, the flight recorder, the
// desync check, monitored_barrier, failure state — is the engine core's (detail/engine/core.hpp).
//
// Ranks that disagree about an operation must never reach libgloo with it (a longer message than
// the posted receive terminates the process): small operations run on checked frames; large
// all_reduce, reduce_scatter, broadcast, gather and all_gather send header frames beside payload
// on slots hashed from the fingerprint (headed()); the others exchange fingerprints first
// (checked.hpp), whether or not the desync check is on.
//
// The fingerprint exchange: every rank sends its own 32 bytes to every other rank at once (one
// message latency), in frames up to kCheckedMaxRanks; above, directly on a slot of its own up to
// kDirectExchangeMax ranks, then a gloo ring allgather, where n-1 messages per rank and operation
// would cost more than n-1 ring steps.
//
// Every collective above the frames' limit runs comm's own algorithms (algorithms.hpp, bulk.hpp),
// whose waits the communicator can cut short (waits.hpp); gloo's barrier remains above
// kCheckedMaxRanks ranks (messages of no payload, which gloo writes at once).

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <gloo/allgather.h>
#include <gloo/barrier.h>
#include <gloo/context.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <comm/concepts.hpp>
#include <comm/detail/base/copy.hpp>
#include <comm/detail/gloo/abort.hpp>
#include <comm/detail/gloo/algorithms.hpp>
#include <comm/detail/gloo/bulk.hpp>
#include <comm/detail/gloo/checked.hpp>
#include <comm/detail/gloo/device.hpp>
#include <comm/detail/gloo/errors.hpp>
#include <comm/detail/gloo/reduce_scatter.hpp>
#include <comm/detail/gloo/store_adapter.hpp>
#include <comm/detail/gloo/waits.hpp>
#include <comm/detail/diagnostics/desync.hpp>
#include <comm/detail/engine/core.hpp>
#include <comm/detail/diagnostics/flight_recorder.hpp>
#include <comm/detail/base/logging.hpp>
#include <comm/detail/diagnostics/monitored_barrier.hpp>
#include <comm/detail/engine/reduce.hpp>
#include <comm/diagnostics.hpp>
#include <comm/error.hpp>
#include <comm/store.hpp>
#include <comm/types.hpp>
#include <comm/work.hpp>

namespace comm::detail::gloo {

/// The reduction gloo (or comm's algorithms) call for `op`. Both forms fit std::function's small
/// buffer (a function pointer; two pointers), so building one does not allocate.
[[nodiscard]] inline ReduceFunc reduce_func(const Op& op) {
  if (op.custom == nullptr) return ReduceFunc(op.kernel);
  return [fn = op.custom, arg = op.custom_arg](void* out, const void* a, const void* b, std::size_t n) {
    fn(arg, out, a, b, n);
  };
}

/// What an Engine is built with besides its store, rank and size.
struct EngineConfig : CoreConfig {
  std::vector<std::string> interfaces;
  std::string hostname;
  /// Nice value added to the gloo devices' event-loop threads (see device.hpp); 0: inherit.
  /// Default: COMM_GLOO_LOOP_NICE, else 19.
  int loop_nice = loop_nice_default();
  /// all_reduce / reduce_scatter algorithm choice (see algorithms.hpp).
  AlgorithmConfig algorithms = algorithm_config_default();
  /// The frames (small operations, fingerprint exchanges) over comm's own connections (direct.hpp)
  /// instead of gloo's pairs; only for 2..kCheckedMaxRanks ranks.
  bool direct = false;
};

class Engine : public EngineCore<Engine> {
  using Core = EngineCore<Engine>;
  /// Tag of the barrier that ends connection. Operation tags are the sequence number modulo 2^31;
  /// the desync check's fingerprint exchange has a tag of its own (exchanges run one at a time,
  /// in the same order on every rank, and gloo keeps messages of one slot in order).
  static constexpr std::uint32_t kConnectTag = 0xffffffffu;
  static constexpr std::uint32_t kDesyncTag = 0x80000000u;
  /// Slot prefix of the direct fingerprint exchange (comm's own algorithms use 0x21 and up).
  static constexpr std::uint8_t kDesyncSlotPrefix = 0x22;
  /// Slot prefix of point-to-point headers (p2p.hpp); their payloads use kP2PDataSlotPrefix
  /// (p2p_data_slot).
  static constexpr std::uint8_t kP2PSlotPrefix = 0x26;
  static constexpr std::uint8_t kP2PDataSlotPrefix = 0x2c;
  static constexpr int kDirectExchangeMax = 64;
  /// Scratch kept between operations; more is freed after the operation that needed it.
  static constexpr std::size_t kScratchKeep = std::size_t{8} << 20;

  static constexpr const char* kUnstagedHint =
      "Gloo stages device buffers for all_reduce, reduce_scatter, all_gather, broadcast and gather only; use "
      "Communicator<backends::Nccl> for the other operations";

  [[nodiscard]] static constexpr std::uint32_t tag_of(std::uint64_t seq) noexcept {
    return static_cast<std::uint32_t>(seq & 0x7fffffffu);
  }

 public:
  /// Connects `size` ranks through `store`: one gloo context per device (see device.hpp).
  Engine(std::shared_ptr<comm::Store> store, int rank, int size, const EngineConfig& cfg)
      : Core(std::move(store), rank, size, cfg, "gloo"), algorithms_(cfg.algorithms), p2p_numbers_(size) {
    // Device buffers reach the engine only for operations the policy does not stage (see
    // backends/gloo.hpp): a clear error instead of a CPU read of device memory.
    host_buffers_unless_staged(kUnstagedHint);
    const auto specs = device_specs(cfg.interfaces, cfg.hostname);
    for (std::size_t i = 0; i < specs.size(); ++i) {
      auto dev = shared_device(specs[i], rank, cfg.loop_nice);
      auto ctx = std::make_shared<::gloo::rendezvous::Context>(rank, size);
      ctx->setTimeout(timeout());
      StoreAdapter adapter(Core::store(), key_prefix() + std::to_string(i) + "/", timeout(), &peer_names_);
      try {
        ctx->connectFullMesh(adapter, dev);
        if (i == 0 && cfg.direct && size > 1 && size <= kCheckedMaxRanks)
          direct_ = std::make_unique<DirectLinks>(*Core::store(), key_prefix() + "direct-", rank, size, specs[0],
                                                  timeout());
        // Once every rank has passed this barrier, every rank has finished reading the store, so
        // the store (e.g. rank 0's TcpStore server from env://) may go away right after create().
        ::gloo::BarrierOptions b(ctx);
        b.setTag(kConnectTag);
        b.setTimeout(timeout());
        ::gloo::barrier(b);
        peer_names_.learn_accepted();
      } catch (...) {
        gloo::rethrow_translated("gloo.connect", rank, &peer_names_);
      }
      contexts_.push_back(std::move(ctx));
    }
    for (std::size_t i = 0; i < contexts_.size(); ++i) frames_.push_back(std::make_unique<Frames>(direct_.get()));
  }

  /// Uses an already connected context (no store: no subgroups, no monitored_barrier).
  Engine(std::shared_ptr<::gloo::Context> ctx, const EngineConfig& cfg)
      : Core(ctx->rank, ctx->size, cfg, "gloo", "adopted"), algorithms_(cfg.algorithms), p2p_numbers_(ctx->size) {
    host_buffers_unless_staged(kUnstagedHint);
    contexts_.push_back(std::move(ctx));
    frames_.push_back(std::make_unique<Frames>());
  }

  ~Engine() { shutdown(); }

  [[nodiscard]] const std::shared_ptr<::gloo::Context>& context(std::size_t i = 0) const { return contexts_.at(i); }
  [[nodiscard]] std::size_t num_contexts() const noexcept { return contexts_.size(); }

 private:
  friend Core;

  // ---- the engine calls the core makes ----

  /// The collective of `op` (comm's own algorithms or gloo's) on the device its tag picks.
  void perform(Op& op, std::uint64_t seq) {
    const std::uint32_t tag = tag_of(seq);
    const auto& ctx = contexts_[tag % contexts_.size()];
    const Deadline deadline(timeout(), gate_);
    switch (op.desc.kind) {
      case OpKind::all_reduce: {
        if (op.out_count == 0) return;
        const ReduceFunc fn = reduce_func(op);
        const void* in = op.in == op.out ? nullptr : op.in;
        if (framed(op)) {
          checked_all_reduce(framed_op(tag, seq, op, 2, op.out_count * op.elem_size), size(), rank(), in, op.out,
                             op.out_count, fn);
          if (op.finish != nullptr) op.finish(op.out, op.out_count, size());
          return;
        }
        const ArAlgorithm algo = ar_algorithm(size(), op.out_count * op.elem_size, algorithms_);
        if (headed(op)) {
          Fingerprint fp = fingerprint(seq, op.desc);
          // The pick is part of the fingerprint that the headers carry and the slots hash.
          fp.reserved = static_cast<std::uint32_t>(algo);
          const FramedOp f = frames_for(tag, fp, static_cast<std::size_t>(size()), 0, op_name(op.desc.kind));
          const ArSlots slots{hashed_slot(kHeadedExchangeSlotPrefix, &fp), headed_ring_slots(fp),
                              hashed_slot(kHeadedAllGatherSlotPrefix, &fp)};
          run_all_reduce(ctx, algo, slots, deadline, in, op.out, op.out_count, op.elem_size, fn, scratch_,
                         HeaderFrames(f, rank()));
        } else {
          run_all_reduce(ctx, algo, ArSlots::of_tag(tag), deadline, in, op.out, op.out_count, op.elem_size, fn,
                         scratch_);
        }
        if (op.finish != nullptr) op.finish(op.out, op.out_count, size());
        return;
      }
      case OpKind::reduce_scatter: {
        if (op.out_count == 0) return;
        const ReduceFunc fn = reduce_func(op);
        if (framed(op)) {
          const auto n = static_cast<std::size_t>(size());
          checked_reduce_scatter(framed_op(tag, seq, op, 2 * n, op.out_count * op.elem_size), size(), rank(), op.in,
                                 op.out, op.out_count, fn);
          if (op.finish != nullptr) op.finish(op.out, op.out_count, size());
          return;
        }
        const RsAlgorithm algo = rs_algorithm(size(), op.out_count, op.elem_size, algorithms_);
        if (headed(op)) {
          Fingerprint fp = fingerprint(seq, op.desc);
          fp.reserved = static_cast<std::uint32_t>(algo);  // as all_reduce's
          const FramedOp f = frames_for(tag, fp, static_cast<std::size_t>(size()), 0, op_name(op.desc.kind));
          const RsSlots slots{hashed_slot(kHeadedHalvingSlotPrefix, &fp), headed_ring_slots(fp)};
          run_reduce_scatter(ctx, algo, slots, deadline, op.in, op.out, op.out_count, op.elem_size, fn, scratch_,
                             HeaderFrames(f, rank()));
        } else {
          run_reduce_scatter(ctx, algo, RsSlots::of_tag(tag), deadline, op.in, op.out, op.out_count, op.elem_size, fn,
                             scratch_);
        }
        // Defensive: every algorithm's scratch is bounded (a few MiB), but never hold more.
        if (scratch_.capacity() > kScratchKeep) Scratch().swap(scratch_);
        if (op.finish != nullptr) op.finish(op.out, op.out_count, size());
        return;
      }
      case OpKind::all_gather:
      case OpKind::split: {
        if (op.in_count == 0) return;
        if (framed(op)) {
          const auto n = static_cast<std::size_t>(size());
          checked_all_gather(framed_op(tag, seq, op, n, op.in_count * op.elem_size), size(), rank(), op.in, op.out);
          return;
        }
        const std::size_t chunk = op.in_count * op.elem_size;
        auto* mine = static_cast<std::byte*>(op.out) + static_cast<std::size_t>(rank()) * chunk;
        // The receives are posted first (they fill the other chunks), so the left neighbour's
        // first segments travel while this rank copies its own input into place.
        if (!headed(op)) {
          RingAllGather ring(ctx, tag, deadline, op.out, chunk, forward_segment(chunk));
          if (mine != op.in) move_bytes(mine, op.in, chunk);  // an input already there is gathered in place
          ring.run();
          return;
        }
        // Header frames (see headed()): each rank checks its left neighbour's, which checked its own
        // left's..., so a rank that disagrees is seen by its right neighbour, and every chunk that
        // reaches a rank came through ranks that agree with it.
        const Fingerprint fp = fingerprint(seq, op.desc);
        const FramedOp f = frames_for(tag, fp, static_cast<std::size_t>(size()), 0, op_name(op.desc.kind));
        const HeaderFrames headers(f, rank());
        const int left = (rank() + size() - 1) % size(), right = (rank() + 1) % size();
        RingAllGather ring(ctx, hashed_slot(kHeadedAllGatherSlotPrefix, &fp), deadline, op.out, chunk,
                           forward_segment(chunk), [&] { headers.expect(left); });
        if (mine != op.in) move_bytes(mine, op.in, chunk);
        ring.send_own_through(1);  // the first segment, then the header behind it (post_headed_recvs)
        headers.announce(right);
        headers.check(left);
        ring.run();
        headers.announced(right);
        return;
      }
      case OpKind::broadcast: {
        if (op.out_count == 0) return;
        if (framed(op)) {
          checked_broadcast(framed_op(tag, seq, op, 1, op.out_count * op.elem_size), size(), rank(), op.desc.root,
                            op.out);
          return;
        }
        const std::size_t bytes = op.out_count * op.elem_size;
        auto run = [&](std::uint64_t slot, const auto& headers) {
          if (size() <= 4)
            chain_broadcast(ctx, slot, deadline, op.out, bytes, op.desc.root, headers);
          else
            tree_broadcast(ctx, slot, deadline, op.out, bytes, op.desc.root, headers);
        };
        if (headed(op)) {
          const Fingerprint fp = fingerprint(seq, op.desc);
          const FramedOp f = frames_for(tag, fp, static_cast<std::size_t>(size()), 0, op_name(op.desc.kind));
          run(hashed_slot(kHeadedBroadcastSlotPrefix, &fp), HeaderFrames(f, rank()));
        } else {
          run(static_cast<std::uint64_t>(::gloo::Slot::build(kTreeBroadcastSlotPrefix, tag)), NoHeaders{});
        }
        return;
      }
      case OpKind::gather: {
        if (op.in_count == 0) return;
        if (framed(op)) {
          const auto n = static_cast<std::size_t>(size());
          checked_gather(framed_op(tag, seq, op, n, op.in_count * op.elem_size), size(), rank(), op.desc.root,
                         op.in, op.out);
          return;
        }
        const std::size_t chunk = op.in_count * op.elem_size;
        if (headed(op)) {
          const Fingerprint fp = fingerprint(seq, op.desc);
          const FramedOp f = frames_for(tag, fp, static_cast<std::size_t>(size()), 0, op_name(op.desc.kind));
          direct_gather(ctx, hashed_slot(kHeadedGatherSlotPrefix, &fp), deadline, op.in, op.out, chunk, op.desc.root,
                        HeaderFrames(f, rank()));
        } else {
          direct_gather(ctx, static_cast<std::uint64_t>(::gloo::Slot::build(kDirectGatherSlotPrefix, tag)), deadline,
                        op.in, op.out, chunk, op.desc.root);
        }
        return;
      }
      case OpKind::barrier: {
        if (framed(op)) {  // every rank hears from every other: a barrier that checks its callers
          checked_all_gather(framed_op(tag, seq, op, static_cast<std::size_t>(size()), 0), size(), rank(), nullptr,
                             nullptr);
          return;
        }
        ::gloo::BarrierOptions o(ctx);
        o.setTag(tag);
        o.setTimeout(deadline.left());
        ::gloo::barrier(o);
        return;
      }
      case OpKind::reduce: {
        const std::size_t bytes = op.in_count * op.elem_size;
        if (!framed(op) && size() > 1 && bytes > (size() == 2 ? algorithms_.exchange_max : algorithms_.doubling_max)) {
          const ReduceFunc fn = reduce_func(op);
          ring_reduce(ctx, tag, deadline, op.in, op.out, op.in_count, op.elem_size, fn, op.desc.root, scratch_,
                      chunk_scratch_);
          if (chunk_scratch_.capacity() > kScratchKeep) Scratch().swap(chunk_scratch_);
          if (op.finish != nullptr && rank() == op.desc.root) op.finish(op.out, op.in_count, size());
          return;
        }
        return Core::compose(op, seq);  // as an all_reduce
      }
      default: return Core::compose(op, seq);  // scatter, all_to_all(_v)
    }
  }

  /// Sends and receives on device 0. Every receive posts its header's receive and its payload's
  /// at once, then every send goes out (header, then payload), the first to the next rank up;
  /// a receive's payload is waited for only once its header checked out. The payload travels on
  /// a slot of its own (p2p_data_slot: a hash of everything the header check compares), so a
  /// peer that disagrees about the message sends its payload where no receive of this rank waits
  /// for it: the header's check fails (DesyncError) before a byte of it lands in the buffer.
  /// Posting the payload's receive with the header's saves the round trip that a receive posted
  /// after the check costs (gloo sends a payload only once the receiver's ready notice is in).
  /// Nothing waits before everything is posted, so a batch that exchanges in both directions
  /// cannot deadlock.
  void perform_p2p(const Op& op, std::span<P2PItem> items) {
    const auto& ctx = contexts_[0];
    const Deadline deadline(timeout(), gate_);
    const auto hslot = static_cast<std::uint64_t>(::gloo::Slot::build(kP2PSlotPrefix, 0));
    const std::size_t n = items.size();
    std::vector<P2PHeader> headers(n);
    std::vector<std::uint64_t> numbers(n);
    std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> hbuf(n), dbuf(n);
    for (std::size_t i = 0; i < n; ++i) {
      const P2PItem& it = items[i];
      if (it.send) continue;
      numbers[i] = p2p_numbers_.next_recv(it.peer);
      hbuf[i] = ctx->createUnboundBuffer(&headers[i], sizeof(P2PHeader));
      hbuf[i]->recv(it.peer, hslot);
      if (it.count != 0) {
        dbuf[i] = ctx->createUnboundBuffer(it.buf, it.count * op.elem_size);
        dbuf[i]->recv(it.peer, p2p_data_slot(p2p_header(op, it, numbers[i])));
      }
    }
    // Sends to rank+1 first, then rank+2...: in an all_to_all every rank then starts on a
    // different peer (as gloo's alltoall), not all on rank 0. The sort is stable: one peer's
    // messages keep their order, which their numbers follow.
    std::vector<std::size_t> order;
    order.reserve(n);
    for (std::size_t i = 0; i < n; ++i)
      if (items[i].send) order.push_back(i);
    const int world = size();
    auto distance = [&](std::size_t i) { return (items[i].peer - rank() + world) % world; };
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return distance(a) < distance(b); });
    for (std::size_t i : order) {
      const P2PItem& it = items[i];
      headers[i] = p2p_header(op, it, p2p_numbers_.next_send(it.peer));
      hbuf[i] = ctx->createUnboundBuffer(&headers[i], sizeof(P2PHeader));
      hbuf[i]->send(it.peer, hslot);
      if (it.count != 0) {
        dbuf[i] = ctx->createUnboundBuffer(it.buf, it.count * op.elem_size);
        dbuf[i]->send(it.peer, p2p_data_slot(headers[i]));
      }
    }
    // gloo's waits name neither the peer nor the message: add them (the text keeps gloo's, which
    // says whether it timed out or the connection closed).
    auto wait = [&](::gloo::transport::UnboundBuffer& b, const P2PItem& it, const char* what) {
      try {
        if (it.send)
          wait_send(b, deadline);
        else
          wait_recv(b, deadline);
      } catch (const ::gloo::IoException& e) {
        throw ::gloo::IoException(std::string(e.what()) + " [" + (it.send ? "sending " : "receiving ") + what +
                                  (it.send ? " to rank " : " from rank ") + std::to_string(it.peer) + ", " +
                                  std::to_string(it.count) + " elements, tag " + std::to_string(it.tag) + "]");
      }
    };
    for (std::size_t i = 0; i < n; ++i) {
      const P2PItem& it = items[i];
      if (it.send) continue;
      wait(*hbuf[i], it, "the header of a message");
      check_p2p_header(op, it, headers[i], numbers[i], rank());
    }
    for (std::size_t i = 0; i < n; ++i)
      if (!items[i].send && dbuf[i]) wait(*dbuf[i], items[i], "a message");
    for (std::size_t i : order) {
      wait(*hbuf[i], items[i], "the header of a message");
      if (dbuf[i]) wait(*dbuf[i], items[i], "a message");
    }
  }

  /// The slot of a point-to-point payload: hashed from its header (bulk.hpp's hashed_slot), which
  /// sender and receiver each compute from what they expect, so the slots agree exactly when the
  /// headers do (but for a 2^-56 chance of a collision, which the header check still catches,
  /// only after the payload).
  [[nodiscard]] static std::uint64_t p2p_data_slot(const P2PHeader& h) noexcept {
    static_assert(sizeof(P2PHeader) == 32);
    return hashed_slot(kP2PDataSlotPrefix, &h);
  }

  /// Whether `op` runs on checked frames (checked.hpp): small enough, few enough ranks.
  [[nodiscard]] bool framed(const Op& op) const noexcept {
    if (size() == 1 || size() > kCheckedMaxRanks) return false;
    switch (op.desc.kind) {
      case OpKind::all_reduce:
      case OpKind::reduce: {  // the small ones run as an all_reduce of the input (EngineCore::compose)
        const std::size_t bytes = (op.desc.kind == OpKind::reduce ? op.in_count : op.out_count) * op.elem_size;
        return bytes <= kCheckedMax && bytes <= (size() == 2 ? algorithms_.exchange_max : algorithms_.doubling_max);
      }
      case OpKind::all_gather:
      case OpKind::split:
      case OpKind::gather: return op.in_count * op.elem_size <= kCheckedMax;
      case OpKind::broadcast:
      case OpKind::reduce_scatter: return op.out_count * op.elem_size <= kCheckedMax;
      case OpKind::barrier: return true;
      default: return false;
    }
  }

  /// The engine core asks before each collective: the fingerprint exchange runs first for those
  /// whose messages are not checked, unless nothing a peer sends can overflow a receive (barrier,
  /// and the point-to-point compositions, whose receives are posted after their header is checked).
  [[nodiscard]] bool exchange_before(const Op& op) const noexcept {
    switch (op.desc.kind) {
      case OpKind::barrier:
      case OpKind::scatter:
      case OpKind::all_to_all:
      case OpKind::all_to_all_v: return false;
      default: return !framed(op) && !headed(op);
    }
  }

  /// Whether `op`, above the frames' limit, checks its peers with header frames instead of a
  /// fingerprint exchange first (all_reduce, reduce_scatter, broadcast, gather, all_gather:
  /// HeaderFrames, bulk.hpp, algorithms.hpp; the exchange cost a message latency, up to 1.2-1.4x
  /// raw gloo at 1 MiB on 2 ranks, benchmarks/RESULTS.md 2026-11-28): every receiver checks
  /// the fingerprint of each rank it receives from before it waits for a byte of payload, and the
  /// payload travels on a slot hashed from the fingerprint, so a rank that disagrees sends it
  /// where nobody waits. A mismatch is a DesyncError on the receiver that saw it (the communicator
  /// fails, as on frames); the others get RemoteError, or complete when all they received came
  /// from ranks that agree with them, and fail at their next operation. Not with the desync check
  /// on (its exchange runs anyway), nor above kCheckedMaxRanks ranks (no frames).
  [[nodiscard]] bool headed(const Op& op) const noexcept {
    if (size() == 1 || size() > kCheckedMaxRanks || desync_check() || framed(op)) return false;
    // The 2-rank ring reduce_scatter (input above COMM_GLOO_RS_HALVING_MAX) keeps the exchange:
    // at 16 MiB it measured faster with the ranks started in step (one binary, 6 rounds: 0.61x
    // raw gloo with a barrier in front of the header frames, 0.70x without; RESULTS 2026-11-28).
    if (op.desc.kind == OpKind::reduce_scatter && size() == 2 &&
        rs_algorithm(size(), op.out_count, op.elem_size, algorithms_) == RsAlgorithm::ring)
      return false;
    return headed_kind(static_cast<std::uint8_t>(op.desc.kind));
  }
  /// A headed ring reduce-scatter's slots, hashed from `fp` (which carries the algorithm).
  [[nodiscard]] static RingSlots headed_ring_slots(const Fingerprint& fp) noexcept {
    return {hashed_slot(kHeadedRingInSlotPrefix, &fp), hashed_slot(kHeadedRingPartialSlotPrefix, &fp)};
  }
  [[nodiscard]] static bool headed_kind(std::uint8_t kind) noexcept {
    const auto k = static_cast<OpKind>(kind);
    return k == OpKind::broadcast || k == OpKind::gather || k == OpKind::all_gather || k == OpKind::reduce_scatter ||
           k == OpKind::all_reduce;
  }

  /// The messages of one framed operation, on the device its tag picks (as perform's).
  [[nodiscard]] FramedOp frames_for(std::uint32_t tag, const Fingerprint& fp, std::size_t nframes, std::size_t payload,
                                    const char* name) {
    const std::size_t i = tag % contexts_.size();
    return FramedOp(contexts_[i], *frames_[i], nframes, tag, Deadline(timeout(), gate_), fp, payload, name);
  }
  [[nodiscard]] FramedOp framed_op(std::uint32_t tag, std::uint64_t seq, const Op& op, std::size_t nframes,
                                   std::size_t payload) {
    return frames_for(tag, fingerprint(seq, op.desc), nframes, payload, op_name(op.desc.kind));
  }

  /// Fills fingerprints() from every rank (this rank's slot is set).
  void exchange_fingerprints(std::uint64_t seq) {
    constexpr std::size_t fp = sizeof(Fingerprint);
    auto& all = fingerprints();
    if (size() <= kCheckedMaxRanks) {
      // In frames on the operation's checked slot: a peer that runs this operation on frames
      // instead (it disagrees about it) sends a frame this receive can hold.
      const FramedOp f = frames_for(tag_of(seq), own_fingerprint(), static_cast<std::size_t>(size()), 0, "desync check");
      // A peer that ran a headed operation (headed()) sent a header frame, and waits on sends that
      // will never match; nor would this exchange end (it waits for its frame to that peer, which
      // never posts a receive for it). The DesyncError fails the communicator at once, inside the
      // exchange: closing its connections wakes that peer and the ones waiting on this rank.
      const bool watch = !desync_check();
      all_to_all_frames(f, size(), rank(), nullptr, false, [&](std::size_t q) {
        std::memcpy(&all[q], f.frame(q), fp);
        if (watch && headed_kind(all[q].kind) && std::memcmp(&all[q], &own_fingerprint(), fp) != 0)
          throw UnsharedDesync(DesyncError(op_name(static_cast<OpKind>(own_fingerprint().kind)), rank(),
                                           "desync: " + f.mismatch(all[q], static_cast<int>(q)),
                                           "rank " + std::to_string(q)));
      });
      return;
    }
    const auto& ctx = contexts_[0];
    if (size() > kDirectExchangeMax) {
      ::gloo::AllgatherOptions o(ctx);  // in place: this rank's slot is its input
      o.setOutput(reinterpret_cast<std::uint8_t*>(all.data()), all.size() * fp);
      o.setTag(kDesyncTag);
      o.setTimeout(timeout());
      ::gloo::allgather(o);
      return;
    }
    // Every exchange uses the same slot: they run one at a time, in the same order on every
    // rank, and gloo delivers the messages of one slot and pair in order.
    if (!fp_send_) {
      fp_send_ = ctx->createUnboundBuffer(&all[static_cast<std::size_t>(rank())], fp);
      fp_recv_ = ctx->createUnboundBuffer(all.data(), all.size() * fp);
    }
    const auto slot = static_cast<std::uint64_t>(::gloo::Slot::build(kDesyncSlotPrefix, 0));
    for (int p = 0; p < size(); ++p) {
      if (p == rank()) continue;
      fp_recv_->recv(p, slot, static_cast<std::size_t>(p) * fp, fp);
      fp_send_->send(p, slot);
    }
    const Deadline deadline(timeout(), gate_);
    for (int i = 1; i < size(); ++i) wait_recv(*fp_recv_, deadline);
    for (int i = 1; i < size(); ++i) wait_send(*fp_send_, deadline);
  }

  [[noreturn]] void rethrow_translated(const char* op) { gloo::rethrow_translated(op, rank(), &peer_names_); }

  /// Closes the connections (peers fail with RemoteError) and wakes every pending wait: gloo's
  /// abort wakes its own, the gate comm's (a send gloo already began writing included).
  void close_transport() noexcept {
    for (auto& ctx : contexts_) abort_context(*ctx);
    if (direct_) direct_->close();
    gate_.close();
  }

  AlgorithmConfig algorithms_;
  std::vector<std::shared_ptr<::gloo::Context>> contexts_;
  gloo::PeerNames peer_names_;
  WaitGate gate_;  // every wait of comm's algorithms (waits.hpp)  // peers' addresses -> ranks, learnt at connect (errors name ranks)
  // The direct exchange's buffers over the core's fingerprint table (made at the first check;
  // destroyed before the contexts).
  std::unique_ptr<::gloo::transport::UnboundBuffer> fp_send_, fp_recv_;
  std::unique_ptr<DirectLinks> direct_;  // the frames' connections, when EngineConfig::direct
  std::vector<std::unique_ptr<Frames>> frames_;  // one per context; destroyed before the contexts
  Scratch scratch_;  // comm's algorithms' buffers; ops run one at a time
  Scratch chunk_scratch_;  // ring_reduce: a non-root's reduced chunk
  P2PCounters p2p_numbers_;
};

}  // namespace comm::detail::gloo
