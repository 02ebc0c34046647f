// comm-bench: nccl-tests-style benchmark of every comm operation.
//
//   comm-run -n 4 comm-bench --op all -b 8 -e 64M -f 4 -c 1 [--json] [--baseline raw]
//
// One row per size: size, count, type, redop, root, time (us, median over iterations of the max
// over ranks), algbw, busbw (nccl-tests factors, see common/bench.hpp), #wrong. With
// `--baseline raw` the same processes also run the raw engine call (gloo::allreduce...) on their
// own gloo context, alternating with comm's call every iteration, and the table gains the raw
// time and the comm/raw ratio.

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <comm/comm.hpp>

#include "common/bench.hpp"
#include "common/cli.hpp"
#include "common/data.hpp"
#include "common/harness.hpp"
#include "common/raw_gloo.hpp"
#include "common/views.hpp"
#if defined(COMM_HAS_NCCL)
#include "common/nccl_rows.hpp"
#endif
#if defined(COMM_HAS_MPI)
#include "common/mpi_rows.hpp"
#endif

namespace {

using namespace comm::bench;
using GlooComm = comm::Communicator<comm::backends::Gloo>;
using ShmComm = comm::Communicator<comm::backends::Shm>;
using HierComm = comm::Communicator<comm::backends::Hierarchical<comm::backends::Shm, comm::backends::Gloo>>;

constexpr std::string_view kAbout =
    R"(nccl-tests-style benchmark of every comm operation (rank 0 prints): all_reduce, reduce_scatter,
all_gather, broadcast, gather, reduce, scatter, all_to_all, all_to_all_v, send_recv (ping-pong) and
barrier, on the Gloo, Shm, Hierarchical, Mpi and NCCL backends. Start it under a launcher:
comm-run -n N comm-bench [OPTIONS] (torchrun, srun work too; --backend mpi: mpirun -np N comm-bench ...).)";

constexpr std::string_view kFooter =
    R"(
Baselines (--baseline raw, same processes, calls alternating with comm's): gloo: raw Gloo on its own
context (every op; --algo picks all_reduce's and reduce_scatter's algorithm); nccl: the raw NCCL call on the same
ncclComm_t and stream; mpi: the blocking MPI call on an MPI_Comm_dup (raw-nb: the non-blocking call +
MPI_Test). An op the baseline lacks runs comm alone.
--backend nccl needs a build with COMM_HAS_NCCL, one GPU per rank; each timed call includes
cudaStreamSynchronize. --backend mpi needs COMM_HAS_MPI and mpirun (comm-bench adopts MPI_COMM_WORLD).
Environment: COMM_BENCH_LOOP_NICE=N runs the gloo event-loop threads at nice N (see RESULTS.md).

Examples:
  comm-run -n 4 comm-bench --op all -b 8 -e 1M -f 4 -c 1          every op, verified
  comm-run -n 2 comm-bench --op all_reduce -o max -d int32 -n 50    max of int32, 50 iterations
  comm-run -n 2 comm-bench --op send_recv -b 8 -e 64M -f 8         ping-pong latency and bandwidth
  comm-run -n 4 comm-bench --backend shm --op all_to_all,barrier -z 0 --json
  comm-run -n 2 comm-bench --baseline raw --budget 2s --sizes 8,1M,64M
  mpirun -np 2 --mca btl self,vader comm-bench --backend mpi --baseline raw-nb -c 1
)";

/// The comm call of `op` on view `v`: the blocking form, or the async form followed by wait().
// noinline: benchmarks/profile-overhead counts instructions inside these two functions.
template <class T, class C>
[[gnu::noinline]] void comm_call(C& c, Op op, const View<T>& v, comm::ReduceOp redop, int root, bool async) {
  if (async)
    async_call(c, op, v, redop, root);
  else
    blocking_call(c, op, v, redop, root);
}

template <class T>
[[gnu::noinline]] void raw_call(RawGloo<T>& g, Op op, const View<T>& v, const Layout& l, comm::ReduceOp redop, int root,
              const std::string& algo) {
  switch (op) {
    case Op::all_reduce: g.all_reduce(v.in, v.out, l.count, redop, algo); break;
    case Op::reduce_scatter: g.reduce_scatter(v.in, v.out, l.block, redop, algo); break;
    case Op::all_gather: g.all_gather(v.in, v.out, l.block); break;
    case Op::broadcast: g.broadcast(v.out, l.count, root); break;
    case Op::gather: g.gather(v.in, v.out, l.block, root); break;
    case Op::reduce: g.reduce(v.in, v.out, l.count, redop, root); break;
    case Op::scatter: g.scatter(v.in, v.out, l.block, root); break;
    case Op::all_to_all: g.all_to_all(v.in, v.out, l.block); break;
    case Op::all_to_all_v: g.all_to_all_v(v.in, v.in_counts, v.out, v.out_counts); break;
    case Op::send_recv: g.ping_pong(v.in, v.out, l.count, v.peer); break;
    case Op::barrier: g.barrier(); break;
  }
}

/// The ops the raw Gloo baseline times: all of them (gloo::reduce, scatter, alltoall(v), an
/// unbound-buffer ping-pong, barrier), except a scatter in place, which gloo cannot express.
[[nodiscard]] constexpr bool raw_has(Op op, bool inplace) noexcept { return !(op == Op::scatter && inplace); }

template <class C>
struct Context {
  const Options& o;
  long wrong = 0;  // summed over every row: comm-bench --check exits 1 when it is not 0
  int rank, size;
  C& c;
  std::shared_ptr<::gloo::Context> raw_ctx;  // null without --baseline raw
  CrossRank x;
};

template <class T, class C>
void run_dtype(Context<C>& ctx) {
  const Options& o = ctx.o;
  const auto redop_opt = parse_redop(o.redop);
  if (!redop_opt) throw std::invalid_argument("unknown --redop '" + o.redop + "'");
  const comm::ReduceOp redop = *redop_opt;
  std::optional<RawGloo<T>> raw;
  if (ctx.raw_ctx) {
    if constexpr (raw_supported_v<T>)
      raw.emplace(ctx.raw_ctx, ctx.c.backend().timeout());
    else
      throw std::invalid_argument("--baseline raw: gloo has no " + std::string(dtype_name<T>()) + " type");
  }
  const std::string backend(C::backend_type::name);
  const std::string system = "comm-" + backend + (o.async ? "-async" : "");

  for (Op op : o.ops) {
    const auto sizes = sizes_for(o, op);
    const bool inplace = in_place(o, op);
    const bool with_raw = raw.has_value() && raw_has(op, inplace);
    if (op == Op::send_recv && ctx.size < 2)
      throw std::invalid_argument("--op send_recv needs at least 2 ranks (the world is " + std::to_string(ctx.size) + ")");
    if (is_rooted(op) && o.root >= ctx.size)
      throw std::invalid_argument("--root " + std::to_string(o.root) + " is not below the world size " +
                                  std::to_string(ctx.size));
    Buffers<T> bufs;
    bufs.reserve(op, sizes, ctx.size, inplace, place_of(o.offset, ctx.rank));
    if (ctx.rank == 0) {
      if (!o.json) {
        std::printf("# comm-bench %s: backend %s, world %d, dtype %s, redop %s, %s, iters %d (min %d, budget %gs), "
                    "warmup %d%s%s\n",
                    std::string(to_string(op)).c_str(), backend.c_str(), ctx.size, std::string(dtype_name<T>()).c_str(),
                    is_reduction(op) ? o.redop.c_str() : "none", inplace ? "in place" : "out of place", o.iters,
                    o.min_iters, o.budget_s, o.warmup, with_raw ? ", baseline raw gloo" : "",
                    o.async ? ", async form" : "");
        if (with_raw)
          std::printf("# raw algorithm: %s\n", (o.algo.empty() ? raw_default_algo(op) : o.algo).c_str());
        else if (raw)
          std::printf("# raw gloo has no %s: comm alone\n", std::string(to_string(op)).c_str());
        print_table_header(o.check, with_raw);
      }
    }
    for (std::size_t bytes : sizes) {
      const Layout l = layout(op, bytes, sizeof(T), ctx.size);
      const View<T> v = view(bufs, op, l, inplace, ctx.rank, o.root);
      std::vector<Candidate> cands;
      cands.push_back({[&] { comm_call<T>(ctx.c, op, v, redop, o.root, o.async); },
                       [&] { fill_view(v, op, ctx.rank); },
                       [&] { return verify_view(v, op, redop, l, ctx.rank, ctx.size, o.root); }});
      if (with_raw) {
        if constexpr (raw_supported_v<T>) {
          cands.push_back({[&] { raw_call<T>(*raw, op, v, l, redop, o.root, o.algo); },
                           [&] { fill_view(v, op, ctx.rank); },
                           [&] { return verify_view(v, op, redop, l, ctx.rank, ctx.size, o.root); }});
        }
      }
      const Measured m = measure(o, cands, ctx.x);
      if (raw) raw->clear_persistent();

      ctx.wrong += report(o, ctx.rank, ctx.size, op, std::string(dtype_name<T>()), inplace, l, m,
                          {system, "", with_raw ? "gloo-raw" : "", o.algo.empty() ? raw_default_algo(op) : o.algo});
    }
  }
}

template <class C>
int run_world(const Options& o, const comm::InitResult& init, C& c, std::shared_ptr<::gloo::Context> raw_ctx);

int run(const Options& o) {
  if (o.backend == "nccl") {
#if defined(COMM_HAS_NCCL)
    if (const auto dc = comm::nccl::device_count(); dc.count < 1) {
      std::fprintf(stderr, "comm-bench: --backend nccl: no usable CUDA device on this machine (%s)\n", dc.why.c_str());
      return 2;
    }
    return run_nccl(o);
#else
    std::fprintf(stderr,
                 "comm-bench: --backend nccl: this build has no NCCL backend (COMM_HAS_NCCL is not defined: CUDA and "
                 "NCCL were not found when comm was configured); use --backend gloo\n");
#endif
    return 2;
  }
  if (o.backend == "mpi") {
#if defined(COMM_HAS_MPI)
    return run_mpi(o);
#else
    std::fprintf(stderr,
                 "comm-bench: --backend mpi: this build has no MPI backend (COMM_HAS_MPI is not defined: no MPI "
                 "library was found when comm was configured; apt-get install libopenmpi-dev)\n");
    return 2;
#endif
  }
  if (o.baseline == "raw-nb") throw std::invalid_argument("--baseline raw-nb is for --backend mpi");
  if (o.backend == "shm") {
    if (o.baseline == "raw") throw std::invalid_argument("--baseline raw: Shm's baseline is the OpenMPI peer");
    comm::InitResult init = comm::init_env();
    ShmComm c = ShmComm::create(init.store, init.rank, init.size);
    return run_world(o, init, c, nullptr);
  }
  if (o.backend == "hierarchical") {
    if (o.baseline == "raw") throw std::invalid_argument("--baseline raw: compare hierarchical with --backend gloo");
    comm::InitResult init = comm::init_env();
    HierComm c = HierComm::create(init.store, init.rank, init.size);
    return run_world(o, init, c, nullptr);
  }
  if (o.backend != "gloo") {
    std::fprintf(stderr, "comm-bench: unknown --backend '%s' (gloo|shm|hierarchical|nccl|mpi)\n", o.backend.c_str());
    return 2;
  }

  comm::InitResult init = comm::init_env();
  // COMM_BENCH_LOOP_NICE (prototype, see raw_gloo.hpp make_device): create the communicator on a
  // helper thread at that nice value, so that gloo's event-loop thread inherits it.
  const int loop_nice = loop_nice_from_env();
  std::optional<GlooComm> made;
  if (loop_nice == 0) {
    made.emplace(GlooComm::create(init.store, init.rank, init.size));
  } else {
    std::exception_ptr err;
    std::thread t([&] {
      ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), loop_nice);
      try {
        made.emplace(GlooComm::create(init.store, init.rank, init.size));
      } catch (...) {
        err = std::current_exception();
      }
    });
    t.join();
    if (err) std::rethrow_exception(err);
  }
  GlooComm& c = *made;
  std::shared_ptr<::gloo::Context> raw_ctx;
  if (o.baseline == "raw") raw_ctx = make_raw_context(init.store, init.rank, init.size, "comm-bench/raw/", c.backend().timeout());
  return run_world(o, init, c, std::move(raw_ctx));
}

/// Every op, dtype and size of the command line on communicator `c` (any host backend).
template <class C>
int run_world(const Options& o, const comm::InitResult& init, C& c, std::shared_ptr<::gloo::Context> raw_ctx) {
  Context<C> ctx{o, 0, init.rank, init.size, c, std::move(raw_ctx), {}};
  ctx.x.max = [&](std::span<double> v) { c.all_reduce(v, comm::ReduceOp::max); };
  ctx.x.sum = [&](std::span<double> v) { c.all_reduce(v, comm::ReduceOp::sum); };

  const bool known = with_dtype(o.dtype, [&](auto t) { run_dtype<decltype(t), C>(ctx); });
  if (!known) throw std::invalid_argument("unknown --dtype '" + o.dtype + "'");

  // Peak RSS of every rank.
  std::vector<double> rss(static_cast<std::size_t>(init.size), 0.0);
  rss[static_cast<std::size_t>(init.rank)] = static_cast<double>(peak_rss_kb());
  ctx.x.max(rss);
  std::vector<long> rss_kb(rss.begin(), rss.end());
  if (init.rank == 0) {
    if (o.json) {
      print_json_memory("comm-" + std::string(C::backend_type::name) + (o.async ? "-async" : ""), init.size, rss_kb);
    } else {
      std::printf("# peak RSS per rank (KiB):");
      for (long k : rss_kb) std::printf(" %ld", k);
      std::printf("\n");
    }
  }
  c.barrier();
  if (ctx.wrong > 0) {
    if (init.rank == 0) std::fprintf(stderr, "comm-bench: --check found %ld wrong elements\n", ctx.wrong);
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  const Program p{"comm-bench", std::string(kAbout), std::string(kCommonFooter) + std::string(kFooter)};
  if (const auto rc = parse_args(argc, argv, o, p, [](CLI::App&) {})) return *rc;
  try {
    return run(o);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "comm-bench: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "comm-bench: %s\n", e.what());
    return 1;
  }
}
