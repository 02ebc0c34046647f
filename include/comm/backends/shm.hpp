#pragma once
/// \file
/// `comm::backends::Shm`: the on-node CPU backend, over one POSIX shared-memory segment per
/// communicator.
///
/// Use it through `comm::Communicator<comm::backends::Shm>` (see communicator.hpp); it needs only
/// comm::comm (POSIX shared memory and futexes: Linux).
///
/// - **Who:** every rank of the communicator must run on this host, in the same IPC, PID and
///   network namespaces; `create()` compares a host identity through the store and throws
///   comm::InvalidArgument naming the rank that is elsewhere. Across hosts use Gloo, or
///   `Hierarchical<Shm, Gloo>`.
/// - **Rendezvous** goes through a `comm::Store`: rank 0 creates the segment under a fresh name,
///   every rank maps it, and the last one to map it unlinks the name, so nothing stays in /dev/shm
///   after the communicator is created, whatever happens to its processes (a SIGKILL included).
///   Subgroups (`split`, `new_group`) get a segment of their own.
/// - **Blocking calls** return when the result is in the output on this rank; **async calls**
///   (`comm::async`) return a `comm::Work` and run in issue order on one worker thread per
///   communicator (started on first use). Buffers must stay alive and untouched until completion.
/// - **Algorithms** (detail/shm/engine.hpp): flag/sequence exchange in cache-line-aligned slots
///   with no lock and no system call on the fast path; all_reduce up to `small_max` bytes in one
///   step, above that a direct reduce-scatter + all-gather through the segment in chunks of
///   `chunk_bytes`; half/bfloat16/fp8 reductions accumulate in float across all ranks and round
///   once. broadcast, scatter, gather and reduce whose buffer fits one chunk and is below the
///   single-copy threshold take one step without a rendezvous: the root of
///   a broadcast or scatter publishes and returns, a non-root of a gather or reduce likewise. Steps of at most 16 bytes go through a ring of 64 header lines per
///   rank, those of at most 16 KiB through a ring of 16 bodies, so a root of back-to-back small
///   rooted operations runs up to 32 of them (15 above 16 bytes) ahead of its slowest reader, as an
///   MPI's eager protocol lets it.
/// - **Single copy:** all_reduce and all_to_all of at least COMM_SHM_CMA_MIN bytes (32 KiB where
///   the host has a core for every rank, else 1 MiB), all_gather from 32 KiB where the host has a
///   core for every rank, reduce_scatter from COMM_SHM_CMA_MIN where the host has a core for every
///   rank, reduce from COMM_SHM_CMA_REDUCE_MIN (64 KiB where the host has a core for every rank,
///   else 1 MiB; the root reduces the larger slice), scatter and gather from
///   COMM_SHM_CMA_ROOTED_MIN (one rank's block: 16 KiB where the host has a core for every rank,
///   else 64 KiB), and broadcast from 16 KiB where the host has a core for every rank move between
///   the ranks' own buffers with `process_vm_readv` and `process_vm_writev` (cross-memory
///   attach): one copy by the kernel instead of two through the segment (from 128 KiB, 64 KiB
///   where ranks share cores, a broadcast's root writes one part into each reader while the
///   readers read the others). Where ranks share cores a broadcast and an all_gather take the
///   segment at every size (there the readers take turns on a core and the segment's chunks are
///   still in the cache), unless COMM_SHM_CMA_ROOTED_MIN or COMM_SHM_CMA_MIN is set. Every rank
///   tries it on every peer at creation; if any rank
///   cannot (COMM_SHM_CMA=0, Yama ptrace_scope 2-3, seccomp) every rank uses the segment. Under
///   ptrace_scope 1 each rank allows it with `prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)`
///   (process-wide; COMM_SHM_CMA=0 avoids it).
/// - **Waiting** spins briefly (long only while every rank has a core), then yields, then sleeps on
///   a futex, so more ranks than cores still progress; a wait whose spin ran out keeps the full
///   spin when the peer runs on another CPU and drops to 16 pauses when it last ran on this one,
///   and two ranks that keep meeting on one CPU of a host with a CPU for each are moved apart
///   (COMM_SHM_SPREAD; detail/shm/steps.hpp).
/// - **Deadlines and faults:** every operation ends by `Options::timeout` with comm::Timeout
///   naming the operation, its sequence number, this rank and the rank it waited for (a stopped or
///   hung peer). A peer whose process exits (SIGKILL included) is noticed within about 10 ms of
///   waiting on it, and every survivor gets comm::RemoteError naming it. After a
///   Timeout/RemoteError the communicator is unusable (later operations fail at once).
/// - **Desync:** each published step carries the operation's fingerprint, so ranks in different
///   operations, or with different counts, roots or reductions, throw comm::DesyncError on every
///   rank — always, not only with the desync check; no rank ever reads data of another operation.
///   A rank that read a mismatched fingerprint throws in that operation. A rank that read none
///   (the root of a one-step broadcast or scatter, a non-root of a one-step gather or reduce, and
///   with more than 2 ranks a non-root of a one-step broadcast or scatter, which reads only the
///   root's) returns from it and throws the DesyncError, naming the mismatched calls, at the start
///   of its next collective that is not a one-step rooted one, or at the latest 32 collectives
///   later (point-to-point calls in between do not check; above 2 ranks it compares a hash sum
///   over each rank's last 64 steps, and single steps only where the sums differ, so a
///   mismatch is missed only where two sums collide, a chance of 2^-64). A rank waiting on a peer
///   when another rank throws it (which aborts the communicator) compares its own unchecked steps
///   first and throws that DesyncError, not a RemoteError. As after any failed operation the
///   communicator is then unusable; with the desync check on, every rank throws
///   before the mismatched operation moves anything and the communicator stays usable.
/// - **Reductions:** every built-in op on every element type (bitwise: integers only), and custom
///   callables `T(T, T)` (folded from the left in rank order, in place or not).
/// - **Diagnostics:** flight recorder, desync check option, monitored_barrier (through the store),
///   as on Gloo.

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include <comm/concepts.hpp>
#include <comm/detail/engine/backend_diagnostics.hpp>
#include <comm/detail/engine/forward.hpp>
#include <comm/detail/engine/policy.hpp>
#include <comm/detail/engine/elastic.hpp>
#include <comm/detail/engine/subgroups.hpp>
#include <comm/detail/base/env.hpp>
#include <comm/detail/shm/engine.hpp>
#include <comm/error.hpp>
#include <comm/options.hpp>
#include <comm/store.hpp>
#include <comm/types.hpp>
#include <comm/work.hpp>

namespace comm::backends {

namespace detail_shm {
[[nodiscard]] inline std::size_t env_bytes(const char* name, std::size_t fallback) {
  if (auto v = comm::detail::env_nonneg_int(name)) return static_cast<std::size_t>(*v);
  return fallback;
}
}  // namespace detail_shm

/// Options of comm::backends::Shm (also spelled `comm::backends::Shm::Options`). The common ones
/// (timeout, desync_check, flight_recorder_size) are comm::CommonOptions'; Shm compares the
/// desync fingerprint in every step anyway, so desync_check adds one exchange.
struct ShmOptions : CommonOptions {
  /// Payload bytes each rank publishes per step (the pipeline's chunk); the segment holds
  /// 2 * size() chunks. Must be the same on every rank. Default: COMM_SHM_CHUNK, else 256 KiB.
  std::size_t chunk_bytes = detail_shm::env_bytes("COMM_SHM_CHUNK", std::size_t{256} << 10);
  /// all_reduce runs in one step (every rank reduces every input) up to this many bytes, above
  /// it as reduce-scatter + all-gather. Default: COMM_SHM_SMALL_MAX, else 16 KiB.
  std::size_t small_max = detail_shm::env_bytes("COMM_SHM_SMALL_MAX", std::size_t{16} << 10);
  /// Spins before a waiter yields (-1: 2000 when every rank can have a core, else 16;
  /// COMM_SHM_SPIN overrides).
  int spin = -1;
};

/// The Shm backend policy. Move-only; its moved-from state may only be destroyed or assigned.
class Shm : public comm::detail::ForwardOps<Shm>,
            public comm::detail::BackendDiagnostics<Shm>,
            public comm::detail::Subgroups<Shm>,
            public comm::detail::Elastic<Shm>,
            public comm::detail::HostReductions {
 public:
  /// Opts in to the comm::backend concept (concepts.hpp).
  using backend_concept = comm::backend_t;
  /// The backend's name in the backend list (backends/list.hpp), in messages and in AnyCommunicator::backend(): "shm".
  static constexpr std::string_view name = "shm";

  /// The backend's options: ShmOptions.
  using Options = ShmOptions;

  /// Maps the segment of `size` ranks of this host through `store` (blocking; ends by
  /// `options.timeout`).
  [[nodiscard]] static Shm create(std::shared_ptr<Store> store, int rank, int size, const Options& options = {}) {
    comm::detail::check_create("shm.init", store, rank, size, options);
    if (options.chunk_bytes < 4096 || options.chunk_bytes > (std::size_t{1} << 30))
      throw InvalidArgument("shm.init", rank,
                            "chunk_bytes " + std::to_string(options.chunk_bytes) +
                                " must be in [4096, 1 GiB] (COMM_SHM_CHUNK)");
    return Shm(std::make_unique<detail::shm::Engine>(std::move(store), rank, size, config(options)), options);
  }

  /// Moves; the moved-from object may only be destroyed or assigned.
  Shm(Shm&&) noexcept = default;
  /// Moves; the moved-from object may only be destroyed or assigned.
  Shm& operator=(Shm&&) noexcept = default;
  ~Shm() = default;

  // rank(), size(), timeout() and the operations come from ForwardOps (detail/engine/forward.hpp).

  // Optional capabilities (concepts.hpp): split/new_group from Subgroups, monitored_barrier and
  // the flight recorder from BackendDiagnostics.

 private:
  friend class comm::detail::ForwardOps<Shm>;
  friend class comm::detail::BackendDiagnostics<Shm>;
  friend class comm::detail::Subgroups<Shm>;
  friend class comm::detail::Elastic<Shm>;

  Shm(std::unique_ptr<detail::shm::Engine> e, Options o) noexcept : engine_(std::move(e)), options_(std::move(o)) {}

  static detail::shm::EngineConfig config(const Options& o) {
    auto c = comm::detail::engine_config<detail::shm::EngineConfig>(o);
    c.chunk = (o.chunk_bytes + detail::shm::kLine - 1) / detail::shm::kLine * detail::shm::kLine;
    c.small_max = o.small_max;
    c.spin = o.spin;
    return c;
  }

  /// Maps subgroup `g`'s own segment (see Subgroups).
  Shm child(const comm::detail::Subgroup& g) const {
    auto c = g.configured(config(options_));
    return Shm(std::make_unique<detail::shm::Engine>(g.store, g.place.rank, g.place.size, c), options_);
  }

  std::unique_ptr<detail::shm::Engine> engine_;
  Options options_;
};

}  // namespace comm::backends
