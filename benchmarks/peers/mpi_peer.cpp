// MPI peer of benchmarks/compare (OpenMPI or MPICH): MPI's own call for every op of comm-bench
// (MPI_Allreduce ... MPI_Alltoallv, a MPI_Send/MPI_Recv ping-pong, MPI_Barrier) with the same
// command line, methodology and JSON lines as comm-bench.
//
//   mpirun -n 2 --mca btl self,vader comm-bench-mpi-peer --system mpi-shm --op all_reduce --json
//   mpirun -n 2 --mca btl self,tcp --mca btl_tcp_if_include lo comm-bench-mpi-peer --system mpi-tcp ...

#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "../common/bench.hpp"
#include "../common/cli.hpp"
#include "../common/data.hpp"
#include "../common/harness.hpp"
#include "../common/peer.hpp"
#include "../common/views.hpp"

namespace {

using namespace comm::bench;

constexpr std::string_view kAbout =
    R"(MPI's own calls, timed like comm-bench (same buffers, checks and rows): MPI_Allreduce,
MPI_Reduce_scatter_block, MPI_Allgather, MPI_Bcast, MPI_Gather, MPI_Reduce, MPI_Scatter, MPI_Alltoall,
MPI_Alltoallv, MPI_Send/MPI_Recv ping-pong and MPI_Barrier. Start it with mpirun -n N.)";

constexpr std::string_view kFooter = R"(
Examples:
  mpirun -n 2 --mca btl self,vader comm-bench-mpi-peer --system mpi-shm --op all -c 1
  mpirun -n 2 --mca btl self,tcp comm-bench-mpi-peer --system mpi-tcp --op send_recv -b 8 -e 16M -f 8
)";

template <class T>
MPI_Datatype mpi_type() {
  if constexpr (std::is_same_v<T, float>) return MPI_FLOAT;
  if constexpr (std::is_same_v<T, double>) return MPI_DOUBLE;
  if constexpr (std::is_same_v<T, std::int8_t>) return MPI_INT8_T;
  if constexpr (std::is_same_v<T, std::uint8_t>) return MPI_UINT8_T;
  if constexpr (std::is_same_v<T, std::int32_t>) return MPI_INT32_T;
  if constexpr (std::is_same_v<T, std::uint32_t>) return MPI_UINT32_T;
  if constexpr (std::is_same_v<T, std::int64_t>) return MPI_INT64_T;
  if constexpr (std::is_same_v<T, std::uint64_t>) return MPI_UINT64_T;
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(comm::ReduceOp op) {
  switch (op) {
    case comm::ReduceOp::sum: return MPI_SUM;
    case comm::ReduceOp::prod: return MPI_PROD;
    case comm::ReduceOp::min: return MPI_MIN;
    case comm::ReduceOp::max: return MPI_MAX;
    case comm::ReduceOp::band: return MPI_BAND;
    case comm::ReduceOp::bor: return MPI_BOR;
    case comm::ReduceOp::bxor: return MPI_BXOR;
    case comm::ReduceOp::avg: break;
  }
  throw std::invalid_argument("MPI has no avg reduction");
}

void check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    throw std::runtime_error(std::string(what) + ": " + std::string(msg, static_cast<std::size_t>(len)));
  }
}

template <class T>
long run_dtype(const Options& o, int rank, int n, const CrossRank& x, const std::string& system) {
  const MPI_Datatype dt = mpi_type<T>();
  if (dt == MPI_DATATYPE_NULL) throw std::invalid_argument("MPI has no " + std::string(dtype_name<T>()) + " type");
  const auto redop = parse_redop(o.redop).value_or(comm::ReduceOp::sum);  // run_peer rejects a bad name
  PeerSystem<T> s;
  s.name = system;
  s.call = [&](Op op, const View<T>& v, const Layout& l) -> std::function<void()> {
    const MPI_Op mop = is_reduction(op) ? mpi_op(redop) : MPI_OP_NULL;
    const int count = static_cast<int>(l.count), block = static_cast<int>(l.block), root = o.root;
    switch (op) {
      case Op::all_reduce:
        return [=] {
          check(MPI_Allreduce(v.in == v.out ? MPI_IN_PLACE : v.in, v.out, count, dt, mop, MPI_COMM_WORLD),
                "MPI_Allreduce");
        };
      case Op::reduce_scatter:
        return [=] {
          if (v.out == v.in + static_cast<std::size_t>(rank) * l.block) {
            // In place: MPI leaves the block at the start of the buffer.
            check(MPI_Reduce_scatter_block(MPI_IN_PLACE, v.in, block, dt, mop, MPI_COMM_WORLD),
                  "MPI_Reduce_scatter_block");
            if (rank != 0) std::memmove(v.out, v.in, l.block * sizeof(T));
          } else {
            check(MPI_Reduce_scatter_block(v.in, v.out, block, dt, mop, MPI_COMM_WORLD), "MPI_Reduce_scatter_block");
          }
        };
      case Op::all_gather:
        return [=] {
          if (v.in == v.out + static_cast<std::size_t>(rank) * l.block)
            check(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, v.out, block, dt, MPI_COMM_WORLD), "MPI_Allgather");
          else
            check(MPI_Allgather(v.in, block, dt, v.out, block, dt, MPI_COMM_WORLD), "MPI_Allgather");
        };
      case Op::broadcast: return [=] { check(MPI_Bcast(v.out, count, dt, root, MPI_COMM_WORLD), "MPI_Bcast"); };
      case Op::gather:
        return [=] { check(MPI_Gather(v.in, block, dt, v.out, block, dt, root, MPI_COMM_WORLD), "MPI_Gather"); };
      case Op::reduce:
        return [=] {
          const void* in = v.in == v.out ? (rank == root ? MPI_IN_PLACE : v.in) : v.in;
          check(MPI_Reduce(in, v.out, count, dt, mop, root, MPI_COMM_WORLD), "MPI_Reduce");
        };
      case Op::scatter:
        return [=] {
          void* out = rank == root && v.out == v.in + static_cast<std::size_t>(rank) * l.block ? MPI_IN_PLACE : v.out;
          check(MPI_Scatter(v.in, block, dt, out, block, dt, root, MPI_COMM_WORLD), "MPI_Scatter");
        };
      case Op::all_to_all:
        return [=] { check(MPI_Alltoall(v.in, block, dt, v.out, block, dt, MPI_COMM_WORLD), "MPI_Alltoall"); };
      case Op::all_to_all_v: {
        // MPI takes int counts and displacements (packed in rank order, as comm's).
        auto c = std::make_shared<std::vector<int>>(4 * static_cast<std::size_t>(n));
        int* sc = c->data();
        int *sd = sc + n, *rc = sd + n, *rd = rc + n;
        for (int p = 0, so = 0, ro = 0; p < n; ++p) {
          sc[p] = static_cast<int>(v.in_counts[static_cast<std::size_t>(p)]);
          rc[p] = static_cast<int>(v.out_counts[static_cast<std::size_t>(p)]);
          sd[p] = so;
          rd[p] = ro;
          so += sc[p];
          ro += rc[p];
        }
        return [=] {
          check(MPI_Alltoallv(v.in, sc, sd, dt, v.out, rc, rd, dt, MPI_COMM_WORLD), "MPI_Alltoallv");
          (void)c;
        };
      }
      case Op::send_recv:
        return [=] {
          if (v.peer < 0) return;
          if (rank < v.peer) {
            check(MPI_Send(v.in, count, dt, v.peer, 0, MPI_COMM_WORLD), "MPI_Send");
            check(MPI_Recv(v.out, count, dt, v.peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE), "MPI_Recv");
          } else {
            check(MPI_Recv(v.out, count, dt, v.peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE), "MPI_Recv");
            check(MPI_Send(v.in, count, dt, v.peer, 0, MPI_COMM_WORLD), "MPI_Send");
          }
        };
      case Op::barrier: return [] { check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier"); };
    }
    return {};
  };
  return run_peer(o, rank, n, x, s);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  Options o;
  std::string system = "mpi";
  int rc = 0;
  try {
    const Program p{"comm-bench-mpi-peer", std::string(kAbout), std::string(kCommonFooter) + std::string(kFooter)};
    if (const auto code = parse_peer_args(argc, argv, o, p, system)) {
      MPI_Finalize();
      return *code;
    }
    CrossRank x;
    x.max = [](std::span<double> v) {
      check(MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD),
            "MPI_Allreduce");
    };
    x.sum = [](std::span<double> v) {
      check(MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD),
            "MPI_Allreduce");
    };
    long wrong = 0;
    const bool known = with_dtype(o.dtype, [&](auto t) { wrong = run_dtype<decltype(t)>(o, rank, n, x, system); });
    if (!known) throw std::invalid_argument("unknown --dtype '" + o.dtype + "'");
    report_peak_rss(o, rank, n, x, system);
    // Every rank holds the same sum: all exit 1 together (MPI_Abort would cut the output short).
    if (wrong > 0) {
      if (rank == 0) std::fprintf(stderr, "comm-bench-mpi-peer: %ld wrong elements\n", wrong);
      MPI_Finalize();
      return 1;
    }
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "comm-bench-mpi-peer: %s\n", e.what());
    rc = 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "comm-bench-mpi-peer: %s\n", e.what());
    rc = 1;
  }
  if (rc != 0) MPI_Abort(MPI_COMM_WORLD, rc);
  MPI_Finalize();
  return rc;
}
