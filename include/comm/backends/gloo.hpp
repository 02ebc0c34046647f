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
///   `COMM_SOCKET_IFNAME`, else `GLOO_SOCKET_IFNAME` (comma-separated: one device per interface),
///   else the local address that routes to `MASTER_ADDR` (127.0.0.1 for a loopback master), else
///   127.0.0.1. With several
///   devices the communicator connects one gloo context per device and spreads *operations*
///   round-robin over them (operation i uses device i mod n), as torch.distributed does; one
///   operation never spans devices. Devices are shared by all communicators of a process.
/// - **Blocking calls** return when the result is in the output on this rank. They run on the
///   calling thread when nothing is queued, else after the queued async work.
/// - **Async calls** (`comm::async`) return a `comm::Work` at once; the operations of one
///   communicator run in issue order on one worker thread (started on first use). The buffers must
///   stay alive and untouched until the Work completes.
/// - **SIGPIPE:** libgloo writes to sockets with writev(); a write to a peer that has just died
///   would kill the process with SIGPIPE, so the first device created ignores SIGPIPE when the
///   program left it at its default (a handler the program installed is kept); the write then
///   fails and the operation ends with comm::RemoteError.
/// - **Threads:** one worker per communicator (only once it has gone async) and one event-loop
///   thread per network device, shared across communicators, at nice +19 (`Options::loop_nice`).
/// - **Deadlines:** every operation ends by `Options::timeout` (default: COMM_TIMEOUT, else 30 min)
///   with comm::Timeout naming the operation and rank. A peer that exits makes the others fail with
///   comm::RemoteError as soon as its connections close. After a Timeout/RemoteError/BackendError
///   the communicator is unusable: later operations fail at once with the first cause. A
///   `Work::wait()` that gives up aborts the communicator (its pending operations fail, peers see
///   RemoteError) and returns its Timeout once the operation has ended, so gloo no longer touches
///   its buffers (bounded: at most one more timeout).
/// - **Membership check** before connecting: a rank started with another world size fails at once
///   with comm::InvalidArgument naming both processes; a rank that never joins is a Timeout naming
///   it (and, when its rank is held by another process, that process).
/// - **Algorithms:** all_reduce runs one exchange (2 ranks, <= 256 KiB) or recursive doubling
///   (more ranks, <= 256 KiB), else gloo's ring; reduce_scatter runs recursive halving (power-of-two
///   worlds, input <= 1 MiB), else comm's pipelined ring (detail/gloo/algorithms.hpp). Every rank
///   gets bit-identical results.
/// - **Destruction** finishes the queued operations (each bounded by the timeout; failing at once if
///   the communicator already failed), then closes the connections.
/// - **CUDA device buffers** (cudaMalloc / cuMemAlloc memory) are accepted by every collective,
///   blocking and async, in any mix with host buffers, so several ranks can share one GPU; comm
///   stages them through pinned host memory (detail/gloo/device_staging.hpp). The rules:
///   - the CUDA driver (libcuda.so.1) is loaded at run time on the first collective; there is no
///     build dependency. Where it is absent, finds no device, or COMM_GLOO_DEVICE_BUFFERS=0, every
///     buffer is host memory and the check costs one branch per call. Where it is present, the
///     first collective pays for cuInit and each call asks the driver about its buffers (one
///     cuPointerGetAttributes each); set COMM_GLOO_DEVICE_BUFFERS=0 to skip both.
///   - managed (cudaMallocManaged) and pinned/registered host memory count as host memory.
///   - a device input must be ready when the operation starts: synchronize the stream that wrote
///     it before the call. The copies are synchronous copies on the legacy default stream, in the
///     context the buffer was allocated in; inputs are copied to host when the operation runs (in
///     its place in the issue order), results back to the device after it succeeded. A blocking
///     call returns, and a Work completes, with the result in device memory.
///   - only what the operation reads is copied in and only what it writes is copied out
///     (broadcast: in on the root, out elsewhere; gather: out on the root).
///   - pinned staging blocks come from a pool per communicator (grow-only: powers of two from
///     64 KiB; up to 4 idle blocks kept) allocated in the primary context of the first device
///     seen, which comm retains for the life of the process (do not cudaDeviceReset it).
///   - a CUDA driver failure throws comm::BackendError naming the operation, the rank and the
///     driver's text (cuGetErrorString); peers of a rank whose copy-in failed end by the timeout.
/// - **Reductions:** every built-in op on every element type (bitwise: integers only) with comm's own
///   kernels (detail/engine/reduce.hpp), and custom callables `T(T, T)`, which must be associative,
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
///   they differ; monitored_barrier through the store (detail/diagnostics/monitored_barrier.hpp).
///   Without it, mismatches are still caught: checked frames (small operations), header frames
///   (large broadcast, gather, all_gather: DesyncError on the receiver that saw it), a fingerprint
///   exchange (other large collectives), point-to-point headers (docs/RELIABILITY.md).

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
#include <comm/detail/engine/backend_diagnostics.hpp>
#include <comm/detail/engine/forward.hpp>
#include <comm/detail/engine/policy.hpp>
#include <comm/detail/engine/elastic.hpp>
#include <comm/detail/engine/subgroups.hpp>
#include <comm/detail/gloo/device_staging.hpp>
#include <comm/detail/gloo/engine.hpp>
#include <comm/diagnostics.hpp>
#include <comm/error.hpp>
#include <comm/options.hpp>
#include <comm/store.hpp>
#include <comm/types.hpp>
#include <comm/work.hpp>

namespace comm::backends {

/// Options of comm::backends::Gloo (also spelled `comm::backends::Gloo::Options`).
/// The common ones (timeout, desync_check, flight_recorder_size) are comm::CommonOptions'; Gloo's
/// desync check is one small gloo allgather (or direct exchange) per operation.
struct GlooOptions : CommonOptions {
  /// Network interfaces to use, one gloo device each (operations go round-robin over them);
  /// overrides GLOO_SOCKET_IFNAME.
  std::vector<std::string> interfaces;
  /// Host name or address to bind to when `interfaces` is empty; overrides GLOO_SOCKET_IFNAME.
  std::string hostname;
  /// Nice value added to gloo's event-loop threads (0..19; 0: same priority as the process).
  /// A loop thread that spins on a busy connection lock at the caller's priority keeps the caller
  /// off the CPU until the next scheduler tick (4 ms stalls on a loaded machine); at a lower
  /// priority the caller preempts it at once. Applies when a network device is first created in
  /// the process (devices are shared). Default: COMM_GLOO_LOOP_NICE, else 19.
  int loop_nice = comm::detail::gloo::loop_nice_default();
  /// Small operations' messages (every message of at most 256 KiB, at most 16 ranks; the
  /// fingerprint exchanges too) over comm's own TCP connections, one per pair of ranks on the same
  /// interface, sent eagerly and read by the waiting thread, instead of gloo's pairs (a rendezvous
  /// and two thread hand-offs per message: 92 vs 15 us for 8 bytes between two hosts).
  /// Unset: off, except in Hierarchical's cross-node members, where latency across hosts is what
  /// the small operations pay. Default: COMM_GLOO_DIRECT (0 or 1), else unset. Same on every rank.
  std::optional<bool> direct = comm::detail::gloo::direct_env();
};

/// The Gloo backend policy. Move-only; its moved-from state may only be destroyed or assigned.
class Gloo : public comm::detail::ForwardOps<Gloo>,
             public comm::detail::BackendDiagnostics<Gloo>,
             public comm::detail::Subgroups<Gloo>,
             public comm::detail::Elastic<Gloo>,
             public comm::detail::HostReductions {
 public:
  /// Opts in to the comm::backend concept (concepts.hpp).
  using backend_concept = comm::backend_t;
  /// The backend's name in the backend list (backends/list.hpp), in messages and in AnyCommunicator::backend(): "gloo".
  static constexpr std::string_view name = "gloo";

  /// The backend's options: GlooOptions.
  using Options = GlooOptions;

  /// Connects `size` ranks through `store` (blocking; ends by `options.timeout`).
  [[nodiscard]] static Gloo create(std::shared_ptr<Store> store, int rank, int size, const Options& options = {}) {
    comm::detail::check_create("gloo.init", store, rank, size, options);
    return Gloo(std::make_unique<detail::gloo::Engine>(std::move(store), rank, size, config(options)), options);
  }

  /// Wraps an already connected gloo context (e.g. one shared with other code).
  [[nodiscard]] static Gloo adopt(std::shared_ptr<::gloo::Context> context, const Options& options = {}) {
    if (!context) throw InvalidArgument("gloo.adopt", -1, "gloo context is null");
    comm::detail::check_timeout("gloo.adopt", context->rank, options);
    return Gloo(std::make_unique<detail::gloo::Engine>(std::move(context), config(options)), options);
  }

  /// Moves; the moved-from object may only be destroyed or assigned.
  Gloo(Gloo&&) noexcept = default;
  /// Moves; the moved-from object may only be destroyed or assigned.
  Gloo& operator=(Gloo&&) noexcept = default;
  ~Gloo() = default;

  // rank(), size() and timeout() come from ForwardOps.

  /// The gloo context of device `i` (escape hatch for code that talks to gloo directly; do not
  /// use it concurrently with this communicator's operations).
  [[nodiscard]] const std::shared_ptr<::gloo::Context>& context(std::size_t i = 0) const { return engine_->context(i); }
  /// The number of gloo devices (contexts) operations are spread over: one per interface.
  [[nodiscard]] std::size_t num_devices() const noexcept { return engine_->num_contexts(); }

  // Each collective first asks staging_ whether a buffer is CUDA device memory (one cached branch
  // where no CUDA driver is usable); if so the engine runs on pinned host copies (see the header
  // comment and detail/gloo/device_staging.hpp).
  /// The backend concept's collectives (concepts.hpp), called by comm::Communicator after its
  /// checks; a CUDA device buffer is staged through pinned host memory.
  ///@{
  template <element T, class Red, class Launch>
  auto all_reduce(std::span<const T> in, std::span<T> out, Red red, Launch l) {
    if (auto s = staging_.all_reduce<T>(in, out, rank()))
      return engine_->all_reduce<T>(s->in, s->out, std::move(red), l, std::move(s->hooks));
    return engine_->all_reduce<T>(in, out, std::move(red), l);
  }
  template <element T, class Red, class Launch>
  auto reduce_scatter(std::span<const T> in, std::span<T> out, Red red, Launch l) {
    if (auto s = staging_.reduce_scatter<T>(in, out, rank()))
      return engine_->reduce_scatter<T>(s->in, s->out, std::move(red), l, std::move(s->hooks));
    return engine_->reduce_scatter<T>(in, out, std::move(red), l);
  }
  template <element T, class Launch>
  auto all_gather(std::span<const T> in, std::span<T> out, Launch l) {
    if (auto s = staging_.all_gather<T>(in, out, rank()))
      return engine_->all_gather<T>(s->in, s->out, l, std::move(s->hooks));
    return engine_->all_gather<T>(in, out, l);
  }
  template <element T, class Launch>
  auto broadcast(std::span<T> data, int root, Launch l) {
    if (auto s = staging_.broadcast<T>(data, root, rank()))
      return engine_->broadcast<T>(s->out, root, l, std::move(s->hooks));
    return engine_->broadcast<T>(data, root, l);
  }
  template <element T, class Launch>
  auto gather(std::span<const T> in, std::span<T> out, int root, Launch l) {
    if (auto s = staging_.gather<T>(in, out, root, rank()))
      return engine_->gather<T>(s->in, s->out, root, l, std::move(s->hooks));
    return engine_->gather<T>(in, out, root, l);
  }
  ///@}
  // barrier, reduce, scatter, all_to_all(_v), send, recv and batch_isend_irecv come from
  // ForwardOps (the engine rejects device buffers for them; it stages only the five above).

  // Optional capabilities (concepts.hpp): split/new_group from Subgroups, monitored_barrier and
  // the flight recorder from BackendDiagnostics.

 private:
  friend class comm::detail::ForwardOps<Gloo>;          // the operations without device staging
  friend class comm::detail::BackendDiagnostics<Gloo>;  // monitored_barrier, flight_record, options
  friend class comm::detail::Subgroups<Gloo>;           // split, new_group: child()
  friend class comm::detail::Elastic<Gloo>;             // shrink, grow: create(), options_

  Gloo(std::unique_ptr<detail::gloo::Engine> e, Options o) noexcept : engine_(std::move(e)), options_(std::move(o)) {}

  static detail::gloo::EngineConfig config(const Options& o) {
    auto c = comm::detail::engine_config<detail::gloo::EngineConfig>(o);
    c.interfaces = o.interfaces;
    c.hostname = o.hostname;
    c.loop_nice = o.loop_nice;
    c.direct = o.direct.value_or(false);
    return c;
  }

  /// Connects subgroup `g` among its members (see Subgroups).
  Gloo child(const comm::detail::Subgroup& g) const {
    auto c = g.configured(config(options_));
    return Gloo(std::make_unique<detail::gloo::Engine>(g.store, g.place.rank, g.place.size, c), options_);
  }

  std::unique_ptr<detail::gloo::Engine> engine_;
  Options options_;
  detail::gloo::DeviceStaging staging_;  // CUDA device buffers (its pool outlives queued operations)
};

}  // namespace comm::backends
