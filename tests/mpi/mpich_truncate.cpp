// Run under MPICH (mpi_mpich_truncate): ranks that disagree on a broadcast's size, the root sending
// more than rank 1 receives. MPICH 4.0 raises that truncation through MPI_COMM_WORLD's error
// handler; on an MPI that comm initialized the world returns errors, so rank 1 gets a comm::Error
// naming the operation, the peer and the cause instead of the job aborting. Prints "mpich_truncate: OK" on rank 1 when so.
#include <comm/comm.hpp>

#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: mpich_truncate STORE_FILE\n");
    return 2;
  }
  const char* r = std::getenv("PMI_RANK");
  const char* n = std::getenv("PMI_SIZE");
  if (r == nullptr || n == nullptr) {
    std::fprintf(stderr, "mpich_truncate: run it under mpiexec.mpich (PMI_RANK, PMI_SIZE)\n");
    return 2;
  }
  const int rank = std::atoi(r);
  const int size = std::atoi(n);
  auto store = std::make_shared<comm::FileStore>(argv[1]);
  auto c = comm::Communicator<comm::backends::Mpi>::create(store, rank, size);
  std::vector<float> data(rank == 0 ? 4 : 2, 1.0f);
  // Neither rank may leave before rank 1 has judged, and both leave through MPI_Finalize (comm's
  // exit guard): hydra tears the job down (SIGHUP) when a rank exits without it, which under load
  // killed rank 1 before its receive had failed (CI, stop 30).
  const auto finish = [&](bool ok) {
    std::fflush(stdout);
    store->set("verdict." + std::to_string(rank), ok ? "ok" : "bad");
    store->wait({"verdict.0", "verdict.1"});
    return ok ? 0 : 1;
  };
  try {
    c.broadcast(data, 0);
  } catch (const comm::Error& e) {
    const std::string what = e.what();
    const bool named = what.find("broadcast") != std::string::npos && what.find("rank 0 sent more") != std::string::npos &&
                       what.find("different counts") != std::string::npos;
    std::printf("mpich_truncate: rank %d: %s\n", rank, e.what());
    if (rank == 1 && named) std::printf("mpich_truncate: OK\n");
    return finish(rank == 1 && named);
  }
  std::printf("mpich_truncate: rank %d: broadcast returned\n", rank);
  return finish(rank == 0);  // rank 1 must have thrown
}
