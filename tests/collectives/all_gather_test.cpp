// all_gather: every element type x sizes x in/out-of-place x sync/async, rank order,
// spans and containers, >1M elements.
#include "backend_test_util.hpp"

#include <span>

using namespace suite;

namespace {

template <class T>
T gather_value(int rank, std::size_t i) {
  return input_value<T>(rank, i, ReduceOp::min);
}

template <class T>
void run_all_gather(Comm& c, std::size_t count, bool in_place, bool use_async) {
  const int n = c.size();
  const auto r = static_cast<std::size_t>(c.rank());
  INFO("all_gather ", type_name(comm::dtype_of<T>), " count=", count, in_place ? " in-place" : " out-of-place",
       use_async ? " async" : " blocking");
  std::vector<T> in(count), out(count * static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < count; ++i) in[i] = gather_value<T>(c.rank(), i);
  if (in_place) {
    std::copy(in.begin(), in.end(), out.begin() + static_cast<std::ptrdiff_t>(r * count));
    const std::span<const T> slot(out.data() + r * count, count);
    if (use_async)
      c.all_gather(slot, out, comm::async).wait();
    else
      c.all_gather(slot, out);
  } else {
    if (use_async)
      c.all_gather(in, out, comm::async).wait();
    else
      c.all_gather(in, out);
  }
  CHECK(first_mismatch(out, [&](std::size_t i) { return gather_value<T>(static_cast<int>(i / count), i % count); }) ==
        -1);
}

}  // namespace

TEST_CASE_TEMPLATE("all_gather: every size, placement and launch", T, COMM_TEST_ALL_TYPES) {
  auto c = make_comm();
  for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1003}})
    for (bool in_place : {true, false})
      for (bool use_async : {false, true}) run_all_gather<T>(c, count, in_place, use_async);
}

TEST_CASE("all_gather: the rank of each process, from a span of non-const elements") {
  auto c = make_comm();
  std::int32_t mine = c.rank();
  std::vector<std::int32_t> all(static_cast<std::size_t>(c.size()), -1);
  c.all_gather(std::span<std::int32_t>(&mine, 1), all);
  for (int r = 0; r < c.size(); ++r) CHECK(all[static_cast<std::size_t>(r)] == r);
}

TEST_CASE("all_gather: more than a million elements") {
  auto c = make_comm();
  const std::size_t count = (std::size_t{1} << 20) + 5;
  std::vector<std::uint8_t> in(count), out(count * static_cast<std::size_t>(c.size()));
  for (std::size_t i = 0; i < count; ++i) in[i] = gather_value<std::uint8_t>(c.rank(), i);
  c.all_gather(in, out);
  CHECK(first_mismatch(out, [&](std::size_t i) {
          return gather_value<std::uint8_t>(static_cast<int>(i / count), i % count);
        }) == -1);
}
