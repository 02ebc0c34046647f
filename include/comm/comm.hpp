#pragma once
/// \file
/// Umbrella header: everything in comm, and the backends this build was configured with
/// (COMM_HAS_GLOO, COMM_HAS_NCCL, COMM_HAS_MPI, defined by the comm::gloo, comm::nccl and comm::mpi
/// targets; the list is include/comm/backends/list.hpp).

#include <comm/types.hpp>
#include <comm/error.hpp>
#include <comm/work.hpp>
#include <comm/concepts.hpp>
#include <comm/diagnostics.hpp>
#include <comm/store.hpp>
#include <comm/init.hpp>
#include <comm/communicator.hpp>
#include <comm/cdb.hpp>

// The backends this build was configured with: the one list, include/comm/backends/list.hpp.
#include <comm/backends/registry.hpp>
