// The stores' semantics: HashStore in one process, the world TcpStore and FileStore across the
// ranks of the job, PrefixStore isolation, timeouts, bad input, and a TcpStore hosted by rank 0.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <comm/detail/engine/liveness.hpp>
#include <comm/store.hpp>
#include <support/multirank.hpp>

using namespace std::chrono_literals;
using comm::test::barrier;
using comm::test::world;
using Clock = std::chrono::steady_clock;

namespace {

std::string str(const std::vector<std::uint8_t>& v) { return {v.begin(), v.end()}; }
std::vector<std::uint8_t> bytes(std::string_view s) { return {s.begin(), s.end()}; }

std::chrono::milliseconds since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
}

bool contains(std::string_view hay, std::string_view needle) { return hay.find(needle) != std::string_view::npos; }

// The whole single-store contract, for any store, by one caller. `exact_counts`: nobody else
// adds keys meanwhile, so num_keys() can be checked exactly.
void check_local_semantics(comm::Store& s, bool exact_counts = true) {
  CHECK_FALSE(s.check("a"));
  s.set("a", "1");
  CHECK(s.check("a"));
  CHECK(str(s.get("a")) == "1");
  s.set("a", "two");  // overwrite
  CHECK(str(s.get("a")) == "two");
  s.set("empty", "");  // empty values exist
  CHECK(s.check("empty"));
  CHECK(s.get("empty").empty());

  const std::vector<std::uint8_t> binary{0, 255, 10, 0, 13};
  s.set("bin", std::span<const std::uint8_t>(binary));
  CHECK(s.get("bin") == binary);

  CHECK(s.add("n", 5) == 5);
  CHECK(s.add("n", -7) == -2);
  CHECK(s.add("n", 0) == -2);
  CHECK(str(s.get("n")) == "-2");
  CHECK_THROWS_AS(s.add("a", 1), comm::InvalidArgument);  // "two" is not an integer
  s.set("big", std::to_string(INT64_MAX));
  CHECK_THROWS_AS(s.add("big", 1), comm::InvalidArgument);

  // compare_set: empty expected creates a missing key; a mismatch leaves the value alone.
  CHECK(str(s.compare_set("c", {}, bytes("x"))) == "x");
  CHECK(str(s.compare_set("c", bytes("nope"), bytes("y"))) == "x");
  CHECK(str(s.compare_set("c", bytes("x"), bytes("y"))) == "y");
  CHECK(str(s.get("c")) == "y");
  CHECK(s.compare_set("missing-cas", bytes("x"), bytes("y")).empty());
  CHECK_FALSE(s.check("missing-cas"));

  const auto before = s.num_keys();
  CHECK(s.delete_key("c"));
  CHECK_FALSE(s.delete_key("c"));
  CHECK_FALSE(s.check("c"));
  if (exact_counts) CHECK(s.num_keys() == before - 1);

  s.wait({"a", "n"}, 1s);  // present: returns at once
  s.wait({}, 1s);
}

// get() of a missing key ends with Timeout after about `t`, naming the key; wait() names only the
// keys that are missing.
void check_timeouts(comm::Store& s, std::string_view what) {
  INFO("store: " << what);
  const auto saved = s.timeout();
  s.set_timeout(150ms);
  const std::string key = "never/set/" + std::to_string(world().rank);
  auto t0 = Clock::now();
  try {
    (void)s.get(key);
    FAIL("get of a missing key returned");
  } catch (const comm::Timeout& e) {
    const auto took = since(t0);
    CHECK(took >= 140ms);
    CHECK(took < 2150ms);
    CHECK(e.op() == "store.get");
    CHECK(contains(e.what(), key));
  }
  s.set_timeout(saved);

  s.set("present/" + std::to_string(world().rank), "1");
  t0 = Clock::now();
  try {
    s.wait({"present/" + std::to_string(world().rank), key}, 100ms);
    FAIL("wait on a missing key returned");
  } catch (const comm::Timeout& e) {
    CHECK(since(t0) >= 90ms);
    CHECK(since(t0) < 2100ms);
    CHECK(e.op() == "store.wait");
    CHECK(contains(e.what(), key));
    CHECK_FALSE(contains(e.what(), "present/"));
  }
}

std::string temp_path(std::string_view tag) {
  return "/tmp/comm-store-test-" + std::string(tag) + "-" + std::to_string(::getpid()) + "-" +
         std::to_string(Clock::now().time_since_epoch().count());
}

}  // namespace

// --- HashStore (one process) --------------------------------------------------------------------

TEST_CASE("HashStore: the Store contract") {
  comm::HashStore s(5s);
  check_local_semantics(s);
  check_timeouts(s, "HashStore");
}

TEST_CASE("HashStore: concurrent adds from threads and a get woken by another thread") {
  comm::HashStore s(5s);
  constexpr int threads = 8, per = 500;
  std::vector<std::thread> ts;
  for (int i = 0; i < threads; ++i)
    ts.emplace_back([&] {
      for (int j = 0; j < per; ++j) s.add("counter", 1);
    });
  for (auto& t : ts) t.join();
  CHECK(s.add("counter", 0) == threads * per);

  std::thread setter([&] {
    std::this_thread::sleep_for(30ms);
    s.set("late", "here");
  });
  const auto t0 = Clock::now();
  CHECK(str(s.get("late")) == "here");
  CHECK(since(t0) >= 20ms);
  setter.join();
}

// --- the world store across ranks ---------------------------------------------------------------

TEST_CASE("world store: every rank's value is visible to every rank") {
  auto s = comm::test::fresh_store();
  const auto& w = world();
  s->set("v/" + std::to_string(w.rank), "value-of-" + std::to_string(w.rank));
  for (int r = 0; r < w.size; ++r) CHECK(str(s->get("v/" + std::to_string(r))) == "value-of-" + std::to_string(r));
}

TEST_CASE("world store: concurrent adds from all ranks give distinct results and the right total") {
  auto s = comm::test::fresh_store();
  const auto& w = world();
  constexpr int per = 100;
  std::string mine;
  std::int64_t last = 0;
  for (int i = 0; i < per; ++i) {
    const auto v = s->add("counter", 1);
    CHECK(v > last);  // each rank sees its own increments in order
    last = v;
    mine += std::to_string(v) + ",";
  }
  s->set("seen/" + std::to_string(w.rank), mine);
  barrier();
  CHECK(s->add("counter", 0) == static_cast<std::int64_t>(per) * w.size);
  std::set<std::int64_t> all;
  for (int r = 0; r < w.size; ++r) {
    const auto text = str(s->get("seen/" + std::to_string(r)));
    std::size_t pos = 0;
    while (pos < text.size()) {
      const auto comma = text.find(',', pos);
      all.insert(std::stoll(text.substr(pos, comma - pos)));
      pos = comma + 1;
    }
  }
  CHECK(all.size() == static_cast<std::size_t>(per * w.size));  // no value handed out twice
}

TEST_CASE("world store: compare_set elects exactly one winner") {
  auto s = comm::test::fresh_store();
  const auto& w = world();
  const auto me = "rank" + std::to_string(w.rank);
  const auto got = str(s->compare_set("leader", {}, bytes(me)));
  s->set("saw/" + std::to_string(w.rank), got);
  if (got == me) s->add("winners", 1);
  barrier();
  CHECK(s->add("winners", 0) == 1);
  for (int r = 0; r < w.size; ++r) CHECK(str(s->get("saw/" + std::to_string(r))) == got);
}

TEST_CASE("world store: get and wait block until another rank sets the key") {
  auto s = comm::test::fresh_store();
  const auto& w = world();
  const int next = (w.rank + 1) % w.size;
  std::thread setter([&] {
    std::this_thread::sleep_for(40ms);
    s->set("ready/" + std::to_string(w.rank), "yes");
  });
  s->wait({"ready/" + std::to_string(next)}, 10s);  // usually set only after this call began
  CHECK(str(s->get("ready/" + std::to_string(next))) == "yes");
  setter.join();
}

TEST_CASE("world store: timeouts name the key, the op and the rank") {
  auto s = comm::test::fresh_store();
  check_timeouts(*s, "world TcpStore via PrefixStore");
  s->set_timeout(100ms);
  try {
    (void)s->get("nobody/sets/this");
    FAIL("returned");
  } catch (const comm::Timeout& e) {
    CHECK(e.rank() == world().rank);
    CHECK(contains(e.what(), "on rank " + std::to_string(world().rank)));
    CHECK(contains(e.what(), "nobody/sets/this"));
  }
}

TEST_CASE("PrefixStore: keys are prefixed and stores with other prefixes do not see them") {
  auto base = std::make_shared<comm::HashStore>(5s);
  auto a = std::make_shared<comm::PrefixStore>("a", base);
  comm::PrefixStore b("b", base);
  a->set("x", "from-a");
  CHECK(a->check("x"));
  CHECK_FALSE(b.check("x"));
  CHECK(base->check("a/x"));
  CHECK(str(base->get("a/x")) == "from-a");
  b.set("x", "from-b");
  CHECK(str(a->get("x")) == "from-a");
  CHECK(str(b.get("x")) == "from-b");
  CHECK(a->add("n", 2) == 2);
  CHECK_FALSE(b.check("n"));
  CHECK(b.delete_key("x"));
  CHECK(a->check("x"));
  comm::PrefixStore nested("inner", a);  // prefixes compose
  nested.set("k", "v");
  CHECK(base->check("a/inner/k"));

  b.set_timeout(80ms);  // its own timeout, not the base's 5 s
  const auto t0 = Clock::now();
  try {
    (void)b.get("only-in-a");
    FAIL("returned");
  } catch (const comm::Timeout& e) {
    CHECK(contains(e.what(), "b/only-in-a"));
  }
  CHECK(since(t0) < 2s);
  CHECK_THROWS_AS(comm::PrefixStore("p", nullptr), comm::InvalidArgument);
}

TEST_CASE("PrefixStore over the world store isolates concurrent users on every rank") {
  auto base = comm::test::fresh_store();
  const auto& w = world();
  comm::PrefixStore mine("rank" + std::to_string(w.rank), base);
  mine.set("k", std::to_string(w.rank));
  CHECK(mine.add("c", 1) == 1);  // nobody else's add lands here
  barrier();
  CHECK(str(mine.get("k")) == std::to_string(w.rank));
  for (int r = 0; r < w.size; ++r)
    CHECK(str(base->get("rank" + std::to_string(r) + "/k")) == std::to_string(r));
}

// --- a TcpStore hosted by rank 0 ----------------------------------------------------------------

TEST_CASE("TcpStore hosted by rank 0 on a shared port: full contract across ranks") {
  const auto& w = world();
  const auto port = comm::test::shared_free_port();
  comm::TcpStoreOptions o;
  o.is_server = w.rank == 0;
  o.rank = w.rank;
  o.timeout = 10s;
  comm::TcpStore s("127.0.0.1", port, o);
  CHECK(s.port() == port);
  CHECK(s.host() == "127.0.0.1");
  CHECK(s.is_server() == (w.rank == 0));
  CHECK(s.rank() == w.rank);

  // Fresh store: every rank's keys are counted.
  s.set("key/" + std::to_string(w.rank), std::to_string(w.rank));
  s.add("count", 1);
  s.wait({"key/" + std::to_string(w.size - 1)});
  barrier();
  CHECK(s.num_keys() == w.size + 1);
  CHECK(s.add("count", 0) == w.size);
  barrier();
  if (w.rank == 0) CHECK(s.delete_key("key/0"));
  barrier();
  CHECK_FALSE(s.check("key/0"));
  CHECK(s.num_keys() == w.size);
  CHECK_FALSE(s.delete_key("key/0"));
  barrier();

  // Each rank exercises the rest on its own keys.
  comm::PrefixStore own("own" + std::to_string(w.rank), std::shared_ptr<comm::Store>(&s, [](comm::Store*) {}));
  check_local_semantics(own, false);
  check_timeouts(s, "TcpStore");
  try {
    s.set_timeout(100ms);
    (void)s.get("absent");
    FAIL("returned");
  } catch (const comm::Timeout& e) {
    CHECK(contains(e.what(), "127.0.0.1:" + std::to_string(port)));  // names the address
  }
  s.set_timeout(10s);
  barrier();  // the server (rank 0) outlives everyone's use of it
}

TEST_CASE("TcpStore: a get blocked in one thread does not block a set from another thread") {
  comm::TcpStoreOptions o;
  o.is_server = true;
  o.timeout = 5s;
  comm::TcpStore s("127.0.0.1", 0, o);
  std::thread setter([&] {
    std::this_thread::sleep_for(30ms);
    s.set("k", "v");  // must not wait for the get below to finish
  });
  const auto t0 = Clock::now();
  CHECK(str(s.get("k")) == "v");
  CHECK(since(t0) < 2s);
  setter.join();

  std::atomic<int> ok{0};
  std::vector<std::thread> ts;
  for (int i = 0; i < 8; ++i)
    ts.emplace_back([&, i] {
      for (int j = 0; j < 50; ++j) s.add("n", 1);
      s.set("t" + std::to_string(i), "x");
      if (str(s.get("t" + std::to_string((i + 1) % 8))) == "x") ++ok;
    });
  for (auto& t : ts) t.join();
  CHECK(ok == 8);
  CHECK(s.add("n", 0) == 400);
}

TEST_CASE("TcpStore: IPv6 loopback and localhost") {
  comm::TcpStoreOptions o;
  o.is_server = true;
  o.timeout = 5s;
  comm::TcpStore v6("::1", 0, o);
  CHECK(v6.address() == "[::1]:" + std::to_string(v6.port()));
  v6.set("k", "six");
  comm::TcpStoreOptions c;
  c.timeout = 5s;
  comm::TcpStore client("[::1]", v6.port(), c);
  CHECK(str(client.get("k")) == "six");

  comm::TcpStore local("localhost", 0, o);
  comm::TcpStore local_client("localhost", local.port(), c);
  local_client.set("x", "y");
  CHECK(str(local.get("x")) == "y");
}

TEST_CASE("TcpStore: a server that goes away makes clients fail with RemoteError, not hang") {
  comm::TcpStoreOptions o;
  o.is_server = true;
  o.timeout = 10s;
  auto server = std::make_unique<comm::TcpStore>("127.0.0.1", 0, o);
  comm::TcpStoreOptions c;
  c.timeout = 10s;
  c.rank = world().rank;
  comm::TcpStore client("127.0.0.1", server->port(), c);
  client.set("a", "1");
  std::thread killer([&] {
    std::this_thread::sleep_for(50ms);
    server.reset();
  });
  const auto t0 = Clock::now();
  CHECK_THROWS_AS((void)client.get("never"), comm::RemoteError);  // parked on the server when it dies
  killer.join();
  CHECK(since(t0) < 3s);
  CHECK_THROWS_AS(client.set("b", "2"), comm::RemoteError);  // and later calls fail fast too
  CHECK(since(t0) < 3s);
}

TEST_CASE("TcpStore: bad input is an Error, not a crash") {
  comm::TcpStoreOptions o;
  o.is_server = true;
  o.timeout = 5s;
  o.max_key_bytes = 16;
  o.max_value_bytes = 1024;
  comm::TcpStore s("127.0.0.1", 0, o);
  CHECK_THROWS_AS(s.set(std::string(17, 'k'), "v"), comm::InvalidArgument);
  CHECK_THROWS_AS((void)s.get(std::string(100, 'k')), comm::InvalidArgument);
  CHECK_THROWS_AS(s.set("k", std::string(1025, 'v')), comm::InvalidArgument);
  s.set("k", std::string(1024, 'v'));  // at the limit is fine

  // A client with larger limits than the server: the server refuses, the connection survives.
  comm::TcpStoreOptions big;
  big.timeout = 5s;
  comm::TcpStore c("127.0.0.1", s.port(), big);
  try {
    c.set("k", std::string(4096, 'v'));
    FAIL("accepted");
  } catch (const comm::InvalidArgument& e) {
    CHECK(contains(e.what(), "max_value_bytes"));
  }
  CHECK_THROWS_AS(c.set(std::string(64, 'k'), "v"), comm::InvalidArgument);
  CHECK(c.add("ok", 1) == 1);

  comm::TcpStoreOptions client;
  CHECK_THROWS_AS(comm::TcpStore("127.0.0.1", 0, client), comm::InvalidArgument);  // port 0 needs a server
  CHECK_THROWS_AS(comm::TcpStore("", 1234, client), comm::InvalidArgument);
  client.token = std::string(5000, 't');
  CHECK_THROWS_AS(comm::TcpStore("127.0.0.1", s.port(), client), comm::InvalidArgument);

  // A port already in use: the error names the address and port.
  try {
    comm::TcpStore again("127.0.0.1", s.port(), o);
    FAIL("bound twice");
  } catch (const comm::Error& e) {
    CHECK(contains(e.what(), "127.0.0.1:" + std::to_string(s.port())));
  }
}

TEST_CASE("TcpStore: a store of another job refuses this job's clients and says so") {
  comm::TcpStoreOptions o;
  o.is_server = true;
  o.timeout = 5s;
  o.token = "same-token";  // a later job may even reuse the token: the job id still tells them apart
  o.job_id = "job-A";
  auto old_job = std::make_unique<comm::TcpStore>("127.0.0.1", 0, o);
  const auto port = old_job->port();

  comm::TcpStoreOptions c = o;
  c.is_server = false;
  c.rank = 1;
  c.timeout = 1s;  // bounds the retry against a store that might be closing
  c.job_id = "job-B";
  const auto t0 = Clock::now();
  try {
    comm::TcpStore client("127.0.0.1", port, c);
    FAIL("a client of job-B joined job-A's store");
  } catch (const comm::InvalidArgument& e) {
    MESSAGE(e.what());
    CHECK(e.op() == "store.connect");
    CHECK(e.rank() == 1);
    CHECK(contains(e.what(), "belongs to job 'job-A', this process to job 'job-B'"));
    CHECK(contains(e.what(), "an earlier job's store still runs on this port"));
  }
  CHECK(since(t0) >= 900ms);
  CHECK(since(t0) < 3s);
  // Nothing of job-B reached job-A's store.
  CHECK(old_job->num_keys() == 0);

  // No job id on one side only is a mismatch too.
  {
    std::vector<std::pair<std::string, std::string>> saved;
    for (const char* n : {"COMM_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"}) {
      if (const char* v = std::getenv(n)) saved.emplace_back(n, v);
      ::unsetenv(n);
    }
    c.job_id.clear();
    CHECK_THROWS_WITH_AS(comm::TcpStore("127.0.0.1", port, c), doctest::Contains("this process to no job id"),
                         comm::InvalidArgument);
    for (const auto& [n, v] : saved) ::setenv(n.c_str(), v.c_str(), 1);
  }

  // The earlier job's store closes while job-B's client retries; job-B's own store then takes
  // the port and the client joins it.
  c.job_id = "job-B";
  c.timeout = 10s;
  std::unique_ptr<comm::TcpStore> new_job;
  std::thread restart([&] {
    std::this_thread::sleep_for(300ms);
    old_job.reset();
    comm::TcpStoreOptions n = o;
    n.job_id = "job-B";
    new_job = std::make_unique<comm::TcpStore>("127.0.0.1", port, n);
  });
  const auto t1 = Clock::now();
  comm::TcpStore joined("127.0.0.1", port, c);
  restart.join();
  CHECK(since(t1) < 3s);
  joined.set("k", "v");
  CHECK(str(new_job->get("k")) == "v");
}

TEST_CASE("TcpStore: a will (liveness) fires when its connection closes or falls silent, not once withdrawn") {
  comm::TcpStoreOptions o;
  o.is_server = true;
  o.timeout = 5s;
  o.rank = 0;
  comm::TcpStore server("127.0.0.1", 0, o);
  comm::TcpStoreOptions c = o;
  c.is_server = false;
  c.rank = 1;
  {
    auto a = std::make_unique<comm::TcpStore>("127.0.0.1", server.port(), c);
    CHECK(a->watch("w/closed", "1|", 10s) == 0);  // the rank hosting the server
    CHECK_FALSE(a->heartbeat(1s).has_value());
    const auto t0 = Clock::now();
    a.reset();  // its connection closes, as when the process dies
    const auto v = str(server.get("w/closed"));
    CHECK(since(t0) < 1s);
    CHECK(v == "1|its connection to the store closed (the process exited or was killed)");
  }
  {
    comm::TcpStore watcher("127.0.0.1", server.port(), c);
    (void)watcher.watch("w/silent", "9|", 10s);
    comm::TcpStore silent("127.0.0.1", server.port(), c);
    (void)silent.watch("w/silent", "2|", 200ms);
    const auto t0 = Clock::now();
    const auto v = str(server.get("w/silent"));  // parked until the will fires
    CHECK(since(t0) >= 150ms);
    CHECK(since(t0) < 2s);
    CHECK(v == "2|it sent no heartbeat for 200 ms (stopped, hung or cut off)");
    const auto seen = watcher.heartbeat(1s);  // the others see it with their next heartbeat
    REQUIRE(seen.has_value());
    CHECK(str(*seen) == v);
    CHECK_THROWS_AS((void)silent.heartbeat(1s), comm::RemoteError);  // and the silent one was dropped
  }
  {
    auto d = std::make_unique<comm::TcpStore>("127.0.0.1", server.port(), c);
    (void)d->watch("w/withdrawn", "3|", 10s);
    (void)d->watch("", "", 10s);  // a rank that leaves normally withdraws its will first
    d.reset();
    std::this_thread::sleep_for(100ms);
    CHECK_FALSE(server.check("w/withdrawn"));
  }
}

TEST_CASE("liveness values: who is named, and which news is the echo of a rank's own timeout") {
  using comm::detail::Liveness;
  auto at = [](std::string_view v, int rank) { return Liveness::parse_value(bytes(v), rank, 4); };
  // A closed connection rank 1 blames on rank 0: rank 0 hears of it from rank 1, and after its
  // own Timeout it is that timeout's echo (libgloo closed the connection), before it news.
  auto d = at("1!0|connection closed by peer", 0);
  CHECK(d.rank == 1);
  CHECK(d.source == 1);
  CHECK(d.echo);
  CHECK_FALSE(d.explains(true));
  CHECK(d.explains(false));
  CHECK(d.why == "rank 1's operation failed: connection closed by peer");
  // The same at another rank names the blamed one, and is no echo there.
  d = at("1!0|connection closed by peer", 2);
  CHECK(d.rank == 0);
  CHECK_FALSE(d.echo);
  CHECK(d.explains(true));
  // A mismatch rank 1 diagnosed ('#') is news even after a Timeout at the rank it blames.
  d = at("1#0|desync: rank 0 called all_reduce(float x4, sum) while rank 1 called all_reduce(float x8, sum)", 0);
  CHECK(d.rank == 1);
  CHECK_FALSE(d.echo);
  CHECK(d.explains(true));
  // Deaths, revokes and a blame out of range are never echoes.
  d = at("0|its connection to the store closed", 3);
  CHECK(d.rank == 0);
  CHECK(d.why == "rank 0 is dead: its connection to the store closed");
  CHECK(d.explains(true));
  d = at("2^|shrinking", 0);
  CHECK(d.rank == 2);
  CHECK(d.explains(true));
  d = at("3!9|connection closed", 0);
  CHECK(d.rank == 3);
  CHECK_FALSE(d.echo);
  CHECK(at("0~|left", 1).left);
}

// --- FileStore ----------------------------------------------------------------------------------

TEST_CASE("FileStore: the Store contract in one process") {
  const auto path = temp_path("local");
  {
    comm::FileStore s(path, 5s);
    CHECK(s.path() == path);
    check_local_semantics(s);
    check_timeouts(s, "FileStore");
    comm::FileStore again(path, 5s);  // a second instance replays the same log
    CHECK(str(again.get("a")) == "two");
    CHECK_FALSE(again.check("c"));
    CHECK(again.num_keys() == s.num_keys());
  }
  ::unlink(path.c_str());
}

TEST_CASE("FileStore: a record cut short by a dying writer is dropped, a foreign file is refused") {
  const auto path = temp_path("torn");
  {
    comm::FileStore s(path, 5s);
    s.set("whole", "1");
  }
  {
    std::ofstream f(path, std::ios::binary | std::ios::app);
    const char partial[] = {'S', 5, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 'h', 'a'};  // header + 2 of 14 bytes
    f.write(partial, sizeof partial);
  }
  {
    comm::FileStore s(path, 5s);
    CHECK(str(s.get("whole")) == "1");
    CHECK_FALSE(s.check("half"));
    s.set("after", "2");  // the writer cuts the torn record off first
    comm::FileStore other(path, 5s);
    CHECK(str(other.get("after")) == "2");
    CHECK(other.num_keys() == 2);
  }
  ::unlink(path.c_str());

  {
    std::ofstream f(path);
    f << "this is not a store file\n";
  }
  CHECK_THROWS_AS(comm::FileStore(path, 1s), comm::Error);
  ::unlink(path.c_str());
  CHECK_THROWS_AS(comm::FileStore("/tmp", 1s), comm::Error);  // a directory
  CHECK_THROWS_AS(comm::FileStore("/nonexistent-dir/x/y", 1s), comm::Error);
  CHECK_THROWS_AS(comm::FileStore("", 1s), comm::InvalidArgument);
}

TEST_CASE("FileStore: a lock held elsewhere ends in Timeout naming the file, not a hang") {
  const auto path = temp_path("locked");
  {
    comm::FileStore s(path, 100ms);
    s.set("k", "v");
    const int other = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    REQUIRE(other >= 0);
    struct flock fl{};
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    REQUIRE(::fcntl(other, F_OFD_SETLK, &fl) == 0);
    const auto t0 = Clock::now();
    try {
      s.set("k", "w");
      FAIL("wrote through a held lock");
    } catch (const comm::Timeout& e) {
      CHECK(e.op() == "store.set");
      CHECK(contains(e.what(), path));
    }
    CHECK(since(t0) < 2s);
    ::close(other);  // releases the lock
    s.set("k", "w");
    CHECK(str(s.get("k")) == "w");
  }
  ::unlink(path.c_str());
}

TEST_CASE("FileStore: shared by all ranks through one file") {
  const auto& w = world();
  auto ws = comm::test::fresh_store();
  if (w.rank == 0) ws->set("path", temp_path("shared"));
  const auto path = str(ws->get("path"));
  {
    comm::FileStore s(path, 10s);
    s.set_rank(w.rank);
    s.set("r/" + std::to_string(w.rank), std::to_string(w.rank * 7));
    for (int r = 0; r < w.size; ++r) CHECK(str(s.get("r/" + std::to_string(r))) == std::to_string(r * 7));

    constexpr int per = 50;
    for (int i = 0; i < per; ++i) s.add("counter", 1);
    const auto me = "rank" + std::to_string(w.rank);
    const auto leader = str(s.compare_set("leader", {}, bytes(me)));
    if (leader == me) s.add("winners", 1);
    barrier();
    CHECK(s.add("counter", 0) == per * w.size);
    CHECK(s.add("winners", 0) == 1);
    CHECK(str(s.get("leader")) == leader);
    CHECK(s.num_keys() == w.size + 3);
    barrier();
    if (w.rank == 0) CHECK(s.delete_key("leader"));
    barrier();
    CHECK_FALSE(s.check("leader"));
    CHECK(s.num_keys() == w.size + 2);

    // A get that blocks until another rank writes.
    const int next = (w.rank + 1) % w.size;
    std::thread setter([&] {
      std::this_thread::sleep_for(30ms);
      s.set("late/" + std::to_string(w.rank), "x");
    });
    CHECK(str(s.get("late/" + std::to_string(next))) == "x");
    setter.join();
    try {
      s.wait({"late/" + std::to_string(next), "never"}, 100ms);
      FAIL("returned");
    } catch (const comm::Timeout& e) {
      CHECK(contains(e.what(), "'never'"));
      CHECK(contains(e.what(), path));
      CHECK(e.rank() == w.rank);
    }
    barrier();
  }
  if (w.rank == 0) ::unlink(path.c_str());
}
