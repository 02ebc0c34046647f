#pragma once
// Which network devices a Gloo communicator uses, and a process-wide cache of them.
//
// Choice, first match wins:
//   1. Options::interfaces (one device per interface name),
//   2. Options::hostname (one device bound to that host name or address),
//   3. COMM_SOCKET_IFNAME, a comma-separated list of interface names (one device each); comm's
//      name for the choice, shared by every TCP engine, so it wins over the engine's own variable,
//   4. GLOO_SOCKET_IFNAME, the same list, read for users who set it for torch.distributed,
//   5. the local address whose route reaches MASTER_ADDR (127.0.0.1 for a loopback master),
//   6. 127.0.0.1 (single-host default when MASTER_ADDR is not set).
// Devices are shared by every communicator of the process that asks for the same interface or
// address: each gloo TCP device runs one event-loop thread, so sharing keeps comm's thread count
// independent of the number of communicators.

#include <netdb.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <gloo/common/logging.h>
#include <gloo/transport/tcp/device.h>

#include <comm/detail/base/env.hpp>
#include <comm/error.hpp>

namespace comm::detail::gloo {

struct DeviceSpec {
  std::string iface;     // bind to this interface's address, or
  std::string hostname;  // bind to this host name / address
  std::string origin;    // where the choice came from, for messages
};

/// The local address (numeric) that the kernel would use to reach `host`, or "" when unknown.
/// Uses a connected UDP socket: no packet is sent.
[[nodiscard]] inline std::string source_address_for(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || res == nullptr) return {};
  std::string out;
  for (addrinfo* ai = res; ai != nullptr && out.empty(); ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      std::array<char, NI_MAXHOST> buf{};
      if (::getnameinfo(reinterpret_cast<sockaddr*>(&local), len, buf.data(), buf.size(), nullptr, 0,
                        NI_NUMERICHOST) == 0)
        out = buf.data();
    }
    ::close(fd);
  }
  ::freeaddrinfo(res);
  return out;
}

[[nodiscard]] inline std::vector<std::string> split_list(std::string_view s) {
  std::vector<std::string> out;
  while (!s.empty()) {
    const auto comma = s.find(',');
    const auto item = trim(s.substr(0, comma));
    if (!item.empty()) out.emplace_back(item);
    if (comma == std::string_view::npos) break;
    s.remove_prefix(comma + 1);
  }
  return out;
}

[[nodiscard]] inline std::vector<DeviceSpec> device_specs(const std::vector<std::string>& interfaces,
                                                          const std::string& hostname) {
  std::vector<DeviceSpec> specs;
  for (const auto& i : interfaces)
    if (!trim(i).empty()) specs.push_back({std::string(trim(i)), {}, "Options::interfaces"});
  if (!specs.empty()) return specs;
  if (!hostname.empty()) return {{{}, hostname, "Options::hostname"}};
  for (const char* var : {"COMM_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}) {
    if (auto env = getenv_str(var)) {
      for (auto& i : split_list(*env)) specs.push_back({std::move(i), {}, var});
      if (!specs.empty()) return specs;
    }
  }
  if (auto master = getenv_str("MASTER_ADDR"); master && !trim(*master).empty()) {
    auto local = source_address_for(std::string(trim(*master)));
    if (!local.empty()) return {{{}, std::move(local), "the route to MASTER_ADDR"}};
  }
  return {{{}, "127.0.0.1", "the loopback default"}};
}

/// COMM_GLOO_LOOP_NICE (the nice value added to gloo's event-loop threads), else 19.
[[nodiscard]] inline int loop_nice_default() {
  if (auto v = getenv_str("COMM_GLOO_LOOP_NICE"); v && !trim(*v).empty()) {
    try {
      return std::clamp(std::stoi(std::string(trim(*v))), 0, 19);
    } catch (...) {
      throw InvalidArgument("gloo.init", -1, "COMM_GLOO_LOOP_NICE='" + std::string(*v) + "' is not a number 0..19");
    }
  }
  return 19;
}

/// Runs `make` on a short-lived thread whose nice value is raised by `nice`, so that the threads
/// it starts (gloo's event loop) inherit it. Why: the loop thread spins on a level-triggered
/// epoll while the caller holds the pair mutex; at equal priority it keeps the caller off the CPU
/// until the next scheduler tick (4 ms stalls, benchmarks/analysis.md section 2), at a lower one
/// the caller preempts it at once.
template <class Make>
auto on_niced_thread(int nice, Make&& make) {
  using R = decltype(make());
  if (nice <= 0) return make();
  R result{};
  std::exception_ptr error;
  std::thread t([&] {
    errno = 0;
    const int now = ::getpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()));
    if (errno == 0) (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), std::min(19, now + nice));
    try {
      result = make();
    } catch (...) {
      error = std::current_exception();
    }
  });
  t.join();
  if (error) std::rethrow_exception(error);
  return result;
}

/// libgloo sends with writev(), which raises SIGPIPE when the peer's socket is gone; at the default
/// disposition that kills the process before gloo can turn the closed connection into an error, so
/// a peer's death would take its survivors down instead of giving them comm::RemoteError (seen
/// across network namespaces: tests/multinode). A program that chose a disposition keeps it.
inline void ignore_default_sigpipe() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction now {};
    if (::sigaction(SIGPIPE, nullptr, &now) != 0 || (now.sa_flags & SA_SIGINFO) != 0 || now.sa_handler != SIG_DFL)
      return;
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    ::sigaction(SIGPIPE, &ignore, nullptr);
  });
}

/// A TCP device for `spec`, shared with other communicators of this process (the first one to
/// ask sets its loop thread's nice value).
[[nodiscard]] inline std::shared_ptr<::gloo::transport::Device> shared_device(const DeviceSpec& spec, int rank,
                                                                             int loop_nice = 0) {
  static std::mutex mu;
  static std::map<std::string, std::weak_ptr<::gloo::transport::Device>> cache;
  const std::string key = spec.iface.empty() ? "host:" + spec.hostname : "iface:" + spec.iface;
  ignore_default_sigpipe();
  std::lock_guard lock(mu);
  if (auto it = cache.find(key); it != cache.end())
    if (auto dev = it->second.lock()) return dev;
  ::gloo::transport::tcp::attr attr;
  attr.iface = spec.iface;
  attr.hostname = spec.hostname;
  std::string why;
  try {
    auto dev = on_niced_thread(loop_nice, [&] { return ::gloo::transport::tcp::CreateDevice(attr); });
    cache[key] = dev;
    return dev;
  } catch (const ::gloo::EnforceNotMet& e) {
    why = e.what();
  } catch (const std::exception& e) {
    why = e.what();
  }
  const std::string what = spec.iface.empty() ? "host '" + spec.hostname + "'" : "interface '" + spec.iface + "'";
  throw InvalidArgument("gloo.init", rank, "cannot use " + what + " (from " + spec.origin + "): " + why);
}

}  // namespace comm::detail::gloo
