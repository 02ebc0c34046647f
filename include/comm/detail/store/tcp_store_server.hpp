#pragma once
// The TcpStore server: one thread running a poll() loop over non-blocking sockets.
//
// Per connection it buffers at most one request frame (its length checked against the frame
// limit before anything is buffered beyond the 8-byte header), answers requests in order, and
// parks get()/wait() requests as waiters that are answered when their keys appear or their
// deadline passes. A connection is dropped when it sends a bad magic, a wrong token, an
// oversized or malformed frame (after an error reply where the framing still holds), when its
// handshake does not complete within the stall timeout, or when a started request or a pending
// reply makes no progress for the stall timeout. Memory: stored keys and values, and the keys that
// parked requests wait on, count against max_total_bytes together. Nothing here throws out of
// the thread. A connection with a will (Op::watch: liveness) sets its will's key when it closes,
// errs or stays silent past its silence bound: how ranks learn that a peer died or stopped.

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include <comm/error.hpp>
#include <comm/detail/net/socket.hpp>
#include <comm/detail/store/common.hpp>
#include <comm/detail/store/protocol.hpp>

namespace comm::detail {

/// What the server enforces (from TcpStoreOptions).
struct TcpStoreServerConfig {
  std::string token;
  std::string job_id;  // a client of another job is refused (HelloStatus::wrong_job)
  std::size_t max_connections = 1024;
  std::size_t max_key_bytes = 4096;
  std::size_t max_value_bytes = std::size_t{64} << 20;
  std::size_t max_total_bytes = std::size_t{1} << 30;
  std::chrono::milliseconds stall_timeout = std::chrono::seconds(5);
};

class TcpStoreServer {
 public:
  /// Binds and listens on every address `host` resolves to (port 0: a free port, the same on
  /// all of them), then starts the thread. Throws on bind failure; nothing is left running.
  TcpStoreServer(const std::string& host, std::uint16_t port, TcpStoreServerConfig cfg, int rank)
      : opts_(std::move(cfg)),
        token_(opts_.token),
        host_rank_(rank),
        frame_cap_(store_proto::frame_limit(opts_.max_key_bytes, opts_.max_value_bytes)),
        max_connections_(std::max<std::size_t>(opts_.max_connections, 1)),
        stall_(std::max(opts_.stall_timeout, std::chrono::milliseconds(1))) {
    const std::string where = format_host_port(host, port);
    if (host.empty()) throw InvalidArgument("store.listen", rank, "TcpStore server needs a host to bind, got ''");
    const Resolved r = resolve(host, port);
    if (r.addrs.empty())
      throw InvalidArgument("store.listen", rank, "cannot resolve host '" + host + "': " + r.error_text(), where);
    std::uint16_t chosen = 0;
    for (int attempt = 0; attempt < 16 && listeners_.empty(); ++attempt) {
      // With port 0 the first address picks the port; if another address has it taken, start over.
      chosen = port;
      bool retry = false;
      int fail_err = 0;
      std::string fail_addr;
      for (auto a : r.addrs) {
        a.set_port(chosen);
        int err = 0;
        Fd fd = listen_on(a, err);
        if (!fd) {
          if (err == EADDRINUSE && port == 0 && chosen != 0) {
            retry = true;
            break;
          }
          if (err == EADDRINUSE)
            throw BackendError("store.listen", rank,
                               "cannot bind " + to_string(a) + ": " + errno_text(err) +
                                   " (another process, or an earlier job, uses this port)",
                               to_string(a));
          if (fail_err == 0) {
            fail_err = err;
            fail_addr = to_string(a);
          }
          continue;  // e.g. an address family this machine cannot bind; clients try the others
        }
        if (chosen == 0) chosen = local_address(fd.get()).port();
        bound_.push_back(local_address(fd.get()));
        listeners_.push_back(std::move(fd));
      }
      if (retry) {
        listeners_.clear();
        bound_.clear();
        continue;
      }
      if (listeners_.empty())
        throw BackendError("store.listen", rank, "cannot bind " + fail_addr + ": " + errno_text(fail_err), fail_addr);
    }
    if (listeners_.empty())
      throw BackendError("store.listen", rank, "found no port free on every address of '" + host + "'", where);
    port_ = chosen;
    int p[2];
    if (::pipe2(p, O_NONBLOCK | O_CLOEXEC) != 0)
      throw BackendError("store.listen", rank, "cannot create the wake-up pipe: " + errno_text(errno));
    wake_r_.reset(p[0]);
    wake_w_.reset(p[1]);
    thread_ = std::thread([this] { run(); });
  }

  ~TcpStoreServer() {
    stop_.store(true);
    const char c = 1;
    while (::write(wake_w_.get(), &c, 1) < 0 && errno == EINTR) {
    }
    if (thread_.joinable()) thread_.join();
  }

  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  [[nodiscard]] std::uint16_t port() const noexcept { return port_; }
  /// The local addresses listened on.
  [[nodiscard]] const std::vector<SockAddr>& bound() const noexcept { return bound_; }

 private:
  using Bytes = std::vector<std::uint8_t>;
  using Op = store_proto::Op;
  using Status = store_proto::Status;
  static constexpr std::size_t read_chunk = std::size_t{64} << 10;
  static constexpr std::size_t max_read_chunk = std::size_t{4} << 20;
  static constexpr std::size_t reject_slack = 64;  // rejected connections kept to deliver the reason
  static constexpr std::size_t keep_capacity = std::size_t{1} << 20;

  enum class Phase : std::uint8_t { hello, ready, closing, draining };

  struct Pending {
    Op op = Op::get;
    std::vector<std::string> keys;
    Clock::time_point deadline;
    std::size_t cost = 0;  // counted in parked_bytes_
  };

  // What one key of a parked get()/wait() costs the server: its copy, its place in the request's
  // key list and in waiters_. Counted against max_total_bytes, so that a request of millions of
  // empty keys (8 bytes each on the wire) cannot make the server take many times its size.
  static constexpr std::size_t parked_key_overhead = 128;
  [[nodiscard]] static std::size_t parked_cost(std::string_view key) noexcept {
    return key.size() + parked_key_overhead;
  }

  // Op::watch: set `key` to `value` + the reason when this connection ends or falls silent.
  struct Will {
    std::string key;
    Bytes value;
    std::chrono::milliseconds silence{};
    Clock::time_point last;  // the last request
    std::size_t cost = 0;    // counted in parked_bytes_
  };

  struct Conn {
    Fd fd;
    std::uint64_t id = 0;
    Phase phase = Phase::hello;
    Bytes in;
    std::size_t in_off = 0;
    Bytes out;
    std::size_t out_off = 0;
    Clock::time_point accepted;
    Clock::time_point progress;  // last time bytes moved
    Clock::time_point until;     // closing/draining: drop at this time
    std::optional<Pending> pending;
    bool dead = false;
    bool counted = true;  // counts against max_connections (false: being rejected)
    int rank = -1;
    std::optional<Will> will;

    [[nodiscard]] std::size_t unread() const noexcept { return in.size() - in_off; }
    [[nodiscard]] bool out_pending() const noexcept { return out_off < out.size(); }
  };

  static Fd listen_on(const SockAddr& a, int& err) {
    Fd fd(::socket(a.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, IPPROTO_TCP));
    if (!fd) {
      err = errno;
      return {};
    }
    const int one = 1;
    (void)::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (a.family() == AF_INET6) (void)::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
    if (::bind(fd.get(), a.get(), a.len) != 0 || ::listen(fd.get(), SOMAXCONN) != 0) {
      err = errno;
      return {};
    }
    return fd;
  }

  void run() noexcept {
    try {
      loop();
    } catch (...) {
      // Out of memory or similar in the loop itself: close everything so that clients fail
      // with RemoteError instead of waiting for their deadline.
    }
    conns_.clear();
    listeners_.clear();
  }

  void loop() {
    std::vector<pollfd> pfds;
    std::vector<std::uint64_t> ids;
    while (!stop_.load()) {
      auto now = Clock::now();
      pfds.clear();
      ids.clear();
      pfds.push_back({wake_r_.get(), POLLIN, 0});
      const bool accepting = now >= accept_pause_until_;
      for (const auto& l : listeners_) pfds.push_back({l.get(), static_cast<short>(accepting ? POLLIN : 0), 0});
      for (const auto& [id, c] : conns_) {
        short ev = 0;
        if (wants_read(*c)) ev |= POLLIN;
        if (c->out_pending()) ev |= POLLOUT;
        if (c->pending) ev |= POLLRDHUP;  // a parked client that goes away
        pfds.push_back({c->fd.get(), ev, 0});
        ids.push_back(id);
      }
      auto next = next_deadline();
      if (!accepting) next = std::min(next, accept_pause_until_);
      const int n = ::poll(pfds.data(), pfds.size(), poll_timeout_ms(next, now));
      if (n < 0 && errno != EINTR) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      now = Clock::now();
      if (n > 0 && (pfds[0].revents & POLLIN) != 0) {
        char buf[64];
        while (::read(wake_r_.get(), buf, sizeof buf) > 0) {
        }
      }
      if (stop_.load()) break;
      if (n > 0) {
        for (std::size_t i = 0; i < listeners_.size(); ++i)
          if ((pfds[1 + i].revents & POLLIN) != 0) accept_all(listeners_[i].get(), now);
        const std::size_t base = 1 + listeners_.size();
        for (std::size_t i = 0; i < ids.size(); ++i) {
          const short re = pfds[base + i].revents;
          if (re == 0) continue;
          auto it = conns_.find(ids[i]);
          if (it == conns_.end() || it->second->dead) continue;
          Conn& c = *it->second;
          guarded(c, [&] { on_events(c, re, now); });
        }
      }
      run_ready(now);
      expire(now);
      run_ready(now);
      std::erase_if(conns_, [](const auto& kv) { return kv.second->dead; });
    }
  }

  // Runs `f` for connection `c`; anything it throws (out of memory for a large value) drops
  // only that connection.
  template <class F>
  void guarded(Conn& c, F&& f) {
    try {
      f();
    } catch (...) {
      drop(c);
    }
  }

  [[nodiscard]] bool wants_read(const Conn& c) const noexcept {
    if (c.dead || c.pending) return false;
    if (c.phase == Phase::draining) return true;
    if (c.phase == Phase::closing || c.out_pending()) return false;
    return c.unread() < frame_cap_ + store_proto::frame_header_size + store_proto::max_token_bytes + 16;
  }

  void on_events(Conn& c, short re, Clock::time_point now) {
    if ((re & POLLERR) != 0) return drop(c);
    if (c.pending) {
      if ((re & (POLLRDHUP | POLLHUP)) != 0) drop(c);
      return;
    }
    if ((re & POLLOUT) != 0) {
      flush(c, now);
      if (c.dead) return;
      if (!c.out_pending()) ready_.push_back(c.id);
    }
    if ((re & (POLLIN | POLLHUP | POLLRDHUP)) != 0) {
      if (wants_read(c)) {
        read_some(c, now);
      } else if ((re & POLLHUP) != 0) {
        drop(c);  // gone for good and we cannot read now: nothing left to do for it
      }
    }
  }

  void accept_all(int lfd, Clock::time_point now) {
    for (int i = 0; i < 64; ++i) {
      const int fd = ::accept4(lfd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
          accept_pause_until_ = now + std::chrono::milliseconds(100);  // let connections drain first
        return;
      }
      Fd owned(fd);
      std::size_t active = 0;
      for (const auto& kv : conns_) active += kv.second->counted && !kv.second->dead ? 1 : 0;
      if (conns_.size() >= max_connections_ + reject_slack) continue;  // closes it at once
      set_nodelay(fd);
      auto c = std::make_unique<Conn>();
      c->fd = std::move(owned);
      c->id = next_id_++;
      c->accepted = c->progress = now;
      Conn& ref = *c;
      conns_.emplace(c->id, std::move(c));
      if (active >= max_connections_) {
        ref.counted = false;
        const auto r = store_proto::encode_hello_reply(
            store_proto::HelloStatus::too_many_connections,
            "server at its connection limit (" + std::to_string(max_connections_) + " connections)");
        ref.out.assign(r.begin(), r.end());
        close_after_reply(ref, now);
        flush(ref, now);
      }
    }
  }

  void read_some(Conn& c, Clock::time_point now) {
    if (c.phase == Phase::draining) {
      char scratch[4096];
      for (int i = 0; i < 16; ++i) {
        const ssize_t n = ::recv(c.fd.get(), scratch, sizeof scratch, 0);
        if (n > 0) continue;
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        return drop(c);  // EOF or error: the peer has read our reply or is gone
      }
      return;
    }
    if (c.in_off == c.in.size()) {
      c.in.clear();
      c.in_off = 0;
    } else if (c.in_off > 0 && c.in_off >= c.in.size() / 2) {
      c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(c.in_off));
      c.in_off = 0;
    }
    // Read what is waiting (FIONREAD), at least a page and at most a bounded chunk: memory follows
    // the bytes that really arrived, never a length the peer claims.
    int avail = 0;
    if (::ioctl(c.fd.get(), FIONREAD, &avail) != 0) avail = 0;
    const std::size_t want = std::clamp<std::size_t>(static_cast<std::size_t>(std::max(avail, 0)), 4096,
                                                     c.phase == Phase::ready ? max_read_chunk : read_chunk);
    const std::size_t old = c.in.size();
    c.in.resize(old + want);
    ssize_t n = 0;
    do {
      n = ::recv(c.fd.get(), c.in.data() + old, want, 0);
    } while (n < 0 && errno == EINTR);
    if (n <= 0) {
      c.in.resize(old);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      // EOF or reset: finish the complete requests already here, then forget the connection.
      process(c, now);
      return drop(c);
    }
    c.in.resize(old + static_cast<std::size_t>(n));
    c.progress = now;
    process(c, now);
  }

  void process(Conn& c, Clock::time_point now) {
    for (;;) {
      if (c.dead) return;
      if (c.out_pending()) {
        flush(c, now);
        if (c.dead || c.out_pending()) return;
      }
      if (c.pending || (c.phase != Phase::hello && c.phase != Phase::ready)) return;
      if (c.phase == Phase::hello) {
        if (!process_hello(c, now)) {
          if (!c.dead && c.out_pending()) flush(c, now);
          return;
        }
        continue;
      }
      if (c.unread() < store_proto::frame_header_size) return;
      const std::uint64_t len = store_proto::read_u64(c.in.data() + c.in_off);
      if (len == 0 || len > frame_cap_) {
        reply_error(c, Status::invalid,
                    "request of " + std::to_string(len) + " bytes is outside the server's limit (1.." +
                        std::to_string(frame_cap_) + " bytes)");
        close_after_reply(c, now);
        continue;  // flushes the reply, then stops reading
      }
      if (c.unread() - store_proto::frame_header_size < len) return;
      const std::span<const std::uint8_t> payload(c.in.data() + c.in_off + store_proto::frame_header_size,
                                                  static_cast<std::size_t>(len));
      handle(c, payload, now);
      c.in_off += store_proto::frame_header_size + static_cast<std::size_t>(len);
      if (c.in_off == c.in.size()) {
        c.in.clear();
        c.in_off = 0;
        if (c.in.capacity() > keep_capacity) Bytes().swap(c.in);
      }
    }
  }

  bool process_hello(Conn& c, Clock::time_point now) {
    namespace sp = store_proto;
    const std::span<const std::uint8_t> in(c.in.data() + c.in_off, c.unread());
    if (in.size() >= 4 && sp::Reader(in).u32() != sp::magic) {
      drop(c);  // not our protocol: no reply
      return false;
    }
    if (in.size() < sp::hello_size) return false;
    sp::Reader r(in);
    (void)r.u32();
    const auto ver = r.u16();
    const std::size_t token_len = r.u16();
    const auto rank = r.i32();
    if (token_len > sp::max_token_bytes) {
      drop(c);
      return false;
    }
    if (r.left() < token_len) return false;
    const auto token = r.raw(token_len);
    if (ver < sp::min_version || ver > sp::version) {
      c.in_off += sp::hello_size + token_len;
      send_hello(c, sp::HelloStatus::bad_version,
                 "server speaks protocol versions " + std::to_string(sp::min_version) + " to " +
                     std::to_string(sp::version) + ", client sent " + std::to_string(ver));
      close_after_reply(c, now);
      return false;
    }
    std::span<const std::uint8_t> job;
    if (ver >= 2) {
      if (r.left() < 2) return false;
      const std::size_t job_len = r.u16();
      if (job_len > sp::max_job_id_bytes) {
        drop(c);
        return false;
      }
      if (r.left() < job_len) return false;
      job = r.raw(job_len);
    }
    c.in_off += in.size() - r.left();
    // Before the token: a client of a later job on this port has another token too, and "another
    // job's store" is the useful answer. Job ids are not secret.
    if (!std::equal(job.begin(), job.end(), opts_.job_id.begin(), opts_.job_id.end(),
                    [](std::uint8_t a, char b) { return a == static_cast<std::uint8_t>(b); })) {
      send_hello(c, sp::HelloStatus::wrong_job, opts_.job_id);
      close_after_reply(c, now);
      return false;
    }
    if (!token_equal(token)) {
      send_hello(c, sp::HelloStatus::wrong_token, "wrong token");
      close_after_reply(c, now);
      return false;
    }
    c.rank = rank;
    c.phase = Phase::ready;
    c.progress = now;
    send_hello(c, sp::HelloStatus::ok, "");
    return true;
  }

  [[nodiscard]] bool token_equal(std::span<const std::uint8_t> t) const noexcept {
    // Constant time in the token's content.
    unsigned diff = t.size() == token_.size() ? 0u : 1u;
    for (std::size_t i = 0; i < t.size(); ++i) {
      const auto mine = i < token_.size() ? static_cast<std::uint8_t>(token_[i]) : std::uint8_t{0};
      diff |= static_cast<unsigned>(mine ^ t[i]);
    }
    return diff == 0;
  }

  void send_hello(Conn& c, store_proto::HelloStatus s, const std::string& msg) {
    const auto r = store_proto::encode_hello_reply(s, msg);
    c.out.insert(c.out.end(), r.begin(), r.end());
  }

  void close_after_reply(Conn& c, Clock::time_point now) {
    c.phase = Phase::closing;
    c.until = now + std::min(stall_, std::chrono::milliseconds(2000));
  }

  // --- replies --------------------------------------------------------------------------------

  void start_reply(Conn& c) {
    if (!c.out_pending()) {
      c.out.clear();
      c.out_off = 0;
    }
  }

  void reply_ok(Conn& c) {
    start_reply(c);
    const auto at = store_proto::begin_frame(c.out);
    c.out.push_back(static_cast<std::uint8_t>(Status::ok));
    store_proto::finish_frame(c.out, at);
  }

  template <class F>
  void reply_ok_with(Conn& c, F&& fields) {
    start_reply(c);
    const auto at = store_proto::begin_frame(c.out);
    store_proto::Writer w(c.out);
    w.u8(static_cast<std::uint8_t>(Status::ok));
    fields(w);
    store_proto::finish_frame(c.out, at);
  }

  void reply_error(Conn& c, Status s, const std::string& msg) {
    start_reply(c);
    const auto at = store_proto::begin_frame(c.out);
    store_proto::Writer w(c.out);
    w.u8(static_cast<std::uint8_t>(s));
    w.str(msg);
    store_proto::finish_frame(c.out, at);
  }

  void reply_timeout(Conn& c, const std::vector<std::string>& missing) {
    reply_timeout_with(c, missing.size(), [&](store_proto::Writer& w) {
      for (const auto& k : missing) w.str(k);
    });
  }

  // A timeout reply naming `n` missing keys, which `keys(w)` writes.
  template <class F>
  void reply_timeout_with(Conn& c, std::size_t n, F&& keys) {
    start_reply(c);
    const auto at = store_proto::begin_frame(c.out);
    store_proto::Writer w(c.out);
    w.u8(static_cast<std::uint8_t>(Status::timeout));
    w.u32(static_cast<std::uint32_t>(n));
    keys(w);
    store_proto::finish_frame(c.out, at);
  }

  void flush(Conn& c, Clock::time_point now) {
    while (c.out_pending()) {
      const ssize_t n = ::send(c.fd.get(), c.out.data() + c.out_off, c.out.size() - c.out_off, MSG_NOSIGNAL);
      if (n > 0) {
        c.out_off += static_cast<std::size_t>(n);
        c.progress = now;
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      return drop(c);
    }
    c.out.clear();
    c.out_off = 0;
    if (c.out.capacity() > keep_capacity) Bytes().swap(c.out);
    if (c.phase == Phase::closing) {
      // Half-close and read until the peer closes, so that unread input does not turn our
      // close into a reset that could destroy the reply before the peer reads it.
      (void)::shutdown(c.fd.get(), SHUT_WR);
      c.phase = Phase::draining;
    }
  }

  void drop(Conn& c) {
    if (c.dead) return;
    if (c.will) fire_will(c, "its connection to the store closed (the process exited or was killed)");
    if (c.pending) unpark(c);
    c.dead = true;
    c.fd.reset();
    Bytes().swap(c.in);
    Bytes().swap(c.out);
    c.in_off = c.out_off = 0;
  }

  // --- requests -------------------------------------------------------------------------------

  bool key_ok(Conn& c, std::string_view key) {
    if (key.size() <= opts_.max_key_bytes) return true;
    reply_error(c, Status::invalid,
                "key of " + std::to_string(key.size()) + " bytes exceeds the server's max_key_bytes (" +
                    std::to_string(opts_.max_key_bytes) + ")");
    return false;
  }

  bool value_ok(Conn& c, std::string_view key, std::size_t size) {
    if (size <= opts_.max_value_bytes) return true;
    reply_error(c, Status::invalid,
                "value of " + std::to_string(size) + " bytes for " + quote_key(key) +
                    " exceeds the server's max_value_bytes (" + std::to_string(opts_.max_value_bytes) + ")");
    return false;
  }

  // Stores key=value unless that would pass max_total_bytes (then replies `failed`).
  bool put(Conn& c, std::string_view key, std::span<const std::uint8_t> value) {
    auto it = kv_.find(key);
    const std::size_t old = it == kv_.end() ? 0 : key.size() + it->second.size();
    const std::size_t add = key.size() + value.size();
    if (add > old && total_bytes_ + parked_bytes_ - old + add > opts_.max_total_bytes) {
      reply_error(c, Status::failed,
                  "store full: storing " + std::to_string(add) + " bytes for " + quote_key(key) + " would pass " +
                      "max_total_bytes (" + std::to_string(opts_.max_total_bytes) + "; " +
                      std::to_string(total_bytes_ + parked_bytes_) + " in use)");
      return false;
    }
    if (it == kv_.end()) {
      kv_.emplace(std::string(key), Bytes(value.begin(), value.end()));
    } else {
      it->second.assign(value.begin(), value.end());
    }
    total_bytes_ = total_bytes_ - old + add;
    return true;
  }

  // Whether parking keys that cost `cost` fits in max_total_bytes (else replies `failed`).
  bool parked_fits(Conn& c, std::size_t keys, std::size_t cost) {
    if (cost <= opts_.max_total_bytes && total_bytes_ + parked_bytes_ <= opts_.max_total_bytes - cost) return true;
    reply_error(c, Status::failed,
                "store full: waiting on " + std::to_string(keys) + (keys == 1 ? " key" : " keys") + " takes about " +
                    std::to_string(cost) + " bytes of server memory, which would pass max_total_bytes (" +
                    std::to_string(opts_.max_total_bytes) + "; " + std::to_string(total_bytes_ + parked_bytes_) +
                    " in use)");
    return false;
  }

  void malformed(Conn& c, Clock::time_point now) {
    reply_error(c, Status::invalid, "malformed request");
    close_after_reply(c, now);
  }

  static std::uint64_t clamp_ms(std::uint64_t ms) noexcept {
    constexpr std::uint64_t year = 365ull * 24 * 3600 * 1000;
    return std::min(ms, 100 * year);
  }

  void handle(Conn& c, std::span<const std::uint8_t> payload, Clock::time_point now) {
    store_proto::Reader r(payload);
    const auto op = static_cast<Op>(r.u8());
    if (c.will) c.will->last = now;
    switch (op) {
      case Op::watch: {
        const auto key = r.str();
        const auto value = r.bytes();
        const auto ms = clamp_ms(r.u64());
        if (!r.done()) return malformed(c, now);
        if (ms == 0 && !key.empty()) {  // release: the will(s) of this key and value, on any connection
          release_wills(key, value);
          return reply_ok_with(c, [&](store_proto::Writer& w) { w.i32(host_rank_); });
        }
        if (c.will) {
          parked_bytes_ -= c.will->cost;
          c.will.reset();
        }
        if (!key.empty()) {
          if (!key_ok(c, key) || !value_ok(c, key, value.size())) return;
          const std::size_t cost = parked_cost(key) + value.size() + will_reason_bytes;
          if (!parked_fits(c, 1, cost)) return;
          parked_bytes_ += cost;
          c.will = Will{std::string(key), Bytes(value.begin(), value.end()),
                        std::chrono::milliseconds(std::max<std::uint64_t>(ms, 1)), now, cost};
        }
        return reply_ok_with(c, [&](store_proto::Writer& w) { w.i32(host_rank_); });
      }
      case Op::heartbeat: {
        // Parks (as a get of the will's key, for at most wait_ms, below the silence bound) so that
        // a death reaches every watcher the moment the server sees it.
        const auto ms = clamp_ms(r.u64());
        if (!r.done()) return malformed(c, now);
        const auto it = c.will ? kv_.find(c.will->key) : kv_.end();
        if (it != kv_.end() || !c.will || ms == 0) return reply_heartbeat(c, it != kv_.end() ? &it->second : nullptr);
        const auto wait = std::min(std::chrono::milliseconds(ms), c.will->silence / 2);
        if (!parked_fits(c, 1, parked_cost(c.will->key))) return;
        return park(c, Op::heartbeat, {c.will->key}, now + wait, parked_cost(c.will->key));
      }
      case Op::set: {
        const auto key = r.str();
        const auto value = r.bytes();
        if (!r.done()) return malformed(c, now);
        if (!key_ok(c, key) || !value_ok(c, key, value.size()) || !put(c, key, value)) return;
        reply_ok(c);
        return key_changed(key);
      }
      case Op::get: {
        const auto key = r.str();
        const auto ms = clamp_ms(r.u64());
        if (!r.done()) return malformed(c, now);
        if (!key_ok(c, key)) return;
        if (auto it = kv_.find(key); it != kv_.end()) {
          return reply_ok_with(c, [&](store_proto::Writer& w) { w.bytes(it->second); });
        }
        if (ms == 0) return reply_timeout_with(c, 1, [&](store_proto::Writer& w) { w.str(key); });
        if (!parked_fits(c, 1, parked_cost(key))) return;
        return park(c, Op::get, {std::string(key)}, now + std::chrono::milliseconds(ms), parked_cost(key));
      }
      case Op::add: {
        const auto key = r.str();
        const auto delta = r.i64();
        if (!r.done()) return malformed(c, now);
        if (!key_ok(c, key)) return;
        auto it = kv_.find(key);
        const auto res = apply_add(key, it == kv_.end() ? nullptr : &it->second, delta);
        if (!res.error.empty()) return reply_error(c, Status::invalid, res.error);
        if (!put(c, key, format_counter(res.value))) return;
        reply_ok_with(c, [&](store_proto::Writer& w) { w.i64(res.value); });
        return key_changed(key);
      }
      case Op::compare_set: {
        const auto key = r.str();
        const auto expected = r.bytes();
        const auto desired = r.bytes();
        if (!r.done()) return malformed(c, now);
        if (!key_ok(c, key) || !value_ok(c, key, desired.size())) return;
        auto it = kv_.find(key);
        if (cas_matches(it == kv_.end() ? nullptr : &it->second, expected)) {
          if (!put(c, key, desired)) return;
          reply_ok_with(c, [&](store_proto::Writer& w) { w.bytes(desired); });
          return key_changed(key);
        }
        return reply_ok_with(c, [&](store_proto::Writer& w) {
          if (it == kv_.end()) {
            w.bytes({});
          } else {
            w.bytes(it->second);
          }
        });
      }
      case Op::wait:
      case Op::check: {
        // Two passes over the keys. The first checks and counts them without copying anything:
        // a key costs 8 bytes on the wire but much more once copied and parked, so nothing is
        // copied before that cost is known to fit (parked_fits).
        const std::uint32_t n = r.u32();
        const store_proto::Reader first_key = r;
        std::size_t count = 0, missing = 0, cost = 0;
        for (std::uint32_t i = 0; i < n && r.ok(); ++i) {
          const auto key = r.str();
          if (!r.ok()) break;
          if (!key_ok(c, key)) return;
          ++count;
          cost += parked_cost(key);
          if (kv_.find(key) == kv_.end()) ++missing;
        }
        const auto ms = op == Op::wait ? clamp_ms(r.u64()) : 0;
        if (!r.done()) return malformed(c, now);
        if (op == Op::check) {
          return reply_ok_with(c, [&](store_proto::Writer& w) { w.u8(missing == 0 ? 1 : 0); });
        }
        if (missing == 0) return reply_ok(c);
        auto each_key = [&](auto&& f) {
          store_proto::Reader k = first_key;
          for (std::size_t i = 0; i < count; ++i) f(k.str());
        };
        if (ms == 0) {
          return reply_timeout_with(c, missing, [&](store_proto::Writer& w) {
            each_key([&](std::string_view key) {
              if (kv_.find(key) == kv_.end()) w.str(key);
            });
          });
        }
        if (!parked_fits(c, count, cost)) return;
        std::vector<std::string> keys;
        keys.reserve(count);
        each_key([&](std::string_view key) { keys.emplace_back(key); });
        return park(c, Op::wait, std::move(keys), now + std::chrono::milliseconds(ms), cost);
      }
      case Op::num_keys: {
        if (!r.done()) return malformed(c, now);
        return reply_ok_with(c, [&](store_proto::Writer& w) { w.i64(static_cast<std::int64_t>(kv_.size())); });
      }
      case Op::delete_key: {
        const auto key = r.str();
        if (!r.done()) return malformed(c, now);
        if (!key_ok(c, key)) return;
        auto it = kv_.find(key);
        const bool existed = it != kv_.end();
        if (existed) {
          total_bytes_ -= key.size() + it->second.size();
          kv_.erase(it);
        }
        return reply_ok_with(c, [&](store_proto::Writer& w) { w.u8(existed ? 1 : 0); });
      }
    }
    reply_error(c, Status::invalid, "unknown request type " + std::to_string(static_cast<int>(op)));
    close_after_reply(c, now);
  }

  // --- liveness -----------------------------------------------------------------------------------

  static constexpr std::size_t will_reason_bytes = 128;

  void reply_heartbeat(Conn& c, const Bytes* value) {
    reply_ok_with(c, [&](store_proto::Writer& w) {
      w.u8(value != nullptr ? 1 : 0);
      w.bytes(value != nullptr ? std::span<const std::uint8_t>(*value) : std::span<const std::uint8_t>());
    });
  }

  // A rank that leaves withdraws its will from another connection (its own is held by a pending
  // heartbeat): the will goes, and the held heartbeat is answered now.
  void release_wills(std::string_view key, std::span<const std::uint8_t> value) {
    for (auto& [id, cp] : conns_) {
      Conn& o = *cp;
      if (o.dead || !o.will || o.will->key != key ||
          !std::equal(o.will->value.begin(), o.will->value.end(), value.begin(), value.end()))
        continue;
      parked_bytes_ -= o.will->cost;
      o.will.reset();
      if (o.pending && o.pending->op == Op::heartbeat) {
        reply_heartbeat(o, nullptr);
        unpark(o);
        ready_.push_back(o.id);
      }
    }
  }

  // The first will to fire sets its key; later ones (the same death seen twice, or a second
  // death) leave the first cause in place.
  void fire_will(Conn& c, const std::string& reason) {
    Will w = std::move(*c.will);
    c.will.reset();
    parked_bytes_ -= w.cost;
    if (kv_.find(w.key) != kv_.end()) return;
    Bytes v = std::move(w.value);
    v.insert(v.end(), reason.begin(), reason.end());
    total_bytes_ += w.key.size() + v.size();  // bounded: charged as parked while the will was held
    kv_.emplace(w.key, std::move(v));
    key_changed(w.key);
  }

  // --- parked get()/wait() ----------------------------------------------------------------------

  void park(Conn& c, Op op, std::vector<std::string> keys, Clock::time_point deadline, std::size_t cost) {
    for (const auto& k : keys)
      if (kv_.find(k) == kv_.end()) waiters_[k].push_back(c.id);
    c.pending = Pending{op, std::move(keys), deadline, cost};
    parked_bytes_ += cost;
  }

  void unpark(Conn& c) {
    for (const auto& k : c.pending->keys) {
      auto it = waiters_.find(k);
      if (it == waiters_.end()) continue;
      std::erase(it->second, c.id);
      if (it->second.empty()) waiters_.erase(it);
    }
    parked_bytes_ -= c.pending->cost;
    c.pending.reset();
  }

  void key_changed(std::string_view key) {
    auto it = waiters_.find(key);
    if (it == waiters_.end()) return;
    const std::vector<std::uint64_t> ids = it->second;  // unpark() edits the list
    for (const auto id : ids) {
      auto ct = conns_.find(id);
      if (ct == conns_.end() || ct->second->dead || !ct->second->pending) continue;
      Conn& c = *ct->second;
      const auto& p = *c.pending;
      if (!std::all_of(p.keys.begin(), p.keys.end(), [&](const auto& k) { return kv_.find(k) != kv_.end(); }))
        continue;
      if (p.op == Op::get) {
        const auto& value = kv_.find(p.keys.front())->second;
        reply_ok_with(c, [&](store_proto::Writer& w) { w.bytes(value); });
      } else if (p.op == Op::heartbeat) {
        reply_heartbeat(c, &kv_.find(p.keys.front())->second);
      } else {
        reply_ok(c);
      }
      unpark(c);
      ready_.push_back(c.id);
    }
  }

  // Connections that may have buffered requests to go on with (after a reply went out).
  void run_ready(Clock::time_point now) {
    while (!ready_.empty()) {
      const auto id = ready_.back();
      ready_.pop_back();
      auto it = conns_.find(id);
      if (it == conns_.end() || it->second->dead) continue;
      Conn& c = *it->second;
      guarded(c, [&] { process(c, now); });
    }
  }

  [[nodiscard]] std::optional<Clock::time_point> stall_deadline(const Conn& c) const {
    switch (c.phase) {
      case Phase::hello: return c.accepted + stall_;
      case Phase::closing:
      case Phase::draining: return c.until;
      case Phase::ready:
        if (c.out_pending() || (!c.pending && c.unread() > 0)) return c.progress + stall_;
        return std::nullopt;
    }
    return std::nullopt;
  }

  [[nodiscard]] Clock::time_point next_deadline() const {
    auto t = Clock::time_point::max();
    for (const auto& [id, c] : conns_) {
      if (c->dead) continue;
      if (c->pending) t = std::min(t, c->pending->deadline);
      if (c->will) t = std::min(t, c->will->last + c->will->silence);
      if (auto s = stall_deadline(*c)) t = std::min(t, *s);
    }
    return t;
  }

  void expire(Clock::time_point now) {
    for (auto& [id, cp] : conns_) {
      Conn& c = *cp;
      if (c.dead) continue;
      if (auto s = stall_deadline(c); s && *s <= now) {
        drop(c);
        continue;
      }
      if (c.will && c.will->last + c.will->silence <= now) {
        fire_will(c, "it sent no heartbeat for " + std::to_string(c.will->silence.count()) +
                         " ms (stopped, hung or cut off)");
        drop(c);
        continue;
      }
      if (c.pending && c.pending->deadline <= now) {
        guarded(c, [&] {
          std::vector<std::string> missing;
          for (const auto& k : c.pending->keys)
            if (kv_.find(k) == kv_.end()) missing.push_back(k);
          if (c.pending->op == Op::heartbeat) {
            reply_heartbeat(c, missing.empty() ? &kv_.find(c.pending->keys.front())->second : nullptr);
          } else if (missing.empty() && c.pending->op == Op::get) {
            const auto& value = kv_.find(c.pending->keys.front())->second;
            reply_ok_with(c, [&](store_proto::Writer& w) { w.bytes(value); });
          } else if (missing.empty()) {
            reply_ok(c);
          } else {
            reply_timeout(c, missing);
          }
          unpark(c);
          flush(c, now);
          ready_.push_back(c.id);
        });
      }
    }
  }

  TcpStoreServerConfig opts_;
  std::string token_;
  int host_rank_;  // the rank of the process hosting this server (-1: unknown)
  std::size_t frame_cap_;
  std::size_t max_connections_;
  std::chrono::milliseconds stall_;
  std::uint16_t port_ = 0;
  std::vector<SockAddr> bound_;
  std::vector<Fd> listeners_;
  Fd wake_r_;
  Fd wake_w_;
  std::atomic<bool> stop_{false};
  Clock::time_point accept_pause_until_{};

  std::map<std::string, Bytes, std::less<>> kv_;
  std::size_t total_bytes_ = 0;
  std::size_t parked_bytes_ = 0;  // what parked get()/wait() requests hold (Pending::cost)
  std::map<std::string, std::vector<std::uint64_t>, std::less<>> waiters_;
  std::unordered_map<std::uint64_t, std::unique_ptr<Conn>> conns_;
  std::vector<std::uint64_t> ready_;
  std::uint64_t next_id_ = 1;

  std::thread thread_;  // last: starts after everything above is constructed
};

}  // namespace comm::detail
