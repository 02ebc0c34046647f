// Fault tolerance (shrink, grow, revoke, close_joins) on the backends that have it; a backend
// without it says so at compile time (checked here through the concepts) and at run time through
// AnyCommunicator. The processes stay alive in these cases: a rank that "leaves" simply stops
// calling, and killed processes are the fault battery's (tests/faults/elastic_faults_test.cpp).
#include "backend_test_util.hpp"

#include <chrono>
#include <numeric>
#include <thread>

#include <comm/any_communicator.hpp>

using namespace suite;
using namespace std::chrono_literals;

namespace {

constexpr bool kElastic = comm::supports_shrink<Backend> && comm::supports_grow<Backend> &&
                          comm::supports_revoke<Backend> && comm::supports_close_joins<Backend>;

/// The sum of every rank's (rank + 1) on `c`: what an all_reduce must give.
template <class C>
int checked_sum(C& c) {
  std::vector<int> v{c.rank() + 1};
  c.all_reduce(v);
  return v[0];
}

int triangle(int n) { return n * (n + 1) / 2; }

}  // namespace

TEST_CASE("elastic: the capability is there exactly on the backends that have it") {
  const bool expected = kBackendName == "gloo" || kBackendName == "shm" || kBackendName == "hierarchical" ||
                        kBackendName == "relay";
  CHECK(kElastic == expected);
  if constexpr (!kElastic) {
    auto any = comm::AnyCommunicator(make_comm());
    CHECK_THROWS_AS((void)any.shrink(), comm::InvalidArgument);
    CHECK_THROWS_AS(any.revoke(), comm::InvalidArgument);
  }
}

TEST_CASE("elastic: revoke ends every member's operations, naming the revoking rank; shrink then keeps everyone") {
  if constexpr (kElastic) {
    COMM_REQUIRE_RANKS(2);
    Options o;
    o.timeout = 20s;
    auto c = make_comm(o);
    CHECK(checked_sum(c) == triangle(c.size()));
    // An operation that has ended on the revoker may still be finishing on the others, and a revoke
    // ends it there too (that is the contract); so the revoke waits for every rank to be done.
    comm::test::barrier();
    const int revoker = c.size() - 1;
    if (c.rank() == revoker) {
      c.revoke("test");
      CHECK_THROWS_AS(c.barrier(), comm::RemoteError);
    } else {
      // A pending operation ends within the liveness watch's reach, not at the timeout.
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<int> v{1};
      comm::Work w = c.all_reduce(v, comm::async);
      try {
        w.wait();
        FAIL("the operation completed on a revoked communicator");
      } catch (const comm::RemoteError& e) {
        CHECK(std::string(e.what()).find("rank " + std::to_string(revoker) + " revoked the communicator") !=
              std::string::npos);
        CHECK(e.peer() == "rank " + std::to_string(revoker));
      }
      CHECK(std::chrono::steady_clock::now() - t0 < 5s);
    }
    auto s = c.shrink();  // everyone is alive: the same members, ranks kept
    CHECK(s.size() == c.size());
    CHECK(s.rank() == c.rank());
    CHECK(checked_sum(s) == triangle(s.size()));
    CHECK_THROWS_AS(c.barrier(), comm::RemoteError);  // the old one stays failed
  }
}

TEST_CASE("elastic: grow with nobody waiting keeps the membership, for one store round trip") {
  if constexpr (kElastic) {
    auto c = make_comm();
    const int rank = c.rank(), size = c.size();
    const auto t0 = std::chrono::steady_clock::now();
    constexpr int kRounds = 200;
    for (int i = 0; i < kRounds; ++i) c = c.grow();
    const auto us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / kRounds;
    if (rank == 0) MESSAGE("grow() with nobody waiting: " << us << " us per call (" << size << " ranks)");
    CHECK(c.rank() == rank);
    CHECK(c.size() == size);
    CHECK(checked_sum(c) == triangle(size));
  }
}

TEST_CASE("elastic: a rank that does not take part is named by the shrink's deadline; a late one is left out") {
  if constexpr (kElastic) {
    COMM_REQUIRE_RANKS(3);
    Options o;
    o.timeout = 1500ms;
    auto c = make_comm(o);
    CHECK(checked_sum(c) == triangle(c.size()));
    const int absent = c.size() - 1;
    if (c.rank() == absent) {
      // Alive (its liveness watch keeps beating) but busy elsewhere past the others' deadline.
      std::this_thread::sleep_for(2500ms);
      CHECK_THROWS_AS((void)c.shrink(), comm::Timeout);  // reads the same verdict
    } else {
      try {
        (void)c.shrink();
        FAIL("shrink formed a communicator without a live rank that never took part");
      } catch (const comm::Timeout& e) {
        CHECK(e.op() == "shrink");
        CHECK(std::string(e.what()).find("rank " + std::to_string(absent)) != std::string::npos);
      }
    }
    // A second attempt where the absent rank is late, but still within the deadline: all members.
    if (c.rank() == absent) std::this_thread::sleep_for(300ms);
    auto s = c.shrink();
    CHECK(s.size() == c.size());
    CHECK(checked_sum(s) == triangle(s.size()));
  }
}

TEST_CASE("elastic: shrink needs a root communicator; a subgroup says which to shrink") {
  if constexpr (kElastic && comm::supports_split<Backend>) {
    COMM_REQUIRE_RANKS(2);
    auto c = make_comm();
    auto g = c.split(0);
    REQUIRE(g);
    try {
      (void)g->shrink();
      FAIL("a subgroup shrank");
    } catch (const comm::InvalidArgument& e) {
      CHECK(std::string(e.what()).find("root communicator") != std::string::npos);
    }
    CHECK(checked_sum(*g) == triangle(g->size()));  // the refusal left it usable
  }
}

TEST_CASE("elastic: AnyCommunicator shrinks, grows and closes the door") {
  if constexpr (kElastic) {
    COMM_REQUIRE_RANKS(2);
    auto any = comm::AnyCommunicator(make_comm());
    any = any.grow();
    CHECK(checked_sum(any) == triangle(any.size()));
    comm::test::barrier();  // as above: the revoke must not end the others' last all_reduce
    any.revoke("test");
    CHECK_THROWS_AS(any.barrier(), comm::RemoteError);
    any = any.shrink();
    CHECK(checked_sum(any) == triangle(any.size()));
    if (any.rank() == 0) any.close_joins();
    any.barrier();
  }
}
