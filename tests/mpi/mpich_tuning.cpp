// Run under MPICH (mpi_mpich_tuning.npN): the Mpi backend's choices that differ under MPICH
// (detail/mpi/schedules.hpp, tuning_for_library). From 512 KiB comm's all_reduce on 2-8 ranks is
// MPICH's own MPI_Iallreduce after a count check (Tuning::library_all_reduce); below it comm's
// own schedule, whose one exchange stops at 8 KiB and whose messages go whole (no eager pieces,
// unlike OpenMPI's). On both sides of each limit: float sums close to the sum in double, avg, a
// type MPI has no reduction for (bfloat16, comm's kernel in a user-defined MPI_Op), in place, out
// of place and async; every rank's result the same bits. An all_gather whose own block is copied
// before the exchange (from 4 MiB) and one below; reduce_scatters whose blocks go whole (up to
// 8 MiB: one at the limit) and one just above it, in 33 uneven chunks. Then ranks that disagree
// on the size: both above the threshold (the count check: a BackendError naming the peer), and
// one on each side (the length checks of either
// path, also where the small side sends exactly as many bytes as the count check does), and the
// communicator refusing further work after it. The collective suites run under
// OpenMPI only, so this is where MPICH's paths are checked. Prints "mpich_tuning: N rank(s), 0
// failed check(s): OK" on rank 0.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <comm/backends/mpi.hpp>
#include <comm/communicator.hpp>

namespace {

using Comm = comm::Communicator<comm::backends::Mpi>;

int g_rank = -1;
int g_failures = 0;

#define CHECK(cond)                                                                                \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      ++g_failures;                                                                                \
      std::fprintf(stderr, "[%d] %s:%d: check failed: %s\n", g_rank, __FILE__, __LINE__, #cond);  \
    }                                                                                              \
  } while (false)

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

constexpr std::size_t kThreshold = std::size_t{512} << 10;  // bytes, Tuning::library_all_reduce under MPICH
constexpr std::size_t kWholeMax = std::size_t{8} << 20;     // bytes, Tuning::whole_max under MPICH

/// Rank r's input element i: varied floats (not integers), so that the order of the reduction
/// shows in the bits; the same on every rank that computes it.
float input(int r, std::size_t i) {
  std::uint32_t x = static_cast<std::uint32_t>(i) * 2654435761u + static_cast<std::uint32_t>(r) * 40503u + 12345u;
  x ^= x >> 13;
  x *= 0x5bd1e995u;
  x ^= x >> 15;
  return static_cast<float>(x % 100000u) / 997.0f - 50.0f;
}

std::uint64_t fnv(const void* p, std::size_t n) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::size_t i = 0; i < n; ++i) h = (h ^ static_cast<const unsigned char*>(p)[i]) * 1099511628211ull;
  return h;
}

/// Whether every rank of the world holds `h`.
bool same_everywhere(std::uint64_t h, int n) {
  std::vector<std::uint64_t> all(static_cast<std::size_t>(n));
  MPI_Allgather(&h, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD);
  for (auto v : all)
    if (v != h) return false;
  return true;
}

/// float sums of `count` elements, in place, out of place and async: close to the sum in double,
/// and the same bits on every rank.
void sums(Comm& c, std::size_t count) {
  const int n = c.size(), me = c.rank();
  std::vector<float> in(count), out(count), inplace(count), async(count);
  for (std::size_t i = 0; i < count; ++i) in[i] = input(me, i);
  inplace = in;
  async = in;
  c.all_reduce(in, out);
  c.all_reduce(std::span<float>(inplace));
  c.all_reduce(std::span<float>(async), comm::ReduceOp::sum, comm::async).wait();
  bool close = true;
  for (std::size_t i = 0; i < count; ++i) {
    double want = 0, scale = 0;
    for (int r = 0; r < n; ++r) {
      want += input(r, i);
      scale += std::fabs(input(r, i));
    }
    close = close && std::fabs(out[i] - want) <= 1e-6 * scale + 1e-6;
  }
  CHECK(close);
  CHECK(std::memcmp(out.data(), inplace.data(), count * sizeof(float)) == 0);
  CHECK(std::memcmp(out.data(), async.data(), count * sizeof(float)) == 0);
  CHECK(same_everywhere(fnv(out.data(), count * sizeof(float)), n));
}

/// Exact results: int32 avg (the floor of the sum / size()), bfloat16 max (comm's kernel).
void exact(Comm& c, std::size_t bytes) {
  const int n = c.size(), me = c.rank();
  std::vector<std::int32_t> v(bytes / sizeof(std::int32_t));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<std::int32_t>(i % 1000) * (me + 1) - me;
  c.all_reduce(v, comm::ReduceOp::avg);  // floor division of the sum
  bool ok = true;
  for (std::size_t i = 0; i < v.size(); ++i) {
    std::int64_t s = 0;
    for (int r = 0; r < n; ++r) s += static_cast<std::int64_t>(i % 1000) * (r + 1) - r;
    const std::int64_t q = s / n - ((s % n != 0 && s < 0) ? 1 : 0);
    ok = ok && v[i] == q;
  }
  CHECK(ok);
  std::vector<comm::bfloat16> b(bytes / sizeof(comm::bfloat16));
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = comm::bfloat16(static_cast<float>((i + static_cast<std::size_t>(me)) % 61));
  c.all_reduce(b, comm::ReduceOp::max);
  ok = true;
  for (std::size_t i = 0; i < b.size(); ++i) {
    float want = 0;
    for (int r = 0; r < n; ++r) want = std::max(want, static_cast<float>((i + static_cast<std::size_t>(r)) % 61));
    ok = ok && static_cast<float>(b[i]) == want;
  }
  CHECK(ok);
}

/// all_gather of a `bytes` block per rank, out of place and in place.
void gathers(Comm& c, std::size_t bytes) {
  const int n = c.size(), me = c.rank();
  const std::size_t block = bytes / sizeof(std::uint32_t);
  auto value = [&](int r, std::size_t i) { return static_cast<std::uint32_t>(i * 7 + static_cast<std::size_t>(r) * 1000003u); };
  std::vector<std::uint32_t> in(block), out(block * static_cast<std::size_t>(n)), inplace(out.size());
  for (std::size_t i = 0; i < block; ++i) in[i] = value(me, i);
  c.all_gather(in, out);
  std::copy(in.begin(), in.end(), inplace.begin() + static_cast<std::ptrdiff_t>(block * static_cast<std::size_t>(me)));
  c.all_gather(std::span<const std::uint32_t>(inplace.data() + block * static_cast<std::size_t>(me), block), inplace);
  bool ok = true;
  for (int r = 0; r < n; ++r)
    for (std::size_t i = 0; i < block; ++i) ok = ok && out[static_cast<std::size_t>(r) * block + i] == value(r, i);
  CHECK(ok);
  CHECK(out == inplace);
}

/// reduce_scatter of a `bytes` block per rank (int64 sums: exact), out of place and in place.
void reduce_scatters(Comm& c, std::size_t bytes) {
  const int n = c.size(), me = c.rank();
  const std::size_t block = bytes / sizeof(std::int64_t);
  std::vector<std::int64_t> in(block * static_cast<std::size_t>(n)), out(block);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<std::int64_t>(i % 4099) * (me + 1) - me;
  c.reduce_scatter(in, out);
  std::span<std::int64_t> mine(in.data() + block * static_cast<std::size_t>(me), block);
  c.reduce_scatter(in, mine);
  bool ok = true;
  for (std::size_t j = 0; j < block; ++j) {
    const std::size_t i = block * static_cast<std::size_t>(me) + j;
    std::int64_t want = 0;
    for (int r = 0; r < n; ++r) want += static_cast<std::int64_t>(i % 4099) * (r + 1) - r;
    ok = ok && out[j] == want && mine[j] == want;
  }
  CHECK(ok);
}

/// Ranks whose sizes differ (rank 1 holds `other` bytes, the rest `bytes`): every rank gets a
/// comm::Error saying so, `named` ranks one naming the peer, and the communicator then refuses.
void mismatch(std::size_t bytes, std::size_t other, bool named) {
  const int me = g_rank;
  {
    auto c = Comm::adopt(MPI_COMM_WORLD);
    std::vector<float> v((me == 1 ? other : bytes) / sizeof(float), 1.0f);
    std::string what;
    try {
      c.all_reduce(v);
    } catch (const comm::Error& e) {
      what = e.what();
    }
    std::printf("mpich_tuning: rank %d, %zu vs %zu bytes: %s\n", me, bytes, other, what.c_str());
    CHECK(contains(what, "all_reduce on rank " + std::to_string(me)));
    CHECK(contains(what, "different counts"));
    if (named) {
      // The count check names the first peer whose size differs from this rank's.
      const int peer = me == 1 ? 0 : 1;
      CHECK(contains(what, "(peer " + std::to_string(peer) + ")"));
      CHECK(contains(what, "rank " + std::to_string(peer) + " called it with " +
                               std::to_string(me == 1 ? bytes : other) + " bytes where this rank has " +
                               std::to_string(me == 1 ? other : bytes)));
    }
    std::string again;
    try {
      c.barrier();
    } catch (const comm::Error& e) {
      again = e.what();
    }
    CHECK(contains(again, "unusable after an earlier failure"));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  // MPICH 4.0 raises a truncated receive through MPI_COMM_WORLD's handler (docs/BACKENDS.md).
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int n = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  try {
    {
      auto c = Comm::adopt(MPI_COMM_WORLD);
      for (std::size_t bytes : {std::size_t{8} << 10, (std::size_t{8} << 10) + 4, std::size_t{16} << 10, kThreshold - 4,
                                kThreshold, kThreshold + 4 * 1027, 4 * kThreshold}) {
        sums(c, bytes / sizeof(float));
        exact(c, bytes);
      }
      for (std::size_t bytes : {(std::size_t{4} << 20) - 4, std::size_t{4} << 20}) gathers(c, bytes);
      for (std::size_t bytes : {kThreshold, kThreshold + 8, kWholeMax, kWholeMax + 8}) reduce_scatters(c, bytes);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    mismatch(2 * kThreshold, kThreshold, true);                  // both above: the count check
    mismatch(2 * kThreshold, std::size_t{4} << 10, false);       // rank 1 in comm's exchange
    // Rank 1's exchange of 8 bytes, the length of the count check's own message: it must not take
    // the others' sizes for data (it did when the sizes went on the schedules' tag).
    mismatch(2 * kThreshold, 8, false);
    mismatch(kThreshold, kThreshold - (std::size_t{64} << 10), false);  // rank 1 in comm's reduce-scatter
  } catch (const std::exception& e) {
    ++g_failures;
    std::fprintf(stderr, "[%d] unexpected exception: %s\n", g_rank, e.what());
  }
  int total = 0;
  MPI_Allreduce(&g_failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (g_rank == 0)
    std::printf("mpich_tuning: %d rank(s), %d failed check(s)%s\n", n, total, total == 0 ? ": OK" : "");
  std::fflush(stdout);
  MPI_Finalize();
  return total == 0 ? 0 : 1;
}
