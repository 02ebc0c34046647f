// The NCCL backend on the shared communicator core (detail/engine/comm_core.hpp), what of it runs
// without a GPU: the membership check at create() (before any device is touched, so it behaves the
// same with and without a GPU), the core's key prefix on the store, and the core's flight-record
// naming, failure record and peer-failure text as the NCCL engine uses them; shrink()'s path choice.
#include "nccl_test_util.hpp"

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <comm/detail/engine/comm_core.hpp>

using namespace nccl_test;
using namespace std::chrono_literals;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// CommCore's protected side, as an engine sees it.
struct CoreProbe : comm::detail::CommCore {
  using CommCore::CommCore;
  using CommCore::note_peer_failure;
  using CommCore::recorder;
  using CommCore::throw_if_failed;
};

}  // namespace

// Fault tolerance is the shared layer's (detail/engine/elastic.hpp) on NCCL too.
static_assert(comm::supports_shrink<comm::backends::Nccl> && comm::supports_grow<comm::backends::Nccl> &&
              comm::supports_revoke<comm::backends::Nccl> && comm::supports_close_joins<comm::backends::Nccl>);
// shrink() goes through ncclCommShrink exactly where nccl.h has it (2.27+), and the watchdog can keep
// a failed communicator for it where nccl.h has ncclCommRevoke (the NCCL here: 2.28.9, both).
static_assert(COMM_NCCL_HAS_SHRINK == (NCCL_VERSION_CODE >= 22700 ? 1 : 0));
#if defined(NCCL_REVOKE_DEFAULT)
static_assert(COMM_NCCL_HAS_REVOKE == COMM_NCCL_HAS_SHRINK);
#else
static_assert(COMM_NCCL_HAS_REVOKE == 0);
#endif

TEST_CASE("create(): ranks started with different world sizes fail the membership check, before NCCL") {
  const auto& w = comm::test::world();
  if (w.size != 2) {
    report_skip("runs with two ranks");
    return;
  }
  auto store = comm::test::fresh_store();
  const int claimed = w.rank == 0 ? 2 : 3;  // rank 1 believes in a world of 3
  const auto t0 = std::chrono::steady_clock::now();
  bool thrown = false;
  try {
    (void)Comm::create(store, w.rank, claimed);
  } catch (const comm::InvalidArgument& e) {
    thrown = true;
    const std::string m = e.what();
    INFO("message: ", m);
    CHECK(e.op() == "nccl.init");
    CHECK(e.rank() == w.rank);
    CHECK(contains(m, "world size mismatch"));
    CHECK(contains(m, "world size 3"));
    CHECK(contains(m, "world size 2"));
  }
  CHECK(thrown);
  CHECK(std::chrono::steady_clock::now() - t0 < 10s);
  comm::test::barrier();
  // The core's records under NCCL's key prefix; no NCCL unique id: nothing of NCCL started.
  CHECK(store->check("comm/nccl/1/member/0"));
  CHECK(store->check("comm/nccl/1/member/1"));
  CHECK_FALSE(store->check("comm/nccl/1/uid"));
  comm::test::barrier();
}

TEST_CASE("the core under NCCL: place, dump naming, flight record, first failure, peer failure text") {
  namespace cd = comm::detail;
  auto store = std::make_shared<comm::HashStore>(5s);
  cd::CoreConfig cfg;
  cfg.timeout = 5s;
  cfg.flight_recorder_size = 8;
  // A store of its own: one rank, so no membership wait.
  const cd::CommPlace first = cd::join_store(store, 0, 1, cfg, "nccl");
  const cd::CommPlace second = cd::join_store(store, 0, 1, cfg, "nccl");
  CHECK(first.key_prefix == "comm/nccl/1/");
  CHECK(first.name.empty());
  CHECK(first.root);
  CHECK(second.key_prefix == "comm/nccl/2/");
  CHECK(second.name == "c2");
  cfg.file_rank = 3;
  cfg.name = "g0";
  const cd::CommPlace sub = cd::join_store(store, 0, 1, cfg, "nccl");
  CHECK_FALSE(sub.root);
  CHECK(sub.file_rank == 3);
  CHECK(sub.name == "g0");

  CoreProbe core(second, 0, 2, cfg, "nccl");
  CHECK(core.key_prefix() == "comm/nccl/2/");
  CHECK(core.next_group_index() == 0);
  CHECK(core.next_group_index() == 1);
  core.recorder().issued(0, comm::OpDesc{comm::OpKind::all_reduce, comm::OpDesc::none, comm::OpDesc::none, -1, 4});
  core.recorder().started(0);
  const comm::FlightRecord r = core.flight_record();
  CHECK(r.backend == "nccl");
  CHECK(r.name == "c2");
  REQUIRE(r.ops.size() == 1);
  CHECK(r.ops[0].op == "all_reduce");

  CHECK_FALSE(core.has_failed());
  CHECK_NOTHROW(core.throw_if_failed("all_reduce"));
  const auto f = core.note_peer_failure(1, "rank 1 is dead: its connection to the store closed");
  REQUIRE(f.has_value());
  CHECK(f->peer == "rank 1");
  CHECK(contains(f->what, "seen by rank 0's liveness watch during op #0 (all_reduce)"));
  CHECK(core.has_failed());
  CHECK_FALSE(core.note_peer_failure(1, "again").has_value());  // the first failure stays
  try {
    core.throw_if_failed("broadcast");
    FAIL("no error");
  } catch (const comm::RemoteError& e) {
    CHECK(e.op() == "broadcast");
    CHECK(e.peer() == "rank 1");
    CHECK(contains(e.what(), "unusable after an earlier failure"));
  }
  CHECK(contains(core.failure_text(), "rank 1 is dead"));
}

// shrink()'s path choice (detail/nccl/shrink.hpp, agree_all): ncclCommShrink only where every member can,
// the same answer on every member, and a member that never answers named by the deadline. Three
// members are threads on one HashStore (no GPU needed).
TEST_CASE("shrink's path choice: all members get the same answer; a silent member is named") {
  namespace dn = comm::detail::nccl;
  const auto run = [](std::vector<int> says, std::chrono::milliseconds timeout) {
    comm::HashStore store(timeout);
    const int n = static_cast<int>(says.size());
    std::vector<int> got(says.size(), -1);
    std::vector<std::string> errors(says.size());
    std::vector<std::thread> members;
    for (int r = 0; r < n; ++r) {
      if (says[static_cast<std::size_t>(r)] < 0) continue;  // silent: never answers
      members.emplace_back([&, r] {
        try {
          got[static_cast<std::size_t>(r)] = dn::agree_all(store, r, n, says[static_cast<std::size_t>(r)] == 1, timeout);
        } catch (const comm::Timeout& e) {
          errors[static_cast<std::size_t>(r)] = e.what();
        }
      });
    }
    for (auto& t : members) t.join();
    return std::make_pair(got, errors);
  };
  {
    const auto [got, errors] = run({1, 1, 1}, 5s);
    CHECK(got == std::vector<int>{1, 1, 1});
  }
  {
    const auto [got, errors] = run({1, 0, 1}, 5s);  // one member's communicator was aborted
    CHECK(got == std::vector<int>{0, 0, 0});
  }
  {
    const auto t0 = std::chrono::steady_clock::now();
    const auto [got, errors] = run({1, 1, -1}, 300ms);
    CHECK(std::chrono::steady_clock::now() - t0 < 3s);
    for (int r : {0, 1}) {
      CHECK(got[static_cast<std::size_t>(r)] == -1);
      CHECK(contains(errors[static_cast<std::size_t>(r)], "comm: shrink on rank " + std::to_string(r)));
      CHECK(contains(errors[static_cast<std::size_t>(r)], "new rank(s) 2 did not say within 300 ms"));
    }
  }
}
