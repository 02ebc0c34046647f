// Diagnostics: the flight recorder (order, states, ring size, dumps on demand, on a
// timeout and at destruction), the desync check (mismatched op, count, dtype, root, reduction,
// named on every rank; the communicator stays usable) and monitored_barrier (late and missing
// ranks named, on every rank).
#include "backend_test_util.hpp"

#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <comm/diagnostics.hpp>
#include <support/env_guard.hpp>

using namespace suite;
using namespace std::chrono_literals;

namespace {

using comm::test::ScopedEnv;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

/// A directory made by rank 0 and shared with every rank through the harness store.
std::string shared_tmpdir() {
  auto store = comm::test::fresh_store();
  if (comm::test::world().rank == 0) {
    char tmpl[] = "/tmp/comm-diag-XXXXXX";
    REQUIRE(::mkdtemp(tmpl) != nullptr);
    store->set("dir", std::string(tmpl));
  }
  const auto v = store->get("dir");
  return std::string(v.begin(), v.end());
}

Options with_desync(bool on = true) {
  Options o;
  o.desync_check = on;
  return o;
}

/// Runs `f`, which must throw comm::DesyncError; returns its message.
template <class F>
std::string desync_message(F&& f) {
  try {
    f();
  } catch (const comm::DesyncError& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("expected DesyncError, got: ", e.what());
    return {};
  }
  FAIL("expected DesyncError, nothing thrown");
  return {};
}

/// "ranks 0, 2, 3" for every rank but `except` (for size 2: "rank 0").
std::string others_than(int except, int n) {
  std::vector<int> v;
  for (int r = 0; r < n; ++r)
    if (r != except) v.push_back(r);
  std::string s = v.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s;
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Flight recorder

TEST_CASE("flight recorder: operations in issue order with their description and state") {
  auto c = make_comm();
  const int n = c.size();
  std::vector<float> f(4, 1.f);
  c.all_reduce(f, comm::ReduceOp::max);
  std::vector<std::int32_t> b(3, c.rank());
  auto w = c.broadcast(b, n - 1, comm::async);
  w.wait();
  const std::vector<double> in(2, 1.0);
  std::vector<double> out(c.rank() == 0 ? 2 * static_cast<std::size_t>(n) : 0);
  c.gather(in, out, 0);
  c.barrier();
  std::vector<comm::half> h(5);
  c.all_reduce(h, [](comm::half a, comm::half x) { return comm::half(float(a) + float(x)); });

  const auto fr = c.flight_record();
  CHECK(fr.backend == kBackendName);
  CHECK(fr.rank == c.rank());
  CHECK(fr.size == n);
  CHECK(fr.total_ops == 5);
  REQUIRE(fr.ops.size() == 5);
  for (std::size_t i = 0; i < fr.ops.size(); ++i) {
    const auto& r = fr.ops[i];
    INFO(comm::to_string(r));
    CHECK(r.seq == i);
    CHECK(r.state == comm::OpState::completed);
    CHECK(r.queued.time_since_epoch().count() != 0);
    CHECK(r.queued <= r.started);
    CHECK(r.started <= r.ended);
    CHECK(r.error.empty());
  }
  CHECK(comm::describe_call(fr.ops[0]) == "all_reduce(float x4, max)");
  CHECK(comm::describe_call(fr.ops[1]) == "broadcast(int32 x3, root " + std::to_string(n - 1) + ")");
  CHECK(comm::describe_call(fr.ops[2]) == "gather(double x2, root 0)");  // the input count on every rank
  CHECK(comm::describe_call(fr.ops[3]) == "barrier()");
  CHECK(comm::describe_call(fr.ops[4]) == "all_reduce(half x5, custom)");
  CHECK(fr.ops[0].dtype == comm::Dtype::float32);
  CHECK(fr.ops[0].reduce == comm::ReduceOp::max);
  CHECK(fr.ops[1].root == n - 1);
  CHECK(fr.ops[4].custom_reduce);
  CHECK_FALSE(fr.ops[4].reduce.has_value());
  const std::string text = comm::to_string(fr);
  CHECK(contains(text, "# comm flight record: backend=" + kBackendName + " rank=" + std::to_string(c.rank())));
  CHECK(contains(text, "#0 all_reduce(float x4, max) state=completed queued="));
  CHECK(contains(text, "#3 barrier() state=completed"));
}

// The recorder keeps raw TSC ticks where the kernel's clock is the TSC and converts them when the
// record is read: its times must still be the wall clock's, at the clock's rate.
TEST_CASE("flight recorder: times are the wall clock's, and a pause between operations shows at its length") {
  auto c = make_comm();
  std::vector<float> v(4, 1.f);
  const auto before = std::chrono::system_clock::now();
  c.all_reduce(v);
  std::this_thread::sleep_for(40ms);
  c.all_reduce(v);
  const auto after = std::chrono::system_clock::now();
  const auto fr = c.flight_record();
  REQUIRE(fr.ops.size() == 2);
  INFO(comm::to_string(fr));
  const auto slack = 2ms;
  CHECK(fr.ops[0].queued >= before - slack);
  CHECK(fr.ops[1].ended <= after + slack);
  CHECK(fr.ops[0].ended <= fr.ops[1].queued);
  const auto gap = fr.ops[1].queued - fr.ops[0].ended;  // this rank's sleep, nothing else
  CHECK(gap >= 40ms - slack);
  CHECK(gap <= (after - before) + slack);
}

TEST_CASE("flight recorder: queued and started states while an operation waits for a peer") {
  COMM_REQUIRE_RANKS(2);
  auto c = make_comm();
  auto store = comm::test::fresh_store();
  std::vector<float> a(16, 1.f), b(16, 1.f);
  if (c.rank() == 0) {
    // Rank 0 issues two async operations; the others hold back, so the first stays "started"
    // (waiting for them) and the second "queued" behind it.
    auto w1 = c.all_reduce(a, comm::async);
    auto w2 = c.all_reduce(b, comm::async);
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    comm::FlightRecord fr;
    do {
      fr = c.flight_record();
      if (fr.ops.size() == 2 && fr.ops[0].state == comm::OpState::started) break;
      std::this_thread::sleep_for(1ms);
    } while (std::chrono::steady_clock::now() < deadline);
    REQUIRE(fr.ops.size() == 2);
    CHECK(fr.ops[0].state == comm::OpState::started);
    CHECK(fr.ops[1].state == comm::OpState::queued);
    CHECK(fr.ops[1].started.time_since_epoch().count() == 0);
    CHECK(contains(comm::to_string(fr), "#1 all_reduce(float x16, sum) state=queued"));
    store->set("looked", "1");
    w1.wait();
    w2.wait();
  } else {
    store->wait({"looked"}, 30s);
    c.all_reduce(a);
    c.all_reduce(b);
  }
  const auto fr = c.flight_record();
  REQUIRE(fr.ops.size() == 2);
  CHECK(fr.ops[0].state == comm::OpState::completed);
  CHECK(fr.ops[1].state == comm::OpState::completed);
}

TEST_CASE("flight recorder: a ring of the last N; size 0 records nothing") {
  Options o;
  o.flight_recorder_size = 4;
  auto c = make_comm(o);
  std::vector<std::int64_t> v(1);
  for (int i = 0; i < 10; ++i) c.all_reduce(v);
  auto fr = c.flight_record();
  CHECK(fr.capacity == 4);
  CHECK(fr.total_ops == 10);
  REQUIRE(fr.ops.size() == 4);
  for (std::size_t i = 0; i < 4; ++i) CHECK(fr.ops[i].seq == 6 + i);

  // A capacity that is not a power of two wraps the same way.
  o.flight_recorder_size = 3;
  auto three = make_comm(o);
  for (int i = 0; i < 10; ++i) three.all_reduce(v);
  fr = three.flight_record();
  CHECK(fr.capacity == 3);
  CHECK(fr.total_ops == 10);
  REQUIRE(fr.ops.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(fr.ops[i].seq == 7 + i);
    CHECK(fr.ops[i].state == comm::OpState::completed);
  }

  o.flight_recorder_size = 0;
  auto off = make_comm(o);
  off.all_reduce(v);
  fr = off.flight_record();
  CHECK(fr.capacity == 0);
  CHECK(fr.total_ops == 0);
  CHECK(fr.ops.empty());
  CHECK(v[0] == 0);
}

TEST_CASE("flight recorder: an operation still in flight keeps its record when the ring wraps") {
  COMM_REQUIRE_RANKS(2);
  Options o;
  o.flight_recorder_size = 2;
  auto c = make_comm(o);
  auto store = comm::test::fresh_store();
  std::vector<std::vector<float>> bufs(6, std::vector<float>(16, 1.f));
  if (c.rank() == 0) {
    // Four async operations while the others hold back: #0 waits for them, #1 is queued, and #2
    // and #3 find the ring's two records held by those two.
    std::vector<comm::Work> works;
    for (int i = 0; i < 4; ++i) works.push_back(c.all_reduce(bufs[static_cast<std::size_t>(i)], comm::async));
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    comm::FlightRecord fr;
    do {
      fr = c.flight_record();
      if (!fr.ops.empty() && fr.ops[0].state == comm::OpState::started) break;
      std::this_thread::sleep_for(1ms);
    } while (std::chrono::steady_clock::now() < deadline);
    CHECK(fr.total_ops == 4);
    REQUIRE(fr.ops.size() == 2);
    CHECK(fr.ops[0].seq == 0);
    CHECK(fr.ops[0].state == comm::OpState::started);
    CHECK(fr.ops[1].seq == 1);
    CHECK(fr.ops[1].state == comm::OpState::queued);
    store->set("looked", "1");
    for (auto& w : works) w.wait();
  } else {
    store->wait({"looked"}, 30s);
    for (int i = 0; i < 4; ++i) c.all_reduce(bufs[static_cast<std::size_t>(i)]);
  }
  // Ended, they give their records up as before.
  c.all_reduce(bufs[4]);
  c.all_reduce(bufs[5]);
  const auto fr = c.flight_record();
  CHECK(fr.total_ops == 6);
  REQUIRE(fr.ops.size() == 2);
  CHECK(fr.ops[0].seq == 4);
  CHECK(fr.ops[1].seq == 5);
  CHECK(fr.ops[1].state == comm::OpState::completed);
}

TEST_CASE("flight recorder: records read while operations run are whole") {
  // Writers take no lock (one operation runs at a time); a snapshot reads each record under its
  // version count. Every record read here must be one operation's, not two half-written ones.
  Options o;
  o.flight_recorder_size = 8;
  auto c = make_comm(o);
  constexpr int kOps = 3000;
  std::vector<float> buf(8, 1.f);
  std::atomic<bool> done{false};
  std::atomic<long> seen{0};
  std::string bad;
  std::thread reader([&] {
    std::uint64_t last_total = 0;
    while (!done.load() && bad.empty()) {
      const auto fr = c.flight_record();
      if (fr.total_ops < last_total) bad = "total_ops went back";
      last_total = fr.total_ops;
      for (std::size_t i = 0; i < fr.ops.size() && bad.empty(); ++i) {
        const auto& r = fr.ops[i];
        if (i > 0 && r.seq <= fr.ops[i - 1].seq) bad = "records out of order";
        // Each round of kOps ends with one more all_reduce of one int64 (more rounds or not).
        const bool vote = r.seq % (kOps + 1) == kOps;
        const std::size_t count = vote ? 1 : 1 + r.seq % 7;
        if (r.op != "all_reduce" || r.count != count || r.dtype != (vote ? comm::Dtype::int64 : comm::Dtype::float32))
          bad = "#" + std::to_string(r.seq) + " reads as " + comm::to_string(r);
        if (r.state == comm::OpState::queued || r.state == comm::OpState::failed) bad = "state of " + comm::to_string(r);
        const bool started = r.started.time_since_epoch().count() != 0;
        const bool ended = r.ended.time_since_epoch().count() != 0;
        if (!started || ended != (r.state == comm::OpState::completed) || (ended && r.ended < r.started))
          bad = "times of " + comm::to_string(r);
        seen.fetch_add(1);
      }
      // A reader that never sleeps takes a core from the ranks' own threads: 4 ranks on 2 cores
      // then ran 3000 operations in 90 s instead of 3.
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  });
  // At least kOps, and on until the reader has checked a few hundred records (at one rank the
  // operations can end before its thread runs); the same number on every rank.
  std::uint64_t ops = 0;
  for (;;) {
    for (int i = 0; i < kOps; ++i, ++ops) c.all_reduce(std::span<float>(buf.data(), 1 + ops % 7));
    std::int64_t more = seen.load() < 400 && ops < 100 * kOps ? 1 : 0;
    c.all_reduce(std::span<std::int64_t>(&more, 1), comm::ReduceOp::max);
    ++ops;
    if (more == 0) break;
  }
  done.store(true);
  reader.join();
  CHECK_MESSAGE(bad.empty(), bad);
  CHECK(seen.load() > 0);
  const auto fr = c.flight_record();
  CHECK(fr.total_ops == ops);
  REQUIRE(fr.ops.size() == 8);
  CHECK(fr.ops.back().seq == ops - 1);
}

TEST_CASE("flight recorder: dump on demand, and automatically after a timeout and at destruction") {
  COMM_REQUIRE_RANKS(2);
  const std::string dir = shared_tmpdir();
  const std::string prefix = dir + "/fr";
  const int me = comm::test::world().rank;
  const int last = comm::test::world().size - 1;
  {
    ScopedEnv env("COMM_FLIGHT_RECORDER", prefix.c_str());
    Options o;
    o.timeout = 700ms;
    auto c = make_comm(o);
    std::vector<float> v(8, 1.f);
    c.all_reduce(v);
    c.dump_flight_record(dir + "/on-demand." + std::to_string(me));
    const std::string on_demand = read_file(dir + "/on-demand." + std::to_string(me));
    CHECK(contains(on_demand, "#0 all_reduce(float x8, sum) state=completed"));
    CHECK_THROWS_AS(c.dump_flight_record(dir + "/no/such/dir/x"), comm::BackendError);

    // The last rank skips the next all_reduce: the others time out (or see its connections close).
    if (me != last) {
      CHECK_THROWS_AS(c.all_reduce(v), comm::Error);
      const std::string dump = read_file(prefix + "." + std::to_string(me));
      INFO(dump);
      CHECK(contains(dump, "rank=" + std::to_string(me)));
      CHECK(contains(dump, "#0 all_reduce(float x8, sum) state=completed"));
      CHECK(contains(dump, "#1 all_reduce(float x8, sum) state=failed"));
      CHECK(contains(dump, "error=\"comm: all_reduce on rank " + std::to_string(me)));
      const auto fr = c.flight_record();
      REQUIRE(fr.ops.size() == 2);
      CHECK(fr.ops[1].state == comm::OpState::failed);
      CHECK(contains(fr.ops[1].error, "all_reduce"));
    }
    comm::test::barrier();
  }  // destruction writes the record (the last rank's too, with its one operation)
  const std::string at_exit = read_file(prefix + "." + std::to_string(me));
  CHECK(contains(at_exit, "#0 all_reduce(float x8, sum) state=completed"));
  if (me == last) CHECK(contains(at_exit, "ops=1 "));
  comm::test::barrier();
  if (me == 0) {
    const std::string cmd = "rm -rf '" + dir + "'";
    CHECK(std::system(cmd.c_str()) == 0);
  }
}

TEST_CASE("flight recorder: subgroups dump to their own file") {
  const std::string dir = shared_tmpdir();
  const std::string prefix = dir + "/fr";
  const int me = comm::test::world().rank;
  {
    ScopedEnv env("COMM_FLIGHT_RECORDER", prefix.c_str());
    auto c = make_comm();
    auto g = c.split(me % 2, me);
    REQUIRE(g.has_value());
    g->barrier();
  }
  CHECK(contains(read_file(prefix + "." + std::to_string(me)), "#0 split(int64 x2) state=completed"));
  const std::string group = read_file(prefix + "." + std::to_string(me) + ".g0");
  CHECK(contains(group, "comm=g0"));
  CHECK(contains(group, "#0 barrier() state=completed"));
  comm::test::barrier();
  if (me == 0) CHECK(std::system(("rm -rf '" + dir + "'").c_str()) == 0);
}

// ------------------------------------------------------------------------------------------------
// Desync check

TEST_CASE("desync check: off by default, on with COMM_DEBUG=DETAIL") {
  {
    ScopedEnv env("COMM_DEBUG", nullptr);
    CHECK_FALSE(Options{}.desync_check);
  }
  {
    ScopedEnv env("COMM_DEBUG", "DETAIL");
    CHECK(Options{}.desync_check);
  }
  {
    ScopedEnv env("COMM_DEBUG", "INFO");
    CHECK_FALSE(Options{}.desync_check);
  }
}

TEST_CASE("desync check: matching operations pass, including gather with different output sizes") {
  auto c = make_comm(with_desync());
  REQUIRE(c.backend().desync_check());
  const int n = c.size();
  std::vector<float> v(4, 1.f);
  c.all_reduce(v);
  CHECK(v[0] == static_cast<float>(n));
  const std::vector<std::int32_t> in{c.rank()};
  std::vector<std::int32_t> out(c.rank() == n - 1 ? static_cast<std::size_t>(n) : 0);  // empty off the root
  c.gather(in, out, n - 1);
  if (c.rank() == n - 1)
    for (int r = 0; r < n; ++r) CHECK(out[static_cast<std::size_t>(r)] == r);
  std::vector<std::int32_t> rs_in(static_cast<std::size_t>(n) * 2, 1), rs_out(2);
  c.reduce_scatter(rs_in, rs_out);
  CHECK(rs_out[0] == n);
  std::vector<comm::Work> ws;
  for (int i = 0; i < 8; ++i) ws.push_back(c.all_reduce(v, comm::async));
  for (auto& w : ws) w.wait();
  c.barrier();
  auto g = c.split(0, 0);  // inherits the check
  REQUIRE(g.has_value());
  CHECK(g->backend().desync_check());
  g->all_reduce(v);
}

TEST_CASE("desync check: a mismatch is named on every rank, and the communicator stays usable") {
  COMM_REQUIRE_RANKS(2);
  auto c = make_comm(with_desync());
  const int n = c.size();
  const int me = c.rank();
  const std::string rest = others_than(1, n);
  std::vector<float> f4(4, 1.f), f8(8, 1.f);
  std::vector<std::int32_t> i4(4, 1);
  std::vector<float> g_out(4 * static_cast<std::size_t>(n));

  c.barrier();  // op #0
  // op #1: operation and root.
  auto msg = desync_message([&] {
    if (me == 1)
      c.broadcast(f4, 0);
    else
      c.all_reduce(f4);
  });
  INFO(msg);
  CHECK(contains(msg, "comm: " + std::string(me == 1 ? "broadcast" : "all_reduce") + " on rank " + std::to_string(me)));
  CHECK(contains(msg, "rank 1 called broadcast(float x4, root 0) while " + rest +
                          " called all_reduce(float x4, sum) at op #1"));

  // op #2: count.
  msg = desync_message([&] { c.all_reduce(me == 1 ? f8 : f4); });
  CHECK(contains(msg, "rank 1 called all_reduce(float x8, sum) while " + rest + " called all_reduce(float x4, sum) at op #2"));

  // op #3: element type of the same size.
  msg = desync_message([&] {
    if (me == 1)
      c.all_reduce(i4);
    else
      c.all_reduce(f4);
  });
  CHECK(contains(msg, "rank 1 called all_reduce(int32 x4, sum) while " + rest + " called all_reduce(float x4, sum)"));

  // op #4: reduction.
  msg = desync_message([&] { c.all_reduce(f4, me == 1 ? comm::ReduceOp::max : comm::ReduceOp::sum); });
  CHECK(contains(msg, "rank 1 called all_reduce(float x4, max) while " + rest + " called all_reduce(float x4, sum) at op #4"));

  // op #5: root of a gather, async: Work::wait rethrows it.
  msg = desync_message([&] {
    const int root = me == 1 ? 1 : 0;
    std::vector<float> out(me == root ? g_out.size() : 0);
    auto w = c.gather(f4, out, root, comm::async);
    w.wait();
  });
  CHECK(contains(msg, "rank 1 called gather(float x4, root 1) while " + rest + " called gather(float x4, root 0) at op #5"));

  // Nothing of the mismatched operations was sent: the communicator works.
  std::vector<float> v(4, 1.f);
  c.all_reduce(v);
  CHECK(v[0] == static_cast<float>(n));
  const auto fr = c.flight_record();
  REQUIRE(fr.ops.size() == 7);
  CHECK(fr.ops[1].state == comm::OpState::failed);
  CHECK(contains(fr.ops[1].error, "desync"));
  CHECK(fr.ops[6].state == comm::OpState::completed);
}

TEST_CASE("desync check: three distinct calls are all named") {
  COMM_REQUIRE_RANKS(3);
  auto c = make_comm(with_desync());
  const int me = c.rank();
  std::vector<float> f(2, 1.f);
  const auto msg = desync_message([&] {
    if (me == 1)
      c.broadcast(f, 0);
    else if (me == 2)
      c.barrier();
    else
      c.all_reduce(f);
  });
  INFO(msg);
  CHECK(contains(msg, "rank 1 called broadcast(float x2, root 0), rank 2 called barrier() while " +
                          std::string(c.size() == 3 ? "rank 0" : "ranks 0, 3") +
                          " called all_reduce(float x2, sum) at op #0"));
  c.barrier();
}

// ------------------------------------------------------------------------------------------------
// monitored_barrier

TEST_CASE("monitored_barrier: everyone arrives") {
  auto c = make_comm();
  for (int i = 0; i < 5; ++i) c.monitored_barrier(10s, i % 2 == 0);
  c.monitored_barrier();
  CHECK_THROWS_AS(c.monitored_barrier(0ms), comm::InvalidArgument);
  const auto fr = c.flight_record();
  REQUIRE(fr.ops.size() == 6);
  CHECK(comm::describe_call(fr.ops[0]) == "monitored_barrier()");
  CHECK(fr.ops[5].state == comm::OpState::completed);
  std::vector<float> v(1, 1.f);
  c.all_reduce(v);  // the data path is untouched
  CHECK(v[0] == static_cast<float>(c.size()));
}

TEST_CASE("monitored_barrier: a late rank is named on every rank") {
  COMM_REQUIRE_RANKS(2);
  auto c = make_comm();
  const int n = c.size();
  const int me = c.rank();
  const int late = n - 1;
  const auto t0 = std::chrono::steady_clock::now();
  if (me == late) std::this_thread::sleep_for(1500ms);
  std::string msg;
  try {
    c.monitored_barrier(500ms);
  } catch (const comm::Timeout& e) {
    msg = e.what();
  }
  INFO(msg);
  const std::string named = "rank " + std::to_string(late) + " did not arrive within 500 ms";
  CHECK(contains(msg, named));
  if (me == 0) {
    CHECK(contains(msg, "comm: monitored_barrier on rank 0 (peer " + std::to_string(late) + ")"));
  } else {
    CHECK(contains(msg, "rank 0 reports that " + named));
  }
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  // The failure is recorded (not the data path's failure: collectives still work).
  const auto fr = c.flight_record();
  REQUIRE(fr.ops.size() == 1);
  CHECK(fr.ops[0].state == comm::OpState::failed);
  std::vector<float> v(1, 1.f);
  c.all_reduce(v);
  CHECK(v[0] == static_cast<float>(n));
}

TEST_CASE("monitored_barrier: ranks that never arrive; wait_all_ranks names them all") {
  COMM_REQUIRE_RANKS(3);
  auto c = make_comm();
  const int n = c.size();
  const int me = c.rank();
  // Ranks 1 and n-1 never call it.
  const bool absent = me == 1 || me == n - 1;
  const std::string both = "ranks 1, " + std::to_string(n - 1) + " did not arrive within 500 ms";
  if (!absent) {
    std::string msg;
    try {
      c.monitored_barrier(500ms, true);
    } catch (const comm::Timeout& e) {
      msg = e.what();
    }
    INFO(msg);
    CHECK(contains(msg, both));
  }
  comm::test::barrier();
  // Without wait_all_ranks: only the first missing rank.
  auto c2 = make_comm();
  if (!absent) {
    std::string msg;
    try {
      c2.monitored_barrier(500ms);
    } catch (const comm::Timeout& e) {
      msg = e.what();
    }
    INFO(msg);
    CHECK(contains(msg, "rank 1 did not arrive within 500 ms"));
    CHECK(contains(msg, "wait_all_ranks"));
    CHECK_FALSE(contains(msg, both));
  }
  comm::test::barrier();
}

TEST_CASE("monitored_barrier: rank 0 missing is named by the others") {
  COMM_REQUIRE_RANKS(2);
  auto c = make_comm();
  if (c.rank() != 0) {
    std::string msg, peer;
    try {
      c.monitored_barrier(200ms);
    } catch (const comm::Timeout& e) {
      msg = e.what();
      peer = e.peer();
    }
    INFO(msg);
    CHECK(contains(msg, "rank 0 did not complete monitored_barrier #0 within 400 ms"));
    CHECK(peer == "0");
  }
  comm::test::barrier();
}
