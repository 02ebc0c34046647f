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

#include <chrono>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <gloo/context.h>

#include <comm/concepts.hpp>
#include <comm/detail/env.hpp>
#include <comm/detail/gloo/engine.hpp>
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
    return Gloo(std::make_unique<detail::gloo::Engine>(store, rank, size, options.timeout, options.interfaces,
                                                        options.hostname));
  }

  /// Wraps an already connected gloo context (e.g. one shared with other code).
  [[nodiscard]] static Gloo adopt(std::shared_ptr<::gloo::Context> context, const Options& options = {}) {
    if (!context) throw InvalidArgument("gloo.adopt", -1, "gloo context is null");
    check_timeout(options, context->rank);
    return Gloo(std::make_unique<detail::gloo::Engine>(std::move(context), options.timeout));
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

 private:
  explicit Gloo(std::unique_ptr<detail::gloo::Engine> e) noexcept : engine_(std::move(e)) {}

  static void check_timeout(const Options& o, int rank) {
    if (o.timeout.count() <= 0)
      throw InvalidArgument("gloo.init", rank,
                            "timeout " + std::to_string(o.timeout.count()) + " ms must be positive");
  }

  std::unique_ptr<detail::gloo::Engine> engine_;
};

}  // namespace comm::backends
