// Init methods: env parsing with good and bad values, and real rendezvous over env://, tcp://
// and file:// across the ranks of this job.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <thread>

#include <unistd.h>

#include <comm/init.hpp>
#include <support/env_guard.hpp>
#include <support/multirank.hpp>

namespace {

using comm::test::EnvGuard;

std::string message_of(auto&& fn) {
  try {
    fn();
  } catch (const comm::InvalidArgument& e) {
    return e.what();
  }
  return "<no InvalidArgument thrown>";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("COMM_TIMEOUT accepts seconds and suffixes, rejects junk") {
  using namespace std::chrono_literals;
  CHECK(comm::detail::parse_duration("90") == 90s);
  CHECK(comm::detail::parse_duration("250ms") == 250ms);
  CHECK(comm::detail::parse_duration("1.5s") == 1500ms);
  CHECK(comm::detail::parse_duration("2m") == 120s);
  CHECK_FALSE(comm::detail::parse_duration("abc"));
  CHECK_FALSE(comm::detail::parse_duration("-3"));
  CHECK_FALSE(comm::detail::parse_duration("5h"));
  CHECK_FALSE(comm::detail::parse_duration(""));
  {
    EnvGuard g{{"COMM_TIMEOUT", "42s"}};
    CHECK(comm::timeout_from_env() == 42s);
  }
  {
    EnvGuard g{{"COMM_TIMEOUT", nullptr}};
    CHECK(comm::timeout_from_env() == std::chrono::minutes(30));
  }
  {
    EnvGuard g{{"COMM_TIMEOUT", "soon"}};
    CHECK(contains(message_of([] { (void)comm::timeout_from_env(); }), "COMM_TIMEOUT='soon' is not a duration"));
  }
}

TEST_CASE("durations: one exact syntax for COMM_TIMEOUT and comm-run, rounded up to a millisecond") {
  using namespace std::chrono_literals;
  using comm::detail::parse_duration;
  // The parser comm-run includes too (tools/comm_run.cpp): usable in constant expressions.
  static_assert(parse_duration("1.0004s") == 1001ms);
  // Decimal, not binary: 0.3 s is 300 ms (a double times 1000 is 300.00000000000006).
  CHECK(parse_duration("0.3s") == 300ms);
  CHECK(parse_duration("0.3") == 300ms);
  CHECK(parse_duration("1.0004s") == 1001ms);  // never shorter than written
  CHECK(parse_duration("1.0000000000001s") == 1001ms);
  CHECK(parse_duration("1.000000000000s") == 1000ms);
  CHECK(parse_duration("0.1ms") == 1ms);  // a positive value never becomes 0
  CHECK(parse_duration("0") == 0ms);
  CHECK(parse_duration(".5m") == 30s);
  CHECK(parse_duration("2.") == 2s);
  CHECK(parse_duration(" 2 m ") == 120s);
  CHECK(parse_duration("31536000s") == std::chrono::hours(24 * 365));  // a year is the limit
  CHECK_FALSE(parse_duration("31536000.001s"));
  CHECK_FALSE(parse_duration("1e3"));
  CHECK_FALSE(parse_duration("inf"));
  CHECK_FALSE(parse_duration("nan"));
  CHECK_FALSE(parse_duration("+5"));
  CHECK_FALSE(parse_duration("."));
  CHECK_FALSE(parse_duration("1.5.2"));
  CHECK_FALSE(parse_duration("99999999999999999999999"));
  CHECK_FALSE(parse_duration("s"));
  {
    EnvGuard g{{"COMM_TIMEOUT", "1.0004s"}};
    CHECK(comm::timeout_from_env() == 1001ms);
  }
  {
    EnvGuard g{{"COMM_TIMEOUT", "0.1ms"}};  // was 0 ms, then "not a duration"
    CHECK(comm::timeout_from_env() == 1ms);
  }
}

TEST_CASE("a store made without a timeout follows COMM_TIMEOUT") {
  using namespace std::chrono_literals;
  {
    EnvGuard g{{"COMM_TIMEOUT", "42s"}};
    CHECK(comm::Store::timeout_from_env() == 42s);
    CHECK(comm::HashStore().timeout() == 42s);
    CHECK(comm::TcpStoreOptions{}.timeout == 42s);
    const auto path = std::filesystem::temp_directory_path() / ("comm_init_test_fs_" + std::to_string(::getpid()));
    {
      comm::FileStore fs(path.string());
      CHECK(fs.timeout() == 42s);
    }
    std::filesystem::remove(path);
    // An explicit timeout still wins.
    CHECK(comm::HashStore(5s).timeout() == 5s);
  }
  {
    EnvGuard g{{"COMM_TIMEOUT", nullptr}};
    CHECK(comm::HashStore().timeout() == comm::Store::default_timeout);
    CHECK(comm::TcpStoreOptions{}.timeout == std::chrono::minutes(30));
  }
  {
    EnvGuard g{{"COMM_TIMEOUT", "soon"}};
    CHECK(contains(message_of([] { (void)comm::HashStore(); }), "COMM_TIMEOUT='soon' is not a duration"));
  }
}

TEST_CASE("env:// rejects bad values with messages that quote them") {
  SUBCASE("port is not a number") {
    EnvGuard g{{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "abc"}};
    CHECK(contains(message_of([] { (void)comm::init_env(std::chrono::seconds(1)); }),
                   "MASTER_PORT='abc' is not a port number"));
  }
  SUBCASE("port out of range") {
    EnvGuard g{{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "70000"}};
    CHECK(contains(message_of([] { (void)comm::init_env(std::chrono::seconds(1)); }),
                   "MASTER_PORT='70000' is not a port number"));
  }
  SUBCASE("rank not below world size") {
    EnvGuard g{{"RANK", "5"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "1234"}};
    CHECK(contains(message_of([] { (void)comm::init_env(std::chrono::seconds(1)); }), "RANK=5 is not below WORLD_SIZE=4"));
  }
  SUBCASE("rank is junk") {
    EnvGuard g{{"RANK", "two"}, {"WORLD_SIZE", "4"}};
    CHECK(contains(message_of([] { (void)comm::init_env(std::chrono::seconds(1)); }), "RANK='two' is not a non-negative integer"));
  }
  SUBCASE("negative world size") {
    EnvGuard g{{"RANK", "0"}, {"WORLD_SIZE", "-2"}};
    CHECK(contains(message_of([] { (void)comm::init_env(std::chrono::seconds(1)); }), "WORLD_SIZE='-2'"));
  }
  SUBCASE("missing variables are named") {
    EnvGuard g{{"RANK", nullptr}, {"WORLD_SIZE", "4"}};
    CHECK(contains(message_of([] { (void)comm::init_env(std::chrono::seconds(1)); }), "RANK is not set"));
  }
  SUBCASE("missing MASTER_ADDR is named") {
    EnvGuard g{{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_ADDR", nullptr}, {"MASTER_PORT", "1234"}};
    CHECK(contains(message_of([] { (void)comm::init_env(std::chrono::seconds(1)); }), "MASTER_ADDR is not set"));
  }
  SUBCASE("local rank beyond local world size") {
    EnvGuard g{{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "2"},
               {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "1234"}};
    CHECK(contains(message_of([] { (void)comm::init_env(std::chrono::seconds(1)); }),
                   "LOCAL_RANK=3 is not below LOCAL_WORLD_SIZE=2"));
  }
}

TEST_CASE("init_method parses URLs and rejects malformed ones") {
  CHECK(contains(message_of([] { (void)comm::init_method("udp://x:1", 0, 1); }), "is not env://, tcp://host:port or file:///path"));
  CHECK(contains(message_of([] { (void)comm::init_method("tcp://127.0.0.1", 0, 1); }), "has no port"));
  CHECK(contains(message_of([] { (void)comm::init_method("tcp://127.0.0.1:http", 0, 1); }), "is not a port number"));
  CHECK(contains(message_of([] { (void)comm::init_method("tcp://[::1:80", 0, 1); }), "is not [ipv6]:port"));
  CHECK(contains(message_of([] { (void)comm::init_method("tcp://127.0.0.1:5000"); }), "needs rank and world_size"));
  CHECK(contains(message_of([] { (void)comm::init_method("tcp://127.0.0.1:5000", 3, 2); }), "rank=3 is not below world_size=2"));
  CHECK(contains(message_of([] { (void)comm::init_method("file://relative/path", 0, 1); }), "needs an absolute path"));
}

TEST_CASE("a missing rank 0 gives a Timeout naming the store address within its deadline") {
  const auto port = comm::test::shared_free_port();  // nobody listens there
  const std::string url = "tcp://127.0.0.1:" + std::to_string(port);
  const auto t0 = std::chrono::steady_clock::now();
  // Rank 1 of 2: a client of a server that never starts.
  CHECK_THROWS_AS((void)comm::init_method(url, 1, 2, std::chrono::milliseconds(500)), comm::Timeout);
  const auto took = std::chrono::steady_clock::now() - t0;
  CHECK(took < std::chrono::seconds(5));
  try {
    (void)comm::init_method(url, 1, 2, std::chrono::milliseconds(200));
  } catch (const comm::Timeout& e) {
    CHECK(contains(e.what(), "127.0.0.1:" + std::to_string(port)));
  }
}

TEST_CASE("env:// rendezvous across real processes") {
  const auto& w = comm::test::world();
  const auto port = comm::test::shared_free_port();
  const auto port_text = std::to_string(port);
  const auto rank_text = std::to_string(w.rank), size_text = std::to_string(w.size);
  EnvGuard g{{"RANK", rank_text.c_str()}, {"WORLD_SIZE", size_text.c_str()}, {"MASTER_ADDR", "127.0.0.1"},
             {"MASTER_PORT", port_text.c_str()}, {"LOCAL_RANK", rank_text.c_str()}, {"LOCAL_WORLD_SIZE", size_text.c_str()}};
  auto r = comm::init_env(std::chrono::seconds(20));
  CHECK(r.rank == w.rank);
  CHECK(r.size == w.size);
  CHECK(r.local_rank == w.rank);
  r.store->set("env/" + rank_text, rank_text);
  for (int i = 0; i < w.size; ++i) {
    auto v = r.store->get("env/" + std::to_string(i));
    CHECK(std::string(v.begin(), v.end()) == std::to_string(i));
  }
  // Rank 0 hosts the server: keep it up until everyone has read.
  r.store->add("env/done", 1);
  r.store->wait({"env/done"});
  if (w.rank == 0) {
    while (r.store->add("env/done", 0) < w.size) std::this_thread::yield();
  }
  comm::test::barrier();
}

TEST_CASE("tcp:// and file:// rendezvous across real processes") {
  const auto& w = comm::test::world();
  SUBCASE("tcp") {
    const auto port = comm::test::shared_free_port();
    auto r = comm::init_method("tcp://127.0.0.1:" + std::to_string(port), w.rank, w.size, std::chrono::seconds(20));
    CHECK(r.store->add("tcp/count", 1) >= 1);
    r.store->wait({"tcp/count"});
    comm::test::barrier();
    CHECK(r.store->add("tcp/count", 0) == w.size);
    comm::test::barrier();
  }
  SUBCASE("file") {
    auto ws = comm::test::fresh_store();
    if (w.rank == 0) {
      auto dir = std::filesystem::temp_directory_path() / ("comm-init-test-" + std::to_string(::getpid()));
      std::filesystem::create_directories(dir);
      ws->set("path", (dir / "store").string());
    }
    auto p = ws->get("path");
    const std::string path(p.begin(), p.end());
    auto r = comm::init_method("file://" + path, w.rank, w.size, std::chrono::seconds(20));
    r.store->add("file/count", 1);
    comm::test::barrier();
    CHECK(r.store->add("file/count", 0) == w.size);
    comm::test::barrier();
    if (w.rank == 0) std::filesystem::remove_all(std::filesystem::path(path).parent_path());
  }
}
