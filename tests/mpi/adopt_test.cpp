// The MPI backend inside an MPI program: the program initializes MPI
// itself, adopts MPI_COMM_WORLD, runs every collective blocking and async (in place and out of
// place, MPI-native and comm-kernel element types, custom reductions), large broadcasts from every
// root (in parts from 3 ranks), subgroups of the adopted
// communicator, and at the end the failure path: a rank that skips an operation makes one rank time
// out and the other fail at once with RemoteError naming it; a count mismatch in comm's own
// broadcast, whole or in parts, is a BackendError naming the root.
//
//   mpirun -np 2|3 mpi_adopt_test [--thread serialized]
//
// Every rank checks its own results; the failure count is summed over MPI_COMM_WORLD and rank 0
// prints the verdict. Exit code 0 only when every check passed on every rank.
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <comm/backends/mpi.hpp>
#include <comm/communicator.hpp>

namespace {

using Comm = comm::Communicator<comm::backends::Mpi>;
using namespace std::chrono_literals;

int g_rank = -1;
int g_failures = 0;

#define EXPECT(cond)                                                                               \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      ++g_failures;                                                                                \
      std::fprintf(stderr, "[%d] %s:%d: check failed: %s\n", g_rank, __FILE__, __LINE__, #cond);  \
    }                                                                                              \
  } while (false)

template <class E, class F>
std::string expect_throw(F&& f, const char* what) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ++g_failures;
    std::fprintf(stderr, "[%d] %s: wrong exception: %s\n", g_rank, what, e.what());
    return e.what();
  }
  ++g_failures;
  std::fprintf(stderr, "[%d] %s: nothing thrown\n", g_rank, what);
  return {};
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// Sum over ranks 0..n-1 of (r + 1) * (i + 1): what all_reduce(sum) of value (r+1)*(i+1) gives.
double tri(int n) { return n * (n + 1) / 2.0; }

void blocking_collectives(Comm& c) {
  const int n = c.size(), me = c.rank();
  // all_reduce: in place and out of place, MPI-native types and ops.
  std::vector<float> f(1000);
  for (std::size_t i = 0; i < f.size(); ++i) f[i] = static_cast<float>((me + 1) * (i + 1));
  c.all_reduce(f);
  bool ok = true;
  for (std::size_t i = 0; i < f.size(); ++i) ok = ok && f[i] == static_cast<float>(tri(n) * (i + 1));
  EXPECT(ok);
  const std::vector<std::int64_t> in{me, -me, 7};
  std::vector<std::int64_t> out(3);
  c.all_reduce(in, out, comm::ReduceOp::max);
  EXPECT(out[0] == n - 1 && out[1] == 0 && out[2] == 7);
  std::vector<std::uint32_t> bits{1u << me, 0xffu};
  c.all_reduce(bits, comm::ReduceOp::bor);
  EXPECT(bits[0] == (1u << n) - 1 && bits[1] == 0xffu);
  std::vector<std::int32_t> avg{me * 3 - 5};
  c.all_reduce(avg, comm::ReduceOp::avg);  // floor division of the sum
  {
    int s = 0;
    for (int r = 0; r < n; ++r) s += r * 3 - 5;
    const int q = s / n - ((s % n != 0 && s < 0) ? 1 : 0);
    EXPECT(avg[0] == q);
  }
  // Types MPI has no reduction for run comm's kernel in a user-defined MPI_Op.
  std::vector<comm::half> h(257, comm::half(static_cast<float>(me + 1)));
  c.all_reduce(h, comm::op::sum);
  ok = true;
  for (auto x : h) ok = ok && static_cast<float>(x) == static_cast<float>(tri(n));
  EXPECT(ok);
  std::vector<comm::bfloat16> bf(5, comm::bfloat16(static_cast<float>(me)));
  c.all_reduce(bf, comm::ReduceOp::max);
  EXPECT(static_cast<float>(bf[4]) == static_cast<float>(n - 1));
  std::vector<comm::float8_e4m3> f8(3, comm::float8_e4m3(1.0f));
  c.all_reduce(f8, comm::ReduceOp::avg);
  EXPECT(static_cast<float>(f8[0]) == 1.0f);
  // A custom callable, on an MPI-native type.
  std::vector<double> d{static_cast<double>(me + 2)};
  c.all_reduce(d, [](double a, double b) { return a * b; });
  {
    double p = 1;
    for (int r = 0; r < n; ++r) p *= r + 2;
    EXPECT(d[0] == p);
  }
  // reduce_scatter: out of place and in place (the output is this rank's block of the input).
  std::vector<std::int32_t> rs_in(static_cast<std::size_t>(n) * 4);
  for (std::size_t i = 0; i < rs_in.size(); ++i) rs_in[i] = static_cast<std::int32_t>(i) + me;
  std::vector<std::int32_t> rs_out(4);
  c.reduce_scatter(rs_in, rs_out);
  ok = true;
  for (std::size_t j = 0; j < 4; ++j)
    ok = ok && rs_out[j] == static_cast<std::int32_t>(n * (static_cast<std::size_t>(me) * 4 + j) + n * (n - 1) / 2);
  EXPECT(ok);
  const std::vector<std::int32_t> before = rs_in;
  std::span<std::int32_t> slot(rs_in.data() + static_cast<std::size_t>(me) * 4, 4);
  c.reduce_scatter(rs_in, slot);
  EXPECT(std::equal(slot.begin(), slot.end(), rs_out.begin()));
  ok = true;  // the rest of the input is untouched
  for (std::size_t i = 0; i < rs_in.size(); ++i)
    if (i / 4 != static_cast<std::size_t>(me)) ok = ok && rs_in[i] == before[i];
  EXPECT(ok);
  // all_gather: out of place and in place.
  const std::vector<std::uint8_t> mine{static_cast<std::uint8_t>(me), static_cast<std::uint8_t>(100 + me)};
  std::vector<std::uint8_t> all(2 * static_cast<std::size_t>(n));
  c.all_gather(mine, all);
  ok = true;
  for (int r = 0; r < n; ++r) ok = ok && all[2 * r] == r && all[2 * r + 1] == 100 + r;
  EXPECT(ok);
  std::vector<comm::half> hall(static_cast<std::size_t>(n), comm::half(0.0f));
  hall[static_cast<std::size_t>(me)] = comm::half(static_cast<float>(me) + 0.5f);
  c.all_gather(std::span<const comm::half>(&hall[static_cast<std::size_t>(me)], 1), hall);
  ok = true;
  for (int r = 0; r < n; ++r) ok = ok && static_cast<float>(hall[static_cast<std::size_t>(r)]) == r + 0.5f;
  EXPECT(ok);
  // broadcast from the last rank.
  std::vector<double> b(3, me == n - 1 ? 42.5 : -1.0);
  c.broadcast(b, n - 1);
  EXPECT(b[0] == 42.5 && b[2] == 42.5);
  // gather: to rank 0 out of place, to the last rank in place; outputs off the root may be empty.
  const std::vector<std::int64_t> gin{10 * me};
  std::vector<std::int64_t> gout(me == 0 ? static_cast<std::size_t>(n) : 0);
  c.gather(gin, gout, 0);
  if (me == 0)
    for (int r = 0; r < n; ++r) EXPECT(gout[static_cast<std::size_t>(r)] == 10 * r);
  std::vector<std::int64_t> g2(me == n - 1 ? static_cast<std::size_t>(n) : 1, 0);
  g2[me == n - 1 ? static_cast<std::size_t>(me) : 0] = 7 * me;
  c.gather(std::span<const std::int64_t>(&g2[me == n - 1 ? static_cast<std::size_t>(me) : 0], 1),
           me == n - 1 ? std::span<std::int64_t>(g2) : std::span<std::int64_t>(), n - 1);
  if (me == n - 1)
    for (int r = 0; r < n; ++r) EXPECT(g2[static_cast<std::size_t>(r)] == 7 * r);
  c.barrier();
  // Bad arguments are InvalidArgument, before anything is sent.
  std::vector<float> wrong(3);
  expect_throw<comm::InvalidArgument>([&] { c.all_gather(f, wrong); }, "all_gather size");
  expect_throw<comm::InvalidArgument>([&] { c.broadcast(f, n); }, "broadcast root");
}

/// Broadcasts large enough to go in parts read in turn at 3 ranks and more (schedules.hpp,
/// broadcast_parts): from every root, at the smallest size that does, at a size of many parts and
/// at sizes whose parts do not divide it evenly, blocking and two at once async. Every element
/// carries its index and the root, so a part placed at another offset or taken from another
/// broadcast is seen.
void large_broadcasts(Comm& c) {
  const int n = c.size(), me = c.rank();
  auto value = [](std::size_t i, int root) { return static_cast<float>(i % 65521) + 0.5f * static_cast<float>(root); };
  auto check = [&](const std::vector<float>& v, int root) {
    std::size_t bad = 0;
    for (std::size_t i = 0; i < v.size(); ++i) bad += v[i] != value(i, root) ? 1 : 0;
    return bad == 0;
  };
  for (const std::size_t count : {std::size_t{65536}, std::size_t{262147}, std::size_t{750001}, std::size_t{4194305}})
    for (int root = 0; root < n; ++root) {
      std::vector<float> v(count, -1.f);
      if (me == root)
        for (std::size_t i = 0; i < count; ++i) v[i] = value(i, root);
      c.broadcast(v, root);
      EXPECT(check(v, root));
    }
  std::vector<float> a(300001, -1.f), b(700003, -1.f);
  const int ra = 0, rb = n - 1;
  if (me == ra)
    for (std::size_t i = 0; i < a.size(); ++i) a[i] = value(i, ra);
  if (me == rb)
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = value(i, rb);
  auto wa = c.broadcast(a, ra, comm::async);
  auto wb = c.broadcast(b, rb, comm::async);
  wa.wait();
  wb.wait();
  EXPECT(check(a, ra));
  EXPECT(check(b, rb));
}

void async_collectives(Comm& c) {
  const int n = c.size(), me = c.rank();
  std::vector<float> a(4096, 1.f);
  std::vector<std::int32_t> r(static_cast<std::size_t>(n) * 8, me), rout(8);
  std::vector<double> g(static_cast<std::size_t>(n));
  const std::vector<double> gin{me * 1.5};
  std::vector<comm::bfloat16> bb(16, comm::bfloat16(me == 0 ? 3.0f : 0.0f));
  std::vector<comm::Work> ws;
  ws.push_back(c.all_reduce(a, comm::ReduceOp::sum, comm::async));
  ws.push_back(c.reduce_scatter(r, rout, comm::op::sum, comm::async));
  ws.push_back(c.all_gather(gin, g, comm::async));
  ws.push_back(c.broadcast(bb, 0, comm::async));
  ws.push_back(c.barrier(comm::async));
  std::vector<std::uint64_t> custom{static_cast<std::uint64_t>(me + 1)};
  ws.push_back(c.all_reduce(custom, [](std::uint64_t x, std::uint64_t y) { return x + y + 0; }, comm::async));
  for (auto& w : ws) w.wait();
  for (auto& w : ws) EXPECT(w.is_completed());
  EXPECT(a[0] == static_cast<float>(n) && a[4095] == static_cast<float>(n));
  EXPECT(rout[0] == n * (n - 1) / 2);
  for (int q = 0; q < n; ++q) EXPECT(g[static_cast<std::size_t>(q)] == q * 1.5);
  EXPECT(static_cast<float>(bb[15]) == 3.0f);
  EXPECT(custom[0] == static_cast<std::uint64_t>(tri(n)));
  // Blocking calls after async ones run after them, in issue order.
  std::vector<std::int32_t> v{1};
  auto w = c.all_reduce(v, comm::async);
  c.all_reduce(v);
  EXPECT(w.is_completed());
  EXPECT(v[0] == n * n);
  const auto fr = c.flight_record();
  EXPECT(fr.backend == "mpi");
  EXPECT(!fr.ops.empty() && fr.ops.back().state == comm::OpState::completed);
}

void subgroups(Comm& c) {
  const int n = c.size(), me = c.rank();
  // split without a store: MPI_Comm_create_group after the color exchange.
  auto g = c.split(me % 2, -me);  // reversed order inside each parity
  EXPECT(g.has_value());
  if (g) {
    std::vector<int> members;
    for (int r = n - 1; r >= 0; --r)
      if (r % 2 == me % 2) members.push_back(r);
    EXPECT(g->size() == static_cast<int>(members.size()));
    EXPECT(members[static_cast<std::size_t>(g->rank())] == me);
    std::vector<std::int32_t> s{me};
    g->all_reduce(s);
    EXPECT(s[0] == std::accumulate(members.begin(), members.end(), 0));
    EXPECT(g->flight_record().name == "adopted.g0");
  }
  EXPECT(!c.split(-1, 0).has_value());
  // new_group: the last rank first; the others get nullopt at once.
  const std::vector<int> ranks{n - 1, 0};
  auto ng = c.new_group(ranks);
  EXPECT(ng.has_value() == (me == 0 || me == n - 1));
  if (ng) {
    EXPECT(ng->rank() == (me == n - 1 ? 0 : 1));
    std::vector<std::int32_t> b{me == n - 1 ? 99 : 0};
    ng->broadcast(b, 0);
    EXPECT(b[0] == 99);
  }
  // No store: monitored_barrier is refused, the communicator stays usable.
  expect_throw<comm::InvalidArgument>([&] { c.monitored_barrier(1s); }, "monitored_barrier");
  c.barrier();
}

/// A new_group member that never comes: the first member names it (and only it) at its deadline,
/// and tells the member that did come, which gives up at once instead of at its own deadline.
void gate_timeout(int n, int me) {
  if (n < 2) return;
  comm::backends::Mpi::Options o;
  o.timeout = me == 0 ? 400ms : 20s;  // the others wait for rank 0 in the barrier below
  auto c = Comm::adopt(MPI_COMM_WORLD, o);
  std::vector<int> ranks{0};
  if (n >= 3) ranks.push_back(1);
  ranks.push_back(n - 1);  // never comes
  const auto t0 = std::chrono::steady_clock::now();
  if (me == 0) {
    const auto msg = expect_throw<comm::Timeout>([&] { (void)c.new_group(ranks); }, "new_group gate");
    EXPECT(contains(msg, "(peer " + std::to_string(n - 1) + "): rank " + std::to_string(n - 1) +
                             " of this communicator did not reach new_group within 400 ms"));
  } else if (me == 1 && n >= 3) {
    const auto msg = expect_throw<comm::Timeout>([&] { (void)c.new_group(ranks); }, "new_group gate (member)");
    EXPECT(contains(msg, "rank 0 (the group's first member) reports that another member did not reach new_group"));
    EXPECT(std::chrono::steady_clock::now() - t0 < 5s);
  } else if (me != n - 1) {
    EXPECT(!c.new_group(ranks).has_value());
  }
  c.barrier();  // the parent is untouched
}

/// The last rank skips an all_reduce: rank 0 (short timeout) times out, the ranks between (long
/// timeout) fail at once with RemoteError naming rank 0, well before their own deadline.
void failure(int n, int me) {
  if (n < 2) return;
  comm::backends::Mpi::Options o;
  o.timeout = me == 0 ? 500ms : 20s;
  {
    auto c = Comm::adopt(MPI_COMM_WORLD, o);
    std::vector<float> v(8, 1.f);
    c.all_reduce(v);
    EXPECT(v[0] == static_cast<float>(n));
    if (me != n - 1) {
      const auto t0 = std::chrono::steady_clock::now();
      if (me == 0) {
        const auto msg = expect_throw<comm::Timeout>([&] { c.all_reduce(v); }, "timeout");
        EXPECT(contains(msg, "comm: all_reduce on rank 0"));
        EXPECT(contains(msg, "op #1 did not complete within 500 ms"));
        // comm's own schedule (up to 8 ranks) knows whose message is missing: the last rank's.
        EXPECT(contains(msg, "comm: all_reduce on rank 0 (peer " + std::to_string(n - 1) + ")"));
        EXPECT(contains(msg, "no data from rank " + std::to_string(n - 1) + " arrived"));
        EXPECT(contains(msg, "requests stay pending"));
      } else {
        const auto msg = expect_throw<comm::RemoteError>([&] { c.all_reduce(v); }, "remote");
        EXPECT(contains(msg, "comm: all_reduce on rank " + std::to_string(me) + " (peer 0): rank 0 failed: "));
        EXPECT(contains(msg, "did not complete within 500 ms"));
        EXPECT(std::chrono::steady_clock::now() - t0 < 5s);
      }
      // Unusable now: the next operation fails at once with the first cause.
      const auto t1 = std::chrono::steady_clock::now();
      const auto again = expect_throw<comm::Error>([&] { c.barrier(); }, "after failure");
      EXPECT(contains(again, "unusable after an earlier failure"));
      EXPECT(std::chrono::steady_clock::now() - t1 < 1s);
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);  // the last rank waits here until the others are done failing
}

/// One broadcast from rank 0, which holds `root_n` elements where the others hold `other_n`: the
/// others get a BackendError containing `want`, then `after(message, v)` checks more of it and
/// what is left in their buffer. The root's part completes.
template <class After>
void broadcast_mismatch(int me, std::size_t root_n, std::size_t other_n, const std::string& want, After after) {
  {
    auto c = Comm::adopt(MPI_COMM_WORLD);
    std::vector<float> v(me == 0 ? root_n : other_n, me == 0 ? 7.f : -1.f);
    if (me == 0) {
      c.broadcast(v, 0);
    } else {
      const std::string label = "count mismatch: " + want;
      const auto msg = expect_throw<comm::BackendError>([&] { c.broadcast(v, 0); }, label.c_str());
      EXPECT(contains(msg, "comm: broadcast on rank " + std::to_string(me)));
      EXPECT(contains(msg, want));
      after(msg, v);
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

/// Ranks that disagree about a count (comm's own schedule, up to 8 ranks). The root broadcasts 2
/// elements where the others expect 4: they get a BackendError naming the root, and nothing is
/// written past the 2 elements that came. The other way, 4 where the others receive 2 (MPI
/// truncates the receive; under MPICH 4.0 that error goes through MPI_COMM_WORLD's handler:
/// tests/mpi/mpich_truncate.cpp), the error says the root sent more.
void count_mismatch(int n, int me) {
  if (n < 2) return;
  broadcast_mismatch(me, 2, 4, "rank 0 sent 8 bytes where 16 were expected",
                     [&](const std::string& msg, const std::vector<float>& v) {
                       EXPECT(contains(msg, "comm: broadcast on rank " + std::to_string(me) + " (peer 0)"));
                       EXPECT(v[2] == -1.f && v[3] == -1.f);
                     });
  broadcast_mismatch(me, 4, 2, "rank 0 sent more than the 8 bytes expected",
                     [](const std::string&, const std::vector<float>&) {});
  if (n < 3) return;
  // In parts (3 ranks and more, from 256 KiB): 1 MiB against 768 KiB goes in 256 KiB parts both
  // ways, alike in length, so only the size sent first tells the readers; the root's parts go
  // unread and the root ends by the readers' notice.
  {
    auto c = Comm::adopt(MPI_COMM_WORLD);
    std::vector<float> v(me == 0 ? 262144 : 196608, me == 0 ? 7.f : -1.f);
    if (me == 0) {
      const auto msg = expect_throw<comm::Error>([&] { c.broadcast(v, 0); }, "parts: the root");
      EXPECT(contains(msg, "comm: broadcast on rank 0"));
    } else {
      const auto msg = expect_throw<comm::BackendError>([&] { c.broadcast(v, 0); }, "parts: count mismatch");
      EXPECT(contains(msg, "rank 0 broadcast 1048576 bytes where this rank has 786432"));
      EXPECT(v[0] == -1.f && v[196607] == -1.f);  // nothing of the root's came
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

/// MPI below MPI_THREAD_MULTIPLE: blocking operations work, async ones are refused up front.
void serialized(Comm& c) {
  std::vector<float> v{1.f};
  c.all_reduce(v);
  EXPECT(v[0] == static_cast<float>(c.size()));
  const auto msg = expect_throw<comm::InvalidArgument>([&] { (void)c.all_reduce(v, comm::async); }, "async");
  EXPECT(contains(msg, "MPI_THREAD_MULTIPLE"));
  c.barrier();
}

}  // namespace

int main(int argc, char** argv) {
  const bool want_serialized = argc > 2 && std::strcmp(argv[1], "--thread") == 0 && std::strcmp(argv[2], "serialized") == 0;
  int provided = 0;
  MPI_Init_thread(&argc, &argv, want_serialized ? MPI_THREAD_SERIALIZED : MPI_THREAD_MULTIPLE, &provided);
  int n = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  try {
    {
      auto c = Comm::adopt(MPI_COMM_WORLD);
      EXPECT(c.rank() == g_rank);
      EXPECT(c.size() == n);
      EXPECT(c.backend().native_handle() != MPI_COMM_WORLD);
      if (want_serialized) {
        serialized(c);
      } else {
        EXPECT(provided == MPI_THREAD_MULTIPLE);
        blocking_collectives(c);
        large_broadcasts(c);
        async_collectives(c);
        subgroups(c);
      }
    }
    if (!want_serialized) {
      gate_timeout(n, g_rank);
      count_mismatch(n, g_rank);
      failure(n, g_rank);
    }
  } catch (const std::exception& e) {
    ++g_failures;
    std::fprintf(stderr, "[%d] unexpected exception: %s\n", g_rank, e.what());
  }
  // The caller's communicator is still the caller's.
  int total = 0;
  MPI_Allreduce(&g_failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (g_rank == 0) std::printf("mpi_adopt_test: %d rank(s), %d failed check(s)%s\n", n, total, total ? "" : ": OK");
  MPI_Finalize();
  return total == 0 ? 0 : 1;
}
