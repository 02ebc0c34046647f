// Argument checks: each bad call throws comm::InvalidArgument naming the op, the rank and the
// offending sizes/values before anything is sent, and the communicator stays usable.
#include "backend_test_util.hpp"

#include <span>
#include <string>
#include <type_traits>

using namespace suite;

namespace {

/// Runs `f`, expects InvalidArgument whose message contains each of `parts`.
template <class F>
void expect_invalid(F&& f, std::initializer_list<std::string> parts) {
  bool thrown = false;
  try {
    f();
  } catch (const comm::InvalidArgument& e) {
    thrown = true;
    const std::string msg = e.what();
    INFO("message: ", msg);
    for (const auto& p : parts) CHECK(msg.find(p) != std::string::npos);
  }
  CHECK(thrown);
}

/// A collective that must still work after the bad calls.
void still_usable(Comm& c) {
  std::vector<std::int32_t> v{1};
  c.all_reduce(v);
  CHECK(v[0] == c.size());
}

}  // namespace

TEST_CASE("arguments: sizes") {
  auto c = make_comm();
  const int n = c.size();
  const std::string rank = "on rank " + std::to_string(c.rank());
  const auto un = static_cast<std::size_t>(n);

  std::vector<float> a(5), b(6);
  expect_invalid([&] { c.all_reduce(a, b); }, {"all_reduce", rank, "input has 5 elements", "output has 6"});
  expect_invalid([&] { (void)c.all_reduce(a, b, comm::async); }, {"all_reduce", rank, "5", "6"});

  std::vector<float> in(un * 2 + 1), out(2);
  const std::string rs = "input has " + std::to_string(un * 2 + 1) + " elements, expected size()*output = " +
                         std::to_string(un * 2);
  expect_invalid([&] { c.reduce_scatter(in, out); }, {"reduce_scatter", rank, rs});
  expect_invalid([&] { (void)c.reduce_scatter(in, out, comm::op::max, comm::async); }, {"reduce_scatter", rank, rs});

  std::vector<double> gin(3), gout(un * 3 + 1);
  const std::string ag = "output has " + std::to_string(un * 3 + 1) + " elements, expected size()*input = " +
                         std::to_string(un * 3);
  expect_invalid([&] { c.all_gather(gin, gout); }, {"all_gather", rank, ag});
  expect_invalid([&] { (void)c.all_gather(gin, gout, comm::async); }, {"all_gather", rank, ag});

  if (n > 1) {
    // torch's order, all_gather_into_tensor(output, input): the message says the order is (input, output).
    std::vector<float> whole(un * 4), part(4);
    const std::string hint = "the arguments are (input, output), the reverse of torch's";
    expect_invalid([&] { c.all_gather(whole, part); }, {"all_gather", rank, hint});
    expect_invalid([&] { c.reduce_scatter(part, whole); }, {"reduce_scatter", rank, hint});
    try {
      c.all_gather(gin, gout);  // wrong, but not a swap: no hint
      FAIL("all_gather accepted mismatched sizes");
    } catch (const comm::InvalidArgument& e) {
      CHECK(std::string(e.what()).find(hint) == std::string::npos);
    }
  }

  std::vector<std::int64_t> tin(2), tout(un * 2 - 1);
  // Only the root checks its output; make every rank the root once.
  for (int root = 0; root < n; ++root) {
    if (c.rank() == root)
      expect_invalid([&] { c.gather(tin, tout, root); },
                     {"gather", rank, "output has " + std::to_string(un * 2 - 1) + " element", "on the root",
                      "expected size()*input = " + std::to_string(un * 2)});
  }
  still_usable(c);
}

TEST_CASE("arguments: roots") {
  auto c = make_comm();
  const int n = c.size();
  const std::string rank = "on rank " + std::to_string(c.rank());
  std::vector<float> v(3);
  std::vector<float> out(static_cast<std::size_t>(n) * 3);
  for (int root : {-1, n, n + 5}) {
    const std::string what = "root " + std::to_string(root) + " is out of range [0, " + std::to_string(n) + ")";
    expect_invalid([&] { c.broadcast(v, root); }, {"broadcast", rank, what});
    expect_invalid([&] { (void)c.broadcast(v, root, comm::async); }, {"broadcast", rank, what});
    expect_invalid([&] { c.gather(v, out, root); }, {"gather", rank, what});
  }
  still_usable(c);
}

TEST_CASE("arguments: overlapping buffers") {
  auto c = make_comm();
  const int n = c.size();
  const auto un = static_cast<std::size_t>(n);
  const std::string rank = "on rank " + std::to_string(c.rank());
  std::vector<float> buf(10 * un + 10);
  // all_reduce: partial overlap
  expect_invalid([&] { c.all_reduce(std::span<const float>(buf.data(), 6), std::span<float>(buf.data() + 1, 6)); },
                 {"all_reduce", rank, "overlap"});
  // reduce_scatter: output inside the input but not at this rank's slot
  const std::size_t wrong = c.rank() == 0 ? 1 : 0;
  expect_invalid(
      [&] { c.reduce_scatter(std::span<const float>(buf.data(), 2 * un), std::span<float>(buf.data() + wrong, 2)); },
      {"reduce_scatter", rank, "overlaps"});
  // all_gather: input inside the output but not at this rank's slot
  expect_invalid(
      [&] { c.all_gather(std::span<const float>(buf.data() + wrong, 2), std::span<float>(buf.data(), 2 * un)); },
      {"all_gather", rank, "overlaps"});
  still_usable(c);
}

TEST_CASE("arguments: runtime ReduceOp checked at run time") {
  auto c = make_comm();
  const std::string rank = "on rank " + std::to_string(c.rank());
  std::vector<float> f(4);
  std::vector<comm::half> h(4);
  std::vector<float> out(4 * static_cast<std::size_t>(c.size()));
  expect_invalid([&] { c.all_reduce(f, comm::ReduceOp::band); },
                 {"all_reduce", rank, "band", "float", "integer element type"});
  expect_invalid([&] { c.all_reduce(h, comm::ReduceOp::bxor); }, {"all_reduce", rank, "bxor", "half"});
  std::vector<comm::float8_e4m3> f8(4);
  expect_invalid([&] { c.all_reduce(f8, comm::ReduceOp::band); }, {"all_reduce", rank, "band", "float8_e4m3"});
  expect_invalid([&] { (void)c.reduce_scatter(out, f, comm::ReduceOp::bor, comm::async); },
                 {"reduce_scatter", rank, "bor", "float"});
  expect_invalid([&] { c.all_reduce(f, static_cast<comm::ReduceOp>(42)); }, {"all_reduce", rank, "42"});
  still_usable(c);
}

TEST_CASE("arguments: construction") {
  const auto& w = comm::test::world();
  auto expect = [](auto&& f, const std::string& part) {
    bool thrown = false;
    try {
      f();
    } catch (const comm::InvalidArgument& e) {
      thrown = true;
      INFO("message: ", e.what());
      CHECK(std::string(e.what()).find(part) != std::string::npos);
    }
    CHECK(thrown);
  };
  expect([&] { (void)Comm::create(nullptr, 0, 1); }, "store is null");
  expect([&] { (void)Comm::create(comm::test::fresh_store(), 0, 0); }, "size 0");
  expect([&] { (void)Comm::create(comm::test::fresh_store(), 3, 2); }, "rank 3 is out of range [0, 2)");
  Options o;
  o.timeout = std::chrono::milliseconds(0);
  expect([&] { (void)Comm::create(comm::test::fresh_store(), w.rank, w.size, o); }, "must be positive");
#if defined(COMM_TEST_BACKEND_GLOO)
  Options bad;
  bad.interfaces = {"comm-no-such-if0"};
  expect([&] { (void)Comm::create(comm::test::fresh_store(), w.rank, w.size, bad); }, "comm-no-such-if0");
  expect([&] { (void)Comm::adopt(std::shared_ptr<gloo::Context>()); }, "null");
#endif
}

// create() checks its arguments in one place (detail/engine/policy.hpp) for every backend: the
// same message, naming the backend's init step, the rank and the value.
TEST_CASE("arguments: construction, one message for every backend") {
  static_assert(std::is_base_of_v<comm::CommonOptions, Options>, "a backend's options derive from CommonOptions");
  const auto& w = comm::test::world();
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const comm::InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("(nothing thrown)");
  };
  const std::string init = "comm: " + std::string(Backend::name) + ".init on rank ";
  CHECK(message([&] { (void)Comm::create(nullptr, 0, 1); }) == init + "0: store is null");
  CHECK(message([&] { (void)Comm::create(comm::test::fresh_store(), 0, 0); }) == init + "0: size 0 must be at least 1");
  CHECK(message([&] { (void)Comm::create(comm::test::fresh_store(), -1, 2); }) ==
        "comm: " + std::string(Backend::name) + ".init: rank -1 is out of range [0, 2)");
  CHECK(message([&] { (void)Comm::create(comm::test::fresh_store(), 3, 2); }) ==
        init + "3: rank 3 is out of range [0, 2)");
  Options o;
  o.timeout = std::chrono::milliseconds(-5);
  CHECK(message([&] { (void)Comm::create(comm::test::fresh_store(), w.rank, w.size, o); }) ==
        init + std::to_string(w.rank) + ": timeout -5 ms must be positive");
}
