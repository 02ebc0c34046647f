// comm-run: the comm launcher.
//
// Starts N ranks of a program on this node with the launcher environment (RANK, LOCAL_RANK,
// WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK/NODE_RANK, MASTER_ADDR, MASTER_PORT,
// COMM_STORE_TOKEN), hosts the job's TcpStore (so that it outlives any rank), prefixes every line
// the ranks print with "[rank] " (or writes them to per-rank files, --log-dir), forwards
// SIGINT/SIGTERM/SIGHUP to them, restarts a failed rank alone when --max-restarts allows, and
// otherwise stops the whole job when one rank fails, exiting with the first failing rank's code.
// A small POSIX program: fork + exec, one poll() loop, signals read through a signalfd so nothing
// runs in a signal handler; the store server is the library's (its own thread, started after the
// signals are blocked so that they still reach the signalfd). Arguments: CLI11 finds the options
// (torchrun's spellings among them), comm-run checks their values itself so every bad value gets
// one kind of message, durations through the library's parser.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include <comm/detail/base/duration.hpp>
#include <comm/detail/store/common.hpp>
#include <comm/detail/store/tcp_store_server.hpp>

#ifndef COMM_RUN_VERSION
#define COMM_RUN_VERSION "unknown"
#endif

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr int exit_usage = 2;
constexpr int exit_timeout = 124;
constexpr int max_nproc = 1024;
constexpr int max_nnodes = 65536;
constexpr int max_restarts_limit = 1'000'000;
// A line longer than this is cut (with a newline) so one rank cannot make us buffer without bound.
constexpr std::size_t max_line = 64 * 1024;

constexpr std::string_view footer_text =
    R"(Durations are seconds, or a number with an ms, s or m suffix (0.5, 500ms, 2m).
Options also take the --option=value form. Options end at the program name or at `--`.

Each rank gets in its environment:
  RANK              node_rank * N + local rank
  LOCAL_RANK        0 .. N-1
  WORLD_SIZE        K * N
  LOCAL_WORLD_SIZE  N
  GROUP_RANK, NODE_RANK  I
  GROUP_WORLD_SIZE  K
  MASTER_ADDR, MASTER_PORT
  COMM_STORE_TOKEN  kept if set, else a random per-job token (the store checks it);
                    with --nnodes > 1 it must be set, to the same value on every node
  COMM_JOB_ID       --rdzv-id if given, else kept if set, else (one node) a fresh id per job: a
                    store of another job on the same port refuses this job's ranks, naming both
  COMM_AGENT_STORE  1: the launcher hosts the store (unless --no-agent-store), so every rank,
                    rank 0 too, connects to it as a client
  COMM_RESTART_COUNT  only in a restarted rank: this node's restarts so far, this one
                    included (1, 2, ...); unset in the ranks first started

Store: comm-run hosts the job's TcpStore on MASTER_ADDR:MASTER_PORT (with the job's
COMM_STORE_TOKEN and COMM_JOB_ID) from before the ranks start until the job ends, so the death of
any rank, rank 0 included, leaves it up; with --nnodes > 1 node 0's comm-run hosts it and the
others do not. A connection with a wrong or no token is refused (logged with COMM_DEBUG=WARN).

Output: every line a rank writes to stdout (stderr) is written to stdout (stderr) prefixed with
"[RANK] ", whole lines only; a last line without a newline is completed at exit. Ranks run with
stdin from /dev/null, except rank 0, which inherits stdin when it is not a terminal.
With --log-dir DIR, rank r's stdout and stderr go, unprefixed, to DIR/rank_<r>/stdout.log and
DIR/rank_<r>/stderr.log (emptied when the job starts; a restarted rank appends), and reach the
console only as --tee says (torchrun's values: 0 none, 1 stdout, 2 stderr, 3 both; default 0).
--redirects (torchrun's -r) names the streams that go to the files only; a stream in neither
--redirects nor --tee then goes to the console only. --local-ranks-filter 0,2-3 shows only those
local ranks' output on the console (the others' output goes to their files, or nowhere without
--log-dir). comm-run's own messages always go to stderr.

Restarts: with --max-restarts N, a rank that exits non-zero or is killed by a signal is started
again, alone, with the same environment plus COMM_RESTART_COUNT (stdin from /dev/null; its
leftover child processes are killed first); the other ranks are neither restarted nor signalled.
Each restart prints one line on stderr. Once N restarts are used, the next failure ends the job.

Failure: when a rank exits non-zero or is killed by a signal, comm-run reports it, sends SIGTERM
to the other ranks (their whole process groups), SIGKILL after the grace period, and exits with
that rank's code (128 + signal number for a signal). SIGINT, SIGTERM and SIGHUP sent to comm-run
are forwarded to all ranks (a second SIGINT/SIGTERM kills them); comm-run then exits with
128 + signal number. Exit codes: 2 bad arguments, 124 timeout, 126/127 program not runnable.

Trace: when COMM_TRACE=path is set, every rank writes its Chrome trace to path.<rank>; when the job
ends comm-run merges the files of this node's ranks into `path` (with --nnodes > 1:
path.node<I>), a trace of every rank that opens in chrome://tracing or ui.perfetto.dev.

torchrun: its spellings work (--nproc_per_node, --node_rank, --master_addr, --master_port,
--max_restarts, --log_dir, -t, -r, --local_ranks_filter, --rdzv_*). comm-run runs a program, not a
Python script: write `comm-run -n 2 python train.py` (--no-python is accepted and changes nothing;
-m/--module and --run-path are refused). The rendezvous is static: --rdzv-backend static or c10d,
--rdzv-endpoint HOST[:PORT] is --master-addr/--master-port, --rdzv-id is COMM_JOB_ID; with
--nnodes > 1 every node names its --node-rank. --monitor-interval, --start-method and --role are
accepted and change nothing.

Examples:
  comm-run -n 4 ./train                        4 ranks on this node
  comm-run --standalone --nproc_per_node=4 ./train
                                               the same, in torchrun's words
  comm-run -n 4 --log-dir logs --tee 2 ./train
                                               each rank's output in logs/rank_<r>/*.log,
                                               stderr also on the console
  comm-run -n 8 --local-ranks-filter 0 ./train only rank 0's output on the console
  comm-run -n 4 --max-restarts 3 --timeout 10m -- ./train --epochs 3
  export COMM_STORE_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')   # on both nodes
  comm-run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 -n 8 ./train
  comm-run --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 -n 8 ./train
)";

// ---------------------------------------------------------------------------------------------
// Arguments

// Bits of --tee and --redirects (torchrun's values).
constexpr int stream_out = 1;
constexpr int stream_err = 2;

struct Options {
  int nproc = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: pick a free port
  milliseconds grace{5000};
  std::optional<milliseconds> timeout;
  bool prefix = true;
  bool agent_store = true;  // this launcher (node 0's) hosts the store
  int max_restarts = 0;
  std::string job_id;   // --rdzv-id; empty: from the environment or fresh
  std::string log_dir;  // empty: no log files, every stream to the console
  int tee = 0;          // with log_dir: streams also shown on the console
  int redirects = stream_out | stream_err;  // with log_dir: streams written to the files
  std::vector<bool> shown;  // by local rank: its output may reach the console (empty: every rank)
  std::vector<char*> command;  // program and its arguments, null-terminated
};

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "comm-run: error: %s\nTry 'comm-run --help' for more information.\n", message.c_str());
  std::exit(exit_usage);
}

std::optional<long long> parse_integer(std::string_view s) {
  if (!s.empty() && s.front() == '+') s.remove_prefix(1);
  long long v = 0;
  const char* end = s.data() + s.size();
  auto [p, ec] = std::from_chars(s.data(), end, v);
  if (s.empty() || ec != std::errc() || p != end) return std::nullopt;
  return v;
}

int parse_int_option(std::string_view name, std::string_view value, long long lo, long long hi) {
  auto v = parse_integer(value);
  if (!v || *v < lo || *v > hi)
    usage_error(std::string(name) + " must be an integer from " + std::to_string(lo) + " to " + std::to_string(hi) +
                ", got '" + std::string(value) + "'");
  return static_cast<int>(*v);
}

milliseconds parse_duration_option(std::string_view name, std::string_view value, bool allow_zero) {
  auto d = comm::detail::parse_duration(value);  // the library's syntax, shared (COMM_TIMEOUT)
  if (!d || (!allow_zero && d->count() == 0))
    usage_error(std::string(name) + " must be a " + (allow_zero ? "non-negative" : "positive") +
                " duration (seconds, or a number with ms, s or m), got '" + std::string(value) + "'");
  return *d;
}

/// The GPUs this job may use, as torchrun's --nproc-per-node gpu counts them, without CUDA: the
/// entries of CUDA_VISIBLE_DEVICES when it is set, else the GPUs the NVIDIA driver lists.
int count_gpus() {
  if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES"); visible != nullptr) {
    int n = 0;
    for (std::string_view v = visible; !v.empty();) {
      const std::size_t comma = std::min(v.find(','), v.size());
      if (comma > 0) ++n;
      v.remove_prefix(std::min(comma + 1, v.size()));
    }
    return n;
  }
  std::error_code ec;
  int n = 0;
  for (std::filesystem::directory_iterator it("/proc/driver/nvidia/gpus", ec), end; !ec && it != end; it.increment(ec))
    ++n;
  return n;
}

/// -n: a number, or torchrun's cpu, gpu or auto (GPUs when there are any, else CPUs).
int parse_nproc(std::string_view v) {
  if (v == "cpu" || v == "gpu" || v == "auto") {
    const int gpus = v == "cpu" ? 0 : count_gpus();
    if (v == "gpu" && gpus == 0)
      usage_error("-n/--nproc-per-node gpu: no GPU found (CUDA_VISIBLE_DEVICES, else /proc/driver/nvidia/gpus); "
                  "give a number");
    const long cpus = ::sysconf(_SC_NPROCESSORS_ONLN);
    const long n = gpus > 0 ? gpus : std::max(1L, cpus);
    return static_cast<int>(std::min<long>(n, max_nproc));
  }
  return parse_int_option("-n/--nproc-per-node", v, 1, max_nproc);
}

/// --nnodes: K, or torchrun's MIN:MAX when both are K (an elastic range is refused).
int parse_nnodes(std::string_view v) {
  if (const auto colon = v.find(':'); colon != std::string_view::npos) {
    const std::string_view lo = v.substr(0, colon), hi = v.substr(colon + 1);
    if (lo != hi)
      usage_error("--nnodes " + std::string(v) +
                  ": a range of nodes (torchrun's elastic MIN:MAX) is not supported; comm-run starts a fixed "
                  "number of nodes, give one number");
    v = lo;
  }
  return parse_int_option("--nnodes", v, 1, max_nnodes);
}

/// --tee and --redirects: torchrun's 0 (none), 1 (stdout), 2 (stderr) or 3 (both).
int parse_streams(std::string_view name, std::string_view v) {
  if (v.find(':') != std::string_view::npos)
    usage_error(std::string(name) + " " + std::string(v) +
                ": a value per local rank (torchrun's RANK:VALUE,...) is not supported; give one of 0, 1, 2, 3");
  if (v.size() != 1 || v[0] < '0' || v[0] > '3')
    usage_error(std::string(name) + " must be 0 (none), 1 (stdout), 2 (stderr) or 3 (both), got '" + std::string(v) +
                "'");
  return v[0] - '0';
}

/// --local-ranks-filter: "0,2,5-7" → which of the `nproc` local ranks are shown.
std::vector<bool> parse_rank_filter(std::string_view v, int nproc) {
  std::vector<bool> shown(static_cast<std::size_t>(nproc), false);
  const std::string name = "--local-ranks-filter";
  if (v.empty()) usage_error(name + " must list local ranks (like 0,1 or 0-3), got ''");
  for (std::size_t start = 0; start <= v.size();) {
    const std::size_t comma = std::min(v.find(',', start), v.size());
    const std::string_view item = v.substr(start, comma - start);
    const std::size_t dash = item.find('-', 1);  // a leading '-' is a sign: out of range below
    auto bound = [&](std::string_view s) {
      auto r = parse_integer(s);
      if (!r)
        usage_error(name + " must list local ranks (like 0,1 or 0-3), got '" + std::string(v) + "' ('" +
                    std::string(item) + "' is not a rank or a range)");
      if (*r < 0 || *r >= nproc)
        usage_error(name + ": local rank " + std::string(s) + " is not in 0.." + std::to_string(nproc - 1) +
                    " (-n is " + std::to_string(nproc) + ")");
      return static_cast<int>(*r);
    };
    const int lo = bound(item.substr(0, dash));
    const int hi = dash == std::string_view::npos ? lo : bound(item.substr(dash + 1));
    if (hi < lo) usage_error(name + ": the range '" + std::string(item) + "' is empty");
    for (int r = lo; r <= hi; ++r) shown[static_cast<std::size_t>(r)] = true;
    start = comma + 1;
  }
  return shown;
}

/// The usage line CLI11 cannot derive: the program comes after the options, not as one of them.
class Formatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App*, std::string) const override {
    return "Usage: comm-run [OPTIONS] [--] program [args...]\n";
  }
};

Options parse_args(int argc, char** argv) {
  Options o;
  CLI::App app{"Starts N processes (ranks) of `program` on this node for a comm job, with the launcher\n"
               "environment, and hosts the job's store.",
               "comm-run"};
  app.formatter(std::make_shared<Formatter>());
  app.get_formatter()->column_width(36);
  app.footer(std::string(footer_text));
  // The first word that is not an option, and all after it, is the program's command line.
  app.prefix_command();
  app.set_help_flag("-h,--help", "show this help and exit");
  app.set_version_flag("--version", std::string("comm-run ") + COMM_RUN_VERSION, "show the version and exit");
  // The last of a repeated option wins, as with the parser before CLI11 (and torchrun's argparse).
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);

  // Values are taken as text and checked below, so every bad value gets the same kind of message.
  std::string nproc, nnodes, node_rank, master_addr, master_port, grace, timeout, max_restarts, log_dir, tee,
      redirects, filter, rdzv_backend, rdzv_endpoint, rdzv_id, ignored;
  bool no_prefix = false, no_agent_store = false, standalone = false, flag_ignored = false;
  auto value = [&](const char* names, std::string& into, const char* type, const char* what) {
    return app.add_option(names, into, what)->type_name(type);
  };
  auto flag = [&](const char* names, bool& into, const char* what) {
    return app.add_flag(names, into, what)->disable_flag_override();
  };
  value("-n,--nproc-per-node,--nproc_per_node", nproc, "N",
        "ranks to start on this node (default 1, at most 1024);\n"
        "also cpu, gpu or auto (GPUs, else CPUs) as torchrun");
  value("--nnodes", nnodes, "K", "nodes in the job (default 1); WORLD_SIZE = K * N");
  value("--node-rank,--node_rank", node_rank, "I", "this node's index, 0 <= I < K (default 0)");
  value("--master-addr,--master_addr", master_addr, "A", "address of the job's store (default 127.0.0.1)");
  value("--master-port,--master_port", master_port, "P",
        "port of the job's store (default: a free port;\nrequired when --nnodes > 1)");
  flag("--standalone", standalone,
       "one node, the store on 127.0.0.1 and a free port (torchrun's);\nnot with --nnodes > 1 or --master-*");
  flag("--no-agent-store", no_agent_store,
       "do not host the store: rank 0 does (for programs that bind\nMASTER_PORT themselves)");
  value("--max-restarts,--max_restarts", max_restarts, "N",
        "restart a rank that fails, alone, up to N times in all on this\nnode (default 0: a failure ends the job)");
  value("--grace-period", grace, "S", "after SIGTERM, wait S before SIGKILL (default 5s)");
  value("--timeout", timeout, "S", "stop the whole job after S and exit with code 124");
  flag("--no-prefix", no_prefix, "do not prefix console lines with \"[rank] \"");
  value("--log-dir,--log_dir", log_dir, "DIR",
        "write rank r's stdout and stderr to DIR/rank_<r>/stdout.log\nand stderr.log (not to the console unless --tee)");
  value("-t,--tee", tee, "0-3",
        "with --log-dir, the streams also shown on the console:\n0 none (default), 1 stdout, 2 stderr, 3 both");
  value("-r,--redirects", redirects, "0-3",
        "with --log-dir, the streams written to the files only\n(default 3; the others go to the console only)");
  value("--local-ranks-filter,--local_ranks_filter", filter, "LIST",
        "show only these local ranks' output on the console (0,1 or 0-3)");
  value("--rdzv-backend,--rdzv_backend", rdzv_backend, "NAME", "static or c10d (both: comm-run's static rendezvous)")
      ->group("torchrun rendezvous");
  value("--rdzv-endpoint,--rdzv_endpoint", rdzv_endpoint, "HOST[:PORT]", "as --master-addr HOST --master-port PORT")
      ->group("torchrun rendezvous");
  value("--rdzv-id,--rdzv_id", rdzv_id, "ID", "the job id (exported as COMM_JOB_ID)")->group("torchrun rendezvous");
  // torchrun's options that mean nothing for comm-run: accepted (hidden) so its command lines work.
  for (const char* names : {"--monitor-interval,--monitor_interval", "--start-method,--start_method", "--role"})
    app.add_option(names, ignored)->group("");
  app.add_flag("--no-python,--no_python", flag_ignored)->group("")->disable_flag_override();
  // torchrun's options comm-run cannot honour: recognised (hidden), so the error says why.
  std::string refused_value;
  bool refused_flag = false;
  struct Refused {
    const char* names;
    const char* why;
    bool takes_value;
  };
  static constexpr Refused refused[] = {
      {"-m,--module", "comm-run runs a program, not a Python module: write `comm-run ... python -m MODULE`", false},
      {"--run-path,--run_path", "comm-run runs a program: write `comm-run ... python SCRIPT`", false},
      {"--rdzv-conf,--rdzv_conf", "comm-run's rendezvous is static and has no settings (see --rdzv-backend)", true},
      {"--local-addr,--local_addr", "the ranks connect to MASTER_ADDR; this node's address is not configurable", true},
  };
  std::vector<CLI::Option*> refused_opts;
  for (const Refused& r : refused)
    refused_opts.push_back((r.takes_value ? app.add_option(r.names, refused_value)
                                          : app.add_flag(r.names, refused_flag)->disable_flag_override())
                               ->group(""));

  // Two forms CLI11 reads otherwise: "-n=4" (the old parser's; CLI11 would take "=4") and
  // "--name=" (an empty value; CLI11 would take the next word). from[k]: the argv index of args[k].
  std::vector<std::string> args;
  std::vector<int> from;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.starts_with("-n=")) a = "--nproc-per-node=" + a.substr(3);
    if (a.size() > 3 && a.starts_with("--") && a.find('=') == a.size() - 1) {
      args.push_back(a.substr(0, a.size() - 1));
      from.push_back(i);
      a.clear();
    }
    args.push_back(std::move(a));
    from.push_back(i);
  }
  const std::vector<std::string> given = args;
  std::reverse(args.begin(), args.end());  // CLI11 takes them last-first
  try {
    app.parse(args);
  } catch (const CLI::CallForHelp& e) {
    std::exit(app.exit(e));
  } catch (const CLI::CallForVersion& e) {
    std::exit(app.exit(e));
  } catch (const CLI::ArgumentMismatch& e) {
    // CLI11 says "--name: 1 required TYPE missing"; ours names the option as it is spelled above.
    const std::string what = e.what();
    if (what.ends_with(" missing")) usage_error("option '" + what.substr(0, what.find(':')) + "' needs a value");
    usage_error(what);
  } catch (const CLI::ParseError& e) {
    usage_error(e.what());
  }

  // What CLI11 left: the command line, after a `--` if one came first; a leading word that looks
  // like an option is one comm-run does not know.
  std::vector<std::string> rest = app.remaining();
  bool marked = false;
  if (!rest.empty() && rest.front() == "--") {
    const auto at = given.end() - static_cast<std::ptrdiff_t>(rest.size());
    marked = std::equal(rest.begin(), rest.end(), at, given.end());  // the `--` is ours, not a stray word's
    if (marked) rest.erase(rest.begin());
  }
  if (!rest.empty() && !marked && rest.front().size() >= 2 && rest.front().front() == '-')
    usage_error("unknown option '" + rest.front() + "'");
  for (std::size_t k = 0; k < refused_opts.size(); ++k)
    if (refused_opts[k]->count() > 0) {
      std::string names = refused[k].names;
      std::replace(names.begin(), names.end(), ',', '/');
      usage_error(names + " (torchrun's) is not supported: " + refused[k].why);
    }

  if (!nproc.empty()) o.nproc = parse_nproc(nproc);
  if (!nnodes.empty()) o.nnodes = parse_nnodes(nnodes);
  if (!node_rank.empty()) o.node_rank = parse_int_option("--node-rank", node_rank, 0, max_nnodes - 1);
  if (app.count("--master-addr") > 0) {
    if (master_addr.empty()) usage_error("--master-addr must not be empty");
    o.master_addr = master_addr;
  }
  if (!master_port.empty() || app.count("--master-port") > 0)
    o.master_port = parse_int_option("--master-port", master_port, 1, 65535);
  if (!grace.empty()) o.grace = parse_duration_option("--grace-period", grace, true);
  if (app.count("--timeout") > 0) o.timeout = parse_duration_option("--timeout", timeout, false);
  if (!max_restarts.empty() || app.count("--max-restarts") > 0)
    o.max_restarts = parse_int_option("--max-restarts", max_restarts, 0, max_restarts_limit);
  o.prefix = !no_prefix;
  o.agent_store = !no_agent_store;

  if (app.count("--rdzv-backend") > 0 && rdzv_backend != "static" && rdzv_backend != "c10d")
    usage_error("--rdzv-backend " + rdzv_backend +
                " is not supported: comm-run's rendezvous is static (its store, every node naming --node-rank); "
                "use static or c10d");
  if (rdzv_backend == "c10d" && o.nnodes > 1 && node_rank.empty())
    usage_error("--rdzv-backend c10d with --nnodes > 1 needs --node-rank on every node (comm-run does not hand out "
                "node ranks)");
  if (app.count("--rdzv-endpoint") > 0) {
    if (app.count("--master-addr") > 0 || app.count("--master-port") > 0)
      usage_error("give --rdzv-endpoint or --master-addr/--master-port, not both");
    std::string_view ep = rdzv_endpoint, host = ep, port;
    if (ep.starts_with('[')) {  // [IPv6]:PORT
      const auto close = ep.find(']');
      if (close == std::string_view::npos) usage_error("--rdzv-endpoint '" + rdzv_endpoint + "' lacks its ']'");
      host = ep.substr(1, close - 1);
      if (close + 1 < ep.size()) {
        if (ep[close + 1] != ':') usage_error("--rdzv-endpoint must be HOST[:PORT], got '" + rdzv_endpoint + "'");
        port = ep.substr(close + 2);
      }
    } else if (const auto colon = ep.rfind(':'); colon != std::string_view::npos && ep.find(':') == colon) {
      host = ep.substr(0, colon);
      port = ep.substr(colon + 1);
    }
    if (host.empty()) usage_error("--rdzv-endpoint must be HOST[:PORT], got '" + rdzv_endpoint + "'");
    o.master_addr = std::string(host);
    // torchrun's "localhost:0" (its --standalone endpoint): a free port.
    if (!port.empty() && port != "0") o.master_port = parse_int_option("--rdzv-endpoint's port", port, 1, 65535);
  }
  if (app.count("--rdzv-id") > 0) {
    if (rdzv_id.empty()) usage_error("--rdzv-id must not be empty");
    o.job_id = rdzv_id;
  }
  if (standalone) {
    for (const char* other : {"--master-addr", "--master-port", "--rdzv-endpoint"})
      if (app.count(other) > 0)
        usage_error(std::string("--standalone picks the store's address and port itself; drop ") + other);
    if (o.nnodes != 1 || o.node_rank != 0)
      usage_error("--standalone is one node: --nnodes must be 1 and --node-rank 0");
    o.master_addr = "127.0.0.1";
    o.master_port = 0;
  }

  if (app.count("--log-dir") > 0) {
    if (log_dir.empty()) usage_error("--log-dir must not be empty");
    o.log_dir = log_dir;
  }
  if (app.count("--tee") > 0) o.tee = parse_streams("--tee", tee);
  if (app.count("--redirects") > 0) o.redirects = parse_streams("--redirects", redirects);
  if (app.count("--local-ranks-filter") > 0) o.shown = parse_rank_filter(filter, o.nproc);

  if (rest.empty()) usage_error("no program given");
  if (o.node_rank >= o.nnodes)
    usage_error("--node-rank must be less than --nnodes (" + std::to_string(o.nnodes) + "), got " +
                std::to_string(o.node_rank));
  if (o.nnodes > 1 && o.master_port == 0)
    usage_error("--master-port is required when --nnodes > 1 (every node must use the same port)");
  // The program's words are argv's own strings (exec needs char*; they live as long as we do).
  for (int i = from[given.size() - rest.size()]; i < argc; ++i) o.command.push_back(argv[i]);
  o.command.push_back(nullptr);
  return o;
}

// ---------------------------------------------------------------------------------------------
// Small system helpers

[[noreturn]] void fatal(const std::string& what) {
  std::fprintf(stderr, "comm-run: %s: %s\n", what.c_str(), std::strerror(errno));
  std::exit(1);
}

std::string signal_name(int sig) {
  if (const char* abbrev = sigabbrev_np(sig)) return std::string("SIG") + abbrev;
  return "signal " + std::to_string(sig);
}

/// A port that was free on 127.0.0.1 a moment ago. Another process can take it before rank 0
/// binds it; we ask as late as possible (just before the ranks start) to keep that window small.
int pick_free_port() {
  int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) fatal("socket");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) fatal("bind 127.0.0.1:0");
  if (::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) != 0) fatal("getsockname");
  ::close(s);
  return ntohs(a.sin_port);
}

std::string random_token() {
  unsigned char bytes[16];
  int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0) fatal("open /dev/urandom");
  std::size_t got = 0;
  while (got < sizeof bytes) {
    ssize_t n = ::read(fd, bytes + got, sizeof bytes - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fatal("read /dev/urandom");
    got += static_cast<std::size_t>(n);
  }
  ::close(fd);
  static constexpr char hex[] = "0123456789abcdef";
  std::string token;
  for (unsigned char b : bytes) {
    token += hex[b >> 4];
    token += hex[b & 15];
  }
  return token;
}

/// Writes all of `data`; gives up quietly when the reader is gone (e.g. `comm-run ... | head`).
void write_all(int fd, std::string_view data) {
  static bool broken[3] = {false, false, false};
  if (fd <= 2 && broken[fd]) return;
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n > 0) {
      data.remove_prefix(static_cast<std::size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && errno == EAGAIN) {  // our stdout may be a non-blocking fd we inherited
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, 1000);
    } else {
      if (fd <= 2) broken[fd] = true;
      return;
    }
  }
}

std::string seconds_text(milliseconds d) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", static_cast<double>(d.count()) / 1000.0);
  return buf;
}

void message(const std::string& text) { write_all(STDERR_FILENO, "comm-run: " + text + "\n"); }

// ---------------------------------------------------------------------------------------------
// COMM_TRACE: the ranks' Chrome traces merged into one file

/// The contents of the "traceEvents" array of a JSON trace (between its brackets), or nullopt
/// when there is none or it does not close (a rank killed while writing).
std::optional<std::string_view> trace_events(std::string_view doc) {
  const std::size_t key = doc.find("\"traceEvents\"");
  if (key == std::string_view::npos) return std::nullopt;
  const std::size_t open = doc.find('[', key);
  if (open == std::string_view::npos) return std::nullopt;
  int depth = 0;
  bool in_string = false, escaped = false;
  for (std::size_t i = open; i < doc.size(); ++i) {
    const char c = doc[i];
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      ++depth;
    } else if ((c == ']' || c == '}') && --depth == 0) {
      return c == ']' ? std::optional(doc.substr(open + 1, i - open - 1)) : std::nullopt;
    }
  }
  return std::nullopt;
}

/// Merges this node's ranks' traces (path.<rank>, written during this job) into path, or
/// path.node<I> when the job spans several nodes. Says what it did on stderr.
void merge_traces(const Options& o, std::filesystem::file_time_type started) {
  const char* env = std::getenv("COMM_TRACE");
  if (env == nullptr || *env == '\0') return;
  std::string_view path_view = env;
  while (!path_view.empty() && std::isspace(static_cast<unsigned char>(path_view.front()))) path_view.remove_prefix(1);
  while (!path_view.empty() && std::isspace(static_cast<unsigned char>(path_view.back()))) path_view.remove_suffix(1);
  if (path_view.empty()) return;
  const std::string path(path_view);
  // File times come from a coarser clock than ours: a file of this job may look a little older.
  started -= std::chrono::seconds(1);
  std::string events;
  std::vector<int> missing;
  int merged = 0;
  for (int local = 0; local < o.nproc; ++local) {
    const int rank = o.node_rank * o.nproc + local;
    const std::string file = path + "." + std::to_string(rank);
    std::error_code ec;
    const auto written = std::filesystem::last_write_time(file, ec);
    if (ec || written < started) {
      missing.push_back(rank);
      continue;
    }
    std::ifstream in(file, std::ios::binary);
    const std::string doc((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    auto body = trace_events(doc);
    if (!in.good() && !in.eof()) body.reset();
    if (!body) {
      missing.push_back(rank);
      continue;
    }
    while (!body->empty() && std::isspace(static_cast<unsigned char>(body->front()))) body->remove_prefix(1);
    while (!body->empty() && std::isspace(static_cast<unsigned char>(body->back()))) body->remove_suffix(1);
    if (!body->empty()) {
      if (!events.empty()) events += ",\n";
      events.append(*body);
    }
    ++merged;
  }
  std::string missing_text;
  for (int r : missing) missing_text += (missing_text.empty() ? "" : ", ") + std::to_string(r);
  if (merged == 0) {
    message("COMM_TRACE is set but no rank wrote a trace (" + path + ".<rank>) during this job");
    return;
  }
  const std::string out = o.nnodes > 1 ? path + ".node" + std::to_string(o.node_rank) : path;
  const std::string tmp = out + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << "{\"traceEvents\":[\n" << events << "\n],\n\"displayTimeUnit\":\"ms\",\"otherData\":{\"producer\":\"comm-run\",\"ranks\":"
      << merged << "}}\n";
    f.flush();
    if (!f) {
      message("cannot write the merged trace " + tmp);
      std::remove(tmp.c_str());
      return;
    }
  }
  if (std::rename(tmp.c_str(), out.c_str()) != 0) {
    message("cannot write the merged trace " + out + ": " + std::strerror(errno));
    std::remove(tmp.c_str());
    return;
  }
  message("trace of " + std::to_string(merged) + " rank(s) merged into " + out +
          (missing.empty() ? std::string() : " (no trace from rank(s) " + missing_text + ")"));
}

// ---------------------------------------------------------------------------------------------
// The job

/// One output pipe of one rank, cut into prefixed lines.
struct Stream {
  int fd = -1;
  int dest = STDOUT_FILENO;  // the console (our stdout or stderr), or -1: not shown
  int file = -1;             // the rank's log file (--log-dir), or -1
  std::string pending;       // bytes after the last newline (console only)
};

struct Rank {
  int rank = 0;
  int local = 0;
  pid_t pid = -1;  // also its process group id
  bool running = false;
  bool logged = false;  // its log files were started (a restart appends to them)
  Stream out, err;
};

class Job {
 public:
  explicit Job(Options o) : opt_(std::move(o)) {}

  int run() {
    setup_signals();
    prepare_env();
    prepare_logs();
    host_store();
    const auto started = std::filesystem::file_time_type::clock::now();
    start_ranks();
    event_loop();
    final_drain();
    linger_store();
    merge_traces(opt_, started);
    return exit_code_;
  }

 private:
  void setup_signals() {
    // A rank's exit or a user's signal arrives as data on a signalfd, read in the poll loop.
    sigset_t set;
    sigemptyset(&set);
    for (int s : {SIGCHLD, SIGINT, SIGTERM, SIGHUP}) sigaddset(&set, s);
    if (::sigprocmask(SIG_BLOCK, &set, &old_mask_) != 0) fatal("sigprocmask");
    sfd_ = ::signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
    if (sfd_ < 0) fatal("signalfd");
    ::signal(SIGPIPE, SIG_IGN);
    // Orphaned grandchildren come to us, so we can reap them and see when a group is empty.
    ::prctl(PR_SET_CHILD_SUBREAPER, 1);
  }

  void prepare_env() {
    static constexpr std::string_view ours[] = {"RANK=",       "LOCAL_RANK=",       "WORLD_SIZE=",
                                                "LOCAL_WORLD_SIZE=", "GROUP_RANK=", "NODE_RANK=",
                                                "GROUP_WORLD_SIZE=", "MASTER_ADDR=", "MASTER_PORT=",
                                                "COMM_STORE_TOKEN=", "COMM_JOB_ID=", "COMM_AGENT_STORE=",
                                                "COMM_RESTART_COUNT="};
    for (char** e = environ; *e != nullptr; ++e) {
      std::string_view kv = *e;
      if (std::none_of(std::begin(ours), std::end(ours), [&](std::string_view k) { return kv.starts_with(k); }))
        base_env_.emplace_back(kv);
    }
    const char* token = std::getenv("COMM_STORE_TOKEN");
    if (token != nullptr && *token != '\0') {
      token_ = token;
    } else if (opt_.nnodes > 1) {
      usage_error(
          "COMM_STORE_TOKEN must be set, to the same value on every node, when --nnodes > 1; for example\n"
          "  export COMM_STORE_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \\n')");
    } else {
      token_ = random_token();
    }
    const char* job = std::getenv("COMM_JOB_ID");
    if (!opt_.job_id.empty())
      job_id_ = opt_.job_id;
    else if (job != nullptr && *job != '\0')
      job_id_ = job;
    else if (opt_.nnodes == 1)
      job_id_ = "comm-run-" + std::to_string(::getpid()) + "-" + random_token().substr(0, 8);
  }

  /// --log-dir: DIR/rank_<r>/ for each of this node's ranks, made before any rank starts so that a
  /// directory we cannot write is a clear error, not a job running blind.
  void prepare_logs() {
    if (opt_.log_dir.empty()) return;
    for (int local = 0; local < opt_.nproc; ++local) {
      const std::filesystem::path dir = rank_log_dir(opt_.node_rank * opt_.nproc + local);
      std::error_code ec;
      std::filesystem::create_directories(dir, ec);
      if (ec) {
        message("--log-dir: cannot create " + dir.string() + ": " + ec.message());
        std::exit(1);
      }
    }
  }

  std::filesystem::path rank_log_dir(int rank) const {
    return std::filesystem::path(opt_.log_dir) / ("rank_" + std::to_string(rank));
  }

  /// " (its output: DIR/rank_<r>/)" when the rank's output is in files, so a failure names them.
  std::string where_output(int rank) const {
    return opt_.log_dir.empty() ? std::string() : " (its output: " + rank_log_dir(rank).string() + "/)";
  }

  /// The log file of `bit` (stream_out or stream_err) for rank `r`, or -1 when that stream has none.
  /// Emptied when the job first starts the rank; a restart appends.
  int open_log(const Rank& r, int bit) {
    if (opt_.log_dir.empty() || ((opt_.redirects | opt_.tee) & bit) == 0) return -1;
    const std::string path = (rank_log_dir(r.rank) / (bit == stream_out ? "stdout.log" : "stderr.log")).string();
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | (r.logged ? O_APPEND : O_TRUNC), 0644);
    if (fd < 0) message("--log-dir: cannot open " + path + ": " + std::strerror(errno) + "; that output is lost");
    return fd;
  }

  /// Where stream `bit` of local rank `local` shows on the console: our stdout/stderr, or -1.
  int console(int local, int bit) const {
    if (!opt_.shown.empty() && !opt_.shown[static_cast<std::size_t>(local)]) return -1;
    const bool shown = opt_.log_dir.empty() || (opt_.tee & bit) != 0 || (opt_.redirects & bit) == 0;
    return shown ? (bit == stream_out ? STDOUT_FILENO : STDERR_FILENO) : -1;
  }

  /// Node 0's launcher hosts the job's store from before the ranks start until the job ends (the
  /// server's thread; the signals are blocked already, so they still come to the signalfd). Rank
  /// -1 as the host: no rank's death takes the store with it.
  void host_store() {
    if (!opt_.agent_store || opt_.node_rank != 0) return;
    comm::detail::TcpStoreServerConfig cfg;
    cfg.token = token_;
    // What the ranks' stores will send: COMM_JOB_ID as we export it, else their inherited
    // TORCHELASTIC_RUN_ID / SLURM_JOB_ID.
    cfg.job_id = job_id_.empty() ? comm::detail::job_id_from_env() : job_id_;
    try {
      store_ = std::make_unique<comm::detail::TcpStoreServer>(opt_.master_addr,
                                                             static_cast<std::uint16_t>(opt_.master_port), cfg, -1);
    } catch (const std::exception& e) {
      message(std::string("cannot host the job's store: ") + e.what() +
              (opt_.master_port == 0 ? "" : " (pick another --master-port)"));
      std::exit(1);
    }
    opt_.master_port = store_->port();
  }

  std::vector<std::string> rank_env(int local) const {
    std::vector<std::string> env = base_env_;
    const int world = opt_.nnodes * opt_.nproc;
    env.push_back("RANK=" + std::to_string(opt_.node_rank * opt_.nproc + local));
    env.push_back("LOCAL_RANK=" + std::to_string(local));
    env.push_back("WORLD_SIZE=" + std::to_string(world));
    env.push_back("LOCAL_WORLD_SIZE=" + std::to_string(opt_.nproc));
    env.push_back("GROUP_RANK=" + std::to_string(opt_.node_rank));
    env.push_back("NODE_RANK=" + std::to_string(opt_.node_rank));
    env.push_back("GROUP_WORLD_SIZE=" + std::to_string(opt_.nnodes));
    env.push_back("MASTER_ADDR=" + opt_.master_addr);
    env.push_back("MASTER_PORT=" + std::to_string(opt_.master_port));
    env.push_back("COMM_STORE_TOKEN=" + token_);
    if (!job_id_.empty()) env.push_back("COMM_JOB_ID=" + job_id_);
    if (opt_.agent_store) env.push_back("COMM_AGENT_STORE=1");
    return env;
  }

  void start_ranks() {
    const bool inherit_stdin = ::isatty(STDIN_FILENO) == 0;
    const int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (devnull < 0) fatal("open /dev/null");
    if (opt_.master_port == 0) opt_.master_port = pick_free_port();
    ranks_.resize(static_cast<std::size_t>(opt_.nproc));
    for (int local = 0; local < opt_.nproc && !stopping_; ++local) {
      Rank& r = ranks_[static_cast<std::size_t>(local)];
      r.rank = opt_.node_rank * opt_.nproc + local;
      r.local = local;
      spawn(r, rank_env(local), (inherit_stdin && r.rank == 0) ? STDIN_FILENO : devnull);
    }
    ::close(devnull);
    if (opt_.timeout) deadline_ = Clock::now() + *opt_.timeout;
  }

  /// Starts rank `r`'s process with `env`; on failure starts stopping the job.
  void spawn(Rank& r, std::vector<std::string> env, int in_fd) {
    const pid_t self = ::getpid();
    // Everything the child needs is built before fork: it only calls async-signal-safe functions.
    std::vector<char*> envp;
    for (auto& kv : env) envp.push_back(kv.data());
    envp.push_back(nullptr);

    int out[2], err[2], status_pipe[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0 || ::pipe2(status_pipe, O_CLOEXEC) != 0)
      fatal("pipe");
    const pid_t pid = ::fork();
    if (pid < 0) {
      message("cannot start rank " + std::to_string(r.rank) + ": fork: " + std::strerror(errno));
      for (int fd : {out[0], out[1], err[0], err[1], status_pipe[0], status_pipe[1]}) ::close(fd);
      begin_stop(1, SIGTERM);
      return;
    }
    if (pid == 0) exec_child(self, in_fd, out[1], err[1], status_pipe[1], envp.data());

    ::setpgid(pid, pid);  // also done in the child; whichever runs first wins the race
    ::close(out[1]);
    ::close(err[1]);
    ::close(status_pipe[1]);
    r.pid = pid;
    r.running = true;
    ++running_;
    r.out = Stream{out[0], console(r.local, stream_out), open_log(r, stream_out), {}};
    r.err = Stream{err[0], console(r.local, stream_err), open_log(r, stream_err), {}};
    r.logged = true;
    for (int fd : {out[0], err[0]}) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);

    // The status pipe closes on a successful exec, or carries errno when exec failed.
    int exec_errno = 0;
    ssize_t n;
    do n = ::read(status_pipe[0], &exec_errno, sizeof exec_errno);
    while (n < 0 && errno == EINTR);
    ::close(status_pipe[0]);
    if (n == static_cast<ssize_t>(sizeof exec_errno)) {
      message("cannot run '" + std::string(opt_.command[0]) + "': " + std::strerror(exec_errno));
      begin_stop(exec_errno == ENOENT ? 127 : 126, SIGTERM);
    }
  }

  /// Starts rank `r` again, alone, after its process failed (`how`): the same environment plus
  /// COMM_RESTART_COUNT. What the dead process left (its output, its children) goes first.
  void restart(Rank& r, const std::string& how) {
    ++restarts_;
    message("rank " + std::to_string(r.rank) + " " + how + "; restarting it (restart " + std::to_string(restarts_) +
            " of " + std::to_string(opt_.max_restarts) + ")");
    ::killpg(r.pid, SIGKILL);  // children it left behind belong to the dead process
    for (Stream* st : {&r.out, &r.err}) close_stream(*st, r.rank);
    std::vector<std::string> env = rank_env(r.local);
    env.push_back("COMM_RESTART_COUNT=" + std::to_string(restarts_));
    const int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (devnull < 0) fatal("open /dev/null");
    spawn(r, std::move(env), devnull);
    ::close(devnull);
  }

  [[noreturn]] void exec_child(pid_t parent, int in_fd, int out_fd, int err_fd, int status_fd, char** envp) {
    ::setpgid(0, 0);
    // Die with the launcher even when it is SIGKILLed, so no rank outlives its job.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);
    ::signal(SIGPIPE, SIG_DFL);
    ::sigprocmask(SIG_SETMASK, &old_mask_, nullptr);
    if (in_fd != STDIN_FILENO) ::dup2(in_fd, STDIN_FILENO);
    ::dup2(out_fd, STDOUT_FILENO);
    ::dup2(err_fd, STDERR_FILENO);
    ::execvpe(opt_.command[0], opt_.command.data(), envp);
    int e = errno;
    ssize_t ignored = ::write(status_fd, &e, sizeof e);
    (void)ignored;
    ::_exit(127);
  }

  void event_loop() {
    std::vector<pollfd> fds;
    std::vector<Stream*> streams;
    while (running_ > 0 || (stopping_ && !killed_ && any_group_alive())) {
      fds.assign(1, pollfd{sfd_, POLLIN, 0});
      streams.assign(1, nullptr);
      for (Rank& r : ranks_)
        for (Stream* s : {&r.out, &r.err})
          if (s->fd >= 0) {
            fds.push_back(pollfd{s->fd, POLLIN, 0});
            streams.push_back(s);
          }
      int rc = ::poll(fds.data(), fds.size(), poll_timeout_ms());
      if (rc < 0 && errno != EINTR) fatal("poll");
      if (rc > 0) {
        for (std::size_t k = 1; k < fds.size(); ++k)
          if (fds[k].revents != 0) read_once(*streams[k], owner(*streams[k]));
        if (fds[0].revents != 0) handle_signals();
      }
      check_deadlines();
    }
  }

  /// Reads what is left in the pipes once every rank has exited. A grandchild may still hold a
  /// pipe open; we do not wait for it beyond a short moment.
  void final_drain() {
    const auto until = Clock::now() + milliseconds(200);
    for (;;) {
      std::vector<pollfd> fds;
      std::vector<Stream*> streams;
      for (Rank& r : ranks_)
        for (Stream* s : {&r.out, &r.err})
          if (s->fd >= 0) {
            fds.push_back(pollfd{s->fd, POLLIN, 0});
            streams.push_back(s);
          }
      const auto left = std::chrono::duration_cast<milliseconds>(until - Clock::now()).count();
      if (fds.empty() || left <= 0) break;
      int rc = ::poll(fds.data(), fds.size(), static_cast<int>(std::min<long long>(left, 50)));
      if (rc < 0 && errno != EINTR) break;
      if (rc == 0) break;
      for (std::size_t k = 0; k < fds.size(); ++k)
        if (fds[k].revents != 0) read_once(*streams[k], owner(*streams[k]));
    }
    for (Rank& r : ranks_)
      for (Stream* s : {&r.out, &r.err}) close_stream(*s, r.rank);
  }

  /// With several nodes, our ranks may be done while other nodes' ranks still use the store we
  /// host (a slower node, a replacement finishing its step): closing it then would fail them. So
  /// after a clean finish we keep it up until every client has disconnected, as torchrun's exit
  /// barrier does, bounded by --timeout (else linger_limit) and cut short by a signal.
  void linger_store() {
    if (!store_ || opt_.nnodes <= 1 || exit_code_ != 0) return;
    static constexpr auto linger_limit = std::chrono::minutes(5);
    const auto until = deadline_ ? *deadline_ : Clock::now() + linger_limit;
    while (store_->clients() > 0) {
      if (Clock::now() >= until) {
        message("the other nodes' ranks still hold " + std::to_string(store_->clients()) +
                " connection(s) to the job's store; closing it (" +
                (deadline_ ? std::string("--timeout") : std::string("5 min after this node's ranks ended")) + ")");
        return;
      }
      pollfd p{sfd_, POLLIN, 0};
      if (::poll(&p, 1, 20) > 0) {
        signalfd_siginfo si;
        while (::read(sfd_, &si, sizeof si) == static_cast<ssize_t>(sizeof si))
          if (si.ssi_signo != SIGCHLD) {
            message("got " + signal_name(static_cast<int>(si.ssi_signo)) +
                    " while hosting the store for the other nodes; closing it");
            return;
          }
      }
    }
  }

  int owner(const Stream& s) const {
    for (const Rank& r : ranks_)
      if (&r.out == &s || &r.err == &s) return r.rank;
    return -1;
  }

  // --- output ---------------------------------------------------------------------------------

  void emit(Stream& s, int rank, std::string_view data) {
    if (s.file >= 0 && !data.empty()) write_all(s.file, data);  // the file gets the bytes as written
    if (s.dest < 0) return;
    s.pending.append(data);
    const std::string prefix = opt_.prefix ? "[" + std::to_string(rank) + "] " : std::string();
    std::string out;
    std::size_t start = 0;
    for (;;) {
      std::size_t nl = s.pending.find('\n', start);
      if (nl == std::string::npos) {
        if (s.pending.size() - start < max_line) break;
        nl = start + max_line - 1;  // cut an overlong line
        out += prefix;
        out.append(s.pending, start, nl + 1 - start);
        out += '\n';
      } else {
        out += prefix;
        out.append(s.pending, start, nl + 1 - start);
      }
      start = nl + 1;
    }
    s.pending.erase(0, start);
    if (!out.empty()) write_all(s.dest, out);
  }

  void close_stream(Stream& s, int rank) {
    if (s.fd < 0) return;
    ::close(s.fd);
    s.fd = -1;
    if (s.file >= 0) {
      ::close(s.file);
      s.file = -1;
    }
    if (!s.pending.empty()) {
      s.pending += '\n';  // complete the last line so it is not glued to another rank's output
      emit(s, rank, {});
    }
  }

  /// One read; returns false when the stream has nothing more for now (EAGAIN) or ended.
  bool read_once(Stream& s, int rank) {
    if (s.fd < 0) return false;
    char buf[65536];
    ssize_t n = ::read(s.fd, buf, sizeof buf);
    if (n > 0) {
      emit(s, rank, std::string_view(buf, static_cast<std::size_t>(n)));
      return true;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return false;
    close_stream(s, rank);  // EOF or error
    return false;
  }

  void drain(Rank& r) {
    for (Stream* s : {&r.out, &r.err})
      while (read_once(*s, r.rank)) {
      }
  }

  // --- processes and signals ------------------------------------------------------------------

  void handle_signals() {
    signalfd_siginfo si;
    while (::read(sfd_, &si, sizeof si) == static_cast<ssize_t>(sizeof si)) {
      const int sig = static_cast<int>(si.ssi_signo);
      if (sig == SIGCHLD) {
        reap();
      } else if (!stopping_) {
        message("got " + signal_name(sig) + ", forwarding it to all ranks");
        begin_stop(128 + sig, sig);
      } else if (sig != SIGHUP && !killed_) {
        message("got " + signal_name(sig) + " again, killing all ranks");
        kill_all(SIGKILL);
      }
    }
  }

  void reap() {
    for (;;) {
      int status = 0;
      const pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid <= 0) return;
      auto it = std::find_if(ranks_.begin(), ranks_.end(), [&](const Rank& r) { return r.pid == pid; });
      if (it == ranks_.end() || !it->running) continue;  // an orphaned grandchild
      it->running = false;
      --running_;
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
      if (stopping_) continue;  // the job is already going down; the first cause is known
      drain(*it);               // its last words come before our report
      if (restarts_ < opt_.max_restarts) {
        restart(*it, (WIFEXITED(status) ? "exited with code " + std::to_string(WEXITSTATUS(status))
                                        : "was killed by signal " + signal_name(WTERMSIG(status))) +
                         where_output(it->rank));
        continue;
      }
      if (opt_.max_restarts > 0)
        message("no restart left (--max-restarts " + std::to_string(opt_.max_restarts) + " used up)");
      if (WIFEXITED(status)) {
        message("rank " + std::to_string(it->rank) + " exited with code " + std::to_string(WEXITSTATUS(status)) +
                where_output(it->rank));
        begin_stop(WEXITSTATUS(status), SIGTERM);
      } else {
        message("rank " + std::to_string(it->rank) + " was killed by signal " + signal_name(WTERMSIG(status)) +
                where_output(it->rank));
        begin_stop(128 + WTERMSIG(status), SIGTERM);
      }
      if (running_ > 0)
        message("stopping the other " + std::to_string(running_) + " rank(s): SIGTERM, then SIGKILL after " +
                seconds_text(opt_.grace) + "s");
    }
  }

  /// Starts shutting the job down: `code` is the exit code (the first cause wins), `sig` goes to
  /// every rank's process group, and SIGKILL follows after the grace period.
  void begin_stop(int code, int sig) {
    if (stopping_) return;
    stopping_ = true;
    exit_code_ = code;
    kill_all(sig);
    kill_at_ = Clock::now() + opt_.grace;
  }

  /// Signals every rank's whole process group, so a rank's own children go too.
  void kill_all(int sig) {
    for (const Rank& r : ranks_)
      if (r.pid > 0) ::killpg(r.pid, sig);
    if (sig == SIGKILL) killed_ = true;
  }

  bool any_group_alive() const {
    return std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.pid > 0 && ::killpg(r.pid, 0) == 0; });
  }

  int poll_timeout_ms() const {
    std::optional<Clock::time_point> next;
    if (deadline_ && !stopping_) next = deadline_;
    if (stopping_ && !killed_) next = kill_at_;
    if (!next) return stopping_ ? 100 : -1;
    const auto left = std::chrono::ceil<milliseconds>(*next - Clock::now()).count();
    // While only grandchildren remain, poll now and then: their exit is not always a SIGCHLD to us.
    return static_cast<int>(std::clamp<long long>(left, 0, running_ > 0 ? 1'000'000 : 100));
  }

  void check_deadlines() {
    const auto now = Clock::now();
    if (!stopping_ && deadline_ && now >= *deadline_) {
      message("timeout: the job ran longer than " + seconds_text(*opt_.timeout) + "s (--timeout); stopping all ranks");
      begin_stop(exit_timeout, SIGTERM);
    }
    if (stopping_ && !killed_ && now >= kill_at_) {
      if (running_ > 0) message("grace period over, killing the remaining " + std::to_string(running_) + " rank(s)");
      kill_all(SIGKILL);
    }
  }

  Options opt_;
  std::vector<std::string> base_env_;
  std::string token_;
  std::string job_id_;  // COMM_JOB_ID for the ranks; empty: not set
  std::vector<Rank> ranks_;
  std::unique_ptr<comm::detail::TcpStoreServer> store_;  // node 0's store; null: not ours to host
  int restarts_ = 0;
  sigset_t old_mask_{};
  int sfd_ = -1;
  int running_ = 0;
  bool stopping_ = false;
  bool killed_ = false;
  int exit_code_ = 0;
  Clock::time_point kill_at_{};
  std::optional<Clock::time_point> deadline_;
};

}  // namespace

int main(int argc, char** argv) {
  // Make sure fds 0-2 exist, so the pipes we create never land on them.
  for (int fd = 0; fd <= 2; ++fd)
    if (::fcntl(fd, F_GETFD) < 0 && ::open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY) < 0) return 1;
  Options options = parse_args(argc, argv);
  return Job(std::move(options)).run();
}
