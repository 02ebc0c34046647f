// libFuzzer target for the TcpStore wire protocol (include/comm/detail/store/protocol.hpp), both
// ends, through the production code paths:
//
//   server  the bytes go to a live TcpStoreServer over a loopback connection: the handshake
//           parser, the frame reader (lengths checked before anything is buffered), the request
//           decoder and the connection state machine (pipelining, parked get/wait, error replies,
//           closing and draining). With flag bit 0 a valid hello goes first, so most inputs reach
//           the request decoder; with bit 1 the bytes go out in small pieces (partial frames);
//           with bit 2 they are split over two connections (a parked get on one, woken by a set on
//           the other).
//   client  a fake server answers a TcpStore client's hello and requests with the bytes (after a
//           valid hello reply unless flag bit 0 is set), and the client makes one or two calls: the reply decoders must turn anything into a value or a
//           comm::Error, never crash, hang or allocate from an unchecked length.
//
// Input: byte 0 selects (bit 7: client, else server) and carries the flags; byte 1 is a
// parameter (piece size / split point); the rest is what goes on the wire. Every input gets a
// fresh server, so a crash reproduces from its input alone.
//
// Build (scripts/sanitize fuzz does this):
//   clang++ -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -Iinclude fuzz/store_protocol_fuzz.cpp
// Run:  store_protocol_fuzz -max_len=4096 -max_total_time=300 fuzz/corpus/store

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <comm/detail/net/socket.hpp>
#include <comm/detail/store/protocol.hpp>
#include <comm/detail/store/tcp_store_server.hpp>
#include <comm/store.hpp>

namespace {

namespace cd = comm::detail;
namespace sp = comm::detail::store_proto;
using namespace std::chrono_literals;

constexpr const char* token = "fuzz-token";

// Every input must be done with well within this; past it, something hangs: abort so that
// libFuzzer reports the input.
constexpr auto hang_limit = 5s;

cd::TcpStoreServerConfig server_config() {
  cd::TcpStoreServerConfig cfg;
  cfg.token = token;
  cfg.max_connections = 4;
  cfg.max_key_bytes = 64;
  cfg.max_value_bytes = 256;
  cfg.max_total_bytes = 4096;
  cfg.stall_timeout = 300ms;
  return cfg;
}

[[noreturn]] void hang(const char* where) {
  std::fprintf(stderr, "store_protocol_fuzz: HANG: %s did not finish within %lld ms\n", where,
               static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(hang_limit).count()));
  std::abort();
}

cd::Fd connect_to(std::uint16_t port) {
  const auto r = cd::resolve("127.0.0.1", port);
  int err = 0;
  auto fd = cd::connect_once(r.addrs.at(0), cd::deadline_after(2s), err);
  if (!fd) hang("connect");
  return fd;
}

void send_bytes(int fd, std::span<const std::uint8_t> b, std::size_t piece) {
  // The server may close early (bad magic, oversized frame): a failed send just ends the input.
  for (std::size_t at = 0; at < b.size(); at += piece) {
    const auto n = std::min(piece, b.size() - at);
    if (!cd::send_all(fd, b.subspan(at, n), cd::deadline_after(hang_limit)).ok()) return;
  }
}

// Reads (and discards) until the server closes the connection.
void drain(int fd) {
  const auto deadline = cd::deadline_after(hang_limit);
  std::uint8_t buf[4096];
  for (;;) {
    const auto w = cd::wait_ready(fd, POLLIN, deadline);
    if (w.status == cd::IoStatus::timeout) hang("the server's answer");
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n > 0) continue;
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    return;
  }
}

void fuzz_server(std::uint8_t flags, std::uint8_t param, std::span<const std::uint8_t> wire) {
  cd::TcpStoreServer server("127.0.0.1", 0, server_config(), 0);
  const auto hello = sp::encode_hello(token, 1);
  const std::size_t piece = (flags & 2) ? param % 7 + 1 : wire.size() + 1;
  if (flags & 4) {
    // Two clients: A sends the first part (e.g. a get that parks), B the rest (e.g. its set).
    const std::size_t split = wire.empty() ? 0 : param % (wire.size() + 1);
    auto a = connect_to(server.port());
    auto b = connect_to(server.port());
    send_bytes(a.get(), hello, hello.size());
    send_bytes(a.get(), wire.first(split), piece);
    send_bytes(b.get(), hello, hello.size());
    send_bytes(b.get(), wire.subspan(split), piece);
    ::shutdown(b.get(), SHUT_WR);
    drain(b.get());
    ::shutdown(a.get(), SHUT_WR);
    drain(a.get());
    return;
  }
  auto c = connect_to(server.port());
  if (flags & 1) send_bytes(c.get(), hello, hello.size());
  send_bytes(c.get(), wire, piece);
  ::shutdown(c.get(), SHUT_WR);
  drain(c.get());
}

// A fake server: accepts one connection, reads the hello, then sends `input` (after a valid hello
// reply unless `raw`) and closes. The client makes call number `param % 8` and, if that left the
// connection usable, call number `(param / 8) % 8` on the same connection (with bit 6 of `param`:
// watch and heartbeat, the liveness calls, instead).
void fuzz_client(bool raw, std::uint8_t param, std::span<const std::uint8_t> input) {
  std::vector<std::uint8_t> wire;
  if (!raw) wire = sp::encode_hello_reply(sp::HelloStatus::ok, "");
  wire.insert(wire.end(), input.begin(), input.end());
  cd::Fd listener(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  auto addr = cd::resolve("127.0.0.1", 0).addrs.at(0);
  if (::bind(listener.get(), addr.get(), addr.len) != 0 || ::listen(listener.get(), 4) != 0) hang("listen");
  const auto port = cd::local_address(listener.get()).port();
  std::thread fake([&] {
    pollfd p{listener.get(), POLLIN, 0};
    if (::poll(&p, 1, 2000) != 1) return;
    cd::Fd conn(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    listener.reset();  // a reconnect is refused
    if (!conn) return;
    std::uint8_t head[sp::hello_size + 64];
    (void)::recv(conn.get(), head, sizeof head, 0);
    (void)::send(conn.get(), wire.data(), wire.size(), MSG_NOSIGNAL);
    ::shutdown(conn.get(), SHUT_WR);
    std::uint8_t buf[4096];  // swallow the requests until the client goes
    pollfd q{conn.get(), POLLIN, 0};
    while (::poll(&q, 1, 2000) == 1 && ::recv(conn.get(), buf, sizeof buf, 0) > 0) {
    }
  });
  const auto t0 = std::chrono::steady_clock::now();
  try {
    comm::TcpStoreOptions o;
    o.token = token;
    // Only waited out when the hello reply is cut short (the constructor retries until then):
    // the fake server always closes, so every other read ends at once.
    o.timeout = 20ms;
    o.max_key_bytes = 64;
    o.max_value_bytes = 256;
    comm::TcpStore c("127.0.0.1", port, o);
    const std::uint8_t one[] = {'1'};
    auto call = [&](int which) {
      switch (which) {
        case 0: (void)c.get("k"); break;
        case 1: c.set("k", "v"); break;
        case 2: (void)c.add("n", 1); break;
        case 3: (void)c.compare_set("k", std::span<const std::uint8_t>(), one); break;
        case 4: c.wait({"a", "b"}, 20ms); break;
        case 5: (void)c.num_keys(); break;
        case 6: (void)c.delete_key("k"); break;
        default: (void)c.check("k"); break;
      }
    };
    call(param % 8);
    if (param & 0x40) {  // the liveness calls' replies
      (void)c.watch("dead", "1|", 20ms);
      (void)c.heartbeat(20ms);
    } else {
      call((param / 8) % 8);
    }
  } catch (const comm::Error&) {
    // Every bad reply must end here: a value or a comm::Error, nothing else.
  }
  if (std::chrono::steady_clock::now() - t0 > hang_limit) hang("the client calls");
  fake.join();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  const std::uint8_t flags = data[0];
  const std::uint8_t param = data[1];
  const std::span<const std::uint8_t> wire(data + 2, size - 2);
  if (flags & 0x80)
    fuzz_client((flags & 1) != 0, param, wire);
  else
    fuzz_server(flags, param, wire);
  return 0;
}
