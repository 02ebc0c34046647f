// The TcpStore server against hostile or broken peers: raw sockets send junk, bad magic, huge
// length prefixes, stalled requests, wrong tokens and many connections. After each, the server
// must still serve a normal client, and memory must not follow the lengths peers claim.
#include <doctest/doctest.h>

#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <comm/detail/net/socket.hpp>
#include <comm/detail/store/protocol.hpp>
#include <comm/store.hpp>
#include <support/multirank.hpp>

using namespace std::chrono_literals;
namespace sp = comm::detail::store_proto;
using Bytes = std::vector<std::uint8_t>;
using Clock = std::chrono::steady_clock;

namespace {

// The stall timeout of the servers that test stalls; the others keep the 5 s default so that a
// loaded machine cannot make a slow but honest client look stalled.
constexpr auto stall = 300ms;
// Explicit, so that the tests do not depend on the COMM_STORE_TOKEN that comm-run sets.
constexpr std::string_view token = "proto-test-token";

comm::TcpStoreOptions client_options() {
  comm::TcpStoreOptions o;
  o.timeout = 3s;
  o.token = token;
  return o;
}

comm::TcpStoreOptions server_options() {
  comm::TcpStoreOptions o;
  o.token = token;
  o.is_server = true;
  o.timeout = 5s;
  o.rank = 0;
  return o;
}

comm::TcpStoreOptions stalling_server_options() {
  auto o = server_options();
  o.stall_timeout = stall;
  return o;
}

std::chrono::milliseconds since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
}

bool contains(std::string_view hay, std::string_view needle) { return hay.find(needle) != std::string_view::npos; }

// Resident memory of this process, in KiB.
long rss_kib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  return -1;
}

// A raw TCP client that speaks whatever the test makes it speak.
struct Raw {
  comm::detail::Fd fd;

  explicit Raw(std::uint16_t port, const std::string& host = "127.0.0.1") {
    const auto r = comm::detail::resolve(host, port);
    REQUIRE_FALSE(r.addrs.empty());
    int err = 0;
    fd = comm::detail::connect_once(r.addrs.front(), comm::detail::deadline_after(2s), err);
    REQUIRE_MESSAGE(fd.valid(), "connect: " << comm::detail::errno_text(err));
  }

  // Best effort: the server may already have dropped us.
  bool send(std::span<const std::uint8_t> b) { return comm::detail::send_all(fd.get(), b, comm::detail::deadline_after(2s)).ok(); }
  bool send(std::string_view s) { return send(comm::detail::as_bytes(s)); }

  // Reads exactly n bytes (false if the server closed first or 2 s passed).
  bool read(std::span<std::uint8_t> b) { return comm::detail::recv_all(fd.get(), b, comm::detail::deadline_after(2s)).ok(); }

  // Reads until the server closes the connection or `within` passes.
  struct Outcome {
    bool closed = false;
    Bytes got;
  };
  Outcome read_until_closed(std::chrono::milliseconds within) {
    Outcome o;
    const auto deadline = comm::detail::deadline_after(within);
    std::uint8_t buf[4096];
    for (;;) {
      if (!comm::detail::wait_ready(fd.get(), POLLIN, deadline).ok()) return o;
      const ssize_t n = ::recv(fd.get(), buf, sizeof buf, 0);
      if (n > 0) {
        o.got.insert(o.got.end(), buf, buf + n);
        continue;
      }
      if (n == 0 || errno == ECONNRESET) {
        o.closed = true;
        return o;
      }
      if (errno != EAGAIN && errno != EINTR) return o;
    }
  }

  // Sends a hello and returns the reply's status (-1: no reply).
  int hello(std::string_view tok = token, std::uint16_t version = sp::version) {
    auto h = sp::encode_hello(tok, 0, comm::detail::job_id_from_env());  // the server's default
    h[4] = static_cast<std::uint8_t>(version);
    h[5] = static_cast<std::uint8_t>(version >> 8);
    if (!send(h)) return -1;
    std::uint8_t head[sp::hello_reply_size];
    if (!read(head)) return -1;
    sp::Reader r(head);
    if (r.u32() != sp::magic) return -1;
    (void)r.u16();
    const int status = r.u8();
    std::string msg(r.u16(), '\0');
    if (!msg.empty() && !read(std::span(reinterpret_cast<std::uint8_t*>(msg.data()), msg.size()))) return -1;
    return status;
  }

  // Reads one reply frame (empty if none came).
  Bytes reply() {
    std::uint8_t head[8];
    if (!read(head)) return {};
    const auto len = sp::read_u64(head);
    if (len == 0 || len > (1u << 20)) return {};
    Bytes p(len);
    if (!read(p)) return {};
    return p;
  }
};

template <class F>
Bytes frame(sp::Op op, F&& fields) {
  Bytes f;
  const auto at = sp::begin_frame(f);
  f.push_back(static_cast<std::uint8_t>(op));
  sp::Writer w(f);
  fields(w);
  sp::finish_frame(f, at);
  return f;
}

Bytes header(std::uint64_t len) {
  Bytes h;
  sp::Writer(h).u64(len);
  return h;
}

// A normal client can still use the server, with correct results.
void check_healthy(std::uint16_t port, std::string_view tok = token) {
  static int n = 0;
  const std::string key = "health/" + std::to_string(n++);
  auto o = client_options();
  o.token = tok;
  comm::TcpStore c("127.0.0.1", port, o);
  c.set(key, "ok-" + key);
  const auto v = c.get(key);
  CHECK(std::string(v.begin(), v.end()) == "ok-" + key);
  CHECK(c.add(key + "/n", 3) == 3);
  CHECK(c.check(key));
}

// The LISTEN sockets on `port` in /proc/net/tcp{,6}, as their hex local addresses.
std::vector<std::string> listening_addresses(std::uint16_t port) {
  std::vector<std::string> out;
  char want[8];
  std::snprintf(want, sizeof want, "%04X", port);
  for (const char* file : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream f(file);
    std::string line;
    std::getline(f, line);  // header
    while (std::getline(f, line)) {
      std::istringstream is(line);
      std::string slot, local, remote, state;
      is >> slot >> local >> remote >> state;
      const auto colon = local.rfind(':');
      if (state == "0A" && colon != std::string::npos && local.substr(colon + 1) == want)
        out.push_back(local.substr(0, colon));
    }
  }
  return out;
}

}  // namespace

TEST_CASE("the server binds loopback only when asked for loopback, IPv4 and IPv6") {
  comm::TcpStore v4("127.0.0.1", 0, server_options());
  auto addrs = listening_addresses(v4.port());
  REQUIRE(addrs.size() == 1);
  CHECK(addrs[0] == "0100007F");  // 127.0.0.1, not 0.0.0.0

  comm::TcpStore v6("::1", 0, server_options());
  addrs = listening_addresses(v6.port());
  REQUIRE(addrs.size() == 1);
  CHECK(addrs[0] == "00000000000000000000000001000000");  // ::1, not ::

  comm::TcpStore local("localhost", 0, server_options());
  addrs = listening_addresses(local.port());
  REQUIRE_FALSE(addrs.empty());
  for (const auto& a : addrs) CHECK((a == "0100007F" || a == "00000000000000000000000001000000"));
  check_healthy(local.port());
}

TEST_CASE("connecting to a port nobody serves ends with Timeout within the deadline") {
  const auto port = comm::detail::free_port();
  comm::TcpStoreOptions o;
  o.timeout = 300ms;
  o.rank = 3;
  const auto t0 = Clock::now();
  try {
    comm::TcpStore c("127.0.0.1", port, o);
    FAIL("connected to nothing");
  } catch (const comm::Timeout& e) {
    const auto took = since(t0);
    CHECK(took >= 290ms);
    CHECK(took < 2300ms);
    CHECK(e.op() == "store.connect");
    CHECK(e.rank() == 3);
    CHECK(contains(e.what(), "127.0.0.1:" + std::to_string(port)));
  }
}

TEST_CASE("junk and a bad magic are dropped without a reply; the server keeps serving") {
  comm::TcpStore s("127.0.0.1", 0, server_options());
  {
    Raw r(s.port());
    Bytes junk(4096);
    std::uint32_t x = 12345;
    for (auto& b : junk) b = static_cast<std::uint8_t>((x = x * 1103515245u + 12345u) >> 16);
    junk[0] = 'X';  // never the magic
    r.send(junk);
    const auto o = r.read_until_closed(2s);
    CHECK(o.closed);
    CHECK(o.got.empty());
  }
  check_healthy(s.port());
  {
    Raw r(s.port());
    r.send("GET / HTTP/1.0\r\n\r\n");
    const auto o = r.read_until_closed(2s);
    CHECK(o.closed);
    CHECK(o.got.empty());
  }
  check_healthy(s.port());
  {
    Raw r(s.port());
    CHECK(r.hello(token, sp::version + 1) == static_cast<int>(sp::HelloStatus::bad_version));
    CHECK(r.read_until_closed(2s).closed);
  }
  check_healthy(s.port());
}

TEST_CASE("a huge length prefix gets an error reply and a drop, and allocates nothing") {
  comm::TcpStore s("127.0.0.1", 0, server_options());
  check_healthy(s.port());
  const long rss0 = rss_kib();
  const auto cap = sp::frame_limit(comm::TcpStoreOptions{}.max_key_bytes, comm::TcpStoreOptions{}.max_value_bytes);
  for (const std::uint64_t len : {std::uint64_t{1} << 63, ~std::uint64_t{0}, std::uint64_t{0},
                                  static_cast<std::uint64_t>(cap) + 1}) {
    INFO("length prefix " << len);
    Raw r(s.port());
    REQUIRE(r.hello() == 0);
    r.send(header(len));
    const auto o = r.read_until_closed(2s);
    CHECK(o.closed);
    REQUIRE(o.got.size() > 9);
    CHECK(o.got[8] == static_cast<std::uint8_t>(sp::Status::invalid));
    CHECK(contains(std::string(o.got.begin(), o.got.end()), "limit"));
  }
  CHECK(rss_kib() - rss0 < 16 * 1024);
  check_healthy(s.port());
}

TEST_CASE("a frame that claims 100 MiB and stalls is dropped at the stall timeout, without the 100 MiB") {
  comm::TcpStore s("127.0.0.1", 0, stalling_server_options());
  const long rss0 = rss_kib();
  Raw r(s.port());
  REQUIRE(r.hello() == 0);
  r.send(header(100u << 20));
  r.send(Bytes(1000, 7));
  const auto t0 = Clock::now();
  std::this_thread::sleep_for(stall / 3);
  CHECK(rss_kib() - rss0 < 16 * 1024);  // while the server still holds the partial frame
  const auto o = r.read_until_closed(3s);
  CHECK(o.closed);
  CHECK(since(t0) >= stall - 50ms);
  CHECK(since(t0) < stall + 3000ms);
  check_healthy(s.port());
}

TEST_CASE("half-sent handshakes and requests are dropped at the stall timeout") {
  comm::TcpStore s("127.0.0.1", 0, stalling_server_options());
  auto expect_dropped = [&](Raw& r) {
    const auto t0 = Clock::now();
    const auto o = r.read_until_closed(3s);
    CHECK(o.closed);
    CHECK(since(t0) < stall + 3000ms);
  };
  {
    Raw silent(s.port());  // connects and says nothing
    expect_dropped(silent);
  }
  {
    Raw r(s.port());
    const auto h = sp::encode_hello(token, 0, comm::detail::job_id_from_env());
    r.send(std::span(h).first(6));
    expect_dropped(r);
  }
  {
    Raw r(s.port());
    REQUIRE(r.hello() == 0);
    r.send(Bytes{5, 0, 0});  // 3 of the 8 header bytes
    expect_dropped(r);
  }
  {
    Raw r(s.port());
    REQUIRE(r.hello() == 0);
    auto f = frame(sp::Op::set, [](sp::Writer& w) {
      w.str("k");
      w.str("value");
    });
    r.send(std::span(f).first(f.size() - 2));  // all but the last 2 bytes
    expect_dropped(r);
  }
  {
    Raw idle(s.port());  // a handshaken, idle connection is NOT dropped
    REQUIRE(idle.hello() == 0);
    const auto o = idle.read_until_closed(stall * 2);
    CHECK_FALSE(o.closed);
    idle.send(frame(sp::Op::num_keys, [](sp::Writer&) {}));
    CHECK(idle.reply().size() == 9);
  }
  check_healthy(s.port());
}

TEST_CASE("a client that sends half a frame holds nothing on the server past the stall timeout") {
  auto so = stalling_server_options();
  so.max_connections = 3;  // the test's store client, and two more
  comm::TcpStore s("127.0.0.1", 0, so);
  const std::string big(200 << 10, 'v');
  auto f = frame(sp::Op::set, [&](sp::Writer& w) {
    w.str("half");
    w.str(big);
  });
  {
    // Two connections each send half of a 200 KiB set and go silent: they hold both free slots.
    Raw a(s.port()), b(s.port());
    REQUIRE(a.hello() == 0);
    REQUIRE(b.hello() == 0);
    REQUIRE(a.send(std::span(f).first(f.size() / 2)));
    REQUIRE(b.send(std::span(f).first(f.size() / 2)));
    const auto t0 = Clock::now();
    CHECK(a.read_until_closed(stall + 3000ms).closed);
    CHECK(b.read_until_closed(stall + 3000ms).closed);
    CHECK(since(t0) < stall + 3000ms);
  }
  // Their slots and buffers are free again: two new clients are served, and nothing was stored.
  Raw c(s.port()), d(s.port());
  CHECK(c.hello() == 0);
  CHECK(d.hello() == 0);
  CHECK_FALSE(s.check("half"));
  CHECK(s.num_keys() == 0);
}

TEST_CASE("a wrong token is rejected with a clear error; the right one (or COMM_STORE_TOKEN) is accepted") {
  const char* env = std::getenv("COMM_STORE_TOKEN");
  const std::optional<std::string> saved = env ? std::optional<std::string>(env) : std::nullopt;
  ::unsetenv("COMM_STORE_TOKEN");
  auto so = server_options();
  so.token = "s3cret";
  comm::TcpStore s("127.0.0.1", 0, so);
  {
    Raw r(s.port());
    CHECK(r.hello("wrong") == static_cast<int>(sp::HelloStatus::wrong_token));
    CHECK(r.read_until_closed(2s).closed);
  }
  comm::TcpStoreOptions c;
  c.timeout = 2s;
  c.rank = 5;
  for (const char* token : {"wrong", ""}) {
    c.token = token;
    try {
      comm::TcpStore bad("127.0.0.1", s.port(), c);
      FAIL("accepted token '" << token << "'");
    } catch (const comm::Error& e) {
      CHECK(contains(e.what(), "store.connect"));
      CHECK(contains(e.what(), "rejected: wrong token"));
      CHECK(contains(e.what(), "rank 5"));
    }
  }
  check_healthy(s.port(), "s3cret");
  ::setenv("COMM_STORE_TOKEN", "s3cret", 1);
  c.token.clear();
  comm::TcpStore from_env("127.0.0.1", s.port(), c);
  from_env.set("k", "v");
  if (saved) {
    ::setenv("COMM_STORE_TOKEN", saved->c_str(), 1);
  } else {
    ::unsetenv("COMM_STORE_TOKEN");
  }
  CHECK(s.check("k"));

  // A server without a token refuses a client that brings one: both sides must agree.
  auto open = server_options();
  open.token.clear();
  ::unsetenv("COMM_STORE_TOKEN");
  comm::TcpStore s2("127.0.0.1", 0, open);
  c.token = "unexpected";
  CHECK_THROWS_AS(comm::TcpStore("127.0.0.1", s2.port(), c), comm::InvalidArgument);
  if (saved) ::setenv("COMM_STORE_TOKEN", saved->c_str(), 1);
}

TEST_CASE("the job id: another job's client is refused with the server's job id; version 1 hellos have none") {
  auto so = server_options();
  so.job_id = "job-A";
  comm::TcpStore s("127.0.0.1", 0, so);
  auto hello_as = [&](Raw& r, std::string_view job, std::uint16_t version, std::string* msg) {
    auto h = sp::encode_hello(token, 3, job);
    if (version == 1) {
      h.resize(h.size() - 2 - job.size());  // version 1 ends after the token
      h[4] = 1;
      h[5] = 0;
    }
    REQUIRE(r.send(h));
    std::uint8_t head[sp::hello_reply_size];
    REQUIRE(r.read(head));
    sp::Reader rd(head);
    CHECK(rd.u32() == sp::magic);
    (void)rd.u16();
    const int status = rd.u8();
    msg->assign(rd.u16(), '\0');
    if (!msg->empty()) REQUIRE(r.read(std::span(reinterpret_cast<std::uint8_t*>(msg->data()), msg->size())));
    return status;
  };
  std::string msg;
  {
    Raw r(s.port());
    CHECK(hello_as(r, "job-B", sp::version, &msg) == static_cast<int>(sp::HelloStatus::wrong_job));
    CHECK(msg == "job-A");
    CHECK(r.read_until_closed(2s).closed);
  }
  {
    Raw r(s.port());  // a version 1 client has no job id: not this job's
    CHECK(hello_as(r, "", 1, &msg) == static_cast<int>(sp::HelloStatus::wrong_job));
    CHECK(r.read_until_closed(2s).closed);
  }
  {
    Raw r(s.port());  // the right job but the wrong token is still refused
    auto h = sp::encode_hello("wrong", 3, "job-A");
    REQUIRE(r.send(h));
    std::uint8_t head[sp::hello_reply_size];
    REQUIRE(r.read(head));
    CHECK(head[6] == static_cast<std::uint8_t>(sp::HelloStatus::wrong_token));
  }
  {
    Raw r(s.port());
    CHECK(hello_as(r, "job-A", sp::version, &msg) == 0);
    r.send(frame(sp::Op::num_keys, [](sp::Writer&) {}));
    CHECK(r.reply().size() == 9);
  }
  {
    Raw r(s.port());  // a job id over the limit: dropped without a reply
    auto h = sp::encode_hello(token, 3, "");
    h[h.size() - 2] = 0xff;
    h[h.size() - 1] = 0xff;
    REQUIRE(r.send(h));
    const auto o = r.read_until_closed(2s);
    CHECK(o.closed);
    CHECK(o.got.empty());
  }
  auto v1 = server_options();
  v1.job_id = "";
  const char* env = std::getenv("COMM_JOB_ID");
  const std::optional<std::string> saved = env ? std::optional<std::string>(env) : std::nullopt;
  ::unsetenv("COMM_JOB_ID");
  {
    comm::TcpStore none("127.0.0.1", 0, v1);
    Raw r(none.port());  // no job id on either side: version 1 clients are served
    CHECK(hello_as(r, "", 1, &msg) == 0);
    r.send(frame(sp::Op::num_keys, [](sp::Writer&) {}));
    CHECK(r.reply().size() == 9);
  }
  if (saved) ::setenv("COMM_JOB_ID", saved->c_str(), 1);
  auto c = client_options();
  c.job_id = "job-A";
  comm::TcpStore client("127.0.0.1", s.port(), c);
  client.set("k", "v");
  CHECK(client.check("k"));
}

TEST_CASE("malformed and oversized requests get an error reply; the server keeps serving") {
  comm::TcpStore s("127.0.0.1", 0, server_options());
  {
    Raw r(s.port());
    REQUIRE(r.hello() == 0);
    r.send(frame(sp::Op::set, [](sp::Writer& w) { w.u64(1000); }));  // a key length with no key
    const auto p = r.reply();
    REQUIRE_FALSE(p.empty());
    CHECK(p[0] == static_cast<std::uint8_t>(sp::Status::invalid));
    CHECK(r.read_until_closed(2s).closed);
  }
  {
    Raw r(s.port());
    REQUIRE(r.hello() == 0);
    r.send(frame(static_cast<sp::Op>(99), [](sp::Writer&) {}));
    const auto p = r.reply();
    REQUIRE_FALSE(p.empty());
    CHECK(p[0] == static_cast<std::uint8_t>(sp::Status::invalid));
    CHECK(r.read_until_closed(2s).closed);
  }
  {
    Raw r(s.port());
    REQUIRE(r.hello() == 0);
    r.send(frame(sp::Op::num_keys, [](sp::Writer& w) { w.u8(1); }));  // trailing bytes
    const auto p = r.reply();
    REQUIRE_FALSE(p.empty());
    CHECK(p[0] == static_cast<std::uint8_t>(sp::Status::invalid));
  }
  {
    // Well-formed but over the server's limits: refused, and the connection stays usable.
    Raw r(s.port());
    REQUIRE(r.hello() == 0);
    r.send(frame(sp::Op::set, [](sp::Writer& w) {
      w.str(std::string(5000, 'k'));
      w.str("v");
    }));
    auto p = r.reply();
    REQUIRE_FALSE(p.empty());
    CHECK(p[0] == static_cast<std::uint8_t>(sp::Status::invalid));
    CHECK(contains(std::string(p.begin(), p.end()), "max_key_bytes"));
    r.send(frame(sp::Op::set, [](sp::Writer& w) {
      w.str("fine");
      w.str("v");
    }));
    p = r.reply();
    REQUIRE(p.size() == 1);
    CHECK(p[0] == static_cast<std::uint8_t>(sp::Status::ok));
  }
  CHECK(s.check("fine"));
  check_healthy(s.port());
}

TEST_CASE("pipelined requests are answered in order; parked gets wake up or are forgotten") {
  comm::TcpStore s("127.0.0.1", 0, server_options());
  Raw r(s.port());
  REQUIRE(r.hello() == 0);
  Bytes batch;
  auto add = [&](const Bytes& f) { batch.insert(batch.end(), f.begin(), f.end()); };
  add(frame(sp::Op::set, [](sp::Writer& w) {
    w.str("p");
    w.str("v1");
  }));
  add(frame(sp::Op::get, [](sp::Writer& w) {
    w.str("p");
    w.u64(0);
  }));
  add(frame(sp::Op::get, [](sp::Writer& w) {
    w.str("absent");
    w.u64(0);
  }));
  add(frame(sp::Op::add, [](sp::Writer& w) {
    w.str("n");
    w.i64(5);
  }));
  r.send(batch);
  auto p = r.reply();
  CHECK(p == Bytes{0});
  p = r.reply();
  REQUIRE(p.size() == 11);
  CHECK(std::string(p.begin() + 9, p.end()) == "v1");
  p = r.reply();
  REQUIRE_FALSE(p.empty());
  CHECK(p[0] == static_cast<std::uint8_t>(sp::Status::timeout));
  p = r.reply();
  REQUIRE(p.size() == 9);
  CHECK(sp::Reader(std::span(p).subspan(1)).i64() == 5);

  // A parked get is answered by another client's set.
  r.send(frame(sp::Op::get, [](sp::Writer& w) {
    w.str("wake");
    w.u64(5000);
  }));
  std::this_thread::sleep_for(20ms);
  s.set("wake", "up");
  p = r.reply();
  REQUIRE(p.size() == 11);
  CHECK(std::string(p.begin() + 9, p.end()) == "up");

  // A parked get whose client leaves is forgotten.
  {
    Raw gone(s.port());
    REQUIRE(gone.hello() == 0);
    gone.send(frame(sp::Op::wait, [](sp::Writer& w) {
      w.u32(2);
      w.str("w1");
      w.str("w2");
      w.u64(10000);
    }));
    std::this_thread::sleep_for(20ms);
  }
  std::this_thread::sleep_for(20ms);
  s.set("w1", "x");
  s.set("w2", "x");
  check_healthy(s.port());
}

TEST_CASE("many connections: idle floods are shed, the connection limit is enforced and reported") {
  {
    comm::TcpStore s("127.0.0.1", 0, stalling_server_options());
    std::vector<std::unique_ptr<Raw>> flood;
    for (int i = 0; i < 200; ++i) flood.push_back(std::make_unique<Raw>(s.port()));
    check_healthy(s.port());  // served while 200 silent connections are open
    const auto t0 = Clock::now();
    int closed = 0;
    for (auto& r : flood) closed += r->read_until_closed(3s).closed ? 1 : 0;
    CHECK(closed == 200);  // all shed at the stall timeout
    CHECK(since(t0) < stall + 3000ms);
    check_healthy(s.port());
  }
  {
    auto so = server_options();
    so.max_connections = 8;
    comm::TcpStore s("127.0.0.1", 0, so);  // its own client holds one of the 8
    std::vector<std::unique_ptr<Raw>> held;
    for (int i = 0; i < 7; ++i) {
      held.push_back(std::make_unique<Raw>(s.port()));
      REQUIRE(held.back()->hello() == 0);
    }
    {
      Raw extra(s.port());
      CHECK(extra.hello() == static_cast<int>(sp::HelloStatus::too_many_connections));
    }
    auto c = client_options();
    try {
      comm::TcpStore over("127.0.0.1", s.port(), c);
      FAIL("connected past the limit");
    } catch (const comm::Error& e) {
      CHECK(contains(e.what(), "connection limit"));
    }
    held.resize(3);  // close 4
    bool ok = false;
    for (int i = 0; i < 100 && !ok; ++i) {  // the server notices the closes asynchronously
      try {
        comm::TcpStore again("127.0.0.1", s.port(), c);
        again.set("k", "v");
        ok = true;
      } catch (const comm::RemoteError&) {
        std::this_thread::sleep_for(10ms);
      }
    }
    CHECK(ok);
    CHECK(s.check("k"));
  }
}

TEST_CASE("the server enforces max_total_bytes") {
  auto so = server_options();
  so.max_total_bytes = 1 << 20;
  comm::TcpStore s("127.0.0.1", 0, so);
  const std::string big(600 << 10, 'x');
  s.set("a", big);
  try {
    s.set("b", big);
    FAIL("stored past max_total_bytes");
  } catch (const comm::RemoteError& e) {
    CHECK(contains(e.what(), "store full"));
  }
  CHECK_FALSE(s.check("b"));
  s.set("a", "small");  // shrinking is always allowed
  s.set("b", big);
  CHECK(s.delete_key("b"));
  s.set("c", big);
  CHECK(s.get("c").size() == big.size());
}

TEST_CASE("a wait on millions of keys is charged against max_total_bytes; nothing is copied first") {
  // 8 bytes per key on the wire (empty keys). A parked request keeps its keys as they came (one
  // buffer, waiting on one key at a time), and is charged that plus one overhead: the 4 MiB
  // request does not fit in 2 MiB.
  auto so = server_options();
  so.max_total_bytes = 2 << 20;
  comm::TcpStore s("127.0.0.1", 0, so);
  check_healthy(s.port());
  constexpr std::uint32_t n = 1 << 19;
  auto keys_frame = [&](sp::Op op, std::optional<std::uint64_t> ms) {
    return frame(op, [&](sp::Writer& w) {
      w.u32(n);
      for (std::uint32_t i = 0; i < n; ++i) w.u64(0);
      if (ms) w.u64(*ms);
    });
  };
  // Generous deadlines: sanitizer builds on a loaded machine move megabytes slowly.
  auto send = [](Raw& r, const Bytes& b) {
    return comm::detail::send_all(r.fd.get(), b, comm::detail::deadline_after(30s)).ok();
  };
  auto reply = [](Raw& r) {
    std::uint8_t head[8];
    Bytes p;
    if (!comm::detail::recv_all(r.fd.get(), head, comm::detail::deadline_after(30s)).ok()) return p;
    p.resize(sp::read_u64(head));
    if (!comm::detail::recv_all(r.fd.get(), p, comm::detail::deadline_after(30s)).ok()) p.clear();
    return p;
  };
  const auto parked = keys_frame(sp::Op::wait, 10000);
  const auto at_once = keys_frame(sp::Op::wait, 0);
  const auto check = keys_frame(sp::Op::check, std::nullopt);
  const long rss0 = rss_kib();
  Raw r(s.port());
  REQUIRE(r.hello() == 0);
  REQUIRE(send(r, parked));
  auto p = reply(r);
  REQUIRE(p.size() > 1);
  CHECK(p[0] == static_cast<std::uint8_t>(sp::Status::failed));
  CHECK(contains(std::string(p.begin(), p.end()), "store full: waiting on 524288 keys"));
  // ms = 0 answers at once with the missing keys (a reply no larger than the request)...
  REQUIRE(send(r, at_once));
  p = reply(r);
  REQUIRE(p.size() > 5);
  CHECK(p[0] == static_cast<std::uint8_t>(sp::Status::timeout));
  CHECK(sp::Reader(std::span(p).subspan(1)).u32() == n);
  // ... and check() only looks.
  REQUIRE(send(r, check));
  p = reply(r);
  REQUIRE(p.size() == 2);
  CHECK(p[1] == 0);
  // The 4 MiB requests were buffered and answered without copies per key.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // ASan's quarantine and TSan's shadow keep freed request buffers resident: no RSS bound there.
  MESSAGE("RSS bound not checked under a sanitizer; grew by " << (rss_kib() - rss0) << " KiB");
#else
  CHECK(rss_kib() - rss0 < 48 * 1024);
#endif
  // A normal wait still parks and is woken.
  comm::TcpStore c("127.0.0.1", s.port(), client_options());
  auto waiter = std::thread([&] { c.wait({"x", "y"}, 3s); });
  std::this_thread::sleep_for(20ms);
  s.set("x", "1");
  s.set("y", "1");
  waiter.join();
  check_healthy(s.port());
}

TEST_CASE("large values round-trip") {
  comm::TcpStore s("127.0.0.1", 0, server_options());
  std::string v(16 << 20, '\0');
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<char>(i * 31);
  s.set("big", v);
  comm::TcpStore other("127.0.0.1", s.port(), client_options());
  const auto got = other.get("big");
  CHECK(got.size() == v.size());
  CHECK(std::equal(got.begin(), got.end(), v.begin(), [](std::uint8_t a, char b) { return a == static_cast<std::uint8_t>(b); }));
}

namespace {
std::string text(const Bytes& b) { return {b.begin(), b.end()}; }
}  // namespace

TEST_CASE("multi_get: every value in order, once every key is set; a timeout names the missing keys") {
  comm::TcpStore s("127.0.0.1", 0, server_options());
  comm::TcpStore c("127.0.0.1", s.port(), client_options());
  s.set("a", "1");
  // Keys present: answered at once, in the order asked (a key twice is answered twice).
  auto v = c.multi_get({"a", "a"}, 1s);
  REQUIRE(v.size() == 2);
  CHECK(text(v[0]) == "1");
  CHECK(text(v[1]) == "1");
  // Missing keys: parked until the last one is set, from another connection.
  std::vector<Bytes> got;
  auto waiter = std::thread([&] { got = c.multi_get({"b", "a", "c"}, 5s); });
  std::this_thread::sleep_for(30ms);
  s.set("c", "3");
  std::this_thread::sleep_for(30ms);
  s.set("b", "2");
  waiter.join();
  REQUIRE(got.size() == 3);
  CHECK(text(got[0]) == "2");
  CHECK(text(got[1]) == "1");
  CHECK(text(got[2]) == "3");
  // A key passed while waiting, then deleted, is waited for again.
  auto waiter2 = std::thread([&] { got = c.multi_get({"d", "e"}, 5s); });
  std::this_thread::sleep_for(30ms);
  s.set("d", "4");
  std::this_thread::sleep_for(30ms);
  CHECK(s.delete_key("d"));
  s.set("e", "5");
  std::this_thread::sleep_for(50ms);
  s.set("d", "6");
  waiter2.join();
  REQUIRE(got.size() == 2);
  CHECK(text(got[0]) == "6");
  CHECK(text(got[1]) == "5");
  // Never set: Timeout naming only the missing key, about at the deadline.
  const auto t0 = Clock::now();
  std::string what;
  try {
    (void)c.multi_get({"a", "never"}, 200ms);
  } catch (const comm::Timeout& e) {
    what = e.what();
  }
  CHECK(contains(what, "key 'never' not set"));
  CHECK(Clock::now() - t0 >= 190ms);
  // Through a PrefixStore, and the default (wait, then get each) of another store.
  auto base = std::make_shared<comm::TcpStore>("127.0.0.1", s.port(), client_options());
  comm::PrefixStore ps("pre", base);
  ps.set("k", "p");
  v = ps.multi_get({"k"}, 1s);
  REQUIRE(v.size() == 1);
  CHECK(text(v[0]) == "p");
  comm::HashStore hs(1s);
  hs.set("x", "y");
  v = hs.multi_get({"x"}, 1s);
  REQUIRE(v.size() == 1);
  CHECK(text(v[0]) == "y");
  check_healthy(s.port());
}

TEST_CASE("multi_get: a reply larger than one frame is refused, and the connection stays usable") {
  auto so = server_options();
  so.max_value_bytes = 300 << 10;  // frame limit: 1 MiB
  comm::TcpStore s("127.0.0.1", 0, so);
  auto co = client_options();
  co.max_value_bytes = so.max_value_bytes;
  comm::TcpStore c("127.0.0.1", s.port(), co);
  const std::string big(300 << 10, 'x');
  for (const char* k : {"v1", "v2", "v3", "v4"}) s.set(k, big);
  std::string what;
  try {
    (void)c.multi_get({"v1", "v2", "v3", "v4"}, 1s);
  } catch (const comm::InvalidArgument& e) {
    what = e.what();
  }
  CHECK(contains(what, "ask for fewer keys"));
  CHECK(c.multi_get({"v1", "v2", "v3"}, 1s).size() == 3);
  check_healthy(s.port());
}

TEST_CASE("many parked requests on one key, and many timers: each is answered once, on time") {
  comm::TcpStore s("127.0.0.1", 0, server_options());
  constexpr int n = 64;
  std::vector<std::unique_ptr<comm::TcpStore>> clients;
  for (int i = 0; i < n; ++i) clients.push_back(std::make_unique<comm::TcpStore>("127.0.0.1", s.port(), client_options()));
  std::atomic<int> woken{0}, timed_out{0};
  std::vector<std::thread> ts;
  for (int i = 0; i < n; ++i)
    ts.emplace_back([&, i] {
      try {
        // Half wait on the key that is set; the other half also on one that never is, with
        // deadlines spread over 100-400 ms (the server's timer heap orders them).
        if (i % 2 == 0) {
          clients[static_cast<std::size_t>(i)]->wait({"go"}, 5s);
          ++woken;
        } else {
          clients[static_cast<std::size_t>(i)]->wait({"go", "never"}, std::chrono::milliseconds(100 + 5 * i));
        }
      } catch (const comm::Timeout&) {
        ++timed_out;
      }
    });
  std::this_thread::sleep_for(50ms);
  s.set("go", "1");
  for (auto& t : ts) t.join();
  CHECK(woken.load() == n / 2);
  CHECK(timed_out.load() == n / 2);
  check_healthy(s.port());
}

TEST_CASE("requests sent behind a parked one wait for it: not run before it, answered in order after it") {
  comm::TcpStore s("127.0.0.1", 0, server_options());
  Raw r(s.port());
  REQUIRE(r.hello() == 0);
  // The server reads what comes on a connection whose request is parked (so that parking
  // changes nothing it has registered with epoll), but it must not act on it yet.
  Bytes batch;
  auto add = [&](const Bytes& f) { batch.insert(batch.end(), f.begin(), f.end()); };
  add(frame(sp::Op::get, [](sp::Writer& w) {
    w.str("late");
    w.u64(5000);
  }));
  add(frame(sp::Op::set, [](sp::Writer& w) {
    w.str("behind");
    w.str("b");
  }));
  add(frame(sp::Op::get, [](sp::Writer& w) {
    w.str("behind");
    w.u64(0);
  }));
  r.send(batch);
  std::this_thread::sleep_for(50ms);
  CHECK_FALSE(s.check("behind"));
  s.set("late", "l");
  auto p = r.reply();
  REQUIRE(p.size() == 10);
  CHECK(std::string(p.begin() + 9, p.end()) == "l");
  p = r.reply();
  CHECK(p == Bytes{0});
  p = r.reply();
  REQUIRE(p.size() == 10);
  CHECK(std::string(p.begin() + 9, p.end()) == "b");
  CHECK(s.check("behind"));

  // More than the server holds for a parked connection (64 KiB): the rest waits in the kernel
  // until the parked request is answered, then every request runs, in order.
  r.send(frame(sp::Op::get, [](sp::Writer& w) {
    w.str("late2");
    w.u64(5000);
  }));
  constexpr int many = 2000;
  Bytes flood;
  for (int i = 0; i < many; ++i) {
    const auto f = frame(sp::Op::set, [&](sp::Writer& w) {
      w.str("k/" + std::to_string(i));
      w.str(std::string(200, 'x'));
    });
    flood.insert(flood.end(), f.begin(), f.end());
  }
  REQUIRE(flood.size() > 4 * (std::size_t{64} << 10));
  bool sent = false;
  std::thread sender([&] { sent = r.send(flood); });
  std::this_thread::sleep_for(100ms);
  CHECK_FALSE(s.check("k/0"));
  s.set("late2", "m");
  p = r.reply();
  REQUIRE(p.size() == 10);
  CHECK(std::string(p.begin() + 9, p.end()) == "m");
  int oks = 0;
  for (int i = 0; i < many; ++i) oks += r.reply() == Bytes{0} ? 1 : 0;
  sender.join();
  CHECK(sent);
  CHECK(oks == many);
  CHECK(s.check("k/0"));
  CHECK(s.check("k/1999"));
  check_healthy(s.port());
}

TEST_CASE("multi_get: a burst of large answers (every rank's when the last joins) each carries its own values") {
  // Replies above what a connection keeps are built one at a time, in their connections' turns,
  // from one reused buffer: each must still hold its own keys' values in its own order.
  comm::TcpStore s("127.0.0.1", 0, server_options());
  constexpr int n = 12;
  constexpr int keys = 4;
  auto value_of = [](int k) { return std::string(40000 + 1000 * k, static_cast<char>('a' + k)); };
  std::vector<std::unique_ptr<comm::TcpStore>> clients;
  for (int i = 0; i < n; ++i) clients.push_back(std::make_unique<comm::TcpStore>("127.0.0.1", s.port(), client_options()));
  std::vector<std::vector<Bytes>> got(n);
  std::vector<std::vector<int>> asked(n);
  std::vector<std::thread> ts;
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < keys; ++j) asked[static_cast<std::size_t>(i)].push_back((i + j) % keys);  // rotated per client
    ts.emplace_back([&, i] {
      std::vector<std::string> names;
      for (const int k : asked[static_cast<std::size_t>(i)]) names.push_back("big/" + std::to_string(k));
      got[static_cast<std::size_t>(i)] = clients[static_cast<std::size_t>(i)]->multi_get(names, 10s);
    });
  }
  std::this_thread::sleep_for(50ms);
  for (int k = 0; k < keys; ++k) s.set("big/" + std::to_string(k), value_of(k));
  for (auto& t : ts) t.join();
  for (int i = 0; i < n; ++i) {
    const auto& g = got[static_cast<std::size_t>(i)];
    REQUIRE(g.size() == static_cast<std::size_t>(keys));
    for (int j = 0; j < keys; ++j)
      CHECK_MESSAGE(text(g[static_cast<std::size_t>(j)]) == value_of(asked[static_cast<std::size_t>(i)][static_cast<std::size_t>(j)]),
                    "client " << i << ", value " << j);
  }
  // Then a small reply on each: nothing of the large ones is left behind.
  for (auto& c : clients) CHECK(text(c->multi_get({"big/0"}, 1s)[0]) == value_of(0));
  check_healthy(s.port());
}
