// The backends comm knows: ONE list, expanded by <comm/backends/registry.hpp> (comm.hpp's
// includes, cdb's selection by name and its error texts) and read by CMake (file(STRINGS) of the
// COMM_BACKEND lines: the backend-parametrized test suites and the fault battery).
//
// No include guard, on purpose: an X-macro list, expanded once per use with COMM_BACKEND defined
// by the includer. Include <comm/backends/registry.hpp>, not this file.
//
//   COMM_BACKEND(name, has, target, Policy...)
//     name    the cdb name (InitOptions::backend), the test suites' prefix; one identifier;
//     has     1, or the macro its CMake target defines (1 when the backend is compiled in);
//     target  the CMake target that brings it in (what "not compiled in (link ...)" names, and
//             what the test suites link);
//     Policy  its policy type (last: it may contain commas).
//
// Adding a backend: its policy header and engine folder, its CMake target (CMakeLists.txt and
// cmake/commConfig.cmake.in), and one entry here: the header's include under the has-macro, and
// its COMM_BACKEND line. Order: the order of error texts and of the suites' registration.

#if !defined(COMM_BACKEND)
#error "<comm/backends/list.hpp> is an X-macro list: include <comm/backends/registry.hpp>"
#endif

#include <comm/backends/shm.hpp>
COMM_BACKEND(shm, 1, comm::comm, ::comm::backends::Shm)

#if defined(COMM_HAS_GLOO)
#include <comm/backends/gloo.hpp>
#endif
COMM_BACKEND(gloo, COMM_HAS_GLOO, comm::gloo, ::comm::backends::Gloo)

#if defined(COMM_HAS_GLOO)
#include <comm/backends/hierarchical.hpp>
#endif
COMM_BACKEND(hierarchical, COMM_HAS_GLOO, comm::gloo, ::comm::backends::Hierarchical<::comm::backends::Shm, ::comm::backends::Gloo>)

#if defined(COMM_HAS_NCCL)
#include <comm/backends/nccl.hpp>
#endif
COMM_BACKEND(nccl, COMM_HAS_NCCL, comm::nccl, ::comm::backends::Nccl)

#if defined(COMM_HAS_MPI)
#include <comm/backends/mpi.hpp>
#endif
COMM_BACKEND(mpi, COMM_HAS_MPI, comm::mpi, ::comm::backends::Mpi)

// Test-only extension point: comm's own test build names a file of further entries (same form)
// here, so that a backend written under tests/ joins every suite through its one entry.
#if defined(COMM_TEST_EXTRA_BACKENDS)
#include COMM_TEST_EXTRA_BACKENDS
#endif
