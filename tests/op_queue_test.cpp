// comm::detail::OpQueue (detail/engine/op_queue.hpp), the order every engine's operations run in:
// one thread's blocking calls (the owner's path without a lock) beside async calls, blocking calls
// from other threads and wait_idle_until from another thread. Whatever the mix, operations never
// overlap, run in the order of their numbers, the numbers count up without a gap, and a wait for
// the queue to go idle does not return while an operation still runs.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include <comm/detail/base/process_fence.hpp>
#include <comm/detail/engine/op_queue.hpp>
#include <comm/work.hpp>

namespace {

using comm::detail::Op;
using comm::OpKind;
using comm::detail::OpQueue;

// The owner the queue calls back: checks that no two operations run at once and records the
// numbers in the order the operations ran.
struct Recorder {
  std::atomic<int> inside{0};
  std::atomic<int> overlaps{0};
  std::mutex mu;
  std::vector<std::uint64_t> ran_ids;   // in execution order
  std::vector<std::uint64_t> ran_seqs;  // collective numbers, in execution order
  std::vector<std::uint64_t> issued_ids;
  std::chrono::microseconds hold{0};  // how long each operation runs
  std::atomic<bool> throw_next{false};
  std::atomic<int> finished{0};  // operations whose execute has returned or thrown

  // Issues never overlap each other (the flight recorder writes without a lock): the vector is
  // written without one, so that ThreadSanitizer sees two issues at once as the race it is.
  static void issue(void* self, const Op&, std::uint64_t id, std::uint64_t, bool) {
    static_cast<Recorder*>(self)->issued_ids.push_back(id);
  }
  static void execute(void* self, Op& op, std::uint64_t id, std::uint64_t seq, bool) {
    auto* r = static_cast<Recorder*>(self);
    if (r->inside.fetch_add(1) != 0) r->overlaps++;
    if (r->hold.count() > 0) std::this_thread::sleep_for(r->hold);
    {
      const std::lock_guard lock(r->mu);
      r->ran_ids.push_back(id);
      if (!comm::detail::is_p2p(op.desc.kind)) r->ran_seqs.push_back(seq);
    }
    r->inside.fetch_sub(1);
    r->finished++;
    if (r->throw_next.exchange(false)) throw std::runtime_error("the operation failed");
  }
};

Op collective() {
  Op op;
  op.desc.kind = OpKind::all_reduce;
  return op;
}
Op p2p() {
  Op op;
  op.desc.kind = OpKind::send;
  return op;
}

std::shared_ptr<comm::WorkState> work() {
  return std::make_shared<comm::WorkState>("all_reduce", 0, std::chrono::milliseconds(10000));
}

// Every number once, in order of execution.
void check_order(Recorder& r, std::size_t total) {
  CHECK(r.overlaps.load() == 0);
  REQUIRE(r.ran_ids.size() == total);
  for (std::size_t i = 0; i < total; ++i) CHECK(r.ran_ids[i] == i);
  for (std::size_t i = 0; i < r.ran_seqs.size(); ++i) CHECK(r.ran_seqs[i] == i);
  REQUIRE(r.issued_ids.size() == total);
  for (std::size_t i = 0; i < total; ++i) CHECK(r.issued_ids[i] == i);
}

}  // namespace

TEST_CASE("blocking calls on one thread run in order, numbered without a gap; a throw leaves the queue usable") {
  Recorder r;
  OpQueue q(&r, &Recorder::execute, &Recorder::issue);
  constexpr int kOps = 1000;
  for (int i = 0; i < kOps; ++i) {
    Op op = i % 7 == 3 ? p2p() : collective();
    q.run_inline(op);
  }
  r.throw_next = true;
  Op failing = collective();
  CHECK_THROWS_AS(q.run_inline(failing), std::runtime_error);
  Op after = collective();
  q.run_inline(after);
  check_order(r, kOps + 2);
  CHECK(q.wait_idle_until(std::chrono::steady_clock::now() + std::chrono::seconds(1)));
}

TEST_CASE("the owner's blocking calls beside async calls and other threads' blocking calls never overlap") {
  Recorder r;
  OpQueue q(&r, &Recorder::execute, &Recorder::issue);
  constexpr int kOwner = 3000, kOther = 300, kAsync = 300;
  std::atomic<bool> go{false};
  std::vector<std::shared_ptr<comm::WorkState>> works;
  std::mutex works_mu;
  // The owner claims the queue with its first call, then keeps calling. Each operation lasts a
  // little, so that the other threads' first calls come while one of the owner's runs.
  Op first = collective();
  q.run_inline(first);
  r.hold = std::chrono::microseconds(20);
  std::thread other([&] {
    while (!go.load()) std::this_thread::yield();
    for (int i = 0; i < kOther; ++i) {
      Op op = collective();
      q.run_inline(op);
    }
  });
  std::thread async([&] {
    while (!go.load()) std::this_thread::yield();
    for (int i = 0; i < kAsync; ++i) {
      auto w = work();
      q.submit(collective(), w);
      const std::lock_guard lock(works_mu);
      works.push_back(std::move(w));
    }
  });
  go = true;
  for (int i = 0; i < kOwner; ++i) {
    Op op = collective();
    q.run_inline(op);
  }
  other.join();
  async.join();
  for (auto& w : works) REQUIRE(w->wait_until(std::chrono::steady_clock::now() + std::chrono::seconds(20)));
  check_order(r, 1 + kOwner + kOther + kAsync);
}

TEST_CASE("the owner's own async calls and blocking calls alternate in order, and the fast path reopens") {
  Recorder r;
  OpQueue q(&r, &Recorder::execute, &Recorder::issue);
  std::size_t total = 0;
  for (int round = 0; round < 200; ++round) {
    auto w = work();
    q.submit(collective(), w);
    Op op = collective();
    q.run_inline(op);  // behind the queued one
    total += 2;
    CHECK(w->done());
  }
  check_order(r, total);
}

TEST_CASE("wait_idle_until from another thread waits for the owner's running operation") {
  if (!comm::detail::process_fence_available())
    MESSAGE("membarrier(PRIVATE_EXPEDITED) is not available here: the queue takes its lock on every call");
  Recorder r;
  OpQueue q(&r, &Recorder::execute, &Recorder::issue);
  Op warm = collective();
  q.run_inline(warm);  // this thread owns the queue
  r.hold = std::chrono::milliseconds(150);
  std::atomic<bool> started{false};
  std::thread watcher([&] {
    while (!started.load()) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    // Within a short deadline the operation still runs: not idle.
    CHECK_FALSE(q.wait_idle_until(std::chrono::steady_clock::now() + std::chrono::milliseconds(30)));
    CHECK(r.finished.load() == 1);
    // With a long one it returns once the operation has ended, and only then.
    CHECK(q.wait_idle_until(std::chrono::steady_clock::now() + std::chrono::seconds(5)));
    CHECK(r.finished.load() == 2);
  });
  started = true;
  Op op = collective();
  q.run_inline(op);
  watcher.join();
  r.hold = std::chrono::microseconds(0);
  Op again = collective();
  q.run_inline(again);
  check_order(r, 3);
}
