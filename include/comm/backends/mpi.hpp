#pragma once
/// \file
/// `comm::backends::Mpi`: the MPI backend, over any MPI-3 library (OpenMPI, MPICH, Intel MPI).
///
/// Use it through `comm::Communicator<comm::backends::Mpi>` (see communicator.hpp); link `comm::mpi`.
///
/// - **Construction.**
///   - `create(store, rank, size)` / `from_env()` initialize MPI (MPI_Init_thread with
///     MPI_THREAD_MULTIPLE) unless it is initialized already, check that `rank` and `size` are this
///     process's in MPI_COMM_WORLD (comm::InvalidArgument otherwise: launch with `mpirun -np N`),
///     run the store's membership check, then duplicate MPI_COMM_WORLD. MPI is finalized at exit only
///     when comm initialized it; then MPI_COMM_WORLD also gets MPI_ERRORS_RETURN (MPICH 4.0 raises
///     a truncated receive of comm's own communicators through the world's handler). The store is
///     kept for monitored_barrier and subgroup keys.
///     `from_env()` needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (mpirun sets none of them:
///     export them, or use `adopt(MPI_COMM_WORLD)` or `comm::init_distributed()`, which discover
///     mpirun's own variables).
///   - `adopt(MPI_Comm)` duplicates the caller's communicator (which must be an intracommunicator,
///     on an initialized MPI) and never frees it. It has no store: `monitored_barrier` is not
///     available (comm::InvalidArgument); split and new_group work.
///   - Each communicator duplicates its MPI communicator three times (MPI_Comm_idup, so creation
///     ends by the timeout too): one carries the collectives, one subgroup creation and failure
///     notices, one point-to-point messages. The first and the last are freed at destruction; the
///     control one only at MPI_Finalize (a peer that fails later still sends its notice there). `native_handle()` is the first (escape hatch: do not
///     use it concurrently with this communicator's operations).
/// - **Blocking calls** return when the result is in the output on this rank. They run on the
///   calling thread when nothing is queued, else after the queued async work.
/// - **Async calls** (`comm::async`) return a `comm::Work` at once; the operations of one
///   communicator run in issue order on one worker thread. They need MPI at MPI_THREAD_MULTIPLE
///   (what comm asks for; an application that initialized MPI at a lower level gets
///   comm::InvalidArgument from async calls, blocking ones work). The buffers must stay alive and
///   untouched until the Work completes.
/// - **Execution:** on communicators of 2 to 8 ranks, all_reduce, reduce_scatter, all_gather and
///   broadcast run as comm's own schedules over MPI point-to-point messages (MPI_Isend / MPI_Irecv
///   on the data communicator, which use the library's shared memory and its single-copy path) and
///   MPI_Reduce_local: every rank sends to every other at once. all_reduce up to 32 KiB (OpenMPI,
///   MPICH; 4 KiB on other libraries) exchanges whole inputs and reduces them in rank order (the
///   same result on every rank); above that a direct reduce-scatter (each rank reduces its block:
///   its own part, then the others in rank order, in chunks of 256 KiB reduced as they arrive,
///   through at most 4 reused chunk buffers per peer; under MPICH a block of up to 8 MiB goes
///   whole) then a direct all-gather. reduce_scatter is the first step alone, all_gather the
///   second, broadcast the root sending to each rank. A
///   message a little above the library's eager limit (OpenMPI: 4 KiB up to 12,000 bytes; MPICH:
///   8 KiB up to 32 KiB) goes as several eager pieces instead of one rendezvous (the library is
///   recognized by MPI_Get_library_version). These run at the speed of the library's own
///   blocking calls (benchmarks/RESULTS.md, "Mpi backend vs blocking MPI"), where MPI's
///   non-blocking schedules are up to 2-6x slower. A received message of another length than
///   expected (ranks called with different counts) is comm::BackendError naming its sender. Every
///   other operation, and these beyond 8 ranks or above INT_MAX bytes per message, is MPI's
///   non-blocking collective (MPI_Iallreduce, MPI_Ireduce_scatter_block, MPI_Iallgather, MPI_Ibcast,
///   MPI_Igather, MPI_Ireduce, MPI_Iscatter, MPI_Ialltoall, MPI_Ialltoallv, MPI_Ibarrier). Either
///   way every request is polled with MPI_Test (spinning for 2 ms, then sched_yield between tests,
///   then 50 us sleeps after 100 ms) until it completes or the deadline passes. In-place forms use
///   MPI_IN_PLACE (in-place reduce_scatter goes through a scratch block:
///   the input is only read; reduce in place on the root, scatter into the root's own slice).
///   Counts above INT_MAX: all_reduce, reduce, broadcast and point-to-point messages run in chunks;
///   reduce_scatter, all_gather, gather, scatter and all_to_all refuse per-rank blocks that large,
///   all_to_all_v counts or displacements beyond INT_MAX (comm::InvalidArgument).
/// - **Point-to-point** (send, recv, batch_isend_irecv) runs on a third duplicate of the
///   communicator, so user tags never meet the collectives: each message is a 32-byte header
///   (kind, element type, count, the user's tag, its number on the pair), checked by the receiver
///   before the payload is received (a mismatch is comm::DesyncError, never a buffer overrun), then
///   the payload (MPI_Isend / MPI_Irecv). The messages of a pair are matched in the order they were
///   sent; any tag >= 0 works (it never becomes an MPI tag). A batch posts every send and receive
///   before waiting, so exchanges in both directions cannot deadlock; batch_isend_irecv is always
///   async (MPI_THREAD_MULTIPLE). premul_sum scales a copy of the input, then sums.
/// - **Deadlines and what a Timeout leaves behind:** every operation ends by `Options::timeout`
///   (default: COMM_TIMEOUT, else 30 min) with comm::Timeout naming the operation, rank and
///   sequence number, and for comm's own schedules the peer whose message did not arrive (else the
///   first that did not take this rank's). **MPI cannot cancel a collective**: the timed-out request stays pending, and
///   if the late peers arrive later MPI may still read the inputs and write the outputs (so do
///   the point-to-point requests of comm's own schedules, which are left pending the same way), so keep
///   those buffers alive (or end the process). The communicator is then unusable — every later
///   operation fails at once with the first cause — and its MPI communicators, datatypes and the
///   request are leaked, never freed. The rank that fails first sends a short notice to every peer;
///   a peer whose operation waits for it fails with comm::RemoteError naming that rank and the
///   cause (after ~1 ms of waiting) instead of at its own deadline. A `Work::wait()` that gives up
///   aborts the communicator the same way. A process that dies makes the MPI launcher end the job.
///   Calls with no deadline: MPI_Init_thread, MPI_Finalize (at exit) and MPI_Comm_create_group,
///   which runs only once every member is known to be present (see Subgroups).
/// - **Reductions:** on the integers, float and double, MPI's predefined ops (MPI_SUM, MPI_PROD,
///   MPI_MIN, MPI_MAX, MPI_BAND, MPI_BOR, MPI_BXOR); avg is MPI_SUM then comm's division (floor for
///   integers). half, bfloat16 and fp8 move as MPI_UINT16_T / MPI_UINT8_T and reduce with a
///   user-defined MPI_Op running comm's kernel (in float); custom callables `T(T, T)` (associative,
///   commutative, must not throw) run the same way, on any element type.
/// - **Subgroups:** `split(color, key)` is an operation of this communicator (an all_gather of
///   every rank's color and key, recorded as "split"); the ranks of each color then make their
///   communicator with MPI_Comm_create_group on the control communicator. `new_group(ranks)`:
///   non-members return nullopt at once; members meet first (through the store's membership check,
///   or without a store on the control communicator, naming any member that does not come by the
///   timeout), then MPI_Comm_create_group. Subgroups inherit the options and are independent of
///   their parent.
/// - **Diagnostics:** the flight recorder and the desync check (an MPI_Iallgather of a 32-byte
///   fingerprint per rank before each operation) from the engine core; monitored_barrier through
///   the store (created communicators only).
/// - **Destruction** finishes the queued operations (each bounded by the timeout), then frees the
///   MPI communicators (not after a failure, see above; nothing after MPI_Finalize).

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <comm/concepts.hpp>
#include <comm/detail/engine/backend_diagnostics.hpp>
#include <comm/detail/engine/forward.hpp>
#include <comm/detail/engine/policy.hpp>
#include <comm/detail/engine/subgroups.hpp>
#include <comm/detail/diagnostics/flight_recorder.hpp>
#include <comm/detail/mpi/engine.hpp>
#include <comm/detail/mpi/errors.hpp>
#include <comm/detail/mpi/runtime.hpp>
#include <comm/detail/mpi/types.hpp>
#include <comm/diagnostics.hpp>
#include <comm/error.hpp>
#include <comm/options.hpp>
#include <comm/store.hpp>
#include <comm/types.hpp>
#include <comm/work.hpp>

namespace comm::backends {

/// Options of comm::backends::Mpi (also spelled `comm::backends::Mpi::Options`): the common ones,
/// comm::CommonOptions (the timeout bounds creation too; the desync check is one MPI_Iallgather of
/// 32 bytes per rank and operation).
struct MpiOptions : CommonOptions {};

/// The MPI backend policy. Move-only; its moved-from state may only be destroyed or assigned.
class Mpi : public comm::detail::ForwardOps<Mpi>,
            public comm::detail::BackendDiagnostics<Mpi>,
            public comm::detail::Subgroups<Mpi>,
            public comm::detail::HostReductions {
  using Engine = comm::detail::mpi::Engine;

 public:
  /// Opts in to the comm::backend concept (concepts.hpp).
  using backend_concept = comm::backend_t;
  /// The backend's name in the backend list (backends/list.hpp), in messages and in AnyCommunicator::backend(): "mpi".
  static constexpr std::string_view name = "mpi";

  /// The backend's options: MpiOptions.
  using Options = MpiOptions;

  /// This process as rank `rank` of `size` in MPI_COMM_WORLD, rendezvoused through `store`
  /// (blocking; ends by `options.timeout`). Initializes MPI when nobody has.
  [[nodiscard]] static Mpi create(std::shared_ptr<Store> store, int rank, int size, const Options& options = {}) {
    comm::detail::check_create("mpi.init", store, rank, size, options);
    (void)comm::detail::mpi::ensure_initialized("mpi.init", rank);
    int world_rank = -1, world_size = -1;
    COMM_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank), "mpi.init", rank);
    COMM_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size), "mpi.init", rank);
    if (world_rank != rank || world_size != size)
      throw InvalidArgument("mpi.init", rank,
                            "rank " + std::to_string(rank) + " of " + std::to_string(size) +
                                " does not match this process in MPI_COMM_WORLD (rank " + std::to_string(world_rank) +
                                " of " + std::to_string(world_size) + "): start every rank with mpirun -np " +
                                std::to_string(size) + " (or srun), or adopt() a communicator of the right ranks");
    comm::detail::mpi::CommSource src{MPI_COMM_WORLD, {}, 0, "mpi.init"};
    return Mpi(std::make_unique<Engine>(std::move(store), rank, size, comm::detail::core_config(options), src), options);
  }

  /// Duplicates `comm` (an intracommunicator of an initialized MPI; collective over it, ends by
  /// `options.timeout`). The caller's communicator is never freed by comm.
  [[nodiscard]] static Mpi adopt(MPI_Comm comm, const Options& options = {}) {
    if (!comm::detail::mpi::initialized() || comm::detail::mpi::finalized())
      throw InvalidArgument("mpi.adopt", -1,
                            "MPI is not initialized (or already finalized): call MPI_Init_thread before adopt(), or "
                            "use create()/from_env(), which initialize it");
    if (comm == MPI_COMM_NULL) throw InvalidArgument("mpi.adopt", -1, "the communicator is MPI_COMM_NULL");
    int inter = 0;
    COMM_MPI_CHECK(MPI_Comm_test_inter(comm, &inter), "mpi.adopt", -1);
    if (inter != 0)
      throw InvalidArgument("mpi.adopt", -1, "the communicator is an intercommunicator; comm needs an intracommunicator");
    int rank = -1, size = -1;
    COMM_MPI_CHECK(MPI_Comm_rank(comm, &rank), "mpi.adopt", -1);
    COMM_MPI_CHECK(MPI_Comm_size(comm, &size), "mpi.adopt", -1);
    comm::detail::check_timeout("mpi.adopt", rank, options);
    comm::detail::mpi::CommSource src{comm, {}, 0, "mpi.adopt"};
    return Mpi(std::make_unique<Engine>(rank, size, comm::detail::core_config(options), "adopted", src), options);
  }

  /// Moves; the moved-from object may only be destroyed or assigned.
  Mpi(Mpi&&) noexcept = default;
  /// Moves; the moved-from object may only be destroyed or assigned.
  Mpi& operator=(Mpi&&) noexcept = default;
  ~Mpi() = default;

  // rank(), size(), timeout() and the operations come from ForwardOps (detail/engine/forward.hpp),
  // which runs admit() below first; split/new_group from Subgroups, monitored_barrier and the
  // flight recorder from BackendDiagnostics.

  /// The MPI communicator the collectives run on (comm's duplicate; see the file comment).
  [[nodiscard]] MPI_Comm native_handle() const noexcept { return engine_->comm(); }
  /// The thread level MPI runs at (async operations need MPI_THREAD_MULTIPLE).
  [[nodiscard]] int thread_level() const noexcept { return engine_->thread_level(); }

  /// Subgroups connect through the control communicator, with or without a store.
  static constexpr bool subgroups_without_store = true;

 private:
  friend class comm::detail::ForwardOps<Mpi>;
  friend class comm::detail::BackendDiagnostics<Mpi>;
  friend class comm::detail::Subgroups<Mpi>;

  Mpi(std::unique_ptr<Engine> e, Options o) noexcept : engine_(std::move(e)), options_(std::move(o)) {}

  /// Subgroup `g` by MPI_Comm_create_group on the control communicator. A new_group's members
  /// meet first: through the child's membership check on the store, else on the control
  /// communicator (MPI_Comm_create_group has no deadline).
  Mpi child(const comm::detail::Subgroup& g) const {
    if (!g.met && !g.store) engine_->gate(g.members, g.index);
    const auto c = g.configured(comm::detail::core_config(options_));
    comm::detail::mpi::CommSource src{engine_->control(), g.members, Engine::group_tag(g.index), "mpi.group"};
    if (g.store) return Mpi(std::make_unique<Engine>(g.store, g.place.rank, g.place.size, c, src), options_);
    return Mpi(std::make_unique<Engine>(g.place.rank, g.place.size, c, c.name, src), options_);
  }

  /// What MPI cannot take, refused before anything is queued, so the communicator stays usable:
  /// async operations run on the worker thread, so MPI must allow calls from any thread; and MPI
  /// counts are int.
  void admit(const comm::detail::ForwardCall& call) const {
    using comm::OpKind;
    const char* op = comm::detail::op_name(call.kind);
    if (call.async && !engine_->multi_threaded())
      throw InvalidArgument(op, rank(),
                            std::string("async operations need MPI initialized with MPI_THREAD_MULTIPLE; this "
                                        "process runs ") +
                                comm::detail::mpi::thread_level_name(engine_->thread_level()) +
                                " (use the blocking form, or MPI_Init_thread with MPI_THREAD_MULTIPLE)");
    if (call.kind == OpKind::all_to_all_v) {
      check_counts_v(call.in_counts, "in_counts");
      check_counts_v(call.out_counts, "out_counts");
      return;
    }
    const bool out_block = call.kind == OpKind::reduce_scatter || call.kind == OpKind::scatter;
    check_count(op, call.block, out_block ? "output" : "input");
  }

  /// MPI counts are int: one rank's block of these operations must fit.
  void check_count(const char* op, std::size_t n, const char* what) const {
    if (n > Engine::kMaxCount)
      throw InvalidArgument(op, rank(),
                            std::string(what) + " has " + std::to_string(n) +
                                " elements per rank; the MPI backend moves at most INT_MAX (" +
                                std::to_string(INT_MAX) + ") per rank in one call: split the call");
  }

  /// MPI_Ialltoallv takes int counts and int displacements (the prefix sums of the counts).
  void check_counts_v(std::span<const std::size_t> counts, const char* what) const {
    std::size_t displ = 0;
    for (std::size_t p = 0; p < counts.size(); ++p) {
      if (counts[p] > Engine::kMaxCount)
        throw InvalidArgument("all_to_all_v", rank(),
                              std::string(what) + "[" + std::to_string(p) + "] is " + std::to_string(counts[p]) +
                                  " elements; the MPI backend moves at most INT_MAX (" + std::to_string(INT_MAX) +
                                  ") per block (MPI_Alltoallv counts are int): split the call");
      if (displ > Engine::kMaxCount)
        throw InvalidArgument("all_to_all_v", rank(),
                              std::string(what) + ": block " + std::to_string(p) + " starts at element " +
                                  std::to_string(displ) + ", beyond INT_MAX (" + std::to_string(INT_MAX) +
                                  "; MPI_Alltoallv displacements are int): split the call");
      displ += counts[p];
    }
  }

  std::unique_ptr<Engine> engine_;
  Options options_;
};

}  // namespace comm::backends
