// all_reduce: every element type x every op x sizes x in/out-of-place x sync/async,
// compile-time op forms, custom callables, wrap-around, integer avg, a >1M-element buffer.
#include "backend_test_util.hpp"

#include <array>
#include <functional>
#include <span>

using namespace suite;

namespace {

template <class T>
void run_all_reduce(Comm& c, ReduceOp op, std::size_t count, bool in_place, bool use_async) {
  const int n = c.size();
  std::vector<T> in(count), out(count);
  for (std::size_t i = 0; i < count; ++i) in[i] = input_value<T>(c.rank(), i, op);
  INFO("all_reduce ", type_name(comm::dtype_of<T>), " ", comm::to_string(op), " count=", count,
       in_place ? " in-place" : " out-of-place", use_async ? " async" : " blocking");
  if (in_place) {
    if (use_async) {
      auto w = c.all_reduce(in, op, comm::async);
      w.wait();
      CHECK(w.is_completed());
    } else {
      c.all_reduce(in, op);
    }
    CHECK(first_mismatch(in, [&](std::size_t i) { return reference<T>(op, n, i); }) == -1);
  } else {
    const auto before = in;
    if (use_async)
      c.all_reduce(std::span<const T>(in), std::span<T>(out), op, comm::async).wait();
    else
      c.all_reduce(std::span<const T>(in), std::span<T>(out), op);
    CHECK(first_mismatch(out, [&](std::size_t i) { return reference<T>(op, n, i); }) == -1);
    CHECK(in == before);  // the input is left alone
  }
}

}  // namespace

TEST_CASE_TEMPLATE("all_reduce: every op, size, placement and launch", T, COMM_TEST_ALL_TYPES) {
  auto c = make_comm();
  for (ReduceOp op : ops_for<T>())
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1003}})
      for (bool in_place : {true, false})
        for (bool use_async : {false, true}) run_all_reduce<T>(c, op, count, in_place, use_async);
}

TEST_CASE("all_reduce: compile-time ops, std functors and custom callables") {
  auto c = make_comm();
  const int n = c.size();
  auto check = [&](auto tag, ReduceOp op, auto&& red) {
    using T = decltype(tag);
    std::vector<T> v(13);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = input_value<T>(c.rank(), i, op);
    c.all_reduce(v, red);
    CHECK(first_mismatch(v, [&](std::size_t i) { return reference<T>(op, n, i); }) == -1);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = input_value<T>(c.rank(), i, op);
    c.all_reduce(v, red, comm::async).wait();
    CHECK(first_mismatch(v, [&](std::size_t i) { return reference<T>(op, n, i); }) == -1);
  };
  check(0.0f, ReduceOp::sum, comm::op::sum);
  check(0.0f, ReduceOp::prod, comm::op::prod);
  check(0.0f, ReduceOp::min, comm::op::min);
  check(0.0f, ReduceOp::max, comm::op::max);
  check(0.0f, ReduceOp::avg, comm::op::avg);
  check(std::int32_t{}, ReduceOp::band, comm::op::band);
  check(std::int32_t{}, ReduceOp::bor, comm::op::bor);
  check(std::int32_t{}, ReduceOp::bxor, comm::op::bxor);
  check(0.0, ReduceOp::sum, std::plus<>{});
  check(std::int64_t{}, ReduceOp::prod, std::multiplies<>{});
  check(std::uint8_t{}, ReduceOp::band, std::bit_and<>{});
  check(std::uint32_t{}, ReduceOp::bor, std::bit_or<>{});
  check(std::int8_t{}, ReduceOp::bxor, std::bit_xor<>{});
  // Custom callables T(T, T): lambdas, generic lambdas, function pointers, stateful objects.
  check(0.0f, ReduceOp::max, [](float a, float b) { return a < b ? b : a; });
  check(std::int32_t{}, ReduceOp::sum, [](auto a, auto b) { return a + b; });
  check(comm::half{}, ReduceOp::sum, [](comm::half a, comm::half b) { return comm::half(float(a) + float(b)); });
  check(comm::bfloat16{}, ReduceOp::min,
        [](comm::bfloat16 a, comm::bfloat16 b) { return float(b) < float(a) ? b : a; });
  check(std::uint64_t{}, ReduceOp::bxor, +[](std::uint64_t a, std::uint64_t b) { return a ^ b; });
  struct Min8 {  // a function object type (copied into the operation)
    std::int8_t operator()(std::int8_t a, std::int8_t b) const { return b < a ? b : a; }
  };
  check(std::int8_t{}, ReduceOp::min, Min8{});
}

TEST_CASE("all_reduce: accepts containers, arrays and spans") {
  auto c = make_comm();
  const int n = c.size();
  std::vector<float> v(5, 1.0f);
  c.all_reduce(v);  // vector by reference, in place
  CHECK(v == std::vector<float>(5, static_cast<float>(n)));
  std::array<std::int32_t, 3> a{1, 2, 3};
  c.all_reduce(a, comm::op::max);
  CHECK(a == std::array<std::int32_t, 3>{1, 2, 3});
  const std::vector<double> cin(4, 2.0);
  std::vector<double> out(4);
  c.all_reduce(cin, out);  // const container as input
  CHECK(out == std::vector<double>(4, 2.0 * n));
  std::vector<double> in2(4, 1.0);
  c.all_reduce(std::span<double>(in2), std::span<double>(out), comm::ReduceOp::sum);  // span<T> as an input
  CHECK(out == std::vector<double>(4, 1.0 * n));
  c.all_reduce(std::span<double>(in2), std::span<double>(in2));  // same buffer twice: in place
  CHECK(in2 == std::vector<double>(4, 1.0 * n));
  auto w = c.all_reduce(std::span<double>(in2), out, comm::async);
  w.wait();
  CHECK(out == std::vector<double>(4, 1.0 * n * n));
}

TEST_CASE("all_reduce: signed integer sums and products wrap around") {
  auto c = make_comm();
  const int n = c.size();
  std::vector<std::int8_t> s8(3, std::int8_t{100});
  c.all_reduce(s8);
  CHECK(s8[0] == static_cast<std::int8_t>(static_cast<std::uint8_t>(100 * n)));
  std::vector<std::int32_t> s32(3, INT32_MAX);
  c.all_reduce(s32);
  CHECK(s32[0] == static_cast<std::int32_t>(static_cast<std::uint32_t>(INT32_MAX) * static_cast<std::uint32_t>(n)));
  std::vector<std::int64_t> p64(3, std::int64_t{1} << 40);
  c.all_reduce(p64, comm::op::prod);
  std::uint64_t want = 1;
  for (int r = 0; r < n; ++r) want *= std::uint64_t{1} << 40;
  CHECK(p64[0] == static_cast<std::int64_t>(want));
}

TEST_CASE("all_reduce: integer avg uses floor division") {
  auto c = make_comm();
  const int n = c.size();
  std::vector<std::int32_t> v{c.rank() == 0 ? -7 : 0, c.rank() == 0 ? 7 : 0, -1};
  c.all_reduce(v, comm::ReduceOp::avg);
  auto floor_div = [](long long a, long long d) { return a / d - ((a % d != 0 && a < 0) ? 1 : 0); };
  CHECK(v[0] == floor_div(-7, n));
  CHECK(v[1] == 7 / n);
  CHECK(v[2] == floor_div(-n, n));
  std::vector<std::uint8_t> u{static_cast<std::uint8_t>(c.rank() + 1)};
  c.all_reduce(u, comm::op::avg);
  CHECK(u[0] == (n * (n + 1) / 2) / n);
}

TEST_CASE("all_reduce: more than a million elements") {
  auto c = make_comm();
  const int n = c.size();
  const std::size_t count = (std::size_t{1} << 20) + 3;
  std::vector<float> v(count);
  for (std::size_t i = 0; i < count; ++i) v[i] = input_value<float>(c.rank(), i, ReduceOp::sum);
  c.all_reduce(v);
  CHECK(first_mismatch(v, [&](std::size_t i) { return reference<float>(ReduceOp::sum, n, i); }) == -1);
}

#if defined(COMM_TEST_BACKEND_SHM)
// Shm folds a custom callable from the left in rank order (docs/BACKENDS.md): with one that is
// neither commutative nor associative, every rank gets the rank-ordered fold, in place or not, on
// each path the size picks (one step, the segment's chunks, single copy from 1 MiB). In place, a
// rank whose input is not the first operand once started the fold from its own input (all_reduce,
// reduce), or copied its own block through the segment to avoid that (reduce_scatter).
TEST_CASE("all_reduce, reduce_scatter and reduce: a custom callable is folded in rank order") {
  auto c = make_comm();
  const int n = c.size();
  auto f = [](std::uint32_t a, std::uint32_t b) { return a * 31u + b; };
  auto input = [](int r, std::size_t i) { return static_cast<std::uint32_t>(r) * 1000003u + static_cast<std::uint32_t>(i) * 7u + 1u; };
  auto want = [&](std::size_t i) {
    std::uint32_t acc = input(0, i);
    for (int r = 1; r < n; ++r) acc = f(acc, input(r, i));
    return acc;
  };
  for (std::size_t count : {std::size_t{13}, std::size_t{2000}, std::size_t{20000}, std::size_t{300000}}) {
    for (bool in_place : {true, false}) {
      INFO("count=", count, std::string(in_place ? " in-place" : " out-of-place"));
      std::vector<std::uint32_t> in(count), out(count);
      for (std::size_t i = 0; i < count; ++i) in[i] = input(c.rank(), i);
      if (in_place) {
        c.all_reduce(in, f);
        CHECK(first_mismatch(in, want) == -1);
      } else {
        c.all_reduce(std::span<const std::uint32_t>(in), std::span<std::uint32_t>(out), f);
        CHECK(first_mismatch(out, want) == -1);
      }
      // reduce_scatter: in place the output is this rank's block of the input.
      {
        const auto me = static_cast<std::size_t>(c.rank());
        std::vector<std::uint32_t> all(count * static_cast<std::size_t>(n));
        for (std::size_t i = 0; i < all.size(); ++i) all[i] = input(c.rank(), i);
        const std::span<std::uint32_t> mine =
            in_place ? std::span<std::uint32_t>(all.data() + me * count, count) : std::span<std::uint32_t>(out);
        c.reduce_scatter(std::span<const std::uint32_t>(all), mine, f);
        const std::vector<std::uint32_t> got(mine.begin(), mine.end());
        CHECK(first_mismatch(got, [&](std::size_t i) { return want(me * count + i); }) == -1);
      }
      // reduce at the last rank: in place its input is the last operand.
      const int root = n - 1;
      for (std::size_t i = 0; i < count; ++i) in[i] = input(c.rank(), i);
      if (in_place) {
        c.reduce(in, root, f);
        if (c.rank() == root) CHECK(first_mismatch(in, want) == -1);
      } else {
        c.reduce(std::span<const std::uint32_t>(in), std::span<std::uint32_t>(out), root, f);
        if (c.rank() == root) CHECK(first_mismatch(out, want) == -1);
      }
    }
  }
}
#endif
