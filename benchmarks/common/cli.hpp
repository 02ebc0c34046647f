#pragma once
// The command line shared by comm-bench and the C++ peers (nccl-tests spelling where one exists).

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "bench.hpp"

namespace comm::bench {

struct Options {
  std::vector<Op> ops{Op::all_reduce};
  std::string backend = "gloo";
  std::string dtype = "float";
  std::string redop = "sum";
  int root = 0;
  std::size_t min_bytes = 8, max_bytes = std::size_t{64} << 20, factor = 4;
  std::string sizes;  ///< explicit list, overrides -b/-e/-f
  int iters = 20, warmup = 5, min_iters = 5;
  double budget_s = 0;  ///< per size and system; 0: always `iters`
  bool check = false;
  bool json = false;
  int placement = -1;  ///< -1: per-op default (all_reduce in place, others out of place), 0 out, 1 in
  std::string baseline;  ///< "", "raw" or "raw-nb" (mpi: the non-blocking call)
  std::string algo;      ///< algorithm variant (raw gloo prototypes, see --help)
  bool async = false;    ///< comm: time the comm::async form (+ Work::wait)
  int gap_us = 0;        ///< sleep between timed calls (not timed)
};

/// In place by default for all_reduce only, like torch.distributed's API.
[[nodiscard]] inline bool in_place(const Options& o, Op op) {
  if (o.placement >= 0) return o.placement == 1;
  return op == Op::all_reduce;
}

inline constexpr std::string_view kCommonHelp =
    R"(  --op OPS          all_reduce|reduce_scatter|all_gather|broadcast|gather, a comma list, or all
                    (default all_reduce)
  --dtype T         float|double|half|bfloat16|float8_e4m3|float8_e5m2|int8|uint8|int32|uint32|int64|uint64
                    (default float; fp8 also as fp8_e4m3/e4m3, fp8_e5m2/e5m2)
  --redop R         sum|prod|min|max|avg|band|bor|bxor (default sum)
  --root R          root of broadcast and gather (default 0)
  -b, --minbytes N  smallest size (default 8); K, M, G suffixes are binary
  -e, --maxbytes N  largest size (default 64M)
  -f, --stepfactor F  multiply the size by F (default 4)
  --sizes LIST      explicit sizes, e.g. 8,1K,1M,64M (overrides -b/-e/-f)
  -n, --iters N     timed iterations per size (default 20)
  -w, --warmup N    untimed warm-up iterations per size (default 5)
  --budget S        cut the iterations of a size so that one system spends about S seconds on it,
                    from the warm-up's time (default 0: no cut); never below --min-iters
  --min-iters N     (default 5)
  -c, --check       verify the results once per size and report #wrong (elements, all ranks)
  --json            print JSON lines (schema comm-bench/1) instead of the table
  --inplace / --out-of-place   placement (default: all_reduce in place, the others out of place)
  --gap-us N        sleep N us between calls, outside the timed region (default 0: back to back)
)";

[[nodiscard]] inline std::vector<Op> parse_ops(std::string_view s) {
  std::vector<Op> out;
  if (s == "all") return {std::begin(kAllOps), std::end(kAllOps)};
  while (!s.empty()) {
    const auto comma = s.find(',');
    const auto item = s.substr(0, comma);
    auto op = parse_op(item);
    if (!op) throw std::invalid_argument("unknown op '" + std::string(item) + "'");
    out.push_back(*op);
    if (comma == std::string_view::npos) break;
    s.remove_prefix(comma + 1);
  }
  return out;
}

[[nodiscard]] inline int parse_int(std::string_view flag, std::string_view v, int lo) {
  try {
    std::size_t pos = 0;
    const int x = std::stoi(std::string(v), &pos);
    if (pos != v.size() || x < lo) throw std::invalid_argument("");
    return x;
  } catch (...) {
    throw std::invalid_argument(std::string(flag) + " needs an integer >= " + std::to_string(lo) + ", got '" +
                                std::string(v) + "'");
  }
}

/// Parses argv into `o`. `extra(flag, next)` handles program-specific flags: it returns how many
/// arguments it consumed (0: unknown flag). Throws std::invalid_argument with a message.
template <class Extra>
void parse_args(int argc, char** argv, Options& o, std::string_view help, Extra&& extra) {
  std::vector<std::string_view> a(argv + 1, argv + argc);
  for (std::size_t i = 0; i < a.size(); ++i) {
    std::string_view f = a[i];
    std::string inline_value;
    bool has_inline = false;
    if (f.starts_with("--")) {
      if (auto eq = f.find('='); eq != std::string_view::npos) {
        inline_value = std::string(f.substr(eq + 1));
        f = f.substr(0, eq);
        has_inline = true;
      }
    }
    auto value = [&]() -> std::string_view {
      if (has_inline) return inline_value;
      if (i + 1 >= a.size()) throw std::invalid_argument(std::string(f) + " needs a value");
      return a[++i];
    };
    if (f == "-h" || f == "--help") {
      std::fputs(help.data(), stdout);
      std::fputs(kCommonHelp.data(), stdout);
      std::exit(0);
    } else if (f == "--op" || f == "-o") {
      o.ops = parse_ops(value());
    } else if (f == "--backend") {
      o.backend = value();
    } else if (f == "--dtype" || f == "-d") {
      o.dtype = value();
    } else if (f == "--redop") {
      o.redop = value();
    } else if (f == "--root" || f == "-r") {
      o.root = parse_int(f, value(), 0);
    } else if (f == "-b" || f == "--minbytes") {
      o.min_bytes = parse_bytes(value());
    } else if (f == "-e" || f == "--maxbytes") {
      o.max_bytes = parse_bytes(value());
    } else if (f == "-f" || f == "--stepfactor") {
      o.factor = static_cast<std::size_t>(parse_int(f, value(), 2));
    } else if (f == "--sizes") {
      o.sizes = value();
    } else if (f == "-n" || f == "--iters") {
      o.iters = parse_int(f, value(), 1);
    } else if (f == "-w" || f == "--warmup") {
      o.warmup = parse_int(f, value(), 0);
    } else if (f == "--min-iters") {
      o.min_iters = parse_int(f, value(), 1);
    } else if (f == "--budget") {
      o.budget_s = std::stod(std::string(value()));
    } else if (f == "-c" || f == "--check") {
      o.check = true;
    } else if (f == "--json") {
      o.json = true;
    } else if (f == "--inplace") {
      o.placement = 1;
    } else if (f == "--out-of-place") {
      o.placement = 0;
    } else if (f == "--baseline") {
      o.baseline = value();
      if (o.baseline != "raw" && o.baseline != "raw-nb")
        throw std::invalid_argument("--baseline takes 'raw' (or, for --backend mpi, 'raw-nb')");
    } else if (f == "--algo") {
      o.algo = value();
    } else if (f == "--gap-us") {
      o.gap_us = parse_int(f, value(), 0);
    } else if (f == "--async") {
      o.async = true;
    } else {
      const std::string_view next = i + 1 < a.size() ? a[i + 1] : std::string_view{};
      const int used = extra(f, next);
      if (used == 0) throw std::invalid_argument("unknown option '" + std::string(f) + "' (see --help)");
      i += static_cast<std::size_t>(used - 1);
    }
  }
  (void)size_list(o.min_bytes, o.max_bytes, o.factor, o.sizes);  // validate now
}

}  // namespace comm::bench
