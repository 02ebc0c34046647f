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
#include "../common/peer.hpp"
#include "../common/raw_gloo.hpp"
#include "../common/views.hpp"

namespace {

using namespace comm::bench;

constexpr std::string_view kAbout =
    R"(Raw Gloo for every op of comm-bench (gloo::allreduce, ReduceScatterHalvingDoubling, allgather,
broadcast, gather, reduce, scatter, alltoall, alltoallv, an unbound-buffer ping-pong, barrier), timed
like comm-bench (same buffers, checks and rows); start it with comm-run -n N.)";

constexpr std::string_view kFooter = R"(
Examples:
  comm-run -n 2 comm-bench-gloo-peer --op all_reduce --sizes 8,1M --json --algo bcube
  comm-run -n 4 comm-bench-gloo-peer --op all -c 1
)";

template <class T>
long run_dtype(const Options& o, RawGloo<T>& g, const CrossRank& x, const std::string& system) {
  const auto redop = parse_redop(o.redop).value_or(comm::ReduceOp::sum);  // run_peer rejects a bad name
  PeerSystem<T> s;
  s.name = system;
  s.algo = [&](Op op) { return o.algo.empty() ? raw_default_algo(op) : o.algo; };
  s.call = [&](Op op, const View<T>& v, const Layout& l) -> std::function<void()> {
    const std::string algo = s.algo(op);
    switch (op) {
      case Op::all_reduce: return [&g, v, l, redop, algo] { g.all_reduce(v.in, v.out, l.count, redop, algo); };
      case Op::reduce_scatter: return [&g, v, l, redop, algo] { g.reduce_scatter(v.in, v.out, l.block, redop, algo); };
      case Op::all_gather: return [&g, v, l] { g.all_gather(v.in, v.out, l.block); };
      case Op::broadcast: return [&g, v, l, root = o.root] { g.broadcast(v.out, l.count, root); };
      case Op::gather: return [&g, v, l, root = o.root] { g.gather(v.in, v.out, l.block, root); };
      case Op::reduce: return [&g, v, l, redop, root = o.root] { g.reduce(v.in, v.out, l.count, redop, root); };
      case Op::scatter: return [&g, v, l, root = o.root] { g.scatter(v.in, v.out, l.block, root); };
      case Op::all_to_all: return [&g, v, l] { g.all_to_all(v.in, v.out, l.block); };
      case Op::all_to_all_v: return [&g, v] { g.all_to_all_v(v.in, v.in_counts, v.out, v.out_counts); };
      case Op::send_recv: return [&g, v, l] { g.ping_pong(v.in, v.out, l.count, v.peer); };
      case Op::barrier: return [&g] { g.barrier(); };
    }
    return {};
  };
  s.after_size = [&g] { g.clear_persistent(); };
  s.supports = [&o](Op op) { return !(op == Op::scatter && in_place(o, op)); };  // gloo: no scatter in place
  return run_peer(o, g.rank(), g.size(), x, s);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  std::string system = "gloo-raw";
  try {
    const Program p{"comm-bench-gloo-peer", std::string(kAbout), std::string(kCommonFooter) + std::string(kFooter)};
    if (const auto code = parse_peer_args(argc, argv, o, p, system)) return *code;
    comm::InitResult init = comm::init_env();
    const auto timeout = comm::timeout_from_env();
    auto ctx = make_raw_context(init.store, init.rank, init.size, "gloo-peer/", timeout);
    CrossRank x;
    RawGloo<double> reducer(ctx, timeout);
    x.max = [&](std::span<double> v) { reducer.all_reduce(v.data(), v.data(), v.size(), comm::ReduceOp::max, "ring"); };
    x.sum = [&](std::span<double> v) { reducer.all_reduce(v.data(), v.data(), v.size(), comm::ReduceOp::sum, "ring"); };
    long wrong = 0;
    bool known = with_dtype(o.dtype, [&](auto t) {
      using T = decltype(t);
      if constexpr (raw_supported_v<T>) {
        RawGloo<T> g(ctx, timeout);
        wrong = run_dtype<T>(o, g, x, system);
      } else {
        throw std::invalid_argument("gloo has no " + std::string(dtype_name<T>()) + " type");
      }
    });
    if (!known) throw std::invalid_argument("unknown --dtype '" + o.dtype + "'");
    report_peak_rss(o, init.rank, init.size, x, system);
    reducer.barrier();
    if (wrong > 0) {
      if (init.rank == 0) std::fprintf(stderr, "comm-bench-gloo-peer: %ld wrong elements\n", wrong);
      return 1;
    }
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "comm-bench-gloo-peer: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "comm-bench-gloo-peer: %s\n", e.what());
    return 1;
  }
  return 0;
}
