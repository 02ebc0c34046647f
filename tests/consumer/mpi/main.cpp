// Built against an installed comm with find_package(comm COMPONENTS mpi) and run as a single MPI
// process (no mpirun: MPI's singleton mode). comm initializes MPI, and finalizes it at exit.
#include <comm/comm.hpp>

#include <cstdio>
#include <memory>
#include <vector>

#if !defined(COMM_HAS_MPI)
#error "comm::mpi must define COMM_HAS_MPI"
#endif

int main() {
  auto c = comm::Communicator<comm::backends::Mpi>::create(std::make_shared<comm::HashStore>(), 0, 1);
  std::vector<comm::half> h{comm::half(1.5f), comm::half(2.0f)};
  c.all_reduce(h, comm::op::max);
  std::vector<float> x{1.f, 2.f, 3.f};
  c.all_reduce(x, comm::ReduceOp::sum, comm::async).wait();
  if (x[2] != 3.f || static_cast<float>(h[0]) != 1.5f) return 2;
  int init = 0;
  MPI_Initialized(&init);
  if (init == 0) return 3;
  std::puts("consumer: comm with mpi works");
  return 0;
}
