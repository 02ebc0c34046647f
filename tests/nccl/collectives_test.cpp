// The five collectives and barrier on device memory, for every element type and every reduction
// NCCL runs, at several sizes (0, 1, odd, > 1M elements), in place and out of place, blocking and
// async, with both gather paths; results against a locally computed reference. Needs a GPU (and,
// for more than one rank per GPU, NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1): skipped
// otherwise, with the reason printed.
#include "nccl_test_util.hpp"

#include <algorithm>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

using namespace nccl_test;

namespace {

const std::vector<std::size_t> kSizes{0, 1, 7, (std::size_t{1} << 20) + 3};

template <class T>
void check_reduced(const std::vector<T>& got, ReduceOp op, int n, std::size_t offset = 0) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double want = expected<T>(op, offset + i, n);
    if (!close(got[i], want, op)) {
      if (bad < 5) FAIL_CHECK("element " << offset + i << ": got " << static_cast<double>(got[i]) << ", want " << want);
      ++bad;
    }
  }
  CHECK(bad == 0);
}

template <class T>
void all_reduce_case(Comm& c, ReduceOp op, std::size_t n, bool in_place, bool async) {
  CAPTURE(comm::to_string(comm::dtype_of<T>));
  CAPTURE(comm::to_string(op));
  CAPTURE(n);
  CAPTURE(in_place);
  CAPTURE(async);
  const auto in_host = inputs<T>(c.rank(), n, op);
  DeviceBuffer<T> in(in_host), out(n);
  if (in_place) {
    if (async)
      c.all_reduce(in.span(), op, comm::async).wait();
    else
      c.all_reduce(in.span(), op);
    check_reduced(in.download(), op, c.size());
  } else {
    if (async)
      c.all_reduce(in.cspan(), out.span(), op, comm::async).wait();
    else
      c.all_reduce(in.cspan(), out.span(), op);
    check_reduced(out.download(), op, c.size());
    CHECK(in.download() == in_host);  // the input is left alone
  }
}

template <class T>
void reduce_scatter_case(Comm& c, ReduceOp op, std::size_t per_rank, bool in_place, bool async) {
  CAPTURE(comm::to_string(comm::dtype_of<T>));
  CAPTURE(comm::to_string(op));
  CAPTURE(per_rank);
  CAPTURE(in_place);
  const std::size_t n = per_rank * static_cast<std::size_t>(c.size());
  DeviceBuffer<T> in(inputs<T>(c.rank(), n, op)), out(per_rank);
  const std::size_t offset = per_rank * static_cast<std::size_t>(c.rank());
  std::span<T> dst = in_place ? in.span().subspan(offset, per_rank) : out.span();
  if (async)
    c.reduce_scatter(in.cspan(), dst, op, comm::async).wait();
  else
    c.reduce_scatter(in.cspan(), dst, op);
  auto all = in_place ? in.download() : out.download();
  std::vector<T> mine = in_place ? std::vector<T>(all.begin() + static_cast<std::ptrdiff_t>(offset),
                                                  all.begin() + static_cast<std::ptrdiff_t>(offset + per_rank))
                                 : all;
  check_reduced(mine, op, c.size(), offset);
}

template <class T>
void movement_cases(Comm& c) {
  CAPTURE(comm::to_string(comm::dtype_of<T>));
  const int n = c.size();
  const auto un = static_cast<std::size_t>(n);
  for (std::size_t k : kSizes) {
    CAPTURE(k);
    std::vector<T> mine(k);
    for (std::size_t i = 0; i < k; ++i) mine[i] = tag<T>(c.rank(), i);
    // all_gather, out of place and in place
    for (bool in_place : {false, true}) {
      DeviceBuffer<T> in(mine), out(k * un);
      if (in_place) {
        std::vector<T> seed(k * un, T{});
        std::copy(mine.begin(), mine.end(), seed.begin() + static_cast<std::ptrdiff_t>(k * static_cast<std::size_t>(c.rank())));
        out.upload(seed);
        c.all_gather(std::span<const T>(out.span().subspan(k * static_cast<std::size_t>(c.rank()), k)), out.span());
      } else {
        c.all_gather(in.cspan(), out.span(), comm::async).wait();
      }
      const auto got = out.download();
      bool ok = true;
      for (int r = 0; r < n; ++r)
        for (std::size_t i = 0; i < k; ++i) ok = ok && same(got[static_cast<std::size_t>(r) * k + i], tag<T>(r, i));
      CHECK(ok);
    }
    // broadcast from every root
    for (int root = 0; root < n; ++root) {
      DeviceBuffer<T> d(mine);
      if (root % 2 == 0)
        c.broadcast(d.span(), root);
      else
        c.broadcast(d.span(), root, comm::async).wait();
      const auto got = d.download();
      bool ok = true;
      for (std::size_t i = 0; i < k; ++i) ok = ok && same(got[i], tag<T>(root, i));
      CHECK(ok);
    }
    // gather to every root (out empty elsewhere), and in place on the root
    for (int root = 0; root < n; ++root) {
      for (bool in_place : {false, true}) {
        DeviceBuffer<T> in(mine), out(c.rank() == root ? k * un : 0);
        std::span<const T> src = in.cspan();
        if (in_place && c.rank() == root) {
          std::vector<T> seed(k * un, T{});
          std::copy(mine.begin(), mine.end(), seed.begin() + static_cast<std::ptrdiff_t>(k * static_cast<std::size_t>(root)));
          out.upload(seed);
          src = std::span<const T>(out.span().subspan(k * static_cast<std::size_t>(root), k));
        }
        c.gather(src, out.span(), root);
        if (c.rank() == root) {
          const auto got = out.download();
          bool ok = true;
          for (int r = 0; r < n; ++r)
            for (std::size_t i = 0; i < k; ++i) ok = ok && same(got[static_cast<std::size_t>(r) * k + i], tag<T>(r, i));
          CHECK(ok);
        }
      }
    }
  }
}

}  // namespace

TEST_CASE_TEMPLATE("all_reduce: every type, op and size, in place and out of place, blocking and async", T,
                   NCCL_TEST_ALL_TYPES) {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  for (ReduceOp op : ops_for<T>())
    for (std::size_t n : kSizes)
      for (bool in_place : {false, true})
        for (bool async : {false, true}) {
          if (n > 1000 && in_place != async) continue;  // the large size: two of the four forms
          all_reduce_case<T>(c, op, n, in_place, async);
        }
}

TEST_CASE_TEMPLATE("all_reduce: compile-time ops map to NCCL's", T, float, comm::half, std::uint32_t) {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  DeviceBuffer<T> d(inputs<T>(c.rank(), 9, ReduceOp::sum));
  c.all_reduce(d.span(), std::plus<>{});
  check_reduced(d.download(), ReduceOp::sum, c.size());
  d.upload(inputs<T>(c.rank(), 9, ReduceOp::max));
  c.all_reduce(d.span(), comm::op::max);
  check_reduced(d.download(), ReduceOp::max, c.size());
  d.upload(inputs<T>(c.rank(), 9, ReduceOp::prod));
  c.all_reduce(d.span(), std::multiplies<>{}, comm::async).wait();
  check_reduced(d.download(), ReduceOp::prod, c.size());
}

TEST_CASE_TEMPLATE("reduce_scatter: every type, op and size, in place and out of place", T, NCCL_TEST_ALL_TYPES) {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  for (ReduceOp op : ops_for<T>())
    for (std::size_t per_rank : {std::size_t{0}, std::size_t{1}, std::size_t{5}, std::size_t{1} << 18})
      for (bool in_place : {false, true}) reduce_scatter_case<T>(c, op, per_rank, in_place, per_rank % 2 == 1);
}

TEST_CASE_TEMPLATE("all_gather, broadcast, gather: every type and size", T, NCCL_TEST_ALL_TYPES) {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  movement_cases<T>(c);
}

TEST_CASE("gather: the p2p path (ncclSend/ncclRecv in a group) gives the same result") {
  NCCL_REQUIRE_GPU();
  comm::backends::Nccl::Options o;
  o.gather = comm::nccl::GatherAlgorithm::p2p;
  auto c = make_comm(o);
  CHECK(c.backend().gather_algorithm() == comm::nccl::GatherAlgorithm::p2p);
  movement_cases<std::int32_t>(c);
  movement_cases<comm::bfloat16>(c);
}

TEST_CASE("gather: the native path where NCCL >= 2.28, chosen by default") {
  NCCL_REQUIRE_GPU();
  const bool native = COMM_NCCL_HAS_GATHER && comm::nccl::runtime_version() >= 22800;
  if (!native) {
    report_skip("NCCL " + comm::nccl::version_string(comm::nccl::runtime_version()) + " has no ncclGather");
    return;
  }
  auto c = make_comm();
  CHECK(c.backend().gather_algorithm() == comm::nccl::GatherAlgorithm::native);
  movement_cases<double>(c);
}

TEST_CASE("barrier: blocking and async") {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  for (int i = 0; i < 10; ++i) {
    c.barrier();
    auto w = c.barrier(comm::async);
    w.wait();
    CHECK(w.is_completed());
  }
}

TEST_CASE("many operations in flight complete, in order, with the right results") {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  constexpr int kOps = 64;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> bufs;
  std::vector<comm::Work> works;
  for (int i = 0; i < kOps; ++i) {
    bufs.push_back(std::make_unique<DeviceBuffer<float>>(std::vector<float>(1000 + static_cast<std::size_t>(i), float(i))));
    works.push_back(c.all_reduce(bufs.back()->span(), comm::async));
  }
  // A blocking op issued after them runs after them.
  DeviceBuffer<float> last(std::vector<float>(3, 1.0f));
  c.all_reduce(last.span());
  for (auto& w : works) w.wait();
  for (int i = 0; i < kOps; ++i) {
    const auto got = bufs[static_cast<std::size_t>(i)]->download();
    CHECK(std::all_of(got.begin(), got.end(), [&](float x) { return x == float(i) * float(c.size()); }));
  }
  CHECK(last.download() == std::vector<float>(3, float(c.size())));
}

TEST_CASE("premul_sum: each rank's input times its own scalar, summed") {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  const int n = c.size();
  DeviceBuffer<float> d(std::vector<float>(17, 2.0f));
  c.backend().all_reduce_premul_sum<float>(d.span(), d.span(), float(c.rank() + 1));
  const float want = 2.0f * float(n * (n + 1) / 2);
  CHECK(d.download() == std::vector<float>(17, want));

  DeviceBuffer<double> in(std::vector<double>(4 * static_cast<std::size_t>(n), 1.0)), out(4);
  c.backend().reduce_scatter_premul_sum<double>(in.cspan(), out.span(), 0.5, comm::async).wait();
  CHECK(out.download() == std::vector<double>(4, 0.5 * n));
  CHECK_THROWS_AS(c.backend().all_reduce_premul_sum<float>(d.span(), d.span().subspan(1), 1.0f), comm::InvalidArgument);
}

TEST_CASE("fp8: moved everywhere, reduced where NCCL >= 2.24 and compute capability >= 9.0") {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  using F = comm::float8_e4m3;
  const auto un = static_cast<std::size_t>(c.size());
  std::vector<F> mine(8, F(float(c.rank() + 1)));
  DeviceBuffer<F> in(mine), out(8 * un);
  c.all_gather(in.cspan(), out.span());
  const auto got = out.download();
  for (std::size_t r = 0; r < un; ++r) CHECK(static_cast<float>(got[r * 8]) == float(r + 1));
  int major = 0;
  NCCL_TEST_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, c.backend().device()));
  // A runtime ReduceOp, so that this compiles where fp8 reductions are not compiled in.
  if (COMM_NCCL_FP8_REDUCTIONS && comm::nccl::runtime_version() >= 22400 && major >= 9) {
    c.all_reduce(in.span(), ReduceOp::sum);
    CHECK(static_cast<float>(in.download()[0]) == float(un * (un + 1) / 2));
  } else {
    CHECK_THROWS_AS(c.all_reduce(in.span(), ReduceOp::sum), comm::InvalidArgument);
  }
}
