#pragma once
// comm-bench --backend mpi: comm's MPI backend under mpirun, and with --baseline the raw MPI call
// on a communicator of its own (MPI_Comm_dup of MPI_COMM_WORLD) in the same processes, alternating
// call by call:
//   --baseline raw      the blocking call (MPI_Allreduce, MPI_Reduce_scatter_block, MPI_Allgather,
//                       MPI_Bcast, MPI_Gather, MPI_Reduce, MPI_Scatter, MPI_Alltoall(v),
//                       MPI_Send/MPI_Recv, MPI_Barrier): what an MPI program calls today;
//   --baseline raw-nb   the non-blocking call comm issues (MPI_Iallreduce...) completed by spinning on
//                       MPI_Test: the same MPI work as comm's, so the ratio is comm's own layer.
// comm-bench initializes MPI itself (MPI_THREAD_MULTIPLE) and adopts MPI_COMM_WORLD.
//
//   mpirun -np 2 --mca btl self,vader comm-bench --backend mpi --baseline raw --sizes 8,1M
//
// Only compiled where comm::mpi exists (COMM_HAS_MPI).

#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <comm/comm.hpp>

#include "bench.hpp"
#include "cli.hpp"
#include "data.hpp"
#include "harness.hpp"
#include "views.hpp"

namespace comm::bench {

using MpiComm = comm::Communicator<comm::backends::Mpi>;

inline void mpi_check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    throw std::runtime_error(std::string(what) + ": " + std::string(msg, static_cast<std::size_t>(len)));
  }
}

/// The raw baseline's MPI calls (blocking, or non-blocking + MPI_Test spin) on its own communicator.
template <class T>
struct RawMpi {
  MPI_Comm comm;
  bool nonblocking;
  int rank;

  void wait(MPI_Request& r) const {
    int done = 0;
    while (done == 0) mpi_check(MPI_Test(&r, &done, MPI_STATUS_IGNORE), "MPI_Test");
  }

  void call(Op op, const View<T>& v, const Layout& l, comm::ReduceOp redop, int root) const {
    const MPI_Datatype dt = comm::detail::mpi::datatype<T>();
    const MPI_Op mop = is_reduction(op) ? comm::detail::mpi::op_of(redop) : MPI_OP_NULL;
    const int count = static_cast<int>(l.count), block = static_cast<int>(l.block);
    MPI_Request r = MPI_REQUEST_NULL;
    switch (op) {
      case Op::all_reduce: {
        const void* in = v.in == v.out ? MPI_IN_PLACE : v.in;
        if (!nonblocking) return mpi_check(MPI_Allreduce(in, v.out, count, dt, mop, comm), "MPI_Allreduce");
        mpi_check(MPI_Iallreduce(in, v.out, count, dt, mop, comm, &r), "MPI_Iallreduce");
        break;
      }
      case Op::reduce_scatter: {
        // In place (the output is this rank's block): MPI leaves the result at the start.
        const bool in_place = v.out == v.in + static_cast<std::size_t>(rank) * l.block;
        const void* in = in_place ? MPI_IN_PLACE : v.in;
        T* out = in_place ? v.in : v.out;
        if (!nonblocking)
          mpi_check(MPI_Reduce_scatter_block(in, out, block, dt, mop, comm), "MPI_Reduce_scatter_block");
        else {
          mpi_check(MPI_Ireduce_scatter_block(in, out, block, dt, mop, comm, &r), "MPI_Ireduce_scatter_block");
          wait(r);
        }
        if (in_place && rank != 0) std::memmove(v.out, v.in, l.block * sizeof(T));
        return;
      }
      case Op::all_gather: {
        const bool in_place = v.in == v.out + static_cast<std::size_t>(rank) * l.block;
        const void* in = in_place ? MPI_IN_PLACE : v.in;
        if (!nonblocking) return mpi_check(MPI_Allgather(in, block, dt, v.out, block, dt, comm), "MPI_Allgather");
        mpi_check(MPI_Iallgather(in, block, dt, v.out, block, dt, comm, &r), "MPI_Iallgather");
        break;
      }
      case Op::broadcast:
        if (!nonblocking) return mpi_check(MPI_Bcast(v.out, count, dt, root, comm), "MPI_Bcast");
        mpi_check(MPI_Ibcast(v.out, count, dt, root, comm, &r), "MPI_Ibcast");
        break;
      case Op::gather:
        if (!nonblocking) return mpi_check(MPI_Gather(v.in, block, dt, v.out, block, dt, root, comm), "MPI_Gather");
        mpi_check(MPI_Igather(v.in, block, dt, v.out, block, dt, root, comm, &r), "MPI_Igather");
        break;
      case Op::reduce: {
        const void* in = v.in == v.out && rank == root ? MPI_IN_PLACE : v.in;
        if (!nonblocking) return mpi_check(MPI_Reduce(in, v.out, count, dt, mop, root, comm), "MPI_Reduce");
        mpi_check(MPI_Ireduce(in, v.out, count, dt, mop, root, comm, &r), "MPI_Ireduce");
        break;
      }
      case Op::scatter: {
        void* out = rank == root && v.out == v.in + static_cast<std::size_t>(rank) * l.block ? MPI_IN_PLACE : v.out;
        if (!nonblocking) return mpi_check(MPI_Scatter(v.in, block, dt, out, block, dt, root, comm), "MPI_Scatter");
        mpi_check(MPI_Iscatter(v.in, block, dt, out, block, dt, root, comm, &r), "MPI_Iscatter");
        break;
      }
      case Op::all_to_all:
        if (!nonblocking) return mpi_check(MPI_Alltoall(v.in, block, dt, v.out, block, dt, comm), "MPI_Alltoall");
        mpi_check(MPI_Ialltoall(v.in, block, dt, v.out, block, dt, comm, &r), "MPI_Ialltoall");
        break;
      case Op::all_to_all_v: {
        // int counts and packed displacements, rebuilt per call (outside MPI's time, inside ours:
        // comm converts its size_t counts per call too).
        const std::size_t n = v.in_counts.size();
        std::vector<int> cd(4 * n);
        for (std::size_t p = 0, so = 0, ro = 0; p < n; ++p) {
          cd[p] = static_cast<int>(v.in_counts[p]);
          cd[2 * n + p] = static_cast<int>(v.out_counts[p]);
          cd[n + p] = static_cast<int>(so);
          cd[3 * n + p] = static_cast<int>(ro);
          so += v.in_counts[p];
          ro += v.out_counts[p];
        }
        const int *sc = cd.data(), *sd = sc + n, *rc = sd + n, *rd = rc + n;
        if (!nonblocking)
          return mpi_check(MPI_Alltoallv(v.in, sc, sd, dt, v.out, rc, rd, dt, comm), "MPI_Alltoallv");
        mpi_check(MPI_Ialltoallv(v.in, sc, sd, dt, v.out, rc, rd, dt, comm, &r), "MPI_Ialltoallv");
        wait(r);
        return;
      }
      case Op::send_recv: {
        if (v.peer < 0) return;
        MPI_Request q = MPI_REQUEST_NULL;
        auto send = [&] {
          if (!nonblocking) return mpi_check(MPI_Send(v.in, count, dt, v.peer, 0, comm), "MPI_Send");
          mpi_check(MPI_Isend(v.in, count, dt, v.peer, 0, comm, &q), "MPI_Isend");
          wait(q);
        };
        auto recv = [&] {
          if (!nonblocking) return mpi_check(MPI_Recv(v.out, count, dt, v.peer, 0, comm, MPI_STATUS_IGNORE), "MPI_Recv");
          mpi_check(MPI_Irecv(v.out, count, dt, v.peer, 0, comm, &q), "MPI_Irecv");
          wait(q);
        };
        if (rank < v.peer) {
          send();
          recv();
        } else {
          recv();
          send();
        }
        return;
      }
      case Op::barrier:
        if (!nonblocking) return mpi_check(MPI_Barrier(comm), "MPI_Barrier");
        mpi_check(MPI_Ibarrier(comm, &r), "MPI_Ibarrier");
        break;
    }
    wait(r);
  }
};

/// "Open MPI v4.1.4" (the first line of MPI_Get_library_version).
inline std::string mpi_library() {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  MPI_Get_library_version(buf, &len);
  std::string s(buf, static_cast<std::size_t>(len));
  s = s.substr(0, s.find_first_of("\n,"));
  return s;
}

template <class T>
void run_mpi_dtype(const Options& o, MpiComm& c, MPI_Comm raw_comm, const CrossRank& x, long& wrong_total) {
  const auto redop_opt = parse_redop(o.redop);
  if (!redop_opt) throw std::invalid_argument("unknown --redop '" + o.redop + "'");
  const comm::ReduceOp redop = *redop_opt;
  const int rank = c.rank(), n = c.size();
  const bool baseline = !o.baseline.empty();
  const RawMpi<T> raw{raw_comm, o.baseline == "raw-nb", rank};
  if (baseline) {
    if constexpr (!comm::detail::mpi::mpi_reduces_v<T>)
      throw std::invalid_argument("--baseline " + o.baseline + ": MPI has no " + std::string(dtype_name<T>()) +
                                  " type (comm reduces it with its own kernel)");
    if (redop == comm::ReduceOp::avg) throw std::invalid_argument("--baseline: MPI has no avg reduction");
  }
  const std::string system = o.async ? "comm-mpi-async" : "comm-mpi";
  const std::string raw_name = o.baseline == "raw-nb" ? "mpi-raw-nb" : "mpi-raw";

  for (Op op : o.ops) {
    const auto sizes = sizes_for(o, op);
    const bool inplace = in_place(o, op);
    if (op == Op::send_recv && n < 2) throw std::invalid_argument("--op send_recv needs at least 2 ranks");
    if (is_rooted(op) && o.root >= n)
      throw std::invalid_argument("--root " + std::to_string(o.root) + " is not below the world size " +
                                  std::to_string(n));
    Buffers<T> bufs;
    bufs.reserve(op, sizes, n, inplace, place_of(o.offset, rank));
    if (rank == 0 && !o.json) {
      std::printf("# comm-bench %s: backend mpi (%s), world %d, dtype %s, redop %s, %s, iters %d (min %d, budget "
                  "%gs), warmup %d%s%s\n",
                  std::string(to_string(op)).c_str(), mpi_library().c_str(), n, std::string(dtype_name<T>()).c_str(),
                  is_reduction(op) ? o.redop.c_str() : "none", inplace ? "in place" : "out of place", o.iters,
                  o.min_iters, o.budget_s, o.warmup,
                  !baseline                ? ""
                  : o.baseline == "raw-nb" ? ", baseline raw MPI (non-blocking + MPI_Test)"
                                           : ", baseline raw MPI (blocking)",
                  o.async ? ", async form" : "");
      print_table_header(o.check, baseline);
    }
    for (std::size_t bytes : sizes) {
      const Layout l = layout(op, bytes, sizeof(T), n);
      const View<T> v = view(bufs, op, l, inplace, rank, o.root);
      auto fill = [&] { fill_view(v, op, rank); };
      auto verify = [&] { return verify_view(v, op, redop, l, rank, n, o.root); };
      std::vector<Candidate> cands;
      cands.push_back({[&] {
                         if (o.async)
                           async_call(c, op, v, redop, o.root);
                         else
                           blocking_call(c, op, v, redop, o.root);
                       },
                       fill, verify});
      if (baseline) {
        if constexpr (comm::detail::mpi::mpi_reduces_v<T>)
          cands.push_back({[&] { raw.call(op, v, l, redop, o.root); }, fill, verify});
      }
      const Measured m = measure(o, cands, x);
      wrong_total += report(o, rank, n, op, std::string(dtype_name<T>()), inplace, l, m,
                            {system, "", baseline ? raw_name : "", ""});
    }
  }
}

/// Runs every op of `o` on the MPI backend; returns the process exit code.
inline int run_mpi(const Options& o) {
  int provided = 0;
  mpi_check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
  long wrong = 0;
  int rank = 0;
  {
    auto c = MpiComm::adopt(MPI_COMM_WORLD);
    rank = c.rank();
    MPI_Comm raw = MPI_COMM_NULL;
    mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, &raw), "MPI_Comm_dup");
    // Cross-rank reductions of the timing vectors, through the communicator itself (untimed).
    CrossRank x;
    x.max = [&](std::span<double> v) { c.all_reduce(v, comm::ReduceOp::max); };
    x.sum = [&](std::span<double> v) { c.all_reduce(v, comm::ReduceOp::sum); };
    const bool known = with_dtype(o.dtype, [&](auto t) { run_mpi_dtype<decltype(t)>(o, c, raw, x, wrong); });
    if (!known) throw std::invalid_argument("unknown --dtype '" + o.dtype + "'");
    std::vector<double> rss(static_cast<std::size_t>(c.size()), 0.0);
    rss[static_cast<std::size_t>(rank)] = static_cast<double>(peak_rss_kb());
    x.max(rss);
    if (rank == 0 && o.json) print_json_memory("comm-mpi", c.size(), std::vector<long>(rss.begin(), rss.end()));
    c.barrier();
    MPI_Comm_free(&raw);
  }
  MPI_Finalize();
  if (wrong > 0) {
    if (rank == 0) std::fprintf(stderr, "comm-bench: --check found %ld wrong elements\n", wrong);
    return 1;
  }
  return 0;
}

}  // namespace comm::bench
