#pragma once
// The measuring loop shared by comm-bench and the C++ peers: optional check, warm-up, iteration
// planning, alternating timed calls, cross-rank max per iteration, median.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <functional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bench.hpp"
#include "cli.hpp"

namespace comm::bench {

/// One system's operation at one size.
struct Candidate {
  std::function<void()> call;    ///< the operation, timed
  std::function<void()> fill;    ///< sets the inputs (and clears the outputs)
  std::function<long()> verify;  ///< wrong elements of this rank's result (after fill + call)
};

/// Element-wise reductions over ranks, in place, provided by the system that runs the benchmark.
struct CrossRank {
  std::function<void(std::span<double>)> max;
  std::function<void(std::span<double>)> sum;
};

struct Measured {
  int iters = 0;
  std::vector<Stats> t;     ///< per candidate
  std::vector<long> wrong;  ///< per candidate, summed over ranks; -1 when not checked
};

[[nodiscard]] inline double now_us() noexcept {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// Runs every candidate at one size. With several candidates, their calls alternate within each
/// iteration (and the order flips every iteration), so slow drifts of the machine hit all alike.
inline Measured measure(const Options& o, std::span<Candidate> cands, const CrossRank& x) {
  const std::size_t k = cands.size();
  Measured m;
  m.wrong.assign(k, -1);
  if (o.check) {
    std::vector<double> w(k);
    for (std::size_t c = 0; c < k; ++c) {
      cands[c].fill();
      cands[c].call();
      w[c] = static_cast<double>(cands[c].verify());
    }
    x.sum(w);
    for (std::size_t c = 0; c < k; ++c) m.wrong[c] = static_cast<long>(w[c]);
  }
  for (auto& c : cands) c.fill();

  auto round = [&](int i, std::vector<std::vector<double>>& t) {
    for (std::size_t j = 0; j < k; ++j) {
      const std::size_t c = (i % 2 == 0) ? j : k - 1 - j;
      const double t0 = now_us();
      cands[c].call();
      t[c].push_back(now_us() - t0);
      if (o.gap_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(o.gap_us));
    }
  };

  std::vector<std::vector<double>> warm(k);
  for (int i = 0; i < o.warmup; ++i) round(i, warm);
  std::vector<double> warm_us(k, 0.0);
  for (std::size_t c = 0; c < k; ++c) warm_us[c] = stats(warm[c]).median_us;
  x.max(warm_us);
  double per_round = 0;
  for (double w : warm_us) per_round += w;
  m.iters = plan_iters(o.iters, o.min_iters, o.budget_s, per_round);

  std::vector<std::vector<double>> t(k);
  for (auto& v : t) v.reserve(static_cast<std::size_t>(m.iters));
  for (int i = 0; i < m.iters; ++i) round(i, t);

  std::vector<double> flat;
  flat.reserve(k * static_cast<std::size_t>(m.iters));
  for (auto& v : t) flat.insert(flat.end(), v.begin(), v.end());
  x.max(flat);
  for (std::size_t c = 0; c < k; ++c)
    m.t.push_back(stats({flat.begin() + static_cast<std::ptrdiff_t>(c * static_cast<std::size_t>(m.iters)),
                         flat.begin() + static_cast<std::ptrdiff_t>((c + 1) * static_cast<std::size_t>(m.iters))}));
  return m;
}

/// What the rows of one measured size are called: candidate 0 is `system`, candidate 1 (when
/// measured) `baseline`, and candidate 0's row carries the ratio of their medians.
struct RowNames {
  std::string system;
  std::string algo;
  std::string baseline;  ///< empty: one candidate
  std::string baseline_algo;
};

/// Builds the rows of `m`, prints them on rank 0 (JSON lines or the table) and returns the wrong
/// elements they counted (0 when not checked).
inline long report(const Options& o, int rank, int world, Op op, std::string dtype, bool inplace, const Layout& l,
                   const Measured& m, const RowNames& names) {
  Row r;
  r.system = names.system;
  r.algo = names.algo;
  r.op = op;
  r.dtype = std::move(dtype);
  r.redop = is_reduction(op) ? o.redop : "none";
  r.root = is_rooted(op) ? o.root : -1;
  r.world = world;
  r.placement = inplace ? "in" : "out";
  r.l = l;
  r.iters = m.iters;
  // send_recv times a round trip: its row is one way (half), as osu_latency reports.
  auto one_way = [op](Stats t) {
    if (op == Op::send_recv) {
      t.median_us /= 2;
      t.mean_us /= 2;
      t.min_us /= 2;
      t.max_us /= 2;
    }
    return t;
  };
  r.t = one_way(m.t[0]);
  r.wrong = op == Op::barrier ? -1 : m.wrong[0];  // a barrier has no result to check
  long wrong = std::max(0L, r.wrong);
  const bool baseline = !names.baseline.empty() && m.t.size() > 1;
  Row rr = r;
  if (baseline) {
    rr.system = names.baseline;
    rr.algo = names.baseline_algo;
    rr.t = one_way(m.t[1]);
    rr.wrong = op == Op::barrier ? -1 : m.wrong[1];
    wrong += std::max(0L, rr.wrong);
    r.baseline = names.baseline;
    r.ratio = rr.t.median_us > 0 ? r.t.median_us / rr.t.median_us : 0;
  }
  if (rank == 0) {
    if (o.json) {
      print_json(r);
      if (baseline) print_json(rr);
    } else {
      print_table_row(r, baseline ? &rr : nullptr);
    }
  }
  return wrong;
}

}  // namespace comm::bench
