// Chaos soak (issue 16): random faults at random points of random collective loops, and the
// liveness watch (detail/liveness.hpp) that ends every survivor's operation within a second.
//
// Each trial draws a backend (gloo, shm), a world of 2-4 fault_peer ranks, a collective, its size,
// sync or async, a fault (SIGKILL, or SIGSTOP: a silent rank; a victim of rank 0 also kills or
// stops the store it hosts), a victim and a point (after 1-16 operations, plus 0-20 ms). The
// ranks run with COMM_TIMEOUT=10s, far beyond the 1 s the liveness watch needs. Checked per trial:
//   - no hang: a hard guard (40 s) aborts the battery naming the trial;
//   - every survivor ends with RemoteError naming the victim ("rank V": 100 % attribution);
//   - in time: SIGKILL within 1 s, SIGSTOP within the liveness silence (1 s here) + 1 s;
//   - except on Gloo, for a survivor whose send libgloo had started writing: nothing wakes that
//     wait but its own timeout (Known limits 1 in docs/RELIABILITY.md), so its operation ends at
//     COMM_TIMEOUT (Timeout, or the liveness watch's RemoteError recorded meanwhile); counted,
//     reported, and allowed for at most 10 % of Gloo survivors;
//   - nothing left: no comm-shm-* in /dev/shm, no zombie child.
// At the end it prints the time-to-error distribution (p50, p99, max) per fault.
//
// COMM_CHAOS_TRIALS (default 200: what CI runs, about 2.5 minutes on 2 cores) and COMM_CHAOS_SEED
// (default 16) choose the run; `COMM_CHAOS_TRIALS=2000 fault_battery --test-suite=chaos` soaks
// longer.
#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <random>

#include "battery.hpp"

using namespace comm::faults;

namespace {

constexpr double kill_bound_ms = 1000;
constexpr double silence_ms = 1000;  // COMM_LIVENESS_SILENCE for the trials
constexpr double stop_bound_ms = silence_ms + 1000;
constexpr double timeout_ms = 10000;  // COMM_TIMEOUT for the trials

long long mono_ns_of(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

/// Segments created by `pids` (Shm names them comm-shm-<creator pid>-...) still in /dev/shm:
/// other jobs on this machine may have theirs there at the same time.
std::string shm_leftovers(const std::vector<pid_t>& pids) {
  std::string left;
  if (auto* d = ::opendir("/dev/shm")) {
    while (auto* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (!n.starts_with("comm-shm-")) continue;
      const long creator = std::atol(n.c_str() + 9);
      for (pid_t p : pids)
        if (creator == p) left += " " + n;
    }
    ::closedir(d);
  }
  return left;
}

/// Children of this process that are zombies (exited, not reaped).
std::string zombies() {
  std::string z;
  const std::string me = std::to_string(::getpid());
  if (auto* d = ::opendir("/proc")) {
    while (auto* e = ::readdir(d)) {
      const std::string pid = e->d_name;
      if (pid.empty() || pid.find_first_not_of("0123456789") != std::string::npos) continue;
      std::ifstream f("/proc/" + pid + "/stat");
      std::string line;
      if (!std::getline(f, line)) continue;
      const auto close = line.rfind(')');
      if (close == std::string::npos) continue;
      char state = 0;
      long ppid = 0;
      if (std::sscanf(line.c_str() + close + 1, " %c %ld", &state, &ppid) != 2) continue;
      if (state == 'Z' && std::to_string(ppid) == me) z += " " + pid;
    }
    ::closedir(d);
  }
  return z;
}

struct Trial {
  std::string backend, op, fault;
  int n = 2, victim = 0, after = 1, delay_ms = 0;
  std::size_t count = 1;
  bool async = false;
  [[nodiscard]] std::string name(int i) const {
    return "chaos #" + std::to_string(i) + ": " + backend + " " + std::to_string(n) + " ranks, " + op + " x" +
           std::to_string(count) + (async ? " async" : "") + ", " + fault + " rank " + std::to_string(victim) +
           " after op " + std::to_string(after) + " + " + std::to_string(delay_ms) + " ms";
  }
};

Trial draw(std::mt19937& rng) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  static const char* backends[] = {"gloo", "shm"};
  static const char* ops[] = {"all_reduce", "broadcast", "all_gather", "gather", "reduce_scatter", "barrier"};
  static const std::size_t counts[] = {1, 256, 1 << 14, 1 << 18};
  Trial t;
  t.backend = backends[pick(0, 1)];
  t.n = pick(2, 4);
  t.op = ops[pick(0, 5)];
  t.count = counts[pick(0, 3)];
  if (t.op == "reduce_scatter") t.count = (t.count + 3) / 4 * 4;
  t.async = pick(0, 1) == 1;
  t.fault = pick(0, 2) == 0 ? "SIGSTOP" : "SIGKILL";  // deaths twice as often: they are the 1 s target
  t.victim = pick(0, t.n - 1);
  t.after = 1 << pick(0, 4);
  t.delay_ms = pick(0, 20);
  return t;
}

std::vector<double> g_kill_ms, g_stop_ms, g_missed_ms;
int g_gloo_survivors = 0, g_gloo_missed = 0;

void run_trial(int i, const Trial& t) {
  const std::string name = t.name(i);
  HangGuard guard(name, 40s);
  INFO(name);
  auto w = start_world(
      t.n, free_port(), "10s",
      [&](int) {
        std::vector<std::string> a{t.backend, "--op", t.op, "--count", std::to_string(t.count), "--iters", "-1",
                                   "--no-check"};
        if (t.async) a.push_back("--async");
        return a;
      },
      {{"COMM_LIVENESS_SILENCE", "1s"}});
  REQUIRE_MESSAGE(w.all_said("ITER " + std::to_string(t.after), 20s), w.outputs());
  std::this_thread::sleep_for(std::chrono::milliseconds(t.delay_ms));
  auto& v = w[static_cast<std::size_t>(t.victim)];
  const auto t_fault = Clock::now();
  v.signal(t.fault == "SIGKILL" ? SIGKILL : SIGSTOP);
  const double bound = t.fault == "SIGKILL" ? kill_bound_ms : stop_bound_ms;
  for (int r = 0; r < t.n; ++r) {
    if (r == t.victim) continue;
    auto res = result_of(w[static_cast<std::size_t>(r)], 25s);
    CHECK_MESSAGE(!res.empty(), w.outputs());
    if (res.empty()) continue;
    INFO(res["what"]);
    CHECK(res["status"] == "error");
    CHECK(res["rank"] == std::to_string(r));
    if (res.count("t_ns") == 0) continue;
    const double ms = static_cast<double>(std::stoll(res["t_ns"]) - mono_ns_of(t_fault)) / 1e6;
    if (t.backend == "gloo") ++g_gloo_survivors;
    if (t.backend == "gloo" && ms >= timeout_ms - 500) {
      ++g_gloo_missed;  // libgloo's unwoken send (see above)
      CHECK(ms < timeout_ms + 3000);
      g_missed_ms.push_back(ms);
      report(name + ": rank " + std::to_string(r) + " (libgloo send not woken)", res["kind"], ms, timeout_ms + 3000,
             res["what"]);
    } else {
      CHECK(res["kind"] == "RemoteError");
      CHECK(res["peer"] == "rank_" + std::to_string(t.victim));
      CHECK(ms < bound);
      (t.fault == "SIGKILL" ? g_kill_ms : g_stop_ms).push_back(ms);
      report(name + ": rank " + std::to_string(r), res["kind"], ms, bound, res["what"]);
    }
    CHECK_MESSAGE(w[static_cast<std::size_t>(r)].wait_or_kill(10s).code == 10, w.outputs());
  }
  if (t.fault == "SIGSTOP") v.signal(SIGKILL);  // a stopped rank would wait for its 60 s timeout
  (void)v.wait_or_kill(10s);
  std::vector<pid_t> pids;
  for (const auto& p : w.ranks) pids.push_back(p->pid());
  w.ranks.clear();  // reaps every rank
  const std::string shm = shm_leftovers(pids), zombie = zombies();
  const std::string shm_msg = "left in /dev/shm:" + shm, zombie_msg = "zombie children:" + zombie;
  CHECK_MESSAGE(shm.empty(), shm_msg);
  CHECK_MESSAGE(zombie.empty(), zombie_msg);
}

void summary(const char* what, const std::vector<double>& v, double bound) {
  char msg[256];
  std::snprintf(msg, sizeof msg, "p50 %.1f ms, p99 %.1f ms, max %.1f ms over %zu survivors", percentile(v, 50),
                percentile(v, 99), percentile(v, 100), v.size());
  report(std::string("chaos: time to error after ") + what, "summary", percentile(v, 99), bound, msg);
}

}  // namespace

TEST_SUITE("chaos") {

TEST_CASE("chaos soak: random faults at random points; every survivor fails in time, naming the victim") {
  const int trials = env_int("COMM_CHAOS_TRIALS", 200);
  const int seed = env_int("COMM_CHAOS_SEED", 16);
  std::mt19937 rng(static_cast<std::mt19937::result_type>(seed));
  g_kill_ms.clear();
  g_stop_ms.clear();
  g_missed_ms.clear();
  g_gloo_survivors = g_gloo_missed = 0;
  const auto t0 = Clock::now();
  for (int i = 0; i < trials; ++i) run_trial(i, draw(rng));
  summary("SIGKILL", g_kill_ms, kill_bound_ms);
  summary("SIGSTOP", g_stop_ms, stop_bound_ms);
  report("chaos: Gloo survivors whose send libgloo did not wake (Timeout at COMM_TIMEOUT)", "summary",
         static_cast<double>(g_gloo_missed), 0.1 * g_gloo_survivors,
         std::to_string(g_gloo_missed) + " of " + std::to_string(g_gloo_survivors) + " Gloo survivors");
  CHECK(g_gloo_missed * 10 <= g_gloo_survivors);
  std::printf("chaos: %d trials (seed %d) in %.1f s\n", trials, seed,
              std::chrono::duration<double>(Clock::now() - t0).count());
}

}  // TEST_SUITE
