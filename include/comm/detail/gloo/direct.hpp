#pragma once
// comm's own TCP connections for the Gloo engine's small messages (the frames of checked.hpp).
//
// Why: a message over gloo's pairs costs a rendezvous (the sender waits for the receiver's
// "ready" unless it already arrived) and two thread hand-offs (gloo's event loop reads the socket,
// then wakes the waiting thread). On a machine with more busy threads than cores each hand-off
// waits for a core: an 8-byte all_reduce between two hosts took 92 us through gloo's pairs where
// OpenMPI's TCP transport, which sends eagerly and reads in the caller, takes 15 us. Here a frame
// is sent at once (header + bytes, written by the calling thread) and read by the thread that
// waits for it: one one-way trip, no hand-off.
//
// Protocol, one connection per pair of ranks (the lower rank connects, sends a 24-byte hello:
// magic, its rank, the communicator's secret): every message is an 8-byte header
// (magic, payload length) and the payload. Messages from one peer are matched to receives in the
// order both were made, which is gloo's rule for one slot: framed operations run one at a time and
// in the same order on every rank. A receive is read only once posted, into its frame; a length
// above the frame or a wrong magic is a protocol error (the connection is not read further).
//
// Every wait has the operation's deadline. close() (any thread: the engine's close_transport)
// shuts every connection down, so that a wait here returns at once and peers read end-of-stream.
//
// The door: a listener accepts anyone who can reach it, so the hello proves membership with a
// secret nobody outside the job can compute: per communicator, rank 0 draws 16 random bytes
// (getrandom) and publishes them under the communicator's store prefix; the store admits only
// holders of the job's token (COMM_STORE_TOKEN), so only the communicator's ranks read them. A
// connection whose hello lacks them (compared in constant time), or that sends none within 5 s,
// is closed and logged (COMM_DEBUG=WARN, naming the peer's address); handshakes run side by side,
// so a silent stranger delays nobody, and the members never see it.

#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <gloo/common/error.h>
#include <gloo/transport/tcp/attr.h>
#include <gloo/transport/tcp/device.h>

#include <comm/detail/base/env.hpp>
#include <comm/detail/base/logging.hpp>
#include <comm/detail/gloo/device.hpp>
#include <comm/detail/gloo/waits.hpp>
#include <comm/detail/net/socket.hpp>
#include <comm/error.hpp>
#include <comm/store.hpp>

namespace comm::detail::gloo {

/// COMM_GLOO_DIRECT: "1" / "0" force comm's connections on / off for the frames; unset: the
/// communicator's choice (GlooOptions::direct).
[[nodiscard]] inline std::optional<bool> direct_env() {
  const auto v = getenv_str("COMM_GLOO_DIRECT");
  if (!v || trim(*v).empty()) return std::nullopt;
  const auto t = trim(*v);
  if (t == "1") return true;
  if (t == "0") return false;
  throw InvalidArgument("gloo.init", -1, "COMM_GLOO_DIRECT='" + std::string(*v) + "' is not 0 or 1");
}

/// The hello's proof that a connection comes from a rank of the communicator (see the file comment).
using DirectSecret = std::array<std::uint8_t, 16>;

/// The store key under which rank 0 publishes the communicator's secret.
[[nodiscard]] inline std::string direct_secret_key(const std::string& prefix) { return prefix + "secret"; }

/// 16 bytes from the kernel's random source.
[[nodiscard]] inline DirectSecret draw_direct_secret(int rank) {
  DirectSecret s{};
  std::size_t got = 0;
  while (got < s.size()) {
    const ssize_t n = ::getrandom(s.data() + got, s.size() - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw BackendError("gloo.init", rank, "comm's direct connections: getrandom: " + errno_text(errno));
    got += static_cast<std::size_t>(n);
  }
  return s;
}

/// The communicator's secret: rank 0 draws and publishes it, the others read it (by `deadline`).
[[nodiscard]] inline DirectSecret direct_secret(comm::Store& store, const std::string& prefix, int rank,
                                                Clock::time_point deadline) {
  const std::string key = direct_secret_key(prefix);
  if (rank == 0) {
    const DirectSecret s = draw_direct_secret(rank);
    store.set(key, std::span<const std::uint8_t>(s.data(), s.size()));
    return s;
  }
  store.wait({key}, remaining(deadline));
  const auto v = store.get(key);
  DirectSecret s{};
  if (v.size() != s.size())
    throw BackendError("gloo.connect", rank,
                       "the direct connections' secret in the store is malformed (" + std::to_string(v.size()) +
                           " bytes, not " + std::to_string(s.size()) + ")",
                       "rank 0");
  std::copy(v.begin(), v.end(), s.begin());
  return s;
}

/// Constant time in the bytes: how long a refusal takes tells a stranger nothing about the secret.
[[nodiscard]] inline bool same_secret(const std::uint8_t* got, const DirectSecret& secret) noexcept {
  unsigned diff = 0;
  for (std::size_t i = 0; i < secret.size(); ++i) diff |= static_cast<unsigned>(got[i] ^ secret[i]);
  return diff == 0;
}

class DirectLinks {
 public:
  static constexpr std::uint32_t kHelloMagic = 0x48444d43u;  // "CMDH"
  static constexpr std::uint32_t kFrameMagic = 0x46444d43u;  // "CMDF"

  static constexpr std::size_t kHelloSize = 24;  // magic, rank, secret
  static constexpr auto kHelloWithin = std::chrono::seconds(5);
  static constexpr std::size_t kMaxHandshakes = 64;  // at once; more wait in the backlog
  static constexpr int kLoggedRefusals = 10;         // then one line with the count

  /// Connects this rank to every other of `size` through `store` (keys under `prefix`), listening
  /// on the address gloo's device for `spec` binds to, within `timeout`.
  DirectLinks(comm::Store& store, const std::string& prefix, int rank, int size, const DeviceSpec& spec,
              std::chrono::milliseconds timeout)
      : rank_(rank), peers_(static_cast<std::size_t>(size)) {
    const auto deadline = deadline_after(timeout);
    Fd listener = listen_like(spec);
    const SockAddr here = local_address(listener.get());
    // Rank 0's secret is in the store before its address: whoever sees one can read the other.
    DirectSecret secret{};
    if (rank == 0) secret = direct_secret(store, prefix, rank, deadline);
    store.set(prefix + std::to_string(rank), to_string(here));
    if (rank != 0) secret = direct_secret(store, prefix, rank, deadline);
    // Lower ranks connect: a connect completes in the listener's backlog, so every rank first
    // connects to the ranks above it, then accepts the ones below.
    for (int q = rank + 1; q < size; ++q) {
      const std::string key = prefix + std::to_string(q);
      store.wait({key}, remaining(deadline));
      const SockAddr there = parse_address(store.get(key), q);
      int err = 0;
      Fd fd;
      while (!(fd = connect_once(there, deadline, err))) {
        if (err != ECONNREFUSED || Clock::now() >= deadline)
          throw RemoteError("gloo.connect", rank, "comm's direct connection to rank " + std::to_string(q) + " at " +
                                                      to_string(there) + " failed: " + errno_text(err),
                            "rank " + std::to_string(q));
        ::usleep(10000);
      }
      std::array<std::uint8_t, kHelloSize> hello{};
      put32(hello.data(), kHelloMagic);
      put32(hello.data() + 4, static_cast<std::uint32_t>(rank));
      std::copy(secret.begin(), secret.end(), hello.begin() + 8);
      if (auto r = send_all(fd.get(), hello, deadline); !r.ok())
        throw RemoteError("gloo.connect", rank, "comm's direct connection to rank " + std::to_string(q) + ": " + r.text(),
                          "rank " + std::to_string(q));
      peers_[static_cast<std::size_t>(q)].fd = std::move(fd);
    }
    accept_lower(listener.get(), secret, deadline);
  }

  DirectLinks(const DirectLinks&) = delete;
  DirectLinks& operator=(const DirectLinks&) = delete;

  /// Queues `n` bytes at `data` (valid until sent) to `peer` and writes what the socket takes.
  /// Returns the send's ticket for wait_sent.
  std::uint64_t send(int peer, const std::byte* data, std::size_t n) {
    Peer& p = at(peer);
    Out o{data, n, 0, {}};
    put32(o.header.data(), kFrameMagic);
    put32(o.header.data() + 4, static_cast<std::uint32_t>(n));
    p.out.push_back(o);
    if (!closed_.load(std::memory_order_relaxed)) (void)write_some(p);
    return ++p.queued;
  }
  /// Posts a receive of at most `cap` bytes into `dst` for `peer`'s next message. Returns its ticket.
  std::uint64_t post_recv(int peer, std::byte* dst, std::size_t cap) {
    Peer& p = at(peer);
    p.in.push_back(In{dst, cap, 0, 0});
    return ++p.posted;
  }

  /// Waits until `peer` got send `ticket` (all of it handed to the kernel).
  void wait_sent(int peer, std::uint64_t ticket, const Deadline& d, const char* op, std::uint64_t seq) {
    Peer& p = at(peer);
    wait([&] { return p.sent >= ticket; }, peer, d, true, op, seq);
  }
  /// Waits until receive `ticket` from `peer` is complete.
  void wait_received(int peer, std::uint64_t ticket, const Deadline& d, const char* op, std::uint64_t seq) {
    Peer& p = at(peer);
    wait([&] { return p.received >= ticket; }, peer, d, false, op, seq);
  }

  /// From any thread: every wait ends (the next one at once) and peers see the connections close.
  void close() noexcept {
    closed_.store(true);
    for (auto& p : peers_)
      if (p.fd) ::shutdown(p.fd.get(), SHUT_RDWR);
  }

 private:
  struct Out {
    const std::byte* data;
    std::size_t n;
    std::size_t done;  // of header + payload
    std::array<std::uint8_t, 8> header;
  };
  struct In {
    std::byte* dst;
    std::size_t cap;
    std::size_t got;  // payload bytes read
    std::size_t len;  // payload length, from the header
  };
  struct Peer {
    Fd fd;
    std::deque<Out> out;
    std::deque<In> in;
    std::uint64_t queued = 0, sent = 0, posted = 0, received = 0;
    std::array<std::uint8_t, 8> header{};
    std::size_t header_got = 0;
    std::string failed;  // why the connection is unusable ("" while it is)
  };

  /// A connection being accepted: its hello so far.
  struct Handshake {
    Fd fd;
    SockAddr from;
    std::array<std::uint8_t, kHelloSize> hello{};
    std::size_t got = 0;
    Clock::time_point until;
  };

  /// Accepts the ranks below this one. Every connection gets kHelloWithin to send a hello with
  /// the secret; the others are refused (closed, one log line each), side by side with the rest.
  void accept_lower(int listener, const DirectSecret& secret, Clock::time_point deadline) {
    std::vector<Handshake> pending;
    std::vector<pollfd> fds;
    int refused = 0;
    const auto refuse = [&](const Handshake& h, const std::string& why) {
      if (++refused <= kLoggedRefusals)
        log(LogLevel::warn, "gloo direct connections: rank " + std::to_string(rank_) + " refused a connection from " +
                                to_string(h.from) + ": " + why);
    };
    for (int accepted = 0; accepted < rank_;) {
      auto now = Clock::now();
      for (auto it = pending.begin(); it != pending.end();) {
        if (now >= it->until) {
          refuse(*it, "no hello within " + std::to_string(kHelloWithin.count()) + " s");
          it = pending.erase(it);
        } else {
          ++it;
        }
      }
      if (now >= deadline)
        throw Timeout("gloo.connect", rank_,
                      "comm's direct connections: " + std::to_string(rank_ - accepted) + " of the ranks below " +
                          std::to_string(rank_) + " did not connect" +
                          (refused > 0 ? " (" + std::to_string(refused) + " other connections refused)" : ""));
      auto wake = deadline;
      fds.clear();
      fds.push_back({listener, static_cast<short>(pending.size() < kMaxHandshakes ? POLLIN : 0), 0});
      for (const auto& h : pending) {
        fds.push_back({h.fd.get(), POLLIN, 0});
        wake = std::min(wake, h.until);
      }
      const auto ms = std::chrono::ceil<std::chrono::milliseconds>(wake - now).count();
      if (::poll(fds.data(), fds.size(), static_cast<int>(std::clamp<long long>(ms, 0, 100))) < 0 && errno != EINTR)
        throw BackendError("gloo.connect", rank_, "comm's direct connections: poll: " + errno_text(errno));
      now = Clock::now();
      // Handshakes first (fds[1..] are pending[0..] as polled), then new connections.
      for (std::size_t i = pending.size(); i-- > 0;) {
        if (fds[i + 1].revents == 0) continue;
        Handshake& h = pending[i];
        const ssize_t n = ::recv(h.fd.get(), h.hello.data() + h.got, h.hello.size() - h.got, MSG_DONTWAIT);
        if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
        if (n <= 0) {
          refuse(h, n == 0 ? "closed before its hello" : "failed before its hello: " + errno_text(errno));
          pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
          continue;
        }
        h.got += static_cast<std::size_t>(n);
        if (h.got < h.hello.size()) continue;
        const std::uint32_t q = get32(h.hello.data() + 4);
        std::string why;
        if (get32(h.hello.data()) != kHelloMagic)
          why = "not a comm hello";
        else if (!same_secret(h.hello.data() + 8, secret))
          why = "wrong secret";
        else if (q >= static_cast<std::uint32_t>(rank_) || peers_[q].fd)
          why = "claims rank " + std::to_string(q) + ", which is not a rank below " + std::to_string(rank_) +
                " still to connect";
        if (!why.empty()) {
          refuse(h, why);
        } else {
          set_nodelay(h.fd.get());
          peers_[q].fd = std::move(h.fd);
          ++accepted;
        }
        pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
      }
      if ((fds[0].revents & POLLIN) != 0) {
        for (int k = 0; k < 16 && pending.size() < kMaxHandshakes; ++k) {
          Fd fd(::accept4(listener, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
          if (!fd) break;
          Handshake h;
          h.from = peer_address(fd.get());
          h.fd = std::move(fd);
          h.until = now + kHelloWithin;
          pending.push_back(std::move(h));
        }
      }
    }
    for (const auto& h : pending) refuse(h, "no hello yet when every rank below had connected");
    if (refused > kLoggedRefusals)
      log(LogLevel::warn, "gloo direct connections: rank " + std::to_string(rank_) + " refused " +
                              std::to_string(refused - kLoggedRefusals) + " more connections (not logged one by one)");
  }

  Peer& at(int peer) {
    if (peer < 0 || static_cast<std::size_t>(peer) >= peers_.size() || !peers_[static_cast<std::size_t>(peer)].fd)
      throw InvalidArgument("gloo", rank_, "no direct connection to rank " + std::to_string(peer));
    return peers_[static_cast<std::size_t>(peer)];
  }

  static void put32(std::uint8_t* p, std::uint32_t v) noexcept { std::memcpy(p, &v, 4); }
  [[nodiscard]] static std::uint32_t get32(const std::uint8_t* p) noexcept {
    std::uint32_t v = 0;
    std::memcpy(&v, p, 4);
    return v;
  }

  /// A listening socket on the address gloo's device binds to (same interface choice), any port.
  [[nodiscard]] Fd listen_like(const DeviceSpec& spec) const {
    ::gloo::transport::tcp::attr a;
    a.iface = spec.iface;
    a.hostname = spec.hostname;
    SockAddr addr;
    try {
      const auto r = ::gloo::transport::tcp::CreateDeviceAttr(a);
      std::memcpy(&addr.storage, &r.ai_addr, sizeof addr.storage);
      addr.len = static_cast<socklen_t>(r.ai_addrlen);
    } catch (const std::exception& e) {
      throw InvalidArgument("gloo.init", rank_, std::string("comm's direct connections: no address: ") + e.what());
    }
    addr.set_port(0);
    int err = 0;
    Fd fd = listen_on(addr, err);
    if (!fd)
      throw BackendError("gloo.init", rank_,
                         "comm's direct connections: cannot listen on " + to_string(addr) + ": " + errno_text(err));
    return fd;
  }

  [[nodiscard]] SockAddr parse_address(const comm::Store::Bytes& v, int q) const {
    const std::string s(v.begin(), v.end());
    const auto colon = s.rfind(':');
    int port = -1;
    if (s.size() <= 64 && colon != std::string::npos && colon + 1 < s.size() &&
        s.find_first_not_of("0123456789", colon + 1) == std::string::npos && s.size() - colon <= 6)
      port = std::stoi(s.substr(colon + 1));
    Resolved r;
    if (port > 0 && port < 65536) r = resolve(strip_brackets(s.substr(0, colon)), static_cast<std::uint16_t>(port));
    if (r.addrs.empty())
      throw BackendError("gloo.connect", rank_,
                         "rank " + std::to_string(q) + "'s direct address in the store is malformed (" +
                             std::to_string(v.size()) + " bytes)",
                         "rank " + std::to_string(q));
    return r.addrs.front();
  }

  /// Writes what the socket takes of `p`'s queue; false: the connection failed (p.failed says why).
  bool write_some(Peer& p) {
    while (!p.out.empty()) {
      Out& o = p.out.front();
      iovec iov[2];
      int k = 0;
      if (o.done < 8) iov[k++] = {o.header.data() + o.done, 8 - o.done};
      const std::size_t from = o.done < 8 ? 0 : o.done - 8;
      if (from < o.n) iov[k++] = {const_cast<std::byte*>(o.data) + from, o.n - from};
      msghdr m{};
      m.msg_iov = iov;
      m.msg_iovlen = static_cast<std::size_t>(k);
      // MSG_EOR ends the frame's last skb (the kernel applies it only to the write that takes the
      // frame's last byte), which the kernel then never autocorks: a short tail that
      // tcp_autocorking holds until this socket's earlier skbs leave the host waits, behind a
      // shaped or shared link's queue, for the whole queue (4 nodes x 2, 4 MiB all_reduce, whose
      // frames are 64 KiB and 8 bytes: 1.5-2.5x the link bound, 1.08x with it;
      // benchmarks/RESULTS.md, "A frame's tail held by autocorking").
      const ssize_t w = ::sendmsg(p.fd.get(), &m, MSG_NOSIGNAL | MSG_DONTWAIT | eor_);
      if (w < 0) {
        if (errno == EINTR) continue;
        if (errno == EOPNOTSUPP && eor_ != 0) {  // a kernel that refuses MSG_EOR on TCP: plain writes
          eor_ = 0;
          continue;
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
        p.failed = errno_text(errno);
        return false;
      }
      o.done += static_cast<std::size_t>(w);
      if (o.done < 8 + o.n) return true;
      p.out.pop_front();
      ++p.sent;
    }
    return true;
  }

  /// Reads what has arrived for `p`'s posted receives; false: the connection failed or the peer
  /// broke the protocol (p.failed says why).
  bool read_some(Peer& p) {
    while (!p.in.empty()) {
      In& in = p.in.front();
      ssize_t got = 0;
      if (p.header_got < 8) {
        got = ::recv(p.fd.get(), p.header.data() + p.header_got, 8 - p.header_got, MSG_DONTWAIT);
      } else if (in.got < in.len) {
        got = ::recv(p.fd.get(), in.dst + in.got, in.len - in.got, MSG_DONTWAIT);
      }
      if (got == 0 && (p.header_got < 8 || in.got < in.len)) {
        p.failed = "the connection was closed";
        return false;
      }
      if (got < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
        p.failed = errno == ECONNRESET ? "the connection was reset" : errno_text(errno);
        return false;
      }
      if (p.header_got < 8) {
        p.header_got += static_cast<std::size_t>(got);
        if (p.header_got < 8) continue;
        const std::uint32_t len = get32(p.header.data() + 4);
        if (get32(p.header.data()) != kFrameMagic || len > in.cap) {
          p.failed = get32(p.header.data()) != kFrameMagic
                         ? "it sent bytes that are not a comm frame"
                         : "it sent a message of " + std::to_string(len) + " bytes for a receive of " +
                               std::to_string(in.cap);
          return false;
        }
        in.len = len;
      } else {
        in.got += static_cast<std::size_t>(got);
      }
      if (p.header_got == 8 && in.got == in.len) {
        p.in.pop_front();
        p.header_got = 0;
        ++p.received;
      }
    }
    return true;
  }

  /// Drives every connection with pending work until `done()`, the deadline or a failure.
  template <class Done>
  void wait(Done&& done, int peer, const Deadline& d, bool sending, const char* op, std::uint64_t seq) {
    const auto spin_until = Clock::now() + kSpin;
    const auto what = [&] {
      return std::string(sending ? "sending to" : "receiving from") + " rank " + std::to_string(peer) + " in op #" +
             std::to_string(seq) + ", over comm's direct connections";
    };
    for (;;) {
      if (closed_.load()) {
        // A frame that came in before the close is still taken, as on gloo's own pairs
        // (checked.hpp, FramedOp::waited): a mismatch in it is this rank's own DesyncError, not
        // the echo of the failure that mismatch caused elsewhere.
        if (!sending && done()) return;
        throw ::gloo::IoException(sending ? "send aborted" : "receive aborted");
      }
      for (std::size_t q = 0; q < peers_.size(); ++q) {
        Peer& p = peers_[q];
        if (!p.fd || (!p.failed.empty() && q != static_cast<std::size_t>(peer))) continue;
        if (!p.failed.empty() || !(p.out.empty() || write_some(p)) || !(p.in.empty() || read_some(p))) {
          if (closed_.load()) throw ::gloo::IoException(sending ? "send aborted" : "receive aborted");
          // A peer that died or broke the protocol: this operation cannot complete.
          throw RemoteError(op, rank_, "the connection to rank " + std::to_string(q) + " failed: " + p.failed + " [" + what() + "]",
                            "rank " + std::to_string(q));
        }
      }
      if (done()) return;
      const auto now = Clock::now();
      if (now < spin_until) {
        // A reply often comes within a few microseconds: yielding keeps this rank from paying a
        // sleep and a wake-up for it, and lets a rank that shares the core run meanwhile.
        ::sched_yield();
        continue;
      }
      pollfds_.clear();
      for (auto& p : peers_) {
        if (!p.fd) continue;
        const short ev = static_cast<short>((p.out.empty() ? 0 : POLLOUT) | (p.in.empty() ? 0 : POLLIN));
        if (ev != 0) pollfds_.push_back({p.fd.get(), ev, 0});
      }
      const auto left = d.left();
      if (d.expired())
        throw Timeout(op, rank_, "timed out [" + what() + "]",
                      "rank " + std::to_string(peer));
      const int ms = static_cast<int>(std::min<std::chrono::milliseconds::rep>(left.count(), 100));
      if (::poll(pollfds_.data(), pollfds_.size(), ms) < 0 && errno != EINTR)
        throw BackendError(op, rank_, "poll: " + errno_text(errno) + " [" + what() + "]");
    }
  }

  static constexpr std::chrono::microseconds kSpin{50};
  int eor_ = MSG_EOR;

  int rank_;
  std::vector<Peer> peers_;
  std::vector<pollfd> pollfds_;
  std::atomic<bool> closed_{false};
};

}  // namespace comm::detail::gloo
