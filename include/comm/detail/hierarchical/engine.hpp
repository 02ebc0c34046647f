#pragma once
// The engine behind comm::backends::Hierarchical<Intra, Inter>: every operation is composed of
// operations of two member communicators, one among the ranks of this node (Intra) and one across
// nodes (Inter). Issue order, async Work, the flight recorder, the desync check, monitored_barrier
// and the failure state are the engine core's (detail/engine/core.hpp), as for every host backend;
// this file is the composition only.
//
// Notation: M nodes, L ranks per node (uniform case), this rank is local rank l on node m.
//   all_reduce, uniform, larger than small_max: intra reduce_scatter (local rank l owns slice l of
//     the buffer, padded to L equal slices), inter all_reduce of slice l among the ranks of local
//     index l (the L inter groups run at once), intra all_gather of the slices. Across nodes each
//     rank moves 1/L of the buffer, so a node sends what one flat ring rank would, once.
//   all_reduce, small: intra all_reduce, then every inter group all-reduces the whole node sum (one
//     step fewer; the same bits on every rank, as every group reduces the same node sums).
//   The cross-node all_reduce of those steps is picked by size and node count: hierarchical/cross.hpp.
//   reduce_scatter: the input reordered so that local rank l's share holds the blocks of the ranks
//     of local index l (one per node), intra reduce_scatter, inter reduce_scatter.
//   all_gather: inter all_gather among local index l, intra all_gather, reorder into rank order.
//   broadcast: the root's local index group across nodes, then each node from that local rank.
//   gather: each node to the root's local index, then that group to the root; reorder.
//   barrier: intra barrier, then inter barrier (every inter group holds one rank of every node,
//     and that rank passed its node's barrier: no rank leaves before every rank arrived).
// Nodes of different sizes: only the local ranks 0 ("leaders") talk across nodes. all_reduce is
// intra all_reduce, leaders' all_reduce, intra broadcast; all_gather/gather/reduce_scatter go
// through an all_reduce (bitwise or over a zeroed buffer for the gathers: exact for every type).
//
// The rest of the surface (when Inter has it, comm::supports_full_surface<Inter>):
//   reduce: the core's composition (an all_reduce as above, into scratch off the root).
//   scatter, all_to_all, all_to_all_v, send, recv, batch_isend_irecv: on a communicator of every
//     rank (ranks as here): these move different data between every pair of ranks, so two levels
//     would only add copies. They run as that communicator's operations of the same element type
//     (its messages' headers check type, count and tag); a batch is its batch_isend_irecv, waited
//     for before the operation returns. Which communicator ("flat", the same on every rank):
//       one node, and Intra has the surface: the intra member (its ranks are the ranks here);
//       one rank per node: the inter member (likewise);
//       otherwise a third member, an Inter communicator of every rank created with the others. It
//       costs one more Inter rendezvous at creation (Gloo: a connection between every pair of
//       ranks; 4 ranks on one host: about +50 ms).
//
// Failure: the first error of a step fails the communicator (the core's failure state); this rank
// then destroys every member, so that their peers see this rank leave (Shm: at once; Gloo: closed
// connections) instead of waiting for their deadline.

//
// Every step is an Op record handed to a member's erased entry (members.hpp): the engine works
// on bytes and element sizes, with the reduction kernels of the operation's own record, and never
// re-types an operation.

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <comm/concepts.hpp>
#include <comm/detail/base/copy.hpp>
#include <comm/detail/diagnostics/desync.hpp>
#include <comm/detail/hierarchical/cross.hpp>
#include <comm/detail/base/logging.hpp>
#include <comm/detail/engine/core.hpp>
#include <comm/detail/hierarchical/members.hpp>
#include <comm/detail/hierarchical/topology.hpp>
#include <comm/error.hpp>
#include <comm/store.hpp>
#include <comm/types.hpp>
#include <comm/work.hpp>

namespace comm::detail::hierarchical {

template <class Intra, class Inter>
class Engine : public EngineCore<Engine<Intra, Inter>> {
  using Core = EngineCore<Engine<Intra, Inter>>;
  using Members = hierarchical::Members<Intra, Inter>;
  using Bytes = std::byte;

 public:
  using Config = EngineConfig<typename Intra::Options, typename Inter::Options>;

  /// Joins the communicator (the core's membership check), exchanges node identities through the
  /// store, then creates the members: blocking, each part ending by the timeout.
  Engine(std::shared_ptr<comm::Store> store, int rank, int size, const Config& cfg)
      : Core(std::move(store), rank, size, cfg, "hierarchical"),
        small_max_(cfg.small_max),
        segment_(std::max<std::size_t>(cfg.segment, 4096)),
        cross_(cross_from_env(rank)) {
    // Steps copy through host scratch and members take host buffers only (no device staging).
    this->host_buffers_only("use Communicator<backends::Nccl>, or Gloo, which stages device buffers");
    topo_ = make_topology(exchange_identities(cfg.node_id));
    node_ = topo_.node_of[static_cast<std::size_t>(rank)];
    local_ = topo_.local_of[static_cast<std::size_t>(rank)];
    local_size_ = topo_.node_size(node_);
    place_ = Place{&topo_, node_, local_, local_size_, topo_.inter_group(topo_.uniform ? local_ : 0)};
    local_major_ = topo_.local_major_is_rank_order();
    node_major_ = topo_.node_major_is_rank_order();
    if (rank == 0) {
      const bool one = topo_.num_nodes() == 1;
      log(LogLevel::info,
          std::string("hierarchical") + (this->name().empty() ? "" : " " + this->name()) + ": " + topo_.describe() +
              (cfg.node_id_given ? " (nodes from COMM_NODE_ID / Options::node_id)" : " (nodes by host identity)") +
              (one ? "; one node: every operation is the intra-node communicator's"
                   : topo_.uniform
                         ? "; across nodes one " + std::string(Inter::name) + " communicator per local rank, all at once"
                         : "; nodes differ in size: only local rank 0 of each node talks across nodes (leaders-only "
                           "inter-node communicator), slower than equal nodes"));
    }
    members_.emplace(*this, place_, cfg);
  }

  ~Engine() { this->shutdown(); }

  [[nodiscard]] const Topology& topology() const noexcept { return topo_; }
  [[nodiscard]] int node() const noexcept { return node_; }
  [[nodiscard]] int local_rank() const noexcept { return local_; }
  [[nodiscard]] int local_size() const noexcept { return local_size_; }

 private:
  friend Core;

  static constexpr bool kFlat = Members::kFlat;

  /// Every rank's node identity, in rank order.
  std::vector<std::string> exchange_identities(const std::string& mine) {
    auto& st = *this->store();
    const std::string base = this->key_prefix() + "node/";
    st.set(base + std::to_string(this->rank()), mine);
    std::vector<std::string> ids(static_cast<std::size_t>(this->size()));
    for (int p = 0; p < this->size(); ++p) {
      if (p == this->rank()) {
        ids[static_cast<std::size_t>(p)] = mine;
        continue;
      }
      const std::string key = base + std::to_string(p);
      try {
        st.wait({key}, this->timeout());
      } catch (const Timeout&) {
        throw Timeout("hierarchical.init", this->rank(),
                      "rank " + std::to_string(p) + " did not publish its node identity within " +
                          std::to_string(this->timeout().count()) + " ms (no record " + key + ")",
                      "rank " + std::to_string(p));
      }
      const auto v = st.get(key);
      ids[static_cast<std::size_t>(p)].assign(reinterpret_cast<const char*>(v.data()), v.size());
    }
    return ids;
  }

  // ---- the engine calls the core makes ----

  void perform(Op& op, std::uint64_t seq) {
    members_->guarded([&] {
      switch (op.desc.kind) {
        case OpKind::all_reduce:
          return reduce_then_finish(op, op.in_count, [&](std::size_t n) { all_reduce_n(op, op.in, op.out, n); });
        case OpKind::reduce_scatter:
          return reduce_then_finish(op, op.out_count, [&](std::size_t c) { reduce_scatter_n(op, op.in, op.out, c); });
        case OpKind::all_gather:
        case OpKind::split:
          return do_all_gather(static_cast<const Bytes*>(op.in), static_cast<Bytes*>(op.out), op.in_count * op.elem_size);
        case OpKind::broadcast:
          return do_broadcast(static_cast<Bytes*>(op.out), op.out_count * op.elem_size, op.desc.root);
        case OpKind::gather:
          return do_gather(static_cast<const Bytes*>(op.in), static_cast<Bytes*>(op.out), op.in_count * op.elem_size,
                           op.desc.root);
        case OpKind::barrier: return do_barrier();
        case OpKind::reduce: return this->compose(op, seq);  // the all_reduce above, into scratch off the root
        case OpKind::scatter:
        case OpKind::all_to_all:
        case OpKind::all_to_all_v:
          if constexpr (kFlat) return do_flat(op);
          [[fallthrough]];
        default:
          throw BackendError(op_name(op.desc.kind), this->rank(), "not an operation the hierarchical engine runs");
      }
    });
  }

  /// send, recv, batch_isend_irecv: one batch of the flat communicator, waited for.
  void perform_p2p(const Op& op, std::span<P2PItem> items) {
    members_->guarded([&] {
      if constexpr (kFlat) {
        const Level level = members_->flat("batch_isend_irecv");
        Op batch = step_of(op, OpKind::p2p_batch, nullptr, nullptr, 0, 0);
        batch.p2p.assign(items.begin(), items.end());
        batch.desc.root = items.empty() ? -1 : items.front().peer;
        batch.desc.count = items.size();
        Pending p;
        const std::size_t i = p.add(members_->start(level, batch));
        // The member's own deadline (same timeout, started when the batch runs) ends it first, with
        // the error that names the peer; Work::wait's abort is the backstop.
        members_->wait(level, "batch_isend_irecv", p.works[i], this->timeout() + std::chrono::seconds(2));
      } else {
        throw BackendError(op_name(op.desc.kind), this->rank(),
                           std::string("point-to-point needs an inter-node backend with it; ") +
                               std::string(Inter::name) + " has none");
      }
    });
  }

  void exchange_fingerprints(std::uint64_t /*seq*/) {
    auto& all = this->fingerprints();
    const Fingerprint mine = this->own_fingerprint();
    members_->guarded([&] {
      do_all_gather(reinterpret_cast<const Bytes*>(&mine), reinterpret_cast<Bytes*>(all.data()), sizeof(Fingerprint));
    });
  }

  [[noreturn]] void rethrow_translated(const char* op) { members_->rethrow_translated(op); }
  void close_transport() noexcept {
    if (members_) members_->close_transport();
  }

  // ---- steps ----

  /// A step of `parent`: its element type and reduction (avg as sum: divided once, at the end),
  /// none of its hooks, prescale or finish.
  [[nodiscard]] static Op step_of(const Op& parent, OpKind kind, const void* in, void* out, std::size_t in_n,
                                  std::size_t out_n) {
    Op s;
    s.desc = OpDesc{kind, parent.desc.dtype, parent.desc.reduce, -1, kind == OpKind::reduce_scatter ? out_n : in_n};
    // What the kernels run: avg and premul_sum (already scaled) as sum.
    const auto r = reduce_from_code(parent.desc.reduce);
    if (parent.custom == nullptr && (!r || *r == ReduceOp::avg)) s.desc.reduce = static_cast<std::uint8_t>(ReduceOp::sum);
    s.in = in;
    s.out = out;
    s.in_count = in_n;
    s.out_count = out_n;
    s.elem_size = parent.elem_size;
    s.kernel = parent.kernel;
    s.many = parent.many;
    s.custom = parent.custom;
    s.custom_arg = parent.custom_arg;
    return s;
  }
  /// A step that only moves `in_b` / `out_b` bytes (no reduction).
  [[nodiscard]] static Op bytes_step(OpKind kind, const void* in, void* out, std::size_t in_b, std::size_t out_b,
                                     int root = -1) {
    Op s;
    s.desc = OpDesc{kind, static_cast<std::uint8_t>(Dtype::uint8), OpDesc::none, root,
                    kind == OpKind::broadcast ? out_b : in_b};
    s.in = in;
    s.out = out;
    s.in_count = in_b;
    s.out_count = out_b;
    s.elem_size = 1;
    return s;
  }

  void intra(Op&& s) { members_->run(Level::intra, s); }
  void inter(Op&& s) { members_->run(Level::inter, s); }

  [[nodiscard]] bool leader() const noexcept { return local_ == 0; }
  [[nodiscard]] int num_nodes() const noexcept { return topo_.num_nodes(); }
  [[nodiscard]] std::size_t ranks() const noexcept { return static_cast<std::size_t>(this->size()); }

  /// Scratch buffer `i` (0, 1 or 2) of at least `bytes`; operations run one at a time.
  Bytes* scratch(int i, std::size_t bytes) {
    auto& s = scratch_[static_cast<std::size_t>(i)];
    if (s.size() < bytes) s.resize(bytes);
    return s.data();
  }

  static void copy(const void* from, void* to, std::size_t bytes) noexcept {
    if (from != to) copy_bytes(to, from, bytes);
  }
  static Bytes* at(void* p, std::size_t bytes) noexcept { return static_cast<Bytes*>(p) + bytes; }
  static const Bytes* at(const void* p, std::size_t bytes) noexcept { return static_cast<const Bytes*>(p) + bytes; }

  /// Elements [n, padded) of `buf` become copies of its first: the padding is reduced like the
  /// data, and copies of a real element keep a user reduction away from values the program never
  /// gave it.
  static void pad(Bytes* buf, std::size_t n, std::size_t padded, std::size_t e) noexcept {
    for (std::size_t i = n; i < padded; ++i) std::memcpy(buf + i * e, buf, e);
  }

  // Member steps that skip a member of one rank (a copy where the result must move).
  void intra_all_reduce(const Op& r, const void* in, void* out, std::size_t n) {
    if (local_size_ == 1) return copy(in, out, n * r.elem_size);
    intra(step_of(r, OpKind::all_reduce, in, out, n, n));
  }
  void inter_all_reduce(const Op& r, const void* in, void* out, std::size_t n) {
    if (num_nodes() == 1) return copy(in, out, n * r.elem_size);
    cross_all_reduce(r, in, out, n, cross_for(n * r.elem_size, Step::alone));
  }

  [[nodiscard]] Cross cross_for(std::size_t bytes, Step step) const noexcept {
    return cross_form(cross_, static_cast<std::size_t>(num_nodes()), bytes, step);
  }
  [[nodiscard]] std::size_t slice_grain(Cross c) const noexcept {
    return hierarchical::slice_grain(c, static_cast<std::size_t>(num_nodes()));
  }

  /// A cross-node all_reduce of `n` elements from `in` into `out` (may be equal) in form `c`.
  void cross_all_reduce(const Op& r, const void* in, void* out, std::size_t n, Cross c) {
    const auto k = static_cast<std::size_t>(num_nodes());
    const std::size_t e = r.elem_size;
    if (c == Cross::gather) {
      // Every node's buffer to every node, then each rank folds them in node order: the same
      // operands in the same order everywhere, so the same bits.
      Bytes* all = scratch(2, k * n * e);
      inter(bytes_step(OpKind::all_gather, in, all, n * e, k * n * e));
      Bytes* o = static_cast<Bytes*>(out);
      for (std::size_t j = 1; j < k; ++j) {
        const Bytes* a = j == 1 ? all : o;
        if (r.custom != nullptr)
          r.custom(r.custom_arg, o, a, all + j * n * e, n);
        else
          r.kernel(o, a, all + j * n * e, n);
      }
      return;
    }
    if (c != Cross::rsag) return inter(step_of(r, OpKind::all_reduce, in, out, n, n));
    const std::size_t blk = (n + k - 1) / k;
    Bytes* buf = static_cast<Bytes*>(out);
    if (blk * k != n) {
      buf = scratch(2, blk * k * e);
      copy(in, buf, n * e);
      pad(buf, n, blk * k, e);
    } else {
      copy(in, buf, n * e);
    }
    Bytes* mine = buf + static_cast<std::size_t>(node_) * blk * e;
    inter(step_of(r, OpKind::reduce_scatter, buf, mine, blk * k, blk));
    inter(bytes_step(OpKind::all_gather, mine, buf, blk * e, blk * k * e));
    if (buf != out) copy(buf, out, n * e);
  }
  void intra_broadcast(Bytes* data, std::size_t b, int root) {
    if (local_size_ == 1) return;
    intra(bytes_step(OpKind::broadcast, nullptr, data, 0, b, root));
  }

  // ---- operations ----

  /// `body(n)` for an operation of `n` elements (nothing for 0), then the reduction's finish (avg).
  template <class Body>
  void reduce_then_finish(const Op& op, std::size_t n, Body&& body) {
    if (n == 0) return;
    body(n);
    if (op.finish != nullptr) op.finish(op.out, n, this->size());
  }

  /// `n` elements of `r`'s type reduced with `r`'s reduction, from `in` into `out`.
  void all_reduce_n(const Op& r, const void* in, void* out, std::size_t n) {
    const int m = num_nodes();
    const int l = local_size_;
    const std::size_t e = r.elem_size;
    if (m == 1) return intra_all_reduce(r, in, out, n);
    if (!topo_.uniform) {
      intra_all_reduce(r, in, out, n);
      if (leader()) inter_all_reduce(r, out, out, n);
      return intra_broadcast(static_cast<Bytes*>(out), n * e, 0);
    }
    if (l == 1) {
      // A forced form (COMM_HIERARCHICAL_CROSS) keeps the whole buffer in one cross-node step.
      if (cross_ == Cross::automatic && cross_segmented(1, static_cast<std::size_t>(m), n * e))
        return all_reduce_pipelined(r, in, out, n);
      return inter_all_reduce(r, in, out, n);
    }
    if (n * e <= small_max_ || n < static_cast<std::size_t>(l)) {
      intra_all_reduce(r, in, out, n);
      return inter_all_reduce(r, out, out, n);
    }
    if (n * e >= 2 * segment_) return all_reduce_pipelined(r, in, out, n);
    if (leaders_carry(static_cast<std::size_t>(l), n * e)) {
      Op s = step_of(r, OpKind::reduce, in, out, n, n);
      s.desc.root = 0;
      intra(std::move(s));
      if (leader()) cross_all_reduce(r, out, out, n, cross_for(n * e, Step::alone));
      return intra_broadcast(static_cast<Bytes*>(out), n * e, 0);
    }
    const auto ul = static_cast<std::size_t>(l);
    const Cross c = cross_for((n + ul - 1) / ul * e, Step::alone);
    const std::size_t grain = ul * slice_grain(c);  // slices of whole blocks
    const std::size_t padded = (n + grain - 1) / grain * grain;
    const std::size_t chunk = padded / ul;
    Bytes* whole = static_cast<Bytes*>(out);
    const void* src = in;
    if (padded != n) {
      whole = scratch(0, padded * e);
      copy(in, whole, n * e);
      pad(whole, n, padded, e);
      src = whole;
    }
    Bytes* slot = whole + static_cast<std::size_t>(local_) * chunk * e;
    intra(step_of(r, OpKind::reduce_scatter, src, slot, padded, chunk));
    cross_all_reduce(r, slot, slot, chunk, c);
    intra(bytes_step(OpKind::all_gather, slot, whole, chunk * e, padded * e));
    if (whole != out) copy(whole, out, n * e);
  }

  /// Member operations started with comm::async; all of them are waited for before the
  /// operation returns or throws (they use its buffers), failures included.
  struct Pending {
    std::vector<Work> works;
    Pending() = default;
    Pending(const Pending&) = delete;
    Pending& operator=(const Pending&) = delete;
    ~Pending() {
      for (auto& w : works) {
        try {
          w.wait();
        } catch (...) {  // the first failure is already on its way out
        }
      }
    }
    std::size_t add(Work w) {
      works.push_back(std::move(w));
      return works.size() - 1;
    }
  };

  /// The slice form in segments: each segment goes through intra reduce_scatter, inter all_reduce
  /// and intra all_gather, issued as async member operations as soon as the previous step of that
  /// segment is done, so the on-node steps of one segment overlap the cross-node step of another
  /// and only the first segment's reduce_scatter and the last one's all_gather add to the time of
  /// the cross-node transfer. Each member runs its operations in issue order, the same on every
  /// rank: every reduce_scatter, then each all_gather as its segment's all_reduce ends. With one
  /// rank per node (cross_segmented) the on-node steps are one-rank member operations (copies at
  /// most), and the segments are cut for the cross-node blocks instead of by segment_.
  void all_reduce_pipelined(const Op& r, const void* in, void* out, std::size_t n) {
    const auto l = static_cast<std::size_t>(local_size_);
    const std::size_t e = r.elem_size;
    const auto k = static_cast<std::size_t>(num_nodes());
    // One rank per node (cross_segmented): segments whose blocks are at most Gloo's largest direct
    // message; their count grows with the buffer (measured to 32 MiB: 32 segments at 4 nodes).
    const std::size_t wanted = l == 1 ? std::max<std::size_t>(1, (n * e + k * kCrossBlockMax - 1) / (k * kCrossBlockMax))
                                      : std::clamp<std::size_t>(n * e / segment_, 1, kSegmentsMax);
    // The form of every segment's cross-node step, from the full segments' size; rsag or the
    // member's all_reduce (gather, when forced, is the member's here: segments are large).
    const Cross c = [&] {
      const Cross f = cross_for(((n + wanted - 1) / wanted + l - 1) / l * e, Step::segment);
      return f == Cross::gather ? Cross::member : f;
    }();
    const std::size_t grain = l * slice_grain(c);
    const std::size_t seg = ((n + wanted - 1) / wanted + grain - 1) / grain * grain;  // whole slices and blocks
    const std::size_t count = (n + seg - 1) / seg;
    struct Segment {
      const Bytes* src;  // reduce_scatter's input
      Bytes* buf;        // where the segment is reduced and gathered
      Bytes* dst;        // where its result goes
      std::size_t len, chunk;
    };
    std::vector<Segment> v(count);
    for (std::size_t i = 0; i < count; ++i) {
      const std::size_t off = i * seg;
      const std::size_t len = std::min(seg, n - off);
      const std::size_t chunk = (len + grain - 1) / grain * grain / l;
      if (chunk * l == len) {
        v[i] = Segment{at(in, off * e), at(out, off * e), at(out, off * e), len, chunk};
      } else {  // only the last segment: padded as in the one-segment form
        Bytes* b = scratch(0, chunk * l * e);
        copy(at(in, off * e), b, len * e);
        pad(b, len, chunk * l, e);
        v[i] = Segment{b, b, at(out, off * e), len, chunk};
      }
    }
    auto slot = [&](const Segment& x) { return x.buf + static_cast<std::size_t>(local_) * x.chunk * e; };
    Pending p;
    p.works.reserve(3 * count);
    std::vector<std::size_t> rs(count), xr(count), ar(count), ag(count);
    for (std::size_t i = 0; i < count; ++i) {
      Op s = step_of(r, OpKind::reduce_scatter, v[i].src, slot(v[i]), v[i].chunk * l, v[i].chunk);
      rs[i] = p.add(members_->start(Level::intra, s));
    }
    for (std::size_t i = 0; i < count; ++i) {
      members_->wait(Level::intra, "reduce_scatter", p.works[rs[i]]);
      if (c == Cross::rsag) {  // the member runs them in issue order: the all_gather after the reduce_scatter
        const std::size_t blk = v[i].chunk / k;
        Bytes* mine = slot(v[i]) + static_cast<std::size_t>(node_) * blk * e;
        Op a = step_of(r, OpKind::reduce_scatter, slot(v[i]), mine, v[i].chunk, blk);
        xr[i] = p.add(members_->start(Level::inter, a));
        Op b = bytes_step(OpKind::all_gather, mine, slot(v[i]), blk * e, v[i].chunk * e);
        ar[i] = p.add(members_->start(Level::inter, b));
        continue;
      }
      Op s = step_of(r, OpKind::all_reduce, slot(v[i]), slot(v[i]), v[i].chunk, v[i].chunk);
      ar[i] = p.add(members_->start(Level::inter, s));
    }
    for (std::size_t i = 0; i < count; ++i) {
      if (c == Cross::rsag) members_->wait(Level::inter, "reduce_scatter", p.works[xr[i]]);
      members_->wait(Level::inter, c == Cross::rsag ? "all_gather" : "all_reduce", p.works[ar[i]]);
      Op s = bytes_step(OpKind::all_gather, slot(v[i]), v[i].buf, v[i].chunk * e, v[i].chunk * l * e);
      ag[i] = p.add(members_->start(Level::intra, s));
    }
    for (std::size_t i = 0; i < count; ++i) members_->wait(Level::intra, "all_gather", p.works[ag[i]]);
    for (const auto& x : v)
      if (x.buf != x.dst) copy(x.buf, x.dst, x.len * e);
  }

  void reduce_scatter_n(const Op& r, const void* in, void* out, std::size_t c) {
    const int m = num_nodes();
    const int l = local_size_;
    const std::size_t e = r.elem_size;
    const std::size_t total = ranks() * c;
    if (m == 1) {  // local ranks are the ranks
      if (l == 1) return copy(in, out, c * e);
      return intra(step_of(r, OpKind::reduce_scatter, in, out, total, c));
    }
    if (!topo_.uniform) {
      Bytes* all = scratch(1, total * e);
      all_reduce_n(r, in, all, total);
      return copy(all + static_cast<std::size_t>(this->rank()) * c * e, out, c * e);
    }
    // Local rank j's share: the blocks of the ranks of local index j, by node.
    const std::size_t share = static_cast<std::size_t>(m) * c;
    const void* src = in;
    Bytes* reordered = nullptr;
    if (!local_major_) {
      reordered = scratch(0, total * e);
      for (int j = 0; j < l; ++j)
        for (int k = 0; k < m; ++k)
          copy(at(in, static_cast<std::size_t>(topo_.rank_at(k, j)) * c * e),
               reordered + (static_cast<std::size_t>(j) * static_cast<std::size_t>(m) + static_cast<std::size_t>(k)) * c * e,
               c * e);
      src = reordered;
    }
    const void* mine = src;  // this rank's share, reduced over the node
    if (l > 1) {
      Bytes* slot = reordered != nullptr ? reordered + static_cast<std::size_t>(local_) * share * e : scratch(1, share * e);
      intra(step_of(r, OpKind::reduce_scatter, src, slot, total, share));
      mine = slot;
    }
    inter(step_of(r, OpKind::reduce_scatter, mine, out, share, c));
  }

  void do_all_gather(const Bytes* in, Bytes* out, std::size_t b) {
    if (b == 0) return;
    const int m = num_nodes();
    const int l = local_size_;
    const std::size_t total = ranks() * b;
    if (m == 1) {
      if (l == 1) return copy(in, out, b);
      return intra(bytes_step(OpKind::all_gather, in, out, b, total));
    }
    if (!topo_.uniform) {
      // Every rank's block at its place in a zeroed buffer, or-ed together: exact for any bits.
      Bytes* z = scratch(0, total);
      std::memset(z, 0, total);
      copy(in, z + static_cast<std::size_t>(this->rank()) * b, b);
      Op bor = bytes_step(OpKind::all_reduce, nullptr, nullptr, 0, 0);
      bor.desc.reduce = static_cast<std::uint8_t>(ReduceOp::bor);
      bor.kernel = reduce_kernel_for<std::uint8_t>(ReduceOp::bor);
      bor.many = reduce_many_for<std::uint8_t>(ReduceOp::bor);
      return all_reduce_n(bor, z, out, total);
    }
    // Slots by local index, then node; `out` itself when that is the rank order.
    const std::size_t share = static_cast<std::size_t>(m) * b;
    Bytes* q = local_major_ ? out : scratch(1, total);
    Bytes* slot = q + static_cast<std::size_t>(local_) * share;
    inter(bytes_step(OpKind::all_gather, in, slot, b, share));
    if (l > 1) intra(bytes_step(OpKind::all_gather, slot, q, share, total));
    if (q != out)
      for (int j = 0; j < l; ++j)
        for (int k = 0; k < m; ++k)
          copy(q + (static_cast<std::size_t>(j) * static_cast<std::size_t>(m) + static_cast<std::size_t>(k)) * b,
               out + static_cast<std::size_t>(topo_.rank_at(k, j)) * b, b);
  }

  void do_broadcast(Bytes* data, std::size_t b, int root) {
    if (b == 0) return;
    const int m0 = topo_.node_of[static_cast<std::size_t>(root)];
    const int l0 = topo_.local_of[static_cast<std::size_t>(root)];
    auto across = [&] { inter(bytes_step(OpKind::broadcast, nullptr, data, 0, b, m0)); };
    if (num_nodes() == 1) return intra_broadcast(data, b, l0);
    if (topo_.uniform) {
      if (local_ == l0) across();
      return intra_broadcast(data, b, l0);
    }
    // Leaders-only: the root's node first hands the data to its leader.
    const bool via_leader = l0 != 0;
    if (node_ == m0 && via_leader) intra_broadcast(data, b, l0);
    if (leader()) across();
    if (node_ != m0 || !via_leader) intra_broadcast(data, b, 0);
  }

  void do_gather(const Bytes* in, Bytes* out, std::size_t b, int root) {
    if (b == 0) return;
    const bool is_root = this->rank() == root;
    const std::size_t total = ranks() * b;
    const int m0 = topo_.node_of[static_cast<std::size_t>(root)];
    const int l0 = topo_.local_of[static_cast<std::size_t>(root)];
    const int m = num_nodes();
    const int l = local_size_;
    if (m == 1) {
      if (l == 1) return copy(in, out, b);
      return intra(bytes_step(OpKind::gather, in, out, b, is_root ? total : 0, l0));
    }
    if (!topo_.uniform) {
      Bytes* all = is_root ? out : scratch(1, total);
      if (is_root && in >= out && in < out + total) {  // in place on the root: keep the input
        Bytes* keep = scratch(1, b);
        copy(in, keep, b);
        in = keep;
      }
      return do_all_gather(in, all, b);
    }
    // Each node gathers to its rank of the root's local index (node order = local rank order),
    // then those ranks gather to the root, which puts the blocks in rank order.
    const std::size_t node_bytes = static_cast<std::size_t>(l) * b;
    const Bytes* mine = in;
    if (l > 1) {
      Bytes* g = local_ == l0 ? scratch(0, node_bytes) : nullptr;
      intra(bytes_step(OpKind::gather, in, g, b, g != nullptr ? node_bytes : 0, l0));
      mine = g;
    }
    if (local_ != l0) return;
    Bytes* h = !is_root ? nullptr : node_major_ ? out : scratch(1, total);
    inter(bytes_step(OpKind::gather, mine, h, node_bytes, h != nullptr ? total : 0, m0));
    if (is_root && h != out)
      for (int k = 0; k < m; ++k)
        for (int j = 0; j < l; ++j)
          copy(h + (static_cast<std::size_t>(k) * static_cast<std::size_t>(l) + static_cast<std::size_t>(j)) * b,
               out + static_cast<std::size_t>(topo_.rank_at(k, j)) * b, b);
  }

  /// scatter, all_to_all, all_to_all_v as the flat member's, of the same element type (its
  /// messages' headers check type and count; one rank: a copy).
  void do_flat(const Op& op) {
    if (ranks() == 1) {  // every block is this rank's own
      const std::size_t n = op.desc.kind == OpKind::scatter ? op.out_count : op.in_count;
      return copy(op.in, op.out, n * op.elem_size);
    }
    const char* name = op_name(op.desc.kind);
    Op s = step_of(op, op.desc.kind, op.in, op.out, op.in_count, op.out_count);
    s.desc = op.desc;
    s.counts = op.counts;
    members_->run(members_->flat(name), s);
  }

  void do_barrier() {
    auto on_node = [&] {
      if (local_size_ > 1) intra(bytes_step(OpKind::barrier, nullptr, nullptr, 0, 0));
    };
    auto across = [&] {
      if (num_nodes() > 1) inter(bytes_step(OpKind::barrier, nullptr, nullptr, 0, 0));
    };
    on_node();
    if (topo_.uniform) return across();
    if (leader()) across();
    on_node();
  }

  // The pipelined all_reduce: at most this many segments (more hide more of the on-node steps,
  // each costs three member operations).
  static constexpr std::size_t kSegmentsMax = 8;

  Topology topo_;
  int node_ = 0;
  int local_ = 0;
  int local_size_ = 1;
  Place place_;              // before members_: they refer to it
  bool local_major_ = false;  // rank == local * M + node: slices need no reordering
  bool node_major_ = false;   // rank == node * L + local: gathers need no reordering
  std::size_t small_max_;
  std::size_t segment_;  // pipeline segments of at least this many bytes
  Cross cross_;          // COMM_HIERARCHICAL_CROSS (automatic: by size and node count)
  std::array<std::vector<Bytes>, 3> scratch_;  // 2: the cross-node step's own
  std::optional<Members> members_;
};

}  // namespace comm::detail::hierarchical
