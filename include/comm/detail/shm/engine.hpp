#pragma once
// The Shm engine behind comm::backends::Shm: collectives among the ranks of one host through one
// shared-memory segment (segment.hpp). Everything that is not about moving bytes — issue order,
// async Work, flight recorder, desync check, monitored_barrier, failure state — is the engine
// core's (detail/engine/core.hpp).
//
// The protocol (steps.hpp; waiting primitives in wait.hpp) and the algorithms written on it (here):
// a communicator-wide step counter, the same on every rank. In step s a rank writes its
// contribution into its header line s%kRing (up to kInline bytes), its body s%kBodyRing (up to
// kLaneBytes: every small operation) or its half s%2 (larger steps) and then publishes s in the
// header line (release store); a reader waits until the writer's header says s (acquire load)
// and reads. With the header line also goes the fingerprint of the step's operation (so a peer in
// another operation, or with another count, is a DesyncError on every rank, never a wrong read):
// an 8-byte all_reduce between two ranks moves one cache line each way.
//   - A half written in step s was last written in step s-2; a rank writes it only once every
//     peer has published s-1 (and so finished step s-2). A body is rewritten kBodyRing steps
//     later, once every peer has published the step after its last use; a header line kRing
//     steps later, once every peer has published s - kRing + kLag (segment.hpp): so a root of
//     small rooted operations runs up to kRing - kLag operations (kBodyRing - 1 with a body)
//     ahead of its slowest reader, where one pair of halves held it to one. In symmetric steps
//     all are already known from the previous step's wait, so they cost nothing.
//   - The first step of every operation of several steps is symmetric: every rank publishes and
//     reads every rank's header, so every rank sees every fingerprint and either all throw
//     DesyncError or none does (then the communicator stays usable: every rank consumed the same
//     step). Rooted operations of one step (broadcast, scatter, gather, reduce within one chunk)
//     skip it: a rank reads only the headers it needs (the root's, or the root reads everyone's)
//     and checks their fingerprints; a rank that did not read every peer's header leaves the step
//     unchecked, and compares it (steps.hpp, settle()) at the entry of its next operation that is
//     not a one-step rooted one, or at the latest kLag steps later, and throws the DesyncError
//     before it publishes anything of that operation. Nothing is ever read from a peer in
//     another operation.
//   - Large all_reduce, all_gather, all_to_all, broadcast, scatter, gather, reduce and
//     reduce_scatter read the peers' buffers directly with process_vm_readv, or write a reduced
//     slice into them with process_vm_writev (single copy; see cma.hpp), framed by symmetric
//     steps that carry the buffer addresses and say when a buffer may be overwritten or released.
// Algorithms:
//   - all_reduce, <= small_max bytes: one step; each rank reduces all inputs (n-input kernels,
//     reduce.hpp: half/bfloat16/fp8 accumulate in float).
//   - all_reduce, larger: per chunk two steps, a direct reduce-scatter (each rank reduces its
//     slice of the chunk from every rank's half) and an all-gather of the reduced slices; chunks
//     of `chunk` bytes keep the working set in cache and let ranks run a step apart.
//   - reduce_scatter, all_gather, gather: one step per chunk; broadcast: one step per chunk with
//     the root one step ahead at most.
// Waiting: spin (with pause; long where the peer runs on another CPU, short where it shares this
// one: steps.hpp), then yield for up to 2 ms, then sleep on a futex in the peer's
// control line with bounded slices; a publisher wakes only when a sleeper announced itself, so the fast path
// has no syscall, and where every rank registered for membarrier the publish has no fence either:
// the sleeper fences the publishers before it sleeps (wait.hpp). In the sleeping phase the waiter checks the deadline, the abort words and whether
// the peer's process still exists (pidfd, or kill(pid, 0) where pidfds are missing), so a SIGKILLed
// peer is seen within a slice (10 ms), a stopped one by the deadline.

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <comm/detail/base/copy.hpp>
#include <comm/detail/diagnostics/desync.hpp>
#include <comm/detail/engine/core.hpp>
#include <comm/detail/base/env.hpp>
#include <comm/detail/shm/cma.hpp>
#include <comm/detail/shm/segment.hpp>
#include <comm/detail/shm/steps.hpp>
#include <comm/detail/shm/wait.hpp>
#include <comm/error.hpp>
#include <comm/store.hpp>

namespace comm::detail::shm {

struct EngineConfig : CoreConfig {
  std::size_t chunk = 0;      // payload bytes per half
  std::size_t small_max = 0;  // all_reduce: one step up to this many bytes
  int spin = -1;              // spins before yielding (-1: from the load)
};

class Engine : public EngineCore<Engine>, private Steps, private SingleCopy<Engine> {
  using Core = EngineCore<Engine>;
  using Clock = std::chrono::steady_clock;

 public:
  Engine(std::shared_ptr<comm::Store> store, int rank, int size, const EngineConfig& cfg)
      : Core(std::move(store), rank, size, cfg, "shm"),
        Steps(rank, size, timeout(), cfg.chunk),
        small_max_(std::min(cfg.small_max, cfg.chunk)),
        srcs_(static_cast<std::size_t>(size)) {
    host_buffers_only("use Communicator<backends::Nccl>, or Gloo, which stages device buffers");
    map_ = rendezvous(*Core::store(), key_prefix(), rank, layout_, timeout());
    header_ = reinterpret_cast<Header*>(map_.base());
    ctl(rank).pid = static_cast<std::int64_t>(::getpid());
    // Touch this rank's halves here, so that their pages are on this rank's NUMA node.
    std::memset(static_cast<void*>(half(rank, 0)), 0, 2 * layout_.half_bytes);
    std::memset(static_cast<void*>(slot(rank, 0)), 0, kRing * kLine);
    std::memset(static_cast<void*>(body(rank, 0)), 0, kBodyRing * kLaneBytes);
    spin_ = cfg.spin >= 0 ? cfg.spin : default_spin(size);
    spin_now_ = spin_;
    // One step that every rank takes: afterwards every pid is published.
    fp_ = fingerprint(0, OpDesc{OpKind::barrier, OpDesc::none, OpDesc::none, -1, 0});
    ctl(rank).probe = reinterpret_cast<std::uintptr_t>(&probe_);
    ctl(rank).peer_fence = env_nonneg_int("COMM_SHM_MEMBARRIER").value_or(1) != 0 && register_peer_fence() ? 1 : 0;
    run("shm.init", [&] {
      op_name_ = "shm.init";
      const std::uint64_t s = next_step();
      publish(s);
      wait_all(s);
    });
    // Publishes go without a fence only where every rank's waits fence the others (wait.hpp).
    peer_fence_ = true;
    for (int p = 0; p < size; ++p) peer_fence_ = peer_fence_ && ctl(p).peer_fence == 1;
    for (int p = 0; p < size; ++p)
      if (p != rank) watch_[static_cast<std::size_t>(p)] = ProcessWatch(ctl(p).pid);
    if (size > 1) run("shm.init", [&] { agree_cma(); });
  }

  ~Engine() {
    shutdown();
    if (header_ != nullptr) {
      // Peers still waiting on this rank (a mismatched program) learn at once that it left.
      ctl(rank()).left.store(1, std::memory_order_seq_cst);
      ring(rank());
    }
  }

  [[nodiscard]] std::size_t chunk_bytes() const noexcept { return layout_.chunk; }
  /// Whether large messages move by cross-memory attach (single copy) on this communicator.
  [[nodiscard]] bool single_copy() const noexcept { return cma_on_; }

 private:
  friend Core;
  friend SingleCopy<Engine>;

  // ---- the engine calls the core makes ----

  void perform(Op& op, std::uint64_t seq) {
    fp_ = fingerprint(seq, op.desc);
    op_seq_ = seq;
    op_name_ = op_name(op.desc.kind);
    if (one_step_rooted(op))
      settle(false, step_ + 1);
    else
      settle(true);
    dispatch(op, seq);
  }

  void dispatch(Op& op, std::uint64_t seq) {
    switch (op.desc.kind) {
      case OpKind::all_reduce: return do_all_reduce(op);
      case OpKind::reduce_scatter: return do_reduce_scatter(op);
      case OpKind::all_gather:
      case OpKind::split: return do_all_gather(op);
      case OpKind::broadcast: return do_broadcast(op);
      case OpKind::gather: return do_gather(op);
      case OpKind::barrier: {
        const std::uint64_t s = next_step();
        publish(s);
        wait_all(s);
        return;
      }
      case OpKind::scatter: return do_scatter(op);
      case OpKind::all_to_all: return do_all_to_all(op);
      case OpKind::reduce:
        if (use_cma_reduce(op.in_count * op.elem_size)) return cma_reduce(op);
        if (op.in_count * op.elem_size <= layout_.chunk) return do_reduce(op);
        return Core::compose(op, seq);  // as an all_reduce
      default: return Core::compose(op, seq);  // all_to_all_v
    }
  }

  /// Point-to-point through the channels of the segment (segment.hpp): each (sender, receiver)
  /// pair has two slots; a message is one or more chunks, the first carrying its P2PHeader, checked
  /// before a byte is copied out. Every item of the batch progresses in one loop (those of one
  /// peer and direction in order), so a batch that exchanges in both directions cannot deadlock.
  ///
  /// A chunk is ready when its slot's first word holds its number + 1: the receiver polls the line
  /// that carries the header, the length and a payload of up to kP2PInline bytes, so a small
  /// message costs it one line from the sender instead of three (a separate counter, the header,
  /// the payload). The sender's store needs no fence where every rank fences its peers before it
  /// sleeps (peer_fence_, as publish()); the call allocates nothing and reads the clock only once
  /// a wait outlasts its spin. A 2-rank ping-pong of 8 B went from 0.58-0.67 to 0.30-0.31 us one
  /// way (OpenMPI 0.24-0.31), 4 KiB from 1.18-1.29 to 0.90-0.94 (benchmarks/RESULTS.md, "Shm
  /// point-to-point: one line per small message").
  void perform_p2p(const Op& op, std::span<P2PItem> items) {
    op_name_ = op_name(op.desc.kind);
    const std::size_t n = items.size();
    const std::size_t e = op.elem_size;
    // Read the clock only once a wait outlasts its spin (a call that never waits takes no time
    // from it): the deadline then runs from the first such wait, at most one spin late.
    auto deadline = Clock::time_point::max();
    // Per item: bytes moved, (receives) its message number, whether it started and finished;
    // kept between calls, so a call allocates nothing once a batch of its size has run.
    p2p_items_.assign(n, P2PProgress{});
    std::size_t left = n;
    // The item each (peer, direction) works on: the first unfinished one in batch order.
    auto first_of = [&](std::size_t i) {
      for (std::size_t j = 0; j < i; ++j)
        if (!p2p_items_[j].finished && items[j].peer == items[i].peer && items[j].send == items[i].send) return false;
      return true;
    };
    auto can_move = [&](const P2PItem& it) {
      if (it.send) {
        const ChannelCtl& c = channel(rank(), it.peer);
        return c.posted.load(std::memory_order_relaxed) - c.taken.load(std::memory_order_acquire) < 2;
      }
      const std::uint64_t taken = channel(it.peer, rank()).taken.load(std::memory_order_relaxed);
      return chunk_no(channel_slot(it.peer, rank(), taken)).load(std::memory_order_acquire) == taken + 1;
    };
    auto step = [&](std::size_t i) -> bool {  // true when it moved a chunk
      const P2PItem& it = items[i];
      P2PProgress& g = p2p_items_[i];
      const std::size_t bytes = it.count * e;
      if (it.send) {
        ChannelCtl& c = channel(rank(), it.peer);
        const std::uint64_t posted = c.posted.load(std::memory_order_relaxed);
        if (posted - c.taken.load(std::memory_order_acquire) >= 2) return false;
        if (!g.started) {
          g.started = true;
          g.number = p2p_numbers_.next_send(it.peer);
        }
        std::byte* slot = channel_slot(rank(), it.peer, posted);
        const std::size_t m = std::min(layout_.p2p_chunk, bytes - g.done);
        if (g.done == 0) {
          const P2PHeader h = p2p_header(op, it, g.number);
          std::memcpy(slot + kP2PHeaderAt, &h, sizeof h);
        }
        std::memcpy(slot + kP2PBytesAt, &m, sizeof m);
        copy(slot + (m <= kP2PInline ? kP2PInlineAt : kLine), static_cast<const std::byte*>(it.buf) + g.done, m);
        c.posted.store(posted + 1, std::memory_order_relaxed);  // read by this rank only
        chunk_no(slot).store(posted + 1, peer_fence_ ? std::memory_order_release : std::memory_order_seq_cst);
        wake_sleepers();
        g.done += m;
        if (g.done == bytes) g.finished = true;
        return true;
      }
      ChannelCtl& c = channel(it.peer, rank());
      const std::uint64_t taken = c.taken.load(std::memory_order_relaxed);
      const std::byte* slot = channel_slot(it.peer, rank(), taken);
      if (chunk_no(slot).load(std::memory_order_acquire) != taken + 1) return false;
      if (!g.started) {
        g.started = true;
        g.number = p2p_numbers_.next_recv(it.peer);
        P2PHeader h;
        std::memcpy(&h, slot + kP2PHeaderAt, sizeof h);
        check_p2p_header(op, it, h, g.number, rank());
      }
      std::size_t m = 0;
      std::memcpy(&m, slot + kP2PBytesAt, sizeof m);
      if (m > bytes - g.done || (m == 0 && bytes != 0))
        throw DesyncError(op_name_, rank(), "rank " + std::to_string(it.peer) + " sent a chunk of " +
                                                std::to_string(m) + " bytes where " + std::to_string(bytes - g.done) +
                                                " were left of the message", "rank " + std::to_string(it.peer));
      copy(static_cast<std::byte*>(it.buf) + g.done, slot + (m <= kP2PInline ? kP2PInlineAt : kLine), m);
      c.taken.store(taken + 1, peer_fence_ ? std::memory_order_release : std::memory_order_seq_cst);
      wake_sleepers();
      g.done += m;
      if (g.done == bytes) g.finished = true;
      return true;
    };
    int idle = 0;
    auto yield_until = Clock::time_point::max();  // the spin ran out: yield until then, then sleep
    while (left != 0) {
      bool moved = false;
      for (std::size_t i = 0; i < n; ++i) {
        if (p2p_items_[i].finished || !first_of(i)) continue;
        while (!p2p_items_[i].finished && step(i)) moved = true;
        if (p2p_items_[i].finished) --left;
      }
      if (left == 0) break;
      if (moved) {
        note_cpu();  // the peers' spins on this rank follow where it runs (steps.hpp, spin_ran_out)
        idle = 0;
        yield_until = Clock::time_point::max();
        continue;
      }
      // Nothing could move: spin, then yield, then sleep on the bell of a peer this rank waits
      // for (bounded slices), checking that the peers are alive and the deadline.
      if (idle < spin_now_) {
        ++idle;
        cpu_relax();
        continue;
      }
      int peer = -1;
      for (std::size_t i = 0; i < n; ++i)
        if (!p2p_items_[i].finished && first_of(i)) peer = items[i].peer;
      // Spun in vain: the next spin is short only if the peer shares this CPU (a long spin then
      // holds the CPU the peer needs: 2000 pauses, ~60 us, per message).
      if (idle == spin_now_) {
        spin_ran_out(peer);
        if (yield_until == Clock::time_point::max()) {
          const auto now = Clock::now();
          yield_until = now + kYieldPhase;
          if (deadline == Clock::time_point::max()) deadline = now + timeout();
        }
      }
      const bool sleep = Clock::now() >= yield_until;
      if (!sleep) {
        std::this_thread::yield();
        if (++idle % 64 != 0) continue;
      } else {
        RankCtl& b = ctl(peer);
        b.sleepers.fetch_add(1, std::memory_order_seq_cst);
        const std::uint32_t bell = b.bell.load(std::memory_order_seq_cst);
        if (peer_fence_) fence_peers();  // the peer's stores were not fenced: order them now
        bool ready = false;
        for (std::size_t i = 0; i < n && !ready; ++i)
          ready = !p2p_items_[i].finished && first_of(i) && can_move(items[i]);
        // Several peers: short slices, since only `peer`'s bell wakes this rank early.
        const auto slice = std::chrono::duration_cast<std::chrono::nanoseconds>(
            left == 1 ? std::chrono::nanoseconds(kSlice) : std::chrono::nanoseconds(std::chrono::microseconds(200)));
        if (!ready) futex_wait(&b.bell, bell, std::min<std::chrono::nanoseconds>(slice, std::max<Clock::duration>(deadline - Clock::now(), {})));
        b.sleepers.fetch_sub(1, std::memory_order_seq_cst);
      }
      for (std::size_t i = 0; i < n; ++i) {
        if (p2p_items_[i].finished || !first_of(i)) continue;
        const P2PItem& it = items[i];
        (void)check_peer(it.peer, deadline, sleep, [&] { return can_move(it); }, [&] {
          return std::string(" (") + (it.send ? "sending " : "receiving ") + std::to_string(it.count) +
                 " elements with tag " + std::to_string(it.tag) + (it.send ? " to" : " from") + " rank " +
                 std::to_string(it.peer) + ")";
        });
      }
    }
  }

  void exchange_fingerprints(std::uint64_t seq) {
    // One symmetric step whose operation fingerprint is the check's own; the fingerprints travel
    // as payload.
    fp_ = fingerprint(seq, OpDesc{OpKind::barrier, OpDesc::none, OpDesc::none, -2, 0});
    op_seq_ = seq;
    op_name_ = "desync_check";
    settle(true);
    auto& all = fingerprints();
    const std::uint64_t s = next_step();
    copy(begin(s, sizeof(Fingerprint)), &all[static_cast<std::size_t>(rank())], sizeof(Fingerprint));
    publish(s);
    wait_all(s);
    for (int p = 0; p < size(); ++p)
      if (p != rank()) std::memcpy(&all[static_cast<std::size_t>(p)], payload(p, s, sizeof(Fingerprint)), sizeof(Fingerprint));
  }

  /// Tells every peer that this communicator failed (their waits end with RemoteError naming this
  /// rank, unless a dead rank was named first) and wakes them. A peer whose process is gone without
  /// leaving the communicator is named dead first: this rank's failure is most likely its echo (the
  /// liveness watch or a read of its buffer saw the death before the others' waits did), and the
  /// others should report the cause, not this rank.
  void close_transport() noexcept {
    if (header_ == nullptr) return;
    // Exited first, then left: a peer that left and then exited between the two reads would
    // otherwise be taken for dead.
    for (int p = 0; p < size(); ++p)
      if (p != rank() && watch_[static_cast<std::size_t>(p)].exited() && ctl(p).left.load(std::memory_order_acquire) == 0) {
        declare_dead(p);
        break;
      }
    std::uint32_t none = 0;
    (void)header_->abort.compare_exchange_strong(none, static_cast<std::uint32_t>(rank() + 1));
    for (int p = 0; p < size(); ++p) ring(p);
  }

  // ---- algorithms ----

  // memcpy/memmove of `bytes`, nothing for 0 (an empty buffer's data() may be null); in pieces
  // where the two addresses would put glibc's `rep movsb` on its slow path (base/copy.hpp).
  static void copy(void* dst, const void* src, std::size_t bytes) noexcept { copy_bytes(dst, src, bytes); }
  static void move(void* dst, const void* src, std::size_t bytes) noexcept { move_bytes(dst, src, bytes); }
  /// A large block that every rank moves at once (base/copy.hpp, copy_large_bytes).
  static void move_large(void* dst, const void* src, std::size_t bytes) noexcept { move_large_bytes(dst, src, bytes); }

  /// Elements per step for element size `e` when each rank writes `pieces` pieces per step.
  [[nodiscard]] std::size_t per_step(std::size_t e, std::size_t pieces = 1) const noexcept {
    return std::max<std::size_t>(layout_.chunk / (e * pieces), 1);
  }

  /// How a step's payload holds a piece for each other rank (reduce_scatter, all_to_all, scatter).
  /// A rank's own piece never goes through the segment. Where the operation's input is larger
  /// than a body (kLaneBytes), its slot is left out, so that at 2 ranks up to twice that still
  /// goes through a body (a ring of kBodyRing) rather than a half, whose writer first waits for
  /// every peer to leave the step before (measured with bodies of 16 KiB: 2-rank all_to_all of 24
  /// / 31 KiB 2.76 / 3.30 against 2.40 / 2.80 us, OpenMPI 2.48 / 2.80; scatter 1.41 / 1.87 against
  /// 0.97 / 1.35). Smaller operations keep the slot: without it a 2-rank all_to_all of 4 KiB took
  /// 1.27 against 1.15 us (one binary, the two layouts in turn; its pieces' offsets move, and why
  /// that costs was not found). (benchmarks/RESULTS.md, "A payload without the own piece".)
  struct Pieces {
    std::size_t count;  // pieces per payload
    bool compact;       // no slot for the writer's own piece
    /// Where `writer`'s payload holds its piece for rank `dest` (dest != writer).
    [[nodiscard]] std::size_t at(std::size_t dest, std::size_t writer) const noexcept {
      return compact && dest > writer ? dest - 1 : dest;
    }
  };
  /// The layout for an operation whose input (every rank's, or the root's) is `total` bytes.
  [[nodiscard]] Pieces pieces_for(std::size_t total) const noexcept {
    const auto un = static_cast<std::size_t>(size());
    const bool compact = un > 1 && total > kLaneBytes;
    return {compact ? un - 1 : un, compact};
  }

  /// Whether a symmetric step's own block (all_gather, all_to_all) is copied between the publish
  /// and the wait, while the peers' steps may still be on their way, rather than after the wait.
  /// Only where every rank has a core: where ranks share cores a rank should reach its wait, and
  /// give up the core to a peer that has yet to publish, as soon as it can. One binary, the order
  /// switched by the environment, 16 rounds of the 2-4 rank all_gather, 4-64 KiB (Intel Xeon VM):
  /// at 2 ranks early took 8 / 16 / 30 KiB in 1.17 / 1.62 / 2.36 us against 1.19 / 1.75 / 2.71
  /// after the wait; at 3 and 4 ranks on the 2 cores early was the slowest order, 16 KiB 5.97
  /// against 5.17 us at 3, 7.52 against 6.46 at 4 (benchmarks/RESULTS.md, "The own block before
  /// the wait").
  [[nodiscard]] bool own_block_early() const noexcept { return cma_own_core_; }

  /// Runs `f(off, c)` over [0, m) in chunks of at most `k` elements; once (c = 0) when m is 0,
  /// so that every rank takes the operation's steps whatever its count.
  template <class F>
  static void by_chunks(std::size_t m, std::size_t k, F&& f) {
    std::size_t off = 0;
    do {
      const std::size_t c = std::min(k, m - off);
      f(off, c);
      off += c;
    } while (off < m);
  }

  /// out = reduction of srcs_[0..n) over `count` elements with op's kernels; `finish` (avg) too.
  void reduce_from(const Op& op, void* out, std::size_t count, bool finish) {
    const int n = size();
    if (count == 0) return;
    if (n == 1) {
      if (out != srcs_[0]) copy(out, srcs_[0], count * op.elem_size);
    } else if (op.many != nullptr) {
      op.many(out, srcs_.data(), n, count);
    } else {
      // A custom callable, folded from the left in rank order: every rank that reduces the same
      // elements applies the same operands in the same order, so all get the same bits even for
      // a callable that is not associative (float sums) or not commutative. When `out` is rank
      // k's input (in place) and k > 1, `out` cannot hold the fold before input k is used: the
      // callable is element-wise, so the fold runs block by block in scratch. (k = 1 is the first
      // step's operand, read at each index before that index is written.)
      int acc = -1;
      for (int k = 0; k < n; ++k)
        if (srcs_[static_cast<std::size_t>(k)] == out) acc = k;
      if (acc <= 1) {
        op.custom(op.custom_arg, out, srcs_[0], srcs_[1], count);
        for (int k = 2; k < n; ++k) op.custom(op.custom_arg, out, out, srcs_[static_cast<std::size_t>(k)], count);
      } else {
        fold_in_scratch(op, static_cast<std::byte*>(out), count);
      }
    }
    if (finish && op.finish != nullptr) op.finish(out, count, n);
  }

  /// reduce_from's custom fold where `out` is input 2 or later: each block of elements is
  /// folded in scratch that stays in the cache, then copied over `out`'s block.
  void fold_in_scratch(const Op& op, std::byte* out, std::size_t count) {
    const std::size_t e = op.elem_size;
    const std::size_t per = std::max<std::size_t>(kFoldBlock / e, 1);
    if (fold_.size() < per * e) fold_.resize(per * e);
    std::byte* tmp = fold_.data();
    const int n = size();
    for (std::size_t off = 0; off < count; off += per) {
      const std::size_t c = std::min(per, count - off);
      auto src = [&](int k) { return static_cast<const std::byte*>(srcs_[static_cast<std::size_t>(k)]) + off * e; };
      op.custom(op.custom_arg, tmp, src(0), src(1), c);
      for (int k = 2; k < n; ++k) op.custom(op.custom_arg, tmp, tmp, src(k), c);
      copy(out + off * e, tmp, c * e);
    }
  }
  static constexpr std::size_t kFoldBlock = 16 << 10;

  void do_all_reduce(Op& op) {
    const std::size_t e = op.elem_size;
    const std::size_t count = op.out_count;
    const auto* in = static_cast<const std::byte*>(op.in);
    auto* out = static_cast<std::byte*>(op.out);
    const int n = size();
    if (use_cma(count * e) && count * e > small_max_) return cma_all_reduce(op);
    if (count * e <= small_max_) {
      const std::uint64_t s = next_step();
      copy(begin(s, count * e), in, count * e);
      publish(s);
      wait_all(s);
      for (int p = 0; p < n; ++p) srcs_[static_cast<std::size_t>(p)] = p == rank() ? in : payload(p, s, count * e);
      reduce_from(op, out, count, true);
      return;
    }
    // Chunks of k elements; in each, rank p reduces slice p (cache-line aligned) and all gather.
    const std::size_t k = per_step(e);
    const std::size_t align = std::max<std::size_t>(kLine / e, 1);
    for (std::size_t off = 0; off < count; off += k) {
      const std::size_t m = std::min(k, count - off);
      const std::size_t q = ((m + static_cast<std::size_t>(n) - 1) / static_cast<std::size_t>(n) + align - 1) / align * align;
      const std::size_t lo = std::min(m, q * static_cast<std::size_t>(rank()));
      const std::size_t hi = std::min(m, lo + q);
      const std::uint64_t a = next_step();
      // The peers read their slices of this rank's chunk; its own slice it reads from `in`.
      std::byte* staged = begin(a, m * e);
      copy(staged, in + off * e, lo * e);
      copy(staged + hi * e, in + (off + hi) * e, (m - hi) * e);
      publish(a);
      wait_all(a);
      const std::uint64_t b = next_step();
      // Half b%2 was last read in step a-1, which every peer has left (they published a).
      for (int p = 0; p < n; ++p)
        srcs_[static_cast<std::size_t>(p)] = (p == rank() ? in + off * e : payload(p, a, m * e)) + lo * e;
      std::byte* mine = payload(rank(), b, m * e) + lo * e;
      reduce_from(op, mine, hi - lo, true);
      publish(b);
      // Own slice: copied after the reduction, since `out` may be `in` (the other ranks' slices of
      // `in` were read from the halves, this rank's from `in` itself).
      copy(out + (off + lo) * e, mine, (hi - lo) * e);
      for (int p = 0; p < n; ++p) {
        if (p == rank()) continue;
        wait_step(p, b);
        const std::size_t plo = std::min(m, q * static_cast<std::size_t>(p));
        const std::size_t phi = std::min(m, plo + q);
        copy(out + (off + plo) * e, payload(p, b, m * e) + plo * e, (phi - plo) * e);
      }
    }
  }

  void do_reduce_scatter(Op& op) {
    const std::size_t e = op.elem_size;
    const std::size_t m = op.out_count;  // per rank
    const int n = size();
    const auto* in = static_cast<const std::byte*>(op.in);
    auto* out = static_cast<std::byte*>(op.out);
    if (use_cma_reduce_scatter(static_cast<std::size_t>(n) * m * e)) return cma_reduce_scatter(op);
    const Pieces pieces = pieces_for(static_cast<std::size_t>(n) * m * e);
    const std::size_t k = per_step(e, pieces.count);
    const auto me = static_cast<std::size_t>(rank());
    const std::byte* own = in + me * m * e;
    // This rank's own piece is reduced from `in`, not copied into the segment where nobody else
    // reads it (at 2 ranks half the bytes; 8 B-16 KiB took 0.72-0.85x the time).
    by_chunks(m, k, [&](std::size_t off, std::size_t c) {
      const std::uint64_t s = next_step();
      const std::size_t bytes = pieces.count * c * e;
      std::byte* mine = begin(s, bytes);
      // Piece r of this step: in[r*m + off, +c), at pieces.at(r, me) * c in the payload.
      for (std::size_t r = 0; r < static_cast<std::size_t>(n); ++r)
        if (r != me) copy(mine + pieces.at(r, me) * c * e, in + (r * m + off) * e, c * e);
      publish(s);
      wait_all(s);
      for (std::size_t p = 0; p < static_cast<std::size_t>(n); ++p)
        srcs_[p] = p == me ? own + off * e : payload(static_cast<int>(p), s, bytes) + pieces.at(me, p) * c * e;
      reduce_from(op, out + off * e, c, true);
    });
  }

  void do_all_gather(Op& op) {
    const std::size_t e = op.elem_size;
    const std::size_t m = op.in_count;
    const int n = size();
    if (use_cma_all_gather(m * e * static_cast<std::size_t>(n))) return cma_all_gather(op);
    const auto* in = static_cast<const std::byte*>(op.in);
    auto* out = static_cast<std::byte*>(op.out);
    const std::size_t k = per_step(e);
    by_chunks(m, k, [&](std::size_t off, std::size_t c) {
      const std::uint64_t s = next_step();
      copy(begin(s, c * e), in + off * e, c * e);
      publish(s);
      std::byte* own = out + (static_cast<std::size_t>(rank()) * m + off) * e;
      const bool early = own_block_early();
      if (early && own != in + off * e) move(own, in + off * e, c * e);
      wait_all(s);
      for (int p = 0; p < n; ++p) {
        if (p != rank())
          copy(out + (static_cast<std::size_t>(p) * m + off) * e, payload(p, s, c * e), c * e);
        else if (!early && own != in + off * e)
          move(own, in + off * e, c * e);
      }
    });
  }

  /// Whether `op` is a rooted operation of one step (what dispatch does with it): its entry need
  /// not wait for the peers' fingerprints of recent unchecked steps (settle).
  [[nodiscard]] bool one_step_rooted(const Op& op) const noexcept {
    const std::size_t e = op.elem_size;
    switch (op.desc.kind) {
      case OpKind::broadcast: return !use_cma_broadcast(op.out_count * e) && op.out_count <= per_step(e);
      case OpKind::scatter:
        return !use_cma_rooted(op.out_count * e) &&
               op.out_count <= per_step(e, pieces_for(static_cast<std::size_t>(size()) * op.out_count * e).count);
      case OpKind::gather: return !use_cma_rooted(op.in_count * e) && op.in_count <= per_step(e);
      case OpKind::reduce: return !use_cma_reduce(op.in_count * e) && op.in_count * e <= layout_.chunk;
      default: return false;
    }
  }

  /// Publishes step `s` of an operation whose data comes from `root`. In an operation of one step
  /// only the other ranks wait, for the root, and check its fingerprint; the root leaves the step
  /// unchecked (settle() compares it at the next operation). In an operation of several steps the
  /// first is symmetric (every rank sees every fingerprint, so a mismatched operation ends after
  /// one step on every rank, whatever its length); after it only the other ranks wait.
  void rooted_step(std::uint64_t s, int root, bool& first, bool one_step) {
    publish(s);
    if (one_step) {
      if (rank() != root) wait_step(root, s);
      if (rank() == root || size() > 2) leave_unchecked(s);
      take_next_line(s);
    } else if (first) {
      wait_all(s);
    } else if (rank() != root) {
      wait_step(root, s);
    }
    first = false;
  }

  /// One step per chunk: piece p of this rank's payload is its block for rank p; every rank reads
  /// its piece of every peer's payload.
  void do_all_to_all(Op& op) {
    const std::size_t e = op.elem_size;
    const auto un = static_cast<std::size_t>(size());
    const std::size_t m = op.in_count / un;  // per block
    const auto* in = static_cast<const std::byte*>(op.in);
    auto* out = static_cast<std::byte*>(op.out);
    const auto me = static_cast<std::size_t>(rank());
    // The facade forbids overlapping buffers; a composed caller that passes them takes the
    // segment path, which copies every block out before any is written.
    const std::size_t bytes = op.in_count * e;
    const auto i0 = reinterpret_cast<std::uintptr_t>(in), o0 = reinterpret_cast<std::uintptr_t>(out);
    if (use_cma_all_to_all(bytes) && (i0 + bytes <= o0 || o0 + bytes <= i0)) return cma_all_to_all(op);
    const Pieces pieces = pieces_for(bytes);
    const std::size_t k = per_step(e, pieces.count);
    by_chunks(m, k, [&](std::size_t off, std::size_t c) {
      const std::uint64_t s = next_step();
      std::byte* mine = begin(s, pieces.count * c * e);
      for (std::size_t r = 0; r < un; ++r)
        if (r != me) copy(mine + pieces.at(r, me) * c * e, in + (r * m + off) * e, c * e);
      publish(s);
      const bool early = own_block_early();
      if (early) copy(out + (me * m + off) * e, in + (me * m + off) * e, c * e);
      wait_all(s);
      for (std::size_t p = 0; p < un; ++p) {
        if (p != me)
          copy(out + (p * m + off) * e, payload(static_cast<int>(p), s, pieces.count * c * e) + pieces.at(me, p) * c * e, c * e);
        else if (!early)
          copy(out + (me * m + off) * e, in + (me * m + off) * e, c * e);
      }
    });
  }

  /// broadcast's pattern with pieces: the root's payload holds a piece for every rank.
  void do_scatter(Op& op) {
    const std::size_t e = op.elem_size;
    const auto un = static_cast<std::size_t>(size());
    const std::size_t m = op.out_count;
    const int root = op.desc.root;
    const auto me = static_cast<std::size_t>(rank());
    const auto* in = static_cast<const std::byte*>(op.in);
    auto* out = static_cast<std::byte*>(op.out);
    if (use_cma_rooted(m * e)) return cma_scatter(op);
    const Pieces pieces = pieces_for(un * m * e);
    const std::size_t k = per_step(e, pieces.count);
    const auto uroot = static_cast<std::size_t>(root);
    bool first = true;
    by_chunks(m, k, [&](std::size_t off, std::size_t c) {
      const std::uint64_t s = next_step();
      if (rank() == root) {
        std::byte* mine = begin(s, pieces.count * c * e);
        for (std::size_t r = 0; r < un; ++r)
          if (r != me) copy(mine + pieces.at(r, me) * c * e, in + (r * m + off) * e, c * e);
      }
      rooted_step(s, root, first, m <= k);
      const std::byte* src = rank() == root ? in + (me * m + off) * e
                                            : payload(root, s, pieces.count * c * e) + pieces.at(me, uroot) * c * e;
      if (src != out + off * e) move(out + off * e, src, c * e);
    });
  }

  void do_broadcast(Op& op) {
    const std::size_t e = op.elem_size;
    const std::size_t m = op.out_count;
    const int root = op.desc.root;
    auto* data = static_cast<std::byte*>(op.out);
    if (use_cma_broadcast(m * e)) return cma_broadcast(op);
    const std::size_t k = per_step(e);
    bool first = true;
    by_chunks(m, k, [&](std::size_t off, std::size_t c) {
      const std::uint64_t s = next_step();
      if (rank() == root) copy(begin(s, c * e), data + off * e, c * e);
      rooted_step(s, root, first, m <= k);
      if (rank() != root) copy(data + off * e, payload(root, s, c * e), c * e);
    });
  }

  void do_gather(Op& op) {
    const std::size_t e = op.elem_size;
    const std::size_t m = op.in_count;
    const int n = size();
    const int root = op.desc.root;
    const auto* in = static_cast<const std::byte*>(op.in);
    auto* out = static_cast<std::byte*>(op.out);
    if (use_cma_rooted(m * e)) return cma_gather(op);
    const std::size_t k = per_step(e);
    bool first = true;
    by_chunks(m, k, [&](std::size_t off, std::size_t c) {
      const std::uint64_t s = next_step();
      if (rank() != root) copy(begin(s, c * e), in + off * e, c * e);
      publish(s);
      // One step: the root reads (and checks) every peer, the others leave the step unchecked.
      // Several: the first step is symmetric (rooted_step).
      if (m <= k) {
        if (rank() != root) leave_unchecked(s);
      } else if (first) {
        wait_all(s);
      }
      first = false;
      if (rank() == root) {
        for (int p = 0; p < n; ++p) {
          std::byte* dst = out + (static_cast<std::size_t>(p) * m + off) * e;
          if (p == rank()) {
            if (dst != in + off * e) move(dst, in + off * e, c * e);
            continue;
          }
          wait_step(p, s);
          copy(dst, payload(p, s, c * e), c * e);
        }
      }
      if (m <= k) take_next_line(s);
    });
  }

  /// reduce in one step (its buffer fits a half): the others publish their input and return, the
  /// root reduces every input (checking each fingerprint) into `out`.
  void do_reduce(Op& op) {
    const std::size_t count = op.in_count;
    const int root = op.desc.root;
    const std::uint64_t s = next_step();
    if (rank() != root) {
      copy(begin(s, count * op.elem_size), op.in, count * op.elem_size);
      publish(s);
      leave_unchecked(s);
      take_next_line(s);
      return;
    }
    publish(s);
    for (int p = 0; p < size(); ++p) {
      if (p != rank()) wait_step(p, s);
      srcs_[static_cast<std::size_t>(p)] = p == rank() ? op.in : payload(p, s, count * op.elem_size);
    }
    reduce_from(op, op.out, count, true);
    take_next_line(s);
  }

  // A channel slot's header line: the chunk's number + 1 (its ready word), the message's P2PHeader
  // (first chunk), the chunk's bytes, then the payload of a chunk of up to kP2PInline bytes; a
  // larger chunk's payload follows the line.
  static constexpr std::size_t kP2PHeaderAt = sizeof(std::uint64_t);
  static constexpr std::size_t kP2PBytesAt = kP2PHeaderAt + sizeof(P2PHeader);
  static constexpr std::size_t kP2PInlineAt = kP2PBytesAt + sizeof(std::size_t);
  static constexpr std::size_t kP2PInline = kLine - kP2PInlineAt;
  static_assert(kP2PInline >= 16);
  [[nodiscard]] static std::atomic<std::uint64_t>& chunk_no(const std::byte* slot) noexcept {
    return *reinterpret_cast<std::atomic<std::uint64_t>*>(const_cast<std::byte*>(slot));
  }

  std::size_t small_max_;
  std::vector<const void*> srcs_;  // reduction inputs, one per rank
  std::vector<std::byte> fold_;    // fold_in_scratch's block
  P2PCounters p2p_numbers_{size()};
  struct P2PProgress {
    std::size_t done = 0;      // bytes moved
    std::uint64_t number = 0;  // the message's number (P2PCounters)
    bool started = false, finished = false;
  };
  std::vector<P2PProgress> p2p_items_;  // perform_p2p's, one per item of the batch
};

}  // namespace comm::detail::shm
