#pragma once
/// \file
/// `comm::backends::Hierarchical<Intra, Inter>`: a CPU backend for ranks on several hosts, made of
/// two communicators per rank: `Intra` among the ranks of its node (`Shm`: shared memory) and
/// `Inter` across nodes (`Gloo`: TCP).
///
/// ```cpp
/// using H = comm::backends::Hierarchical<comm::backends::Shm, comm::backends::Gloo>;
/// auto c = comm::Communicator<H>::from_env();       // cdb: backend "hierarchical"
/// ```
/// Use it through `comm::Communicator<Hierarchical<Intra, Inter>>` (see communicator.hpp); with
/// Gloo as `Inter`, link `comm::gloo`. Host buffers only (a device buffer is comm::InvalidArgument).
/// `Intra` and `Inter` are host backends whose engines take operation records (Gloo, Shm, Mpi):
/// each step of an operation is such a record, handed to the member without re-typing it.
///
/// - **Nodes:** by default the ranks whose host identity (boot id, IPC/PID/network namespaces,
///   host name: what Shm requires of its ranks) is the same form one node. `Options::node_id`
///   (default: `COMM_NODE_ID`, any string) overrides it: ranks with the same id are one node (for
///   tests, and for launchers that know better; Shm still refuses ranks of one id on two hosts).
///   Nodes are numbered by their lowest rank, and ranks within a node (local ranks) in rank order;
///   a node's ranks need not be consecutive. Every rank derives the same structure from the
///   identities, exchanged through the store at creation.
/// - **Members:** one `Intra` communicator per node, and, when every node has the same number of
///   ranks L, one `Inter` communicator per local rank index (the ranks with local rank l, one per
///   node), which all work at once. When nodes differ in size, only local rank 0 of each node has
///   an `Inter` communicator ("leaders-only", said at COMM_DEBUG=INFO), which is slower: one rank
///   per node carries all the cross-node traffic.
/// - **Algorithms** (detail/hierarchical/engine.hpp): all_reduce above `Options::small_max` bytes
///   is an intra reduce_scatter (local rank l owns 1/L of the buffer; counts that L does not divide
///   are padded), an inter all_reduce of that slice across nodes, and an intra all_gather: each
///   node sends the buffer across once, L streams at a time, where a flat ring sends up to twice
///   that; from 32 to 128 KiB (below the pipeline) the node's local rank 0 carries the whole buffer
///   across alone instead (intra reduce, inter all_reduce among the nodes' first ranks, intra
///   broadcast): the same bytes in L times fewer messages. Below small_max: intra all_reduce, then
///   inter all_reduce of the whole buffer. reduce_scatter, all_gather, gather and broadcast are
///   the same two levels; barrier is intra then inter.
///   avg is the sum divided once at the end (integers: floor division). reduce is that all_reduce
///   (into scratch off the root).
/// - **scatter, all_to_all, all_to_all_v, send, recv, batch_isend_irecv** (where `Inter` has them,
///   `comm::supports_full_surface<Inter>`; Gloo does): each rank also holds a third member, an
///   `Inter` communicator of every rank (same ranks as this one), and these run on it: they move
///   different data between every pair of ranks, where two levels would only add copies. It costs
///   one more `Inter` rendezvous at creation (Gloo: a connection between every pair of ranks).
///   Point-to-point messages are checked as the member checks them (element type, count, tag, in
///   the order sent: a mismatch is comm::DesyncError); premul_sum scales a copy of the input.
/// - **Blocking calls** return when the result is in the output on this rank; **async calls**
///   (`comm::async`) return a `comm::Work` and run in issue order on one worker thread per
///   communicator. Buffers must stay alive and untouched until completion.
/// - **Deadlines:** `Options::timeout` (default COMM_TIMEOUT, else 30 min) is also the members'
///   timeout: each step of an operation (at most three member operations) ends by it, and
///   `Work::wait` gives up after it. Errors are the members' kind (Timeout, RemoteError...),
///   thrown as this communicator's operation and rank, with the step that failed and, where known,
///   the peer as a rank of this communicator.
/// - **Failure:** after a Timeout/RemoteError/BackendError the communicator is unusable (later
///   operations fail at once with the first cause) and this rank closes every member, so ranks
///   waiting on it in any member fail soon instead of at their deadline.
/// - **Reductions and types:** those both members support (Shm and Gloo: every built-in op on every
///   element type, bitwise on integers; custom callables `T(T, T)`, associative and commutative).
/// - **Diagnostics:** flight recorder (`Options::flight_recorder_size`; the members keep records
///   too, dumped as `<COMM_FLIGHT_RECORDER>.<rank>[.<name>].intra` / `.inter`), the desync check
///   (`Options::desync_check`, over the composed operation; the members' own check is off),
///   monitored_barrier (through the store).
/// - **Subgroups:** `split` and `new_group` give Hierarchical communicators of the members, with
///   their own Intra and Inter communicators (their node structure is derived again from the
///   members' node identities).

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <comm/concepts.hpp>
#include <comm/detail/engine/backend_diagnostics.hpp>
#include <comm/detail/engine/forward.hpp>
#include <comm/detail/engine/policy.hpp>
#include <comm/detail/engine/elastic.hpp>
#include <comm/detail/engine/subgroups.hpp>
#include <comm/detail/base/env.hpp>
#include <comm/detail/hierarchical/engine.hpp>
#include <comm/detail/init/host.hpp>
#include <comm/error.hpp>
#include <comm/options.hpp>
#include <comm/store.hpp>
#include <comm/types.hpp>
#include <comm/work.hpp>

namespace comm::backends {

namespace detail_hierarchical {
[[nodiscard]] inline std::string env_node_id() {
  auto v = comm::detail::getenv_str("COMM_NODE_ID");
  return v ? std::string(comm::detail::trim(*v)) : std::string();
}
[[nodiscard]] inline std::size_t env_small_max() {
  if (auto v = comm::detail::env_nonneg_int("COMM_HIERARCHICAL_SMALL_MAX")) return static_cast<std::size_t>(*v);
  return std::size_t{4} << 10;
}
[[nodiscard]] inline std::size_t env_segment() {
  if (auto v = comm::detail::env_nonneg_int("COMM_HIERARCHICAL_SEGMENT")) return static_cast<std::size_t>(*v);
  return std::size_t{256} << 10;
}
}  // namespace detail_hierarchical

/// Options of comm::backends::Hierarchical<Intra, Inter> (also spelled `Hierarchical<...>::Options`).
/// The common ones are comm::CommonOptions': `timeout` bounds rendezvous and every step of an
/// operation, for this communicator and its members (it replaces `intra.timeout` and
/// `inter.timeout`); `desync_check` checks the composed operation (the members' own check is off).
template <class Intra, class Inter>
struct HierarchicalOptions : CommonOptions {
  /// Which node this rank is on: ranks with the same non-empty id form one node. Empty: the host
  /// identity. Default: COMM_NODE_ID.
  std::string node_id = detail_hierarchical::env_node_id();
  /// Options of the communicator among the ranks of a node (its timeout and desync_check are set
  /// by this communicator).
  typename Intra::Options intra{};
  /// Options of the communicators across nodes (likewise).
  typename Inter::Options inter{};
  /// all_reduce up to this many bytes runs as intra all_reduce + inter all_reduce (one step
  /// fewer); above, as reduce_scatter / all_reduce of a slice / all_gather (1/L of the bytes
  /// across nodes per rank), but from 32 to 128 KiB, on equal nodes of several ranks, as intra
  /// reduce / the nodes' first ranks' all_reduce / intra broadcast. Must be the same on every
  /// rank. Default: COMM_HIERARCHICAL_SMALL_MAX, else 4 KiB.
  std::size_t small_max = detail_hierarchical::env_small_max();
  /// The slice form of all_reduce from 2 * segment_bytes up runs in up to 8 segments of at least
  /// this many bytes, pipelined: the on-node steps of one segment overlap the cross-node step of
  /// another. Must be the same on every rank. Default: COMM_HIERARCHICAL_SEGMENT, else 256 KiB
  /// (at least 4 KiB). Not for one rank per node: there, from 4 nodes and above 2 MiB a node,
  /// the segments are cut so that each node's block is at most 256 KiB (docs/BACKENDS.md).
  std::size_t segment_bytes = detail_hierarchical::env_segment();
};

/// The Hierarchical backend policy over an on-node backend `Intra` and a cross-node backend
/// `Inter`. Move-only; its moved-from state may only be destroyed or assigned.
template <class Intra, class Inter>
class Hierarchical : public comm::detail::ForwardOps<Hierarchical<Intra, Inter>>,
                     public comm::detail::BackendDiagnostics<Hierarchical<Intra, Inter>>,
                     public comm::detail::Subgroups<Hierarchical<Intra, Inter>>,
                     public comm::detail::Elastic<Hierarchical<Intra, Inter>> {
  static_assert(comm::backend<Intra> && comm::backend<Inter>,
                "comm: Hierarchical<Intra, Inter>: both must satisfy the comm::backend concept (see concepts.hpp)");
  // Gathers across nodes of different sizes are a bitwise or over bytes.
  static_assert(Intra::supports_reduction(ReduceOp::bor, Dtype::uint8) &&
                    Inter::supports_reduction(ReduceOp::bor, Dtype::uint8),
                "comm: Hierarchical<Intra, Inter>: both backends must run bor on uint8");

  using Engine = comm::detail::hierarchical::Engine<Intra, Inter>;

 public:
  /// Opts in to the comm::backend concept (concepts.hpp).
  using backend_concept = comm::backend_t;
  /// The backend's name in the backend list (backends/list.hpp), in messages and in AnyCommunicator::backend(): "hierarchical".
  static constexpr std::string_view name = "hierarchical";

  /// The backend's options: HierarchicalOptions<Intra, Inter>.
  using Options = HierarchicalOptions<Intra, Inter>;
  /// The backend of the communicator among a node's ranks.
  using intra_backend = Intra;
  /// The backend of the communicators across nodes.
  using inter_backend = Inter;

  /// An element type both members support.
  static constexpr bool supports_dtype(Dtype d) noexcept { return Intra::supports_dtype(d) && Inter::supports_dtype(d); }
  /// A (reduction, element type) pair both members support.
  static constexpr bool supports_reduction(ReduceOp op, Dtype d) noexcept {
    return Intra::supports_reduction(op, d) && Inter::supports_reduction(op, d);
  }
  /// User callables as reductions, where both members take them.
  static constexpr bool custom_reductions = Intra::custom_reductions && Inter::custom_reductions;
  /// reduce, scatter, all_to_all(_v), send, recv and batch_isend_irecv run on an `Inter`
  /// communicator of every rank (see the file comment), so they exist where `Inter` has them.
  static constexpr bool forwards_full_surface = comm::supports_full_surface<Inter>;

  /// Joins `size` ranks through `store`: exchanges node identities, then creates the members
  /// (blocking; each part ends by `options.timeout`).
  [[nodiscard]] static Hierarchical create(std::shared_ptr<Store> store, int rank, int size,
                                           const Options& options = {}) {
    comm::detail::check_create("hierarchical.init", store, rank, size, options);
    return Hierarchical(std::make_unique<Engine>(std::move(store), rank, size, config(options)), options);
  }

  /// Moves; the moved-from object may only be destroyed or assigned.
  Hierarchical(Hierarchical&&) noexcept = default;
  /// Moves; the moved-from object may only be destroyed or assigned.
  Hierarchical& operator=(Hierarchical&&) noexcept = default;
  ~Hierarchical() = default;

  /// The node structure: this rank's node (numbered by lowest rank), the number of nodes, this
  /// rank's place on its node, and whether every node has the same number of ranks.
  ///@{
  [[nodiscard]] int node() const noexcept { return engine_->node(); }
  [[nodiscard]] int num_nodes() const noexcept { return engine_->topology().num_nodes(); }
  [[nodiscard]] int local_rank() const noexcept { return engine_->local_rank(); }
  [[nodiscard]] int local_size() const noexcept { return engine_->local_size(); }
  [[nodiscard]] bool uniform_nodes() const noexcept { return engine_->topology().uniform; }
///@}

  // rank(), size(), timeout() and the operations come from ForwardOps (detail/engine/forward.hpp);
  // the rest of the surface (capability 11) where Inter has it (forwards_full_surface).

  // Optional capabilities (concepts.hpp): split/new_group from Subgroups, monitored_barrier and
  // the flight recorder from BackendDiagnostics.

 private:
  friend class comm::detail::ForwardOps<Hierarchical>;
  friend class comm::detail::BackendDiagnostics<Hierarchical>;
  friend class comm::detail::Subgroups<Hierarchical>;
  friend class comm::detail::Elastic<Hierarchical>;

  Hierarchical(std::unique_ptr<Engine> e, Options o) noexcept : engine_(std::move(e)), options_(std::move(o)) {}

  static typename Engine::Config config(const Options& o) {
    auto c = comm::detail::engine_config<typename Engine::Config>(o);
    c.node_id_given = !o.node_id.empty();
    c.node_id = c.node_id_given ? "id=" + o.node_id : comm::detail::host_identity();
    c.intra = o.intra;
    c.inter = o.inter;
    c.small_max = o.small_max;
    c.segment = o.segment_bytes;
    return c;
  }

  /// Connects subgroup `g`, with members of its own (see Subgroups).
  Hierarchical child(const comm::detail::Subgroup& g) const {
    auto c = g.configured(config(options_));
    return Hierarchical(std::make_unique<Engine>(g.store, g.place.rank, g.place.size, c), options_);
  }

  std::unique_ptr<Engine> engine_;
  Options options_;
};

}  // namespace comm::backends
