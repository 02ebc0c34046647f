// Hierarchical<Shm, Gloo> beyond the shared suites: the node structure derived from node ids
// (unit checks), and every collective on several node layouts of 4 ranks (consecutive, interleaved,
// neither, nodes of different sizes, one rank per node), with counts around the slice boundaries,
// all three all_reduce forms (two steps, slices, slices in pipelined segments), against results
// computed here.
#include "backend_test_util.hpp"

#include <cstdlib>
#include <numeric>
#include <string>
#include <vector>

#include <comm/detail/hierarchical/cross.hpp>
#include <comm/detail/hierarchical/topology.hpp>

using namespace suite;
namespace h = comm::detail::hierarchical;

TEST_CASE("topology: nodes by first rank, local ranks in rank order, uniform or not") {
  const auto t = h::make_topology({"b", "a", "b", "a", "c", "c"});
  CHECK(t.num_nodes() == 3);
  CHECK(t.nodes == std::vector<std::vector<int>>{{0, 2}, {1, 3}, {4, 5}});
  CHECK(t.node_of == std::vector<int>{0, 1, 0, 1, 2, 2});
  CHECK(t.local_of == std::vector<int>{0, 0, 1, 1, 0, 1});
  CHECK(t.uniform);
  CHECK(t.inter_group(1) == std::vector<int>{2, 3, 5});
  CHECK_FALSE(t.local_major_is_rank_order());  // rank 4 would be local 1 of node 0
  CHECK_FALSE(t.node_major_is_rank_order());
  CHECK(t.describe() == "3 nodes of 2 ranks");

  const auto inter = h::make_topology({"x", "y", "x", "y"});
  CHECK(inter.local_major_is_rank_order());
  CHECK_FALSE(inter.node_major_is_rank_order());
  const auto blocks = h::make_topology({"x", "x", "y", "y"});
  CHECK_FALSE(blocks.local_major_is_rank_order());
  CHECK(blocks.node_major_is_rank_order());

  const auto uneven = h::make_topology({"p", "p", "p", "q"});
  CHECK_FALSE(uneven.uniform);
  CHECK(uneven.describe() == "2 nodes of 3, 1 ranks");
  CHECK(uneven.inter_group(0) == std::vector<int>{0, 3});
}

TEST_CASE("peers named by a member are translated to ranks of the communicator") {
  const std::vector<int> group{5, 2, 7};
  CHECK(h::map_peer("rank 1", group) == "rank 2");
  CHECK(h::map_peer("2", group) == "7");
  CHECK(h::map_peer("rank 3", group) == "rank 3");  // not a member rank: left alone
  CHECK(h::map_peer("10.0.0.1:4000", group) == "10.0.0.1:4000");
  CHECK(h::map_peer("", group).empty());
}

TEST_CASE("the cross-node form by node count, size and step") {
  constexpr std::size_t KiB = 1024;
  using h::Cross;
  using h::Step;
  auto form = [](std::size_t nodes, std::size_t bytes, Step s) {
    return h::cross_form(Cross::automatic, nodes, bytes, s);
  };
  for (Step s : {Step::alone, Step::segment}) {
    INFO("segment ", s == Step::segment);
    CHECK(form(2, 1024 * KiB, s) == Cross::member);  // one exchange at 2 nodes
    CHECK(form(2, 128 * KiB, s) == Cross::member);
    // Doubling below 32 KiB a rank, rsag from there while the member doubles.
    CHECK(form(3, 32 * KiB - 1, s) == Cross::member);
    CHECK(form(4, 16 * KiB, s) == Cross::member);
    CHECK(form(3, 32 * KiB, s) == Cross::rsag);
    CHECK(form(4, 32 * KiB, s) == Cross::rsag);
    CHECK(form(4, 48 * KiB, s) == Cross::rsag);
    CHECK(form(4, 256 * KiB, s) == Cross::rsag);
    CHECK(form(4, 2048 * KiB, s) == Cross::member);  // blocks above kCrossBlockMax
  }
  // Above the member's doubling: its ring alone, rsag as a pipeline's segment.
  CHECK(form(4, 512 * KiB, Step::alone) == Cross::member);
  CHECK(form(4, 1024 * KiB, Step::alone) == Cross::member);
  CHECK(form(4, 512 * KiB, Step::segment) == Cross::rsag);
  CHECK(form(4, 1024 * KiB, Step::segment) == Cross::rsag);
  CHECK(form(3, 768 * KiB, Step::segment) == Cross::rsag);
  // A forced form wins everywhere.
  CHECK(h::cross_form(Cross::gather, 2, 8, Step::alone) == Cross::gather);
  CHECK(h::cross_form(Cross::rsag, 4, 4096 * KiB, Step::alone) == Cross::rsag);
  CHECK(h::cross_form(Cross::member, 4, 256 * KiB, Step::segment) == Cross::member);
}

TEST_CASE("a node's leader carries its buffer across alone from 32 to 128 KiB, with several ranks per node") {
  constexpr std::size_t KiB = 1024;
  CHECK_FALSE(h::leaders_carry(1, 64 * KiB));  // one rank per node: it carries it anyway
  CHECK_FALSE(h::leaders_carry(2, 32 * KiB - 1));
  CHECK(h::leaders_carry(2, 32 * KiB));
  CHECK(h::leaders_carry(2, 64 * KiB));
  CHECK(h::leaders_carry(8, 128 * KiB));
  CHECK_FALSE(h::leaders_carry(2, 128 * KiB + 1));
  CHECK_FALSE(h::leaders_carry(4, 256 * KiB));
}

namespace {

struct Layout {
  const char* name;
  std::vector<int> node;  // node of each of the 4 ranks
  int nodes;
  bool uniform;
};

/// Every collective on `c` (only the all_reduce forms unless `all_ops`), checked element by
/// element (int32: exact in every order).
void check_ops(Comm& c, std::size_t count, bool all_ops) {
  const int n = c.size();
  const int me = c.rank();
  const auto un = static_cast<std::size_t>(n);
  INFO("count ", count);
  auto val = [](int r, std::size_t i) { return static_cast<std::int32_t>((r + 1) * 1000 + static_cast<int>(i % 997)); };
  auto sum = [&](std::size_t i) {
    std::int32_t s = 0;
    for (int r = 0; r < n; ++r) s += val(r, i);
    return s;
  };
  // all_reduce: out of place and in place, sum, max and a custom callable.
  std::vector<std::int32_t> in(count), out(count, -1);
  for (std::size_t i = 0; i < count; ++i) in[i] = val(me, i);
  c.all_reduce(std::span<const std::int32_t>(in), std::span<std::int32_t>(out));
  CHECK(first_mismatch(out, sum) == -1);
  auto inplace = in;
  c.all_reduce(inplace, comm::op::max);
  CHECK(first_mismatch(inplace, [&](std::size_t i) { return val(n - 1, i); }) == -1);
  inplace = in;
  c.all_reduce(inplace, [](std::int32_t a, std::int32_t b) { return a < b ? a : b; }, comm::async).wait();
  CHECK(first_mismatch(inplace, [&](std::size_t i) { return val(0, i); }) == -1);
  // avg of integers: the floor of the mean of the sum.
  inplace = in;
  c.all_reduce(inplace, comm::ReduceOp::avg);
  CHECK(first_mismatch(inplace, [&](std::size_t i) { return static_cast<std::int32_t>(sum(i) / n); }) == -1);
  if (!all_ops) return;

  // reduce_scatter: rank r gets block r; out of place and in place.
  std::vector<std::int32_t> rs_in(un * count), rs_out(count, -1);
  for (std::size_t i = 0; i < rs_in.size(); ++i) rs_in[i] = val(me, i);
  c.reduce_scatter(rs_in, rs_out);
  CHECK(first_mismatch(rs_out, [&](std::size_t i) { return sum(static_cast<std::size_t>(me) * count + i); }) == -1);
  c.reduce_scatter(std::span<const std::int32_t>(rs_in),
                   std::span<std::int32_t>(rs_in.data() + static_cast<std::size_t>(me) * count, count));
  CHECK(first_mismatch(rs_in, [&](std::size_t i) { return sum(i); }, static_cast<std::size_t>(me) * count, count) ==
        -1);

  // all_gather: out of place and in place.
  std::vector<std::int32_t> ag(un * count, -1);
  c.all_gather(std::span<const std::int32_t>(in), std::span<std::int32_t>(ag));
  const std::size_t per = std::max<std::size_t>(count, 1);
  CHECK(first_mismatch(ag, [&](std::size_t i) { return val(static_cast<int>(i / per), i % per); }) == -1);
  std::vector<std::int32_t> ag2(un * count, -1);
  std::copy(in.begin(), in.end(), ag2.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(me) * count));
  c.all_gather(std::span<const std::int32_t>(ag2.data() + static_cast<std::size_t>(me) * count, count),
               std::span<std::int32_t>(ag2));
  CHECK(ag2 == ag);

  for (int root = 0; root < n; ++root) {
    INFO("root ", root);
    // broadcast
    std::vector<std::int32_t> b(count);
    for (std::size_t i = 0; i < count; ++i) b[i] = me == root ? val(root, i) : -7;
    c.broadcast(b, root);
    CHECK(first_mismatch(b, [&](std::size_t i) { return val(root, i); }) == -1);
    // gather (the root's input in its output slot, in place)
    std::vector<std::int32_t> g(me == root ? un * count : 0, -1);
    if (me == root) {
      std::copy(in.begin(), in.end(), g.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(me) * count));
      c.gather(std::span<const std::int32_t>(g.data() + static_cast<std::size_t>(me) * count, count),
               std::span<std::int32_t>(g), root);
      CHECK(g == ag);
    } else {
      c.gather(in, g, root);
    }
  }
  c.barrier();
}

}  // namespace

TEST_CASE("every collective on node layouts of 4 ranks, both all_reduce forms, counts around slices") {
  COMM_REQUIRE_RANKS(4);
  const auto& w = comm::test::world();
  if (w.size != 4) return;  // the layouts are of exactly 4 ranks
  const std::vector<Layout> layouts{
      {"consecutive", {0, 0, 1, 1}, 2, true},  {"interleaved", {0, 1, 0, 1}, 2, true},
      {"neither", {0, 1, 1, 0}, 2, true},      {"3+1", {0, 0, 1, 0}, 2, false},
      {"one rank per node", {0, 1, 2, 3}, 4, true}, {"one node", {0, 0, 0, 0}, 1, true}};
  for (const auto& l : layouts) {
    for (std::size_t small_max : {std::size_t{0}, std::size_t{1} << 20}) {
      INFO("layout ", l.name, ", small_max ", small_max);
      Options o;
      o.node_id = "layout-node-" + std::to_string(l.node[static_cast<std::size_t>(w.rank)]);
      o.small_max = small_max;
      auto c = make_comm(o);
      CHECK(c.backend().num_nodes() == l.nodes);
      CHECK(c.backend().uniform_nodes() == l.uniform);
      CHECK(c.backend().node() == l.node[static_cast<std::size_t>(w.rank)]);
      // 10001: 40 KB, crossed by the nodes' leaders (below small_max: every rank).
      for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{2}, std::size_t{3}, std::size_t{5},
                                std::size_t{1000}, std::size_t{4097}, std::size_t{10001}})
        check_ops(c, count, true);
      if (small_max == 0) check_ops(c, 300001, false);  // the pipelined segments, the last one padded
    }
  }
}

namespace {

/// Sets COMM_HIERARCHICAL_CROSS for the communicators made while it lives ("" unsets it).
struct CrossForm {
  explicit CrossForm(const char* form) {
    if (*form != 0)
      ::setenv("COMM_HIERARCHICAL_CROSS", form, 1);
    else
      ::unsetenv("COMM_HIERARCHICAL_CROSS");
  }
  ~CrossForm() { ::unsetenv("COMM_HIERARCHICAL_CROSS"); }
  CrossForm(const CrossForm&) = delete;
  CrossForm& operator=(const CrossForm&) = delete;
};

}  // namespace

TEST_CASE("the cross-node all_reduce forms at 3 and 4 nodes (gather, reduce_scatter + all_gather)") {
  COMM_REQUIRE_RANKS(4);
  const auto& w = comm::test::world();
  if (w.size != 4) return;
  // Uniform nodes of one rank (every all_reduce is the cross-node step), and 3 nodes of different
  // sizes (the leaders' step). "" is the automatic choice: the member's all_reduce up to 4097
  // elements, rsag (padded to whole blocks) for 50001, the member's ring for 90001 (360 KB). Forced
  // forms run at every count.
  const std::vector<Layout> layouts{{"4 nodes of 1", {0, 1, 2, 3}, 4, true}, {"3 nodes, 2+1+1", {0, 0, 1, 2}, 3, false}};
  for (const auto& l : layouts) {
    for (const char* form : {"", "gather", "rsag", "member"}) {
      INFO("layout ", l.name, ", COMM_HIERARCHICAL_CROSS=", form);
      const CrossForm f(form);
      Options o;
      o.node_id = "cross-node-" + std::to_string(l.node[static_cast<std::size_t>(w.rank)]);
      auto c = make_comm(o);
      CHECK(c.backend().num_nodes() == l.nodes);
      for (std::size_t count : {std::size_t{1}, std::size_t{3}, std::size_t{5}, std::size_t{1000}, std::size_t{4097},
                                std::size_t{50001}, std::size_t{90001}})
        check_ops(c, count, false);
    }
  }
}

TEST_CASE("3 nodes of 2: the cross-node forms in the slice and pipelined all_reduce") {
  // Run by hierarchical_test.np6 alone (6 ranks); skipped in the 4-rank run.
  const auto& w = comm::test::world();
  if (w.size != 6) return;
  for (const char* form : {"", "rsag", "gather"}) {
    INFO("COMM_HIERARCHICAL_CROSS=", form);
    const CrossForm f(form);
    Options o;
    o.node_id = "three-" + std::to_string(w.rank / 2);
    o.small_max = 0;
    auto c = make_comm(o);
    CHECK(c.backend().num_nodes() == 3);
    // 7, 4097 and 5001: slices (padded to a multiple of 2; of 6 under forced rsag), 10 KB ones by
    // doubling; 10001 and 20001: the nodes' leaders carry 40 and 80 KB across (rsag; 10001 padded
    // to whole blocks); 40001: one segment whose 80 KB slices take rsag; 300001: pipelined
    // segments, the last one padded.
    for (std::size_t count : {std::size_t{1}, std::size_t{7}, std::size_t{4097}, std::size_t{5001}, std::size_t{10001},
                              std::size_t{20001}, std::size_t{40001}, std::size_t{300001}})
      check_ops(c, count, count == 7);
  }
}

TEST_CASE("one rank per node: above 2 MiB a node, from 4 nodes, the all_reduce crosses in rsag segments") {
  constexpr std::size_t MiB = std::size_t{1} << 20;
  CHECK_FALSE(h::cross_segmented(1, 4, 8 * MiB));  // a ring chunk of one block: the ring
  CHECK(h::cross_segmented(1, 4, 8 * MiB + 4));
  CHECK(h::cross_segmented(1, 8, 17 * MiB));
  CHECK_FALSE(h::cross_segmented(1, 3, 64 * MiB));  // 3 nodes: the ring kept the link busy
  CHECK_FALSE(h::cross_segmented(1, 2, 64 * MiB));  // 2 nodes: one exchange, nothing to cut
  CHECK_FALSE(h::cross_segmented(2, 4, 64 * MiB));  // several ranks a node: the slice pipeline
  // 4 nodes of one rank (the 4-rank run), int32: 2,097,152 is 2 MiB a node (the ring); 2,100,003
  // crosses in 9 segments of 233,336-byte blocks, the last one padded to whole blocks; forced
  // forms keep the whole buffer in one step. The results against the sums check the cuts.
  const auto& w = comm::test::world();
  if (w.size != 4) return;
  Options o;
  o.node_id = "one-" + std::to_string(w.rank);
  auto c = make_comm(o);
  CHECK(c.backend().num_nodes() == 4);
  for (std::size_t count : {std::size_t{2'097'152}, std::size_t{2'100'003}}) check_ops(c, count, false);
  const CrossForm f("rsag");
  auto forced = make_comm(o);
  check_ops(forced, 2'100'003, false);
}

TEST_CASE("split by node gives the node's ranks; new_group across nodes") {
  COMM_REQUIRE_RANKS(2);
  auto c = make_comm();
  const int me = c.rank();
  auto node = c.split(c.backend().node(), me);
  REQUIRE(node.has_value());
  CHECK(node->size() == c.backend().local_size());
  CHECK(node->backend().num_nodes() == 1);
  std::vector<std::int32_t> v{me};
  node->all_reduce(v);
  // The sum of the ranks on this node, from every rank's node number.
  std::int32_t want = 0;
  std::vector<std::int32_t> nodes_of(static_cast<std::size_t>(c.size()));
  const std::vector<std::int32_t> my_node{c.backend().node()};
  c.all_gather(my_node, nodes_of);
  for (int r = 0; r < c.size(); ++r)
    if (nodes_of[static_cast<std::size_t>(r)] == c.backend().node()) want += r;
  CHECK(v[0] == want);
  // A group of the first and the last rank: on two nodes whenever the world has two.
  auto ends = c.new_group({0, c.size() - 1});
  CHECK(ends.has_value() == (me == 0 || me == c.size() - 1));
  if (ends) {
    std::vector<std::int32_t> x{me};
    ends->all_reduce(x);
    CHECK(x[0] == c.size() - 1);
  }
}
