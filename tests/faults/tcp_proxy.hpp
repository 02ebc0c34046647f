#pragma once
// A fault-injecting TCP proxy for the fault battery: it listens on a loopback port, and forwards
// every connection it accepts to a target address, byte for byte, until told to misbehave:
//
//   pass     forward (the default)
//   stall    stop forwarding in the chosen direction(s) and stop reading, connections stay open:
//            the peer sees a silent, live link (like a hung host or a black-holed route)
//   drop     keep reading in the chosen direction(s) but throw the bytes away (lost data)
//   corrupt  flip bits in one byte out of every `corrupt_every` forwarded in the chosen direction(s)
//   cut      reset every connection (RST) and refuse new ones (accept, then reset at once)
//
// One thread runs a poll() loop over non-blocking sockets; modes can change at any time from
// any thread. Counters say how much went through, so tests can wait until traffic flows.

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <list>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <comm/detail/net/socket.hpp>

namespace comm::faults {

class TcpProxy {
 public:
  enum class Mode : std::uint8_t { pass, stall, drop, corrupt, cut };
  enum Direction : unsigned { to_server = 1, to_client = 2, both = 3 };

  /// Listens on `listen_host`, port 0 (see port()), forwarding to target_host:target_port.
  TcpProxy(std::string target_host, std::uint16_t target_port, std::string listen_host = "127.0.0.1")
      : target_(resolve_one(target_host, target_port)) {
    auto l = resolve_one(listen_host, 0);
    listener_.reset(::socket(l.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    const int one = 1;
    ::setsockopt(listener_.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (!listener_ || ::bind(listener_.get(), l.get(), l.len) != 0 || ::listen(listener_.get(), 128) != 0)
      throw std::runtime_error("TcpProxy: cannot listen on " + listen_host + ": " + detail::errno_text(errno));
    port_ = detail::local_address(listener_.get()).port();
    int p[2];
    if (::pipe2(p, O_NONBLOCK | O_CLOEXEC) != 0) throw std::runtime_error("TcpProxy: pipe2 failed");
    wake_r_.reset(p[0]);
    wake_w_.reset(p[1]);
    thread_ = std::thread([this] { loop(); });
  }

  ~TcpProxy() {
    stop_ = true;
    wake();
    thread_.join();
  }

  TcpProxy(const TcpProxy&) = delete;
  TcpProxy& operator=(const TcpProxy&) = delete;

  [[nodiscard]] std::uint16_t port() const noexcept { return port_; }

  /// Switches mode for the given direction(s); returns once the proxy applies it, so bytes sent
  /// after this call see the new mode. `cut` applies to whole connections.
  void set_mode(Mode m, unsigned dirs = both) {
    std::unique_lock g(mu_);
    if (dirs & to_server) mode_[0] = m;
    if (dirs & to_client) mode_[1] = m;
    const auto gen = ++gen_;
    g.unlock();
    wake();
    g.lock();
    applied_cv_.wait(g, [&] { return applied_ >= gen || stop_; });
  }
  void pass() { set_mode(Mode::pass); }
  void stall(unsigned dirs = both) { set_mode(Mode::stall, dirs); }
  void drop(unsigned dirs = both) { set_mode(Mode::drop, dirs); }
  void corrupt(unsigned dirs = both, unsigned every = 7) {
    corrupt_every_ = every == 0 ? 1 : every;
    set_mode(Mode::corrupt, dirs);
  }
  void cut() { set_mode(Mode::cut); }

  /// Connections accepted so far, and those open now.
  [[nodiscard]] std::uint64_t accepted() const noexcept { return accepted_.load(); }
  [[nodiscard]] std::uint64_t open_connections() const noexcept { return open_.load(); }
  /// Bytes forwarded towards the server / the client.
  [[nodiscard]] std::uint64_t bytes_to_server() const noexcept { return bytes_[0].load(); }
  [[nodiscard]] std::uint64_t bytes_to_client() const noexcept { return bytes_[1].load(); }

 private:
  static constexpr std::size_t buf_cap = 64 * 1024;

  // One direction of one connection: bytes read from `from`, waiting to be written to `to`.
  struct Half {
    std::vector<std::uint8_t> buf;
    std::size_t off = 0;
    bool eof = false;  // `from` closed its write side
    bool shut = false;  // we passed the EOF on (shutdown(to, SHUT_WR))
  };
  struct Conn {
    detail::Fd fd[2];  // [0] client side, [1] server side
    Half half[2];      // [0] client -> server, [1] server -> client
    bool gone[2] = {false, false};  // that side hung up while its direction was stalled
    bool dead = false;
  };

  static detail::SockAddr resolve_one(const std::string& host, std::uint16_t port) {
    auto r = detail::resolve(host, port);
    if (r.addrs.empty()) throw std::runtime_error("TcpProxy: cannot resolve " + host);
    return r.addrs.front();
  }

  void wake() {
    const char c = 1;
    (void)!::write(wake_w_.get(), &c, 1);
  }

  static void reset_close(detail::Fd& fd) {
    if (!fd) return;
    linger lg{1, 0};  // close with RST, like a cut cable seen by a router that answers
    ::setsockopt(fd.get(), SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    fd.reset();
  }

  void kill_conn(Conn& c) {
    if (c.dead) return;
    reset_close(c.fd[0]);
    reset_close(c.fd[1]);
    c.dead = true;
    --open_;
  }

  void accept_all(Mode cut_mode) {
    for (;;) {
      const int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;
      detail::Fd client(fd);
      ++accepted_;
      if (cut_mode == Mode::cut) {
        reset_close(client);
        continue;
      }
      int err = 0;
      detail::Fd server = detail::connect_once(target_, detail::deadline_after(std::chrono::seconds(2)), err);
      if (!server) {
        reset_close(client);
        continue;
      }
      detail::set_nodelay(client.get());
      auto& c = conns_.emplace_back();
      c.fd[0] = std::move(client);
      c.fd[1] = std::move(server);
      ++open_;
    }
  }

  void loop() {
    std::vector<pollfd> pfds;
    std::vector<std::pair<Conn*, int>> who;
    while (!stop_) {
      Mode mode[2];
      {
        std::lock_guard g(mu_);
        mode[0] = mode_[0];
        mode[1] = mode_[1];
        applied_ = gen_;
      }
      applied_cv_.notify_all();
      const bool cut = mode[0] == Mode::cut || mode[1] == Mode::cut;
      if (cut)
        for (auto& c : conns_) kill_conn(c);
      conns_.remove_if([](const Conn& c) { return c.dead; });

      pfds.clear();
      who.clear();
      pfds.push_back({wake_r_.get(), POLLIN, 0});
      pfds.push_back({listener_.get(), POLLIN, 0});
      for (auto& c : conns_) {
        for (int side = 0; side < 2; ++side) {
          // side s reads half[s] (its outgoing bytes) and writes half[1 - s].
          short ev = 0;
          Half& out = c.half[side];
          const Mode m = mode[side];
          if (!out.eof && m != Mode::stall && out.buf.size() < buf_cap) ev |= POLLIN;
          Half& in = c.half[1 - side];
          if (in.off < in.buf.size() && mode[1 - side] != Mode::stall) ev |= POLLOUT;
          pfds.push_back({c.gone[side] ? -1 : c.fd[side].get(), ev, 0});
          who.emplace_back(&c, side);
        }
      }
      const int n = ::poll(pfds.data(), pfds.size(), 200);
      if (n <= 0) continue;
      if (pfds[0].revents & POLLIN) {
        char b[64];
        while (::read(wake_r_.get(), b, sizeof b) > 0) {
        }
      }
      if (pfds[1].revents & POLLIN) accept_all(cut ? Mode::cut : Mode::pass);
      for (std::size_t i = 0; i < who.size(); ++i) {
        auto [c, side] = who[i];
        const short re = pfds[2 + i].revents;
        if (c->dead || re == 0) continue;
        if (re & POLLIN) {
          on_read(*c, side, mode[side]);
        } else if (re & (POLLHUP | POLLERR)) {
          // Gone. On a stalled link the other side must not learn it: stop watching this side.
          if (mode[0] == Mode::stall || mode[1] == Mode::stall)
            c->gone[side] = true;
          else
            kill_conn(*c);
        }
        if (!c->dead && (re & POLLOUT)) on_write(*c, 1 - side);
      }
    }
    for (auto& c : conns_) kill_conn(c);
  }

  // Reads what side `side` sent into half[side].
  void on_read(Conn& c, int side, Mode m) {
    Half& h = c.half[side];
    std::uint8_t tmp[16384];
    const ssize_t n = ::recv(c.fd[side].get(), tmp, sizeof tmp, 0);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) return;
      return kill_conn(c);  // reset by that side: pass the reset on
    }
    if (n == 0) {
      h.eof = true;
    } else if (m != Mode::drop) {
      if (m == Mode::corrupt) {
        for (ssize_t i = 0; i < n; ++i)
          if (++corrupt_count_ % corrupt_every_ == 0) tmp[i] ^= 0x5a;
      }
      if (h.off == h.buf.size()) {
        h.buf.clear();
        h.off = 0;
      }
      h.buf.insert(h.buf.end(), tmp, tmp + n);
    }
    on_write(c, side);
  }

  // Writes half[dir] to the other side.
  void on_write(Conn& c, int dir) {
    if (c.dead || c.gone[1 - dir]) return;
    Half& h = c.half[dir];
    detail::Fd& to = c.fd[1 - dir];
    while (h.off < h.buf.size()) {
      const ssize_t n = ::send(to.get(), h.buf.data() + h.off, h.buf.size() - h.off, MSG_NOSIGNAL);
      if (n > 0) {
        h.off += static_cast<std::size_t>(n);
        bytes_[dir] += static_cast<std::uint64_t>(n);
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
      return kill_conn(c);
    }
    if (h.eof && !h.shut) {
      ::shutdown(to.get(), SHUT_WR);
      h.shut = true;
    }
    if (c.half[0].shut && c.half[1].shut) kill_conn(c);
  }

  detail::SockAddr target_;
  detail::Fd listener_;
  std::uint16_t port_ = 0;
  detail::Fd wake_r_, wake_w_;
  std::mutex mu_;
  std::condition_variable applied_cv_;
  std::uint64_t gen_ = 0, applied_ = 0;  // mode changes requested / taken up by the loop
  Mode mode_[2] = {Mode::pass, Mode::pass};
  std::atomic<unsigned> corrupt_every_{7};
  unsigned long corrupt_count_ = 0;
  std::list<Conn> conns_;
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> accepted_{0}, open_{0};
  std::atomic<std::uint64_t> bytes_[2]{};
  std::thread thread_;
};

}  // namespace comm::faults
