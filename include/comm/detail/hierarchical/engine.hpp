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

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <comm/concepts.hpp>
#include <comm/detail/diagnostics/desync.hpp>
#include <comm/detail/engine/core.hpp>
#include <comm/detail/hierarchical/topology.hpp>
#include <comm/detail/diagnostics/logging.hpp>
#include <comm/detail/engine/transport.hpp>
#include <comm/error.hpp>
#include <comm/store.hpp>
#include <comm/types.hpp>
#include <comm/work.hpp>

namespace comm::detail::hierarchical {

/// What the engine is built with besides its store, rank and size.
template <class IntraOptions, class InterOptions>
struct EngineConfig : CoreConfig {
  std::string node_id;      // the identity that groups ranks into nodes
  bool node_id_given = false;  // from the options / COMM_NODE_ID (else the host identity)
  IntraOptions intra{};
  InterOptions inter{};
  std::size_t small_max = 0;  // all_reduce: the two-step form up to this many bytes
  std::size_t segment = 0;    // all_reduce: pipeline segments of at least this many bytes
};

/// A user reduction after the core erased it, as the elementwise callable the members take.
template <class T>
struct ErasedCustom {
  custom_reduce_fn fn;
  const void* arg;
  T operator()(T a, T b) const {
    T r{};
    fn(arg, &r, &a, &b, 1);
    return r;
  }
};

/// Rethrows `e` as the same kind of comm::Error with another operation, rank, text and peer.
[[noreturn]] inline void rethrow_like(const Error& e, const std::string& op, int rank, const std::string& text,
                                      const std::string& peer) {
  if (dynamic_cast<const DesyncError*>(&e) != nullptr) throw DesyncError(op, rank, text, peer);
  if (dynamic_cast<const InvalidArgument*>(&e) != nullptr) throw InvalidArgument(op, rank, text, peer);
  if (dynamic_cast<const Timeout*>(&e) != nullptr) throw Timeout(op, rank, text, peer);
  if (dynamic_cast<const RemoteError*>(&e) != nullptr) throw RemoteError(op, rank, text, peer);
  if (dynamic_cast<const BackendError*>(&e) != nullptr) throw BackendError(op, rank, text, peer);
  throw Error(op, rank, text, peer);
}

/// A member's peer ("rank 1" or "1") as the rank of this communicator; other texts unchanged.
[[nodiscard]] inline std::string map_peer(const std::string& peer, const std::vector<int>& group) {
  std::string_view p = peer;
  const bool prefixed = p.starts_with("rank ");
  if (prefixed) p.remove_prefix(5);
  if (p.empty() || p.size() > 9 || !std::all_of(p.begin(), p.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return peer;
  const auto i = static_cast<std::size_t>(std::stoi(std::string(p)));
  if (i >= group.size()) return peer;
  return (prefixed ? "rank " : "") + std::to_string(group[i]);
}

[[nodiscard]] inline std::string list_ranks(const std::vector<int>& ranks) {
  std::string s;
  constexpr std::size_t kShown = 16;
  for (std::size_t i = 0; i < ranks.size() && i < kShown; ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  if (ranks.size() > kShown) s += " and " + std::to_string(ranks.size() - kShown) + " more";
  return s;
}

/// Calls `f.template operator()<T>()` with the element type of dtype code `code`.
template <class F>
void with_type(std::uint8_t code, F&& f) {
  switch (static_cast<Dtype>(code)) {
    case Dtype::int8: return f.template operator()<std::int8_t>();
    case Dtype::uint8: return f.template operator()<std::uint8_t>();
    case Dtype::int32: return f.template operator()<std::int32_t>();
    case Dtype::uint32: return f.template operator()<std::uint32_t>();
    case Dtype::int64: return f.template operator()<std::int64_t>();
    case Dtype::uint64: return f.template operator()<std::uint64_t>();
    case Dtype::float16: return f.template operator()<half>();
    case Dtype::bfloat16: return f.template operator()<bfloat16>();
    case Dtype::float32: return f.template operator()<float>();
    case Dtype::float64: return f.template operator()<double>();
    case Dtype::float8_e4m3: return f.template operator()<float8_e4m3>();
    case Dtype::float8_e5m2: return f.template operator()<float8_e5m2>();
  }
  throw BackendError("hierarchical", -1, "unknown element type code " + std::to_string(code));
}

template <class Intra, class Inter>
class Engine : public EngineCore<Engine<Intra, Inter>> {
  using Core = EngineCore<Engine<Intra, Inter>>;
  using Bytes = std::uint8_t;  // the element type of operations that only move data

 public:
  using Config = EngineConfig<typename Intra::Options, typename Inter::Options>;

  /// Joins the communicator (the core's membership check), exchanges node identities through the
  /// store, then creates the members: blocking, each part ending by the timeout.
  Engine(std::shared_ptr<comm::Store> store, int rank, int size, const Config& cfg)
      : Core(std::move(store), rank, size, cfg, "hierarchical"),
        small_max_(cfg.small_max),
        segment_(std::max<std::size_t>(cfg.segment, 4096)) {
    topo_ = make_topology(exchange_identities(cfg.node_id));
    node_ = topo_.node_of[static_cast<std::size_t>(rank)];
    local_ = topo_.local_of[static_cast<std::size_t>(rank)];
    local_size_ = topo_.node_size(node_);
    inter_group_ = topo_.inter_group(topo_.uniform ? local_ : 0);
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
    create_members(cfg);
  }

  ~Engine() { this->shutdown(); }

  [[nodiscard]] const Topology& topology() const noexcept { return topo_; }
  [[nodiscard]] int node() const noexcept { return node_; }
  [[nodiscard]] int local_rank() const noexcept { return local_; }
  [[nodiscard]] int local_size() const noexcept { return local_size_; }

 private:
  friend Core;

  enum class Level : std::uint8_t { intra, inter, flat };

  /// Whether scatter, all_to_all(_v) and point-to-point run here (on a communicator of every rank).
  static constexpr bool kFlat = comm::supports_full_surface<Inter>;
  static constexpr bool kFlatIntra = comm::supports_full_surface<Intra>;
  /// Which member is the communicator of every rank (see the file comment).
  enum class FlatVia : std::uint8_t { none, intra, inter, own };

  // ---- construction ----

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

  template <class O>
  void prepare_member(O& o, const Config& cfg, const char* level) const {
    o.timeout = cfg.timeout;
    // The composed operation is checked once, by this communicator; its steps need no check of
    // their own.
    if constexpr (requires { o.desync_check; }) o.desync_check = false;
    // Across hosts a Gloo member's small messages take comm's direct connections unless the user
    // chose (GlooOptions::direct): there the per-message latency is what small operations pay.
    if constexpr (requires { o.direct.has_value(); })
      if (std::string_view(level) != "intra" && !o.direct.has_value()) o.direct = true;
    // Members' records and dumps carry this communicator's rank and name, so that the members of
    // different nodes (each with its own local ranks) never write the same dump file.
    if constexpr (requires { o.record_file_rank; o.record_name; }) {
      o.record_file_rank = this->file_rank();
      o.record_name = this->name().empty() ? std::string(level) : this->name() + "." + level;
    }
  }

  void create_members(const Config& cfg) {
    const std::string kp = this->key_prefix();
    const auto& base = this->store();
    auto io = cfg.intra;
    prepare_member(io, cfg, "intra");
    try {
      intra_.emplace(Intra::create(std::make_shared<PrefixStore>(kp + "intra/" + std::to_string(node_), base), local_,
                                   local_size_, io));
    } catch (const Error& e) {
      rethrow_like(e, "hierarchical.init", this->rank(),
                   e.detail() + " [creating the intra-node " + std::string(Intra::name) + " communicator of node " +
                       std::to_string(node_) + ", ranks " + list_ranks(topo_.nodes[static_cast<std::size_t>(node_)]) +
                       (cfg.node_id_given ? ", grouped by COMM_NODE_ID / Options::node_id: ranks given one node id "
                                            "must run on one host"
                                          : "") +
                       "]",
                   map_peer(e.peer(), topo_.nodes[static_cast<std::size_t>(node_)]));
    }
    if (topo_.uniform || local_ == 0) {  // leaders-only: the others never cross nodes
      auto xo = cfg.inter;
      prepare_member(xo, cfg, "inter");
      const int index = topo_.uniform ? local_ : 0;
      try {
        inter_.emplace(Inter::create(std::make_shared<PrefixStore>(kp + "inter/" + std::to_string(index), base),
                                     node_, topo_.num_nodes(), xo));
      } catch (const Error& e) {
        rethrow_like(e, "hierarchical.init", this->rank(),
                     e.detail() + " [creating the inter-node " + std::string(Inter::name) + " communicator of ranks " +
                         list_ranks(inter_group_) + "]",
                     map_peer(e.peer(), inter_group_));
      }
    }
    if constexpr (kFlat) {
      if (this->size() == 1) return;  // nothing to send anywhere: copies only
      if (kFlatIntra && topo_.num_nodes() == 1) {
        flat_via_ = FlatVia::intra;
        return;
      }
      if (topo_.uniform && local_size_ == 1) {
        flat_via_ = FlatVia::inter;
        return;
      }
      flat_via_ = FlatVia::own;
      auto fo = cfg.inter;
      prepare_member(fo, cfg, "flat");
      try {
        flat_.emplace(Inter::create(std::make_shared<PrefixStore>(kp + "flat", base), this->rank(), this->size(), fo));
      } catch (const Error& e) {
        rethrow_like(e, "hierarchical.init", this->rank(),
                     e.detail() + " [creating the " + std::string(Inter::name) +
                         " communicator of every rank (scatter, all_to_all, point-to-point)]",
                     e.peer());
      }
    }
  }

  // ---- the engine calls the core makes ----

  void perform(Op& op, std::uint64_t seq) {
    guarded([&] {
      switch (op.desc.kind) {
        case OpKind::all_reduce:
          return with_type(op.desc.dtype, [&]<class T>() { this->template do_all_reduce<T>(op); });
        case OpKind::reduce_scatter:
          return with_type(op.desc.dtype, [&]<class T>() { this->template do_reduce_scatter<T>(op); });
        case OpKind::all_gather:
        case OpKind::split:
          return do_all_gather(static_cast<const Bytes*>(op.in), static_cast<Bytes*>(op.out), op.in_count * op.elem_size);
        case OpKind::broadcast:
          return do_broadcast(static_cast<Bytes*>(op.out), op.out_count * op.elem_size, op.desc.root);
        case OpKind::gather:
          return do_gather(static_cast<const Bytes*>(op.in), static_cast<Bytes*>(op.out), op.in_count * op.elem_size,
                        op.desc.root);
        case OpKind::barrier:
          return do_barrier();
        case OpKind::reduce:
          return this->compose(op, seq);  // the all_reduce above, into scratch off the root
        case OpKind::scatter:
        case OpKind::all_to_all:
        case OpKind::all_to_all_v:
          if constexpr (kFlat) return with_type(op.desc.dtype, [&]<class T>() { this->template do_flat<T>(op); });
          [[fallthrough]];
        default:
          throw BackendError(op_name(op.desc.kind), this->rank(), "not an operation the hierarchical engine runs");
      }
    });
  }

  /// send, recv, batch_isend_irecv: the flat communicator's batch of the same element type,
  /// waited for.
  void perform_p2p(const Op& op, std::span<P2PItem> items) {
    guarded([&] {
      if constexpr (kFlat) {
        with_type(op.desc.dtype, [&]<class T>() {
          std::vector<P2POp<T>> ops;
          ops.reserve(items.size());
          for (const P2PItem& it : items)
            ops.push_back(P2POp<T>{it.send ? P2PKind::isend : P2PKind::irecv,
                                   std::span<T>(static_cast<T*>(it.buf), it.count), it.peer, it.tag});
          flat_step("batch_isend_irecv", [&](auto& x) {
            auto works = x.batch_isend_irecv(std::span<const P2POp<T>>(ops));
            // Every Work shares the batch's state: waiting for one is waiting for the batch. The
            // member's own deadline (same timeout, started when the batch runs) ends it first, with
            // the error that names the peer; Work::wait's abort is the backstop.
            if (!works.front().wait_for(this->timeout() + std::chrono::seconds(2))) works.front().wait();
            for (auto& w : works) w.wait();
          });
        });
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
    guarded([&] {
      do_all_gather(reinterpret_cast<const Bytes*>(&mine), reinterpret_cast<Bytes*>(all.data()), sizeof(Fingerprint));
    });
  }

  [[noreturn]] void rethrow_translated(const char* op) {
    try {
      throw;
    } catch (const Error& e) {
      if (!in_step_) throw;
      in_step_ = false;
      if (step_level_ == Level::flat)  // ranks there are ranks here
        rethrow_like(e, op, this->rank(),
                     e.detail() + " [in the " + step_op_ + " of this " + op + " on the " + std::string(Inter::name) +
                         " communicator of every rank]",
                     e.peer());
      const bool intra = step_level_ == Level::intra;
      const std::vector<int>& group = intra ? topo_.nodes[static_cast<std::size_t>(node_)] : inter_group_;
      const std::string where =
          std::string(" [in the ") + (intra ? "intra-node " : "inter-node ") + step_op_ + " of this " + op +
          (intra ? " on node " + std::to_string(node_) : std::string()) + ": " +
          std::string(intra ? Intra::name : Inter::name) + " communicator of ranks " + list_ranks(group) +
          ", its rank i being the i-th of them]";
      rethrow_like(e, op, this->rank(), e.detail() + where, map_peer(e.peer(), group));
    } catch (const std::bad_alloc&) {
      throw;
    } catch (const std::exception& e) {
      throw BackendError(op, this->rank(), e.what());
    } catch (...) {
      throw BackendError(op, this->rank(), "unknown exception");
    }
  }

  /// Another thread gave up on an operation (Work::wait's deadline) or a step failed: stops what
  /// can be stopped from here. Gloo members abort their connections (their peers fail at once);
  /// an operation in a Shm step ends by its own deadline, and the executing thread then destroys
  /// the members (guarded()).
  void close_transport() noexcept {
    std::lock_guard lock(members_mu_);
    abort_member(intra_);
    abort_member(inter_);
    abort_member(flat_);
  }

  template <class M>
  static void abort_member(std::optional<M>& m) noexcept {
    if (m) abort_transport(*m);
  }

  /// Runs `f` (steps of one operation, on the executing thread); on any exception destroys the
  /// members first, so that their peers learn at once that this rank left.
  template <class F>
  void guarded(F&& f) {
    try {
      std::forward<F>(f)();
    } catch (...) {
      std::optional<Intra> a;
      std::optional<Inter> b, c;
      {
        std::lock_guard lock(members_mu_);
        if (intra_) a.emplace(std::move(*intra_));
        if (inter_) b.emplace(std::move(*inter_));
        if (flat_) c.emplace(std::move(*flat_));
        intra_.reset();
        inter_.reset();
        flat_.reset();
      }
      throw;  // a, b and c are destroyed on the way out, outside the lock
    }
  }

  // ---- steps ----

  void begin_step(Level level, const char* op) {
    if (this->has_failed())  // an abort from another thread: stop between steps
      throw BackendError(op, this->rank(), "stopped: the communicator was aborted");
    if ((level == Level::intra && !intra_) || (level == Level::inter && !inter_) || (level == Level::flat && !flat_))
      throw BackendError(op, this->rank(), "the communicator is unusable after an earlier failure");
    step_level_ = level;
    step_op_ = op;
    in_step_ = true;
  }
  void end_step() noexcept { in_step_ = false; }

  template <class F>
  void intra_step(const char* op, F&& f) {
    begin_step(Level::intra, op);
    std::forward<F>(f)(*intra_);
    end_step();
  }
  template <class F>
  void inter_step(const char* op, F&& f) {
    begin_step(Level::inter, op);
    std::forward<F>(f)(*inter_);
    end_step();
  }
  /// A step on the communicator of every rank (`f` takes it as `auto&`).
  template <class F>
  void flat_step(const char* op, F&& f) {
    switch (flat_via_) {
      case FlatVia::intra:
        if constexpr (kFlatIntra) return intra_step(op, std::forward<F>(f));
        break;
      case FlatVia::inter: return inter_step(op, std::forward<F>(f));
      case FlatVia::own:
        begin_step(Level::flat, op);
        std::forward<F>(f)(*flat_);
        return end_step();
      case FlatVia::none: break;
    }
    throw BackendError(op, this->rank(), "no communicator of every rank for this operation");
  }

  [[nodiscard]] bool leader() const noexcept { return local_ == 0; }
  [[nodiscard]] int num_nodes() const noexcept { return topo_.num_nodes(); }
  [[nodiscard]] std::size_t ranks() const noexcept { return static_cast<std::size_t>(this->size()); }

  /// Scratch buffer `i` (0 or 1) of at least `n` elements of T; operations run one at a time.
  template <class T>
  T* scratch(int i, std::size_t n) {
    auto& s = scratch_[static_cast<std::size_t>(i)];
    if (s.size() < n * sizeof(T)) s.resize(n * sizeof(T));
    return reinterpret_cast<T*>(s.data());
  }

  template <class T>
  static void copy(const T* from, T* to, std::size_t n) noexcept {
    if (from != to && n != 0) std::memcpy(static_cast<void*>(to), static_cast<const void*>(from), n * sizeof(T));
  }

  template <class T, class F>
  void with_reduction(const Op& op, F&& f) {
    if (op.custom != nullptr) {
      f(custom_op<ErasedCustom<T>>{ErasedCustom<T>{op.custom, op.custom_arg}});
    } else {
      ReduceOp r = reduce_from_code(op.desc.reduce).value_or(ReduceOp::sum);
      if (r == ReduceOp::avg) r = ReduceOp::sum;  // divided once, at the end (op.finish)
      f(r);
    }
  }

  // Member steps that skip a member of one rank (a copy where the result must move).
  template <class T, class Red>
  void intra_all_reduce(const T* in, T* out, std::size_t n, const Red& red) {
    if (local_size_ == 1) return copy(in, out, n);
    intra_step("all_reduce", [&](Intra& c) {
      c.all_reduce(std::span<const T>(in, n), std::span<T>(out, n), red, blocking);
    });
  }
  template <class T, class Red>
  void inter_all_reduce(const T* in, T* out, std::size_t n, const Red& red) {
    if (num_nodes() == 1) return copy(in, out, n);
    inter_step("all_reduce", [&](Inter& c) {
      c.all_reduce(std::span<const T>(in, n), std::span<T>(out, n), red, blocking);
    });
  }
  void intra_broadcast(Bytes* data, std::size_t n, int root) {
    if (local_size_ == 1) return;
    intra_step("broadcast", [&](Intra& c) { c.broadcast(std::span<Bytes>(data, n), root, blocking); });
  }

  // ---- operations ----

  template <class T>
  void do_all_reduce(const Op& op) {
    const std::size_t n = op.in_count;
    if (n == 0) return;
    T* out = static_cast<T*>(op.out);
    with_reduction<T>(op, [&](const auto& red) { all_reduce_n<T>(static_cast<const T*>(op.in), out, n, red); });
    if (op.finish != nullptr) op.finish(out, n, this->size());
  }

  template <class T, class Red>
  void all_reduce_n(const T* in, T* out, std::size_t n, const Red& red) {
    const int m = num_nodes();
    const int l = local_size_;
    if (m == 1) return intra_all_reduce(in, out, n, red);
    if (!topo_.uniform) {
      intra_all_reduce(in, out, n, red);
      if (leader()) inter_all_reduce(out, out, n, red);
      return intra_broadcast(reinterpret_cast<Bytes*>(out), n * sizeof(T), 0);
    }
    if (l == 1) return inter_all_reduce(in, out, n, red);
    if (n * sizeof(T) <= small_max_ || n < static_cast<std::size_t>(l)) {
      intra_all_reduce(in, out, n, red);
      return inter_all_reduce(out, out, n, red);
    }
    if (n * sizeof(T) >= 2 * segment_) return all_reduce_pipelined(in, out, n, red);
    const std::size_t chunk = (n + static_cast<std::size_t>(l) - 1) / static_cast<std::size_t>(l);
    const std::size_t padded = chunk * static_cast<std::size_t>(l);
    T* whole = out;
    const T* src = in;
    if (padded != n) {
      whole = scratch<T>(0, padded);
      copy(in, whole, n);
      // The padding is reduced like the data; copies of a real element keep a user reduction
      // away from values the program never gave it.
      std::fill(whole + n, whole + padded, whole[0]);
      src = whole;
    }
    T* slot = whole + static_cast<std::size_t>(local_) * chunk;
    intra_step("reduce_scatter", [&](Intra& c) {
      c.reduce_scatter(std::span<const T>(src, padded), std::span<T>(slot, chunk), red, blocking);
    });
    inter_step("all_reduce", [&](Inter& c) {
      c.all_reduce(std::span<const T>(slot, chunk), std::span<T>(slot, chunk), red, blocking);
    });
    intra_step("all_gather", [&](Intra& c) {
      c.all_gather(std::span<const Bytes>(reinterpret_cast<const Bytes*>(slot), chunk * sizeof(T)),
                   std::span<Bytes>(reinterpret_cast<Bytes*>(whole), padded * sizeof(T)), blocking);
    });
    if (whole != out) copy(whole, out, n);
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

  /// Waits for member operation `w` as step (`level`, `op`), for its errors' text.
  void wait_step(Level level, const char* op, Work& w) {
    begin_step(level, op);
    w.wait();
    end_step();
  }

  /// The slice form in segments: each segment goes through intra reduce_scatter, inter all_reduce
  /// and intra all_gather, issued as async member operations as soon as the previous step of that
  /// segment is done, so the on-node steps of one segment overlap the cross-node step of another
  /// and only the first segment's reduce_scatter and the last one's all_gather add to the time of
  /// the cross-node transfer. Each member runs its operations in issue order, the same on every
  /// rank: every reduce_scatter, then each all_gather as its segment's all_reduce ends.
  template <class T, class Red>
  void all_reduce_pipelined(const T* in, T* out, std::size_t n, const Red& red) {
    const auto l = static_cast<std::size_t>(local_size_);
    const std::size_t wanted = std::clamp<std::size_t>(n * sizeof(T) / segment_, 1, kSegmentsMax);
    const std::size_t seg = ((n + wanted - 1) / wanted + l - 1) / l * l;  // whole slices
    const std::size_t count = (n + seg - 1) / seg;
    struct Segment {
      const T* src;  // reduce_scatter's input
      T* buf;        // where the segment is reduced and gathered
      T* dst;        // where its result goes
      std::size_t len, chunk;
    };
    std::vector<Segment> v(count);
    for (std::size_t i = 0; i < count; ++i) {
      const std::size_t off = i * seg;
      const std::size_t len = std::min(seg, n - off);
      const std::size_t chunk = (len + l - 1) / l;
      if (chunk * l == len) {
        v[i] = Segment{in + off, out + off, out + off, len, chunk};
      } else {  // only the last segment: padded as in the one-segment form
        T* b = scratch<T>(0, chunk * l);
        copy(in + off, b, len);
        std::fill(b + len, b + chunk * l, b[0]);
        v[i] = Segment{b, b, out + off, len, chunk};
      }
    }
    auto slot = [&](const Segment& x) { return x.buf + static_cast<std::size_t>(local_) * x.chunk; };
    Pending p;
    p.works.reserve(3 * count);
    std::vector<std::size_t> rs(count), ar(count), ag(count);
    begin_step(Level::intra, "reduce_scatter");
    for (std::size_t i = 0; i < count; ++i)
      rs[i] = p.add(intra_->reduce_scatter(std::span<const T>(v[i].src, v[i].chunk * l), std::span<T>(slot(v[i]), v[i].chunk),
                                           red, comm::async));
    end_step();
    for (std::size_t i = 0; i < count; ++i) {
      wait_step(Level::intra, "reduce_scatter", p.works[rs[i]]);
      begin_step(Level::inter, "all_reduce");
      ar[i] = p.add(inter_->all_reduce(std::span<const T>(slot(v[i]), v[i].chunk), std::span<T>(slot(v[i]), v[i].chunk),
                                       red, comm::async));
      end_step();
    }
    for (std::size_t i = 0; i < count; ++i) {
      wait_step(Level::inter, "all_reduce", p.works[ar[i]]);
      begin_step(Level::intra, "all_gather");
      ag[i] = p.add(intra_->all_gather(
          std::span<const Bytes>(reinterpret_cast<const Bytes*>(slot(v[i])), v[i].chunk * sizeof(T)),
          std::span<Bytes>(reinterpret_cast<Bytes*>(v[i].buf), v[i].chunk * l * sizeof(T)), comm::async));
      end_step();
    }
    for (std::size_t i = 0; i < count; ++i) wait_step(Level::intra, "all_gather", p.works[ag[i]]);
    for (const auto& x : v)
      if (x.buf != x.dst) copy(x.buf, x.dst, x.len);
  }

  template <class T>
  void do_reduce_scatter(const Op& op) {
    const std::size_t c = op.out_count;
    if (c == 0) return;
    T* out = static_cast<T*>(op.out);
    with_reduction<T>(op, [&](const auto& red) { reduce_scatter_n<T>(static_cast<const T*>(op.in), out, c, red); });
    if (op.finish != nullptr) op.finish(out, c, this->size());
  }

  template <class T, class Red>
  void reduce_scatter_n(const T* in, T* out, std::size_t c, const Red& red) {
    const int m = num_nodes();
    const int l = local_size_;
    const std::size_t total = ranks() * c;
    if (m == 1) {  // local ranks are the ranks
      if (l == 1) return copy(in, out, c);
      return intra_step("reduce_scatter", [&](Intra& x) {
        x.reduce_scatter(std::span<const T>(in, total), std::span<T>(out, c), red, blocking);
      });
    }
    if (!topo_.uniform) {
      T* all = scratch<T>(1, total);
      all_reduce_n<T>(in, all, total, red);
      return copy(all + static_cast<std::size_t>(this->rank()) * c, out, c);
    }
    // Local rank j's share: the blocks of the ranks of local index j, by node.
    const std::size_t share = static_cast<std::size_t>(m) * c;
    const T* src = in;
    T* reordered = nullptr;
    if (!local_major_) {
      reordered = scratch<T>(0, total);
      for (int j = 0; j < l; ++j)
        for (int k = 0; k < m; ++k)
          copy(in + static_cast<std::size_t>(topo_.rank_at(k, j)) * c,
               reordered + (static_cast<std::size_t>(j) * static_cast<std::size_t>(m) + static_cast<std::size_t>(k)) * c,
               c);
      src = reordered;
    }
    const T* mine = src;  // this rank's share, reduced over the node
    if (l > 1) {
      T* slot = reordered != nullptr ? reordered + static_cast<std::size_t>(local_) * share : scratch<T>(1, share);
      intra_step("reduce_scatter", [&](Intra& x) {
        x.reduce_scatter(std::span<const T>(src, total), std::span<T>(slot, share), red, blocking);
      });
      mine = slot;
    }
    inter_step("reduce_scatter", [&](Inter& x) {
      x.reduce_scatter(std::span<const T>(mine, share), std::span<T>(out, c), red, blocking);
    });
  }

  void do_all_gather(const Bytes* in, Bytes* out, std::size_t b) {
    if (b == 0) return;
    const int m = num_nodes();
    const int l = local_size_;
    const std::size_t total = ranks() * b;
    if (m == 1) {
      if (l == 1) return copy(in, out, b);
      return intra_step("all_gather", [&](Intra& x) {
        x.all_gather(std::span<const Bytes>(in, b), std::span<Bytes>(out, total), blocking);
      });
    }
    if (!topo_.uniform) {
      // Every rank's block at its place in a zeroed buffer, or-ed together: exact for any bits.
      Bytes* z = scratch<Bytes>(0, total);
      std::memset(z, 0, total);
      copy(in, z + static_cast<std::size_t>(this->rank()) * b, b);
      return all_reduce_n<Bytes>(z, out, total, ReduceOp::bor);
    }
    // Slots by local index, then node; `out` itself when that is the rank order.
    const std::size_t share = static_cast<std::size_t>(m) * b;
    Bytes* q = local_major_ ? out : scratch<Bytes>(1, total);
    Bytes* slot = q + static_cast<std::size_t>(local_) * share;
    inter_step("all_gather", [&](Inter& x) {
      x.all_gather(std::span<const Bytes>(in, b), std::span<Bytes>(slot, share), blocking);
    });
    if (l > 1)
      intra_step("all_gather", [&](Intra& x) {
        x.all_gather(std::span<const Bytes>(slot, share), std::span<Bytes>(q, total), blocking);
      });
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
    auto across = [&] {
      inter_step("broadcast", [&](Inter& x) { x.broadcast(std::span<Bytes>(data, b), m0, blocking); });
    };
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
      return intra_step("gather", [&](Intra& x) {
        x.gather(std::span<const Bytes>(in, b), std::span<Bytes>(out, is_root ? total : 0), l0, blocking);
      });
    }
    if (!topo_.uniform) {
      Bytes* all = is_root ? out : scratch<Bytes>(1, total);
      if (is_root && in >= out && in < out + total) {  // in place on the root: keep the input
        Bytes* keep = scratch<Bytes>(1, b);
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
      Bytes* g = local_ == l0 ? scratch<Bytes>(0, node_bytes) : nullptr;
      intra_step("gather", [&](Intra& x) {
        x.gather(std::span<const Bytes>(in, b), std::span<Bytes>(g, g != nullptr ? node_bytes : 0), l0, blocking);
      });
      mine = g;
    }
    if (local_ != l0) return;
    Bytes* h = !is_root ? nullptr : node_major_ ? out : scratch<Bytes>(1, total);
    inter_step("gather", [&](Inter& x) {
      x.gather(std::span<const Bytes>(mine, node_bytes), std::span<Bytes>(h, h != nullptr ? total : 0), m0, blocking);
    });
    if (is_root && h != out)
      for (int k = 0; k < m; ++k)
        for (int j = 0; j < l; ++j)
          copy(h + (static_cast<std::size_t>(k) * static_cast<std::size_t>(l) + static_cast<std::size_t>(j)) * b,
               out + static_cast<std::size_t>(topo_.rank_at(k, j)) * b, b);
  }

  /// scatter, all_to_all, all_to_all_v as the flat member's (one rank: a copy).
  template <class T>
  void do_flat(const Op& op) {
    const auto* in = static_cast<const T*>(op.in);
    T* out = static_cast<T*>(op.out);
    const std::size_t n = ranks();
    if (n == 1) {  // every block is this rank's own
      if (op.desc.kind == OpKind::scatter) return copy(in, out, op.out_count);
      return copy(in, out, op.in_count);
    }
    switch (op.desc.kind) {
      case OpKind::scatter:
        return flat_step("scatter", [&](auto& x) {
          x.scatter(std::span<const T>(in, op.in_count), std::span<T>(out, op.out_count), op.desc.root, blocking);
        });
      case OpKind::all_to_all:
        return flat_step("all_to_all", [&](auto& x) {
          x.all_to_all(std::span<const T>(in, op.in_count), std::span<T>(out, op.out_count), blocking);
        });
      default: {
        const std::span<const std::size_t> counts(op.counts);
        return flat_step("all_to_all_v", [&](auto& x) {
          x.all_to_all_v(std::span<const T>(in, op.in_count), counts.first(n), std::span<T>(out, op.out_count),
                         counts.subspan(n, n), blocking);
        });
      }
    }
  }

  void do_barrier() {
    auto intra = [&] {
      if (local_size_ > 1) intra_step("barrier", [&](Intra& x) { x.barrier(blocking); });
    };
    auto across = [&] {
      if (num_nodes() > 1) inter_step("barrier", [&](Inter& x) { x.barrier(blocking); });
    };
    intra();
    if (topo_.uniform) return across();
    if (leader()) across();
    intra();
  }

  // The pipelined all_reduce: at most this many segments (more hide more of the on-node steps,
  // each costs three member operations).
  static constexpr std::size_t kSegmentsMax = 8;

  Topology topo_;
  int node_ = 0;
  int local_ = 0;
  int local_size_ = 1;
  std::vector<int> inter_group_;  // the ranks of this rank's inter-node group, by node
  bool local_major_ = false;      // rank == local * M + node: slices need no reordering
  bool node_major_ = false;       // rank == node * L + local: gathers need no reordering
  std::size_t small_max_;
  std::size_t segment_;  // pipeline segments of at least this many bytes
  std::array<std::vector<std::byte>, 2> scratch_;

  // The step running now, for error messages (executing thread only).
  Level step_level_ = Level::intra;
  const char* step_op_ = "";
  bool in_step_ = false;

  std::mutex members_mu_;  // close_transport (any thread) against guarded()'s teardown
  std::optional<Intra> intra_;
  std::optional<Inter> inter_;  // absent off the leaders when nodes differ in size
  std::optional<Inter> flat_;   // every rank (FlatVia::own): scatter, all_to_all(_v), point-to-point
  FlatVia flat_via_ = FlatVia::none;
};

}  // namespace comm::detail::hierarchical
