// reduce_scatter: every element type x op x sizes x in/out-of-place
// x sync/async, compile-time ops and custom callables, multi-segment pipelines, >1M elements.
#include "backend_test_util.hpp"

#include <functional>
#include <span>

#include <support/env_guard.hpp>

using namespace suite;

namespace {

template <class T>
void run_reduce_scatter(Comm& c, ReduceOp op, std::size_t count, bool in_place, bool use_async) {
  const int n = c.size();
  const auto r = static_cast<std::size_t>(c.rank());
  std::vector<T> in(count * static_cast<std::size_t>(n)), out(count);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = input_value<T>(c.rank(), i, op);
  INFO("reduce_scatter ", type_name(comm::dtype_of<T>), " ", comm::to_string(op), " count=", count,
       in_place ? " in-place" : " out-of-place", use_async ? " async" : " blocking");
  auto want = [&](std::size_t i) { return reference<T>(op, n, r * count + i); };
  if (in_place) {
    // The output is this rank's slot of the input.
    const std::span<T> slot(in.data() + r * count, count);
    if (use_async)
      c.reduce_scatter(std::span<const T>(in), slot, op, comm::async).wait();
    else
      c.reduce_scatter(std::span<const T>(in), slot, op);
    std::vector<T> got(slot.begin(), slot.end());
    CHECK(first_mismatch(got, want) == -1);
  } else {
    if (use_async)
      c.reduce_scatter(in, out, op, comm::async).wait();
    else
      c.reduce_scatter(in, out, op);
    CHECK(first_mismatch(out, want) == -1);
    // The input is left alone.
    CHECK(first_mismatch(in, [&](std::size_t i) { return input_value<T>(c.rank(), i, op); }) == -1);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("reduce_scatter: every op, size, placement and launch", T, COMM_TEST_ALL_TYPES) {
  auto c = make_comm();
  for (ReduceOp op : ops_for<T>())
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1003}})
      for (bool in_place : {true, false})
        for (bool use_async : {false, true}) run_reduce_scatter<T>(c, op, count, in_place, use_async);
}

TEST_CASE("reduce_scatter: inputs around the size of a step's small payload") {
  // Shm, through the segment (single copy off), leaves this rank's own piece out of a step's
  // payload above 64 KiB of input (as all_to_all and scatter: shm/engine.hpp, Pieces); each rank
  // must still reduce its own piece. The other backends ignore the variable.
  comm::test::ScopedEnv no_cma("COMM_SHM_CMA", "0");
  auto c = make_comm();
  const auto n = static_cast<std::size_t>(c.size());
  for (std::size_t total : {std::size_t{65536}, std::size_t{65600}, std::size_t{98304}, std::size_t{130048}})
    for (bool in_place : {true, false})
      run_reduce_scatter<float>(c, ReduceOp::sum, total / (sizeof(float) * n), in_place, false);
}

TEST_CASE("reduce_scatter: compile-time ops, std functors and custom callables") {
  auto c = make_comm();
  const int n = c.size();
  const auto r = static_cast<std::size_t>(c.rank());
  auto check = [&](auto tag, ReduceOp op, auto&& red) {
    using T = decltype(tag);
    const std::size_t count = 9;
    std::vector<T> in(count * static_cast<std::size_t>(n)), out(count);
    for (std::size_t i = 0; i < in.size(); ++i) in[i] = input_value<T>(c.rank(), i, op);
    c.reduce_scatter(in, out, red);
    CHECK(first_mismatch(out, [&](std::size_t i) { return reference<T>(op, n, r * count + i); }) == -1);
    std::fill(out.begin(), out.end(), T{});
    c.reduce_scatter(in, out, red, comm::async).wait();
    CHECK(first_mismatch(out, [&](std::size_t i) { return reference<T>(op, n, r * count + i); }) == -1);
  };
  check(0.0f, ReduceOp::avg, comm::op::avg);
  check(std::int32_t{}, ReduceOp::bxor, comm::op::bxor);
  check(std::int64_t{}, ReduceOp::max, comm::op::max);
  check(0.0, ReduceOp::sum, std::plus<>{});
  check(std::uint32_t{}, ReduceOp::prod, std::multiplies<>{});
  check(std::uint8_t{}, ReduceOp::bor, std::bit_or<>{});
  check(0.0f, ReduceOp::min, [](float a, float b) { return b < a ? b : a; });
  check(comm::bfloat16{}, ReduceOp::sum,
        [](comm::bfloat16 a, comm::bfloat16 b) { return comm::bfloat16(float(a) + float(b)); });
}

TEST_CASE("reduce_scatter: multi-segment pipeline and more than a million elements") {
  auto c = make_comm();
  const int n = c.size();
  const auto r = static_cast<std::size_t>(c.rank());
  {  // float: > 1M input elements, output spanning several 512 KiB segments with a ragged tail
    const std::size_t count = (std::size_t{1} << 20) / static_cast<std::size_t>(n) + 4099;
    std::vector<float> in(count * static_cast<std::size_t>(n)), out(count);
    for (std::size_t i = 0; i < in.size(); ++i) in[i] = input_value<float>(c.rank(), i, ReduceOp::sum);
    c.reduce_scatter(in, out);
    CHECK(first_mismatch(out, [&](std::size_t i) { return reference<float>(ReduceOp::sum, n, r * count + i); }) == -1);
  }
  {  // int64 avg, 3+ segments, in place
    const std::size_t count = 200003;
    std::vector<std::int64_t> in(count * static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < in.size(); ++i) in[i] = input_value<std::int64_t>(c.rank(), i, ReduceOp::avg);
    const std::span<std::int64_t> slot(in.data() + r * count, count);
    c.reduce_scatter(std::span<const std::int64_t>(in), slot, comm::ReduceOp::avg, comm::async).wait();
    std::vector<std::int64_t> got(slot.begin(), slot.end());
    CHECK(first_mismatch(got, [&](std::size_t i) { return reference<std::int64_t>(ReduceOp::avg, n, r * count + i); }) ==
          -1);
  }
  {  // a chunk of ~24 segments: the pipeline's buffering must not deadlock however long a chunk is
    const std::size_t count = (std::size_t{3} << 20) + 17;
    std::vector<float> in(count * static_cast<std::size_t>(n)), out(count);
    for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>((i + r) % 5);
    c.reduce_scatter(in, out);
    CHECK(first_mismatch(out, [&](std::size_t i) {
            float want = 0;
            for (std::size_t q = 0; q < static_cast<std::size_t>(n); ++q)
              want += static_cast<float>((r * count + i + q) % 5);
            return want;
          }) == -1);
  }
}
