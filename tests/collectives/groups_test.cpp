// Subgroups: split (by parity, negative colors, key order, nested), new_group (members
// ranked as listed, non-members return at once without blocking), bad arguments, AnyCommunicator.
#include "backend_test_util.hpp"

#include <chrono>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include <comm/cdb.hpp>

using namespace suite;
using namespace std::chrono_literals;

namespace {

/// Sum of the world ranks in `members`.
int sum_of(const std::vector<int>& members) { return std::accumulate(members.begin(), members.end(), 0); }

/// The world ranks with `rank % 2 == parity`, ascending.
std::vector<int> with_parity(int n, int parity) {
  std::vector<int> v;
  for (int r = parity; r < n; r += 2) v.push_back(r);
  return v;
}

/// Runs the collectives of a group whose rank i is world rank `members[i]`, checking results.
template <class C>
void check_group(C& g, const std::vector<int>& members, int world_rank) {
  REQUIRE(g.size() == static_cast<int>(members.size()));
  REQUIRE(members[static_cast<std::size_t>(g.rank())] == world_rank);
  std::vector<std::int32_t> v{world_rank, 1};
  g.all_reduce(v);
  CHECK(v[0] == sum_of(members));
  CHECK(v[1] == g.size());
  std::vector<std::int32_t> b{g.rank() == 0 ? 1000 + world_rank : -1};
  g.broadcast(b, 0);
  CHECK(b[0] == 1000 + members[0]);
  const std::vector<std::int32_t> mine{world_rank};
  std::vector<std::int32_t> all(members.size());
  g.all_gather(mine, all);
  CHECK(std::vector<int>(all.begin(), all.end()) == members);
  g.barrier();
}

}  // namespace

TEST_CASE("split by parity: each group runs its own collectives") {
  auto c = make_comm();
  const int me = c.rank();
  auto g = c.split(me % 2, me);
  REQUIRE(g.has_value());
  check_group(*g, with_parity(c.size(), me % 2), me);
  // Async work in the group and the parent at the same time.
  std::vector<float> a{1.f}, p{2.f};
  auto wg = g->all_reduce(a, comm::async);
  auto wp = c.all_reduce(p, comm::async);
  wg.wait();
  wp.wait();
  CHECK(a[0] == static_cast<float>(g->size()));
  CHECK(p[0] == 2.f * static_cast<float>(c.size()));
}

TEST_CASE("split: ranks are ordered by (key, parent rank); one color keeps everyone") {
  auto c = make_comm();
  const int n = c.size();
  // Reversed by key.
  auto r = c.split(7, n - 1 - c.rank());
  REQUIRE(r.has_value());
  CHECK(r->rank() == n - 1 - c.rank());
  std::vector<int> reversed(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) reversed[static_cast<std::size_t>(i)] = n - 1 - i;
  check_group(*r, reversed, c.rank());
  // Equal keys: the parent rank breaks the tie.
  auto t = c.split(0, 5);
  REQUIRE(t.has_value());
  CHECK(t->rank() == c.rank());
  // split(color) keeps the parent's order.
  auto k = c.split(3);
  REQUIRE(k.has_value());
  CHECK(k->rank() == c.rank());
}

TEST_CASE("split: a negative color joins no group, the others still connect") {
  auto c = make_comm();
  const int me = c.rank();
  auto g = c.split(me == 0 ? -1 : 4, me);
  if (me == 0) {
    CHECK_FALSE(g.has_value());
  } else {
    REQUIRE(g.has_value());
    std::vector<int> members;
    for (int r = 1; r < c.size(); ++r) members.push_back(r);
    check_group(*g, members, me);
  }
  // The parent is still usable by everyone, and splits again.
  std::vector<std::int32_t> v{1};
  c.all_reduce(v);
  CHECK(v[0] == c.size());
  auto all = c.split(0, 0);
  REQUIRE(all.has_value());
  CHECK(all->size() == c.size());
}

TEST_CASE("nested split: a group split again, and new_group inside a group") {
  auto c = make_comm();
  const int n = c.size();
  const int me = c.rank();
  auto rev = c.split(0, -me);  // world reversed: group rank i is world rank n-1-i
  REQUIRE(rev.has_value());
  const int gr = rev->rank();
  auto inner = rev->split(gr % 2, gr);
  REQUIRE(inner.has_value());
  std::vector<int> members;  // world ranks, in inner order
  for (int i = gr % 2; i < n; i += 2) members.push_back(n - 1 - i);
  check_group(*inner, members, me);
  // A new_group of the reversed group's ranks {0} (world rank n-1).
  auto solo = rev->new_group({0});
  CHECK(solo.has_value() == (me == n - 1));
  if (solo) check_group(*solo, {n - 1}, me);
  // The outer groups still work after the inner ones were made.
  std::vector<std::int32_t> v{me};
  rev->all_reduce(v);
  CHECK(v[0] == n * (n - 1) / 2);
}

TEST_CASE("new_group of a subset: members ranked as listed; non-members do not block") {
  COMM_REQUIRE_RANKS(3);
  auto c = make_comm();
  const int n = c.size();
  const int me = c.rank();
  auto store = comm::test::fresh_store();
  const std::vector<int> a{2, 0};  // group A: world 2 is its rank 0, world 0 its rank 1
  std::vector<int> b;              // group B: everyone else
  for (int r = 0; r < n; ++r)
    if (r != 0 && r != 2) b.push_back(r);
  const bool in_a = me == 0 || me == 2;
  if (in_a) {
    // Members of A hold back until B has connected and run a collective. Had new_group(A) made
    // the non-members wait for A's members, B could never finish and this wait would time out.
    store->wait({"b-done"}, 30s);
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto ga = c.new_group(a);
  const auto t_a = std::chrono::steady_clock::now() - t0;
  auto gb = c.new_group(b);
  CHECK(ga.has_value() == in_a);
  CHECK(gb.has_value() == !in_a);
  if (!in_a) {
    CHECK(t_a < 1s);  // returned at once
    check_group(*gb, b, me);
    if (gb->rank() == 0) store->set("b-done", "1");
  } else {
    check_group(*ga, a, me);
    // gather to the group's rank 1 (world rank 0).
    const std::vector<std::int64_t> in{me * 10};
    std::vector<std::int64_t> out(ga->rank() == 1 ? 2 : 0);
    ga->gather(in, out, 1);
    if (ga->rank() == 1) CHECK(out == std::vector<std::int64_t>{20, 0});
  }
  c.barrier();
}

TEST_CASE("new_group: every rank, and a group of one") {
  auto c = make_comm();
  const int n = c.size();
  std::vector<int> all(static_cast<std::size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  auto g = c.new_group(all);
  REQUIRE(g.has_value());
  check_group(*g, all, c.rank());
  auto last = c.new_group({n - 1});
  CHECK(last.has_value() == (c.rank() == n - 1));
  if (last) check_group(*last, {n - 1}, c.rank());
}

TEST_CASE("new_group: bad arguments throw InvalidArgument before anything is sent") {
  auto c = make_comm();
  const int n = c.size();
  auto expect_invalid = [&](std::vector<int> ranks, const std::string& part) {
    bool thrown = false;
    try {
      (void)c.new_group(ranks);
    } catch (const comm::InvalidArgument& e) {
      thrown = true;
      const std::string msg = e.what();
      INFO("message: ", msg);
      CHECK(msg.find("new_group") != std::string::npos);
      CHECK(msg.find("rank " + std::to_string(c.rank())) != std::string::npos);
      CHECK(msg.find(part) != std::string::npos);
    }
    CHECK(thrown);
  };
  expect_invalid({}, "empty");
  expect_invalid({0, 0}, "rank 0 is listed twice");
  expect_invalid({n}, "rank " + std::to_string(n) + " is out of range [0, " + std::to_string(n) + ")");
  expect_invalid({-1}, "rank -1 is out of range");
  // Nothing was sent and no group number was used: groups still form, the parent still works.
  auto g = c.new_group({0});
  CHECK(g.has_value() == (c.rank() == 0));
  auto s = c.split(1, 0);
  REQUIRE(s.has_value());
  check_group(*s, [&] {
    std::vector<int> v(static_cast<std::size_t>(n));
    std::iota(v.begin(), v.end(), 0);
    return v;
  }(), c.rank());
}

TEST_CASE("groups outlive their parent; an adopted (Gloo) communicator cannot split") {
  std::optional<Comm> g;
  {
    auto c = make_comm();
    g = c.split(c.rank() % 2, c.rank());
#if defined(COMM_TEST_BACKEND_GLOO)
    // An adopted communicator shares the parent's gloo context but has no store.
    auto a = Comm::adopt(c.backend().context());
    CHECK_THROWS_AS((void)a.split(0, 0), comm::InvalidArgument);
    CHECK_THROWS_AS((void)a.new_group({0}), comm::InvalidArgument);
    CHECK_THROWS_AS(a.monitored_barrier(1s), comm::InvalidArgument);
#endif
    c.barrier();
  }
  REQUIRE(g.has_value());
  check_group(*g, with_parity(comm::test::world().size, comm::test::world().rank % 2), comm::test::world().rank);
}

TEST_CASE("AnyCommunicator: split and new_group give AnyCommunicators") {
  comm::AnyCommunicator w(make_comm());
  const int me = w.rank();
  auto g = w.split(me % 2, me);
  REQUIRE(g.has_value());
  CHECK(g->backend() == kBackendName);
  check_group(*g, with_parity(w.size(), me % 2), me);
  auto none = w.split(-1, 0);
  CHECK_FALSE(none.has_value());
  auto first = w.new_group({0});
  CHECK(first.has_value() == (me == 0));
  if (first) check_group(*first, {0}, me);
  CHECK_THROWS_AS((void)w.new_group({0, 0}), comm::InvalidArgument);
  w.monitored_barrier(10s);
  const auto fr = g->flight_record();
  CHECK(fr.name == "g0");
  CHECK(fr.ops.size() >= 4);
}
