#pragma once
// The multi-rank test harness: every test executable runs as N real processes under comm-run.
// The harness main joins all ranks through a TcpStore hosted by rank 0 (on MASTER_PORT), runs the
// doctest cases in the same order on every rank, and makes rank 0 report which ranks failed.
// Checks on other ranks print their failures prefixed by comm-run with [rank].

#include <cstdint>
#include <memory>
#include <string>

#include <comm/store.hpp>

namespace comm::test {

struct World {
  int rank = 0;
  int size = 1;
  std::shared_ptr<comm::Store> store;  // the harness's store, shared by all ranks
};

/// The world this process runs in (from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; a single
/// rank with an in-process store when RANK is unset).
const World& world();

/// A store private to this call: a PrefixStore over the world store with a prefix that is the
/// same on every rank as long as every rank calls it in the same order.
std::shared_ptr<comm::Store> fresh_store();

/// Blocks until every rank has reached the same barrier.
void barrier();

/// Rank 0 picks a free loopback port and every rank receives the same number.
std::uint16_t shared_free_port();

/// The name of the doctest case running now.
const std::string& current_test();

/// Prints, on rank 0, that the current test needs more ranks than it was given.
void report_needs_ranks(int needed);

}  // namespace comm::test

/// At the top of a TEST_CASE: with fewer than `n` ranks, say so and skip the case.
#define COMM_REQUIRE_RANKS(n)                                  \
  do {                                                         \
    if (::comm::test::world().size < (n)) {                    \
      ::comm::test::report_needs_ranks(n);                     \
      return;                                                  \
    }                                                          \
  } while (0)

/// Runs the following statement on rank `r` only.
#define COMM_ON_RANK(r) if (::comm::test::world().rank == (r))
