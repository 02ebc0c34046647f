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
// Protocol, one connection per pair of ranks (the lower rank connects, sends a 16-byte hello:
// magic, its rank, a token of the communicator's store prefix): every message is an 8-byte header
// (magic, payload length) and the payload. Messages from one peer are matched to receives in the
// order both were made, which is gloo's rule for one slot: framed operations run one at a time and
// in the same order on every rank. A receive is read only once posted, into its frame; a length
// above the frame or a wrong magic is a protocol error (the connection is not read further).
//
// Every wait has the operation's deadline. close() (any thread: the engine's close_transport)
// shuts every connection down, so that a wait here returns at once and peers read end-of-stream.

#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
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

#include <comm/detail/init/env.hpp>
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

/// The hello's proof that a connection comes from the same communicator (its store prefix).
[[nodiscard]] inline std::uint64_t direct_token(const std::string& prefix) noexcept {
  std::uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (const char c : prefix) h = (h ^ static_cast<std::uint8_t>(c)) * 0x100000001b3ull;
  return h;
}

class DirectLinks {
 public:
  static constexpr std::uint32_t kHelloMagic = 0x48444d43u;  // "CMDH"
  static constexpr std::uint32_t kFrameMagic = 0x46444d43u;  // "CMDF"

  /// Connects this rank to every other of `size` through `store` (keys under `prefix`), listening
  /// on the address gloo's device for `spec` binds to, within `timeout`.
  DirectLinks(comm::Store& store, const std::string& prefix, int rank, int size, const DeviceSpec& spec,
              std::chrono::milliseconds timeout)
      : rank_(rank), peers_(static_cast<std::size_t>(size)) {
    const auto deadline = deadline_after(timeout);
    const std::uint64_t token = direct_token(prefix);
    Fd listener = listen_like(spec);
    const SockAddr here = local_address(listener.get());
    store.set(prefix + std::to_string(rank), to_string(here));
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
      std::array<std::uint8_t, 16> hello{};
      put32(hello.data(), kHelloMagic);
      put32(hello.data() + 4, static_cast<std::uint32_t>(rank));
      std::memcpy(hello.data() + 8, &token, 8);
      if (auto r = send_all(fd.get(), hello, deadline); !r.ok())
        throw RemoteError("gloo.connect", rank, "comm's direct connection to rank " + std::to_string(q) + ": " + r.text(),
                          "rank " + std::to_string(q));
      peers_[static_cast<std::size_t>(q)].fd = std::move(fd);
    }
    for (int accepted = 0; accepted < rank;) {
      if (auto r = wait_ready(listener.get(), POLLIN, deadline); !r.ok())
        throw Timeout("gloo.connect", rank,
                      "comm's direct connections: " + std::to_string(rank - accepted) + " of the ranks below " +
                          std::to_string(rank) + " did not connect: " + r.text());
      Fd fd(::accept4(listener.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (!fd) continue;
      std::array<std::uint8_t, 16> hello{};
      // A stranger's connection (wrong magic or token, a rank that is not below or already came)
      // is dropped: only the communicator's ranks know the token.
      if (!recv_all(fd.get(), hello, std::min(deadline, Clock::now() + std::chrono::seconds(5))).ok()) continue;
      std::uint64_t got = 0;
      std::memcpy(&got, hello.data() + 8, 8);
      const std::uint32_t q = get32(hello.data() + 4);
      if (get32(hello.data()) != kHelloMagic || got != token || q >= static_cast<std::uint32_t>(rank) ||
          peers_[q].fd)
        continue;
      set_nodelay(fd.get());
      peers_[q].fd = std::move(fd);
      ++accepted;
    }
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
      const ssize_t w = ::sendmsg(p.fd.get(), &m, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w < 0) {
        if (errno == EINTR) continue;
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
      if (closed_.load()) throw ::gloo::IoException(sending ? "send aborted" : "receive aborted");
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

  int rank_;
  std::vector<Peer> peers_;
  std::vector<pollfd> pollfds_;
  std::atomic<bool> closed_{false};
};

}  // namespace comm::detail::gloo
