// cdb with the MPI backend under mpirun (linked with comm::mpi only, so "auto" cannot pick NCCL or
// Gloo):
//   mpi_cdb_test initialized   the program initializes MPI; init_distributed() ("auto") adopts
//                              MPI_COMM_WORLD; comm leaves MPI initialized (the program finalizes).
//   mpi_cdb_test comm          MPI is not initialized; init_distributed({.backend = "mpi"})
//                              discovers mpirun's variables, rendezvous on the TcpStore and
//                              initializes MPI; comm finalizes it at exit (else mpirun fails the job).
// Rank 0 prints the verdict; the failure count is summed over the world.
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <comm/cdb.hpp>

namespace {

int g_failures = 0;

#define EXPECT(cond)                                                                 \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      ++g_failures;                                                                  \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
    }                                                                                \
  } while (false)

void exercise(comm::AnyCommunicator& w) {
  const int n = w.size(), me = w.rank();
  EXPECT(w.backend() == "mpi");
  EXPECT(w.get_if<comm::backends::Mpi>() != nullptr);
  std::vector<double> v{static_cast<double>(me + 1)};
  w.all_reduce(v, comm::ReduceOp::sum);
  EXPECT(v[0] == n * (n + 1) / 2.0);
  std::vector<comm::half> h{comm::half(1.0f)};
  w.all_reduce(h, [](comm::half a, comm::half b) { return comm::half(float(a) + float(b)); }, comm::async).wait();
  EXPECT(static_cast<float>(h[0]) == static_cast<float>(n));
  auto g = w.split(me % 2, me);
  EXPECT(g.has_value());
  if (g) {
    std::vector<std::int32_t> c{1};
    g->all_reduce(c);
    EXPECT(c[0] == (n + (me % 2 == 0 ? 1 : 0)) / 2);
  }
  // init_distributed again returns the same world; a conflicting backend is refused.
  EXPECT(&comm::init_distributed() == &w);
  comm::InitOptions other;
  other.backend = "gloo";
  bool refused = false;
  try {
    (void)comm::init_distributed(other);
  } catch (const comm::InvalidArgument&) {
    refused = true;
  }
  EXPECT(refused);
}

}  // namespace

int main(int argc, char** argv) {
  const bool app_inits = argc > 1 && std::strcmp(argv[1], "initialized") == 0;
  if (app_inits) {
    int provided = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  }
  int rank = -1;
  int total = 0;
  try {
    comm::InitOptions o;
    o.backend = app_inits ? "auto" : "mpi";
    comm::AnyCommunicator& w = comm::init_distributed(o);
    rank = w.rank();
    int init = 0;
    MPI_Initialized(&init);
    EXPECT(init == 1);
    exercise(w);
    if (app_inits) {
      // Adopted: no store, so no monitored_barrier.
      bool refused = false;
      try {
        w.monitored_barrier(std::chrono::seconds(5));
      } catch (const comm::InvalidArgument&) {
        refused = true;
      }
      EXPECT(refused);
    } else {
      w.monitored_barrier(std::chrono::seconds(10));  // created through the store: available
    }
    std::vector<int> f{g_failures};
    w.all_reduce(f);
    total = f[0];
    comm::destroy();
    EXPECT(!comm::is_initialized());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "unexpected exception: %s\n", e.what());
    return 1;
  }
  if (rank == 0) std::printf("mpi_cdb_test: %d failed check(s)%s\n", total, total ? "" : ": OK");
  if (app_inits) {
    int fin = 0;
    MPI_Finalized(&fin);
    if (fin != 0) {  // comm must not finalize an MPI it did not initialize
      std::fprintf(stderr, "MPI was finalized by comm\n");
      return 1;
    }
    MPI_Finalize();
  }
  return total == 0 && g_failures == 0 ? 0 : 1;
}
