#pragma once
// The TcpStore server's network side: one thread running an epoll loop over non-blocking sockets.
// A turn costs what its ready connections and due deadlines cost, not the number of connections:
// epoll reports only the sockets with events, each connection's interest is changed only when it
// changes, and deadlines (stalls, parked requests, silent wills) wait in a heap that a connection
// enters when its earliest deadline moves earlier (and re-enters, lazily, when it fires early). So
// thousands of idle or parked connections (a large job's liveness watches) cost nothing per turn.
// What is stored and how each request is answered (the table, parked waiters, wills, replies) is
// tcp_store_requests.hpp's.
//
// Per connection it buffers at most one request frame (its length checked against the frame
// limit before anything is buffered beyond the 8-byte header) and answers requests in order. A
// connection is dropped when it sends a bad magic, a wrong token, an oversized or malformed frame
// (after an error reply where the framing still holds), when its handshake does not complete
// within the stall timeout, or when a started request or a pending reply makes no progress for the
// stall timeout. Nothing here throws out of the thread. A connection with a will (Op::watch:
// liveness) fires it when it closes, errs or stays silent past its silence bound.

#include <fcntl.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/resource.h>
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
#include <queue>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include <comm/error.hpp>
#include <comm/detail/base/logging.hpp>
#include <comm/detail/net/socket.hpp>
#include <comm/detail/store/common.hpp>
#include <comm/detail/store/protocol.hpp>
#include <comm/detail/store/tcp_store_requests.hpp>

namespace comm::detail {

class TcpStoreServer : private TcpStoreRequests {
 public:
  /// Binds and listens on every address `host` resolves to (port 0: a free port, the same on
  /// all of them), then starts the thread. Throws on bind failure; nothing is left running.
  TcpStoreServer(const std::string& host, std::uint16_t port, TcpStoreServerConfig cfg, int rank)
      : TcpStoreRequests(std::move(cfg), rank),
        token_(opts_.token),
        frame_cap_(store_proto::frame_limit(opts_.max_key_bytes, opts_.max_value_bytes)),
        max_connections_(std::max<std::size_t>(opts_.max_connections, 1)) {
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
    ep_.reset(::epoll_create1(EPOLL_CLOEXEC));
    if (!ep_) throw BackendError("store.listen", rank, "cannot create the server's epoll set: " + errno_text(errno));
    if (!ep_add(wake_r_.get(), EPOLLIN, kWakeTag))
      throw BackendError("store.listen", rank, "cannot watch the wake-up pipe: " + errno_text(errno));
    for (std::size_t i = 0; i < listeners_.size(); ++i)
      if (!ep_add(listeners_[i].get(), EPOLLIN, kListenTag + i))
        throw BackendError("store.listen", rank, "cannot watch the listening socket: " + errno_text(errno));
    raise_fd_limit(max_connections_ + reject_slack + 64);
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
  /// Clients connected now (any thread): a launcher that hosts the store for other nodes keeps
  /// it up until their ranks have let go.
  [[nodiscard]] std::size_t clients() const noexcept { return clients_.load(std::memory_order_relaxed); }

 private:
  static constexpr std::size_t read_chunk = std::size_t{64} << 10;
  static constexpr std::size_t max_read_chunk = std::size_t{4} << 20;
  static constexpr std::size_t reject_slack = 64;  // rejected connections kept to deliver the reason
  static constexpr std::size_t min_room = 4096;  // read_some's least room for a read
  // A connection keeps buffers up to this between requests. A rendezvous' multi_get reply is
  // N records (~180 KiB at 4,096 ranks) on a connection that then stays open and idle: kept, that
  // was ~0.75 GiB held by the process that hosts the store.
  static constexpr std::size_t keep_capacity = std::size_t{64} << 10;

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

  // epoll tags: connection ids start at 1, far below these.
  static constexpr std::uint64_t kWakeTag = ~std::uint64_t{0};
  static constexpr std::uint64_t kListenTag = std::uint64_t{1} << 62;

  /// A server for thousands of connections needs as many descriptors: the soft limit is raised
  /// toward `want` (never past the hard limit, never lowered). Best effort: accept() pauses on
  /// EMFILE either way.
  static void raise_fd_limit(std::size_t want) noexcept {
    rlimit rl{};
    if (::getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= want) return;
    rl.rlim_cur = rl.rlim_max == RLIM_INFINITY ? static_cast<rlim_t>(want) : std::min<rlim_t>(rl.rlim_max, want);
    (void)::setrlimit(RLIMIT_NOFILE, &rl);
  }

  bool ep_add(int fd, std::uint32_t events, std::uint64_t tag) noexcept {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = tag;
    return ::epoll_ctl(ep_.get(), EPOLL_CTL_ADD, fd, &ev) == 0;
  }

  // Brings connection `c`'s registration and timer up to date after anything happened to it.
  void settle(Conn& c) {
    if (c.dead) return;
    // A parked request keeps EPOLLIN (what comes meanwhile is buffered, not handled) and EPOLLRDHUP
    // (a parked client that goes away) as a reading connection has them, so that parking and
    // answering a heartbeat (every watch, every silence/2) changes nothing registered: two
    // epoll_ctl calls of five system calls a heartbeat before.
    std::uint32_t ev = 0;
    if (wants_read(c)) ev |= EPOLLIN | EPOLLRDHUP;
    if (c.out_pending()) ev |= EPOLLOUT;
    if (c.pending) ev |= EPOLLRDHUP;
    if (ev != c.events) {
      epoll_event e{};
      e.events = ev;
      e.data.u64 = c.id;
      if (::epoll_ctl(ep_.get(), EPOLL_CTL_MOD, c.fd.get(), &e) != 0) return drop(c);
      c.events = ev;
    }
    schedule(c);
  }

  // Queues `c` in the timer heap at its earliest deadline, unless it is queued no later already.
  void schedule(Conn& c) {
    const auto d = conn_deadline(c);
    if (d >= c.timer) return;
    c.timer = d;
    timers_.push({d, c.id});
  }

  void loop() {
    std::vector<epoll_event> evs(256);
    bool accepting = true;
    while (!stop_.load()) {
      auto now = Clock::now();
      if (!accepting && now >= accept_pause_until_) {
        accepting = true;
        set_listening(true);
      }
      auto next = timers_.empty() ? Clock::time_point::max() : timers_.top().first;
      if (!accepting) next = std::min(next, accept_pause_until_);
      const int n = ::epoll_wait(ep_.get(), evs.data(), static_cast<int>(evs.size()), poll_timeout_ms(next, now));
      if (n < 0 && errno != EINTR) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      now = Clock::now();
      if (stop_.load()) break;
      for (int i = 0; i < n; ++i) {
        const std::uint64_t tag = evs[static_cast<std::size_t>(i)].data.u64;
        const std::uint32_t re = evs[static_cast<std::size_t>(i)].events;
        if (tag == kWakeTag) {
          char buf[64];
          while (::read(wake_r_.get(), buf, sizeof buf) > 0) {
          }
          continue;
        }
        if (tag >= kListenTag) {
          if (accepting) accept_all(listeners_[static_cast<std::size_t>(tag - kListenTag)].get(), now);
          continue;
        }
        auto it = conns_.find(tag);
        if (it == conns_.end() || it->second->dead) continue;
        Conn& c = *it->second;
        guarded(c, [&] { on_events(c, re, now); });
        settle(c);
      }
      if (accepting && now < accept_pause_until_) {
        accepting = false;
        set_listening(false);
      }
      if (n == static_cast<int>(evs.size()) && evs.size() < 4096) evs.resize(evs.size() * 2);
      run_ready(now);
      expire(now);
      run_ready(now);
      for (const auto id : dead_) conns_.erase(id);
      dead_.clear();
    }
  }

  void set_listening(bool on) noexcept {
    for (std::size_t i = 0; i < listeners_.size(); ++i) {
      epoll_event e{};
      e.events = on ? static_cast<std::uint32_t>(EPOLLIN) : 0u;
      e.data.u64 = kListenTag + i;
      (void)::epoll_ctl(ep_.get(), EPOLL_CTL_MOD, listeners_[i].get(), &e);
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
    if (c.dead) return false;
    if (c.phase == Phase::draining) return true;
    if (c.phase == Phase::closing || c.out_pending()) return false;
    // A parked client has no reason to send (comm's clients wait for each reply): what one sends
    // anyway is held only up to this, then left to the kernel and TCP's flow control as before,
    // so a parked request cannot hold a frame's worth of a stranger's bytes for its whole wait.
    if (c.pending) return c.unread() < keep_capacity;
    return c.unread() < frame_cap_ + store_proto::frame_header_size + store_proto::max_token_bytes + 16;
  }

  void on_events(Conn& c, std::uint32_t re, Clock::time_point now) {
    if ((re & EPOLLERR) != 0) return drop(c);
    if (c.pending) {
      if ((re & (EPOLLRDHUP | EPOLLHUP)) != 0) return drop(c);
      if ((re & EPOLLIN) != 0 && wants_read(c)) read_some(c, now);  // buffered until it is answered
      return;
    }
    if ((re & EPOLLOUT) != 0) {
      flush(c, now);
      if (c.dead) return;
      if (!c.out_pending()) ready_.push_back(c.id);
    }
    if ((re & (EPOLLIN | EPOLLHUP | EPOLLRDHUP)) != 0) {
      if (wants_read(c)) {
        read_some(c, now);
      } else if ((re & EPOLLHUP) != 0) {
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
      if (conns_.size() >= max_connections_ + reject_slack) continue;  // closes it at once
      set_nodelay(fd);
      auto c = std::make_unique<Conn>();
      c->fd = std::move(owned);
      c->id = next_id_++;
      c->accepted = c->progress = now;
      c->events = EPOLLIN | EPOLLRDHUP;  // as settle() keeps a reading connection
      if (!ep_add(fd, c->events, c->id)) continue;  // closes it at once
      Conn& ref = *c;
      conns_.emplace(c->id, std::move(c));
      if (active_ >= max_connections_) {
        ref.counted = false;
        const auto r = store_proto::encode_hello_reply(
            store_proto::HelloStatus::too_many_connections,
            "server at its connection limit (" + std::to_string(max_connections_) + " connections)");
        ref.out.assign(r.begin(), r.end());
        close_after_reply(ref, now);
        flush(ref, now);
      } else {
        clients_.store(++active_, std::memory_order_relaxed);
      }
      settle(ref);
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
    // Read into the room the buffer already has: a small request (a heartbeat, a set) costs one
    // recv. Only a read that fills the room asks the socket how much more waits (FIONREAD) and
    // grows the buffer by that, within a bounded chunk: memory follows the bytes that really
    // arrived, never a length the peer claims. (An allocator that left the room unzeroed saved a
    // tenth of the server's CPU in a 4,096-rank rendezvous, but it constructs byte by byte where
    // the build does not optimize: at -O0 a 4 MiB read took tens of ms, enough to starve
    // heartbeats into a false death in CI.)
    const std::size_t limit = c.pending                    ? keep_capacity - std::min(c.unread(), keep_capacity)
                              : c.phase == Phase::ready ? max_read_chunk
                                                        : read_chunk;
    if (c.in.capacity() - c.in.size() < min_room) c.in.reserve(c.in.size() + min_room);
    std::size_t room = std::min(c.in.capacity() - c.in.size(), limit);
    bool got = false;
    for (int pass = 0; pass < 2; ++pass) {
      const std::size_t old = c.in.size();
      c.in.resize(old + room);
      ssize_t n = 0;
      do {
        n = ::recv(c.fd.get(), c.in.data() + old, room, 0);
      } while (n < 0 && errno == EINTR);
      if (n <= 0) {
        c.in.resize(old);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        // EOF or reset: finish the complete requests already here, then forget the connection.
        process(c, now);
        return drop(c);
      }
      c.in.resize(old + static_cast<std::size_t>(n));
      c.progress = now;
      got = true;
      if (static_cast<std::size_t>(n) < room || c.pending) break;
      int avail = 0;
      if (pass == 1 || ::ioctl(c.fd.get(), FIONREAD, &avail) != 0 || avail <= 0) break;
      room = std::min(static_cast<std::size_t>(avail), limit);
    }
    if (got) process(c, now);
  }

  void process(Conn& c, Clock::time_point now) {
    for (;;) {
      if (c.dead) return;
      if (c.out_pending()) {
        flush(c, now);
        if (c.dead || c.out_pending()) return;
      }
      if (c.pending) {
        if (answer_complete(c)) continue;  // its reply goes out at the loop's top
        return;
      }
      if (c.phase != Phase::hello && c.phase != Phase::ready) return;
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
      log_refusal(c, rank, token.empty() ? "no token" : "a wrong token", now);
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

  /// One COMM_DEBUG=WARN line per refused connection, naming the peer: a stranger knocking is
  /// worth knowing about, and the members never hear of it. At most 10 lines a second, so a
  /// flood cannot fill the log; the next line says how many went unlogged.
  void log_refusal(const Conn& c, std::int32_t claimed_rank, std::string_view what, Clock::time_point now) {
    if (now - refusal_window_ >= std::chrono::seconds(1)) {
      refusal_window_ = now;
      refusals_in_window_ = 0;
    }
    if (++refusals_in_window_ > 10) {
      ++refusals_unlogged_;
      return;
    }
    std::string line = "store server refused a connection from " + to_string(peer_address(c.fd.get())) + " (claims rank " +
                       std::to_string(claimed_rank) + "): " + std::string(what);
    if (refusals_unlogged_ > 0) line += " (" + std::to_string(refusals_unlogged_) + " earlier refusals not logged)";
    refusals_unlogged_ = 0;
    log(LogLevel::warn, line);
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

  // --- sending ------------------------------------------------------------------------------

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
    recycle_out(c, keep_capacity);
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
    if (c.counted) clients_.store(--active_, std::memory_order_relaxed);
    dead_.push_back(c.id);
    c.fd.reset();  // closing it also takes it out of the epoll set
    Bytes().swap(c.in);
    c.in_off = 0;
    recycle_out(c, 0);
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
      settle(c);
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

  // The earliest time something is due on `c`: its stall bound, its parked request's deadline,
  // its will's silence bound.
  [[nodiscard]] Clock::time_point conn_deadline(const Conn& c) const {
    auto t = Clock::time_point::max();
    if (c.dead) return t;
    if (c.pending) t = std::min(t, c.pending->deadline);
    if (c.will) t = std::min(t, c.will->last + c.will->silence);
    if (auto s = stall_deadline(c)) t = std::min(t, *s);
    return t;
  }

  // The connections whose timer is due: each is checked against its real deadlines (a request
  // since may have moved them later) and queued again for the next.
  void expire(Clock::time_point now) {
    while (!timers_.empty() && timers_.top().first <= now) {
      const auto [t, id] = timers_.top();
      timers_.pop();
      auto it = conns_.find(id);
      if (it == conns_.end() || it->second->dead || it->second->timer != t) continue;  // stale
      Conn& c = *it->second;
      c.timer = Clock::time_point::max();
      expire_one(c, now);
      settle(c);
    }
  }

  void expire_one(Conn& c, Clock::time_point now) {
    if (auto s = stall_deadline(c); s && *s <= now) return drop(c);
    if (c.will && c.will->last + c.will->silence <= now) {
      fire_will(c, "it sent no heartbeat for " + std::to_string(c.will->silence.count()) +
                       " ms (stopped, hung or cut off)");
      return drop(c);
    }
    if (c.pending && c.pending->deadline <= now) {
      guarded(c, [&] {
        (void)answer_parked(c, true);
        flush(c, now);
        ready_.push_back(c.id);
      });
    }
  }

  std::string token_;
  std::size_t frame_cap_;
  std::size_t max_connections_;
  std::uint16_t port_ = 0;
  std::vector<SockAddr> bound_;
  std::vector<Fd> listeners_;
  Fd wake_r_;
  Fd wake_w_;
  Fd ep_;
  std::size_t active_ = 0;            // live connections counted against max_connections
  std::atomic<std::size_t> clients_{0};  // active_, for clients()
  std::vector<std::uint64_t> dead_;   // dropped this turn: erased at its end
  // (deadline, connection id), earliest first; an entry is current while it equals Conn::timer.
  std::priority_queue<std::pair<Clock::time_point, std::uint64_t>,
                      std::vector<std::pair<Clock::time_point, std::uint64_t>>, std::greater<>>
      timers_;
  std::atomic<bool> stop_{false};
  Clock::time_point accept_pause_until_{};
  Clock::time_point refusal_window_{};  // log_refusal's rate limit
  int refusals_in_window_ = 0;
  std::uint64_t refusals_unlogged_ = 0;
  std::uint64_t next_id_ = 1;

  std::thread thread_;  // last: starts after everything above is constructed
};

}  // namespace comm::detail
