#pragma once
/// \file
/// Umbrella header: everything in comm, and the backends this build was configured with
/// (COMM_HAS_GLOO, COMM_HAS_NCCL, COMM_HAS_MPI, defined by the comm::gloo, comm::nccl and comm::mpi
/// targets).

#include <comm/types.hpp>
#include <comm/error.hpp>
#include <comm/work.hpp>
#include <comm/concepts.hpp>
#include <comm/diagnostics.hpp>
#include <comm/store.hpp>
#include <comm/init.hpp>
#include <comm/communicator.hpp>
#include <comm/cdb.hpp>

#include <comm/backends/shm.hpp>
#if defined(COMM_HAS_GLOO)
#include <comm/backends/gloo.hpp>
#endif
#include <comm/backends/hierarchical.hpp>  // Hierarchical<Intra, Inter>; <Shm, Gloo> with comm::gloo
#if defined(COMM_HAS_NCCL)
#include <comm/backends/nccl.hpp>
#endif
#if defined(COMM_HAS_MPI)
#include <comm/backends/mpi.hpp>
#endif
