#pragma once
// Making an engine's three MPI communicators (data, control, point-to-point) from a parent: a
// duplicate of the whole parent or a group of its ranks, each step bounded by the deadline.

#include <mpi.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include <comm/detail/mpi/errors.hpp>
#include <comm/detail/mpi/wait.hpp>
#include <comm/error.hpp>

namespace comm::detail::mpi {

/// Where an engine's MPI communicators come from.
struct CommSource {
  MPI_Comm parent = MPI_COMM_NULL;
  /// Empty: duplicate the whole parent (MPI_Comm_idup). Else the parent ranks of the new
  /// communicator in its rank order (MPI_Comm_create_group, called by these ranks only, with `tag`).
  std::vector<int> members;
  int tag = 0;
  const char* op = "mpi.init";  // names the step in errors
};

/// The data, control and point-to-point communicators of an engine.
struct Comms {
  MPI_Comm data = MPI_COMM_NULL;
  MPI_Comm control = MPI_COMM_NULL;
  MPI_Comm p2p = MPI_COMM_NULL;
};

/// Makes the three communicators (blocking, ends by `timeout`), errors returned as codes, named
/// after `name` for MPI tools.
inline Comms make_comms(const CommSource& src, int rank, std::chrono::milliseconds timeout, const std::string& name) {
  const char* op = src.op;
  auto deadline = Deadline::from_now(timeout);
  // MPI writes the new handles when the requests complete, which after a Timeout may be later:
  // they live on the heap and are leaked with the requests.
  auto handles = std::make_unique<std::array<MPI_Comm, 3>>();
  handles->fill(MPI_COMM_NULL);
  auto await_made = [&](MPI_Request* reqs, int n, const char* what) {
    int all = 0;
    const bool done = poll([&] {
      COMM_MPI_CHECK(MPI_Testall(n, reqs, &all, MPI_STATUSES_IGNORE), op, rank);
      return all != 0;
    }, [] {}, deadline);
    if (done) return;
    (void)handles.release();
    throw Timeout(op, rank,
                  std::string(what) + " did not complete within " + std::to_string(timeout.count()) +
                      " ms: a rank did not make this communicator (every rank of the parent must, in the same "
                      "order); the pending MPI request is leaked");
  };
  if (src.members.empty()) {
    // One at a time: OpenMPI 4.1 mixed up the context ids of three duplicates in flight at once
    // on one parent (MPI_ERR_TRUNCATE in a later split's libnbc schedule).
    for (std::size_t i = 0; i < handles->size(); ++i) {
      MPI_Request req = MPI_REQUEST_NULL;
      COMM_MPI_CHECK(MPI_Comm_idup(src.parent, &(*handles)[i], &req), op, rank);
      await_made(&req, 1, "MPI_Comm_idup");
    }
  } else {
    MPI_Group parent_group = MPI_GROUP_NULL, group = MPI_GROUP_NULL;
    COMM_MPI_CHECK(MPI_Comm_group(src.parent, &parent_group), op, rank);
    const int rc = MPI_Group_incl(parent_group, static_cast<int>(src.members.size()), src.members.data(), &group);
    MPI_Group_free(&parent_group);
    if (rc != MPI_SUCCESS) throw_mpi_error(rc, "MPI_Group_incl", op, rank);
    // No deadline of its own: every member is known to be here (the split's exchange, the
    // membership check on the store, or the engine's gate()).
    const int rc2 = MPI_Comm_create_group(src.parent, group, src.tag, &(*handles)[0]);
    MPI_Group_free(&group);
    if (rc2 != MPI_SUCCESS) throw_mpi_error(rc2, "MPI_Comm_create_group", op, rank);
    for (std::size_t i = 1; i < handles->size(); ++i) {
      MPI_Request req = MPI_REQUEST_NULL;
      COMM_MPI_CHECK(MPI_Comm_idup((*handles)[0], &(*handles)[i], &req), op, rank);
      await_made(&req, 1, "MPI_Comm_idup");
    }
  }
  const Comms made{(*handles)[0], (*handles)[1], (*handles)[2]};
  // Failures come back as error codes (COMM_MPI_CHECK) instead of aborting the job.
  for (MPI_Comm c : {made.data, made.control, made.p2p})
    COMM_MPI_CHECK(MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN), op, rank);
  const std::string label = "comm" + (name.empty() ? std::string() : "." + name);
  MPI_Comm_set_name(made.data, label.c_str());
  MPI_Comm_set_name(made.control, (label + ".control").c_str());
  MPI_Comm_set_name(made.p2p, (label + ".p2p").c_str());
  return made;
}

}  // namespace comm::detail::mpi
