#pragma once
// Shared by comm-bench and the C++ peer programs (raw Gloo, OpenMPI): command line, message
// layouts, bus-bandwidth factors, timing statistics, the nccl-tests-style table and the JSON-lines
// schema. Nothing here talks to a network: each program passes its own cross-rank reductions in.
//
// Methodology (the same in every program, the Python torch peer included):
//   - every rank times each call on its own steady clock, back to back (no barrier in between:
//     a barrier adds its own exit skew); warm-up calls run first and are not reported;
//   - the time of iteration i is the maximum over ranks of the ranks' times of iteration i;
//   - the reported time is the median of those maxima (mean and min are in the JSON too);
//   - algbw = bytes / time, busbw = algbw * factor(op, n), with bytes and factor as nccl-tests.

#include <sys/resource.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace comm::bench {

inline constexpr std::string_view kSchema = "comm-bench/1";

enum class Op {
  all_reduce,
  reduce_scatter,
  all_gather,
  broadcast,
  gather,
  reduce,
  scatter,
  all_to_all,
  all_to_all_v,
  send_recv,  ///< ping-pong between rank pairs (0,1), (2,3)...; time is one way (half the round trip)
  barrier,
};
/// Every op, in the order `--op all` runs them.
inline constexpr Op kAllOps[] = {Op::all_reduce, Op::reduce_scatter, Op::all_gather, Op::broadcast,
                                 Op::gather,     Op::reduce,         Op::scatter,    Op::all_to_all,
                                 Op::all_to_all_v, Op::send_recv,    Op::barrier};

[[nodiscard]] constexpr std::string_view to_string(Op op) noexcept {
  switch (op) {
    case Op::all_reduce: return "all_reduce";
    case Op::reduce_scatter: return "reduce_scatter";
    case Op::all_gather: return "all_gather";
    case Op::broadcast: return "broadcast";
    case Op::gather: return "gather";
    case Op::reduce: return "reduce";
    case Op::scatter: return "scatter";
    case Op::all_to_all: return "all_to_all";
    case Op::all_to_all_v: return "all_to_all_v";
    case Op::send_recv: return "send_recv";
    case Op::barrier: return "barrier";
  }
  return "?";
}

/// comm's names, and nccl-tests' binary names without "_perf" (allreduce, alltoall, sendrecv...).
[[nodiscard]] inline std::optional<Op> parse_op(std::string_view s) {
  for (Op op : kAllOps)
    if (s == to_string(op)) return op;
  if (s == "allreduce") return Op::all_reduce;
  if (s == "reducescatter") return Op::reduce_scatter;
  if (s == "allgather") return Op::all_gather;
  if (s == "bcast") return Op::broadcast;
  if (s == "alltoall") return Op::all_to_all;
  if (s == "alltoallv") return Op::all_to_all_v;
  if (s == "sendrecv" || s == "pingpong" || s == "ping_pong") return Op::send_recv;
  return std::nullopt;
}

[[nodiscard]] constexpr bool is_reduction(Op op) noexcept {
  return op == Op::all_reduce || op == Op::reduce_scatter || op == Op::reduce;
}
[[nodiscard]] constexpr bool is_rooted(Op op) noexcept {
  return op == Op::broadcast || op == Op::gather || op == Op::reduce || op == Op::scatter;
}
/// Ops whose output may alias the input (--inplace); all_to_all(_v) and send_recv may not.
[[nodiscard]] constexpr bool can_be_in_place(Op op) noexcept {
  return op != Op::all_to_all && op != Op::all_to_all_v && op != Op::send_recv && op != Op::barrier;
}

/// busbw = algbw * factor (nccl-tests' factors): the share of `bytes` that must cross the busiest
/// rank's link in an optimal algorithm, so that busbw is comparable with the link's bandwidth
/// whatever n is.
///   all_reduce       2(n-1)/n  a reduce-scatter then an all-gather, each moving (n-1)/n of the buffer
///   reduce_scatter   (n-1)/n   each rank must receive the other n-1 ranks' copies of its 1/n block
///   all_gather       (n-1)/n   each rank must receive the n-1 blocks it does not own
///   broadcast        1         every non-root must receive the whole buffer; pipelined, each link
///                              carries it once
///   reduce           1         the root must receive a whole buffer's worth (pipelined, as broadcast)
///   gather, scatter  (n-1)/n   the root's link must carry the n-1 blocks it does not own
///   all_to_all(_v)   (n-1)/n   each rank sends n-1 of its n blocks away (_v: the nominal blocks)
///   send_recv        1         the message crosses the link once per direction
///   barrier          0         no payload
[[nodiscard]] inline double bus_factor(Op op, int n) noexcept {
  if (op == Op::barrier) return 0.0;
  if (op == Op::broadcast || op == Op::reduce || op == Op::send_recv) return 1.0;
  if (n <= 1) return 0.0;
  const double f = static_cast<double>(n - 1) / n;
  return op == Op::all_reduce ? 2.0 * f : f;
}

/// Element counts of one message of (nominal) `bytes`, following nccl-tests: `bytes` is the whole
/// buffer — the all_reduce/broadcast/reduce buffer, the all_gather/gather output, the
/// reduce_scatter/scatter input, one rank's all_to_all input, one send_recv message (barrier: 0).
/// For the split ops, each rank's block is floor(bytes / (n * elem)) elements, at least 1,
/// so tiny sizes round up (8 B of float on 4 ranks becomes 16 B: one float per rank).
struct Layout {
  std::size_t block = 0;      ///< elements of one rank's block (= count for all_reduce/broadcast/reduce/send_recv)
  std::size_t in_count = 0;   ///< elements this rank sends
  std::size_t out_count = 0;  ///< elements this rank receives (gather: on the root)
  std::size_t count = 0;      ///< elements of the whole buffer (the table's "count")
  std::size_t bytes = 0;      ///< bytes of the whole buffer (the table's "size")
  int world = 1;              ///< ranks
};

/// Elements rank `from` sends to rank `to` in all_to_all_v at nominal block `block`: block +- block/2
/// by the parity of from + to, so the counts differ per pair (and never reach 0) while a row of an
/// even world still sums to n * block.
[[nodiscard]] constexpr std::size_t a2av_count(int from, int to, std::size_t block) noexcept {
  return (from + to) % 2 ? block + block / 2 : block - block / 2;
}

[[nodiscard]] inline Layout layout(Op op, std::size_t bytes, std::size_t elem, int n) {
  Layout l;
  l.world = n;
  const auto un = static_cast<std::size_t>(n);
  switch (op) {
    case Op::all_reduce:
    case Op::broadcast:
    case Op::reduce:
    case Op::send_recv:
      l.block = std::max<std::size_t>(1, bytes / elem);
      l.in_count = l.out_count = l.count = l.block;
      break;
    case Op::all_gather:
    case Op::gather:
      l.block = std::max<std::size_t>(1, bytes / (elem * un));
      l.in_count = l.block;
      l.out_count = l.count = l.block * un;
      break;
    case Op::reduce_scatter:
    case Op::scatter:
      l.block = std::max<std::size_t>(1, bytes / (elem * un));
      l.in_count = l.count = l.block * un;
      l.out_count = l.block;
      break;
    case Op::all_to_all:
      l.block = std::max<std::size_t>(1, bytes / (elem * un));
      l.in_count = l.out_count = l.count = l.block * un;
      break;
    case Op::all_to_all_v:
      // count: the nominal n blocks; in/out_count: room for the largest row or column of counts.
      l.block = std::max<std::size_t>(1, bytes / (elem * un));
      l.count = l.block * un;
      l.in_count = l.out_count = (l.block + l.block / 2) * un;
      break;
    case Op::barrier: break;
  }
  l.bytes = l.count * elem;
  return l;
}

/// The items of a comma-separated list ("a,b,c"), in order; an empty item stays empty.
[[nodiscard]] inline std::vector<std::string> comma_list(std::string_view s) {
  std::vector<std::string> out;
  for (;;) {
    const std::size_t q = s.find(',');
    out.emplace_back(s.substr(0, q));
    if (q == std::string_view::npos) return out;
    s.remove_prefix(q + 1);
  }
}

/// Where one rank's buffers start, in bytes past a page boundary (--offset); -1: where std::vector
/// puts them.
struct Place {
  long in = -1, out = -1;
};

/// Rank `rank`'s entry of an --offset list: "IN" or "IN:OUT" per rank, comma separated, rank r
/// taking entry r mod the list's length. Throws std::invalid_argument on a malformed list.
[[nodiscard]] inline Place place_of(const std::string& list, int rank) {
  if (list.empty()) return {};
  const auto items = comma_list(list);
  auto number = [&](const std::string& v) {
    char* end = nullptr;
    const long x = v.empty() ? -1 : std::strtol(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || x < 0 || x >= 4096)
      throw std::invalid_argument("--offset: '" + v + "' is not a byte offset in 0..4095 (list: " + list + ")");
    return x;
  };
  for (const auto& item : items) {  // every entry checked on every rank: the same message everywhere
    const auto colon = item.find(':');
    (void)number(item.substr(0, colon));
    if (colon != std::string::npos) (void)number(item.substr(colon + 1));
  }
  const std::string& mine = items[static_cast<std::size_t>(rank) % items.size()];
  const auto colon = mine.find(':');
  Place p;
  p.in = number(mine.substr(0, colon));
  p.out = colon == std::string::npos ? p.in : number(mine.substr(colon + 1));
  return p;
}

/// "8", "64K", "1M", "64MiB", "2G" (binary multiples).
[[nodiscard]] inline std::size_t parse_bytes(std::string_view s) {
  std::size_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p == s.data()) throw std::invalid_argument("bad size '" + std::string(s) + "'");
  std::string_view suf(p, static_cast<std::size_t>(s.data() + s.size() - p));
  if (suf.ends_with("iB")) suf.remove_suffix(2);
  if (suf.ends_with("B") || suf.ends_with("b")) suf.remove_suffix(1);
  if (suf.empty()) return v;
  if (suf.size() == 1) {
    switch (suf[0]) {
      case 'K': case 'k': return v << 10;
      case 'M': case 'm': return v << 20;
      case 'G': case 'g': return v << 30;
      default: break;
    }
  }
  throw std::invalid_argument("bad size suffix in '" + std::string(s) + "' (use K, M or G)");
}

[[nodiscard]] inline std::string format_bytes(std::size_t b) {
  if (b >= (std::size_t{1} << 30) && b % (std::size_t{1} << 30) == 0) return std::to_string(b >> 30) + " GiB";
  if (b >= (std::size_t{1} << 20) && b % (std::size_t{1} << 20) == 0) return std::to_string(b >> 20) + " MiB";
  if (b >= (std::size_t{1} << 10) && b % (std::size_t{1} << 10) == 0) return std::to_string(b >> 10) + " KiB";
  return std::to_string(b) + " B";
}

/// Sizes from -b to -e multiplying by -f, or adding -i when `step` is not 0 (nccl-tests), or an
/// explicit comma-separated list.
[[nodiscard]] inline std::vector<std::size_t> size_list(std::size_t b, std::size_t e, std::size_t f,
                                                        std::string_view list, std::size_t step = 0) {
  std::vector<std::size_t> out;
  if (!list.empty()) {
    while (!list.empty()) {
      const auto comma = list.find(',');
      out.push_back(parse_bytes(list.substr(0, comma)));
      if (comma == std::string_view::npos) break;
      list.remove_prefix(comma + 1);
    }
    return out;
  }
  if (b > e) throw std::invalid_argument("-b " + std::to_string(b) + " is above -e " + std::to_string(e));
  if (step > 0) {
    // A bound on the row count, so that a typo (-i 1 -e 64G) fails now instead of running for days.
    if ((e - b) / step >= 100000) throw std::invalid_argument("-i " + std::to_string(step) + " gives over 100000 sizes");
    for (std::size_t s = b; s <= e; s += step) out.push_back(s);
    return out;
  }
  if (f < 2) throw std::invalid_argument("-f must be at least 2");
  for (std::size_t s = b; s <= e && s != 0; s *= f) {
    out.push_back(s);
    if (s > e / f) break;  // s * f would pass e (or wrap)
  }
  return out;
}

// ---- timing statistics ----

struct Stats {
  double median_us = 0, mean_us = 0, min_us = 0, max_us = 0;
};

[[nodiscard]] inline Stats stats(std::vector<double> t) {
  Stats s;
  if (t.empty()) return s;
  std::sort(t.begin(), t.end());
  const std::size_t n = t.size();
  s.median_us = n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
  double sum = 0;
  for (double x : t) sum += x;
  s.mean_us = sum / static_cast<double>(n);
  s.min_us = t.front();
  s.max_us = t.back();
  return s;
}

/// Iterations to time for one size: `iters`, cut so that one system spends about `budget_s`
/// seconds (0: no cut) at the warm-up's per-call time `warm_us` (already the max over ranks, so
/// every rank computes the same number), but never below `min_iters`.
[[nodiscard]] inline int plan_iters(int iters, int min_iters, double budget_s, double warm_us) {
  if (budget_s <= 0 || warm_us <= 0) return iters;
  const double fit = budget_s * 1e6 / warm_us;
  const int n = fit >= iters ? iters : static_cast<int>(fit);
  return std::max(std::min(min_iters, iters), n);
}

/// Peak resident set size of this process, KiB.
[[nodiscard]] inline long peak_rss_kb() noexcept {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss;
}

// ---- output ----

/// One measured row: one system, one op, one size.
struct Row {
  std::string system;  ///< "comm-gloo", "gloo-raw", "mpi-shm", "torch-gloo"...
  Op op = Op::all_reduce;
  std::string dtype = "float";
  std::string redop = "sum";  ///< "none" for non-reducing ops
  int root = -1;              ///< -1 for unrooted ops
  int world = 1;
  std::string placement = "out";  ///< "in" (in place) or "out"
  std::string algo;               ///< algorithm variant, "" for the default
  Layout l;
  int iters = 0;
  Stats t;
  long wrong = -1;  ///< -1: not checked
  double ratio = 0;  ///< time / baseline time, 0: no baseline
  std::string baseline;
};

[[nodiscard]] inline double algbw_gbs(const Row& r) { return r.t.median_us > 0 ? r.l.bytes / (r.t.median_us * 1e3) : 0; }
[[nodiscard]] inline double busbw_gbs(const Row& r) { return algbw_gbs(r) * bus_factor(r.op, r.world); }

inline std::string json_escape(std::string_view s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    o += c;
  }
  return o;
}

/// The JSON-lines schema every program prints (one object per line, rank 0 only).
inline void print_json(const Row& r, std::FILE* f = stdout) {
  std::fprintf(f,
               "{\"schema\":\"%s\",\"kind\":\"result\",\"system\":\"%s\",\"algo\":\"%s\",\"op\":\"%s\","
               "\"dtype\":\"%s\",\"redop\":\"%s\",\"root\":%d,\"world\":%d,\"placement\":\"%s\",\"bytes\":%zu,"
               "\"count\":%zu,\"block\":%zu,\"iters\":%d,\"time_us\":%.3f,\"mean_us\":%.3f,\"min_us\":%.3f,"
               "\"max_us\":%.3f,\"algbw_gbs\":%.6f,\"busbw_gbs\":%.6f",
               std::string(kSchema).c_str(), json_escape(r.system).c_str(), json_escape(r.algo).c_str(),
               std::string(to_string(r.op)).c_str(), r.dtype.c_str(), r.redop.c_str(), r.root, r.world,
               r.placement.c_str(), r.l.bytes, r.l.count, r.l.block, r.iters, r.t.median_us, r.t.mean_us, r.t.min_us,
               r.t.max_us, algbw_gbs(r), busbw_gbs(r));
  if (r.wrong >= 0)
    std::fprintf(f, ",\"wrong\":%ld", r.wrong);
  else
    std::fprintf(f, ",\"wrong\":null");
  if (r.ratio > 0) std::fprintf(f, ",\"baseline\":\"%s\",\"ratio\":%.4f", json_escape(r.baseline).c_str(), r.ratio);
  std::fprintf(f, "}\n");
  std::fflush(f);
}

/// Peak RSS of every rank (KiB), printed once at the end.
inline void print_json_memory(std::string_view system, int world, const std::vector<long>& rss_kb,
                              std::FILE* f = stdout) {
  std::fprintf(f, "{\"schema\":\"%s\",\"kind\":\"memory\",\"system\":\"%s\",\"world\":%d,\"peak_rss_kb\":[",
               std::string(kSchema).c_str(), json_escape(system).c_str(), world);
  for (std::size_t i = 0; i < rss_kb.size(); ++i) std::fprintf(f, "%s%ld", i ? "," : "", rss_kb[i]);
  std::fprintf(f, "]}\n");
  std::fflush(f);
}

inline void print_table_header(bool check, bool baseline, std::FILE* f = stdout) {
  std::fprintf(f, "#\n# %12s %12s %9s %6s %5s %10s %8s %8s %7s", "size", "count", "type", "redop", "root",
               "time", "algbw", "busbw", "#wrong");
  if (baseline) std::fprintf(f, " %10s %8s %7s %7s", "raw time", "raw bus", "#wrong", "ratio");
  std::fprintf(f, "\n# %12s %12s %9s %6s %5s %10s %8s %8s %7s", "(B)", "(elements)", "", "", "", "(us)", "(GB/s)",
               "(GB/s)", "");
  if (baseline) std::fprintf(f, " %10s %8s %7s %7s", "(us)", "(GB/s)", "", "c/raw");
  std::fprintf(f, "\n");
  (void)check;
  std::fflush(f);
}

inline void print_table_row(const Row& r, const Row* raw, std::FILE* f = stdout) {
  auto wrong = [](long w) { return w < 0 ? std::string("N/A") : std::to_string(w); };
  std::fprintf(f, "  %12zu %12zu %9s %6s %5d %10.2f %8.3f %8.3f %7s", r.l.bytes, r.l.count, r.dtype.c_str(),
               r.redop.c_str(), r.root, r.t.median_us, algbw_gbs(r), busbw_gbs(r), wrong(r.wrong).c_str());
  if (raw)
    std::fprintf(f, " %10.2f %8.3f %7s %7.3f", raw->t.median_us, busbw_gbs(*raw), wrong(raw->wrong).c_str(),
                 r.ratio);
  std::fprintf(f, "\n");
  std::fflush(f);
}

}  // namespace comm::bench
