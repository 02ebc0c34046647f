// The rest of the surface on the NCCL backend (concepts.hpp, capability 11): reduce, scatter,
// all_to_all, all_to_all_v, send, recv, batch_isend_irecv, and comm::op::premul_sum on all_reduce,
// reduce_scatter and reduce, on device memory, against references computed here on the host.
// Needs a GPU (and, for more than one rank per GPU, NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1):
// skipped otherwise, with the reason printed. Cases that need two ranks say so at one.
#include "nccl_test_util.hpp"

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

using namespace nccl_test;

namespace {

const std::vector<std::size_t> kSizes{0, 1, 7, (std::size_t{1} << 16) + 3};

void use_device(const Comm& c) { NCCL_TEST_CUDA(cudaSetDevice(c.backend().device())); }

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// The value rank `src` sends to rank `dst` at element i: exact in every element type tested.
template <class T>
T p2p_value(int src, int dst, std::size_t i) {
  const long long v = static_cast<long long>(src) * 10 + static_cast<long long>(dst) * 3 + static_cast<long long>(i % 3);
  if constexpr (is_int<T>)
    return static_cast<T>(v);
  else
    return T(static_cast<float>(v));
}

template <class T>
bool all_match(const std::vector<T>& got, std::size_t from, std::size_t n, int src, int dst) {
  for (std::size_t i = 0; i < n; ++i)
    if (!same(got[from + i], p2p_value<T>(src, dst, i))) return false;
  return true;
}

template <class T>
void check_reduced(const std::vector<T>& got, ReduceOp op, int n) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double want = expected<T>(op, i, n);
    if (!close(got[i], want, op)) {
      if (bad < 5) FAIL_CHECK("element " << i << ": got " << static_cast<double>(got[i]) << ", want " << want);
      ++bad;
    }
  }
  CHECK(bad == 0);
}

template <class T>
void reduce_cases(Comm& c) {
  CAPTURE(comm::to_string(comm::dtype_of<T>));
  const int n = c.size();
  for (ReduceOp op : ops_for<T>())
    for (std::size_t k : kSizes)
      for (int root = 0; root < n; ++root)
        for (bool in_place : {false, true}) {
          CAPTURE(comm::to_string(op));
          CAPTURE(k);
          CAPTURE(root);
          CAPTURE(in_place);
          if (k > 1000 && root != n - 1) continue;  // the large size: one root
          const bool async = (root + static_cast<int>(in_place)) % 2 == 1;
          const auto mine = inputs<T>(c.rank(), k, op);
          DeviceBuffer<T> in(mine), out(c.rank() == root ? k : 0);  // out empty off the root
          if (in_place) {
            if (async)
              c.reduce(in.span(), root, op, comm::async).wait();
            else
              c.reduce(in.span(), root, op);
            if (c.rank() == root)
              check_reduced(in.download(), op, n);
            else
              CHECK(in.download() == mine);  // left as it was
          } else {
            if (async)
              c.reduce(in.cspan(), out.span(), root, op, comm::async).wait();
            else
              c.reduce(in.cspan(), out.span(), root, op);
            if (c.rank() == root) check_reduced(out.download(), op, n);
            CHECK(in.download() == mine);
          }
        }
}

template <class T>
void scatter_cases(Comm& c) {
  CAPTURE(comm::to_string(comm::dtype_of<T>));
  const int n = c.size();
  const auto un = static_cast<std::size_t>(n);
  for (std::size_t k : kSizes)
    for (int root = 0; root < n; ++root)
      for (bool in_place : {false, true}) {
        CAPTURE(k);
        CAPTURE(root);
        CAPTURE(in_place);
        if (k > 1000 && root != n - 1) continue;  // the large size: one root
        std::vector<T> all(c.rank() == root ? k * un : 0);
        if (c.rank() == root)
          for (int r = 0; r < n; ++r)
            for (std::size_t i = 0; i < k; ++i) all[static_cast<std::size_t>(r) * k + i] = p2p_value<T>(root, r, i);
        DeviceBuffer<T> in(all), out(k);
        std::span<T> dst = out.span();
        if (in_place && c.rank() == root) dst = in.span().subspan(static_cast<std::size_t>(root) * k, k);
        if (root % 2 == 0)
          c.scatter(in.cspan(), dst, root);
        else
          c.scatter(in.cspan(), dst, root, comm::async).wait();
        const auto got = in_place && c.rank() == root ? in.download() : out.download();
        const std::size_t from = in_place && c.rank() == root ? static_cast<std::size_t>(root) * k : 0;
        CHECK(all_match(got, from, k, root, c.rank()));
      }
}

template <class T>
void all_to_all_cases(Comm& c) {
  CAPTURE(comm::to_string(comm::dtype_of<T>));
  const int n = c.size();
  const auto un = static_cast<std::size_t>(n);
  for (std::size_t k : kSizes) {
    CAPTURE(k);
    std::vector<T> mine(k * un);
    for (int p = 0; p < n; ++p)
      for (std::size_t i = 0; i < k; ++i) mine[static_cast<std::size_t>(p) * k + i] = p2p_value<T>(c.rank(), p, i);
    for (bool async : {false, true}) {
      DeviceBuffer<T> in(mine), out(k * un);
      if (async)
        c.all_to_all(in.cspan(), out.span(), comm::async).wait();
      else
        c.all_to_all(in.cspan(), out.span());
      const auto got = out.download();
      for (int q = 0; q < n; ++q) CHECK(all_match(got, static_cast<std::size_t>(q) * k, k, q, c.rank()));
      CHECK(in.download() == mine);
    }
  }
}

/// all_to_all_v: rank s sends count(s, d) elements to rank d (some zero, the own block included).
std::size_t v_count(int src, int dst, std::size_t scale) {
  return static_cast<std::size_t>((src * 2 + dst * 3) % 4) * scale;
}

template <class T>
void all_to_all_v_cases(Comm& c) {
  CAPTURE(comm::to_string(comm::dtype_of<T>));
  const int n = c.size();
  const int me = c.rank();
  for (std::size_t scale : {std::size_t{0}, std::size_t{1}, std::size_t{5}, std::size_t{40000}}) {
    CAPTURE(scale);
    std::vector<std::size_t> in_counts, out_counts;
    for (int p = 0; p < n; ++p) {
      in_counts.push_back(v_count(me, p, scale));
      out_counts.push_back(v_count(p, me, scale));
    }
    std::vector<T> mine;
    for (int p = 0; p < n; ++p)
      for (std::size_t i = 0; i < in_counts[static_cast<std::size_t>(p)]; ++i) mine.push_back(p2p_value<T>(me, p, i));
    std::size_t total_out = 0;
    for (auto x : out_counts) total_out += x;
    for (bool async : {false, true}) {
      DeviceBuffer<T> in(mine), out(total_out);
      if (async)
        c.all_to_all_v(in.cspan(), in_counts, out.span(), out_counts, comm::async).wait();
      else
        c.all_to_all_v(in.cspan(), in_counts, out.span(), out_counts);
      const auto got = out.download();
      std::size_t at = 0;
      for (int q = 0; q < n; ++q) {
        const std::size_t cnt = out_counts[static_cast<std::size_t>(q)];
        CHECK(all_match(got, at, cnt, q, me));
        at += cnt;
      }
    }
  }
}

/// The premul_sum reference: sum over ranks of T(factor_r) * x_r, in double.
template <class T>
double premul_expected(std::size_t i, int n, double (*factor)(int)) {
  double acc = 0;
  for (int r = 0; r < n; ++r) {
    const T f = T(static_cast<float>(factor(r)));
    acc += static_cast<double>(f) * static_cast<double>(input_value<T>(r, i, ReduceOp::sum));
  }
  return acc;
}

double rank_factor(int r) { return r % 2 == 0 ? 0.5 : 1.5 + 0.25 * r; }

template <class T>
bool premul_close(T got, double want) {
  const double tol = sizeof(T) <= 2 ? 2e-2 : 1e-6;
  return std::abs(static_cast<double>(got) - want) <= tol * std::max(1.0, std::abs(want));
}

template <class T>
void check_premul(const std::vector<T>& got, int n, std::size_t offset = 0) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double want = premul_expected<T>(offset + i, n, &rank_factor);
    if (!premul_close(got[i], want)) {
      if (bad < 5) FAIL_CHECK("element " << offset + i << ": got " << static_cast<double>(got[i]) << ", want " << want);
      ++bad;
    }
  }
  CHECK(bad == 0);
}

template <class T>
void premul_cases(Comm& c) {
  CAPTURE(comm::to_string(comm::dtype_of<T>));
  const int n = c.size();
  const auto un = static_cast<std::size_t>(n);
  const auto pm = comm::op::premul_sum(rank_factor(c.rank()));  // a factor of its own on each rank
  for (std::size_t k : kSizes) {
    CAPTURE(k);
    const auto mine = inputs<T>(c.rank(), k, ReduceOp::sum);
    {  // all_reduce, in place and out of place
      DeviceBuffer<T> d(mine), in(mine), out(k);
      c.all_reduce(d.span(), pm);
      check_premul(d.download(), n);
      c.all_reduce(in.cspan(), out.span(), pm, comm::async).wait();
      check_premul(out.download(), n);
      CHECK(in.download() == mine);
    }
    {  // reduce_scatter: k per rank
      const auto big = inputs<T>(c.rank(), k * un, ReduceOp::sum);
      DeviceBuffer<T> in(big), out(k);
      c.reduce_scatter(in.cspan(), out.span(), pm);
      check_premul(out.download(), n, k * static_cast<std::size_t>(c.rank()));
    }
    for (int root = 0; root < n; ++root) {  // reduce, out of place (empty off the root) and in place
      CAPTURE(root);
      DeviceBuffer<T> in(mine), out(c.rank() == root ? k : 0), d(mine);
      c.reduce(in.cspan(), out.span(), root, pm);
      c.reduce(d.span(), root, pm, comm::async).wait();
      if (c.rank() == root) {
        check_premul(out.download(), n);
        check_premul(d.download(), n);
      } else {
        CHECK(d.download() == mine);
      }
    }
  }
}

}  // namespace

TEST_CASE("the NCCL backend has the whole surface") {
  static_assert(comm::supports_full_surface<comm::backends::Nccl>);
  CHECK(true);
}

TEST_CASE_TEMPLATE("reduce: every type, op, size and root, in place and out of place, blocking and async", T,
                   NCCL_TEST_ALL_TYPES) {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  use_device(c);
  reduce_cases<T>(c);
}

TEST_CASE_TEMPLATE("scatter: every type, size and root, the root's block in place too", T, NCCL_TEST_ALL_TYPES) {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  use_device(c);
  scatter_cases<T>(c);
}

TEST_CASE_TEMPLATE("all_to_all and all_to_all_v: every type, equal and uneven blocks (zeros included)", T,
                   NCCL_TEST_ALL_TYPES) {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  use_device(c);
  all_to_all_cases<T>(c);
  all_to_all_v_cases<T>(c);
}

TEST_CASE_TEMPLATE("premul_sum: all_reduce, reduce_scatter, reduce, each rank with its own factor", T, float, double,
                   comm::half, comm::bfloat16) {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  use_device(c);
  premul_cases<T>(c);
}

TEST_CASE("premul_sum on fp8: reduced where NCCL >= 2.24 and compute capability >= 9.0, else InvalidArgument") {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  use_device(c);
  using F = comm::float8_e4m3;
  const auto un = static_cast<std::size_t>(c.size());
  DeviceBuffer<F> d(std::vector<F>(8, F(2.0f)));
  int major = 0;
  NCCL_TEST_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, c.backend().device()));
  if (COMM_NCCL_FP8_REDUCTIONS && comm::nccl::runtime_version() >= 22400 && major >= 9) {
    try {
      c.all_reduce(d.span(), comm::op::premul_sum(0.5));
      CHECK(static_cast<float>(d.download()[0]) == float(un));
    } catch (const comm::InvalidArgument& e) {
      // NCCL's one-rank path has no fp8 kernel for it: comm refuses it before NCCL sees it.
      INFO(e.what());
      CHECK(c.size() == 1);
      CHECK(std::string(e.what()).find("fp8 on a communicator of one rank") != std::string::npos);
      c.all_reduce(d.span());  // the communicator is still usable
    }
  } else {
    CHECK_THROWS_AS(c.all_reduce(d.span(), comm::op::premul_sum(0.5)), comm::InvalidArgument);
  }
}

TEST_CASE("send and recv: pairs exchange both ways, blocking and async, every size") {
  NCCL_REQUIRE_GPU();
  COMM_REQUIRE_RANKS(2);
  auto c = make_comm();
  use_device(c);
  const int me = c.rank();
  const int peer = me ^ 1;
  if (peer >= c.size()) {  // the odd rank out: nothing to exchange, but the comm stays in step
    c.barrier();
    return;
  }
  for (std::size_t k : kSizes) {
    CAPTURE(k);
    std::vector<double> mine(k);
    for (std::size_t i = 0; i < k; ++i) mine[i] = p2p_value<double>(me, peer, i);
    for (bool async : {false, true}) {
      DeviceBuffer<double> out(mine), in(k);
      // The lower rank sends first: the streams on both sides then match.
      if (me < peer) {
        if (async) {
          auto w1 = c.send(out.cspan(), peer, comm::async);
          auto w2 = c.recv(in.span(), peer, 0, comm::async);
          w1.wait();
          w2.wait();
        } else {
          c.send(out.cspan(), peer);
          c.recv(in.span(), peer);
        }
      } else {
        if (async) {
          auto w1 = c.recv(in.span(), peer, comm::async);
          auto w2 = c.send(out.cspan(), peer, 0, comm::async);
          w1.wait();
          w2.wait();
        } else {
          c.recv(in.span(), peer);
          c.send(out.cspan(), peer);
        }
      }
      CHECK(all_match(in.download(), 0, k, peer, me));
    }
  }
  c.barrier();
}

TEST_CASE("send and recv: a nonzero tag is InvalidArgument naming the op; NCCL has no tags") {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  use_device(c);
  DeviceBuffer<float> d(std::vector<float>(4, 1.0f));
  // Straight to the backend, so that this runs at one rank too (the facade checks the peer first).
  try {
    c.backend().send<float>(d.cspan(), 0, 3, comm::blocking);
    FAIL("no InvalidArgument");
  } catch (const comm::InvalidArgument& e) {
    CHECK(contains(e.what(), "send"));
    CHECK(contains(e.what(), "NCCL has no message tags"));
  }
  CHECK_THROWS_AS(c.backend().recv<float>(d.span(), 0, 1, comm::async), comm::InvalidArgument);
  const std::vector<comm::P2POp<float>> ops{comm::isend(d.span(), 0, 7)};
  try {
    (void)c.backend().batch_isend_irecv<float>(ops);
    FAIL("no InvalidArgument");
  } catch (const comm::InvalidArgument& e) {
    CHECK(contains(e.what(), "batch_isend_irecv"));
    CHECK(contains(e.what(), "entry 0"));
  }
  // The communicator is still usable.
  c.all_reduce(d.span());
  CHECK(d.download() == std::vector<float>(4, float(c.size())));
  if (c.size() >= 2) {
    const int peer = (c.rank() + 1) % c.size();
    CHECK_THROWS_AS(c.send(d.span(), peer, 5), comm::InvalidArgument);
    CHECK_THROWS_AS(c.recv(d.span(), peer, 5, comm::async), comm::InvalidArgument);
  }
}

TEST_CASE("batch_isend_irecv: a ring in both directions, one Work per entry, one flight-record entry") {
  NCCL_REQUIRE_GPU();
  COMM_REQUIRE_RANKS(2);
  auto c = make_comm();
  use_device(c);
  const int n = c.size(), me = c.rank();
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  for (std::size_t k : kSizes) {
    CAPTURE(k);
    std::vector<std::int32_t> to_next(k), to_prev(k);
    for (std::size_t i = 0; i < k; ++i) {
      to_next[i] = p2p_value<std::int32_t>(me, next, i);
      to_prev[i] = p2p_value<std::int32_t>(me, prev, i);
    }
    DeviceBuffer<std::int32_t> sn(to_next), sp(to_prev), from_prev(k), from_next(k);
    std::vector<comm::P2POp<std::int32_t>> ops{comm::isend(sn.span(), next), comm::irecv(from_prev.span(), prev),
                                               comm::isend(sp.span(), prev), comm::irecv(from_next.span(), next)};
    auto works = c.batch_isend_irecv(ops);
    REQUIRE(works.size() == ops.size());
    for (auto& w : works) w.wait();
    CHECK(all_match(from_prev.download(), 0, k, prev, me));
    CHECK(all_match(from_next.download(), 0, k, next, me));
    for (auto& w : works) CHECK(w.is_completed());
  }
  c.backend().synchronize();
  const auto f = c.flight_record();
  REQUIRE(f.ops.size() == kSizes.size());
  for (const auto& op : f.ops) {
    CHECK(op.op == "batch_isend_irecv");
    CHECK(op.count == 4);
    CHECK(op.state == comm::OpState::completed);
  }
  CHECK(c.batch_isend_irecv(std::vector<comm::P2POp<float>>{}).empty());
}

TEST_CASE("flight record and desync check: the new operations are recorded; point-to-point skips the check") {
  NCCL_REQUIRE_GPU();
  comm::backends::Nccl::Options o;
  o.desync_check = true;
  auto c = make_comm(o);
  use_device(c);
  const int n = c.size();
  const auto un = static_cast<std::size_t>(n);
  DeviceBuffer<float> a(std::vector<float>(4 * un, 1.0f)), b(4 * un), r(4);
  c.reduce(a.cspan().subspan(0, 4), r.span(), 0, comm::op::premul_sum(2.0));
  c.scatter(a.cspan(), r.span(), 0);
  c.all_to_all(a.cspan(), b.span());
  // Only ranks 0 and 1 run point-to-point operations: the collectives after them must still
  // agree (p2p takes no collective sequence number and skips the check).
  if (n >= 2 && c.rank() < 2) {
    const int peer = 1 - c.rank();
    if (c.rank() == 0)
      c.send(r.cspan(), peer);
    else
      c.recv(r.span(), peer);
  }
  c.all_reduce(r.span());
  c.backend().synchronize();
  const auto f = c.flight_record();
  const bool p2p = n >= 2 && c.rank() < 2;
  REQUIRE(f.ops.size() == (p2p ? 5u : 4u));
  CHECK(f.ops[0].op == "reduce");
  CHECK(f.ops[0].root == 0);
  CHECK(f.ops[0].custom_reduce);  // premul_sum
  CHECK(f.ops[1].op == "scatter");
  CHECK(f.ops[2].op == "all_to_all");
  if (p2p) {
    CHECK(f.ops[3].op == (c.rank() == 0 ? "send" : "recv"));
    CHECK(f.ops[3].root == 1 - c.rank());
  }
  CHECK(f.ops.back().op == "all_reduce");
  for (const auto& op : f.ops) CHECK(op.state == comm::OpState::completed);
}
