#pragma once
// The loop of a peer program (raw Gloo, OpenMPI): every op and size of the command line timed on
// one system, with comm-bench's buffers, checks and rows, so that only the timed call differs.

#include <cstddef>
#include <cstdio>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "bench.hpp"
#include "cli.hpp"
#include "harness.hpp"
#include "views.hpp"

namespace comm::bench {

template <class T>
struct PeerSystem {
  std::string name;  ///< the rows' "system"
  /// The timed call of `op` on view `v` (made once per size, outside the timing).
  std::function<std::function<void()>(Op op, const View<T>& v, const Layout& l)> call;
  /// The algorithm label of `op` (optional).
  std::function<std::string(Op)> algo;
  /// Runs after each size is measured (optional), e.g. to release per-size engine state.
  std::function<void()> after_size;
  /// Whether the system has `op` (optional: every op).
  std::function<bool(Op)> supports;
};

/// Returns the wrong elements counted over every op and size (summed over ranks; 0 unchecked), so
/// that a peer exits 1 on a wrong result as `comm-bench -c 1` does.
template <class T>
long run_peer(const Options& o, int rank, int n, const CrossRank& x, const PeerSystem<T>& s) {
  const auto redop = parse_redop(o.redop);
  if (!redop) throw std::invalid_argument("unknown --redop '" + o.redop + "'");
  for (Op op : o.ops) {
    if (s.supports && !s.supports(op))
      throw std::invalid_argument(s.name + " has no " + std::string(to_string(op)) +
                                  (in_place(o, op) ? " in place" : "") + " (comm-bench has)");
  }
  long wrong = 0;
  for (Op op : o.ops) {
    const auto sizes = sizes_for(o, op);
    const bool inplace = in_place(o, op);
    const std::string algo = s.algo ? s.algo(op) : std::string();
    Buffers<T> bufs;
    bufs.reserve(op, sizes, n, inplace, place_of(o.offset, rank));
    if (rank == 0 && !o.json) {
      std::printf("# %s %s: world %d, dtype %s%s%s\n", s.name.c_str(), std::string(to_string(op)).c_str(), n,
                  std::string(dtype_name<T>()).c_str(), algo.empty() ? "" : ", algo ", algo.c_str());
      print_table_header(o.check, false);
    }
    for (std::size_t bytes : sizes) {
      const Layout l = layout(op, bytes, sizeof(T), n);
      const View<T> v = view(bufs, op, l, inplace, rank, o.root);
      std::vector<Candidate> c(1);
      c[0].call = s.call(op, v, l);
      c[0].fill = [&] { fill_view(v, op, rank); };
      c[0].verify = [&] { return verify_view(v, op, *redop, l, rank, n, o.root); };
      const Measured m = measure(o, c, x);
      if (s.after_size) s.after_size();
      wrong += report(o, rank, n, op, std::string(dtype_name<T>()), inplace, l, m, {s.name, algo, "", ""});
    }
  }
  return wrong;
}

/// A peer's command line: comm-bench's options plus `--system NAME` (the rows' "system"). Returns
/// nullopt to go on, or the exit code to return now (see parse_args).
[[nodiscard]] inline std::optional<int> parse_peer_args(int argc, char** argv, Options& o, const Program& p,
                                                        std::string& system) {
  return parse_args(argc, argv, o, p, [&](CLI::App& app) {
    app.add_option("--system", system, "the \"system\" field of the rows and JSON lines")->capture_default_str();
  });
}

/// Prints (rank 0, JSON only) every rank's peak RSS, gathered with `x.max`.
inline void report_peak_rss(const Options& o, int rank, int n, const CrossRank& x, const std::string& system) {
  std::vector<double> rss(static_cast<std::size_t>(n), 0.0);
  rss[static_cast<std::size_t>(rank)] = static_cast<double>(peak_rss_kb());
  x.max(rss);
  if (rank == 0 && o.json) print_json_memory(system, n, std::vector<long>(rss.begin(), rss.end()));
}

}  // namespace comm::bench
