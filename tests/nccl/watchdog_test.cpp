// The watchdog without a GPU: fake operations and a fake engine drive completion in issue order,
// deadlines, asynchronous errors, the abort, and the errors pending and later Work report.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <comm/backends/nccl.hpp>
#include <support/multirank.hpp>

using namespace std::chrono_literals;
namespace dn = comm::detail::nccl;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

class FakeOp final : public dn::TrackedOp {
 public:
  FakeOp(std::string op, std::uint64_t seq, std::chrono::milliseconds timeout = 10s)
      : dn::TrackedOp(std::move(op), 3, timeout, seq) {}
  dn::Progress query(dn::Fault& f) noexcept override {
    ++queries;
    const int s = state.load();
    if (s == 1) return dn::Progress::done;
    if (s == 2) {
      f.kind = dn::Fault::Kind::backend;
      f.engine = dn::NativeEngine::cuda;
      f.code = 700;
      f.detail = "the operation failed on the device: illegal address";
      return dn::Progress::failed;
    }
    return dn::Progress::running;
  }
  std::atomic<int> state{0};  // 0 running, 1 done, 2 failed
  std::atomic<int> queries{0};
};

class FakeTarget final : public dn::WatchTarget {
 public:
  std::optional<dn::Fault> async_error() noexcept override {
    std::lock_guard lock(mu);
    ++polls;
    return fault;
  }
  void abort() noexcept override {
    aborts.fetch_add(1);
    abort_thread = std::this_thread::get_id();
  }
  std::mutex mu;
  std::optional<dn::Fault> fault;
  int polls = 0;
  std::atomic<int> aborts{0};
  std::thread::id abort_thread;
};

dn::WatchdogTiming fast() {
  dn::WatchdogTiming t;
  t.async_poll = 5ms;
  t.min_backoff = std::chrono::microseconds(50);
  t.max_backoff = std::chrono::microseconds(500);
  return t;
}

std::shared_ptr<FakeOp> op(const char* name, std::uint64_t seq, std::chrono::milliseconds timeout = 10s) {
  return std::make_shared<FakeOp>(name, seq, timeout);
}

template <class E>
std::string wait_error(comm::Work& w) {
  try {
    w.wait();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("unexpected error: " << e.what());
  }
  FAIL("no error");
  return {};
}

}  // namespace

TEST_CASE("watchdog: operations complete in issue order") {
  FakeTarget t;
  dn::Watchdog wd(t, 3, fast());
  wd.start();
  auto a = op("all_reduce", 1), b = op("broadcast", 2);
  comm::Work wa(a), wb(b);
  const auto deadline = dn::Clock::now() + 10s;
  wd.track(a, deadline);
  wd.track(b, deadline);
  b->state = 1;  // the later one is done first: it still completes after the earlier one
  std::this_thread::sleep_for(30ms);
  CHECK_FALSE(wb.is_completed());
  CHECK(wd.pending() == 2);
  a->state = 1;
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(wa.wait_for(2s));
  CHECK(wb.wait_for(2s));
  CHECK(std::chrono::steady_clock::now() - t0 < 500ms);
  CHECK(wd.wait_idle(dn::Clock::now() + 1s));
  CHECK(wd.pending() == 0);
  CHECK_FALSE(wd.failed());
  CHECK(t.aborts == 0);
  wd.stop();
  CHECK(t.polls > 0);
}

TEST_CASE("watchdog: a deadline fails the operation with Timeout, aborts once, fails the rest") {
  FakeTarget t;
  dn::Watchdog wd(t, 3, fast());
  wd.start();
  auto a = op("all_reduce", 7, 150ms), b = op("all_gather", 8), c = op("barrier", 9);
  comm::Work wa(a), wb(b), wc(c);
  const auto now = dn::Clock::now();
  wd.track(a, now + 100ms);  // before Work::wait's own limit (150 ms from its start), so the watchdog speaks
  wd.track(b, now + 10s);
  wd.track(c, now + 10s);
  const auto t0 = std::chrono::steady_clock::now();
  const auto m = wait_error<comm::Timeout>(wa);
  const auto took = std::chrono::steady_clock::now() - t0;
  CHECK(took >= 80ms);
  CHECK(took < 2s);
  CHECK(contains(m, "comm: all_reduce on rank 3: operation #7 did not complete within 150 ms"));
  CHECK(contains(m, "the watchdog aborted the communicator"));
  const auto mb = wait_error<comm::Timeout>(wb);
  CHECK(contains(mb, "comm: all_gather on rank 3: aborted after a failure of the communicator: comm: all_reduce"));
  CHECK_THROWS_AS(wc.wait(), comm::Timeout);
  CHECK(t.aborts == 1);
  CHECK(t.abort_thread != std::this_thread::get_id());  // aborted on the watchdog thread
  CHECK(wd.failed());
  // Later operations fail at once, quoting the first cause.
  auto d = op("broadcast", 10);
  comm::Work wdone(d);
  wd.track(d, dn::Clock::now() + 10s);
  CHECK(wdone.is_completed());
  const auto md = wait_error<comm::Timeout>(wdone);
  CHECK(contains(md, "comm: broadcast on rank 3: not run: the communicator failed earlier: comm: all_reduce"));
  wd.stop();
  CHECK(t.aborts == 1);
}

TEST_CASE("watchdog: an asynchronous NCCL error fails pending work with RemoteError and its code") {
  FakeTarget t;
  dn::Watchdog wd(t, 3, fast());
  auto a = op("reduce_scatter", 1), b = op("gather", 2);
  comm::Work wa(a), wb(b);
  wd.track(a, dn::Clock::now() + 10s);
  wd.track(b, dn::Clock::now() + 10s);
  {
    std::lock_guard lock(t.mu);
    dn::Fault f;
    f.kind = dn::Fault::Kind::remote;
    f.code = static_cast<int>(ncclRemoteError);
    f.detail = "NCCL reported an asynchronous error: remote process exited";
    t.fault = f;
  }
  wd.start();
  try {
    wa.wait();
    FAIL("no error");
  } catch (const comm::RemoteError& e) {
    CHECK(contains(e.what(), "comm: reduce_scatter on rank 3: NCCL reported an asynchronous error"));
    REQUIRE(comm::nccl::nccl_result_of(e).has_value());
    CHECK(*comm::nccl::nccl_result_of(e) == ncclRemoteError);
  }
  CHECK(contains(wait_error<comm::RemoteError>(wb), "comm: gather on rank 3: aborted after a failure"));
  CHECK(t.aborts == 1);
  wd.stop();
}

TEST_CASE("watchdog: an asynchronous error while idle is the communicator's failure") {
  FakeTarget t;
  dn::Watchdog wd(t, 0, fast());
  {
    std::lock_guard lock(t.mu);
    dn::Fault f;
    f.kind = dn::Fault::Kind::backend;
    f.code = static_cast<int>(ncclSystemError);
    f.detail = "socket closed";
    t.fault = f;
  }
  wd.start();
  for (int i = 0; i < 200 && !wd.failed(); ++i) std::this_thread::sleep_for(5ms);
  REQUIRE(wd.failed());
  const auto m = dn::what_of(wd.failure());
  CHECK(contains(m, "comm: nccl.watchdog on rank 0: socket closed"));
  CHECK_THROWS_AS(std::rethrow_exception(wd.failure()), comm::BackendError);
  wd.stop();
  CHECK(t.aborts == 1);
}

TEST_CASE("watchdog: a device failure of an operation is a BackendError with the CUDA code") {
  FakeTarget t;
  dn::Watchdog wd(t, 3, fast());
  wd.start();
  auto a = op("all_reduce", 1);
  comm::Work wa(a);
  wd.track(a, dn::Clock::now() + 10s);
  a->state = 2;
  try {
    wa.wait();
    FAIL("no error");
  } catch (const comm::BackendError& e) {
    CHECK(contains(e.what(), "comm: all_reduce on rank 3: the operation failed on the device"));
    REQUIRE(comm::nccl::cuda_error_of(e).has_value());
    CHECK(static_cast<int>(*comm::nccl::cuda_error_of(e)) == 700);
  }
  wd.stop();
  CHECK(t.aborts == 1);
}

TEST_CASE("watchdog: a failure reported by the issuing thread is handled on the watchdog thread") {
  FakeTarget t;
  dn::Watchdog wd(t, 1, fast());
  wd.start();
  auto a = op("broadcast", 1);
  comm::Work wa(a);
  wd.track(a, dn::Clock::now() + 10s);
  wd.fail(std::make_exception_ptr(comm::Timeout("all_gather", 1, "NCCL did not finish enqueuing")));
  wd.fail(std::make_exception_ptr(comm::RemoteError("x", 1, "second")));  // the first cause wins
  const auto m = wait_error<comm::Timeout>(wa);
  CHECK(contains(m, "comm: broadcast on rank 1: aborted after a failure of the communicator: comm: all_gather"));
  CHECK(contains(dn::what_of(wd.failure()), "NCCL did not finish enqueuing"));
  CHECK(wd.wait_idle(dn::Clock::now() + 1s));
  wd.stop();
  CHECK(t.aborts == 1);
  CHECK(t.abort_thread != std::this_thread::get_id());
}

TEST_CASE("watchdog: a held failure (shrink's) fails new operations at once, the pending ones only after release") {
  FakeTarget t;
  dn::Watchdog wd(t, 2, fast());
  wd.start();
  auto a = op("all_reduce", 1);
  comm::Work wa(a);
  wd.track(a, dn::Clock::now() + 10s);
  CHECK(wd.fail(std::make_exception_ptr(comm::RemoteError("shrink", 2, "the communicator was shrunk")), true));
  CHECK_FALSE(wd.fail(std::make_exception_ptr(comm::Timeout("x", 2, "second"))));  // the first cause wins
  CHECK(wd.failed());
  CHECK(wd.held());
  // A later operation fails at once; the pending one, whose kernels ncclCommShrink has not stopped
  // yet, neither fails nor completes, and nothing is aborted.
  auto b = op("broadcast", 2);
  comm::Work wb(b);
  wd.track(b, dn::Clock::now() + 10s);
  CHECK(contains(wait_error<comm::RemoteError>(wb), "the communicator was shrunk"));
  CHECK_FALSE(wa.wait_for(100ms));
  CHECK_FALSE(wd.wait_idle(dn::Clock::now() + 20ms));
  CHECK(t.aborts == 0);
  wd.release();
  CHECK_FALSE(wd.held());
  CHECK(contains(wait_error<comm::RemoteError>(wa), "aborted after a failure of the communicator"));
  CHECK(wd.wait_idle(dn::Clock::now() + 1s));
  wd.release();  // idempotent
  wd.stop();
  CHECK(t.aborts == 1);
}

TEST_CASE("watchdog: stop() ends a hold: the engine is aborted and the pending operations fail") {
  FakeTarget t;
  auto a = op("all_gather", 1);
  comm::Work wa(a);
  {
    dn::Watchdog wd(t, 0, fast());
    wd.start();
    wd.track(a, dn::Clock::now() + 10s);
    CHECK(wd.fail(std::make_exception_ptr(comm::RemoteError("shrink", 0, "shrunk")), true));
    std::this_thread::sleep_for(20ms);
    CHECK(t.aborts == 0);
  }
  CHECK(t.aborts == 1);
  CHECK(wa.is_completed());
  CHECK_THROWS_AS(wa.wait(), comm::RemoteError);
}

TEST_CASE("watchdog: stop() without a thread still aborts after a recorded failure") {
  FakeTarget t;
  dn::Watchdog wd(t, 0, fast());
  auto a = op("gather", 1);
  comm::Work wa(a);
  wd.track(a, dn::Clock::now() + 10s);
  wd.fail(std::make_exception_ptr(comm::BackendError("gather", 0, "boom")));
  wd.stop();
  CHECK(t.aborts == 1);
  CHECK(wa.is_completed());
  CHECK_THROWS_AS(wa.wait(), comm::BackendError);
}

TEST_CASE("watchdog: stop() leaves running operations alone and never aborts a healthy engine") {
  FakeTarget t;
  auto a = op("all_reduce", 1);
  comm::Work wa(a);
  {
    dn::Watchdog wd(t, 0, fast());
    wd.start();
    wd.track(a, dn::Clock::now() + 10s);
    CHECK_FALSE(wd.wait_idle(dn::Clock::now() + 20ms));
  }
  CHECK(t.aborts == 0);
  CHECK_FALSE(wa.is_completed());
}

TEST_CASE("watchdog: many operations in flight complete promptly (default timing: spins, then sleeps)") {
  FakeTarget t;
  dn::Watchdog wd(t, 0);
  wd.start();
  std::vector<std::shared_ptr<FakeOp>> ops;
  std::vector<comm::Work> works;
  for (std::uint64_t i = 1; i <= 500; ++i) {
    ops.push_back(op("all_reduce", i));
    works.emplace_back(ops.back());
    wd.track(ops.back(), dn::Clock::now() + 10s);
  }
  std::thread finisher([&] {
    for (auto& o : ops) {
      o->state = 1;
      if (o->seq() % 50 == 0) std::this_thread::sleep_for(1ms);
    }
  });
  for (auto& w : works) CHECK_NOTHROW(w.wait());
  finisher.join();
  CHECK(wd.wait_idle(dn::Clock::now() + 1s));
  wd.stop();
}

namespace {

/// A fake engine that feeds the watchdog's progress hooks to a real flight recorder.
class RecordingTarget final : public dn::WatchTarget {
 public:
  std::optional<dn::Fault> async_error() noexcept override { return std::nullopt; }
  void abort() noexcept override { aborted = true; }
  void op_started(std::uint64_t seq) noexcept override { recorder.started(seq); }
  void op_completed(std::uint64_t seq) noexcept override { recorder.completed(seq); }
  void op_failed(std::uint64_t seq, const std::exception_ptr& e) noexcept override {
    recorder.failed(seq, dn::what_of(e).c_str());
  }
  void failure_handled(const std::exception_ptr&) noexcept override {
    aborted_first = aborted.load();
    handled.fetch_add(1);
  }
  comm::detail::FlightRecorder recorder{8};
  std::atomic<bool> aborted{false};
  std::atomic<bool> aborted_first{false};
  std::atomic<int> handled{0};
};

}  // namespace

TEST_CASE("watchdog: progress hooks drive the flight recorder (started at the head, completed, failed)") {
  RecordingTarget t;
  dn::Watchdog wd(t, 3, fast());
  wd.start();
  const comm::OpDesc desc{comm::OpKind::all_reduce, 8, 0, -1, 4};
  auto a = op("all_reduce", 0), b = op("all_reduce", 1, 150ms);
  comm::Work wa(a), wb(b);
  t.recorder.issued(0, desc);
  t.recorder.issued(1, desc);
  const auto now = dn::Clock::now();
  wd.track(a, now + 10s);
  wd.track(b, now + 300ms);
  auto state = [&](std::size_t i) { return t.recorder.snapshot("nccl", 3, 4, "").ops.at(i).state; };
  CHECK(state(0) == comm::OpState::started);  // at the head of an idle queue
  CHECK(state(1) == comm::OpState::queued);   // behind #0
  a->state = 1;
  CHECK(wa.wait_for(2s));
  CHECK(state(0) == comm::OpState::completed);
  // #1 became the head when #0 completed; it never finishes and fails at its deadline.
  CHECK_THROWS_AS((void)wb.wait_for(std::chrono::milliseconds(2000)), comm::Timeout);
  CHECK(wb.failed());
  const auto f = t.recorder.snapshot("nccl", 3, 4, "");
  REQUIRE(f.ops.size() == 2);
  CHECK(f.ops[1].state == comm::OpState::failed);
  CHECK(f.ops[1].started.time_since_epoch().count() != 0);
  CHECK(contains(f.ops[1].error, "operation #1 did not complete within 150 ms"));
  for (int i = 0; i < 200 && t.handled == 0; ++i) std::this_thread::sleep_for(5ms);
  CHECK(t.handled == 1);          // once, after the abort and the failed operations
  CHECK(t.aborted_first.load());
  wd.stop();
  CHECK(t.handled == 1);
}

TEST_CASE("watchdog: operation #0 at its deadline fails with the cause itself") {
  FakeTarget t;
  dn::Watchdog wd(t, 3, fast());
  wd.start();
  auto a = op("all_reduce", 0, 150ms);
  comm::Work wa(a);
  wd.track(a, dn::Clock::now() + 100ms);
  const auto m = wait_error<comm::Timeout>(wa);
  CHECK(contains(m, "operation #0 did not complete within 150 ms"));
  CHECK_FALSE(contains(m, "aborted after a failure"));
  wd.stop();
}
