// comm's direct connections for the Gloo engine's frames (detail/gloo/direct.hpp), in one process:
// two DirectLinks on threads, or one against a raw socket that plays rank 0 and breaks the
// protocol. Checks order and bytes, deadlines, close() from another thread, a peer that goes
// away, and what a stranger or a broken peer can do (an error naming the peer, nothing read
// beyond the receive).
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>

#include <array>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <comm/detail/gloo/direct.hpp>
#include <comm/error.hpp>
#include <comm/store.hpp>

using namespace std::chrono_literals;
using comm::detail::Fd;
using comm::detail::gloo::Deadline;
using comm::detail::gloo::DeviceSpec;
using comm::detail::gloo::DirectLinks;
using comm::detail::gloo::DirectSecret;
using comm::detail::gloo::WaitGate;

namespace {

const DeviceSpec kLoopback{"", "127.0.0.1", "test"};

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

/// Rank 0's part of the secret, played by hand: draws one and publishes it.
DirectSecret publish_secret(comm::Store& store, const std::string& prefix) {
  const DirectSecret s = comm::detail::gloo::draw_direct_secret(0);
  store.set(comm::detail::gloo::direct_secret_key(prefix), std::span<const std::uint8_t>(s.data(), s.size()));
  return s;
}

/// Connects to rank 1's published address and sends `hello_bytes` of a hello with `secret`.
Fd impersonate_rank0(comm::Store& store, const std::string& prefix, const DirectSecret& secret,
                     std::size_t hello_bytes = DirectLinks::kHelloSize) {
  store.wait({prefix + "1"}, 10s);
  const auto v = store.get(prefix + "1");
  const std::string addr(v.begin(), v.end());
  const auto colon = addr.rfind(':');
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<std::uint16_t>(std::stoi(addr.substr(colon + 1))));
  REQUIRE(::inet_pton(AF_INET, addr.substr(0, colon).c_str(), &sa.sin_addr) == 1);
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  REQUIRE(::connect(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0);
  std::array<std::uint8_t, DirectLinks::kHelloSize> hello{};
  const std::uint32_t head[2] = {DirectLinks::kHelloMagic, 0};
  std::memcpy(hello.data(), head, 8);
  std::memcpy(hello.data() + 8, secret.data(), secret.size());
  REQUIRE(::send(fd.get(), hello.data(), hello_bytes, MSG_NOSIGNAL) == static_cast<ssize_t>(hello_bytes));
  return fd;
}

/// Runs `f`, which must throw E naming `peer`; returns the error's text.
template <class E, class F>
std::string expect_error(F&& f, const char* peer = "rank 0") {
  try {
    f();
  } catch (const E& e) {
    CHECK(e.peer() == peer);
    return e.what();
  }
  FAIL("no error");
  return {};
}

void send_raw(const Fd& fd, std::uint32_t magic, std::uint32_t len, const void* payload, std::size_t n) {
  std::array<std::uint32_t, 2> h{magic, len};
  REQUIRE(::send(fd.get(), h.data(), 8, MSG_NOSIGNAL) == 8);
  if (n != 0) REQUIRE(::send(fd.get(), payload, n, MSG_NOSIGNAL) == static_cast<ssize_t>(n));
}

/// Rank 1's links, connected to an impersonated rank 0 (after whatever `before` connects), with
/// a receive of `cap` bytes posted for rank 0 and the deadline `t` for waiting on it.
struct AgainstRaw {
  comm::HashStore store;
  std::unique_ptr<DirectLinks> links;
  Fd raw;
  std::array<std::byte, 64> buf{};
  WaitGate gate;
  Deadline d;
  std::uint64_t ticket = 0;

  template <class Before>
  AgainstRaw(const std::string& prefix, std::chrono::milliseconds t, std::size_t cap, Before&& before) : d(t, gate) {
    std::thread th([&] { links = std::make_unique<DirectLinks>(store, prefix, 1, 2, kLoopback, 10s); });
    const DirectSecret secret = publish_secret(store, prefix);
    before(store, secret);
    raw = impersonate_rank0(store, prefix, secret);
    th.join();
    REQUIRE(links);
    ticket = links->post_recv(0, buf.data(), cap);
  }
  AgainstRaw(const std::string& prefix, std::chrono::milliseconds t, std::size_t cap = 64)
      : AgainstRaw(prefix, t, cap, [](comm::Store&, const DirectSecret&) {}) {}

  void wait(std::uint64_t seq) { links->wait_received(0, ticket, d, "all_gather", seq); }
  /// The posted receive's error (a RemoteError naming rank 0), as text.
  std::string failure() {
    return expect_error<comm::RemoteError>([&] { wait(1); });
  }
};

/// Ranks 0 and 1, connected on threads.
struct Pair {
  comm::HashStore store;
  std::unique_ptr<DirectLinks> l0, l1;
  explicit Pair(const std::string& prefix) {
    std::thread t([&] { l1 = std::make_unique<DirectLinks>(store, prefix, 1, 2, kLoopback, 10s); });
    l0 = std::make_unique<DirectLinks>(store, prefix, 0, 2, kLoopback, 10s);
    t.join();
    REQUIRE(l1);
  }
};

/// While alive: COMM_DEBUG=WARN, and what this process writes to stderr goes to a file.
struct StderrCapture {
  std::string path;
  int saved = -1;
  StderrCapture() {
    char tmpl[] = "/tmp/comm-direct-log-XXXXXX";
    const int fd = ::mkstemp(tmpl);
    REQUIRE(fd >= 0);
    path = tmpl;
    std::fflush(stderr);
    saved = ::dup(2);
    ::dup2(fd, 2);
    ::close(fd);
    ::setenv("COMM_DEBUG", "WARN", 1);
  }
  /// Restores stderr and returns what was written meanwhile.
  std::string finish() {
    if (saved >= 0) {
      std::fflush(stderr);
      ::dup2(saved, 2);
      ::close(saved);
      saved = -1;
      ::unsetenv("COMM_DEBUG");
    }
    std::ifstream in(path);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  ~StderrCapture() {
    (void)finish();
    std::remove(path.c_str());
  }
};

std::size_t count_of(const std::string& hay, const std::string& needle) {
  std::size_t n = 0;
  for (auto p = hay.find(needle); p != std::string::npos; p = hay.find(needle, p + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("direct links: messages arrive in order with their bytes, both ways at once, large ones too") {
  Pair p("ok/");
  auto& l0 = p.l0;
  auto& l1 = p.l1;
  // Sizes include an empty message and ones far above a socket buffer (the sender must be driven
  // while it waits for the receiver to read).
  const std::vector<std::size_t> sizes{0, 8, 4096, std::size_t{3} << 20, 100};
  auto run = [&](DirectLinks& me, int peer, std::uint8_t seed) {
    WaitGate gate;
    const Deadline d(20s, gate);
    std::vector<std::vector<std::byte>> out, in;
    std::vector<std::uint64_t> sends, recvs;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      in.emplace_back(sizes[k] + 16);
      recvs.push_back(me.post_recv(peer, in.back().data(), in.back().size()));
    }
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      out.emplace_back(sizes[k]);
      for (std::size_t i = 0; i < sizes[k]; ++i) out.back()[i] = std::byte(static_cast<std::uint8_t>(seed + k + i * 7));
      sends.push_back(me.send(peer, out.back().data(), sizes[k]));
    }
    for (std::size_t k = 0; k < sizes.size(); ++k) me.wait_received(peer, recvs[k], d, "test", k);
    for (std::size_t k = 0; k < sizes.size(); ++k) me.wait_sent(peer, sends[k], d, "test", k);
    int wrong = 0;
    const auto other = static_cast<std::uint8_t>(seed == 1 ? 2 : 1);
    for (std::size_t k = 0; k < sizes.size(); ++k)
      for (std::size_t i = 0; i < sizes[k]; ++i)
        wrong += in[k][i] != std::byte(static_cast<std::uint8_t>(other + k + i * 7)) ? 1 : 0;
    return wrong;
  };
  int wrong1 = -1;
  std::thread t1([&] { wrong1 = run(*l1, 0, 2); });
  const int wrong0 = run(*l0, 1, 1);
  t1.join();
  CHECK(wrong0 == 0);
  CHECK(wrong1 == 0);
}

TEST_CASE("direct links: a receive nobody sends to ends at its deadline with Timeout naming the peer") {
  AgainstRaw c("timeout/", 300ms);
  const auto t0 = Clock::now();
  const auto what = expect_error<comm::Timeout>([&] { c.wait(7); });
  CHECK(what.find("op #7") != std::string::npos);
  CHECK(seconds_since(t0) < 2.0);
}

TEST_CASE("direct links: close() from another thread ends a wait at once, and the peer sees the close") {
  Pair p("close/");
  auto& l0 = p.l0;
  auto& l1 = p.l1;
  std::array<std::byte, 64> b0{}, b1{};
  WaitGate gate;
  const Deadline d(30s, gate);
  const auto r0 = l0->post_recv(1, b0.data(), b0.size());
  const auto r1 = l1->post_recv(0, b1.data(), b1.size());
  std::thread closer([&] {
    std::this_thread::sleep_for(100ms);
    l0->close();
  });
  const auto t0 = Clock::now();
  CHECK_THROWS_WITH_AS(l0->wait_received(1, r0, d, "broadcast", 1), "receive aborted", ::gloo::IoException);
  CHECK(seconds_since(t0) < 5.0);
  closer.join();
  const auto what = expect_error<comm::RemoteError>([&] { l1->wait_received(0, r1, d, "broadcast", 1); });
  CHECK(what.find("closed") != std::string::npos);
  CHECK(seconds_since(t0) < 5.0);
}

TEST_CASE("direct links: bytes that are not a frame are a RemoteError naming the sender, nothing is read") {
  AgainstRaw c("garbage/", 10s);
  send_raw(c.raw, 0x12345678u, 8, "ABCDEFGH", 8);
  CHECK(c.failure().find("not a comm frame") != std::string::npos);
  CHECK(c.buf[0] == std::byte{0});
  // The connection stays failed: a later receive fails at once instead of reading the rest.
  c.ticket = c.links->post_recv(0, c.buf.data(), c.buf.size());
  CHECK(c.failure().find("not a comm frame") != std::string::npos);
}

TEST_CASE("direct links: a message longer than the receive is refused before any of it is read") {
  AgainstRaw c("long/", 10s, 16);
  const std::vector<char> payload(64, 'x');
  send_raw(c.raw, DirectLinks::kFrameMagic, 64, payload.data(), payload.size());
  CHECK(c.failure().find("64 bytes for a receive of 16") != std::string::npos);
  CHECK(c.buf[0] == std::byte{0});
  // A length near 4 GiB allocates nothing either: the receive's own buffer is all there is.
  AgainstRaw huge("huge/", 10s);
  send_raw(huge.raw, DirectLinks::kFrameMagic, 0xfffffff0u, nullptr, 0);
  CHECK(huge.failure().find("4294967280 bytes") != std::string::npos);
}

TEST_CASE("direct links: a peer that goes away mid-message is a RemoteError, not a wait to the deadline") {
  AgainstRaw c("gone/", 30s);
  send_raw(c.raw, DirectLinks::kFrameMagic, 32, "half", 4);
  std::thread killer([&] {
    std::this_thread::sleep_for(100ms);
    c.raw.reset();
  });
  const auto t0 = Clock::now();
  CHECK(c.failure().find("closed") != std::string::npos);
  killer.join();
  CHECK(seconds_since(t0) < 5.0);
}

TEST_CASE("direct links: strangers (a wrong secret, no secret) are refused and logged, the real peer is accepted") {
  StderrCapture log;
  Fd silent;  // a stranger that never completes its hello, open until the end
  const auto t0 = Clock::now();
  {
    AgainstRaw c("stranger/", 10s, 64, [&](comm::Store& store, const DirectSecret& secret) {
      // Connect first, with one bit of the secret wrong: rank 1 must not take it for rank 0.
      DirectSecret wrong = secret;
      wrong[5] ^= 0x10;
      Fd s = impersonate_rank0(store, "stranger/", wrong);
      const std::array<std::uint32_t, 3> frame{DirectLinks::kFrameMagic, 4, 0x6c697665};
      (void)::send(s.get(), frame.data(), 12, MSG_NOSIGNAL);  // may meet the reset of the refusal
      // No secret: the old 16-byte hello (magic, rank, a hash anyone could compute), then silence.
      silent = impersonate_rank0(store, "stranger/", DirectSecret{}, 16);
    });
    // The silent stranger held up nobody: its 5 s for a hello ran beside the real handshake.
    CHECK(seconds_since(t0) < 3.0);
    send_raw(c.raw, DirectLinks::kFrameMagic, 4, "good", 4);
    c.wait(1);
    CHECK(std::memcmp(c.buf.data(), "good", 4) == 0);
  }
  const std::string said = log.finish();
  INFO(said);
  CHECK(count_of(said, "comm WARN: gloo direct connections: rank 1 refused a connection from 127.0.0.1:") == 2);
  CHECK(count_of(said, ": wrong secret") == 1);
  CHECK(count_of(said, "\n") == 2);  // nothing else
}

TEST_CASE("direct links: the secret is rank 0's random draw, published under the prefix") {
  Pair a("secret-a/"), b("secret-b/");
  const auto sa = a.store.get(comm::detail::gloo::direct_secret_key("secret-a/"));
  const auto sb = b.store.get(comm::detail::gloo::direct_secret_key("secret-b/"));
  CHECK(sa.size() == 16);
  CHECK(sb.size() == 16);
  CHECK(sa != sb);  // per communicator, not derived from anything a stranger knows
  comm::HashStore store;
  store.set(comm::detail::gloo::direct_secret_key("short/"), std::string("0123"));
  const auto what = expect_error<comm::Error>([&] { DirectLinks l(store, "short/", 1, 2, kLoopback, 2s); });
  CHECK(what.find("secret") != std::string::npos);
}

TEST_CASE("direct links: a malformed address in the store is a clear error, not a crash") {
  comm::HashStore store;
  store.set("bad/1", std::string("no-port-here"));
  const auto what = expect_error<comm::Error>([&] { DirectLinks l(store, "bad/", 0, 2, kLoopback, 2s); }, "rank 1");
  CHECK(what.find("malformed") != std::string::npos);
}
