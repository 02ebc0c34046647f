#pragma once
// Hierarchical's member communicators (see engine.hpp): their creation, the steps an operation
// runs on them, and what a failure of a step becomes. A step is an Op record (detail/engine/op.hpp)
// handed to the member's erased entry (ErasedLaunch): the composed operation was typed once, by
// the facade, and its steps are never re-typed.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <comm/concepts.hpp>
#include <comm/detail/engine/comm_core.hpp>
#include <comm/detail/engine/forward.hpp>
#include <comm/detail/engine/op.hpp>
#include <comm/detail/engine/transport.hpp>
#include <comm/detail/hierarchical/topology.hpp>
#include <comm/error.hpp>
#include <comm/store.hpp>
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

/// Which member a step runs on: this node's, this rank's inter-node group, or the communicator of
/// every rank (scatter, all_to_all(_v), point-to-point).
enum class Level : std::uint8_t { intra, inter, flat };

/// Where this rank sits: computed once by the engine from the node identities.
struct Place {
  const Topology* topo = nullptr;
  int node = 0;
  int local = 0;
  int local_size = 1;
  std::vector<int> inter_group;  // the ranks of this rank's inter-node group, by node
};

template <class Intra, class Inter>
class Members {
  static_assert(erased_launch<Intra> && erased_launch<Inter>,
                "comm: Hierarchical<Intra, Inter>: both backends' engines must take operation records (an "
                "EngineCore engine through ForwardOps)");

 public:
  using Config = EngineConfig<typename Intra::Options, typename Inter::Options>;
  /// Whether scatter, all_to_all(_v) and point-to-point run here (on a communicator of every rank).
  static constexpr bool kFlat = comm::supports_full_surface<Inter>;
  static constexpr bool kFlatIntra = comm::supports_full_surface<Intra>;

  /// Creates the members: blocking, each ending by the timeout.
  Members(const CommCore& core, const Place& place, const Config& cfg) : core_(core), place_(place) {
    create(cfg);
  }

  /// Runs `op` on the member of `level` and returns once it completed here.
  void run(Level level, Op& op) {
    begin_step(level, op_name(op.desc.kind));
    launch(level, op, blocking);
    end_step();
  }
  /// Starts `op` on the member of `level` (comm::async); wait with wait().
  Work start(Level level, Op& op) {
    begin_step(level, op_name(op.desc.kind));
    Work w = launch(level, op, comm::async);
    end_step();
    return w;
  }
  /// Waits for member operation `w`, started as `op` on `level` (for its errors' text); with a
  /// `backstop`, at most that long before Work::wait's own deadline takes over.
  void wait(Level level, const char* op, Work& w, std::chrono::milliseconds backstop = {}) {
    begin_step(level, op);
    if (backstop.count() > 0) (void)w.wait_for(backstop);
    w.wait();
    end_step();
  }

  /// The level of the communicator of every rank (throws where there is none).
  [[nodiscard]] Level flat(const char* op) const {
    switch (flat_via_) {
      case FlatVia::intra: return Level::intra;
      case FlatVia::inter: return Level::inter;
      case FlatVia::own: return Level::flat;
      case FlatVia::none: break;
    }
    throw BackendError(op, core_.rank(), "no communicator of every rank for this operation");
  }

  /// Another thread gave up on an operation (Work::wait's deadline) or a step failed: stops what
  /// can be stopped from here. Gloo members abort their connections (their peers fail at once);
  /// an operation in a Shm step ends by its own deadline, and the executing thread then destroys
  /// the members (guarded()).
  void close_transport() noexcept {
    std::lock_guard lock(mu_);
    abort_member(intra_);
    abort_member(inter_);
    abort_member(flat_);
  }

  /// Runs `f` (steps of one operation, on the executing thread); on any exception destroys the
  /// members first, so that their peers learn at once that this rank left. That teardown is part
  /// of recording the failure (failing_scope): a peer's echo of it waits.
  template <class F>
  void guarded(F&& f) {
    try {
      std::forward<F>(f)();
    } catch (...) {
      const auto scope = core_.failing_scope();
      std::optional<Intra> a;
      std::optional<Inter> b, c;
      {
        std::lock_guard lock(mu_);
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

  /// A member's error as this communicator's (call inside a catch block): the step and the
  /// member's ranks in the text, its peer as a rank here.
  [[noreturn]] void rethrow_translated(const char* op) {
    try {
      throw;
    } catch (const Error& e) {
      if (!in_step_) throw;
      in_step_ = false;
      if (step_level_ == Level::flat)  // ranks there are ranks here
        rethrow_like(e, op, core_.rank(),
                     e.detail() + " [in the " + step_op_ + " of this " + op + " on the " + std::string(Inter::name) +
                         " communicator of every rank]",
                     e.peer());
      const bool intra = step_level_ == Level::intra;
      const std::vector<int>& group = intra ? node_ranks() : place_.inter_group;
      const std::string where =
          std::string(" [in the ") + (intra ? "intra-node " : "inter-node ") + step_op_ + " of this " + op +
          (intra ? " on node " + std::to_string(place_.node) : std::string()) + ": " +
          std::string(intra ? Intra::name : Inter::name) + " communicator of ranks " + list_ranks(group) +
          ", its rank i being the i-th of them]";
      rethrow_like(e, op, core_.rank(), e.detail() + where, map_peer(e.peer(), group));
    } catch (const std::bad_alloc&) {
      throw;
    } catch (const std::exception& e) {
      throw BackendError(op, core_.rank(), e.what());
    } catch (...) {
      throw BackendError(op, core_.rank(), "unknown exception");
    }
  }

 private:
  enum class FlatVia : std::uint8_t { none, intra, inter, own };

  [[nodiscard]] const std::vector<int>& node_ranks() const {
    return place_.topo->nodes[static_cast<std::size_t>(place_.node)];
  }

  template <class Launch>
  auto launch(Level level, Op& op, Launch l) {
    switch (level) {
      case Level::intra: return ErasedLaunch::launch(*intra_, op, l);
      case Level::inter: return ErasedLaunch::launch(*inter_, op, l);
      case Level::flat: break;
    }
    return ErasedLaunch::launch(*flat_, op, l);
  }

  void begin_step(Level level, const char* op) {
    if (core_.has_failed())  // an abort from another thread: stop between steps
      throw BackendError(op, core_.rank(), "stopped: the communicator was aborted");
    if ((level == Level::intra && !intra_) || (level == Level::inter && !inter_) || (level == Level::flat && !flat_))
      throw BackendError(op, core_.rank(), "the communicator is unusable after an earlier failure");
    step_level_ = level;
    step_op_ = op;
    in_step_ = true;
  }
  void end_step() noexcept { in_step_ = false; }

  template <class M>
  static void abort_member(std::optional<M>& m) noexcept {
    if (m) abort_transport(*m);
  }

  template <class O>
  void prepare(O& o, const Config& cfg, const char* level) const {
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
      o.record_file_rank = core_.file_rank();
      o.record_name = core_.name().empty() ? std::string(level) : core_.name() + "." + level;
    }
  }

  void create(const Config& cfg) {
    const std::string kp = core_.key_prefix();
    const auto& base = core_.store();
    const Topology& topo = *place_.topo;
    const int rank = core_.rank();
    auto io = cfg.intra;
    prepare(io, cfg, "intra");
    try {
      intra_.emplace(Intra::create(std::make_shared<PrefixStore>(kp + "intra/" + std::to_string(place_.node), base),
                                   place_.local, place_.local_size, io));
    } catch (const Error& e) {
      rethrow_like(e, "hierarchical.init", rank,
                   e.detail() + " [creating the intra-node " + std::string(Intra::name) + " communicator of node " +
                       std::to_string(place_.node) + ", ranks " + list_ranks(node_ranks()) +
                       (cfg.node_id_given ? ", grouped by COMM_NODE_ID / Options::node_id: ranks given one node id "
                                            "must run on one host"
                                          : "") +
                       "]",
                   map_peer(e.peer(), node_ranks()));
    }
    if (topo.uniform || place_.local == 0) {  // leaders-only: the others never cross nodes
      auto xo = cfg.inter;
      prepare(xo, cfg, "inter");
      const int index = topo.uniform ? place_.local : 0;
      try {
        inter_.emplace(Inter::create(std::make_shared<PrefixStore>(kp + "inter/" + std::to_string(index), base),
                                     place_.node, topo.num_nodes(), xo));
      } catch (const Error& e) {
        rethrow_like(e, "hierarchical.init", rank,
                     e.detail() + " [creating the inter-node " + std::string(Inter::name) + " communicator of ranks " +
                         list_ranks(place_.inter_group) + "]",
                     map_peer(e.peer(), place_.inter_group));
      }
    }
    if constexpr (kFlat) {
      if (core_.size() == 1) return;  // nothing to send anywhere: copies only
      if (kFlatIntra && topo.num_nodes() == 1) {
        flat_via_ = FlatVia::intra;
        return;
      }
      if (topo.uniform && place_.local_size == 1) {
        flat_via_ = FlatVia::inter;
        return;
      }
      flat_via_ = FlatVia::own;
      auto fo = cfg.inter;
      prepare(fo, cfg, "flat");
      try {
        flat_.emplace(Inter::create(std::make_shared<PrefixStore>(kp + "flat", base), rank, core_.size(), fo));
      } catch (const Error& e) {
        rethrow_like(e, "hierarchical.init", rank,
                     e.detail() + " [creating the " + std::string(Inter::name) +
                         " communicator of every rank (scatter, all_to_all, point-to-point)]",
                     e.peer());
      }
    }
  }

  const CommCore& core_;
  const Place& place_;

  // The step running now, for error messages (executing thread only).
  Level step_level_ = Level::intra;
  const char* step_op_ = "";
  bool in_step_ = false;

  std::mutex mu_;  // close_transport (any thread) against guarded()'s teardown
  std::optional<Intra> intra_;
  std::optional<Inter> inter_;  // absent off the leaders when nodes differ in size
  std::optional<Inter> flat_;   // every rank (FlatVia::own): scatter, all_to_all(_v), point-to-point
  FlatVia flat_via_ = FlatVia::none;
};

}  // namespace comm::detail::hierarchical
