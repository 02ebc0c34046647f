#pragma once
// The command line shared by comm-bench and the C++ peers, parsed with CLI11. Short flags mean what
// nccl-tests' mean (-b -e -f -i -n -w -c -o -d -r -z -T); the collective is the long --op.
// Durations (--budget, --timeout) go through comm's own parser (comm/detail/base/duration.hpp), so
// they read like COMM_TIMEOUT: "1.5" (seconds), "500ms", "2s", "1m".

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>

#include <comm/detail/base/duration.hpp>

#include "bench.hpp"
#include "data.hpp"

#ifndef COMM_BENCH_VERSION
#define COMM_BENCH_VERSION "unknown"
#endif

namespace comm::bench {

struct Options {
  std::vector<Op> ops{Op::all_reduce};
  std::string backend = "gloo";
  std::string dtype = "float";
  std::string redop = "sum";
  int root = 0;
  std::size_t min_bytes = 8, max_bytes = std::size_t{64} << 20, factor = 4;
  std::size_t step_bytes = 0;  ///< -i: add this instead of multiplying by -f (0: multiply)
  std::string sizes;           ///< explicit list, overrides -b/-e/-f/-i
  int iters = 20, warmup = 5, min_iters = 5;
  double budget_s = 0;  ///< per size and system; 0: always `iters`
  bool check = false;
  bool json = false;
  int placement = -1;  ///< -1: per-op default (all_reduce in place, others out of place), 0 out, 1 in
  std::string baseline;  ///< "", "raw" or "raw-nb" (mpi: the non-blocking call)
  std::string algo;      ///< algorithm variant (raw gloo prototypes, see --help)
  bool async = false;    ///< comm: time the comm::async form (+ Work::wait); -z 0
  int gap_us = 0;        ///< sleep between timed calls (not timed)
  std::string offset;    ///< --offset: per-rank buffer placement ("" : where std::vector puts them)
};

/// In place by default for all_reduce only, like torch.distributed's API; never for the ops whose
/// buffers may not alias (all_to_all(_v), send_recv, barrier).
[[nodiscard]] inline bool in_place(const Options& o, Op op) {
  if (!can_be_in_place(op)) return false;
  if (o.placement >= 0) return o.placement == 1;
  return op == Op::all_reduce;
}

/// The sizes one op runs at: barrier moves no data and runs once (size 0).
[[nodiscard]] inline std::vector<std::size_t> sizes_for(const Options& o, Op op) {
  if (op == Op::barrier) return {0};
  return size_list(o.min_bytes, o.max_bytes, o.factor, o.sizes, o.step_bytes);
}

[[nodiscard]] inline std::vector<Op> parse_ops(std::string_view s) {
  std::vector<Op> out;
  if (s == "all") return {std::begin(kAllOps), std::end(kAllOps)};
  while (!s.empty()) {
    const auto comma = s.find(',');
    const auto item = s.substr(0, comma);
    auto op = parse_op(item);
    if (!op) {
      std::string known;
      for (Op k : kAllOps) {
        if (!known.empty()) known += '|';
        known += to_string(k);
      }
      throw std::invalid_argument("unknown op '" + std::string(item) + "' (" + known + ", a comma list, or all)");
    }
    out.push_back(*op);
    if (comma == std::string_view::npos) break;
    s.remove_prefix(comma + 1);
  }
  return out;
}

/// What a program says about itself in --help.
struct Program {
  std::string name;   ///< "comm-bench"
  std::string about;  ///< the paragraph under the usage line
  std::string footer; ///< notes and examples after the options
};

namespace detail {

/// "" (the flag alone), "1" or "0" -> bool, for nccl-tests' -c and -z, which take 0/1.
inline bool zero_one(const std::string& flag, const std::string& v) {
  if (v.empty() || v == "1") return true;
  if (v == "0") return false;
  throw CLI::ValidationError(flag, "takes 0 or 1, got '" + v + "'");
}

inline std::string bytes_check(const std::string& v) {
  try {
    (void)parse_bytes(v);
    return {};
  } catch (const std::exception& e) {
    return e.what() + std::string(" (a byte count: 8, 64K, 1M, 2G)");
  }
}

inline std::string duration_check(const std::string& v) {
  return comm::detail::parse_duration(v) ? std::string()
                                         : "'" + v + "' is not a duration (seconds, or a number with ms, s or m)";
}

}  // namespace detail

/// Parses argv into `o` with CLI11. `extra(app)` adds program-specific options. Returns nullopt to
/// go on, or the exit code to return now: 0 after --help or --version (printed), 2 after a bad
/// command line (the message on stderr names the option and the value).
template <class Extra>
[[nodiscard]] std::optional<int> parse_args(int argc, char** argv, Options& o, const Program& p, Extra&& extra) {
  CLI::App app{p.about, p.name};
  app.set_version_flag("--version", p.name + " " COMM_BENCH_VERSION " (comm's project version)");
  app.footer(p.footer);
  app.get_formatter()->column_width(30);

  std::string ops = "all_reduce", check, blocking, budget, timeout;
  std::string minb = "8", maxb = "64M", stepb;
  std::vector<std::string> redops;
  for (auto r : {comm::ReduceOp::sum, comm::ReduceOp::prod, comm::ReduceOp::min, comm::ReduceOp::max,
                 comm::ReduceOp::avg, comm::ReduceOp::band, comm::ReduceOp::bor, comm::ReduceOp::bxor})
    redops.emplace_back(comm::to_string(r));

  app.add_option("--op", ops,
                 "collective(s): all_reduce|reduce_scatter|all_gather|broadcast|gather|reduce|scatter|all_to_all|"
                 "all_to_all_v|send_recv|barrier, a comma list, or all (nccl-tests' names too: allreduce, "
                 "alltoall, sendrecv...)")
      ->default_str("all_reduce")
      ->check([](const std::string& v) {
        try {
          (void)parse_ops(v);
          return std::string();
        } catch (const std::exception& e) {
          return std::string(e.what());
        }
      });
  app.add_option("--backend", o.backend,
                 "gloo | shm (this host's ranks, shared memory) | hierarchical (Shm within a host, Gloo across) | "
                 "nccl (one GPU per rank) | mpi (under mpirun)")
      ->capture_default_str()
      ->check(CLI::IsMember({"gloo", "shm", "hierarchical", "nccl", "mpi"}));
  app.add_option("-o,--redop", o.redop, "reduction of all_reduce, reduce_scatter and reduce")
      ->capture_default_str()
      ->check(CLI::IsMember(redops));
  app.add_option("-d,--dtype", o.dtype,
                 "float|double|half|bfloat16|float8_e4m3|float8_e5m2|int8|uint8|int32|uint32|int64|uint64 "
                 "(also float32, float16, bf16, f8e4m3/e4m3, f8e5m2/e5m2, int)")
      ->capture_default_str()
      ->check([](const std::string& v) {
        return with_dtype(v, [](auto) {}) ? std::string() : "unknown data type '" + v + "'";
      });
  app.add_option("-r,--root", o.root, "root of broadcast, gather, reduce and scatter")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("-b,--minbytes", minb, "smallest size; K, M, G are binary")
      ->capture_default_str()
      ->check(detail::bytes_check);
  app.add_option("-e,--maxbytes", maxb, "largest size")->capture_default_str()->check(detail::bytes_check);
  auto* f = app.add_option("-f,--stepfactor", o.factor, "multiply the size by this")
                ->capture_default_str()
                ->check(CLI::Range(std::size_t{2}, std::size_t{1} << 20));
  app.add_option("-i,--stepbytes", stepb, "add this to the size instead of multiplying (nccl-tests' -i)")
      ->check(detail::bytes_check)
      ->excludes(f);
  app.add_option("--sizes", o.sizes, "explicit sizes, e.g. 8,1K,1M,64M (overrides -b/-e/-f/-i)")
      ->check([](const std::string& v) {
        try {
          (void)size_list(0, 0, 2, v);
          return std::string();
        } catch (const std::exception& e) {
          return std::string(e.what());
        }
      });
  app.add_option("-n,--iters", o.iters, "timed iterations per size")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("-w,--warmup", o.warmup, "untimed warm-up iterations per size")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--min-iters", o.min_iters, "never fewer iterations than this under --budget")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--budget", budget,
                 "cut a size's iterations so that one system spends about this long on it, from the warm-up's "
                 "time (a duration: 1.5, 500ms, 2s; default: no cut)")
      ->check(detail::duration_check);
  app.add_option("-c,--check", check, "verify every size once and report #wrong (elements, all ranks); exit 1 if any")
      ->expected(0, 1)
      ->check(CLI::IsMember({"", "0", "1"}));
  app.add_option("-z,--blocking", blocking,
                 "1 (default): comm's blocking form; 0: the async form, op(..., comm::async).wait()")
      ->expected(0, 1)
      ->check(CLI::IsMember({"", "0", "1"}));
  app.add_flag("--async", o.async, "the same as -z 0");
  app.add_option("-T,--timeout", timeout,
                 "the communicator's deadline for every operation (sets COMM_TIMEOUT; a duration: 30, 500ms, 2m)")
      ->check(detail::duration_check);
  app.add_flag("--json", o.json, "JSON lines (schema comm-bench/1) instead of the table");
  auto* in = app.add_flag_callback("--inplace", [&] { o.placement = 1; },
                                   "in place (all but all_to_all(_v), send_recv and barrier)");
  auto* out = app.add_flag_callback("--out-of-place", [&] { o.placement = 0; },
                                    "out of place (default: all_reduce in place, the others out of place)");
  in->excludes(out);
  app.add_option("--baseline", o.baseline,
                 "raw: also time the raw engine call in the same processes, alternating with comm's (gloo, nccl, "
                 "mpi); raw-nb: the non-blocking MPI call + MPI_Test (mpi)")
      ->check(CLI::IsMember({"raw", "raw-nb"}));
  app.add_option("--algo", o.algo,
                 "raw Gloo's algorithm: all_reduce ring|bcube|hd|oldring|direct|rd, reduce_scatter hd|allreduce");
  app.add_option("--gap-us", o.gap_us, "sleep this many microseconds between calls, outside the timed region")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--offset", o.offset,
                 "start the buffers this many bytes past a page boundary: IN or IN:OUT per rank, a comma list "
                 "(rank r takes entry r mod its length; multiples of the element size; default: where std::vector "
                 "puts them). Copies between buffers 1-15 bytes apart modulo 4096 are slow on some x86 CPUs "
                 "(benchmarks/RESULTS.md)")
      ->check([](const std::string& v) {
        try {
          (void)place_of(v, 0);
          return std::string();
        } catch (const std::exception& e) {
          return std::string(e.what());
        }
      });
  extra(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "%s: %s\nRun with --help for the options.\n", p.name.c_str(), e.what());
    return 2;
  }
  try {
    o.ops = parse_ops(ops);
    o.min_bytes = parse_bytes(minb);
    o.max_bytes = parse_bytes(maxb);
    if (!stepb.empty()) {
      o.step_bytes = parse_bytes(stepb);
      if (o.step_bytes == 0) throw std::invalid_argument("-i/--stepbytes must be above 0");
    }
    if (app.count("--check") > 0) o.check = detail::zero_one("--check", check);
    if (app.count("--blocking") > 0 && !detail::zero_one("--blocking", blocking)) o.async = true;
    if (!budget.empty())
      o.budget_s = static_cast<double>(comm::detail::parse_duration(budget)->count()) / 1000.0;
    if (!timeout.empty()) ::setenv("COMM_TIMEOUT", timeout.c_str(), 1);
    (void)size_list(o.min_bytes, o.max_bytes, o.factor, o.sizes, o.step_bytes);  // validate now
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\nRun with --help for the options.\n", p.name.c_str(), e.what());
    return 2;
  }
  return std::nullopt;
}

/// Examples and notes every program's --help ends with.
inline constexpr std::string_view kCommonFooter =
    R"(Sizes are the whole buffer (nccl-tests): the all_reduce/broadcast/reduce buffer, the all_gather/gather
output, the reduce_scatter/scatter input, one rank's all_to_all(_v) input, one send_recv message.
send_recv is a ping-pong between ranks (0,1), (2,3)...: time is one way (half the round trip).
busbw uses nccl-tests' factors (benchmarks/common/bench.hpp).)";

}  // namespace comm::bench
