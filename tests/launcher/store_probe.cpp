// A comm program for launcher_test to run under comm-run: it uses the job's store (env://, so
// COMM_AGENT_STORE decides who hosts it). Output through write(2), one line per write.
//
//   store_probe survive    every rank watches the others (the liveness watch communicators use);
//                          rank 0 prints "DYING t_ns=..." and SIGKILLs itself; the others print
//                          "DEAD rank=.. t_ns=.. why=.." when the watch names the dead rank, then
//                          set, add and get keys and print "STORE OK". Rank 0 restarted
//                          (COMM_RESTART_COUNT set) sets "back" and exits 0. Run it with
//                          --max-restarts 1 so the job goes on after rank 0's death.
//   store_probe members    rank 0 prints "JOB port=.. job=.."; every rank waits for the key "go",
//                          then checks that no key "stranger*" exists, counts itself in, and
//                          prints "MEMBER OK" once every rank has (exit 0), else exits 3.
//   store_probe late       every rank checks in; the lower half of the ranks exits at once, the
//                          upper half waits 1 s (the store's host node is done by then) and
//                          sets and gets a key: "LATE OK" (exit 0).

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include <comm/detail/engine/liveness.hpp>
#include <comm/init.hpp>
#include <comm/store.hpp>

namespace {

void say(std::string_view s) {
  std::string line(s);
  line += '\n';
  std::string_view rest = line;
  while (!rest.empty()) {
    const ssize_t n = ::write(STDOUT_FILENO, rest.data(), rest.size());
    if (n <= 0) return;
    rest.remove_prefix(static_cast<std::size_t>(n));
  }
}

long long now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string text(const comm::Store::Bytes& b) { return std::string(b.begin(), b.end()); }

int survive(const comm::InitResult& init) {
  auto& store = *init.store;
  const int rank = init.rank, size = init.size;
  if (std::getenv("COMM_RESTART_COUNT") != nullptr) {  // the replacement of rank 0
    store.set("back", std::to_string(::getpid()));
    say("REPLACEMENT restart=" + std::string(std::getenv("COMM_RESTART_COUNT")));
    return 0;
  }
  std::mutex mu;
  std::condition_variable cv;
  int dead = -1;
  long long dead_at = 0;
  std::string why;
  auto live = comm::detail::Liveness::start(init.store, "survive/", rank, size, [&](int r, const std::string& w, bool) {
    std::lock_guard g(mu);
    dead_at = now_ns();
    dead = r;
    why = w;
    cv.notify_all();
  });
  if (!live) {
    say("NO LIVENESS");
    return 4;
  }
  store.set("watching/" + std::to_string(rank), "1");
  for (int p = 0; p < size; ++p) store.wait({"watching/" + std::to_string(p)});
  if (rank == 0) {
    say("DYING t_ns=" + std::to_string(now_ns()));
    ::kill(::getpid(), SIGKILL);
  }
  {
    std::unique_lock l(mu);
    if (!cv.wait_for(l, std::chrono::seconds(10), [&] { return dead >= 0; })) {
      say("NO VERDICT");
      return 5;
    }
    say("DEAD rank=" + std::to_string(dead) + " t_ns=" + std::to_string(dead_at) + " why=" + why);
  }
  // The store outlived rank 0: set, add, get among the survivors.
  store.set("survivor/" + std::to_string(rank), std::to_string(rank * 7));
  const auto count = store.add("survivors", 1);
  for (int p = 1; p < size; ++p) {
    if (text(store.get("survivor/" + std::to_string(p))) != std::to_string(p * 7)) {
      say("BAD VALUE from " + std::to_string(p));
      return 6;
    }
  }
  store.wait({"back"});
  say("STORE OK count=" + std::to_string(count));
  live->stop();
  return 0;
}

int members(const comm::InitResult& init) {
  auto& store = *init.store;
  if (init.rank == 0) {
    const char* job = std::getenv("COMM_JOB_ID");
    say("JOB port=" + std::to_string(init.master_port) + " job=" + (job != nullptr ? job : ""));
  }
  store.wait({"go"});
  for (const char* k : {"stranger", "stranger-raw", "stranger-none"})
    if (store.check(k)) {
      say(std::string("STRANGER KEY ") + k);
      return 3;
    }
  store.add("members", 1);
  for (;;) {
    if (store.add("members", 0) >= init.size) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  say("MEMBER OK");
  return 0;
}

int late(const comm::InitResult& init) {
  auto& store = *init.store;
  store.add("in", 1);
  while (store.add("in", 0) < init.size) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (init.rank < init.size / 2) return 0;
  std::this_thread::sleep_for(std::chrono::seconds(1));
  store.set("late/" + std::to_string(init.rank), "1");
  if (text(store.get("late/" + std::to_string(init.rank))) != "1") return 6;
  say("LATE OK");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string_view mode = argc > 1 ? argv[1] : "";
  try {
    const comm::InitResult init = comm::init_env();
    if (mode == "survive") return survive(init);
    if (mode == "members") return members(init);
    if (mode == "late") return late(init);
    say("unknown mode");
    return 2;
  } catch (const std::exception& e) {
    say(std::string("ERROR ") + e.what());
    return 7;
  }
}
