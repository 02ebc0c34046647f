#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include <comm/detail/base/env.hpp>
#include <comm/init.hpp>
#include <comm/store.hpp>
#include <support/multirank.hpp>

namespace comm::test {
namespace {

World g_world;
int g_store_seq = 0;
int g_barrier_seq = 0;
int g_port_seq = 0;
std::string g_current_test;
int g_cases_run = 0;

// Records the running case's name so skips can say which case they skip.
struct CaseTracker : doctest::IReporter {
  explicit CaseTracker(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData& d) override {
    g_current_test = d.m_name;
    ++g_cases_run;
  }
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
DOCTEST_REGISTER_LISTENER("comm_case_tracker", 1, CaseTracker);

void join_world() {
  auto rank = detail::env_nonneg_int("RANK", "test harness");
  const char* size_var = "WORLD_SIZE";
  if (!rank) {  // under mpirun (tests/support/mpirun-job): the launcher's own variables
    for (const auto& [r, sz] : {std::pair{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"}, std::pair{"PMI_RANK", "PMI_SIZE"}})
      if ((rank = detail::env_nonneg_int(r, "test harness"))) {
        size_var = sz;
        break;
      }
  }
  if (!rank) {  // run by hand, outside comm-run: one rank
    g_world = World{0, 1, std::make_shared<HashStore>()};
    return;
  }
  auto size = detail::env_nonneg_int(size_var, "test harness").value_or(1);
  auto addr = detail::getenv_str("MASTER_ADDR").value_or("127.0.0.1");
  auto port_text = detail::getenv_str("MASTER_PORT");
  if (!port_text) throw InvalidArgument("test harness", *rank, "MASTER_PORT is not set");
  auto port = detail::parse_port("MASTER_PORT", *port_text, "test harness");
  TcpStoreOptions o;
  o.is_server = *rank == 0 && !detail::agent_hosts_store(*rank);  // comm-run hosts it: COMM_AGENT_STORE=1
  o.rank = *rank;
  o.timeout = std::chrono::seconds(60);
  g_world = World{*rank, size, std::make_shared<TcpStore>(addr, port, o)};
}

}  // namespace

const World& world() { return g_world; }

std::shared_ptr<Store> fresh_store() {
  return std::make_shared<PrefixStore>("case" + std::to_string(g_store_seq++), g_world.store);
}

void barrier() {
  const std::string key = "harness/barrier/" + std::to_string(g_barrier_seq++);
  if (g_world.store->add(key, 1) == g_world.size) g_world.store->set(key + "/done", std::string_view("1"));
  g_world.store->wait({key + "/done"});
}

std::uint16_t shared_free_port() {
  const std::string key = "harness/port/" + std::to_string(g_port_seq++);
  if (g_world.rank == 0) g_world.store->set(key, std::to_string(detail::free_port()));
  auto v = g_world.store->get(key);
  return static_cast<std::uint16_t>(std::stoi(std::string(v.begin(), v.end())));
}

const std::string& current_test() { return g_current_test; }

void report_needs_ranks(int needed) {
  if (g_world.rank == 0)
    std::printf("SKIPPED '%s': needs %d ranks, this run has %d\n", g_current_test.c_str(), needed, g_world.size);
}

}  // namespace comm::test

int main(int argc, char** argv) {
  using comm::test::g_world;
  try {
    comm::test::join_world();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "test harness: cannot join the world: %s\n", e.what());
    return 3;
  }
  // comm-run hosts the harness's store (COMM_AGENT_STORE=1): tests that make an env:// world of
  // their own expect env://'s default, rank 0 hosting it, unless they say otherwise.
  ::unsetenv("COMM_AGENT_STORE");
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  if (g_world.rank != 0) ctx.setOption("minimal", true);  // only rank 0 prints the summary
  int rc = ctx.run();
  if (ctx.shouldExit()) return rc;
  // A suite is picked from a shared executable by a filter (tests/collectives): a filter that
  // matches nothing must not pass as an empty success.
  if (comm::test::g_cases_run == 0) {
    std::fprintf(stderr, "test harness: rank %d ran no test case (does the filter match?)\n", g_world.rank);
    rc = 1;
  }

  // Gather every rank's outcome on rank 0 so its summary covers the whole job.
  int exit_code = rc == 0 ? 0 : 1;
  try {
    auto& store = *g_world.store;
    store.set("harness/result/" + std::to_string(g_world.rank), std::to_string(rc));
    if (g_world.rank == 0) {
      std::vector<int> failed;
      for (int r = 0; r < g_world.size; ++r) {
        auto v = store.get("harness/result/" + std::to_string(r));
        if (std::string(v.begin(), v.end()) != "0") failed.push_back(r);
      }
      if (failed.empty()) {
        std::printf("comm-test: all %d rank(s) passed\n", g_world.size);
      } else {
        std::string list;
        for (int r : failed) list += (list.empty() ? "" : ", ") + std::to_string(r);
        std::printf("comm-test: FAILED on rank(s) %s of %d\n", list.c_str(), g_world.size);
        exit_code = 1;
      }
      // Out before the failing ranks are let go: comm-run stops this rank (SIGTERM) as soon as
      // one of them exits non-zero, and stdout into its pipe is block-buffered (a full ctest run
      // on 2026-11-28 lost this report once).
      std::fflush(stdout);
      store.set("harness/reported", std::string_view("1"));
    } else if (rc != 0) {
      // comm-run stops the job as soon as this rank exits non-zero: stay until rank 0 has named
      // this rank in its report. The server may close under the wait once rank 0 exits.
      try {
        store.wait({"harness/reported"});
      } catch (const comm::RemoteError&) {
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "test harness: collecting results failed: %s\n", e.what());
    exit_code = 1;
  }
  std::fflush(stdout);
  return exit_code;
}
