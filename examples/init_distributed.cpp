// One call gives the program its world, however it was launched:
//   comm-run -n 4 ./init_distributed
//   OpenMPI / MPICH / SLURM variables (mpirun -n 4 ./init_distributed, srun -n 4 ./init_distributed)
// With COMM_DEBUG=INFO comm says where each value came from and which backend it picked.
#include <comm/comm.hpp>

#include <cstdio>
#include <vector>

int main() {
  try {
    comm::AnyCommunicator& world = comm::init_distributed();
    std::vector<int> x{world.rank()};
    world.all_reduce(x, comm::op::sum);
    const int expected = world.size() * (world.size() - 1) / 2;
    std::printf("rank %d of %d on %s: sum of ranks = %d (expected %d)\n", world.rank(), world.size(),
                std::string(world.backend()).c_str(), x[0], expected);
    world.barrier();
    comm::destroy();
    return x[0] == expected ? 0 : 1;
  } catch (const comm::Error& e) {
    std::fprintf(stderr, "init_distributed example: %s\n", e.what());
    return 2;
  }
}
