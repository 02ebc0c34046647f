// Fault battery, start-up part: rank 0 never starts, a worker never joins, a rank is started
// twice, ranks disagree on the world size, the port is taken, and init_distributed() is called
// twice or used after destroy(). Ranks are fault_peer processes with an explicit environment and a
// short COMM_TIMEOUT; each must end with a comm::Error (or succeed, where that is right) in time.
#include <sys/socket.h>

#include "battery.hpp"

using namespace comm::faults;

namespace {

constexpr const char* timeout_env = "2s";
constexpr double t_ms = 2000;
// A rank that waits for a deadline must give up by then plus this (process start, connection
// retries with backoff, a loaded 2-core machine).
constexpr double slack_ms = 3000;

double elapsed_ms(const std::map<std::string, std::string>& r) {
  return static_cast<double>(std::stoll(r.at("t_ns")) - std::stoll(r.at("start_ns"))) / 1e6;
}

std::vector<std::string> gloo_args() { return {"gloo", "--iters", "3", "--count", "16"}; }

}  // namespace

TEST_SUITE("init") {

TEST_CASE("rank 0 never starts: the workers end with Timeout naming the store address") {
  HangGuard guard("rank 0 never starts", 30s);
  const auto port = free_port();
  World w;  // ranks 1 and 2 of 3; rank 0 is never started
  for (int r = 1; r < 3; ++r) {
    std::vector<std::string> argv{fault_peer};
    for (auto& a : gloo_args()) argv.push_back(a);
    w.ranks.push_back(std::make_unique<Process>(argv, rank_env(r, 3, port, timeout_env)));
  }
  for (std::size_t i = 0; i < w.size(); ++i) {
    auto r = result_of(w[i], 15s);
    REQUIRE_MESSAGE(!r.empty(), w.outputs());
    const double ms = elapsed_ms(r);
    CHECK(r.at("kind") == "Timeout");
    CHECK(r.at("op") == "store.connect");
    CHECK(r.at("rank") == std::to_string(i + 1));
    CHECK(contains(r.at("what"), "127.0.0.1:" + std::to_string(port)));
    CHECK(ms >= t_ms - 5);
    CHECK(ms < t_ms + slack_ms);
    report("rank 0 never starts: worker " + std::to_string(i + 1), r.at("kind"), ms, t_ms + slack_ms, r.at("what"));
    CHECK_MESSAGE(w[i].wait_or_kill(5s).code == 10, w.outputs());
  }
}

TEST_CASE("a worker never joins: the others end with Timeout naming what is missing") {
  HangGuard guard("worker never joins", 30s);
  const auto port = free_port();
  auto w = start_world(2, port, timeout_env, [](int) { return gloo_args(); },
                       {{"WORLD_SIZE", "3"}});  // rank 2 of 3 is never started
  for (std::size_t i = 0; i < w.size(); ++i) {
    auto r = result_of(w[i], 15s);
    REQUIRE_MESSAGE(!r.empty(), w.outputs());
    const double ms = elapsed_ms(r);
    // Rank 0 hosts the store and started first, so it reaches the deadline first and exits: a
    // worker still waiting may then lose the store a moment before its own deadline (seen under
    // TSan, where start-up is slow). That is RemoteError naming the store, not an early failure.
    const bool store_gone_first = i != 0 && r.at("kind") == "RemoteError" &&
                                  contains(r.at("what"), "lost the connection to the store") && ms >= t_ms - 500;
    CHECK((r.at("kind") == "Timeout" || store_gone_first));
    CHECK(r.at("rank") == std::to_string(i));
    if (!store_gone_first) CHECK(contains(r.at("what"), "2"));  // the missing rank's key
    CHECK(ms < t_ms + slack_ms);
    report("a worker never joins: rank " + std::to_string(i), r.at("kind"), ms, t_ms + slack_ms, r.at("what"));
    CHECK_MESSAGE(w[i].wait_or_kill(5s).code == 10, w.outputs());
  }
}

TEST_CASE("a new job on the port of an earlier job that still runs never joins its store, and says so") {
  HangGuard guard("new job on an old port", 30s);
  const auto port = free_port();
  // The earlier job's rank 0 still serves its store (hung, or slow to exit); the new job has its
  // own COMM_JOB_ID (comm-run makes one per job) and, here, even the same token.
  auto old_env = rank_env(0, 2, port, "30s");
  old_env["COMM_JOB_ID"] = "job-1";
  Process old_store({fault_peer, "store-server"}, old_env);
  REQUIRE_MESSAGE(old_store.wait_line("READY", 10s).has_value(), old_store.output());
  World w;
  for (int r = 0; r < 2; ++r) {
    auto env = rank_env(r, 2, port, timeout_env);
    env["COMM_JOB_ID"] = "job-2";
    w.ranks.push_back(std::make_unique<Process>(std::vector<std::string>{fault_peer, "init"}, env));
  }
  // Its rank 0 cannot bind the port; its worker is refused by the earlier job's store, naming both jobs.
  auto r0 = result_of(w[0], 15s);
  REQUIRE_MESSAGE(!r0.empty(), w.outputs());
  CHECK(r0.at("kind") == "BackendError");
  CHECK(contains(r0.at("what"), "in use"));
  auto r1 = result_of(w[1], 15s);
  REQUIRE_MESSAGE(!r1.empty(), w.outputs());
  const double ms = elapsed_ms(r1);
  CHECK(r1.at("kind") == "InvalidArgument");
  CHECK(r1.at("op") == "store.connect");
  CHECK(r1.at("rank") == "1");
  CHECK(contains(r1.at("what"), "belongs to job 'job-1', this process to job 'job-2'"));
  CHECK(contains(r1.at("what"), "an earlier job's store still runs on this port"));
  CHECK(ms < t_ms + slack_ms);  // retried for min(timeout, 5 s) in case the old store was closing
  report("new job on the port of a running earlier job: worker", r1.at("kind"), ms, t_ms + slack_ms, r1.at("what"));
  for (std::size_t i = 0; i < w.size(); ++i) CHECK_MESSAGE(w[i].wait_or_kill(5s).code == 10, w.outputs());
  old_store.signal(SIGKILL);
  (void)old_store.wait_or_kill(5s);
}

TEST_CASE("duplicate rank 0: during rendezvous it fails at once; after it, it waits alone and times out") {
  HangGuard guard("duplicate rank 0", 30s);
  {
    const auto port = free_port();
    Process first({fault_peer, "gloo", "--iters", "3", "--count", "16"}, rank_env(0, 2, port, timeout_env));
    // Once the first rank 0 serves the store (a connection succeeds), start the duplicate, then rank 1.
    bool up = false;
    for (int i = 0; i < 500 && !up; ++i) {
      int err = 0;
      up = comm::detail::connect_once(comm::detail::resolve("127.0.0.1", port).addrs.at(0),
                                      comm::detail::deadline_after(100ms), err)
               .valid();
      if (!up) std::this_thread::sleep_for(10ms);
    }
    REQUIRE_MESSAGE(up, first.output());
    Process dup({fault_peer, "gloo", "--iters", "3", "--count", "16"}, rank_env(0, 2, port, timeout_env));
    const auto r = result_of(dup);
    REQUIRE_MESSAGE(!r.empty(), dup.output());
    const double ms = elapsed_ms(r);
    CHECK(r.at("kind") == "BackendError");
    CHECK(r.at("op") == "store.listen");
    CHECK(contains(r.at("what"), "127.0.0.1:" + std::to_string(port)));
    CHECK(contains(r.at("what"), "in use"));
    CHECK(ms < 1000);
    report("duplicate rank 0 during rendezvous", r.at("kind"), ms, 1000, r.at("what"));
    Process second({fault_peer, "gloo", "--iters", "3", "--count", "16"}, rank_env(1, 2, port, timeout_env));
    for (auto* p : {&first, &second}) {
      CHECK_MESSAGE(result_of(*p, 15s)["status"] == "ok", p->output());
      CHECK(p->wait_or_kill(5s).code == 0);
    }
  }
  {
    // The world formed. While rank 0 still serves its store (the communicator keeps it), a late
    // duplicate fails to bind at once; once the store is gone, it serves a new one and waits
    // there for a rank 1 that never comes, until its timeout.
    const auto port = free_port();
    auto w = start_world(2, port, timeout_env, [](int) { return gloo_args(); });
    REQUIRE_MESSAGE(w.all_said("RESULT status=ok", 15s), w.outputs());
    Process dup({fault_peer, "gloo", "--iters", "3", "--count", "16"}, rank_env(0, 2, port, timeout_env));
    const auto r = result_of(dup, 15s);
    REQUIRE_MESSAGE(!r.empty(), dup.output());
    const double ms = elapsed_ms(r);
    CHECK((r.at("kind") == "BackendError" || r.at("kind") == "Timeout"));
    CHECK(ms < (r.at("kind") == "Timeout" ? t_ms + slack_ms : 1000));
    report("duplicate rank 0 after the world formed", r.at("kind"), ms, t_ms + slack_ms, r.at("what"));
  }
}

TEST_CASE("duplicate worker rank: the extra process ends with an error, nothing hangs") {
  HangGuard guard("duplicate worker rank", 30s);
  const auto port = free_port();
  // World of 3: ranks 0, 1, 2 and a second rank 1.
  auto w = start_world(3, port, timeout_env, [](int) { return gloo_args(); });
  Process dup({fault_peer, "gloo", "--iters", "3", "--count", "16"}, rank_env(1, 3, port, timeout_env));
  int errors = 0;
  double worst = 0;
  std::string sample, kinds;
  std::vector<Process*> all{&w[0], &w[1], &w[2], &dup};
  for (std::size_t i = 0; i < all.size(); ++i) {
    auto r = result_of(*all[i], 15s);
    REQUIRE_MESSAGE(!r.empty(), all[i]->output());
    if (r.at("status") == "error") {
      ++errors;
      const double ms = elapsed_ms(r);
      worst = std::max(worst, ms);
      CHECK(ms < t_ms + slack_ms);
      kinds += (kinds.empty() ? "" : ",") + r.at("kind");
      if (sample.empty()) sample = r.at("what");
    }
    const auto e = all[i]->wait_or_kill(5s);
    CHECK_FALSE(e.killed_by_us);
  }
  CHECK(errors >= 1);  // the duplicate cannot join a full world
  report("duplicate worker rank (" + std::to_string(errors) + " of 4 processes failed)", kinds, worst,
         t_ms + slack_ms, sample);
}

TEST_CASE("world size mismatch: every rank ends with an error, nothing hangs") {
  HangGuard guard("world size mismatch", 30s);
  const auto port = free_port();
  // Rank 0 believes the world has 2 ranks, rank 1 that it has 3.
  Process r0({fault_peer, "gloo", "--iters", "3", "--count", "16"}, rank_env(0, 2, port, timeout_env));
  Process r1({fault_peer, "gloo", "--iters", "3", "--count", "16"}, rank_env(1, 3, port, timeout_env));
  int errors = 0;
  double worst = 0;
  std::string sample, kinds;
  for (auto* p : {&r0, &r1}) {
    auto r = result_of(*p, 15s);
    REQUIRE_MESSAGE(!r.empty(), p->output());
    CHECK(r.at("status") == "error");
    if (r.at("status") == "error") {
      ++errors;
      const double ms = elapsed_ms(r);
      worst = std::max(worst, ms);
      CHECK(ms < t_ms + slack_ms);
      kinds += (kinds.empty() ? "" : ",") + r.at("kind");
      if (sample.empty()) sample = "rank " + r.at("rank") + ": " + r.at("what");
    }
    CHECK_FALSE(p->wait_or_kill(5s).killed_by_us);
  }
  report("world size mismatch (WORLD_SIZE 2 on rank 0, 3 on rank 1)", kinds, worst, t_ms + slack_ms, sample);
}

TEST_CASE("port in use: rank 0 fails at once with BackendError naming the address") {
  HangGuard guard("init port in use", 30s);
  comm::detail::Fd squatter(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  const auto port = free_port();
  auto a = comm::detail::resolve("127.0.0.1", port).addrs.at(0);
  REQUIRE(::bind(squatter.get(), a.get(), a.len) == 0);
  REQUIRE(::listen(squatter.get(), 4) == 0);
  Process p({fault_peer, "gloo", "--iters", "1"}, rank_env(0, 2, port, timeout_env));
  const auto r = result_of(p);
  REQUIRE_MESSAGE(!r.empty(), p.output());
  const double ms = elapsed_ms(r);
  CHECK(r.at("kind") == "BackendError");
  CHECK(contains(r.at("what"), "127.0.0.1:" + std::to_string(port)));
  CHECK(contains(r.at("what"), "in use"));
  CHECK(ms < 1000);
  report("port in use: rank 0 of a Gloo job", r.at("kind"), ms, 1000, r.at("what"));
}

TEST_CASE("init_distributed twice, and use after destroy()") {
  HangGuard guard("cdb lifecycle", 60s);
  for (const char* scenario : {"double-init", "after-destroy"}) {
    const auto port = free_port();
    auto w = start_world(2, port, "20s", [&](int) { return std::vector<std::string>{"cdb", scenario}; },
                         {{"FAULT_REINIT_PORT", std::to_string(free_port())}});
    const auto t0 = Clock::now();
    for (std::size_t i = 0; i < w.size(); ++i) {
      auto r = result_of(w[i], 30s);
      CHECK_MESSAGE(r["status"] == "ok", w.outputs());
      CHECK(w[i].wait_or_kill(10s).code == 0);
    }
    for (const auto& l : w[0].lines("STEP")) MESSAGE(l);
    report(std::string("cdb ") + scenario + ": every check passed", "ok", ms_since(t0), 30000,
           std::to_string(w[0].lines("STEP ok").size()) + " checks on each rank");
  }
}

}  // TEST_SUITE
