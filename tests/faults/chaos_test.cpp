// Chaos soak: random faults at random points of random collective loops, and the
// liveness watch (detail/engine/liveness.hpp) that ends every survivor's operation within a second.
//
// Each trial draws a fault, a backend (gloo, shm), a world of 2-4 fault_peer ranks, a collective,
// its size, sync or async, a victim and a point (after 1-16 operations, plus 0-20 ms). Faults, and
// what each must lead to (besides, always: no hang, a hard guard of 40 s aborting the battery
// naming the trial; nothing left in /dev/shm (comm-shm-*); no zombie child):
//
//   SIGKILL (2 in 5)  the victim dies (rank 0: with the store it hosts, env:// init). Every
//                     survivor ends with RemoteError naming it ("rank V": the liveness watch's
//                     verdict), within 1 s.
//   SIGSTOP (1 in 5)  the victim goes silent. The same, within the liveness silence (1 s) + 1 s.
//   link cut (1 in 5, Gloo only: Shm has no links) every rank connects through the battery's
//                     proxies (fault_peer --proxy-store, ProxyBroker), and the proxies of every
//                     pair that involves the victim reset their connections and refuse new ones: a
//                     partition that leaves the victim alone (store links untouched). Every rank,
//                     the victim too, ends with RemoteError within 1 s. No process died: what
//                     the liveness watch carries is the first rank whose operation failed on a
//                     reset connection (Liveness::announce_failure). A survivor names the victim,
//                     or another survivor whose failure reached it first (it was waiting only on
//                     that one: a gather or broadcast root); the victim names one of the others.
//                     COMM_TIMEOUT=3s here (see the libgloo exception below).
//   store kill (1 in 5) the TcpStore runs in a process of its own (fault_peer store-server
//                     external, hosted by no rank, like a launcher's agent; the ranks use
//                     --client-store) and is SIGKILLed. The store is not on the data path: no
//                     rank may fail; each completes operations after the kill (an ITER line it
//                     had not printed then) and its whole run (--iters after+32, paced 5 ms per
//                     operation so the run outlasts the kill) and exits 0: destroying a
//                     communicator must not wait for a store that is gone. What it costs: the
//                     liveness watch ends with the store, so a later death is seen by the data
//                     path or COMM_TIMEOUT only.
//
// The exception: on Gloo, a wait libgloo does not wake on a reset connection (a send it had
// started writing: Known limits 1 in docs/RELIABILITY.md) ends only when the communicator closes
// (comm's WaitGate). After a SIGKILL or SIGSTOP the liveness watch's verdict closes it (no
// exception allowed). After a link cut it is the announcement of another rank's failure; should
// no rank of a trial see the reset, its waits end at COMM_TIMEOUT: counted, reported, and allowed
// for at most 1 in 20 of the link-cut ranks (0 of 122 measured; 9-18 % before the announcement).
// The ranks run with COMM_TIMEOUT=10s (3s for link cuts), far beyond the 1 s the liveness watch
// and a reset need. At the end it prints the time-to-error distribution (p50, p99, max) per fault
// (for a store kill, where no error is expected, the time to each rank's normal end).
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
#include <map>
#include <memory>
#include <random>

#include "battery.hpp"

using namespace comm::faults;

namespace {

constexpr double kill_bound_ms = 1000;
constexpr double silence_ms = 1000;  // COMM_LIVENESS_SILENCE for the trials
constexpr double stop_bound_ms = silence_ms + 1000;
constexpr double timeout_ms = 10000;  // COMM_TIMEOUT for the trials
// COMM_TIMEOUT for link-cut trials: should no rank see the reset, nothing but this ends a trial
// (no process dies); short, so such a trial costs 3 s, not 10.
constexpr double cut_timeout_ms = 3000;

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

enum class Fault { sigkill, sigstop, link_cut, store_kill };

const char* fault_name(Fault f) {
  switch (f) {
    case Fault::sigkill: return "SIGKILL";
    case Fault::sigstop: return "SIGSTOP";
    case Fault::link_cut: return "link cut";
    case Fault::store_kill: return "store kill";
  }
  return "?";
}

struct Trial {
  std::string backend, op;
  Fault fault = Fault::sigkill;
  int n = 2, victim = 0, after = 1, delay_ms = 0;
  std::size_t count = 1;
  bool async = false;
  [[nodiscard]] std::string name(int i) const {
    const std::string what =
        fault == Fault::store_kill ? std::string("store kill") : std::string(fault_name(fault)) + " rank " + std::to_string(victim);
    return "chaos #" + std::to_string(i) + ": " + backend + " " + std::to_string(n) + " ranks, " + op + " x" +
           std::to_string(count) + (async ? " async" : "") + ", " + what + " after op " + std::to_string(after) +
           " + " + std::to_string(delay_ms) + " ms";
  }
};

Trial draw(std::mt19937& rng) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  static const char* backends[] = {"gloo", "shm"};
  static const char* ops[] = {"all_reduce", "broadcast", "all_gather", "gather", "reduce_scatter", "barrier"};
  static const std::size_t counts[] = {1, 256, 1 << 14, 1 << 18};
  // Deaths twice as often as each other fault: they are the 1 s target.
  static const Fault faults[] = {Fault::sigkill, Fault::sigkill, Fault::sigstop, Fault::link_cut, Fault::store_kill};
  Trial t;
  t.fault = faults[pick(0, 4)];
  t.backend = backends[pick(0, 1)];
  if (t.fault == Fault::link_cut) t.backend = "gloo";  // Shm has no links to cut
  t.n = pick(2, 4);
  t.op = ops[pick(0, 5)];
  t.count = counts[pick(0, 3)];
  if (t.op == "reduce_scatter") t.count = (t.count + 3) / 4 * 4;
  t.async = pick(0, 1) == 1;
  t.victim = pick(0, t.n - 1);
  if (t.fault == Fault::store_kill) t.victim = -1;
  t.after = 1 << pick(0, 4);
  t.delay_ms = pick(0, 20);
  return t;
}

// Time from the fault to each rank's error, per fault; for a store kill (no error expected) to
// each rank's normal end.
std::map<Fault, std::vector<double>> g_ms;
int g_cut_ranks = 0, g_cut_missed = 0;  // link-cut ranks (victims too), and those libgloo did not wake
int g_cut_victims = 0, g_cut_victims_missed = 0;  // of which victims
int g_cut_named_victim = 0, g_cut_named_earlier = 0;  // link-cut survivors' attribution
int g_store_kill_errors = 0, g_store_kill_ranks = 0;

// Store-kill trials: ranks pace their operations (a sleep before each) and stop after a fixed
// number, so that operations surely run after the kill and the run ends on its own.
constexpr int store_kill_pace_ms = 5;
constexpr int store_kill_more_ops = 32;  // operations after op `after`, the kill among the first few

void run_trial(int i, const Trial& t) {
  const std::string name = t.name(i);
  HangGuard guard(name, 40s);
  INFO(name);
  // Link cut and store kill: the store is not the ranks' own (every rank is a client), so the
  // cut and the kill touch nothing else. For a link cut this process hosts it and the proxies.
  std::unique_ptr<comm::TcpStore> store;
  std::unique_ptr<ProxyBroker> proxies;
  std::unique_ptr<Process> store_proc;
  std::uint16_t port = 0;
  if (t.fault == Fault::link_cut) {
    comm::TcpStoreOptions so;
    so.is_server = true;
    so.rank = -1;
    so.timeout = 20s;
    so.token = "fault-battery-token";
    store = std::make_unique<comm::TcpStore>("127.0.0.1", 0, so);
    port = store->port();
    proxies = std::make_unique<ProxyBroker>(*store, t.n, 20s);
  } else if (t.fault == Fault::store_kill) {
    port = free_port();
    store_proc = std::make_unique<Process>(std::vector<std::string>{fault_peer, "store-server", "external"},
                                           rank_env(0, t.n, port, "10s"));
    REQUIRE_MESSAGE(store_proc->wait_line("READY", 10s), store_proc->output());
  } else {
    port = free_port();
  }
  auto w = start_world(
      t.n, port, t.fault == Fault::link_cut ? "3s" : "10s",
      [&](int) {
        std::vector<std::string> a{t.backend, "--op", t.op, "--count", std::to_string(t.count), "--no-check"};
        if (t.async) a.push_back("--async");
        if (t.fault == Fault::link_cut) a.push_back("--proxy-store");
        if (t.fault == Fault::store_kill) {
          for (const char* x : {"--client-store", "--pace-ms"}) a.push_back(x);
          a.push_back(std::to_string(store_kill_pace_ms));
          a.push_back("--iters");
          a.push_back(std::to_string(t.after + store_kill_more_ops));
        } else {
          a.push_back("--iters");
          a.push_back("-1");
        }
        return a;
      },
      {{"COMM_LIVENESS_SILENCE", "1s"}});
  REQUIRE_MESSAGE(w.all_said("ITER " + std::to_string(t.after), 20s), w.outputs());
  if (proxies) REQUIRE_MESSAGE(proxies->ready(), proxies->error());
  std::this_thread::sleep_for(std::chrono::milliseconds(t.delay_ms));
  const auto t_fault = Clock::now();
  switch (t.fault) {
    case Fault::sigkill: w[static_cast<std::size_t>(t.victim)].signal(SIGKILL); break;
    case Fault::sigstop: w[static_cast<std::size_t>(t.victim)].signal(SIGSTOP); break;
    case Fault::link_cut: proxies->cut_links_of(t.victim); break;
    case Fault::store_kill: store_proc->signal(SIGKILL); break;
  }
  auto ms_of = [&](const std::map<std::string, std::string>& res) {
    return static_cast<double>(std::stoll(res.at("t_ns")) - mono_ns_of(t_fault)) / 1e6;
  };

  if (t.fault == Fault::store_kill) {
    // The store is not on the data path: every rank goes on and finishes its run normally. Its
    // liveness watch ends (its store connection closed), so a later death would only be seen by
    // the data path or COMM_TIMEOUT; destroying the communicator must not wait for the store.
    CHECK(store_proc->wait_or_kill(5s).signal == SIGKILL);  // gone, its sockets closed
    std::vector<std::size_t> iters_at_kill;
    for (int r = 0; r < t.n; ++r) iters_at_kill.push_back(w[static_cast<std::size_t>(r)].lines("ITER ").size());
    for (int r = 0; r < t.n; ++r) {
      auto& p = w[static_cast<std::size_t>(r)];
      auto res = result_of(p, 25s);
      CHECK_MESSAGE(!res.empty(), w.outputs());
      if (res.empty()) continue;
      ++g_store_kill_ranks;
      INFO(res["what"]);
      if (res["status"] != "ok") ++g_store_kill_errors;
      CHECK_MESSAGE(res["status"] == "ok", w.outputs());
      // It completed operations after the store was gone: an ITER line it had not printed then.
      CHECK_MESSAGE(p.lines("ITER ").size() > iters_at_kill[static_cast<std::size_t>(r)], w.outputs());
      CHECK_MESSAGE(p.wait_or_kill(10s).code == 0, w.outputs());
      if (res.count("t_ns") == 0) continue;
      const double ms = ms_of(res);
      g_ms[t.fault].push_back(ms);
      report(name + ": rank " + std::to_string(r) + " finished normally", res["status"], ms, 25000, "");
    }
  } else {
    // Every survivor must fail; after a link cut the victim too (it lost every link).
    const double bound = t.fault == Fault::sigstop ? stop_bound_ms : kill_bound_ms;
    const double t_ms = t.fault == Fault::link_cut ? cut_timeout_ms : timeout_ms;
    std::map<int, std::map<std::string, std::string>> results;
    for (int r = 0; r < t.n; ++r) {
      if (r == t.victim && t.fault != Fault::link_cut) continue;
      auto res = result_of(w[static_cast<std::size_t>(r)], 25s);
      CHECK_MESSAGE(!res.empty(), w.outputs());
      if (!res.empty()) results[r] = res;
    }
    for (auto& [r, res] : results) {
      INFO(res["what"]);
      CHECK(res["status"] == "error");
      CHECK(res["rank"] == std::to_string(r));
      CHECK_MESSAGE(w[static_cast<std::size_t>(r)].wait_or_kill(10s).code == 10, w.outputs());
      if (res.count("t_ns") == 0) continue;
      const double ms = ms_of(res);
      const std::string who = name + ": rank " + std::to_string(r) + (r == t.victim ? " (the victim)" : "");
      if (r == t.victim) ++g_cut_victims;
      if (t.fault == Fault::link_cut) ++g_cut_ranks;
      if (t.backend == "gloo" && t.fault == Fault::link_cut && ms >= t_ms - 500) {
        // Nothing woke libgloo's wait (see above): it ended at COMM_TIMEOUT.
        CHECK(ms < t_ms + 3000);
        ++g_cut_missed;
        if (r == t.victim) ++g_cut_victims_missed;
        report(who + " (libgloo did not wake on the reset)", res["kind"], ms, t_ms + 3000, res["what"]);
      } else {
        CHECK(res["kind"] == "RemoteError");
        CHECK(ms < bound);
        g_ms[t.fault].push_back(ms);
        report(who, res["kind"], ms, bound, res["what"]);
        const std::string victim = "rank_" + std::to_string(t.victim);
        if (r == t.victim) {
          // The victim of a link cut lost every link: it names one of the others.
          CHECK((res["peer"].starts_with("rank_") && res["peer"] != victim));
        } else if (t.fault != Fault::link_cut) {
          CHECK(res["peer"] == victim);  // the liveness watch names the dead or silent rank
        } else if (res["peer"] == victim) {
          ++g_cut_named_victim;
        } else {
          // No process died: a survivor whose operation waited only on another survivor (a gather
          // or broadcast root) hears of that one's failure (its closed connections, or the
          // liveness watch's announcement) before its own link's reset. It names that rank, which
          // failed too (their RESULT lines' order says nothing: each reports after asking its
          // liveness watch, and 2 cores run 4 ranks).
          int other = -1;
          if (res["peer"].starts_with("rank_")) other = std::atoi(res["peer"].c_str() + 5);
          const std::string why = "peer " + res["peer"] + " is neither the victim nor another rank that failed";
          CHECK_MESSAGE((other >= 0 && other != r && results.count(other) == 1 && results[other]["status"] == "error"),
                        why);
          ++g_cut_named_earlier;
        }
      }
    }
    if (t.fault == Fault::sigstop) w[static_cast<std::size_t>(t.victim)].signal(SIGKILL);  // or it waits 60 s
    if (t.fault != Fault::link_cut) (void)w[static_cast<std::size_t>(t.victim)].wait_or_kill(10s);
  }
  std::vector<pid_t> pids;
  for (const auto& p : w.ranks) pids.push_back(p->pid());
  w.ranks.clear();  // reaps every rank
  if (store_proc) pids.push_back(store_proc->pid());
  store_proc.reset();
  proxies.reset();
  store.reset();
  const std::string shm = shm_leftovers(pids), zombie = zombies();
  const std::string shm_msg = "left in /dev/shm:" + shm, zombie_msg = "zombie children:" + zombie;
  CHECK_MESSAGE(shm.empty(), shm_msg);
  CHECK_MESSAGE(zombie.empty(), zombie_msg);
}

void summary(Fault f, const char* what, double bound) {
  const auto& v = g_ms[f];
  char msg[256];
  std::snprintf(msg, sizeof msg, "p50 %.1f ms, p99 %.1f ms, max %.1f ms over %zu ranks", percentile(v, 50),
                percentile(v, 99), percentile(v, 100), v.size());
  report(std::string("chaos: ") + what, "summary", percentile(v, 99), bound, msg);
}

}  // namespace

TEST_SUITE("chaos") {

TEST_CASE("chaos soak: random faults at random points; every survivor fails in time, naming the victim") {
  const int trials = env_int("COMM_CHAOS_TRIALS", 200);
  const int seed = env_int("COMM_CHAOS_SEED", 16);
  std::mt19937 rng(static_cast<std::mt19937::result_type>(seed));
  g_ms.clear();
  g_cut_ranks = g_cut_missed = g_cut_victims = g_cut_victims_missed = g_cut_named_victim = g_cut_named_earlier = 0;
  g_store_kill_errors = g_store_kill_ranks = 0;
  const auto t0 = Clock::now();
  for (int i = 0; i < trials; ++i) run_trial(i, draw(rng));
  summary(Fault::sigkill, "time to error after SIGKILL (survivors)", kill_bound_ms);
  summary(Fault::sigstop, "time to error after SIGSTOP (survivors)", stop_bound_ms);
  summary(Fault::link_cut, "time to error after link cut (every rank)", kill_bound_ms);
  summary(Fault::store_kill, "time to the normal end after store kill (no error expected)", 25000);
  report("chaos: errors after store kill", "summary", static_cast<double>(g_store_kill_errors), 0,
         std::to_string(g_store_kill_errors) + " of " + std::to_string(g_store_kill_ranks) + " ranks");
  report("chaos: link-cut survivors' attribution", "summary", static_cast<double>(g_cut_named_victim), 0,
         std::to_string(g_cut_named_victim) + " named the victim, " + std::to_string(g_cut_named_earlier) +
             " another survivor (one that failed and closed its links first)");
  report("chaos: link-cut ranks whose wait libgloo did not wake on the reset (Timeout at COMM_TIMEOUT)", "summary",
         static_cast<double>(g_cut_missed), g_cut_ranks / 20.0,
         std::to_string(g_cut_missed) + " of " + std::to_string(g_cut_ranks) + " ranks (victims: " +
             std::to_string(g_cut_victims_missed) + " of " + std::to_string(g_cut_victims) + ")");
  CHECK(g_cut_missed * 20 <= g_cut_ranks);
  std::printf("chaos: %d trials (seed %d) in %.1f s\n", trials, seed,
              std::chrono::duration<double>(Clock::now() - t0).count());
}

}  // TEST_SUITE
