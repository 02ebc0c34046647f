#pragma once
/// \file
/// `comm::backends::Gloo`: the CPU backend, over libgloo's TCP transport.
///
/// Use it through `comm::Communicator<comm::backends::Gloo>` (see communicator.hpp); link
/// `comm::gloo`.
///
/// - **Rendezvous** goes through a `comm::Store`: each rank publishes its gloo addresses under a key
///   prefix unique to the communicator, then every pair of ranks connects (a full mesh).
/// - **Network devices:** `Options::interfaces`, else `Options::hostname`, else
///   `GLOO_SOCKET_IFNAME` (comma-separated: one device per interface), else the local address that
///   routes to `MASTER_ADDR` (127.0.0.1 for a loopback master), else 127.0.0.1. With several
///   devices the communicator connects one gloo context per device and spreads *operations*
///   round-robin over them (operation i uses device i mod n), as torch.distributed does; one
///   operation never spans devices. Devices are shared by all communicators of a process.
/// - **Blocking calls** return when the result is in the output on this rank. They run on the
///   calling thread when nothing is queued, else after the queued async work.
/// - **Async calls** (`comm::async`) return a `comm::Work` at once; the operations of one
///   communicator run in issue order on one worker thread (started on first use). The buffers must
///   stay alive and untouched until the Work completes.
/// - **Threads:** one worker per communicator (only once it has gone async) and one event-loop
///   thread per network device, shared across communicators.
/// - **Deadlines:** every operation ends by `Options::timeout` (default: COMM_TIMEOUT, else 30 min)
///   with comm::Timeout naming the operation and rank. A peer that exits makes the others fail with
///   comm::RemoteError as soon as its connections close. After a Timeout/RemoteError/BackendError
///   the communicator is unusable: later operations fail at once with the first cause.
/// - **Destruction** finishes the queued operations (each bounded by the timeout; failing at once if
///   the communicator already failed), then closes the connections.
/// - **Reductions:** every built-in op on every element type (bitwise: integers only) with comm's own
///   kernels (detail/reduce.hpp), and custom callables `T(T, T)`, which must be associative,
///   commutative and must not throw.
/// - **Subgroups:** `split(color, key)` (collective over this communicator) and `new_group(ranks)`
///   (members only) connect a new gloo context among the members through a PrefixStore over this
///   communicator's store, under a prefix unique to the group (this communicator's key prefix, the
///   group's number — counted alike on every rank, members or not — and, for split, the color).
///   The communicator keeps its store (and so, on rank 0 of env://, the TcpStore server) for that.
///   An adopted communicator has no store: split, new_group and monitored_barrier need create().
/// - **Diagnostics:** the flight recorder (`Options::flight_recorder_size`, see
///   <comm/diagnostics.hpp>); the desync check (`Options::desync_check`): before each operation an
///   exchange of a 32-byte fingerprint per rank (each rank sends its own to every other: one
///   message latency; a gloo ring allgather beyond 64 ranks), then DesyncError on every rank if
///   they differ; monitored_barrier through the store (detail/monitored_barrier.hpp).

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <gloo/context.h>

#include <comm/concepts.hpp>
#include <comm/detail/desync.hpp>
#include <comm/detail/env.hpp>
#include <comm/detail/flight_recorder.hpp>
#include <comm/detail/gloo/engine.hpp>
#include <comm/diagnostics.hpp>
#include <comm/error.hpp>
#include <comm/store.hpp>
#include <comm/types.hpp>
#include <comm/work.hpp>

namespace comm::backends {

/// Options of comm::backends::Gloo (also spelled `comm::backends::Gloo::Options`).
struct GlooOptions {
  /// Deadline of every operation and of rendezvous (default: COMM_TIMEOUT, else 30 minutes).
  std::chrono::milliseconds timeout = comm::detail::default_timeout();
  /// Network interfaces to use, one gloo device each (operations go round-robin over them);
  /// overrides GLOO_SOCKET_IFNAME.
  std::vector<std::string> interfaces;
  /// Host name or address to bind to when `interfaces` is empty; overrides GLOO_SOCKET_IFNAME.
  std::string hostname;
  /// Before each operation, compare (sequence number, operation, element type, count, root,
  /// reduction) across ranks and throw comm::DesyncError on every rank when they differ (one small
  /// gloo allgather per operation). Must be the same on every rank. Default: on with
  /// COMM_DEBUG=DETAIL.
  bool desync_check = comm::detail::desync_check_default();
  /// How many operations the flight recorder keeps (0: none). Default: COMM_FLIGHT_RECORDER_SIZE,
  /// else 256.
  std::size_t flight_recorder_size = comm::detail::flight_recorder_size_default();
};

/// The Gloo backend policy. Move-only; its moved-from state may only be destroyed or assigned.
class Gloo {
 public:
  using backend_concept = comm::backend_t;
  static constexpr std::string_view name = "gloo";

  using Options = GlooOptions;

  static constexpr bool supports_dtype(Dtype) noexcept { return true; }
  static constexpr bool supports_reduction(ReduceOp op, Dtype d) noexcept { return !is_bitwise(op) || !is_floating(d); }
  static constexpr bool custom_reductions = true;

  /// Connects `size` ranks through `store` (blocking; ends by `options.timeout`).
  [[nodiscard]] static Gloo create(std::shared_ptr<Store> store, int rank, int size, const Options& options = {}) {
    if (!store) throw InvalidArgument("gloo.init", rank, "store is null");
    if (size < 1) throw InvalidArgument("gloo.init", rank, "size " + std::to_string(size) + " must be at least 1");
    if (rank < 0 || rank >= size)
      throw InvalidArgument("gloo.init", rank,
                            "rank " + std::to_string(rank) + " is out of range [0, " + std::to_string(size) + ")");
    check_timeout(options, rank);
    return Gloo(std::make_unique<detail::gloo::Engine>(std::move(store), rank, size, config(options)), options);
  }

  /// Wraps an already connected gloo context (e.g. one shared with other code).
  [[nodiscard]] static Gloo adopt(std::shared_ptr<::gloo::Context> context, const Options& options = {}) {
    if (!context) throw InvalidArgument("gloo.adopt", -1, "gloo context is null");
    check_timeout(options, context->rank);
    return Gloo(std::make_unique<detail::gloo::Engine>(std::move(context), config(options)), options);
  }

  Gloo(Gloo&&) noexcept = default;
  Gloo& operator=(Gloo&&) noexcept = default;
  ~Gloo() = default;

  [[nodiscard]] int rank() const noexcept { return engine_->rank(); }
  [[nodiscard]] int size() const noexcept { return engine_->size(); }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return engine_->timeout(); }
  /// The gloo context of device `i` (escape hatch for code that talks to gloo directly; do not
  /// use it concurrently with this communicator's operations).
  [[nodiscard]] const std::shared_ptr<::gloo::Context>& context(std::size_t i = 0) const { return engine_->context(i); }
  [[nodiscard]] std::size_t num_devices() const noexcept { return engine_->num_contexts(); }

  template <element T, class Red, class Launch>
  auto all_reduce(std::span<const T> in, std::span<T> out, Red red, Launch l) {
    return engine_->all_reduce<T>(in, out, std::move(red), l);
  }
  template <element T, class Red, class Launch>
  auto reduce_scatter(std::span<const T> in, std::span<T> out, Red red, Launch l) {
    return engine_->reduce_scatter<T>(in, out, std::move(red), l);
  }
  template <element T, class Launch>
  auto all_gather(std::span<const T> in, std::span<T> out, Launch l) {
    return engine_->all_gather<T>(in, out, l);
  }
  template <element T, class Launch>
  auto broadcast(std::span<T> data, int root, Launch l) {
    return engine_->broadcast<T>(data, root, l);
  }
  template <element T, class Launch>
  auto gather(std::span<const T> in, std::span<T> out, int root, Launch l) {
    return engine_->gather<T>(in, out, root, l);
  }
  template <class Launch>
  auto barrier(Launch l) {
    return engine_->barrier(l);
  }

  // ---- optional capabilities (see concepts.hpp): subgroups and diagnostics ----

  /// Collective over every rank of this communicator (an operation "split" in its sequence):
  /// ranks with the same `color` >= 0 form a new communicator, ordered by (key, rank here); a
  /// negative color gives nullopt. The new communicator inherits these options.
  [[nodiscard]] std::optional<Gloo> split(int color, int key) {
    require_store("split");
    const auto all = engine_->exchange_color_key(color, key);
    const auto k = engine_->next_group_index();
    if (color < 0) return std::nullopt;
    std::vector<std::pair<std::int64_t, int>> members;  // (key, rank here)
    for (int r = 0; r < size(); ++r)
      if (all[2 * static_cast<std::size_t>(r)] == color) members.emplace_back(all[2 * static_cast<std::size_t>(r) + 1], r);
    std::sort(members.begin(), members.end());
    const auto me = std::find(members.begin(), members.end(), std::pair<std::int64_t, int>{key, rank()});
    const std::string group = "g" + std::to_string(k);
    return child(engine_->key_prefix() + group + "/c" + std::to_string(color), group,
                 static_cast<int>(me - members.begin()), static_cast<int>(members.size()));
  }

  /// A communicator of `ranks` (validated by the facade: in range, no duplicates), ranked in
  /// that order. Every rank calls it in the same order; non-members return nullopt at once
  /// (without communicating), members connect among themselves only.
  [[nodiscard]] std::optional<Gloo> new_group(std::span<const int> ranks) {
    require_store("new_group");
    const auto k = engine_->next_group_index();
    const auto me = std::find(ranks.begin(), ranks.end(), rank());
    if (me == ranks.end()) return std::nullopt;
    const std::string group = "g" + std::to_string(k);
    return child(engine_->key_prefix() + group, group, static_cast<int>(me - ranks.begin()),
                 static_cast<int>(ranks.size()));
  }

  /// See Communicator::monitored_barrier; a zero timeout means this communicator's timeout.
  void monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks) {
    engine_->monitored_barrier(timeout.count() > 0 ? timeout : engine_->timeout(), wait_all_ranks);
  }

  /// The flight recorder's contents (see <comm/diagnostics.hpp>).
  [[nodiscard]] FlightRecord flight_record() const { return engine_->flight_record(); }
  /// Writes the flight record to `path` ("-": stderr); comm::BackendError when it cannot.
  void dump_flight_record(const std::string& path) const {
    comm::detail::write_text_file(path, to_string(engine_->flight_record()), rank());
  }
  /// Whether the desync check runs before each operation.
  [[nodiscard]] bool desync_check() const noexcept { return engine_->desync_check(); }
  /// The options this communicator was made with (subgroups inherit them).
  [[nodiscard]] const Options& options() const noexcept { return options_; }

 private:
  Gloo(std::unique_ptr<detail::gloo::Engine> e, Options o) noexcept : engine_(std::move(e)), options_(std::move(o)) {}

  static detail::gloo::EngineConfig config(const Options& o) {
    detail::gloo::EngineConfig c;
    c.timeout = o.timeout;
    c.interfaces = o.interfaces;
    c.hostname = o.hostname;
    c.desync_check = o.desync_check;
    c.flight_recorder_size = o.flight_recorder_size;
    return c;
  }

  void require_store(const char* op) const {
    if (!engine_->store())
      throw InvalidArgument(op, rank(),
                            "this communicator was adopted from a gloo context and has no store; subgroups need one "
                            "(create the communicator with create() or from_env())");
  }

  /// Connects subgroup `group` (this rank is `rank` of `size`) under `prefix` in this store.
  Gloo child(const std::string& prefix, const std::string& group, int rank, int size) const {
    auto c = config(options_);
    c.file_rank = engine_->file_rank();
    c.name = engine_->name().empty() ? group : engine_->name() + "." + group;
    auto store = std::make_shared<PrefixStore>(prefix, engine_->store());
    return Gloo(std::make_unique<detail::gloo::Engine>(std::move(store), rank, size, c), options_);
  }

  static void check_timeout(const Options& o, int rank) {
    if (o.timeout.count() <= 0)
      throw InvalidArgument("gloo.init", rank,
                            "timeout " + std::to_string(o.timeout.count()) + " ms must be positive");
  }

  std::unique_ptr<detail::gloo::Engine> engine_;
  Options options_;
};

}  // namespace comm::backends
