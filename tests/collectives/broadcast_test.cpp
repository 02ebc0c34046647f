// broadcast: every element type x sizes x every root x sync/async, >1M elements.
#include "backend_test_util.hpp"

#include <span>

using namespace suite;

namespace {

template <class T>
void run_broadcast(Comm& c, std::size_t count, int root, bool use_async) {
  INFO("broadcast ", type_name(comm::dtype_of<T>), " count=", count, " root=", root,
       use_async ? " async" : " blocking");
  std::vector<T> data(count);
  for (std::size_t i = 0; i < count; ++i) data[i] = input_value<T>(c.rank(), i, ReduceOp::max);
  if (use_async)
    c.broadcast(data, root, comm::async).wait();
  else
    c.broadcast(std::span<T>(data), root);
  CHECK(first_mismatch(data, [&](std::size_t i) { return input_value<T>(root, i, ReduceOp::max); }) == -1);
}

}  // namespace

TEST_CASE_TEMPLATE("broadcast: every size, root and launch", T, COMM_TEST_ALL_TYPES) {
  auto c = make_comm();
  for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1003}})
    for (int root = 0; root < c.size(); ++root)
      for (bool use_async : {false, true}) run_broadcast<T>(c, count, root, use_async);
}

TEST_CASE("broadcast: the world size from rank 0") {
  auto c = make_comm();
  std::int32_t v = c.rank() == 0 ? c.size() : -1;
  c.broadcast(std::span<std::int32_t>(&v, 1), 0);
  CHECK(v == c.size());
}

TEST_CASE("broadcast: more than a million elements from the last rank") {
  auto c = make_comm();
  const std::size_t count = (std::size_t{1} << 20) + 1;
  const int root = c.size() - 1;
  std::vector<double> data(count, -1.0);
  if (c.rank() == root)
    for (std::size_t i = 0; i < count; ++i) data[i] = static_cast<double>(i);
  c.broadcast(data, root);
  CHECK(first_mismatch(data, [](std::size_t i) { return static_cast<double>(i); }) == -1);
}
