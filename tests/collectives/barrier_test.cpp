// barrier: no rank leaves before every rank entered; async barriers; many in a row.
#include "backend_test_util.hpp"

#include <chrono>
#include <thread>

using namespace suite;

TEST_CASE("barrier: no rank leaves before the last one arrives") {
  auto c = make_comm();
  auto store = comm::test::fresh_store();
  for (int round = 0; round < 3; ++round) {
    const std::string key = "arrived/" + std::to_string(round);
    // The last rank arrives late; everyone must still see every arrival after the barrier.
    if (c.rank() == c.size() - 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    store->add(key, 1);
    c.barrier();
    CHECK(store->add(key, 0) == c.size());
  }
}

TEST_CASE("barrier: async form and many in a row") {
  auto c = make_comm();
  auto w = c.barrier(comm::async);
  w.wait();
  CHECK(w.is_completed());
  for (int i = 0; i < 50; ++i) c.barrier();
  std::vector<comm::Work> ws;
  for (int i = 0; i < 20; ++i) ws.push_back(c.barrier(comm::async));
  for (auto& x : ws) x.wait();
}

TEST_CASE("Work::error and Work::exception report a failure without throwing") {
  COMM_REQUIRE_RANKS(2);
  Options o;
  o.timeout = std::chrono::milliseconds(400);
  auto c = make_comm(o);
  comm::Work done = c.barrier(comm::async);
  done.wait();
  CHECK(done.error() == nullptr);  // succeeded
  CHECK(done.exception().empty());
  // Only rank 0 calls: its operation cannot complete and ends by the timeout.
  if (c.rank() == 0) {
    std::vector<float> v(4, 1.0f);
    comm::Work w = c.all_reduce(v, comm::async);
    CHECK(w.error() == nullptr);  // still running (or not yet known): no error to report
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!w.is_completed() && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    REQUIRE(w.is_completed());
    REQUIRE(w.error() != nullptr);
    const std::string text = w.exception();
    INFO(text);
    CHECK(text.find("all_reduce") != std::string::npos);
    CHECK(text.find("rank 0") != std::string::npos);
    CHECK_THROWS_AS(std::rethrow_exception(w.error()), comm::Timeout);
    CHECK_THROWS_AS(w.wait(), comm::Error);
  }
  comm::test::barrier();
}
