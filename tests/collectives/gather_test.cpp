// gather: every element type x sizes x every root x sync/async, empty outputs off the
// root, the root's input inside its output, >1M elements.
#include "backend_test_util.hpp"

#include <span>

using namespace suite;

namespace {

template <class T>
T rooted_gather_value(int rank, std::size_t i) {
  return input_value<T>(rank, i, ReduceOp::sum);
}

template <class T>
void run_gather(Comm& c, std::size_t count, int root, bool use_async) {
  const int n = c.size();
  INFO("gather ", type_name(comm::dtype_of<T>), " count=", count, " root=", root, use_async ? " async" : " blocking");
  std::vector<T> in(count);
  for (std::size_t i = 0; i < count; ++i) in[i] = rooted_gather_value<T>(c.rank(), i);
  // Off the root the output is not used: pass an empty one.
  std::vector<T> out(c.rank() == root ? count * static_cast<std::size_t>(n) : 0);
  if (use_async)
    c.gather(in, out, root, comm::async).wait();
  else
    c.gather(in, out, root);
  if (c.rank() == root)
    CHECK(first_mismatch(out, [&](std::size_t i) { return rooted_gather_value<T>(static_cast<int>(i / count), i % count); }) ==
          -1);
  else
    CHECK(out.empty());
}

}  // namespace

TEST_CASE_TEMPLATE("gather: every size, root and launch", T, COMM_TEST_ALL_TYPES) {
  auto c = make_comm();
  for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1003}})
    for (int root = 0; root < c.size(); ++root)
      for (bool use_async : {false, true}) run_gather<T>(c, count, root, use_async);
}

TEST_CASE("gather: non-root outputs of any size are ignored; the root's input may sit in its output") {
  auto c = make_comm();
  const int n = c.size();
  const int root = n / 2;
  std::vector<float> out(static_cast<std::size_t>(n) * 3, -1.0f);
  const std::size_t slot = static_cast<std::size_t>(c.rank()) * 3;
  for (std::size_t i = 0; i < 3; ++i) out[slot + i] = static_cast<float>(c.rank() * 10 + static_cast<int>(i));
  c.gather(std::span<const float>(out.data() + slot, 3), out, root);
  if (c.rank() == root)
    for (int r = 0; r < n; ++r)
      for (int i = 0; i < 3; ++i) CHECK(out[static_cast<std::size_t>(r * 3 + i)] == static_cast<float>(r * 10 + i));
}

TEST_CASE("gather: more than a million elements") {
  auto c = make_comm();
  const std::size_t count = (std::size_t{1} << 20) + 7;
  std::vector<std::int32_t> in(count, c.rank());
  std::vector<std::int32_t> out(c.rank() == 0 ? count * static_cast<std::size_t>(c.size()) : 0);
  c.gather(in, out, 0);
  if (c.rank() == 0)
    CHECK(first_mismatch(out, [&](std::size_t i) { return static_cast<std::int32_t>(i / count); }) == -1);
}
