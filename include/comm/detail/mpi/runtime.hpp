#pragma once
// MPI's process-wide state as comm sees it: initializing MPI when nobody has (and finalizing at
// exit only what comm initialized), the thread level, and whether an MPI launcher started this
// process.

#include <mpi.h>

#include <mutex>
#include <string>

#include <comm/detail/base/env.hpp>
#include <comm/detail/base/logging.hpp>
#include <comm/detail/mpi/errors.hpp>
#include <comm/error.hpp>

namespace comm::detail::mpi {

[[nodiscard]] inline bool initialized() noexcept {
  int init = 0;
  return MPI_Initialized(&init) == MPI_SUCCESS && init != 0;
}

[[nodiscard]] inline bool finalized() noexcept {
  int fin = 0;
  return MPI_Finalized(&fin) == MPI_SUCCESS && fin != 0;
}

/// The thread level MPI was initialized with (MPI_THREAD_SINGLE ... MPI_THREAD_MULTIPLE).
[[nodiscard]] inline int thread_level() noexcept {
  int provided = MPI_THREAD_SINGLE;
  if (MPI_Query_thread(&provided) != MPI_SUCCESS) return MPI_THREAD_SINGLE;
  return provided;
}

[[nodiscard]] inline const char* thread_level_name(int level) noexcept {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
    default: return "an unknown MPI thread level";
  }
}

/// Finalizes MPI at exit when comm initialized it (a function-local static: destroyed after
/// everything constructed later, e.g. communicators made after the first create()).
class FinalizeGuard {
 public:
  FinalizeGuard() = default;
  FinalizeGuard(const FinalizeGuard&) = delete;
  FinalizeGuard& operator=(const FinalizeGuard&) = delete;
  ~FinalizeGuard() {
    // MPI_Finalize is collective and has no deadline; a peer that died makes the launcher end the
    // job (mpirun kills the remaining ranks), so it cannot wait forever.
    if (mine_ && !finalized()) MPI_Finalize();
  }
  void set_mine() noexcept { mine_ = true; }

 private:
  bool mine_ = false;
};

/// Initializes MPI with MPI_THREAD_MULTIPLE unless it is initialized already (by the application
/// or an earlier communicator); comm then finalizes it at exit. Throws comm::InvalidArgument when
/// MPI was finalized, comm::BackendError when MPI_Init_thread fails. Returns the thread level.
// MPI_Init_thread itself has no deadline: it talks to the launcher (PMIx), which is local.
inline int ensure_initialized(const char* op, int rank) {
  static std::mutex mu;
  std::lock_guard lock(mu);
  if (finalized())
    throw InvalidArgument(op, rank, "MPI is already finalized; no MPI communicator can be made after MPI_Finalize");
  if (!initialized()) {
    static FinalizeGuard guard;
    int provided = MPI_THREAD_SINGLE;
    COMM_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), op, rank);
    guard.set_mine();
    // MPICH 4.0 raises an error of MPI_Test/MPI_Testall (a message longer than its receive)
    // through MPI_COMM_WORLD's handler, not the request's communicator, whose MPI_ERRORS_RETURN
    // comm sets: with the default handler the job aborts instead of failing the operation. MPI
    // is comm's here, so its world returns errors too.
    COMM_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), op, rank);
    if (provided < MPI_THREAD_MULTIPLE)
      log(LogLevel::warn, std::string("comm: MPI provides only ") + thread_level_name(provided) +
                              ": MPI communicators will refuse async operations");
    else
      log(LogLevel::detail, "comm: initialized MPI with MPI_THREAD_MULTIPLE");
  }
  return thread_level();
}

/// Whether an MPI launcher (mpirun/mpiexec of OpenMPI, MPICH, Intel MPI; PMIx) started this
/// process, judged by the variables it sets.
[[nodiscard]] inline bool launched_by_mpi() {
  return getenv_str("OMPI_COMM_WORLD_SIZE").has_value() || getenv_str("PMI_SIZE").has_value() ||
         getenv_str("PMIX_RANK").has_value();
}

}  // namespace comm::detail::mpi
