// comm-bench-shm-wait: the Shm backend alone, for comparing how ranks wait (steps.hpp) between
// two builds under a load of your making. Compiles in about a minute where comm-bench (every
// backend) takes several, so a change to the wait can be tried the same afternoon:
//
//   cmake --build build --target comm-bench-shm-wait        (not built by default)
//   comm-run -n 2 build/benchmarks/comm-bench-shm-wait [ITERS [OPS [BYTES]]]
//     ITERS  timed calls per size (default 1000; a tenth from 1 MiB), after 20 untimed ones
//     OPS    comma list of all_reduce, broadcast, all_gather, gather, reduce, scatter (default all)
//     BYTES  comma list of message sizes in bytes (default 8,4096,65536,1048576)
//
// Prints "op bytes median_us" on rank 0: the median over calls of the slowest rank's time.
// -DCOMM_WAIT_BENCH_BACKEND=comm::backends::Gloo (with -DCOMM_HAS_GLOO=1 -lgloo) times Gloo instead,
// e.g. against an older commit's include/ (docs/RELIABILITY.md, the elastic layer's before/after).
// benchmarks/RESULTS.md, "Where a rank waits", has the runs it was written for.
#include <comm/comm.hpp>

#ifndef COMM_WAIT_BENCH_BACKEND
#define COMM_WAIT_BENCH_BACKEND comm::backends::Shm
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include "../common/bench.hpp"

namespace {

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
  auto c = comm::Communicator<COMM_WAIT_BENCH_BACKEND>::from_env();
  const int iters = argc > 1 ? std::max(std::atoi(argv[1]), 10) : 1000;
  std::vector<std::string> ops = comm::bench::comma_list(argc > 2 ? argv[2] : "all_reduce,broadcast,all_gather,gather,reduce,scatter");
  std::vector<std::size_t> sizes;
  for (const auto& b : comm::bench::comma_list(argc > 3 ? argv[3] : "8,4096,65536,1048576")) sizes.push_back(std::stoul(b));
  const auto n = static_cast<std::size_t>(c.size());
  const bool root = c.rank() == 0;
  for (const auto& op : ops) {
    for (const std::size_t bytes : sizes) {
      const std::size_t count = std::max<std::size_t>(bytes / sizeof(float), 1);
      const std::size_t per = std::max<std::size_t>(count / n, 1);  // per rank, for the gathers
      std::vector<float> in(count, 1.0f), out(count * n, 0.0f);
      auto call = [&] {
        if (op == "all_reduce") {
          c.all_reduce(std::span<float>(in), comm::op::sum);
        } else if (op == "broadcast") {
          c.broadcast(std::span<float>(in), 0);
        } else if (op == "all_gather") {
          c.all_gather(std::span<const float>(in.data(), per), std::span<float>(out.data(), per * n));
        } else if (op == "gather") {
          c.gather(std::span<const float>(in.data(), per), std::span<float>(out.data(), root ? per * n : 0), 0);
        } else if (op == "reduce") {
          c.reduce(std::span<const float>(in), std::span<float>(out.data(), root ? count : 0), 0, comm::op::sum);
        } else if (op == "scatter") {
          c.scatter(std::span<const float>(out.data(), root ? per * n : 0), std::span<float>(in.data(), per), 0);
        } else {
          throw comm::InvalidArgument("comm-bench-shm-wait", c.rank(), "unknown operation '" + op + "'");
        }
      };
      const int timed = bytes >= (std::size_t{1} << 20) ? std::max(iters / 10, 10) : iters;
      for (int i = 0; i < 20; ++i) call();
      std::vector<float> t(static_cast<std::size_t>(timed));
      for (auto& x : t) {
        const double t0 = now_us();
        call();
        x = static_cast<float>(now_us() - t0);
      }
      c.all_reduce(std::span<float>(t), comm::op::max);
      std::sort(t.begin(), t.end());
      if (root) std::printf("%s %zu %.2f\n", op.c_str(), bytes, static_cast<double>(t[t.size() / 2]));
    }
  }
}
