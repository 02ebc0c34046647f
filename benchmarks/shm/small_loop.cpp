// comm-bench-small-loop (comm's Shm) and comm-bench-small-loop-mpi (the same loop on MPI's
// blocking calls): back-to-back small operations timed as a whole, where comm-bench times every
// call. A root of back-to-back rooted operations runs ahead of its readers (Shm's ring, MPI's eager
// queues), so a per-call median mixes how far ahead the root may run with what a call costs; the
// time of a long run divided by its calls is the throughput alone, and at one rank it is the cost
// of the call path itself (benchmarks/RESULTS.md, "Small rooted operations: the call path").
//
//   comm-run -n N comm-bench-small-loop [OPS [BYTES [CALLS [REPS [OFFSET [MODE]]]]]]
//   mpirun -n N comm-bench-small-loop-mpi [OPS [BYTES [CALLS [REPS [OFFSET [MODE]]]]]]
//     OPS    comma list of broadcast, gather, reduce, scatter, all_reduce (default broadcast,gather)
//     BYTES  bytes per rank (default 8; float elements, so a multiple of 4)
//     CALLS  calls per timed run (default 1000000)
//     REPS   timed runs per op (default 5), each after a barrier
//     OFFSET the buffers start this many bytes (a multiple of 4, below 4096) past a page boundary,
//            so a copy's distance to Shm's segment modulo 4096 is fixed (default: where
//            std::vector puts them; benchmarks/RESULTS.md, "memcpy at a distance of 1-15 bytes");
//            a comma list gives rank r its (r mod length)th, so the distance between two ranks'
//            buffers is fixed too ("Cross-memory attach at a distance of 1-15 bytes"); -1 is
//            the default placement, for a MODE without an offset
//     MODE   total (default) or per-call
//
// total: rank 0 prints "op bytes ns_per_call min median max" over the runs, each run's time the
// slowest rank's. per-call: every call is timed on its own (a clock read each, inside the time),
// and each rank prints its percentiles, then rank 0 the median over calls of the slowest rank's
// time, as comm-bench reports it: which rank a per-call median stands for, and whether it is
// that rank's own cost or the wait for another (a root that runs ahead returns at once; one held
// by its readers takes their time).

#ifdef COMM_SMALL_LOOP_MPI
#include <mpi.h>
#else
#include <comm/comm.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include "../common/bench.hpp"

namespace {

#ifdef COMM_SMALL_LOOP_MPI
struct Ranks {
  Ranks(int* argc, char*** argv) { MPI_Init(argc, argv); }
  ~Ranks() { MPI_Finalize(); }
  int rank() const {
    int r = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    return r;
  }
  int size() const {
    int n = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    return n;
  }
  void barrier() { MPI_Barrier(MPI_COMM_WORLD); }
  double max(double v) {
    double m = 0;
    MPI_Allreduce(&v, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return m;
  }
  /// One call of `op`; false for an op this program does not know.
  bool call(const std::string& op, std::span<float> in, std::span<float> out, int /*n: MPI knows it*/) {
    const int c = static_cast<int>(in.size());
    if (op == "broadcast") return MPI_Bcast(in.data(), c, MPI_FLOAT, 0, MPI_COMM_WORLD) == MPI_SUCCESS;
    if (op == "gather")
      return MPI_Gather(in.data(), c, MPI_FLOAT, out.data(), c, MPI_FLOAT, 0, MPI_COMM_WORLD) == MPI_SUCCESS;
    if (op == "reduce") return MPI_Reduce(in.data(), out.data(), c, MPI_FLOAT, MPI_SUM, 0, MPI_COMM_WORLD) == MPI_SUCCESS;
    if (op == "scatter")
      return MPI_Scatter(out.data(), c, MPI_FLOAT, in.data(), c, MPI_FLOAT, 0, MPI_COMM_WORLD) == MPI_SUCCESS;
    if (op == "all_reduce")
      return MPI_Allreduce(in.data(), out.data(), c, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD) == MPI_SUCCESS;
    return false;
  }
};
#else
struct Ranks {
  Ranks(int*, char***) : c(comm::Communicator<comm::backends::Shm>::from_env()) {}
  int rank() const { return c.rank(); }
  int size() const { return c.size(); }
  void barrier() { c.barrier(); }
  double max(double v) {
    c.all_reduce(std::span<double>(&v, 1), comm::ReduceOp::max);
    return v;
  }
  bool call(const std::string& op, std::span<float> in, std::span<float> out, int n) {
    const std::span<float> mine(in);
    if (op == "broadcast") {
      c.broadcast(mine, 0);
    } else if (op == "gather") {
      c.gather(std::span<const float>(mine), std::span<float>(out), 0);
    } else if (op == "reduce") {
      c.reduce(std::span<const float>(mine), std::span<float>(out).first(in.size()), 0, comm::ReduceOp::sum);
    } else if (op == "scatter") {
      c.scatter(std::span<const float>(out).first(in.size() * static_cast<std::size_t>(n)), mine, 0);
    } else if (op == "all_reduce") {
      c.all_reduce(std::span<const float>(mine), std::span<float>(out).first(in.size()), comm::ReduceOp::sum);
    } else {
      return false;
    }
    return true;
  }
  comm::Communicator<comm::backends::Shm> c;
};
#endif

}  // namespace

int main(int argc, char** argv) {
  Ranks ranks(&argc, &argv);
  const auto ops = comm::bench::comma_list(argc > 1 ? argv[1] : "broadcast,gather");
  const std::size_t bytes = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 8;
  const long calls = argc > 3 ? std::strtol(argv[3], nullptr, 10) : 1000000;
  const int reps = argc > 4 ? std::atoi(argv[4]) : 5;
  const auto offsets = comm::bench::comma_list(argc > 5 ? argv[5] : "-1");
  const std::string mode = argc > 6 ? argv[6] : "total";
  const int n = ranks.size();
  long offset = -2;  // not a number: refused below
  if (const std::string& o = offsets[static_cast<std::size_t>(ranks.rank()) % offsets.size()]; !o.empty()) {
    char* end = nullptr;
    const long v = std::strtol(o.c_str(), &end, 10);
    if (*end == '\0') offset = v;
  }
  if (bytes < 4 || bytes % 4 != 0 || calls < 1 || reps < 1 || offset < -1 || offset >= 4096 || (offset > 0 && offset % 4 != 0) ||
      (mode != "total" && mode != "per-call") || (mode == "per-call" && calls > 1000000 / reps)) {
    if (ranks.rank() == 0 || offset < -1)  // an OFFSET list may be wrong for one rank only
      std::fprintf(stderr,
                   "BYTES must be a positive multiple of 4, CALLS and REPS positive, OFFSET multiples of 4 below 4096, "
                   "MODE total or per-call (per-call: at most 1000000 calls in all)\n");
    return 2;
  }
  const std::size_t in_n = bytes / 4, out_n = bytes / 4 * static_cast<std::size_t>(n);
  // With OFFSET, each buffer sits in a larger one at that byte offset past a page boundary.
  const std::size_t slack = offset < 0 ? 0 : 2048;
  std::vector<float> in_store(in_n + slack, 1.0f), out_store(out_n + slack, 0.0f);
  const auto place = [&](std::vector<float>& v, std::size_t count) {
    if (offset < 0) return std::span<float>(v.data(), count);
    const auto a = reinterpret_cast<std::uintptr_t>(v.data());
    const std::size_t skip = ((4096 - (a & 4095u)) & 4095u) + static_cast<std::size_t>(offset);  // bytes, a multiple of 4
    return std::span<float>(v.data() + skip / 4, count);
  };
  const std::span<float> in = place(in_store, in_n), out = place(out_store, out_n);
  if (mode == "per-call") {
    for (const auto& op : ops) {
      std::vector<double> t;
      t.reserve(static_cast<std::size_t>(calls) * static_cast<std::size_t>(reps));
      for (int r = 0; r < reps; ++r) {
        ranks.barrier();
        for (long i = 0; i < calls; ++i) {
          const auto t0 = std::chrono::steady_clock::now();
          if (!ranks.call(op, in, out, n)) {
            if (ranks.rank() == 0) std::fprintf(stderr, "unknown op '%s'\n", op.c_str());
            return 2;
          }
          t.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count());
        }
      }
      std::vector<double> s = t;
      std::sort(s.begin(), s.end());
      const auto q = [&](double f) { return s[static_cast<std::size_t>(f * static_cast<double>(s.size() - 1))]; };
      for (int p = 0; p < n; ++p) {  // in rank order: one barrier per line
        ranks.barrier();
        if (p == ranks.rank()) {
          std::printf("%s %zu rank %d ns_per_call p10 %.0f p50 %.0f p90 %.0f p99 %.0f\n", op.c_str(), bytes, p, q(0.1),
                      q(0.5), q(0.9), q(0.99));
          std::fflush(stdout);
        }
      }
      std::vector<double> slowest(t.size());
      for (std::size_t i = 0; i < t.size(); ++i) slowest[i] = ranks.max(t[i]);
      std::sort(slowest.begin(), slowest.end());
      if (ranks.rank() == 0)
        std::printf("%s %zu slowest_rank ns_per_call p50 %.0f (%d ranks, %ld calls x %d)\n", op.c_str(), bytes,
                    slowest[slowest.size() / 2], n, calls, reps);
    }
    return 0;
  }
  for (const auto& op : ops) {
    std::vector<double> ns;
    for (int r = 0; r < reps; ++r) {
      ranks.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      for (long i = 0; i < calls; ++i) {
        if (!ranks.call(op, in, out, n)) {
          if (ranks.rank() == 0) std::fprintf(stderr, "unknown op '%s'\n", op.c_str());
          return 2;
        }
      }
      const double t = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
      ns.push_back(ranks.max(t) / static_cast<double>(calls));
    }
    std::sort(ns.begin(), ns.end());
    if (ranks.rank() == 0)
      std::printf("%s %zu ns_per_call %.1f %.1f %.1f (%d ranks, %ld calls x %d)\n", op.c_str(), bytes, ns.front(),
                  ns[ns.size() / 2], ns.back(), n, calls, reps);
  }
  return 0;
}
