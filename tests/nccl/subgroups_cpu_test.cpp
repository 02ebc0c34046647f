// The NCCL backend's subgroups and diagnostics without a GPU: the optional capabilities at compile
// time (Communicator<Nccl> and AnyCommunicator), where a rank lands in a split or a new_group and
// the names of subgroups (shared with Gloo), and the error of new_group / monitored_barrier on a
// communicator without a store. The GPU side is tests/nccl/groups_test.cpp.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include <comm/backends/nccl.hpp>
#include <comm/cdb.hpp>
#include <comm/communicator.hpp>
#include <comm/detail/engine/groups.hpp>
#include <support/multirank.hpp>

namespace dn = comm::detail::nccl;
using comm::backends::Nccl;

static_assert(comm::backend<Nccl>);
static_assert(comm::supports_split<Nccl>, "Nccl::split(int, int) -> std::optional<Nccl>");
static_assert(comm::supports_new_group<Nccl>, "Nccl::new_group(std::span<const int>) -> std::optional<Nccl>");
static_assert(comm::supports_monitored_barrier<Nccl>, "Nccl::monitored_barrier(milliseconds, bool)");
static_assert(comm::supports_flight_recorder<Nccl>, "Nccl::flight_record() const, dump_flight_record(path) const");

// AnyCommunicator forwards split, new_group, monitored_barrier and the flight recorder when the
// backend has them: instantiating its NCCL model compiles those paths (not the "lacks" ones).
template class comm::detail::AnyCommModel<Nccl>;

namespace {

// The facade's forms compile for NCCL (never called here: no GPU).
[[maybe_unused]] void facade_forms(comm::Communicator<Nccl>& c, comm::AnyCommunicator& any) {
  std::optional<comm::Communicator<Nccl>> a = c.split(0), b = c.split(1, 2), d = c.new_group({0});
  c.monitored_barrier();
  c.monitored_barrier(std::chrono::seconds(1), true);
  comm::FlightRecord f = c.flight_record();
  c.dump_flight_record("-");
  std::optional<comm::AnyCommunicator> e = any.split(0), g = any.new_group({0});
  (void)a, (void)b, (void)d, (void)e, (void)g, (void)f;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("split_place: ranks of one color ordered by (key, rank); negative color: none") {
  // rank:            0       1       2       3       4
  const std::vector<std::int64_t> ck{0, 5, 1, 0, 0, 5, 1, -1, -1, 0};  // (color, key) per rank
  auto p0 = comm::detail::split_place(ck, 0, 5, 0);
  auto p2 = comm::detail::split_place(ck, 0, 5, 2);
  REQUIRE(p0);
  REQUIRE(p2);
  CHECK(p0->rank == 0);  // equal keys: the lower parent rank first
  CHECK(p2->rank == 1);
  CHECK(p0->size == 2);
  auto p3 = comm::detail::split_place(ck, 1, -1, 3);
  auto p1 = comm::detail::split_place(ck, 1, 0, 1);
  REQUIRE(p3);
  REQUIRE(p1);
  CHECK(p3->rank == 0);  // key -1 before key 0
  CHECK(p1->rank == 1);
  CHECK(p1->size == 2);
  CHECK_FALSE(comm::detail::split_place(ck, -1, 0, 4));
}

TEST_CASE("group_place and subgroup names and prefixes") {
  const std::vector<int> ranks{3, 0, 2};
  auto p = comm::detail::group_place(ranks, 0);
  REQUIRE(p);
  CHECK(p->rank == 1);
  CHECK(p->size == 3);
  CHECK_FALSE(comm::detail::group_place(ranks, 1));
  CHECK(comm::detail::group_name(4) == "g4");
  CHECK(comm::detail::group_prefix("comm/nccl/1/", "g4") == "comm/nccl/1/g4");
  CHECK(comm::detail::split_prefix("comm/nccl/1/", "g4", 7) == "comm/nccl/1/g4/c7");
  CHECK(comm::detail::child_name("", "g0") == "g0");
  CHECK(comm::detail::child_name("g0", "g2") == "g0.g2");
  CHECK(comm::detail::child_name("adopted", "g1") == "adopted.g1");
}

TEST_CASE("new_group and monitored_barrier on an adopted communicator: InvalidArgument saying why") {
  const comm::InvalidArgument e = dn::no_store_error("new_group", 2);
  const std::string m = e.what();
  CHECK(e.op() == "new_group");
  CHECK(e.rank() == 2);
  CHECK(contains(m, "adopted from an ncclComm_t and has no store"));
  CHECK(contains(m, "new_group needs one"));
  CHECK(contains(m, "create() or from_env()"));
  CHECK(contains(dn::no_store_error("monitored_barrier", 0).what(), "monitored_barrier needs one"));
}

TEST_CASE("NcclOptions: the desync check and the flight recorder size default from the environment") {
  Nccl::Options o;
  CHECK(o.desync_check == comm::detail::desync_check_default());
  CHECK(o.flight_recorder_size == comm::detail::flight_recorder_size_default());
}
