// Raw Gloo peer of benchmarks/compare: the collectives called straight on libgloo, same command
// line, methodology and JSON lines as comm-bench. comm is used only to read the launcher's
// environment and for the rendezvous store (comm::TcpStore); no comm code runs in a timed call.
//
//   comm-run -n 2 comm-bench-gloo-peer --op all_reduce --sizes 8,1M --json [--algo ring|bcube|...]

#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <comm/init.hpp>

#include "../common/bench.hpp"
#include "../common/cli.hpp"
#include "../common/data.hpp"
#include "../common/harness.hpp"
#include "../common/raw_gloo.hpp"
#include "../common/views.hpp"

namespace {

using namespace comm::bench;

constexpr std::string_view kHelp =
    R"(Usage: comm-run -n N comm-bench-gloo-peer [options]

Raw Gloo collectives (gloo::allreduce, allgather, broadcast, gather, ReduceScatterHalvingDoubling).
  --algo A   all_reduce ring|bcube|hd|oldring|direct|rd, reduce_scatter hd|allreduce
  --system NAME   the "system" field of the JSON lines (default gloo-raw)
)";

template <class T>
void run_dtype(const Options& o, RawGloo<T>& g, const CrossRank& x, const std::string& system) {
  const auto redop_opt = parse_redop(o.redop);
  if (!redop_opt) throw std::invalid_argument("unknown --redop '" + o.redop + "'");
  const auto redop = *redop_opt;
  const auto sizes = size_list(o.min_bytes, o.max_bytes, o.factor, o.sizes);
  const int rank = g.rank(), n = g.size();
  for (Op op : o.ops) {
    const bool inplace = in_place(o, op);
    Buffers<T> bufs;
    bufs.reserve(op, sizes, n, inplace);
    const std::string algo = o.algo.empty() ? (op == Op::all_reduce ? "ring" : op == Op::reduce_scatter ? "hd" : "")
                                            : o.algo;
    if (rank == 0 && !o.json) {
      std::printf("# gloo-raw %s: world %d, dtype %s, algo %s\n", std::string(to_string(op)).c_str(), n,
                  std::string(dtype_name<T>()).c_str(), algo.empty() ? "default" : algo.c_str());
      print_table_header(o.check, false);
    }
    for (std::size_t bytes : sizes) {
      const Layout l = layout(op, bytes, sizeof(T), n);
      const View<T> v = view(bufs, op, l, inplace, rank, o.root);
      std::vector<Candidate> c(1);
      c[0].call = [&] {
        switch (op) {
          case Op::all_reduce: g.all_reduce(v.in, v.out, l.count, redop, algo); break;
          case Op::reduce_scatter: g.reduce_scatter(v.in, v.out, l.block, redop, algo); break;
          case Op::all_gather: g.all_gather(v.in, v.out, l.block); break;
          case Op::broadcast: g.broadcast(v.out, l.count, o.root); break;
          case Op::gather: g.gather(v.in, v.out, l.block, o.root); break;
        }
      };
      c[0].fill = [&] { fill_view(v, op, rank); };
      c[0].verify = [&] { return verify_view(v, op, redop, l, rank, n, o.root); };
      const Measured m = measure(o, c, x);
      g.clear_persistent();
      Row r;
      r.system = system;
      r.algo = algo;
      r.op = op;
      r.dtype = std::string(dtype_name<T>());
      r.redop = is_reduction(op) ? o.redop : "none";
      r.root = is_rooted(op) ? o.root : -1;
      r.world = n;
      r.placement = inplace ? "in" : "out";
      r.l = l;
      r.iters = m.iters;
      r.t = m.t[0];
      r.wrong = m.wrong[0];
      if (rank == 0) {
        if (o.json)
          print_json(r);
        else
          print_table_row(r, nullptr);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  std::string system = "gloo-raw";
  try {
    parse_args(argc, argv, o, kHelp, [&](std::string_view f, std::string_view next) {
      if (f == "--system" && !next.empty()) {
        system = next;
        return 2;
      }
      return 0;
    });
    comm::InitResult init = comm::init_env();
    const auto timeout = comm::timeout_from_env();
    auto ctx = make_raw_context(init.store, init.rank, init.size, "gloo-peer/", timeout);
    CrossRank x;
    RawGloo<double> reducer(ctx, timeout);
    x.max = [&](std::span<double> v) { reducer.all_reduce(v.data(), v.data(), v.size(), comm::ReduceOp::max, "ring"); };
    x.sum = [&](std::span<double> v) { reducer.all_reduce(v.data(), v.data(), v.size(), comm::ReduceOp::sum, "ring"); };
    bool known = with_dtype(o.dtype, [&](auto t) {
      using T = decltype(t);
      if constexpr (raw_supported_v<T>) {
        RawGloo<T> g(ctx, timeout);
        run_dtype<T>(o, g, x, system);
      } else {
        throw std::invalid_argument("gloo has no " + std::string(dtype_name<T>()) + " type");
      }
    });
    if (!known) throw std::invalid_argument("unknown --dtype '" + o.dtype + "'");
    std::vector<double> rss(static_cast<std::size_t>(init.size), 0.0);
    rss[static_cast<std::size_t>(init.rank)] = static_cast<double>(peak_rss_kb());
    x.max(rss);
    if (init.rank == 0 && o.json) print_json_memory(system, init.size, std::vector<long>(rss.begin(), rss.end()));
    reducer.barrier();
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "comm-bench-gloo-peer: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "comm-bench-gloo-peer: %s\n", e.what());
    return 1;
  }
  return 0;
}
