// The Gloo backend as a whole: many operations in flight, issue order between async and blocking
// calls, Work semantics, destruction with pending work, several communicators at once, adopt(),
// from_env(), several network devices (GLOO_SOCKET_IFNAME), timeouts.
#include "backend_test_util.hpp"

#include <chrono>
#include <cstdlib>
#include <memory>
#include <optional>
#include <span>
#include <thread>
#include <support/env_guard.hpp>

using namespace suite;
using namespace std::chrono_literals;

namespace {

/// Sets an environment variable for the current scope.
using comm::test::ScopedEnv;

// Under TSan, where gloo's event loop runs many times slower, the rank that should see a peer's
// mismatched header could end first with "connection closed" (RemoteError) from the peer that saw
// the mismatch and failed (2026-12-02 VM, at 50fc972 and 8ca13ab alike; a known issue in
// docs/TESTING.md). Since the rank that sees it announces the desync before it closes, the
// RemoteError names it; should that announcement lose its race (it has 200 ms), the sanitizer run,
// which is there for races and memory errors, reports the case instead of failing on it; the
// regular suite keeps the strict check.
#if defined(__SANITIZE_THREAD__)
constexpr bool kSlowLoop = true;
#else
constexpr bool kSlowLoop = false;
#endif

}  // namespace

TEST_CASE("async: many operations of every kind in flight, completed in issue order") {
  auto c = make_comm();
  const int n = c.size();
  const auto un = static_cast<std::size_t>(n);
  const auto r = static_cast<std::size_t>(c.rank());
  constexpr int kRounds = 16;
  std::vector<std::vector<float>> sums(kRounds, std::vector<float>(257));
  std::vector<std::vector<std::int32_t>> rs_in(kRounds, std::vector<std::int32_t>(un * 31)),
      rs_out(kRounds, std::vector<std::int32_t>(31));
  std::vector<std::vector<double>> ag_out(kRounds, std::vector<double>(un * 3));
  // One input per round: an async operation's buffers stay untouched until it completes.
  std::vector<std::vector<double>> ag_in(kRounds, std::vector<double>(3));
  std::vector<std::vector<std::uint8_t>> bc(kRounds, std::vector<std::uint8_t>(100));
  std::vector<comm::Work> works;
  for (int k = 0; k < kRounds; ++k) {
    for (std::size_t i = 0; i < sums[k].size(); ++i) sums[k][i] = static_cast<float>(c.rank() + k);
    for (std::size_t i = 0; i < rs_in[k].size(); ++i) rs_in[k][i] = static_cast<std::int32_t>(i) * (c.rank() + 1);
    for (std::size_t i = 0; i < 3; ++i) ag_in[k][i] = c.rank() * 100.0 + static_cast<double>(i);
    for (auto& x : bc[k]) x = static_cast<std::uint8_t>(c.rank() == k % n ? k : 255);
    works.push_back(c.all_reduce(sums[k], comm::async));
    works.push_back(c.reduce_scatter(rs_in[k], rs_out[k], comm::op::sum, comm::async));
    works.push_back(c.all_gather(ag_in[k], ag_out[k], comm::async));
    works.push_back(c.broadcast(bc[k], k % n, comm::async));
    works.push_back(c.barrier(comm::async));
  }
  // A blocking call issued now runs after all of the above.
  std::vector<std::int64_t> tail{1};
  c.all_reduce(tail);
  CHECK(tail[0] == n);
  for (auto& w : works) CHECK(w.is_completed());  // issue order: everything before `tail` is done
  for (auto& w : works) w.wait();
  const float rank_sum = static_cast<float>(n * (n - 1) / 2);
  for (int k = 0; k < kRounds; ++k) {
    CHECK(sums[k][0] == rank_sum + static_cast<float>(n * k));
    CHECK(sums[k][256] == rank_sum + static_cast<float>(n * k));
    for (std::size_t i = 0; i < 31; ++i)
      CHECK(rs_out[k][i] == static_cast<std::int32_t>(r * 31 + i) * (n * (n + 1) / 2));
    for (int q = 0; q < n; ++q) CHECK(ag_out[k][static_cast<std::size_t>(q) * 3 + 2] == q * 100.0 + 2);
    CHECK(bc[k][99] == k);
  }
}

TEST_CASE("async: Work::wait_for, is_completed, move") {
  auto c = make_comm();
  std::vector<float> v(1000, 1.0f);
  comm::Work w = c.all_reduce(v, comm::async);
  comm::Work moved = std::move(w);
  CHECK(moved.wait_for(30s));
  CHECK(moved.is_completed());
  CHECK_FALSE(moved.failed());
  moved.wait();  // waiting twice is fine
  CHECK(v[999] == static_cast<float>(c.size()));
  comm::Work empty;
  CHECK(empty.is_completed());
  empty.wait();
}

TEST_CASE("async: the worker thread retires when idle and restarts on the next async call") {
  auto c = make_comm();
  std::vector<std::int32_t> v(10, 1);
  c.all_reduce(v, comm::async).wait();
  std::this_thread::sleep_for(2500ms);  // longer than the worker's idle limit (2 s)
  std::fill(v.begin(), v.end(), 1);
  auto w = c.all_reduce(v, comm::async);
  CHECK(w.wait_for(30s));
  CHECK(v[9] == c.size());
}

TEST_CASE("lifecycle: destroying a communicator with queued work completes that work") {
  const int n = comm::test::world().size;
  std::vector<std::vector<float>> bufs(8, std::vector<float>(4096, 1.0f));
  std::vector<comm::Work> works;
  {
    auto c = make_comm();
    for (auto& b : bufs) works.push_back(c.all_reduce(b, comm::async));
  }  // destroyed with work possibly still queued
  for (auto& w : works) {
    CHECK(w.is_completed());
    w.wait();
  }
  for (auto& b : bufs) CHECK(b[4095] == static_cast<float>(n));
}

TEST_CASE("lifecycle: two communicators used at the same time from two threads") {
  auto a = make_comm();
  auto b = make_comm();
  const int n = a.size();
  std::vector<std::int32_t> x(1000, 1), y(1000, 2);
  std::thread t([&] {
    for (int i = 0; i < 20; ++i) {
      std::fill(y.begin(), y.end(), 2);
      b.all_reduce(y);
    }
  });
  for (int i = 0; i < 20; ++i) {
    std::fill(x.begin(), x.end(), 1);
    a.all_reduce(x);
  }
  t.join();
  CHECK(x[999] == n);
  CHECK(y[999] == 2 * n);
}

TEST_CASE("construction: adopt an existing gloo context") {
  auto c = make_comm();
  auto adopted = Comm::adopt(c.backend().context());
  CHECK(adopted.rank() == c.rank());
  CHECK(adopted.size() == c.size());
  std::vector<double> v{1.5};
  adopted.all_reduce(v);
  CHECK(v[0] == 1.5 * c.size());
}

TEST_CASE("construction: from_env (env:// rendezvous)") {
  // The harness already serves a store on MASTER_PORT: point env:// at another free port.
  ScopedEnv port("MASTER_PORT", std::to_string(comm::test::shared_free_port()));
  ScopedEnv own_store("COMM_AGENT_STORE", nullptr);  // rank 0 hosts this one (comm-run hosts the harness's)
  auto c = Comm::from_env();
  CHECK(c.rank() == comm::test::world().rank);
  CHECK(c.size() == comm::test::world().size);
  std::int32_t r = c.rank();
  std::vector<std::int32_t> all(static_cast<std::size_t>(c.size()));
  c.all_gather(std::span<const std::int32_t>(&r, 1), all);
  for (int q = 0; q < c.size(); ++q) CHECK(all[static_cast<std::size_t>(q)] == q);
}

TEST_CASE("devices: GLOO_SOCKET_IFNAME=lo,lo gives two devices used round-robin") {
  ScopedEnv ifname("GLOO_SOCKET_IFNAME", "lo, lo");
  auto c = make_comm();
  CHECK(c.backend().num_devices() == 2);
  for (int i = 0; i < 6; ++i) {
    std::vector<std::int64_t> v(100, i);
    if (i % 2 == 0)
      c.all_reduce(v);
    else
      c.all_reduce(v, comm::async).wait();
    CHECK(v[99] == static_cast<std::int64_t>(i) * c.size());
  }
}

TEST_CASE("devices: Options::hostname and a bad GLOO_SOCKET_IFNAME") {
  comm::backends::Gloo::Options o;
  o.hostname = "127.0.0.1";
  {
    auto c = make_comm(o);
    std::vector<float> v{1.0f};
    c.all_reduce(v);
    CHECK(v[0] == static_cast<float>(c.size()));
  }
  ScopedEnv ifname("GLOO_SOCKET_IFNAME", "comm-bogus0");
  bool thrown = false;
  try {
    (void)make_comm();
  } catch (const comm::InvalidArgument& e) {
    thrown = true;
    const std::string msg = e.what();
    INFO(msg);
    CHECK(msg.find("comm-bogus0") != std::string::npos);
    CHECK(msg.find("GLOO_SOCKET_IFNAME") != std::string::npos);
  }
  CHECK(thrown);
}

TEST_CASE("deadlines: create() with a rank that never arrives ends with comm::Timeout") {
  // Every rank alone on its own in-process store, claiming to be rank 0 of 2.
  comm::backends::Gloo::Options o;
  o.timeout = 300ms;
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_AS((void)Comm::create(std::make_shared<comm::HashStore>(), 0, 2, o), comm::Timeout);
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
}

TEST_CASE("deadlines: an operation a peer never joins ends with comm::Timeout") {
  COMM_REQUIRE_RANKS(2);
  comm::backends::Gloo::Options o;
  o.timeout = 700ms;
  auto c = make_comm(o);
  if (c.rank() == 0) {
    std::vector<float> v(10, 1.0f);
    const auto t0 = std::chrono::steady_clock::now();
    bool timed_out = false;
    try {
      c.all_reduce(v);  // nobody else calls it
    } catch (const comm::Timeout& e) {
      timed_out = true;
      const std::string msg = e.what();
      INFO(msg);
      CHECK(msg.find("all_reduce") != std::string::npos);
      CHECK(msg.find("on rank 0") != std::string::npos);
    }
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
    CHECK(timed_out);
    CHECK(ms >= 600ms);
    CHECK(ms < 5s);
    MESSAGE("all_reduce timed out after ", ms.count(), " ms (timeout 700 ms)");
    // The communicator is now unusable: later operations fail at once with the first cause.
    const auto t1 = std::chrono::steady_clock::now();
    CHECK_THROWS_AS(c.barrier(), comm::Timeout);
    CHECK_THROWS_AS(c.all_reduce(v, comm::async).wait(), comm::Timeout);
    CHECK(std::chrono::steady_clock::now() - t1 < 500ms);
  }
  comm::test::barrier();  // the others stay idle until rank 0 is done
}

TEST_CASE("point-to-point: a mismatched message's payload never lands in the receive buffer") {
  // The payload's receive is posted with its header's (engine.hpp, perform_p2p) on a slot derived
  // from the header, so a peer that disagrees sends it where nothing waits.
  COMM_REQUIRE_RANKS(2);
  struct Case {
    const char* what;
    int send_tag, recv_tag;
    std::size_t send_count, recv_count;
  };
  for (const Case k : {Case{"tag", 1, 2, 64, 64}, Case{"shorter", 3, 3, 32, 64}, Case{"longer", 3, 3, 64, 32}}) {
    INFO("mismatched ", k.what);
    comm::backends::Gloo::Options o;
    o.timeout = 5s;
    auto c = make_comm(o);
    if (c.rank() == 0) {
      std::vector<float> sent(64, 2.0f);
      try {
        c.send(std::span<const float>(sent).first(k.send_count), 1, k.send_tag);
      } catch (const comm::Error& e) {
        MESSAGE("rank 0's send ended with: ", std::string(e.what()));
      }
    } else if (c.rank() == 1) {
      std::vector<float> buf(64, 1.0f);
      CHECK_THROWS_AS(c.recv(std::span<float>(buf).first(k.recv_count), 0, k.recv_tag), comm::DesyncError);
      std::this_thread::sleep_for(50ms);  // a payload that was on its way would be in by now
      CHECK(std::count(buf.begin(), buf.end(), 1.0f) == 64);
    }
  }
}

TEST_CASE("large all_reduce, reduce_scatter, broadcast, gather, all_gather: a mismatched count is a DesyncError on the receiver, no byte lands") {
  // Above the frames' limit these check header frames instead of exchanging fingerprints first
  // (engine.hpp, headed()): the rank that receives from the mismatched one throws DesyncError,
  // the others end with an error or complete with data from ranks that agree with them.
  COMM_REQUIRE_RANKS(2);
  const std::size_t count = std::size_t{1} << 18;  // 1 MiB of floats: above the frames' 256 KiB
  for (const std::string op : {"all_reduce", "reduce_scatter", "broadcast", "gather", "all_gather"}) {
    INFO(op);
    comm::backends::Gloo::Options o;
    o.timeout = 5s;
    auto c = make_comm(o);
    const auto n = static_cast<std::size_t>(c.size());
    const std::size_t mine = c.rank() == 1 ? 2 * count : count;  // rank 1 disagrees
    std::vector<float> in(mine, static_cast<float>(c.rank() + 2));
    std::vector<float> out(n * mine, -1.0f);
    const auto t0 = std::chrono::steady_clock::now();
    bool desync = false, timeout = false, failed = false;
    std::string what;
    try {
      if (op == "broadcast")
        c.broadcast(std::span<float>(out).first(mine), 0);
      else if (op == "gather")
        c.gather(std::span<const float>(in), c.rank() == 0 ? std::span<float>(out) : std::span<float>(), 0);
      else if (op == "all_gather")
        c.all_gather(std::span<const float>(in), std::span<float>(out));
      else if (op == "all_reduce")
        c.all_reduce(std::span<float>(in));  // in place: nothing of a peer's may be added in
      else  // reduce_scatter of blocks of `mine` (above the frames' limit at any size)
        c.reduce_scatter(std::span<const float>(std::vector<float>(n * mine, 1.0f)), std::span<float>(out).first(mine));
    } catch (const comm::DesyncError& e) {
      desync = failed = true;
      CHECK(std::string(e.what()).find(" called ") != std::string::npos);
    } catch (const comm::Timeout&) {
      timeout = failed = true;
    } catch (const comm::Error& e) {
      failed = true;
      what = e.what();
      MESSAGE("rank ", c.rank(), " ended with: ", what);
    }
    // Its own DesyncError, or a RemoteError whose cause is the DesyncError of the rank that saw
    // the mismatch: that rank announces it on the liveness channel before it closes its
    // connections, so a rank woken by the close, or by the announcement before it looked at the
    // header it was waiting for, names the disagreement.
    const bool learnt = desync || what.find("desync: rank ") != std::string::npos;
    CHECK_FALSE(timeout);
    CHECK(std::chrono::steady_clock::now() - t0 < 3s);
    std::this_thread::sleep_for(50ms);  // a payload that was on its way would be in by now
    const auto untouched = [&](std::size_t from, std::size_t to) {
      return std::count(out.begin() + static_cast<std::ptrdiff_t>(from), out.begin() + static_cast<std::ptrdiff_t>(to),
                        -1.0f) == static_cast<std::ptrdiff_t>(to - from);
    };
    if (op == "broadcast" && c.rank() == 1) {
      // Rank 1's parent is the root (chain and tree): the only rank that hears from rank 1's
      // disagreement, it throws DesyncError; nothing of the root's lands.
      CHECK(desync);
      CHECK(untouched(0, out.size()));
    } else if (op == "gather" && c.rank() == 0) {
      CHECK(desync);                      // the root hears from rank 1 first
      CHECK(untouched(count, 2 * count));  // rank 1's block of the root's output
    } else if (op == "all_gather" && c.rank() == 1) {
      // Everything rank 1 receives comes from rank 0, which disagrees with it.
      CHECK(failed);
      CHECK(untouched(0, mine));
      CHECK(untouched(2 * mine, out.size()));
    } else if (op == "all_reduce" || op == "reduce_scatter") {
      // Every rank waits on a chain of peers that ends at a rank which saw the disagreement, so
      // every rank fails, and learns why: a rank whose own peers agree with it (rank 0 of a
      // 3-rank ring) only from the announcement; before it, a receive libgloo had begun reading
      // from the rank that saw the mismatch waited for its deadline (CI, 2026-12-03). Rank 1
      // hears from rank 0 (its left neighbour in the ring; its last peer in recursive halving)
      // before anything of rank 0's is added in: a DesyncError of its own, or, when the
      // announcement came first, the other side of the same disagreement.
      CHECK(failed);
      if (kSlowLoop && !learnt)
        MESSAGE("TSan: rank ", c.rank(), " did not learn of the desync (see kSlowLoop): ", what);
      else
        CHECK(learnt);
      if (c.rank() == 1) {
        if (op == "all_reduce")
          CHECK(std::count(in.begin(), in.end(), 3.0f) == static_cast<std::ptrdiff_t>(in.size()));
        else
          CHECK(untouched(0, mine));
      }
    }
  }
}

TEST_CASE("large all_reduce, reduce_scatter: ranks whose settings pick different algorithms get a DesyncError") {
  // The pick is part of a headed operation's fingerprint (engine.hpp): without it, rank 0's
  // recursive doubling (or ring) and rank 1's ring (or halving) would send on slots the other
  // never receives on, and both would wait for their timeout.
  COMM_REQUIRE_RANKS(2);
  const std::size_t count = std::size_t{1} << 18;  // 1 MiB of floats: above the frames' limit
  const auto n = static_cast<std::size_t>(comm::test::world().size);
  for (const std::string op : {"all_reduce", "reduce_scatter"}) {
    INFO(op);
    comm::backends::Gloo::Options o;
    o.timeout = 5s;
    std::optional<ScopedEnv> env;  // read when the communicator is made
    if (comm::test::world().rank == 0) {
      if (op == "all_reduce")
        env.emplace("COMM_GLOO_ALLREDUCE_SMALL", "4194304");  // recursive doubling up to 4 MiB
      else
        env.emplace("COMM_GLOO_RS_HALVING_MAX", "0");  // never halving
    }
    auto c = make_comm(o);
    env.reset();
    std::vector<float> v(n * count, 1.0f), out(count);
    const auto t0 = std::chrono::steady_clock::now();
    std::string what;
    bool timeout = false, failed = false;
    try {
      if (op == "all_reduce")
        c.all_reduce(std::span<float>(v).first(count));
      else  // 512 KiB per rank: halving by default at 2 ranks (input up to 1 MiB)
        c.reduce_scatter(std::span<const float>(v).first(n * count / 2), std::span<float>(out).first(count / 2));
    } catch (const comm::Timeout&) {
      timeout = failed = true;
    } catch (const comm::Error& e) {  // DesyncError, or RemoteError carrying one
      failed = true;
      what = e.what();
    }
    CHECK_FALSE(timeout);
    CHECK(std::chrono::steady_clock::now() - t0 < 3s);
    // At 2 ranks each hears from the other (ring: its neighbour; doubling and halving: its
    // partner). Above, the ranks next to one of the other pick throw DesyncError and the rest
    // hear of it: RemoteError carrying the DesyncError that a rank announced before closing its
    // connections (also what a rank gets that the announcement reached before it looked at the
    // header it waited for). Above 2 ranks reduce_scatter is the ring whatever the setting (at 3
    // ranks halving needs a power of two; at 4 the 2 MiB input is above its limit): nobody
    // disagrees.
    if (op == "reduce_scatter" && n > 2) {
      CHECK_FALSE(failed);
    } else {
      CHECK(failed);
      const bool named = what.find("chose different algorithms") != std::string::npos;
      if (kSlowLoop && !named)
        MESSAGE("TSan: this rank did not learn of the desync (see kSlowLoop): ", what);
      else
        CHECK(named);
    }
  }
}

TEST_CASE("a large headed operation against a large reduce: every rank ends at once") {
  // A reduce rank (a large reduce exchanges fingerprints first) that gets a header frame in its
  // fingerprint exchange fails the communicator at once (engine.hpp, exchange_fingerprints): a
  // broadcast root, whose sends nobody will ever receive, and the ranks waiting on either end
  // with RemoteError, not at their timeout.
  COMM_REQUIRE_RANKS(2);
  for (const std::string op : {"broadcast", "gather", "all_gather", "all_reduce", "reduce_scatter"}) {
    INFO(op);
    comm::backends::Gloo::Options o;
    o.timeout = 5s;
    auto c = make_comm(o);
    const std::size_t count = std::size_t{1} << 18;  // 1 MiB of floats: above the frames' limit
    std::vector<float> v(count, 1.0f), out(static_cast<std::size_t>(c.size()) * count);
    const auto t0 = std::chrono::steady_clock::now();
    bool timeout = false, failed = false;
    try {
      if (c.rank() != 0)
        c.reduce(std::span<const float>(v), c.rank() == 1 ? std::span<float>(out).first(count) : std::span<float>(), 1);
      else if (op == "broadcast")
        c.broadcast(std::span<float>(v), 0);
      else if (op == "gather")
        c.gather(std::span<const float>(v), std::span<float>(out), 0);
      else if (op == "all_gather")
        c.all_gather(std::span<const float>(v), std::span<float>(out));
      else if (op == "all_reduce")
        c.all_reduce(std::span<float>(v));
      else
        c.reduce_scatter(std::span<const float>(out), std::span<float>(v));
    } catch (const comm::Timeout&) {
      timeout = failed = true;
    } catch (const comm::Error&) {
      failed = true;
    }
    CHECK(failed);
    CHECK_FALSE(timeout);
    CHECK(std::chrono::steady_clock::now() - t0 < 3s);
    // Which ranks see a header (DesyncError) and which hear of the failure first (RemoteError)
    // is a race between the closes; never a Timeout.
  }
}
