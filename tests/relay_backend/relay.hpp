#pragma once
// `comm::test::Relay`: a test-only backend whose engine moves every byte through the communicator's
// Store (set, get, and wait with the operation's deadline). Slow, and correct: it stands on the
// engine core (detail/engine/core.hpp) like the real host engines, so the conformance suites that
// it joins through its one entry in the backend list (tests/relay_backend/list.hpp) check a real
// backend, not a mock.
//
// - A collective is one symmetric step: every rank sets its input (after a 32-byte fingerprint of
//   the operation) under "<prefix>s/<step>/<rank>", reads every peer's, and computes its result
//   locally (reductions in rank order with the operation's kernels). A peer's fingerprint that
//   differs is a DesyncError on every rank, as on Shm.
// - Point-to-point messages (send, recv, batches, and the collectives the core composes from them)
//   are keys "<prefix>p/<from>/<to>/<number>" holding a P2PHeader and the payload; the receiver
//   checks the header, copies, and deletes the key.
// - Store keys do not pile up: once a rank has read every peer's blob of step s, every peer has
//   finished step s-1 (it published s after it), so the rank deletes its own blob of s-1.
// - Waits are store waits in slices of `poll`, so that a failure elsewhere (close_transport, the
//   liveness watch) ends them at once; the operation's deadline gives comm::Timeout naming the
//   rank waited for.
// - The rank hosting the store leaves last (linger), at most 5 s after the others.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <comm/concepts.hpp>
#include <comm/detail/engine/backend_diagnostics.hpp>
#include <comm/detail/diagnostics/desync.hpp>
#include <comm/detail/engine/core.hpp>
#include <comm/detail/engine/forward.hpp>
#include <comm/detail/engine/p2p.hpp>
#include <comm/detail/engine/policy.hpp>
#include <comm/detail/engine/elastic.hpp>
#include <comm/detail/engine/subgroups.hpp>
#include <comm/detail/diagnostics/flight_recorder.hpp>
#include <comm/error.hpp>
#include <comm/options.hpp>
#include <comm/store.hpp>
#include <comm/types.hpp>
#include <comm/work.hpp>

namespace comm::test::relay {

using comm::detail::CoreConfig;
using comm::detail::Fingerprint;
using comm::detail::Op;
using comm::OpDesc;
using comm::OpKind;
using comm::detail::P2PItem;

class Engine : public comm::detail::EngineCore<Engine> {
  using Core = comm::detail::EngineCore<Engine>;
  using Clock = std::chrono::steady_clock;

 public:
  Engine(std::shared_ptr<comm::Store> store, int rank, int size, const CoreConfig& cfg)
      : Core(std::move(store), rank, size, cfg, "relay"), p2p_(size) {
    host_buffers_only("the relay test backend moves host memory through the store");
  }
  ~Engine() {
    shutdown();  // first: queued operations end (they may still read the store)
    linger();
  }

 private:
  friend Core;
  using Blob = std::vector<std::uint8_t>;

  // ---- the engine calls the core makes ----

  void perform(Op& op, std::uint64_t seq) {
    const std::size_t e = op.elem_size;
    const int n = size();
    switch (op.desc.kind) {
      case OpKind::all_reduce: {
        const void* in = op.in != nullptr ? op.in : op.out;
        const auto all = step(op, seq, in, op.out_count * e);
        reduce_into(op, op.out, all, 0, op.out_count);
        return;
      }
      case OpKind::reduce_scatter: {
        const auto all = step(op, seq, op.in, op.in_count * e);
        reduce_into(op, op.out, all, static_cast<std::size_t>(rank()) * op.out_count, op.out_count);
        return;
      }
      case OpKind::all_gather:
      case OpKind::split: {
        const auto all = step(op, seq, op.in, op.in_count * e);
        for (int p = 0; p < n; ++p)
          copy_payload(static_cast<std::byte*>(op.out) + static_cast<std::size_t>(p) * op.in_count * e, all[idx(p)],
                       op.in_count * e, p);
        return;
      }
      case OpKind::broadcast: {
        const bool root = rank() == op.desc.root;
        const auto all = step(op, seq, op.out, root ? op.out_count * e : 0);
        if (!root) copy_payload(op.out, all[idx(op.desc.root)], op.out_count * e, op.desc.root);
        return;
      }
      case OpKind::gather: {
        const auto all = step(op, seq, op.in, op.in_count * e);
        if (rank() == op.desc.root)
          for (int p = 0; p < n; ++p)
            copy_payload(static_cast<std::byte*>(op.out) + static_cast<std::size_t>(p) * op.in_count * e,
                         all[idx(p)], op.in_count * e, p);
        return;
      }
      case OpKind::barrier: (void)step(op, seq, nullptr, 0); return;
      default: return Core::compose(op, seq);  // reduce, scatter, all_to_all(_v): through perform_p2p
    }
  }

  void perform_p2p(const Op& op, std::span<P2PItem> items) {
    const char* name = comm::detail::op_name(op.desc.kind);
    // Sends never block (a set), so sending everything first cannot deadlock with the receives.
    for (const P2PItem& it : items) {
      if (!it.send) continue;
      const auto number = p2p_.next_send(it.peer);
      const comm::detail::P2PHeader h = comm::detail::p2p_header(op, it, number);
      Blob b(sizeof h + it.count * op.elem_size);
      std::memcpy(b.data(), &h, sizeof h);
      if (it.count != 0) std::memcpy(b.data() + sizeof h, it.buf, it.count * op.elem_size);
      store()->set(p2p_key(rank(), it.peer, number), b);
    }
    const auto deadline = Clock::now() + timeout();
    for (const P2PItem& it : items) {
      if (it.send) continue;
      const auto number = p2p_.next_recv(it.peer);
      const std::string key = p2p_key(it.peer, rank(), number);
      wait_for(key, it.peer, deadline, name);
      const Blob b = store()->get(key);
      comm::detail::P2PHeader h;
      if (b.size() < sizeof h)
        throw DesyncError(name, rank(), "a message of " + std::to_string(b.size()) + " bytes from rank " +
                                            std::to_string(it.peer) + " is shorter than its header",
                          "rank " + std::to_string(it.peer));
      std::memcpy(&h, b.data(), sizeof h);
      comm::detail::check_p2p_header(op, it, h, number, rank());
      if (b.size() != sizeof h + it.count * op.elem_size)
        throw DesyncError(name, rank(), "the message from rank " + std::to_string(it.peer) + " holds " +
                                            std::to_string(b.size() - sizeof h) + " payload bytes, not " +
                                            std::to_string(it.count * op.elem_size),
                          "rank " + std::to_string(it.peer));
      if (it.count != 0) std::memcpy(it.buf, b.data() + sizeof h, it.count * op.elem_size);
      (void)store()->delete_key(key);
    }
  }

  void exchange_fingerprints(std::uint64_t seq) {
    Op check;
    check.desc = OpDesc{OpKind::barrier, OpDesc::none, OpDesc::none, -2, 0};
    auto& all = fingerprints();
    const auto blobs = step(check, seq, &all[idx(rank())], sizeof(Fingerprint), "desync_check");
    for (int p = 0; p < size(); ++p)
      if (p != rank()) copy_payload(&all[idx(p)], blobs[idx(p)], sizeof(Fingerprint), p);
  }

  void close_transport() noexcept { closed_.store(true, std::memory_order_release); }

  /// Every rank says it leaves; the rank hosting the store then waits, at most kLinger, until every
  /// peer has said so: the store, this backend's transport, ends with that process, and a peer may
  /// still be reading this rank's blob of the last step (a barrier the host finished first failed
  /// with RemoteError on the peer: faults.relay, 2026-12-06). Not after a failure: the peers then
  /// fail by their own means, and not for a peer the store saw die. The host is known where the
  /// liveness watch ran (a root communicator on a TcpStore); elsewhere nobody waits.
  void linger() noexcept {
    constexpr auto kLinger = std::chrono::seconds(5);
    if (size() < 2 || has_failed() || closed_.load(std::memory_order_acquire)) return;
    try {
      store()->set(key_prefix() + "bye/" + std::to_string(rank()), Blob{1});
      if (store_host() != rank()) return;
      const auto deadline = Clock::now() + kLinger;
      for (int p = 0; p < size(); ++p) {
        if (p == rank()) continue;
        const std::string key = key_prefix() + "bye/" + std::to_string(p);
        // A peer that died says nothing: the store server keeps its death (its will) on a key of
        // its own, and the watch that would have failed this communicator has stopped.
        const std::string dead = comm::detail::Liveness::death_key(key_prefix(), p);
        while (!has_failed() && Clock::now() < deadline) {
          try {
            store()->wait({key}, std::chrono::milliseconds(50));
            break;
          } catch (const Timeout&) {
            if (store()->check({dead})) break;
          }
        }
      }
    } catch (...) {  // the store is gone: nothing to hold open
    }
  }

  // ---- the store steps ----

  [[nodiscard]] static std::size_t idx(int p) noexcept { return static_cast<std::size_t>(p); }

  [[nodiscard]] std::string step_key(std::uint64_t s, int p) const {
    return key_prefix() + "s/" + std::to_string(s) + "/" + std::to_string(p);
  }
  [[nodiscard]] std::string p2p_key(int from, int to, std::uint64_t number) const {
    return key_prefix() + "p/" + std::to_string(from) + "/" + std::to_string(to) + "/" + std::to_string(number);
  }

  /// One symmetric step: this rank's `bytes` at `data` out, every rank's blob in (this rank's too),
  /// each checked against this rank's fingerprint of `op`.
  std::vector<Blob> step(const Op& op, std::uint64_t seq, const void* data, std::size_t bytes,
                         const char* name = nullptr) {
    if (name == nullptr) name = comm::detail::op_name(op.desc.kind);
    // The step's own fingerprint: the desync check's exchange is kept apart from the operation.
    OpDesc d = op.desc;
    const Fingerprint fp = comm::detail::fingerprint(seq, d);
    const std::uint64_t s = ++steps_;
    Blob mine(sizeof fp + bytes);
    std::memcpy(mine.data(), &fp, sizeof fp);
    if (bytes != 0) std::memcpy(mine.data() + sizeof fp, data, bytes);
    store()->set(step_key(s, rank()), mine);
    const auto deadline = Clock::now() + timeout();
    std::vector<Blob> all(idx(size()));
    for (int p = 0; p < size(); ++p) {
      if (p == rank()) {
        all[idx(p)] = std::move(mine);
        continue;
      }
      const std::string key = step_key(s, p);
      wait_for(key, p, deadline, name);
      all[idx(p)] = store()->get(key);
      if (all[idx(p)].size() < sizeof fp || std::memcmp(all[idx(p)].data(), &fp, sizeof fp) != 0)
        throw DesyncError(name, rank(),
                          "rank " + std::to_string(p) + " is in another operation, or the same one with another "
                          "element type, count, root or reduction (their fingerprints differ at step " +
                              std::to_string(s) + ")",
                          "rank " + std::to_string(p));
    }
    if (s > 1) (void)store()->delete_key(step_key(s - 1, rank()));
    return all;
  }

  /// Waits for `key`, set by rank `peer`, until `deadline`, in slices so that a failure of the
  /// communicator (close_transport) ends the wait at once.
  void wait_for(const std::string& key, int peer, Clock::time_point deadline, const char* name) {
    constexpr auto slice = std::chrono::milliseconds(50);
    while (true) {
      if (closed_.load(std::memory_order_acquire))
        throw BackendError(name, rank(), "the communicator was closed while waiting for rank " + std::to_string(peer));
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0)
        throw Timeout(name, rank(),
                      "rank " + std::to_string(peer) + " did not take its part within " +
                          std::to_string(timeout().count()) + " ms",
                      "rank " + std::to_string(peer));
      try {
        store()->wait({key}, std::min<std::chrono::milliseconds>(slice, left));
        return;
      } catch (const Timeout&) {
        // a slice ended; look at the communicator and the deadline again
      }
    }
  }

  /// Copies `bytes` of payload from `blob` (rank `p`'s), which must hold exactly that many.
  void copy_payload(void* out, const Blob& blob, std::size_t bytes, int p) const {
    if (blob.size() != sizeof(Fingerprint) + bytes)
      throw DesyncError("relay", rank(), "rank " + std::to_string(p) + " sent " +
                                             std::to_string(blob.size() - sizeof(Fingerprint)) + " bytes, not " +
                                             std::to_string(bytes), "rank " + std::to_string(p));
    if (bytes != 0) std::memcpy(out, blob.data() + sizeof(Fingerprint), bytes);
  }

  /// out[0, count) = the reduction over ranks (in rank order) of elements [first, first + count)
  /// of each rank's blob.
  void reduce_into(const Op& op, void* out, const std::vector<Blob>& all, std::size_t first, std::size_t count) {
    const std::size_t e = op.elem_size;
    const int n = size();
    if (count == 0) return;
    std::vector<const void*> srcs(idx(n));
    for (int p = 0; p < n; ++p) {
      if (all[idx(p)].size() < sizeof(Fingerprint) + (first + count) * e)
        throw DesyncError("relay", rank(), "rank " + std::to_string(p) + " sent too few elements",
                          "rank " + std::to_string(p));
      srcs[idx(p)] = all[idx(p)].data() + sizeof(Fingerprint) + first * e;
    }
    if (n == 1) {
      std::memcpy(out, srcs[0], count * e);
    } else if (op.many != nullptr) {
      op.many(out, srcs.data(), n, count);
    } else if (op.custom != nullptr) {
      op.custom(op.custom_arg, out, srcs[0], srcs[1], count);
      for (int p = 2; p < n; ++p) op.custom(op.custom_arg, out, out, srcs[idx(p)], count);
    } else {
      op.kernel(out, srcs[0], srcs[1], count);
      for (int p = 2; p < n; ++p) op.kernel(out, out, srcs[idx(p)], count);
    }
    if (op.finish != nullptr) op.finish(out, count, n);
  }

  std::atomic<bool> closed_{false};
  std::uint64_t steps_ = 0;
  comm::detail::P2PCounters p2p_;
};

}  // namespace comm::test::relay

namespace comm::test {

/// Options of the relay backend: the common ones only.
struct RelayOptions : CommonOptions {};

/// The relay backend policy (see the file comment): its engine calls and its options, nothing
/// else. Move-only.
class Relay : public comm::detail::ForwardOps<Relay>,
              public comm::detail::BackendDiagnostics<Relay>,
              public comm::detail::Subgroups<Relay>,
              public comm::detail::Elastic<Relay>,
              public comm::detail::HostReductions {
 public:
  using backend_concept = comm::backend_t;
  static constexpr std::string_view name = "relay";
  using Options = RelayOptions;

  [[nodiscard]] static Relay create(std::shared_ptr<Store> store, int rank, int size, const Options& options = {}) {
    comm::detail::check_create("relay.init", store, rank, size, options);
    return Relay(std::make_unique<relay::Engine>(std::move(store), rank, size, comm::detail::core_config(options)),
                 options);
  }

  Relay(Relay&&) noexcept = default;
  Relay& operator=(Relay&&) noexcept = default;
  ~Relay() = default;

 private:
  friend class comm::detail::ForwardOps<Relay>;
  friend class comm::detail::BackendDiagnostics<Relay>;
  friend class comm::detail::Subgroups<Relay>;
  friend class comm::detail::Elastic<Relay>;

  Relay(std::unique_ptr<relay::Engine> e, Options o) noexcept : engine_(std::move(e)), options_(std::move(o)) {}

  /// Subgroup `g` relays through its own prefix of the parent's store (see Subgroups).
  Relay child(const comm::detail::Subgroup& g) const {
    return Relay(std::make_unique<relay::Engine>(g.store, g.place.rank, g.place.size,
                                                 g.configured(comm::detail::core_config(options_))),
                 options_);
  }

  std::unique_ptr<relay::Engine> engine_;
  Options options_;
};

}  // namespace comm::test
