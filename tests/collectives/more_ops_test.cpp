// The rest of the surface: reduce, scatter, all_to_all, all_to_all_v, send/recv,
// batch_isend_irecv and premul_sum — every element type x sizes x roots x in/out of place x
// sync/async against references computed here, bad input, mismatched point-to-point messages, and
// point-to-point traffic between collectives (with the desync check on), and buffers a few bytes
// apart modulo 4096.
#include "backend_test_util.hpp"

#include <support/env_guard.hpp>

#include <chrono>
#include <cstdint>
#include <numeric>
#include <span>

using namespace suite;

namespace {

const std::size_t kCounts[] = {0, 1, 7, 1003};

/// A value that says who sent it and where: block `(from -> to)`, element i.
template <class T>
T tagged(int from, int to, std::size_t i) {
  // Small integers: exact in every type, fp8 included (|v| <= 8).
  const long long v = (static_cast<long long>(from) * 5 + to * 3 + static_cast<long long>(i % 7)) % 17 - 8;
  if constexpr (std::is_unsigned_v<T>) return static_cast<T>(v < 0 ? -v : v);
  if constexpr (is_int<T>) return static_cast<T>(v);
  return T(static_cast<float>(v));
}

template <class T>
void run_reduce(Comm& c, ReduceOp op, std::size_t count, int root, bool in_place, bool use_async) {
  const int n = c.size();
  INFO("reduce ", type_name(comm::dtype_of<T>), " ", comm::to_string(op), " count=", count, " root=", root,
       in_place ? " in-place" : " out-of-place", use_async ? " async" : " blocking");
  std::vector<T> in(count);
  for (std::size_t i = 0; i < count; ++i) in[i] = input_value<T>(c.rank(), i, op);
  const auto before = in;
  if (in_place) {
    if (use_async)
      c.reduce(in, root, op, comm::async).wait();
    else
      c.reduce(in, root, op);
    if (c.rank() == root)
      CHECK(first_mismatch(in, [&](std::size_t i) { return reference<T>(op, n, i); }) == -1);
    else
      CHECK(first_mismatch(in, [&](std::size_t i) { return before[i]; }) == -1);  // left as it was
  } else {
    // Off the root the output is not used: pass an empty one.
    std::vector<T> out(c.rank() == root ? count : 0);
    if (use_async)
      c.reduce(std::span<const T>(in), std::span<T>(out), root, op, comm::async).wait();
    else
      c.reduce(std::span<const T>(in), std::span<T>(out), root, op);
    if (c.rank() == root) CHECK(first_mismatch(out, [&](std::size_t i) { return reference<T>(op, n, i); }) == -1);
    CHECK(first_mismatch(in, [&](std::size_t i) { return before[i]; }) == -1);
  }
}

template <class T>
void run_scatter(Comm& c, std::size_t count, int root, bool in_place, bool use_async) {
  const auto n = static_cast<std::size_t>(c.size());
  INFO("scatter ", type_name(comm::dtype_of<T>), " count=", count, " root=", root, in_place ? " in-place" : "",
       use_async ? " async" : " blocking");
  const bool is_root = c.rank() == root;
  std::vector<T> in(is_root ? n * count : 0);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = tagged<T>(root, static_cast<int>(i / count), i % count);
  std::vector<T> own(count);
  std::span<T> out(own);
  if (in_place && is_root) out = std::span<T>(in).subspan(static_cast<std::size_t>(root) * count, count);
  if (use_async)
    c.scatter(std::span<const T>(in), out, root, comm::async).wait();
  else
    c.scatter(std::span<const T>(in), out, root);
  const std::vector<T> got(out.begin(), out.end());
  CHECK(first_mismatch(got, [&](std::size_t i) { return tagged<T>(root, c.rank(), i); }) == -1);
}

template <class T>
void run_all_to_all(Comm& c, std::size_t count, bool use_async) {
  const auto n = static_cast<std::size_t>(c.size());
  INFO("all_to_all ", type_name(comm::dtype_of<T>), " count=", count, use_async ? " async" : " blocking");
  std::vector<T> in(n * count), out(n * count);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = tagged<T>(c.rank(), static_cast<int>(i / count), i % count);
  if (use_async)
    c.all_to_all(in, out, comm::async).wait();
  else
    c.all_to_all(in, out);
  CHECK(first_mismatch(out, [&](std::size_t i) { return tagged<T>(static_cast<int>(i / count), c.rank(), i % count); }) ==
        -1);
}

/// all_to_all_v with counts (from -> to) = ((from + 2 to + k) % 4) * scale: zeros included.
std::size_t v_count(int from, int to, std::size_t scale, int k) {
  return static_cast<std::size_t>((from + 2 * to + k) % 4) * scale;
}

template <class T>
void run_all_to_all_v(Comm& c, std::size_t scale, int k, bool use_async) {
  const int n = c.size();
  const int me = c.rank();
  INFO("all_to_all_v ", type_name(comm::dtype_of<T>), " scale=", scale, " k=", k, use_async ? " async" : " blocking");
  std::vector<std::size_t> sc(static_cast<std::size_t>(n)), rc(static_cast<std::size_t>(n));
  for (int p = 0; p < n; ++p) {
    sc[static_cast<std::size_t>(p)] = v_count(me, p, scale, k);
    rc[static_cast<std::size_t>(p)] = v_count(p, me, scale, k);
  }
  std::vector<T> in(std::accumulate(sc.begin(), sc.end(), std::size_t{0}));
  std::vector<T> out(std::accumulate(rc.begin(), rc.end(), std::size_t{0}));
  std::vector<T> want(out.size());
  for (std::size_t p = 0, off = 0; p < sc.size(); off += sc[p], ++p)
    for (std::size_t i = 0; i < sc[p]; ++i) in[off + i] = tagged<T>(me, static_cast<int>(p), i);
  for (std::size_t p = 0, off = 0; p < rc.size(); off += rc[p], ++p)
    for (std::size_t i = 0; i < rc[p]; ++i) want[off + i] = tagged<T>(static_cast<int>(p), me, i);
  if (use_async)
    c.all_to_all_v(in, sc, out, rc, comm::async).wait();
  else
    c.all_to_all_v(in, sc, out, rc);
  CHECK(first_mismatch(out, [&](std::size_t i) { return want[i]; }) == -1);
}

/// Every rank sends to the next and receives from the previous (a ring), as one batch, then
/// with separate async send/recv where the order makes it safe (even ranks send first).
template <class T>
void run_p2p(Comm& c, std::size_t count) {
  const int n = c.size();
  if (n < 2) return;
  const int me = c.rank();
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  INFO("p2p ", type_name(comm::dtype_of<T>), " count=", count);
  std::vector<T> a(count), b(count, T{});
  for (std::size_t i = 0; i < count; ++i) a[i] = tagged<T>(me, next, i);
  auto works = c.batch_isend_irecv({comm::isend(a, next, 5), comm::irecv(b, prev, 5)});
  REQUIRE(works.size() == 2);
  for (auto& w : works) w.wait();
  CHECK(first_mismatch(b, [&](std::size_t i) { return tagged<T>(prev, me, i); }) == -1);
  if (n % 2 == 0) {
    std::fill(b.begin(), b.end(), T{});
    if (me % 2 == 0) {
      c.send(a, next, 1);
      c.recv(b, prev, 1);
    } else {
      auto r = c.recv(b, prev, 1, comm::async);
      auto s = c.send(a, next, 1, comm::async);
      r.wait();
      s.wait();
    }
    CHECK(first_mismatch(b, [&](std::size_t i) { return tagged<T>(prev, me, i); }) == -1);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("reduce: every op, size, root, placement and launch", T, COMM_TEST_ALL_TYPES) {
  auto c = make_comm();
  const int n = c.size();
  for (ReduceOp op : ops_for<T>())
    for (std::size_t count : kCounts)
      for (int root : {0, n - 1})
        for (bool in_place : {true, false})
          for (bool use_async : {false, true}) run_reduce<T>(c, op, count, root, in_place, use_async);
}

TEST_CASE_TEMPLATE("scatter: every size, root, placement and launch", T, COMM_TEST_ALL_TYPES) {
  auto c = make_comm();
  for (std::size_t count : kCounts)
    for (int root = 0; root < c.size(); ++root)
      for (bool in_place : {false, true})
        for (bool use_async : {false, true}) run_scatter<T>(c, count, root, in_place, use_async);
}

TEST_CASE_TEMPLATE("all_to_all and all_to_all_v: every size and launch", T, COMM_TEST_ALL_TYPES) {
  auto c = make_comm();
  for (std::size_t count : kCounts)
    for (bool use_async : {false, true}) run_all_to_all<T>(c, count, use_async);
  for (std::size_t scale : {std::size_t{1}, std::size_t{301}})
    for (int k : {0, 1})
      for (bool use_async : {false, true}) run_all_to_all_v<T>(c, scale, k, use_async);
}

TEST_CASE("all_to_all and scatter: inputs around the size of a step's small payload") {
  // Shm, through the segment (single copy off): up to 64 KiB of input (a body, kLaneBytes) a
  // step's payload holds a slot for every rank; above it the writer's own slot is left out
  // (shm/engine.hpp, Pieces), so at 2 ranks up to 128 KiB still travels through a body. Every
  // rank at every root reads its own piece. The other backends ignore the variable.
  comm::test::ScopedEnv no_cma("COMM_SHM_CMA", "0");
  auto c = make_comm();
  const auto n = static_cast<std::size_t>(c.size());
  for (std::size_t total : {std::size_t{65536}, std::size_t{65600}, std::size_t{98304}, std::size_t{130048}}) {
    const std::size_t count = total / (sizeof(float) * n);
    for (bool use_async : {false, true}) run_all_to_all<float>(c, count, use_async);
    for (int root = 0; root < c.size(); ++root) run_scatter<float>(c, count, root, false, false);
  }
}

TEST_CASE_TEMPLATE("send, recv and batch_isend_irecv: every size", T, COMM_TEST_ALL_TYPES) {
  auto c = make_comm();
  for (std::size_t count : kCounts) run_p2p<T>(c, count);
}

TEST_CASE("send and recv: payloads around the sizes that travel with the header, whole and as a last chunk") {
  // Shm: up to 16 bytes in the line that says the chunk is ready (shm/engine.hpp, kP2PInline);
  // Mpi: up to 2 KiB in the header's message (mpi/engine.hpp, kPackMax). 4 MiB is a whole number
  // of Shm's chunks at 2 and 4 ranks, so the last chunk is the remainder.
  auto c = make_comm();
  for (std::size_t count : {std::size_t{15}, std::size_t{16}, std::size_t{17}, std::size_t{64}, std::size_t{2047},
                            std::size_t{2048}, std::size_t{2049}})
    run_p2p<std::uint8_t>(c, count);
  for (std::size_t rest : {std::size_t{5}, std::size_t{16}, std::size_t{17}})
    run_p2p<std::uint8_t>(c, (std::size_t{4} << 20) + rest);
}

TEST_CASE("large messages: more than a million elements, several chunks everywhere") {
  auto c = make_comm();
  const std::size_t count = (std::size_t{1} << 20) + 7;
  run_p2p<float>(c, count);
  run_all_to_all<std::int32_t>(c, count / static_cast<std::size_t>(c.size()), false);
  run_scatter<double>(c, count / 8, c.size() - 1, false, false);
  run_reduce<float>(c, ReduceOp::sum, count, 0, false, false);
  // In place, the last rank as root: Gloo's ring reduce gathers into the root's own input.
  run_reduce<float>(c, ReduceOp::max, count, c.size() - 1, true, false);
}

TEST_CASE("batch_isend_irecv: every pair both ways, several messages per pair in order") {
  auto c = make_comm();
  const int n = c.size();
  const int me = c.rank();
  const std::size_t m = 40000;  // several Shm chunks: both directions must progress together
  std::vector<std::vector<double>> send_a(static_cast<std::size_t>(n)), send_b(static_cast<std::size_t>(n)),
      recv_a(static_cast<std::size_t>(n)), recv_b(static_cast<std::size_t>(n));
  std::vector<comm::P2POp<double>> ops;
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    const auto up = static_cast<std::size_t>(p);
    send_a[up].assign(m, me * 100.0 + p);
    send_b[up].assign(3, me * 1000.0 + p);
    recv_a[up].assign(m, -1.0);
    recv_b[up].assign(3, -1.0);
    // Receives first on purpose: a batch must not run its entries one after the other.
    ops.push_back(comm::irecv(recv_a[up], p, 7));
    ops.push_back(comm::irecv(recv_b[up], p, 8));
    ops.push_back(comm::isend(send_a[up], p, 7));
    ops.push_back(comm::isend(send_b[up], p, 8));
  }
  auto works = c.batch_isend_irecv(ops);
  CHECK(works.size() == ops.size());
  for (auto& w : works) w.wait();
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    const auto up = static_cast<std::size_t>(p);
    CHECK(recv_a[up] == std::vector<double>(m, p * 100.0 + me));
    CHECK(recv_b[up] == std::vector<double>(3, p * 1000.0 + me));
  }
  CHECK(c.batch_isend_irecv(std::vector<comm::P2POp<double>>{}).empty());
}

TEST_CASE("batch_isend_irecv: a receive whose sender waits on another peer does not hold up the others") {
  // Rank 0 posts both receives at once; rank 2's large send can only end once rank 0 has taken it,
  // and only then does rank 2 let rank 1 send. A batch that handled its receives one after the
  // other (rank 1's first) would leave rank 2's send waiting forever: every rank at its deadline.
  const auto& w = comm::test::world();
  if (w.size < 3) {
    MESSAGE("needs 3 ranks");
    return;
  }
  Options o;
  o.timeout = std::chrono::seconds(20);
  auto c = make_comm(o);
  const std::size_t big = std::size_t{1} << 18;  // 1 MiB of floats: above every eager limit
  std::vector<float> large(big), small(1, -1.0f);
  switch (c.rank()) {
    case 0: {
      std::fill(large.begin(), large.end(), -1.0f);
      auto works = c.batch_isend_irecv({comm::irecv(std::span<float>(small), 1, 3), comm::irecv(std::span<float>(large), 2, 4)});
      for (auto& x : works) x.wait();
      CHECK(small[0] == 1.0f);
      CHECK(std::count(large.begin(), large.end(), 2.0f) == static_cast<std::ptrdiff_t>(big));
      break;
    }
    case 1:
      c.recv(std::span<float>(small), 2, 5);
      CHECK(small[0] == 2.0f);
      small[0] = 1.0f;
      c.send(std::span<const float>(small), 0, 3);
      break;
    case 2:
      std::fill(large.begin(), large.end(), 2.0f);
      c.send(std::span<const float>(large), 0, 4);
      small[0] = 2.0f;
      c.send(std::span<const float>(small), 1, 5);
      break;
    default: break;
  }
  comm::test::barrier();
}

TEST_CASE("point-to-point between collectives leaves the collectives' order intact (desync check on)") {
  Options o;
  o.desync_check = true;
  auto c = make_comm(o);
  const int n = c.size();
  std::vector<int> v{c.rank() + 1};
  for (int round = 0; round < 3; ++round) {
    if (n >= 2 && c.rank() == 0) c.send(std::vector<int>{round}, 1, round);
    if (n >= 2 && c.rank() == 1) {
      std::vector<int> got{-1};
      c.recv(got, 0, round);
      CHECK(got[0] == round);
    }
    c.all_reduce(v);
  }
  // Each all_reduce sums v over the ranks: s, n*s, n*n*s.
  const int s = n * (n + 1) / 2;
  CHECK(v[0] == s * n * n);
  if (n >= 2) {
    const auto rec = c.flight_record();
    bool saw = false;
    for (const auto& r : rec.ops) saw = saw || r.op == (c.rank() == 0 ? "send" : c.rank() == 1 ? "recv" : "all_reduce");
    CHECK(saw);
  }
}

TEST_CASE("premul_sum: all_reduce, reduce_scatter and reduce scale every input") {
  auto c = make_comm();
  const int n = c.size();
  const auto un = static_cast<std::size_t>(n);
  auto check = [&](auto tag) {
    using T = decltype(tag);
    INFO("premul_sum ", type_name(comm::dtype_of<T>));
    const std::size_t count = 37;
    auto in_of = [&](int r, std::size_t i) { return T(static_cast<float>((r + static_cast<int>(i)) % 5)); };
    auto want = [&](std::size_t i) {
      float s = 0;  // factor 0.5 and small integers: exact in every floating type here
      for (int r = 0; r < n; ++r) s += 0.5f * static_cast<float>(in_of(r, i));
      return T(s);
    };
    std::vector<T> v(count);
    for (std::size_t i = 0; i < count; ++i) v[i] = in_of(c.rank(), i);
    const auto in = v;
    c.all_reduce(v, comm::op::premul_sum(0.5));
    CHECK(first_mismatch(v, want) == -1);
    std::vector<T> out(count);
    c.all_reduce(std::span<const T>(in), std::span<T>(out), comm::op::premul_sum(0.5), comm::async).wait();
    CHECK(first_mismatch(out, want) == -1);
    std::vector<T> rs_in(count * un), rs_out(count);
    for (std::size_t i = 0; i < rs_in.size(); ++i) rs_in[i] = in_of(c.rank(), i);
    c.reduce_scatter(rs_in, rs_out, comm::op::premul_sum(0.5));
    CHECK(first_mismatch(rs_out, [&](std::size_t i) { return want(static_cast<std::size_t>(c.rank()) * count + i); }) ==
          -1);
    std::vector<T> r = in;
    c.reduce(r, 0, comm::op::premul_sum(0.5));
    if (c.rank() == 0) CHECK(first_mismatch(r, want) == -1);
  };
  check(float{});
  check(double{});
  check(comm::half{});
  check(comm::bfloat16{});
}

TEST_CASE("bad arguments are comm::InvalidArgument before anything is sent") {
  auto c = make_comm();
  const int n = c.size();
  const auto un = static_cast<std::size_t>(n);
  std::vector<float> a(4 * un), b(4 * un);
  CHECK_THROWS_AS(c.reduce(a, n), comm::InvalidArgument);
  CHECK_THROWS_AS(c.reduce(a, -1), comm::InvalidArgument);
  if (c.rank() == 0) CHECK_THROWS_AS(c.reduce(std::span<const float>(a), std::span<float>(b).first(3), 0), comm::InvalidArgument);
  CHECK_THROWS_AS(c.scatter(a, std::span<float>(b).first(2), n), comm::InvalidArgument);
  if (c.rank() == 0) CHECK_THROWS_AS(c.scatter(std::span<const float>(a).first(3), std::span<float>(b).first(2), 0), comm::InvalidArgument);
  CHECK_THROWS_AS(c.all_to_all(a, std::span<float>(b).first(4 * un - 1)), comm::InvalidArgument);
  if (n > 1) CHECK_THROWS_AS(c.all_to_all(std::span<const float>(a).first(un + 1), std::span<float>(b).first(un + 1)), comm::InvalidArgument);
  CHECK_THROWS_AS(c.all_to_all(a, a), comm::InvalidArgument);
  std::vector<std::size_t> counts(un, 4), short_counts(un + 1, 1), bad(un, 4);
  CHECK_THROWS_AS(c.all_to_all_v(a, short_counts, b, counts), comm::InvalidArgument);
  bad[0] = 5;  // sums to 4n + 1
  CHECK_THROWS_AS(c.all_to_all_v(a, bad, b, counts), comm::InvalidArgument);
  CHECK_THROWS_AS(c.send(a, n), comm::InvalidArgument);
  CHECK_THROWS_AS(c.send(a, c.rank()), comm::InvalidArgument);
  CHECK_THROWS_AS(c.recv(a, -1), comm::InvalidArgument);
  if (n > 1) CHECK_THROWS_AS(c.send(a, (c.rank() + 1) % n, -3), comm::InvalidArgument);
  CHECK_THROWS_AS((void)c.batch_isend_irecv({comm::isend(a, c.rank())}), comm::InvalidArgument);
  // The communicator is still usable: nothing was sent.
  std::vector<int> v{1};
  c.all_reduce(v);
  CHECK(v[0] == n);
}

TEST_CASE("mismatched point-to-point messages are comm::DesyncError on the receiver") {
  const auto& w = comm::test::world();
  if (w.size < 2) return;
  struct Case {
    const char* what;
    int send_tag, recv_tag;
    std::size_t send_count, recv_count;
    const char* sent;    // what the error must say rank 0 sent
    const char* posted;  // and what this rank posted
  };
  for (const Case k : {Case{"tag", 1, 2, 4, 4, "with tag 1", "with tag 2"},
                       Case{"count", 3, 3, 4, 5, "of 4 float ", "of 5 float "}}) {
    INFO("mismatched ", k.what);
    auto c = make_comm();
    std::vector<float> buf(8, 1.0f);
    if (c.rank() == 0) {
      // The send may complete (buffered) or fail once rank 1 gave up; it must not hang.
      try {
        c.send(std::span<const float>(buf).first(k.send_count), 1, k.send_tag);
      } catch (const comm::Error& e) {
        MESSAGE("rank 0's send ended with: ", std::string(e.what()));
      }
    } else if (c.rank() == 1) {
      try {
        c.recv(std::span<float>(buf).first(k.recv_count), 0, k.recv_tag);
        FAIL("the mismatched receive succeeded");
      } catch (const comm::DesyncError& e) {
        const std::string text = e.what();
        CHECK(text.find("rank 0") != std::string::npos);
        CHECK(text.find(k.sent) != std::string::npos);
        CHECK(text.find(k.posted) != std::string::npos);
      }
    }
    // Other ranks did nothing; every rank leaves the communicator.
  }
}

TEST_CASE("a receive from a rank that never sends ends at the deadline, naming that rank") {
  const auto& w = comm::test::world();
  if (w.size < 2) return;
  Options o;
  o.timeout = std::chrono::milliseconds(1500);
  auto c = make_comm(o);
  if (c.rank() == 1) {
    std::vector<float> buf(4);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      c.recv(buf, 0, 9);
      FAIL("the receive returned");
    } catch (const comm::Timeout& e) {
      const std::string text = e.what();
      INFO(text);
      CHECK(text.find("rank 0") != std::string::npos);
      CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
    }
  }
  // Rank 0 keeps its communicator (leaving it would be a RemoteError, not the deadline) until rank
  // 1 is done, through the harness's own barrier.
  comm::test::barrier();
}

#if defined(COMM_TEST_BACKEND_HIERARCHICAL)
// Hierarchical stops its members' transports from another thread through the engine-neutral
// detail/engine/transport.hpp (a failure elsewhere, a revoke, a shrink): both member policies must
// be recognised there, or a member's wait would last to its deadline.
static_assert(comm::detail::TransportAbort<comm::backends::Gloo>::stops);
static_assert(comm::detail::TransportAbort<comm::backends::Shm>::stops);
#endif

TEST_CASE("long long and unsigned long long are the 64-bit element types on every operation") {
  static_assert(comm::dtype_of<long long> == comm::Dtype::int64);
  static_assert(comm::dtype_of<unsigned long long> == comm::Dtype::uint64);
  auto c = make_comm();
  const int n = c.size();
  const auto un = static_cast<std::size_t>(n);
  const long long big = 1LL << 40;  // beyond 32 bits: a narrowed type would lose it
  std::vector<long long> v(5);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = big * (c.rank() + 1) + static_cast<long long>(i);
  c.all_reduce(v);
  for (std::size_t i = 0; i < v.size(); ++i)
    CHECK(v[i] == big * n * (n + 1) / 2 + static_cast<long long>(i) * n);
  c.all_reduce(v, comm::op::max, comm::async).wait();

  std::vector<unsigned long long> u(3, 1ULL << c.rank());
  c.all_reduce(u, comm::ReduceOp::bor);
  CHECK(u[0] == (1ULL << n) - 1);
  c.all_reduce(u, [](unsigned long long a, unsigned long long b) { return a & b; });
  CHECK(u[2] == (1ULL << n) - 1);

  std::vector<long long> b(2, c.rank() == 0 ? -big : 0);
  c.broadcast(b, 0);
  CHECK(b[1] == -big);

  std::vector<long long> in(un * 2), out(un * 2);
  for (std::size_t p = 0; p < un; ++p) in[2 * p] = in[2 * p + 1] = big * c.rank() + static_cast<long long>(p);
  c.all_to_all(std::span<const long long>(in), out);
  for (std::size_t q = 0; q < un; ++q) CHECK(out[2 * q] == big * static_cast<long long>(q) + c.rank());

  std::vector<long long> g(un);
  c.all_gather(std::span<const long long>(&in[0], 1), g);
  for (std::size_t q = 0; q < un; ++q) CHECK(g[q] == big * static_cast<long long>(q));

  if (n >= 2 && c.rank() < 2) {
    std::vector<long long> s(4, big + c.rank()), r(4);
    const int peer = 1 - c.rank();
    auto works = c.batch_isend_irecv({comm::isend(s, peer), comm::irecv(r, peer)});
    for (auto& w : works) w.wait();
    CHECK(r[3] == big + peer);
  }
  c.barrier();
}

// Buffers a few bytes apart modulo 4096, on every backend. glibc's memcpy (`rep movsb` from 2 KiB
// to ~1 MiB) and the kernel's copy behind cross-memory attach are many times slower when the
// destination lies 1-15 bytes past the source modulo 4096 (detail/base/copy.hpp, shm/cma.hpp), so
// every copy between a user's buffer and another goes in pieces or through scratch there: a piece
// put at the wrong place, or left out, shows here. Rank r's k-th buffer starts 4 (r + k mod 4) bytes
// past a page boundary: a pair of ranks meets a destination 4-12 bytes past its source one way and
// 4084-4092 the other (Shm's single copy), and one rank's input and output lie 4-12 bytes apart
// (the own block every backend copies; 5120 elements keep the blocks of all_gather and
// reduce_scatter at those distances too). 70001 elements (4 bytes each) pass one piece of Shm's
// scratch (256 KiB), 5000 and 5120 do not.
TEST_CASE("buffers a few bytes apart modulo 4096: every operation, on every path that copies them") {
  const auto& w = comm::test::world();
  const int n = w.size;
  const int me = w.rank;
  const auto un = static_cast<std::size_t>(n);
  // Shm (and Hierarchical's members) by single copy from 4 KiB; the other backends ignore these.
  comm::test::ScopedEnv e1("COMM_SHM_CMA_MIN", "4096");
  comm::test::ScopedEnv e2("COMM_SHM_CMA_ROOTED_MIN", "4096");
  comm::test::ScopedEnv e3("COMM_SHM_CMA_REDUCE_MIN", "4096");
  auto c = make_comm();
  // Storage for `count` elements starting 4 * (rank + k mod 4) bytes past a page boundary, where
  // k counts the buffers placed so far (the same on every rank).
  std::vector<std::vector<std::int32_t>> keep;
  const auto place = [&](std::size_t count) {
    keep.emplace_back(count + 2048, -1);
    const auto a = reinterpret_cast<std::uintptr_t>(keep.back().data());
    const std::size_t pad = ((4096 - (a & 4095u)) & 4095u) / 4 + static_cast<std::size_t>(me) + keep.size() % 4;
    return std::span<std::int32_t>(keep.back().data() + pad, count);
  };
  const auto code = [](std::size_t q, std::size_t i) { return static_cast<std::int32_t>(q * 1000003 + i % 999983); };
  const auto first_wrong = [](std::span<const std::int32_t> v, auto&& want) {
    for (std::size_t i = 0; i < v.size(); ++i)
      if (v[i] != want(i)) return static_cast<long long>(i);
    return -1LL;
  };
  for (const std::size_t count : {std::size_t{5000}, std::size_t{5120}, std::size_t{70001}}) {
    keep.clear();
    INFO("count ", count, ", rank ", me);
    for (const int root : {0, n - 1}) {
      INFO("root ", root);
      auto b = place(count);
      for (std::size_t i = 0; i < count; ++i) b[i] = me == root ? code(7, i) : -1;
      c.broadcast(b, root);
      CHECK(first_wrong(b, [&](std::size_t i) { return code(7, i); }) == -1);
      auto all = place(count * un);
      auto got = place(count);
      for (std::size_t j = 0; j < all.size(); ++j) all[j] = code(j / count, j % count);
      c.scatter(std::span<const std::int32_t>(all), got, root);
      CHECK(first_wrong(got, [&](std::size_t i) { return code(static_cast<std::size_t>(me), i); }) == -1);
      auto mine = place(count);
      for (std::size_t i = 0; i < count; ++i) mine[i] = code(static_cast<std::size_t>(me), i);
      auto gathered = place(count * un);
      c.gather(std::span<const std::int32_t>(mine), gathered, root);
      if (me == root) CHECK(first_wrong(gathered, [&](std::size_t j) { return code(j / count, j % count); }) == -1);
      auto red = place(count);
      c.reduce(std::span<const std::int32_t>(mine), red, root, ReduceOp::max);
      if (me == root) CHECK(first_wrong(red, [&](std::size_t i) { return code(un - 1, i); }) == -1);
    }
    auto mine = place(count);
    for (std::size_t i = 0; i < count; ++i) mine[i] = code(static_cast<std::size_t>(me), i);
    auto sum = place(count);
    c.all_reduce(std::span<const std::int32_t>(mine), sum, ReduceOp::max);
    CHECK(first_wrong(sum, [&](std::size_t i) { return code(un - 1, i); }) == -1);
    auto g = place(count * un);
    c.all_gather(std::span<const std::int32_t>(mine), g);
    CHECK(first_wrong(g, [&](std::size_t j) { return code(j / count, j % count); }) == -1);
    // all_to_all: the block from rank q to rank p says q * n + p
    auto send = place(count * un);
    auto recv = place(count * un);
    for (std::size_t j = 0; j < send.size(); ++j) send[j] = code(static_cast<std::size_t>(me) * un + j / count, j % count);
    c.all_to_all(std::span<const std::int32_t>(send), recv);
    CHECK(first_wrong(recv, [&](std::size_t j) { return code(j / count * un + static_cast<std::size_t>(me), j % count); }) == -1);
    // reduce_scatter: the max over q of rank q's input, element j = code(q, j)
    auto rs_in = place(count * un);
    for (std::size_t j = 0; j < rs_in.size(); ++j) rs_in[j] = code(static_cast<std::size_t>(me), j);
    auto rs = place(count);
    c.reduce_scatter(std::span<const std::int32_t>(rs_in), rs, ReduceOp::max);
    CHECK(first_wrong(rs, [&](std::size_t i) { return code(un - 1, static_cast<std::size_t>(me) * count + i); }) == -1);
  }
}


#if defined(COMM_TEST_BACKEND_SHM)
#include <sched.h>

#include <comm/detail/base/copy.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

namespace {
bool shm_has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }
}  // namespace

// Shm's one-step rooted operations (broadcast, scatter, gather, reduce within one chunk) do not
// wait for every rank: a rank that read nobody's fingerprint (a root of broadcast, a non-root of
// gather) throws DesyncError at the start of its next collective (backends/shm.hpp). Rank 1 thinks
// it is the root, the others that rank 0 is.
TEST_CASE("shm: a one-step rooted mismatch is a DesyncError on every rank, at the latest at its next operation") {
  const auto& w = comm::test::world();
  if (w.size < 2) return;
  const int me = w.rank;
  const int n = w.size;
  for (const std::string op : {"broadcast", "gather", "reduce", "scatter"}) {
    INFO(op);
    auto c = make_comm();
    const int root = me == 1 ? 1 : 0;
    std::vector<float> a(4, 1.f), out(4 * static_cast<std::size_t>(n), 0.f);
    std::string found;
    bool during = false;
    try {
      if (op == "broadcast") c.broadcast(a, root);
      if (op == "gather") c.gather(std::span<const float>(a), std::span<float>(out), root);
      if (op == "reduce") c.reduce(std::span<const float>(a), std::span<float>(out).first(4), root);
      if (op == "scatter") c.scatter(std::span<const float>(out), std::span<float>(a), root);
    } catch (const comm::DesyncError& e) {
      found = e.what();
      during = true;
    }
    if (!during) {
      // The program's next operation reports it before moving anything.
      std::vector<float> v(4, 1.f);
      try {
        c.all_reduce(v);
        FAIL("the operation after a mismatched ", op, " did not report it");
      } catch (const comm::DesyncError& e) {
        found = e.what();
        CHECK(shm_has(found, "found at the start of a later operation"));
      }
      CHECK(v[0] == 1.f);
    }
    INFO(found);
    CHECK(shm_has(found, "root 1"));
    CHECK(shm_has(found, "root 0"));
  }
}

// A root of small rooted operations runs ahead of its readers (up to kRing - kLag steps of a few
// bytes, kBodyRing - 1 of up to 16 KiB: segment.hpp): every value must still arrive intact and in
// order, whichever rank is root, with steps through the halves (64 KiB) in between, which use
// other reuse rules.
TEST_CASE("shm: back-to-back small rooted operations with the root running ahead deliver every value") {
  const auto& w = comm::test::world();
  const int n = w.size;
  const int me = w.rank;
  const auto un = static_cast<std::size_t>(n);
  auto c = make_comm();
  long long bad = 0;
  for (int i = 0; i < 300; ++i) {
    const int root = (i / 12) % n;  // runs of one root (48 steps), longer than it may get ahead
    std::vector<long long> b(i % 3 == 0 ? 1 : 500, me == root ? i : -1);
    c.broadcast(b, root);
    bad += std::count_if(b.begin(), b.end(), [&](long long v) { return v != i; });
    std::vector<long long> mine(2, 1000LL * i + me), all(2 * un, -1);
    c.gather(std::span<const long long>(mine), std::span<long long>(all), root);
    if (me == root)
      for (std::size_t p = 0; p < un; ++p) bad += all[2 * p] != 1000LL * i + static_cast<long long>(p);
    std::vector<long long> pieces(2 * un), got(2, -1);
    for (std::size_t p = 0; p < un; ++p) pieces[2 * p] = pieces[2 * p + 1] = 7LL * i + static_cast<long long>(p);
    c.scatter(std::span<const long long>(pieces), std::span<long long>(got), root);
    bad += got[1] != 7LL * i + me;
    std::vector<long long> r(3, i + me), sum(3, -1);
    c.reduce(std::span<const long long>(r), std::span<long long>(sum), root);
    if (me == root) bad += sum[2] != static_cast<long long>(n) * i + static_cast<long long>(n) * (n - 1) / 2;
    if (i % 50 == 49) {  // 64 KiB: through the halves
      std::vector<float> big(16384, me == root ? static_cast<float>(i) : 0.f);
      c.broadcast(big, root);
      bad += std::count_if(big.begin(), big.end(), [&](float v) { return v != static_cast<float>(i); });
    }
  }
  CHECK(bad == 0);
  std::vector<long long> total(1, bad);
  c.all_reduce(total);
  CHECK(total[0] == 0);
}

// Back-to-back small broadcasts: the root compares the readers' fingerprints kLag steps late, so
// a mismatch reaches it within kLag + 1 broadcasts, as a DesyncError before it publishes more.
TEST_CASE("shm: a mismatch among back-to-back small broadcasts reaches the root within 33 of them") {
  const auto& w = comm::test::world();
  if (w.size < 2) return;
  const int me = w.rank;
  auto c = make_comm();
  std::vector<float> a(me == 1 ? 5 : 4, 1.f);  // rank 1 broadcasts 5 elements, the others 4
  int thrown_at = -1;
  for (int i = 0; i < 40 && thrown_at < 0; ++i) {
    try {
      c.broadcast(a, 0);
    } catch (const comm::DesyncError& e) {
      thrown_at = i;
      if (me == 0) CHECK(shm_has(e.what(), "found at the start of a later operation"));
    }
  }
  INFO("rank ", me, " threw at broadcast #", thrown_at);
  if (me == 0) {
    CHECK(thrown_at >= 1);
    CHECK(thrown_at <= 33);
  } else if (me == 1) {
    CHECK(thrown_at == 0);  // it reads the root's header at once
  } else {
    CHECK(thrown_at >= 0);  // a reader that matched the root finds rank 1 later
  }
}

// Back-to-back small broadcasts in which every rank thinks it is the root: nobody reads anybody's
// header, so no step is compared in the operation itself, and a rank's header must not say that it
// compared them (at two ranks a rank drops the unchecked steps its peer says it compared): every
// rank throws within kLag + 1 broadcasts.
TEST_CASE("shm: back-to-back small broadcasts that every rank roots are a DesyncError on every rank within 33") {
  const auto& w = comm::test::world();
  if (w.size < 2) return;
  const int me = w.rank;
  auto c = make_comm();
  std::vector<float> a(2, static_cast<float>(me));
  int thrown_at = -1;
  for (int i = 0; i < 40 && thrown_at < 0; ++i) {
    try {
      c.broadcast(a, me);
    } catch (const comm::DesyncError& e) {
      thrown_at = i;
      CHECK(shm_has(e.what(), "found at the start of a later operation"));
    }
  }
  INFO("rank ", me, " threw at broadcast #", thrown_at);
  CHECK(thrown_at >= 1);
  CHECK(thrown_at <= 33);
  CHECK(a[0] == static_cast<float>(me));
}

// Above two ranks the deferred comparison compares a sum over each rank's last kRing steps (64)
// and looks at single steps only where the sums differ (steps.hpp, settle_by_window): a long run
// of small rooted operations with every root in turn, all of them matched, must deliver every
// value without a false DesyncError; then a rank that alone takes itself for the root of a run
// of broadcasts, whose header nobody reads, must be found by the ranks that matched the real root
// through that comparison alone, within kLag + 1 broadcasts.
TEST_CASE("shm: small rooted operations compared late: no false report, and a root nobody reads is found") {
  const auto& w = comm::test::world();
  if (w.size < 2) return;
  const int me = w.rank;
  const int n = w.size;
  const auto un = static_cast<std::size_t>(n);
  // Four rounds, each on a fresh communicator: the rank that finds the mismatch first aborts the
  // communicator, and a rank then waiting on it (a reader that ran ahead of it after the long
  // first part) must still report the DesyncError it holds in its own unchecked steps, not a
  // RemoteError naming that rank (one round in ~7 did, at 4 ranks on a loaded host).
  for (int round = 0; round < 4; ++round) {
    auto c = make_comm();
    long long bad = 0;
    for (int i = 0; i < 150; ++i) {
      const int root = i % n;
      std::vector<long long> b(2, me == root ? i : -1);
      c.broadcast(b, root);
      bad += (b[0] != i) + (b[1] != i);
      std::vector<long long> mine(1, 100LL * i + me), all(un, -1);
      c.gather(std::span<const long long>(mine), std::span<long long>(all), root);
      if (me == root)
        for (std::size_t p = 0; p < un; ++p) bad += all[p] != 100LL * i + static_cast<long long>(p);
    }
    CHECK(bad == 0);
    int thrown_at = -1;
    std::string what;
    bool desync = false;
    for (int i = 0; i < 40 && thrown_at < 0; ++i) {
      std::vector<float> a(2, 1.f);
      try {
        c.broadcast(a, me == n - 1 ? n - 1 : 0);
      } catch (const comm::DesyncError& e) {
        thrown_at = i;
        what = e.what();
        desync = true;
      } catch (const comm::Error& e) {  // caught, so every rank goes on to the next round with the others
        thrown_at = i;
        what = e.what();
      }
    }
    INFO("round ", round, ": rank ", me, " threw at broadcast #", thrown_at, ": ", what);
    CHECK(desync);
    CHECK(thrown_at <= 33);
    CHECK(shm_has(what, "root 0"));
    CHECK(shm_has(what, "root " + std::to_string(n - 1)));
  }
}

// Large messages by cross-memory attach (process_vm_readv), from 4 KiB here (all_reduce, reduce,
// broadcast, all_gather, all_to_all); and a rank that turns it off (COMM_SHM_CMA=0), asks a
// larger threshold or a smaller reduce slice (the root then reduces alone) brings every rank to
// the same path, or the results below would be wrong or the ranks would hang (the last setting:
// where ranks share cores, rank 0 alone asks single copy for all_gather and broadcast from 4 KiB,
// which the others, by default, take only through the segment there). A reduce's slices
// depend on its root (the root's is the larger where every rank has a core), so it runs to the
// last rank and to rank 0.
TEST_CASE("shm: single-copy large messages, and every rank takes the path the least capable one allows") {
  const auto& w = comm::test::world();
  const int n = w.size;
  const int me = w.rank;
  struct Setting {
    const char* cma;
    const char* min;         // nullptr: by the host's cores
    const char* slice_max;   // reduce: above it the root reduces alone
    const char* rooted_min;  // broadcast, scatter, gather (nullptr: the default, 16 KiB or 64 KiB)
    const char* reduce_min;  // reduce (nullptr: the default, 64 KiB or 1 MiB)
  };
  const char* big = me == n - 1 ? "1048576" : "4096";
  for (const Setting s : {Setting{"1", "4096", "8388608", "4096", "4096"}, Setting{me == 0 ? "0" : "1", "4096", "8388608", "4096", "4096"},
                          Setting{"1", big, "8388608", big, big},
                          Setting{"1", me == 0 ? "4096" : nullptr, me == 0 ? "4096" : "8388608", me == 0 ? "4096" : nullptr,
                                  nullptr}}) {
    INFO("COMM_SHM_CMA=", s.cma, " COMM_SHM_CMA_MIN=", s.min ? s.min : "(unset)", " COMM_SHM_CMA_SLICE_MAX=", s.slice_max,
         " COMM_SHM_CMA_ROOTED_MIN=", s.rooted_min ? s.rooted_min : "(unset)",
         " COMM_SHM_CMA_REDUCE_MIN=", s.reduce_min ? s.reduce_min : "(unset)");
    comm::test::ScopedEnv e1("COMM_SHM_CMA", s.cma);
    comm::test::ScopedEnv e2("COMM_SHM_CMA_MIN", s.min);
    comm::test::ScopedEnv e3("COMM_SHM_CMA_BLOCK", "8192");
    comm::test::ScopedEnv e4("COMM_SHM_CMA_SLICE_MAX", s.slice_max);
    comm::test::ScopedEnv e5("COMM_SHM_CMA_ROOTED_MIN", s.rooted_min);
    comm::test::ScopedEnv e6("COMM_SHM_CMA_REDUCE_MIN", s.reduce_min);
    auto c = make_comm();
    // 50000 floats (200 KB): single copy by the host default only where every rank has a core.
    for (std::size_t count : {std::size_t{1000}, std::size_t{5000}, std::size_t{50000}, std::size_t{300001}}) {
      INFO("count ", count);
      std::vector<float> v(count);
      for (std::size_t i = 0; i < count; ++i) v[i] = static_cast<float>((i % 13) + static_cast<std::size_t>(me));
      auto in = v;
      c.all_reduce(v);  // in place
      std::vector<float> o(count);
      c.all_reduce(std::span<const float>(in), std::span<float>(o), ReduceOp::max);
      long long bad = -1;
      for (std::size_t i = 0; i < count && bad < 0; ++i) {
        const float base = static_cast<float>(i % 13);
        const float sum = base * static_cast<float>(n) + static_cast<float>(n * (n - 1) / 2);
        if (v[i] != sum || o[i] != base + static_cast<float>(n - 1)) bad = static_cast<long long>(i);
      }
      CHECK(bad == -1);
      // reduce to the last rank and to rank 0 (single copy: every rank reduces a slice and the
      // root gathers them, or with a small slice maximum the root reads and reduces every input)
      for (const int root : {n - 1, 0}) {
        std::vector<float> red(count, -1.f);
        c.reduce(std::span<const float>(in), std::span<float>(red), root, ReduceOp::max);
        if (me == root) {
          bad = -1;
          for (std::size_t i = 0; i < count && bad < 0; ++i)
            if (red[i] != static_cast<float>(i % 13) + static_cast<float>(n - 1)) bad = static_cast<long long>(i);
          INFO("reduce to rank ", root, ", first wrong at ", bad);
          CHECK(bad == -1);
        }
      }
      std::vector<double> b(count, me == n - 1 ? 2.5 : 0.0);
      c.broadcast(b, n - 1);
      CHECK(std::all_of(b.begin(), b.end(), [](double x) { return x == 2.5; }));
      // Bytes whose share per reader (a broadcast's readers take n - 1 parts each, every one
      // starting at its own; from 64-128 KiB n parts, one of them written by the root) is a whole
      // number of cache lines plus a remainder: the last bytes must arrive too. Element i says i,
      // so a part read or written to the wrong place shows.
      for (std::size_t bytes : {std::size_t{8193}, std::size_t{12289}, count + 1}) {
        std::vector<std::uint8_t> u(bytes);
        for (std::size_t i = 0; i < bytes; ++i) u[i] = me == 0 ? static_cast<std::uint8_t>(i * 7 + 1) : 0;
        c.broadcast(u, 0);
        long long wrong = -1;
        for (std::size_t i = 0; i < bytes && wrong < 0; ++i)
          if (u[i] != static_cast<std::uint8_t>(i * 7 + 1)) wrong = static_cast<long long>(i);
        INFO("uint8 broadcast of ", bytes, " bytes, first wrong at ", wrong);
        CHECK(wrong == -1);
      }
      const auto un = static_cast<std::size_t>(n);
      // scatter from the last rank: element i of rank p's block says (p, i); the root's own block
      // in place on every other count.
      {
        std::vector<std::int32_t> all(me == n - 1 ? count * un : 0);
        for (std::size_t j = 0; j < all.size(); ++j) all[j] = static_cast<std::int32_t>((j / count) * 1000003 + j % count);
        std::vector<std::int32_t> got(count, -1);
        if (me == n - 1 && count % 2 == 0)
          c.scatter(std::span<const std::int32_t>(all), std::span<std::int32_t>(all).subspan(un * count - count), n - 1);
        else
          c.scatter(std::span<const std::int32_t>(all), std::span<std::int32_t>(got), n - 1);
        const std::int32_t* r = me == n - 1 && count % 2 == 0 ? all.data() + (un - 1) * count : got.data();
        bad = -1;
        for (std::size_t i = 0; i < count && bad < 0; ++i)
          if (r[i] != static_cast<std::int32_t>(static_cast<std::size_t>(me) * 1000003 + i)) bad = static_cast<long long>(i);
        CHECK(bad == -1);
      }
      // gather to rank 0, the mirror: element i of rank q's block says (q, i); the root's own
      // input in place on every other count.
      {
        std::vector<std::int32_t> mine(count), all(me == 0 ? count * un : 0, -1);
        for (std::size_t i = 0; i < count; ++i) mine[i] = static_cast<std::int32_t>(static_cast<std::size_t>(me) * 1000003 + i);
        if (me == 0 && count % 2 == 0) {
          std::copy(mine.begin(), mine.end(), all.begin());
          c.gather(std::span<const std::int32_t>(all).first(count), std::span<std::int32_t>(all), 0);
        } else {
          c.gather(std::span<const std::int32_t>(mine), std::span<std::int32_t>(all), 0);
        }
        bad = -1;
        for (std::size_t j = 0; j < all.size() && bad < 0; ++j)
          if (all[j] != static_cast<std::int32_t>((j / count) * 1000003 + j % count)) bad = static_cast<long long>(j);
        CHECK(bad == -1);
      }
      // reduce_scatter: element j of rank q's input is q + j % 7 + (j / count), so rank p's block
      // sums to n * (j % 7 + p) + n(n-1)/2 and a block reduced at the wrong offset is seen;
      // out of place, then in place (the output is this rank's block of the input).
      {
        std::vector<float> rs(count * un);
        for (std::size_t j = 0; j < rs.size(); ++j)
          rs[j] = static_cast<float>(static_cast<std::size_t>(me) + j % 7 + j / count);
        std::vector<float> rso(count, -1.f);
        c.reduce_scatter(std::span<const float>(rs), std::span<float>(rso));
        c.reduce_scatter(std::span<const float>(rs), std::span<float>(rs).subspan(static_cast<std::size_t>(me) * count, count));
        bad = -1;
        for (std::size_t i = 0; i < count && bad < 0; ++i) {
          const std::size_t j = static_cast<std::size_t>(me) * count + i;
          const float want = static_cast<float>(un * (j % 7 + static_cast<std::size_t>(me)) + un * (un - 1) / 2);
          if (rso[i] != want || rs[j] != want) bad = static_cast<long long>(i);
        }
        CHECK(bad == -1);
      }
      std::vector<std::int32_t> g(count * static_cast<std::size_t>(n), -1);
      std::vector<std::int32_t> mine(count, me);
      c.all_gather(std::span<const std::int32_t>(mine), std::span<std::int32_t>(g));
      bad = -1;
      for (std::size_t i = 0; i < g.size() && bad < 0; ++i)
        if (g[i] != static_cast<std::int32_t>(i / count)) bad = static_cast<long long>(i);
      CHECK(bad == -1);
      // all_to_all: element i of the block from rank q to rank p says (q, p, i), so a block read
      // from the wrong peer or at the wrong offset is seen.
      auto code = [&](std::size_t q, std::size_t p, std::size_t i) {
        return static_cast<std::int32_t>((q * 16 + p) * 1000003 + i);
      };
      std::vector<std::int32_t> send(count * un), recv(count * un, -1);
      for (std::size_t p = 0; p < un; ++p)
        for (std::size_t i = 0; i < count; ++i) send[p * count + i] = code(static_cast<std::size_t>(me), p, i);
      c.all_to_all(std::span<const std::int32_t>(send), std::span<std::int32_t>(recv));
      bad = -1;
      for (std::size_t j = 0; j < recv.size() && bad < 0; ++j)
        if (recv[j] != code(j / count, static_cast<std::size_t>(me), j % count)) bad = static_cast<long long>(j);
      CHECK(bad == -1);
    }
  }
}

// A rank asleep on a late peer (past its spin and ~2 ms of yielding, on the futex) is woken by the
// peer's publish, not by the end of its 10 ms slice: with publishes that go without a fence (every
// rank registered for membarrier, so each waiter fences the publishers before it sleeps:
// shm/wait.hpp) and with fenced ones (COMM_SHM_MEMBARRIER=0 on one rank turns the unfenced ones off
// for all). The root stamps its broadcast with the time it enters it; the readers measure from
// there. A wake-up that missed its bell costs 0-10 ms, and the median of 9 such would be ~5 ms.
TEST_CASE("shm: a rank asleep on a late root wakes when the root publishes, whether publishes are fenced or not") {
  const auto& w = comm::test::world();
  if (w.size < 2) return;
  using namespace std::chrono_literals;
  auto now_ns = [] {
    return static_cast<std::int64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                         std::chrono::steady_clock::now().time_since_epoch())
                                         .count());
  };
  for (const char* setting : {"1", w.rank == 0 ? "0" : "1"}) {
    INFO("COMM_SHM_MEMBARRIER=", setting, " on rank ", w.rank);
    comm::test::ScopedEnv fence("COMM_SHM_MEMBARRIER", setting);
    auto c = make_comm();
    std::vector<double> lag_ms;
    for (int round = 0; round < 9; ++round) {
      std::int64_t sent = 0;
      if (w.rank == 0) {
        std::this_thread::sleep_for(25ms);  // the readers are asleep by now
        sent = now_ns();
      }
      c.broadcast(std::span<std::int64_t>(&sent, 1), 0);
      if (w.rank != 0) lag_ms.push_back(static_cast<double>(now_ns() - sent) / 1e6);
    }
    c.barrier();
    if (w.rank == 0) continue;
    std::sort(lag_ms.begin(), lag_ms.end());
    INFO("wake-up after the root's publish, ms, sorted: ", lag_ms[0], " ", lag_ms[4], " ", lag_ms[8]);
    CHECK(lag_ms[4] < 3.0);
  }
}

// Two ranks that meet on one CPU of a host with a CPU for each: the waits notice it (each publish
// records its CPU) and the higher rank moves itself off that CPU, restoring its affinity mask
// (steps.hpp, spread()). Both ranks start pinned to one CPU here, then get their mask back.
TEST_CASE("shm: two ranks made to share a CPU end on different CPUs, with their affinity masks kept") {
  const auto& w = comm::test::world();
  cpu_set_t mask;
  REQUIRE(::sched_getaffinity(0, sizeof mask, &mask) == 0);
  int first = -1;
  for (int c = 0; c < CPU_SETSIZE && first < 0; ++c)
    if (CPU_ISSET(c, &mask)) first = c;
  // Only where the spin is long (a CPU for every rank) and both ranks may use the same CPUs.
  if (w.size != 2 || CPU_COUNT(&mask) < 2 || std::thread::hardware_concurrency() < 2) return;
  comm::test::ScopedEnv spread("COMM_SHM_SPREAD", "1");
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  REQUIRE(::sched_setaffinity(0, sizeof one, &one) == 0);
  auto c = make_comm();
  std::vector<int> firsts(2);
  c.all_gather(std::span<const int>(&first, 1), std::span<int>(firsts));
  REQUIRE(::sched_setaffinity(0, sizeof mask, &mask) == 0);
  if (firsts[0] != firsts[1]) return;  // different masks: nothing shared to undo
  std::vector<int> where(2, -1);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  int apart = 0;
  for (int round = 0; apart == 0; ++round) {
    std::vector<float> x(2, 1.f);
    for (int i = 0; i < 200; ++i) c.all_reduce(x, ReduceOp::max);
    const int cpu = ::sched_getcpu();
    c.all_gather(std::span<const int>(&cpu, 1), std::span<int>(where));
    int done = where[0] != where[1] || std::chrono::steady_clock::now() > until ? 1 : 0;
    c.all_reduce(std::span<int>(&done, 1), ReduceOp::max);  // every rank leaves the loop together
    if (done != 0) apart = where[0] != where[1] ? 1 : -1;
  }
  INFO("rank ", w.rank, " CPUs at the end: ", where[0], " and ", where[1]);
  CHECK(apart == 1);
  cpu_set_t now;
  REQUIRE(::sched_getaffinity(0, sizeof now, &now) == 0);
  CHECK(CPU_EQUAL(&now, &mask));
}
// A 2-rank all_gather and all_to_all whose own block is past kLargeCopyMin (16 MiB) plus a tail
// that is no whole piece: by single copy, each rank copies its own block while the peer reads its
// input, in 256 KiB pieces where every rank has a core (detail/base/copy.hpp, copy_large_bytes).
// Element i of rank q's block for rank p says (q, p, i), so a piece copied to the wrong place,
// or one left out, shows. Two ranks only: the blocks are 16 MiB each.
TEST_CASE("shm: a large own block by single copy arrives whole") {
  const auto& w = comm::test::world();
  if (w.size != 2) return;
  const int me = w.rank;
  const std::size_t count = comm::detail::kLargeCopyMin / sizeof(std::int32_t) + 3;
  const auto value = [&](int q, int p, std::size_t i) {
    return static_cast<std::int32_t>(static_cast<std::size_t>(q) * 1000003 + static_cast<std::size_t>(p) * 7919 + i % 1000000);
  };
  auto c = make_comm();
  std::vector<std::int32_t> in(count), out(2 * count, -1);
  {
    for (std::size_t i = 0; i < count; ++i) in[i] = value(me, 0, i);
    c.all_gather(std::span<const std::int32_t>(in), std::span<std::int32_t>(out));
    long long bad = -1;
    for (std::size_t j = 0; j < out.size() && bad < 0; ++j)
      if (out[j] != value(static_cast<int>(j / count), 0, j % count)) bad = static_cast<long long>(j);
    INFO("all_gather: first wrong element ", bad, " of ", out.size());
    CHECK(bad == -1);
  }
  {
    in.assign(2 * count, 0);
    for (std::size_t j = 0; j < in.size(); ++j) in[j] = value(me, static_cast<int>(j / count), j % count);
    std::fill(out.begin(), out.end(), -1);
    c.all_to_all(std::span<const std::int32_t>(in), std::span<std::int32_t>(out));
    long long bad = -1;
    for (std::size_t j = 0; j < out.size() && bad < 0; ++j)
      if (out[j] != value(static_cast<int>(j / count), me, j % count)) bad = static_cast<long long>(j);
    INFO("all_to_all: first wrong element ", bad, " of ", out.size());
    CHECK(bad == -1);
  }
}
#endif
