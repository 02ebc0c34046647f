// Deliberately fails on rank 1 only. Registered with WILL_FAIL and a regex on rank 0's summary:
// proves that a failure on a non-zero rank fails the job and that rank 0 names that rank.
#include <doctest/doctest.h>

#include <support/multirank.hpp>

TEST_CASE("fails on rank 1 only") { CHECK(comm::test::world().rank != 1); }
