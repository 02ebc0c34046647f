// The harness itself: world, fresh stores, barriers and shared ports agree across ranks.
#include <doctest/doctest.h>

#include <string>

#include <support/multirank.hpp>

using comm::test::world;

TEST_CASE("world matches the launcher's environment") {
  const auto& w = world();
  REQUIRE(w.size >= 1);
  REQUIRE(w.rank >= 0);
  REQUIRE(w.rank < w.size);
  REQUIRE(w.store != nullptr);
}

TEST_CASE("every rank sees every other rank through the world store") {
  const auto& w = world();
  auto s = comm::test::fresh_store();
  s->set("hello/" + std::to_string(w.rank), std::to_string(w.rank * 10));
  for (int r = 0; r < w.size; ++r) {
    auto v = s->get("hello/" + std::to_string(r));
    CHECK(std::string(v.begin(), v.end()) == std::to_string(r * 10));
  }
}

TEST_CASE("barrier orders phases") {
  const auto& w = world();
  auto s = comm::test::fresh_store();
  for (int phase = 0; phase < 3; ++phase) {
    s->add("phase" + std::to_string(phase), 1);
    comm::test::barrier();
    CHECK(s->add("phase" + std::to_string(phase), 0) == w.size);
  }
}

TEST_CASE("shared_free_port is the same on every rank") {
  auto port = comm::test::shared_free_port();
  CHECK(port > 0);
  auto s = comm::test::fresh_store();
  s->set("port/" + std::to_string(world().rank), std::to_string(port));
  for (int r = 0; r < world().size; ++r) {
    auto v = s->get("port/" + std::to_string(r));
    CHECK(std::string(v.begin(), v.end()) == std::to_string(port));
  }
}

TEST_CASE("a case needing more ranks than given is skipped with a reason") {
  COMM_REQUIRE_RANKS(64);
  FAIL("unreachable with fewer than 64 ranks");
}
