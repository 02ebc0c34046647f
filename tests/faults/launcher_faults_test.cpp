// Fault battery, launcher part: comm-run running a Gloo job whose ranks sit in collectives must
// stop the whole job when one rank fails (exits non-zero, or is killed from outside), and exit
// with that rank's code. The launcher's own behaviour in detail is tested in tests/launcher.
#include <signal.h>

#include <cerrno>

#include "battery.hpp"

using namespace comm::faults;

namespace {

// Every rank that said READY (with its pid) is gone once comm-run has exited: none runs on.
void check_all_ranks_gone(Process& job) {
  const auto ready = job.lines();
  int ranks = 0;
  for (const auto& l : ready) {
    const auto at = l.find("READY ");
    if (at == std::string::npos) continue;
    ++ranks;
    const pid_t pid = std::stoi(fields(l.substr(at + 6)).at("pid"));
    bool gone = false;
    for (int i = 0; i < 100 && !gone; ++i) {  // reaped by comm-run before it exits; allow the kernel a moment
      gone = ::kill(pid, 0) != 0 && errno == ESRCH;
      if (!gone) std::this_thread::sleep_for(10ms);
    }
    CHECK_MESSAGE(gone, "rank with pid " << pid << " still runs after comm-run exited");
  }
  CHECK(ranks == 3);
}

}  // namespace

TEST_SUITE("launcher") {

TEST_CASE("comm-run stops a Gloo job when a rank exits non-zero mid-loop, and exits with its code") {
  HangGuard guard("comm-run kill-on-failure (exit 3)", 60s);
  Process job({comm_run, "-n", "3", "--grace-period", "2s", fault_peer, "gloo", "--count", "65536", "--iters", "-1",
               "--exit-rank", "1", "--exit-at", "40", "--exit-code", "3"},
              {{"COMM_TIMEOUT", "30s"}});
  const auto line = job.wait_line("[1] EXITING", 30s);
  REQUIRE_MESSAGE(line, job.output());
  const auto e = job.wait_or_kill(20s);
  const auto exit_ns = mono_ns(job.exited_at());
  REQUIRE_FALSE_MESSAGE(e.killed_by_us, job.output());
  CHECK_MESSAGE(e.code == 3, job.output());
  const double ms = static_cast<double>(exit_ns - std::stoll(fields(line->substr(4)).at("t_ns"))) / 1e6;
  CHECK(ms < 5000);
  CHECK_MESSAGE(contains(job.output(), "stopping the other 2 rank(s)"), job.output());
  check_all_ranks_gone(job);
  report("comm-run: rank 1 exits 3 mid-loop, whole job ends", "exit " + std::to_string(e.code), ms, 5000,
         job.lines("comm-run").empty() ? "" : job.lines("comm-run").front());
}

TEST_CASE("comm-run stops a Gloo job when a rank is SIGKILLed from outside, and exits 128+9") {
  HangGuard guard("comm-run kill-on-failure (SIGKILL)", 60s);
  Process job({comm_run, "-n", "3", "--grace-period", "2s", fault_peer, "gloo", "--count", "65536", "--iters", "-1"},
              {{"COMM_TIMEOUT", "30s"}});
  const auto ready = job.wait_line("[2] READY", 30s);
  REQUIRE_MESSAGE(ready, job.output());
  REQUIRE(job.wait_line("[2] ITER 8", 30s));
  const pid_t victim = std::stoi(fields(ready->substr(4)).at("pid"));
  const auto t_kill = Clock::now();
  ::kill(victim, SIGKILL);
  const auto e = job.wait_or_kill(20s);
  REQUIRE_FALSE_MESSAGE(e.killed_by_us, job.output());
  CHECK_MESSAGE(e.code == 128 + SIGKILL, job.output());
  const double ms = ms_since(t_kill, job.exited_at());
  CHECK(ms < 5000);
  std::string said;
  for (const auto& l : job.lines())
    if (contains(l, "comm-run") && contains(l, "rank 2")) said = l;
  CHECK_MESSAGE(!said.empty(), job.output());
  check_all_ranks_gone(job);
  report("comm-run: rank 2 SIGKILLed, whole job ends", "exit " + std::to_string(e.code), ms, 5000, said);
}

}  // TEST_SUITE
