// barrier over Gloo: no rank leaves before every rank entered; async barriers; many in a row.
#include "gloo_test_util.hpp"

#include <chrono>
#include <thread>

using namespace gloo_test;

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
