#pragma once
// monitored_barrier over a Store (backend-neutral): rank 0 collects the arrivals of the others
// and names the ranks that did not arrive in time.
//
// Barrier #i of a communicator uses the keys `<prefix>/<i>/arrived/<r>` and `<prefix>/<i>/release`:
//   - rank r > 0 sets its arrival key, then waits for the release key: "ok", or rank 0's verdict
//     naming the missing ranks (then comm::Timeout with that text). It waits the timeout plus a
//     grace of min(timeout, 10 s) for rank 0, which may have arrived later than it; past that it
//     throws comm::Timeout naming rank 0 (late, hung or dead).
//   - rank 0 waits for the arrival keys in rank order until its deadline (arrival + timeout). With
//     wait_all_ranks it then checks every remaining rank and names them all; otherwise it stops at
//     the first missing rank. It publishes the verdict, then throws comm::Timeout naming the missing
//     ranks (peer: the first of them). A rank that arrives after the verdict reads it and throws too.
// After a successful barrier #i rank 0 deletes that barrier's arrival keys and the release key of
// #i-1 (every rank has read it: they all arrived at #i), so the store does not grow.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <comm/error.hpp>
#include <comm/store.hpp>

namespace comm::detail {

inline void monitored_barrier(Store& store, const std::string& prefix, std::uint64_t index, int rank, int size,
                              std::chrono::milliseconds timeout, bool wait_all_ranks) {
  using namespace std::chrono;
  const std::string op = "monitored_barrier";
  if (size <= 1) return;
  const std::string base = prefix + "/" + std::to_string(index) + "/";
  const std::string release = base + "release";
  const std::string timeout_text = std::to_string(timeout.count()) + " ms";

  if (rank != 0) {
    store.set(base + "arrived/" + std::to_string(rank), "1");
    const auto grace = std::min<milliseconds>(timeout, seconds(10));
    try {
      store.wait({release}, timeout + grace);
    } catch (const Timeout&) {
      throw Timeout(op, rank,
                    "rank 0 did not complete monitored_barrier #" + std::to_string(index) + " within " +
                        std::to_string((timeout + grace).count()) +
                        " ms (rank 0 collects the arrivals: it is late, hung or dead)",
                    "0");
    }
    const auto v = store.get(release);
    const std::string verdict(v.begin(), v.end());
    if (verdict == "ok") return;
    const auto colon = verdict.find(':');
    throw Timeout(op, rank, "monitored_barrier #" + std::to_string(index) + " failed: rank 0 reports that " +
                                (colon == std::string::npos ? verdict : verdict.substr(colon + 1)),
                  colon == std::string::npos ? std::string() : verdict.substr(0, colon));
  }

  const auto deadline = steady_clock::now() + timeout;
  std::vector<int> missing;
  for (int r = 1; r < size; ++r) {
    const std::string key = base + "arrived/" + std::to_string(r);
    const auto left = duration_cast<milliseconds>(deadline - steady_clock::now());
    if (left.count() > 0) {
      try {
        store.wait({key}, left);
      } catch (const Timeout&) {
        missing.push_back(r);
      }
    } else if (!store.check(key)) {
      missing.push_back(r);
    }
    if (!missing.empty() && !wait_all_ranks) break;
  }
  if (missing.empty()) {
    store.set(release, "ok");
    for (int r = 1; r < size; ++r) store.delete_key(base + "arrived/" + std::to_string(r));
    if (index > 0) store.delete_key(prefix + "/" + std::to_string(index - 1) + "/release");
    return;
  }
  std::string who = missing.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < missing.size(); ++i) who += (i ? ", " : "") + std::to_string(missing[i]);
  std::string what = who + " did not arrive within " + timeout_text;
  if (!wait_all_ranks && missing.front() < size - 1)
    what += " (the first missing rank; later ranks were not checked: pass wait_all_ranks to name them all)";
  store.set(release, std::to_string(missing.front()) + ":" + what);
  throw Timeout(op, 0, what, std::to_string(missing.front()));
}

}  // namespace comm::detail
