#pragma once
// POSIX socket helpers used by the stores: an owning descriptor, deadlines, name resolution,
// connect/send/recv bounded by a deadline, and free_port(). Internal; may change at any time.

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <comm/error.hpp>

namespace comm::detail {

using Clock = std::chrono::steady_clock;

/// `now + t`, saturating at time_point::max() (so a huge timeout never overflows);
/// a negative `t` is treated as zero.
[[nodiscard]] inline Clock::time_point deadline_after(std::chrono::milliseconds t,
                                                     Clock::time_point now = Clock::now()) noexcept {
  if (t.count() <= 0) return now;
  const auto room = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::time_point::max() - now);
  if (t >= room) return Clock::time_point::max();
  return now + t;
}

/// Milliseconds left until `deadline`, rounded up (0 when passed), clamped for poll().
[[nodiscard]] inline int poll_timeout_ms(Clock::time_point deadline, Clock::time_point now = Clock::now()) noexcept {
  if (deadline == Clock::time_point::max()) return -1;
  if (deadline <= now) return 0;
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - now).count();
  return left > INT_MAX ? INT_MAX : static_cast<int>(left);
}

/// Whole milliseconds left until `deadline`, rounded up, 0 when passed.
[[nodiscard]] inline std::chrono::milliseconds remaining(Clock::time_point deadline,
                                                         Clock::time_point now = Clock::now()) noexcept {
  if (deadline <= now) return std::chrono::milliseconds(0);
  if (deadline == Clock::time_point::max()) return std::chrono::milliseconds::max();
  return std::chrono::ceil<std::chrono::milliseconds>(deadline - now);
}

/// The text of an errno value (thread-safe, unlike strerror).
[[nodiscard]] inline std::string errno_text(int e) { return std::system_category().message(e); }

/// An owning file descriptor: closed on destruction, move-only.
class Fd {
 public:
  Fd() noexcept = default;
  explicit Fd(int fd) noexcept : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) reset(std::exchange(o.fd_, -1));
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  [[nodiscard]] int get() const noexcept { return fd_; }
  [[nodiscard]] bool valid() const noexcept { return fd_ >= 0; }
  explicit operator bool() const noexcept { return valid(); }
  int release() noexcept { return std::exchange(fd_, -1); }
  void reset(int fd = -1) noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

/// A socket address of any family.
struct SockAddr {
  sockaddr_storage storage{};
  socklen_t len = 0;

  [[nodiscard]] int family() const noexcept { return storage.ss_family; }
  [[nodiscard]] const sockaddr* get() const noexcept { return reinterpret_cast<const sockaddr*>(&storage); }
  [[nodiscard]] sockaddr* get() noexcept { return reinterpret_cast<sockaddr*>(&storage); }
  [[nodiscard]] std::uint16_t port() const noexcept {
    if (family() == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&storage)->sin_port);
    if (family() == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_port);
    return 0;
  }
  void set_port(std::uint16_t p) noexcept {
    if (family() == AF_INET) reinterpret_cast<sockaddr_in*>(&storage)->sin_port = htons(p);
    if (family() == AF_INET6) reinterpret_cast<sockaddr_in6*>(&storage)->sin6_port = htons(p);
  }
  /// Same family, address and port.
  [[nodiscard]] bool same_endpoint(const SockAddr& o) const noexcept {
    if (family() != o.family()) return false;
    if (family() == AF_INET) {
      const auto* a = reinterpret_cast<const sockaddr_in*>(&storage);
      const auto* b = reinterpret_cast<const sockaddr_in*>(&o.storage);
      return a->sin_port == b->sin_port && a->sin_addr.s_addr == b->sin_addr.s_addr;
    }
    if (family() == AF_INET6) {
      const auto* a = reinterpret_cast<const sockaddr_in6*>(&storage);
      const auto* b = reinterpret_cast<const sockaddr_in6*>(&o.storage);
      return a->sin6_port == b->sin6_port && std::memcmp(&a->sin6_addr, &b->sin6_addr, sizeof(in6_addr)) == 0;
    }
    return false;
  }
};

/// "host:port", with brackets around an IPv6 literal: "[::1]:5000".
[[nodiscard]] inline std::string format_host_port(std::string_view host, std::uint16_t port) {
  std::string s;
  if (host.find(':') != std::string_view::npos) {
    s = "[" + std::string(host) + "]";
  } else {
    s = std::string(host);
  }
  return s + ":" + std::to_string(port);
}

/// `host` without the brackets of an "[::1]"-style IPv6 literal.
[[nodiscard]] inline std::string strip_brackets(std::string_view host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return std::string(host);
}

/// The numeric address of `a`, e.g. "127.0.0.1:5000" or "[::1]:5000".
[[nodiscard]] inline std::string to_string(const SockAddr& a) {
  char host[NI_MAXHOST] = {};
  if (::getnameinfo(a.get(), a.len, host, sizeof host, nullptr, 0, NI_NUMERICHOST) != 0) return "<unknown>";
  return format_host_port(host, a.port());
}

/// The local address a socket is bound to.
[[nodiscard]] inline SockAddr local_address(int fd) noexcept {
  SockAddr a;
  a.len = sizeof a.storage;
  if (::getsockname(fd, a.get(), &a.len) != 0) a = SockAddr{};
  return a;
}

/// The address of the socket's peer.
[[nodiscard]] inline SockAddr peer_address(int fd) noexcept {
  SockAddr a;
  a.len = sizeof a.storage;
  if (::getpeername(fd, a.get(), &a.len) != 0) a = SockAddr{};
  return a;
}

/// The addresses `host` resolves to for TCP, in resolver order, without duplicates.
/// `gai_error` is getaddrinfo's code when resolution failed (then the list is empty).
struct Resolved {
  std::vector<SockAddr> addrs;
  int gai_error = 0;
  [[nodiscard]] std::string error_text() const { return gai_error == 0 ? std::string() : ::gai_strerror(gai_error); }
};

[[nodiscard]] inline Resolved resolve(const std::string& host, std::uint16_t port) {
  Resolved r;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_protocol = IPPROTO_TCP;
  // No AI_ADDRCONFIG: it hides ::1 on machines whose only IPv6 address is the loopback.
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  r.gai_error = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  if (r.gai_error != 0) return r;
  for (addrinfo* p = res; p != nullptr; p = p->ai_next) {
    if (p->ai_family != AF_INET && p->ai_family != AF_INET6) continue;
    if (p->ai_addrlen > sizeof(sockaddr_storage)) continue;
    SockAddr a;
    std::memcpy(&a.storage, p->ai_addr, p->ai_addrlen);
    a.len = p->ai_addrlen;
    bool dup = false;
    for (const auto& b : r.addrs) dup = dup || b.same_endpoint(a);
    if (!dup) r.addrs.push_back(a);
  }
  ::freeaddrinfo(res);
  return r;
}

inline bool set_nonblocking(int fd) noexcept {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  return flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0;
}

inline void set_nodelay(int fd) noexcept {
  const int one = 1;
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/// A non-blocking, close-on-exec socket listening on `a`, or an invalid Fd with `err` set.
/// SO_REUSEADDR: a port left in TIME_WAIT by an earlier job can be bound again. IPV6_V6ONLY: an
/// IPv6 listener does not take the IPv4 port too, so both families can be bound on one port.
[[nodiscard]] inline Fd listen_on(const SockAddr& a, int& err) noexcept {
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

/// One connection attempt to `a`, bounded by `deadline`. Returns a connected, non-blocking,
/// close-on-exec socket with TCP_NODELAY, or an invalid Fd with `err` set (ETIMEDOUT when the
/// deadline passed). A connection to itself (TCP simultaneous open on a local port nobody listens
/// on) is refused as ECONNREFUSED.
[[nodiscard]] inline Fd connect_once(const SockAddr& a, Clock::time_point deadline, int& err) {
  Fd fd(::socket(a.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, IPPROTO_TCP));
  if (!fd) {
    err = errno;
    return {};
  }
  int rc = 0;
  do {
    rc = ::connect(fd.get(), a.get(), a.len);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    if (errno != EINPROGRESS) {
      err = errno;
      return {};
    }
    for (;;) {
      pollfd p{fd.get(), POLLOUT, 0};
      const int n = ::poll(&p, 1, poll_timeout_ms(deadline));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        err = errno;
        return {};
      }
      if (n == 0) {
        err = ETIMEDOUT;
        return {};
      }
      break;
    }
    int so_error = 0;
    socklen_t len = sizeof so_error;
    if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &so_error, &len) != 0) so_error = errno;
    if (so_error != 0) {
      err = so_error;
      return {};
    }
  }
  if (local_address(fd.get()).same_endpoint(peer_address(fd.get()))) {
    err = ECONNREFUSED;
    return {};
  }
  set_nodelay(fd.get());
  err = 0;
  return fd;
}

/// How a bounded send or receive ended.
enum class IoStatus : std::uint8_t { ok, timeout, closed, error };
struct IoResult {
  IoStatus status = IoStatus::ok;
  int err = 0;  // errno for IoStatus::error
  [[nodiscard]] bool ok() const noexcept { return status == IoStatus::ok; }
  [[nodiscard]] std::string text() const {
    switch (status) {
      case IoStatus::ok: return "ok";
      case IoStatus::timeout: return "timed out";
      case IoStatus::closed: return "connection closed by the peer";
      case IoStatus::error: return errno_text(err);
    }
    return "unknown";
  }
};

/// Waits until `fd` is ready for `events` or `deadline` passes.
[[nodiscard]] inline IoResult wait_ready(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, poll_timeout_ms(deadline));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return {IoStatus::error, errno};
    if (n == 0) return {IoStatus::timeout, 0};
    return {};  // readiness, hang-up or error: the next send/recv reports which
  }
}

/// Sends all of `data` on a non-blocking socket before `deadline`. Never raises SIGPIPE.
[[nodiscard]] inline IoResult send_all(int fd, std::span<const std::uint8_t> data, Clock::time_point deadline) {
  std::size_t off = 0;
  while (off < data.size()) {
    const ssize_t n = ::send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n > 0) {
      off += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (auto r = wait_ready(fd, POLLOUT, deadline); !r.ok()) return r;
      continue;
    }
    if (n < 0 && (errno == EPIPE || errno == ECONNRESET)) return {IoStatus::closed, errno};
    return {IoStatus::error, n < 0 ? errno : EIO};
  }
  return {};
}

/// Receives exactly `data.size()` bytes from a non-blocking socket before `deadline`.
[[nodiscard]] inline IoResult recv_all(int fd, std::span<std::uint8_t> data, Clock::time_point deadline) {
  std::size_t off = 0;
  while (off < data.size()) {
    const ssize_t n = ::recv(fd, data.data() + off, data.size() - off, 0);
    if (n > 0) {
      off += static_cast<std::size_t>(n);
      continue;
    }
    if (n == 0) return {IoStatus::closed, 0};
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (auto r = wait_ready(fd, POLLIN, deadline); !r.ok()) return r;
      continue;
    }
    if (errno == ECONNRESET) return {IoStatus::closed, errno};
    return {IoStatus::error, errno};
  }
  return {};
}

/// A TCP port on `host` (loopback by default) that was free when this returned: the kernel
/// picks it by binding port 0. Another process may take it before the caller binds it; use it
/// for tests and single-machine jobs, where a collision fails loudly at bind.
[[nodiscard]] inline std::uint16_t free_port(const std::string& host = "127.0.0.1") {
  const Resolved r = resolve(strip_brackets(host), 0);
  if (r.addrs.empty())
    throw InvalidArgument("free_port", -1, "cannot resolve '" + host + "': " + r.error_text());
  int last_err = 0;
  for (auto a : r.addrs) {
    a.set_port(0);
    Fd fd(::socket(a.family(), SOCK_STREAM | SOCK_CLOEXEC, IPPROTO_TCP));
    if (!fd) {
      last_err = errno;
      continue;
    }
    if (::bind(fd.get(), a.get(), a.len) != 0) {
      last_err = errno;
      continue;
    }
    const std::uint16_t port = local_address(fd.get()).port();
    if (port != 0) return port;
    last_err = EADDRNOTAVAIL;
  }
  throw BackendError("free_port", -1, "cannot bind a free port on '" + host + "': " + errno_text(last_err));
}

}  // namespace comm::detail
