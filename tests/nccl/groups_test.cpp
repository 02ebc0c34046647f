// Subgroups and diagnostics of the NCCL backend on a GPU, written for any number of ranks: split
// (ncclCommSplit) by parity and with a negative color, new_group of a subset with collectives
// inside, nested groups, non-members not blocking, the adopted communicator (split works,
// new_group and monitored_barrier reject), AnyCommunicator, monitored_barrier naming a late rank,
// the flight recorder's contents and dumps, and the desync check. Cases that need several ranks say
// so and skip at one. Skipped with the reason printed where no GPU (or not enough) is usable.
#include "nccl_test_util.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <comm/cdb.hpp>
#include <support/env_guard.hpp>

using namespace nccl_test;
using namespace std::chrono_literals;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// Makes the communicator's device current (DeviceBuffer allocates there).
void use_device(const Comm& c) { NCCL_TEST_CUDA(cudaSetDevice(c.backend().device())); }

/// all_reduce of {value, 1} over `c`: {sum of the values, size}.
std::vector<float> sum_and_count(Comm& c, float value) {
  DeviceBuffer<float> d(std::vector<float>{value, 1.0f});
  c.all_reduce(d.span());
  return d.download();
}

/// A file of this test run, removed when the test ends.
struct TempPath {
  std::string path;
  explicit TempPath(const std::string& name) {
    path = (std::filesystem::temp_directory_path() /
            (name + "." + std::to_string(::getpid()) + "." + std::to_string(comm::test::world().rank)))
               .string();
  }
  ~TempPath() {
    std::error_code ec;
    std::filesystem::remove(path, ec);
    for (int r = 0; r < 8; ++r) std::filesystem::remove(path + "." + std::to_string(r), ec);
  }
};

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

}  // namespace

TEST_CASE("split by parity: ranked by (key, rank), collectives inside; a negative color gets none") {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  use_device(c);
  const int r = c.rank(), n = c.size();
  auto g = c.split(r % 2);  // key = rank: the parent's order
  REQUIRE(g);
  const int members = (n - r % 2 + 1) / 2;
  CHECK(g->size() == members);
  CHECK(g->rank() == r / 2);
  CHECK(g->backend().device() == c.backend().device());
  CHECK(g->backend().stream() != c.backend().stream());  // a stream of its own
  float want = 0;
  for (int q = r % 2; q < n; q += 2) want += static_cast<float>(q);
  auto got = sum_and_count(*g, static_cast<float>(r));
  CHECK(got[0] == want);
  CHECK(got[1] == static_cast<float>(members));

  // Rank 0 joins no group; the others are ranked in reverse (key = -rank).
  auto h = c.split(r == 0 ? -1 : 0, -r);
  if (r == 0) {
    CHECK_FALSE(h);
  } else {
    REQUIRE(h);
    CHECK(h->size() == n - 1);
    CHECK(h->rank() == n - 1 - r);
    got = sum_and_count(*h, static_cast<float>(r));
    CHECK(got[0] == static_cast<float>(n * (n - 1) / 2));
  }
  // The parent is unaffected, and both splits are operations in its flight record.
  got = sum_and_count(c, 1.0f);
  CHECK(got[0] == static_cast<float>(n));
  c.backend().synchronize();
  const auto f = c.flight_record();
  REQUIRE(f.ops.size() == 3);
  CHECK(f.ops[0].op == "split");
  CHECK(f.ops[1].op == "split");
  CHECK(f.ops[0].state == comm::OpState::completed);
  CHECK(f.ops[2].op == "all_reduce");
  CHECK(g->flight_record().name == "g0");
  if (h) CHECK(h->flight_record().name == "g1");
  // A group may be split again.
  auto gg = g->split(0);
  REQUIRE(gg);
  CHECK(gg->size() == g->size());
  CHECK(sum_and_count(*gg, 1.0f)[0] == static_cast<float>(members));
}

TEST_CASE("new_group of a subset: list order, collectives inside, nested groups; the parent goes on") {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  use_device(c);
  const int r = c.rank(), n = c.size();
  const std::vector<int> ranks = n >= 2 ? std::vector<int>{n - 1, 0} : std::vector<int>{0};
  auto g = c.new_group(ranks);
  const auto at = std::find(ranks.begin(), ranks.end(), r);
  if (at == ranks.end()) {
    CHECK_FALSE(g);
  } else {
    REQUIRE(g);
    const int me = static_cast<int>(at - ranks.begin());
    const int m = static_cast<int>(ranks.size());
    CHECK(g->rank() == me);
    CHECK(g->size() == m);
    CHECK(g->flight_record().name == "g0");
    float want = 0;
    for (int q : ranks) want += static_cast<float>(q + 1);
    CHECK(sum_and_count(*g, static_cast<float>(r + 1))[0] == want);
    // broadcast from the group's rank 0 (the first listed rank)
    DeviceBuffer<std::int32_t> b(std::vector<std::int32_t>(3, r));
    g->broadcast(b.span(), 0);
    CHECK(b.download() == std::vector<std::int32_t>(3, ranks[0]));
    // all_gather in group order
    DeviceBuffer<std::int32_t> mine(std::vector<std::int32_t>{r}), all(static_cast<std::size_t>(m));
    g->all_gather(mine.cspan(), all.span());
    CHECK(all.download() == std::vector<std::int32_t>(ranks.begin(), ranks.end()));
    // Nested: a group of the group's rank 0, and a split of the group.
    auto solo = g->new_group({0});
    CHECK(static_cast<bool>(solo) == (me == 0));
    if (solo) {
      CHECK(solo->size() == 1);
      CHECK(solo->flight_record().name == "g0.g0");
      CHECK(sum_and_count(*solo, 5.0f)[0] == 5.0f);
    }
    auto again = g->split(0);
    REQUIRE(again);
    CHECK(again->size() == m);
    CHECK(again->flight_record().name == "g0.g1");
    CHECK(sum_and_count(*again, 1.0f)[0] == static_cast<float>(m));
  }
  // Group numbers advance on every rank: a later group of everyone works, and so does the parent.
  std::vector<int> everyone(static_cast<std::size_t>(n));
  std::iota(everyone.begin(), everyone.end(), 0);
  auto w = c.new_group(everyone);
  REQUIRE(w);
  CHECK(w->rank() == r);
  CHECK(w->flight_record().name == "g1");
  CHECK(sum_and_count(*w, 1.0f)[0] == static_cast<float>(n));
  CHECK(sum_and_count(c, 1.0f)[0] == static_cast<float>(n));
}

TEST_CASE("new_group: non-members return at once, without waiting for the members") {
  NCCL_REQUIRE_GPU();
  COMM_REQUIRE_RANKS(2);
  auto c = make_comm();
  use_device(c);
  if (c.rank() == 0) {
    std::this_thread::sleep_for(1500ms);  // a non-member that waited for the member would take this long
    auto g = c.new_group({0});
    REQUIRE(g);
    CHECK(g->size() == 1);
    CHECK(sum_and_count(*g, 3.0f)[0] == 3.0f);
  } else {
    const auto t0 = std::chrono::steady_clock::now();
    auto g = c.new_group({0});
    CHECK_FALSE(g);
    CHECK(std::chrono::steady_clock::now() - t0 < 500ms);
  }
  comm::test::barrier();
  CHECK(sum_and_count(c, 1.0f)[0] == static_cast<float>(c.size()));
}

TEST_CASE("adopted communicator: split works; new_group and monitored_barrier need a store") {
  NCCL_REQUIRE_GPU();
  ncclComm_t raw = raw_nccl_comm();
  cudaStream_t s = nullptr;
  NCCL_TEST_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  {
    auto a = Comm::adopt(raw, s);
    CHECK_THROWS_WITH_AS(a.new_group({0}), doctest::Contains("has no store"), comm::InvalidArgument);
    CHECK_THROWS_WITH_AS(a.monitored_barrier(1s), doctest::Contains("has no store"), comm::InvalidArgument);
    auto g = a.split(0);
    REQUIRE(g);
    CHECK(g->rank() == a.rank());
    CHECK(g->flight_record().name == "adopted.g0");
    CHECK(sum_and_count(*g, 1.0f)[0] == static_cast<float>(a.size()));
    // The split's own communicator has no store either.
    CHECK_THROWS_AS(g->new_group({0}), comm::InvalidArgument);
  }
  NCCL_TEST_CUDA(cudaStreamDestroy(s));
  CHECK(ncclCommDestroy(raw) == ncclSuccess);
}

TEST_CASE("AnyCommunicator over NCCL: split, new_group, monitored_barrier, flight_record") {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  use_device(c);
  const int n = c.size();
  comm::AnyCommunicator any(std::move(c));
  CHECK(any.backend() == "nccl");
  auto g = any.split(0);
  REQUIRE(g);
  CHECK(g->size() == n);
  auto h = any.new_group({0});
  CHECK(static_cast<bool>(h) == (any.rank() == 0));
  any.monitored_barrier(10s);
  CHECK(any.flight_record().ops.size() == 2);  // split, monitored_barrier
}

TEST_CASE("monitored_barrier: ordered after the operations issued, recorded") {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  use_device(c);
  DeviceBuffer<float> d(std::vector<float>(1 << 20, 1.0f));
  c.all_reduce(d.span());
  c.monitored_barrier(20s, true);
  // It waited for the all_reduce on the host: already complete in the record.
  const auto f = c.flight_record();
  REQUIRE(f.ops.size() == 2);
  CHECK(f.ops[0].op == "all_reduce");
  CHECK(f.ops[0].state == comm::OpState::completed);
  CHECK(f.ops[1].op == "monitored_barrier");
  CHECK(f.ops[1].state == comm::OpState::completed);
}

TEST_CASE("monitored_barrier: names the rank that arrived late, on every rank; usable afterwards") {
  NCCL_REQUIRE_GPU();
  COMM_REQUIRE_RANKS(2);
  auto c = make_comm();
  use_device(c);
  const int r = c.rank(), late = c.size() - 1;
  c.monitored_barrier(20s, true);  // everyone on time
  if (r == late) std::this_thread::sleep_for(1500ms);
  try {
    c.monitored_barrier(500ms, true);
    FAIL("no Timeout on rank " << r);
  } catch (const comm::Timeout& e) {
    const std::string m = e.what();
    CHECK(contains(m, "rank " + std::to_string(late)));
    CHECK(contains(m, "did not arrive within 500 ms"));
    if (r == 0) CHECK(e.peer() == std::to_string(late));
  }
  const auto f = c.flight_record();
  REQUIRE(f.ops.size() == 2);
  CHECK(f.ops[1].state == comm::OpState::failed);
  comm::test::barrier();
  c.monitored_barrier(20s, true);
  CHECK(sum_and_count(c, 1.0f)[0] == static_cast<float>(c.size()));
}

TEST_CASE("flight record: operations in order with their arguments and states; ring; dump") {
  NCCL_REQUIRE_GPU();
  comm::backends::Nccl::Options o;
  o.flight_recorder_size = 4;
  auto c = make_comm(o);
  use_device(c);
  const int n = c.size();
  DeviceBuffer<float> a(std::vector<float>(4, 1.0f)), all(4 * static_cast<std::size_t>(n));
  c.all_reduce(a.span());
  c.broadcast(a.span(), 0);
  c.all_gather(a.cspan(), all.span());
  c.barrier();
  c.backend().synchronize();
  auto f = c.flight_record();
  CHECK(f.backend == "nccl");
  CHECK(f.rank == c.rank());
  CHECK(f.size == n);
  CHECK(f.name.empty());
  CHECK(f.capacity == 4);
  CHECK(f.total_ops == 4);
  REQUIRE(f.ops.size() == 4);
  CHECK(f.ops[0].seq == 0);
  CHECK(f.ops[0].op == "all_reduce");
  CHECK(f.ops[0].dtype == comm::Dtype::float32);
  CHECK(f.ops[0].count == 4);
  CHECK(f.ops[0].reduce == comm::ReduceOp::sum);
  CHECK(f.ops[1].op == "broadcast");
  CHECK(f.ops[1].root == 0);
  CHECK_FALSE(f.ops[1].reduce);
  CHECK(f.ops[2].op == "all_gather");
  CHECK(f.ops[2].count == 4);
  CHECK(f.ops[3].op == "barrier");
  CHECK_FALSE(f.ops[3].dtype);
  for (const auto& op : f.ops) {
    CAPTURE(op.seq);
    CHECK(op.state == comm::OpState::completed);
    CHECK(op.started.time_since_epoch().count() != 0);
    CHECK(op.queued <= op.started);
    CHECK(op.started <= op.ended);
  }
  // The ring keeps the last four.
  comm::Work w = c.all_reduce(a.span(), comm::async);
  w.synchronize();
  c.all_reduce(a.span(), comm::ReduceOp::max);
  c.backend().synchronize();
  f = c.flight_record();
  CHECK(f.total_ops == 6);
  REQUIRE(f.ops.size() == 4);
  CHECK(f.ops.front().seq == 2);
  CHECK(f.ops.back().seq == 5);
  CHECK(f.ops.back().reduce == comm::ReduceOp::max);
  // On demand, to a file.
  TempPath p("comm_nccl_flight");
  c.dump_flight_record(p.path);
  const auto text = read_file(p.path);
  CHECK(contains(text, "backend=nccl"));
  CHECK(contains(text, "rank=" + std::to_string(c.rank())));
  CHECK(contains(text, "#5 all_reduce("));
  CHECK(contains(text, "state=completed"));
  // Recording off.
  o.flight_recorder_size = 0;
  auto off = make_comm(o);
  off.all_reduce(a.span());
  off.backend().synchronize();
  CHECK(off.flight_record().capacity == 0);
  CHECK(off.flight_record().ops.empty());
}

TEST_CASE("desync check: matched operations pass; a mismatch throws DesyncError on every rank; usable") {
  NCCL_REQUIRE_GPU();
  comm::backends::Nccl::Options o;
  o.desync_check = true;
  auto c = make_comm(o);
  use_device(c);
  const int r = c.rank(), n = c.size();
  CHECK(c.backend().desync_check());
  DeviceBuffer<float> d(std::vector<float>(4, 1.0f));
  c.all_reduce(d.span());  // op #0: the fingerprints agree (the exchange runs at one rank too)
  CHECK(d.download() == std::vector<float>(4, static_cast<float>(n)));
  if (n >= 2) {
    try {
      if (r == 0)
        c.broadcast(d.span(), 0);
      else
        c.all_reduce(d.span());
      FAIL("no DesyncError on rank " << r);
    } catch (const comm::DesyncError& e) {
      const std::string m = e.what();
      CHECK(contains(m, "while rank 0 called broadcast(float"));
      CHECK(contains(m, "called all_reduce(float"));
      CHECK(contains(m, "at op #1"));
    }
    const auto f = c.flight_record();
    REQUIRE(f.ops.size() == 2);
    CHECK(f.ops[1].state == comm::OpState::failed);
    CHECK(contains(f.ops[1].error, "desync"));
    // Nothing of the operation was sent: the communicator goes on.
    d.upload(std::vector<float>(4, 2.0f));
    c.all_reduce(d.span());
    CHECK(d.download() == std::vector<float>(4, 2.0f * static_cast<float>(n)));
  }
  // Subgroups inherit the check.
  auto g = c.split(0);
  REQUIRE(g);
  CHECK(g->backend().desync_check());
  CHECK(sum_and_count(*g, 1.0f)[0] == static_cast<float>(n));
}

// ---- shrink (backends/nccl.hpp, "Fault tolerance"). A rank is left out only when it died, which
// a doctest case cannot survive: tests/nccl/peer_death_test.cpp runs ncclCommShrink itself. Here
// every rank is alive, so the members keep everyone and make the new communicator afresh
// (ncclCommShrink needs at least one rank to leave out), through each way the old one can end.

namespace {

/// The new communicator after a shrink that kept everyone: same ranks, working collectives.
void check_everyone_kept(Comm& s, int rank, int size) {
  CHECK(s.size() == size);
  CHECK(s.rank() == rank);
  CHECK(s.backend().made_by() == "ncclCommInitRankConfig");
  use_device(s);
  const auto got = sum_and_count(s, static_cast<float>(rank + 1));
  CHECK(got[0] == static_cast<float>(size * (size + 1) / 2));
  CHECK(got[1] == static_cast<float>(size));
}

/// Sleeps on the host for 300 ms, queued on a stream: what comes after it on the device waits.
void CUDART_CB slow_host_step(void*) { std::this_thread::sleep_for(300ms); }

}  // namespace

TEST_CASE("shrink: everyone alive keeps everyone; the old communicator stays failed") {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  use_device(c);
  const int r = c.rank(), n = c.size();
  CHECK(c.backend().made_by() == "ncclCommInitRankConfig");
  CHECK(sum_and_count(c, 1.0f)[0] == static_cast<float>(n));
  auto s = c.shrink();
  check_everyone_kept(s, r, n);
  DeviceBuffer<float> d(std::vector<float>{1.0f});
  CHECK_THROWS_AS(c.all_reduce(d.span()), comm::RemoteError);
  // The shrunk communicator shrinks again (its lineage goes on).
  auto s2 = s.shrink();
  check_everyone_kept(s2, r, n);
}

TEST_CASE("shrink after revoke: the watchdog ended the old communicator first; the new one works") {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  use_device(c);
  const int r = c.rank(), n = c.size();
  CHECK(sum_and_count(c, 1.0f)[0] == static_cast<float>(n));
  comm::test::barrier();  // every rank is done with the all_reduce before anyone revokes
  c.revoke("test");
  DeviceBuffer<float> d(std::vector<float>{1.0f});
  CHECK_THROWS_AS(c.all_reduce(d.span()), comm::RemoteError);
  auto s = c.shrink();
  check_everyone_kept(s, r, n);
}

TEST_CASE("shrink with an operation still queued: it fails with the shrink's error before shrink returns") {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  use_device(c);
  const int r = c.rank(), n = c.size();
  cudaStream_t st = nullptr;
  NCCL_TEST_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  DeviceBuffer<float> d(std::vector<float>{1.0f});
  comm::Work w;
  {
    comm::nccl::StreamGuard g(st);
    NCCL_TEST_CUDA(cudaLaunchHostFunc(st, slow_host_step, nullptr));
    w = c.all_reduce(d.span(), comm::async);  // ordered after the host step: still queued
  }
  CHECK_FALSE(w.is_completed());
  auto s = c.shrink();
  CHECK(w.is_completed());  // failed by the watchdog once the old communicator's kernels were stopped
  CHECK_THROWS_AS(w.synchronize(), comm::RemoteError);
  check_everyone_kept(s, r, n);
  NCCL_TEST_CUDA(cudaStreamSynchronize(st));
  NCCL_TEST_CUDA(cudaStreamDestroy(st));
}

// Last: it aborts communicators on purpose.
TEST_CASE("flight record: dumped automatically when the watchdog ends a stuck operation") {
  NCCL_REQUIRE_GPU();
  COMM_REQUIRE_RANKS(2);
  TempPath p("comm_nccl_autodump");
  comm::backends::Nccl::Options o;
  o.timeout = 8s;
  std::optional<Comm> c;
  {
    comm::test::ScopedEnv env("COMM_FLIGHT_RECORDER", p.path);  // read when the communicator is made
    c.emplace(make_comm(o));
  }
  use_device(*c);
  const int r = c->rank(), last = c->size() - 1;
  if (r != last) {  // the last rank never joins: the others' all_reduce cannot finish
    DeviceBuffer<float> d(std::vector<float>(4, 1.0f));
    c->all_reduce(d.span());
    CHECK_THROWS_AS(c->backend().synchronize(), comm::Timeout);
    const auto f = c->flight_record();
    REQUIRE(f.ops.size() == 1);
    CHECK(f.ops[0].state == comm::OpState::failed);
    const std::string file = p.path + "." + std::to_string(r);
    std::string text;
    for (int i = 0; i < 100 && !contains(text, "state=failed"); ++i) {  // written by the watchdog thread
      std::this_thread::sleep_for(20ms);
      text = read_file(file);
    }
    CHECK(contains(text, "backend=nccl"));
    CHECK(contains(text, "#0 all_reduce(float x4, sum) state=failed"));
    CHECK(contains(text, "did not complete within"));
  }
  comm::test::barrier();
  c.reset();
}
