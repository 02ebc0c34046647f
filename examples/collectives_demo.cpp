// The seed scenario: every collective once, on the CPU over Gloo or, with --backend shm, over
// shared memory (ranks on one host).
//
//   comm-run -n 4 ./collectives_demo [--backend gloo|shm]
//
// Each rank prints its values before and after each operation; with 4 ranks:
//   all_reduce(rank)               -> 6 on every rank (0+1+2+3)
//   reduce_scatter([rank] * 4)     -> 6 on every rank (its slot summed over the ranks)
//   all_gather(rank)               -> [0, 1, 2, 3]
//   broadcast(world size, root 0)  -> 4 on every rank
//   gather(rank * 10, root 0)      -> [0, 10, 20, 30] on rank 0
//   async all_reduce(rank + 1)     -> 10, waited on through a comm::Work
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include <comm/comm.hpp>

namespace {

template <class T>
std::string show(const std::vector<T>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

template <class Backend>
int demo() {
  // env:// rendezvous: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (set by comm-run).
  auto c = comm::Communicator<Backend>::from_env();
  const int rank = c.rank();
  const int n = c.size();

  // all_reduce in place: the sum of all ranks.
  std::vector<int> mine{rank};
  std::printf("rank %d: all_reduce      before %s", rank, show(mine).c_str());
  c.all_reduce(mine);
  std::printf("  after %s\n", show(mine).c_str());

  // reduce_scatter: every rank contributes [rank] * n; rank r receives the sum of slot r.
  std::vector<int> contrib(static_cast<std::size_t>(n), rank), slot(1);
  c.reduce_scatter(contrib, slot);
  std::printf("rank %d: reduce_scatter  before %s  after %s\n", rank, show(contrib).c_str(), show(slot).c_str());

  // all_gather: everyone's rank, in rank order.
  std::vector<int> everyone(static_cast<std::size_t>(n), -1);
  c.all_gather(std::vector<int>{rank}, everyone);
  std::printf("rank %d: all_gather      before [%d]  after %s\n", rank, rank, show(everyone).c_str());

  // broadcast: rank 0 tells everyone the world size.
  std::vector<int> size_from_root{rank == 0 ? n : -1};
  std::printf("rank %d: broadcast       before %s", rank, show(size_from_root).c_str());
  c.broadcast(size_from_root, /*root=*/0);
  std::printf("  after %s\n", show(size_from_root).c_str());

  // gather: rank 0 collects rank * 10 from everyone; the others pass an empty output.
  std::vector<int> gathered(rank == 0 ? static_cast<std::size_t>(n) : 0);
  c.gather(std::vector<int>{rank * 10}, gathered, /*root=*/0);
  if (rank == 0)
    std::printf("rank %d: gather          before [%d]  after %s\n", rank, rank * 10, show(gathered).c_str());
  else
    std::printf("rank %d: gather          sent [%d] to rank 0\n", rank, rank * 10);

  // async all_reduce: the call returns a Work at once; wait() rethrows any error.
  std::vector<float> async_buf{static_cast<float>(rank + 1)};
  comm::Work work = c.all_reduce(async_buf, comm::async);
  work.wait();
  std::printf("rank %d: async all_reduce before [%d]  after [%g]\n", rank, rank + 1,
              static_cast<double>(async_buf[0]));
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  const std::string backend = argc == 3 && std::string(argv[1]) == "--backend" ? argv[2] : "gloo";
  if (argc != 1 && argc != 3) throw std::invalid_argument("usage: collectives_demo [--backend gloo|shm]");
  if (backend == "shm") return demo<comm::backends::Shm>();
  if (backend == "gloo") return demo<comm::backends::Gloo>();
  throw std::invalid_argument("unknown backend '" + backend + "' (gloo|shm)");
} catch (const std::exception& e) {
  std::fprintf(stderr, "collectives_demo: %s\n", e.what());
  return 1;
}
