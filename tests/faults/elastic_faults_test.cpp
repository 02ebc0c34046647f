// Fault-tolerant communicators with real processes (docs/RELIABILITY.md, "Fault-tolerant
// communicators"): examples/data_parallel_training --elastic on 4 ranks, with ranks SIGKILLed at
// chosen steps (any rank, rank 0 included), revoked, or replaced by comm-run --max-restarts. The
// survivors must shrink, finish, and print the fault-free run's final loss (to 5 significant
// digits); nothing may hang (each job has a hard deadline) and nothing may be left in /dev/shm.
//
// COMM_ELASTIC_TRIALS (default 6 per backend) sets the shrink trials, COMM_ELASTIC_SOAK (default
// 100) the soak's comm-run jobs; both print their recovery times (kill -> the survivors' first
// completed step on the shrunk communicator), p50/p99/max.
#include <dirent.h>
#include <signal.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <random>
#include <set>

#include "battery.hpp"

namespace comm::faults {
namespace {

#if defined(COMM_FAULT_ELASTIC_EXE)
constexpr const char* trainer = COMM_FAULT_ELASTIC_EXE;
constexpr int kRanks = 4;
constexpr int kSteps = 40;
constexpr milliseconds kJobDeadline{90'000};
const std::string kTimeout = "30s";

int env_count(const char* name, int fallback) {
  return static_cast<int>(detail::env_nonneg_int(name, "fault battery").value_or(fallback));
}

/// Hierarchical on one machine: two fake nodes, ranks {0, 2} and {1, 3}.
Process::Env backend_env(const std::string& backend, int rank) {
  if (backend == "hierarchical") return {{"COMM_NODE_ID", "node" + std::to_string(rank % 2)}};
  return {};
}

std::vector<std::string> trainer_args(const std::string& backend, const std::string& extra_flag = {},
                                      const std::string& extra_value = {}) {
  std::vector<std::string> a{trainer, "--backend", backend, "--elastic", "--steps", std::to_string(kSteps)};
  if (!extra_flag.empty()) {
    a.push_back(extra_flag);
    a.push_back(extra_value);
  }
  return a;
}

/// What a job printed that these tests read.
struct JobOutcome {
  std::vector<double> finals;   // "final loss X" lines (one expected)
  long long kill_ns = 0;        // the earliest KILL t_ns
  long long recovered_ns = 0;   // the latest RECOVERED t_ns
  std::string text;             // everything, for failure messages
};

JobOutcome read_outcome(const std::string& text) {
  JobOutcome o;
  o.text = text;
  std::size_t at = 0;
  while (at < text.size()) {
    const auto nl = std::min(text.find('\n', at), text.size());
    const std::string line = text.substr(at, nl - at);
    at = nl + 1;
    if (const auto p = line.find("final loss "); p != std::string::npos) o.finals.push_back(std::stod(line.substr(p + 11)));
    const auto t = line.find("t_ns=");
    if (t == std::string::npos) continue;
    const long long ns = std::stoll(line.substr(t + 5));
    if (line.find("KILL ") != std::string::npos && (o.kill_ns == 0 || ns < o.kill_ns)) o.kill_ns = ns;
    if (line.find("RECOVERED ") != std::string::npos) o.recovered_ns = std::max(o.recovered_ns, ns);
  }
  return o;
}

bool same_loss(double a, double b) { return std::fabs(a - b) <= 1e-5 * std::fabs(b); }

/// comm's segments in /dev/shm whose creator ("comm-shm-<pid>-...") is no longer alive: what a
/// job left behind (segments of jobs that other tests run meanwhile have live creators).
std::set<std::string> orphaned_segments() {
  std::set<std::string> out;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (const dirent* e = ::readdir(d)) {
      const std::string_view name = e->d_name;
      if (!name.starts_with("comm-shm-")) continue;
      const auto pid = std::atoi(std::string(name.substr(9)).c_str());
      if (pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH) out.insert(std::string(name));
    }
    ::closedir(d);
  }
  return out;
}

/// 4 trainer ranks whose store this process hosts (as comm-run would), so that any rank may die.
/// Returns every rank's output once all ended (CHECKs: the killed ranks by SIGKILL, the rest 0).
JobOutcome run_direct(const std::string& backend, const std::vector<std::string>& args, const std::set<int>& killed,
                      const std::function<void(std::uint16_t port)>& meanwhile = {}) {
  TcpStoreOptions so;
  so.is_server = true;
  so.rank = -1;
  so.token = "fault-battery-token";
  TcpStore store("127.0.0.1", 0, so);
  World w;
  for (int r = 0; r < kRanks; ++r) {
    auto env = rank_env(r, kRanks, store.port(), kTimeout);
    env["COMM_AGENT_STORE"] = "1";
    for (const auto& [k, v] : backend_env(backend, r)) env[k] = v;
    w.ranks.push_back(std::make_unique<Process>(args, env));
  }
  if (meanwhile) meanwhile(store.port());
  const auto deadline = Clock::now() + kJobDeadline;
  for (int r = 0; r < kRanks; ++r) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    const Exit e = w[static_cast<std::size_t>(r)].wait_or_kill(std::max(left, milliseconds(1)));
    INFO("rank " << r << ": " << e.str() << "\n" << w.outputs());
    if (killed.count(r) != 0)
      CHECK(e.signal == SIGKILL);
    else
      CHECK((e.exited && e.code == 0));
  }
  return read_outcome(w.outputs());
}

/// The fault-free run's final loss on `backend` (once per backend).
double reference_loss(const std::string& backend) {
  static std::map<std::string, double> cache;
  if (auto it = cache.find(backend); it != cache.end()) return it->second;
  const auto o = run_direct(backend, trainer_args(backend), {});
  REQUIRE(o.finals.size() == 1);
  return cache[backend] = o.finals.front();
}

void summary(const std::string& what, const std::vector<double>& ms) {
  if (ms.empty()) return;
  std::printf("%s: %zu trials, recovery p50 %.1f ms, p99 %.1f ms, max %.1f ms\n", what.c_str(), ms.size(),
              percentile(ms, 50), percentile(ms, 99), percentile(ms, 100));
  std::fflush(stdout);
}

TEST_SUITE("elastic") {
  TEST_CASE("elastic: survivors shrink and finish with the fault-free loss, whichever rank dies (rank 0 too)") {
    std::mt19937 rng(20261126);
    const int trials = env_count("COMM_ELASTIC_TRIALS", 6);
    for (const std::string backend : {"gloo", "shm", "hierarchical"}) {
      CAPTURE(backend);
      const double ref = reference_loss(backend);
      std::vector<double> recovery;
      for (int t = 0; t < trials; ++t) {
        const int victim = t < kRanks ? t : static_cast<int>(rng() % kRanks);  // every rank at least once
        const int step = 3 + static_cast<int>(rng() % (kSteps - 8));
        CAPTURE(victim);
        CAPTURE(step);
        const auto o = run_direct(backend, trainer_args(backend, "--kill", std::to_string(victim) + ":" + std::to_string(step)),
                                  {victim});
        INFO(o.text);
        REQUIRE(o.finals.size() == 1);
        CHECK(same_loss(o.finals.front(), ref));
        REQUIRE(o.kill_ns > 0);
        REQUIRE(o.recovered_ns > o.kill_ns);
        recovery.push_back(static_cast<double>(o.recovered_ns - o.kill_ns) / 1e6);
      }
      summary(backend + " shrink after SIGKILL, 4 ranks", recovery);
      // COMM_TIMEOUT is 30 s: a recovery that waited for it would show here.
      CHECK(percentile(recovery, 100) < 10'000);
    }
  }

  TEST_CASE("elastic: a lost node (both ranks of one fake node) is a shrink on Hierarchical") {
    const double ref = reference_loss("hierarchical");
    const auto o = run_direct("hierarchical", trainer_args("hierarchical", "--kill", "1:7,3:7"), {1, 3});
    INFO(o.text);
    REQUIRE(o.finals.size() == 1);
    CHECK(same_loss(o.finals.front(), ref));
  }

  TEST_CASE("elastic: revoke ends everyone's step; they shrink to the same members and finish") {
    for (const std::string backend : {"gloo", "shm"}) {
      CAPTURE(backend);
      const double ref = reference_loss(backend);
      const auto o = run_direct(backend, trainer_args(backend, "--revoke-step", "9"), {});
      INFO(o.text);
      CHECK(contains(o.text, "rank 0 revoked the communicator"));
      REQUIRE(o.finals.size() == 1);
      CHECK(same_loss(o.finals.front(), ref));
    }
  }

  TEST_CASE("elastic: where the store lived in the rank that died, shrink says so") {
    // Rank 0 hosts the store (no COMM_AGENT_STORE): its death takes the store with it.
    const int port = free_port();
    World w;
    for (int r = 0; r < kRanks; ++r)
      w.ranks.push_back(std::make_unique<Process>(trainer_args("gloo", "--kill", "0:5"), rank_env(r, kRanks, port, kTimeout)));
    for (int r = 0; r < kRanks; ++r) {
      const Exit e = w[static_cast<std::size_t>(r)].wait_or_kill(kJobDeadline);
      INFO("rank " << r << ": " << e.str() << "\n" << w.outputs());
      CHECK(!e.killed_by_us);
      if (r != 0) CHECK((e.exited && e.code != 0));
    }
    INFO(w.outputs());
    CHECK(contains(w.outputs(), "the store is gone with rank 0, which hosted it"));
  }

  TEST_CASE("elastic: a stranger without the job's token cannot join; the members see nothing") {
    const double ref = reference_loss("shm");
    std::string stranger_out;
    Exit stranger_exit;
    const auto o = run_direct("shm", trainer_args("shm"), {}, [&](std::uint16_t port) {
      for (const char* token : {"wrong-token", ""}) {
        auto env = rank_env(1, kRanks, port, "5s", token);
        env["COMM_RESTART_COUNT"] = "1";  // it claims to replace rank 1
        Process stranger(trainer_args("shm"), env);
        stranger_exit = stranger.wait_or_kill(milliseconds(20'000));
        stranger_out += stranger.output();
        INFO(stranger_out);
        CHECK((stranger_exit.exited && stranger_exit.code != 0));
        CHECK(!contains(stranger_out, "joined as rank"));
      }
    });
    INFO(o.text);
    CHECK(contains(stranger_out, "token"));
    REQUIRE(o.finals.size() == 1);
    CHECK(same_loss(o.finals.front(), ref));
    CHECK(!contains(o.text, "grew from"));  // nobody got in
  }

  TEST_CASE("elastic soak: random kills under comm-run --max-restarts; replacements rejoin; same final loss") {
    std::mt19937 rng(7);
    const int jobs = env_count("COMM_ELASTIC_SOAK", 100);
    const auto orphans_before = orphaned_segments();
    const std::string backends[] = {"gloo", "shm", "hierarchical"};
    int joined = 0, restarts = 0;
    std::vector<double> rejoin_ms;  // a replacement's start -> it is a member
    for (int j = 0; j < jobs; ++j) {
      const std::string backend = backends[j % 3];
      const double ref = reference_loss(backend);
      const int kills = 1 + static_cast<int>(rng() % 2);
      std::string plan;
      std::set<int> victims;
      while (static_cast<int>(victims.size()) < kills) victims.insert(static_cast<int>(rng() % kRanks));
      for (int v : victims) plan += (plan.empty() ? "" : ",") + std::to_string(v) + ":" + std::to_string(2 + rng() % (kSteps - 6));
      CAPTURE(backend);
      CAPTURE(plan);
      std::vector<std::string> argv{comm_run, "-n", std::to_string(kRanks), "--max-restarts", "2"};
      // Hierarchical's two fake nodes: the node follows the launcher's RANK (a replacement's too).
      if (backend == "hierarchical")
        for (const char* a : {"sh", "-c", "COMM_NODE_ID=node$((RANK % 2)) exec \"$0\" \"$@\""}) argv.push_back(a);
      for (auto& a : trainer_args(backend, "--kill", plan)) argv.push_back(a);
      Process job(argv, {{"COMM_TIMEOUT", kTimeout}});
      const Exit e = job.wait_or_kill(kJobDeadline);
      const auto o = read_outcome(job.output());
      INFO(e.str() << "\n" << o.text);
      REQUIRE((e.exited && e.code == 0));
      REQUIRE(o.finals.size() == 1);
      CHECK(same_loss(o.finals.front(), ref));
      for (const auto& l : job.lines()) {
        restarts += contains(l, "restarting it") ? 1 : 0;
        if (const auto p = l.find("ms after its start"); p != std::string::npos) {
          ++joined;
          const auto comma = l.rfind(", ", p);
          rejoin_ms.push_back(std::stod(l.substr(comma + 2, p - comma - 3)));
        }
      }
    }
    std::printf("elastic soak: %d jobs, %d restarts, %d replacements joined (the others found the job finished)\n", jobs,
                restarts, joined);
    if (!rejoin_ms.empty())
      std::printf("elastic soak: rejoin (a replacement's start -> member) p50 %.1f ms, p99 %.1f ms, max %.1f ms\n",
                  percentile(rejoin_ms, 50), percentile(rejoin_ms, 99), percentile(rejoin_ms, 100));
    CHECK(restarts >= jobs);  // every job lost at least one rank
    CHECK(joined > 0);
    CHECK(orphaned_segments() == orphans_before);  // no segment left behind
  }
}
#endif

}  // namespace
}  // namespace comm::faults
