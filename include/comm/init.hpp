#pragma once
/// \file
/// Init methods: `env://`, `tcp://host:port` and `file:///path`. Each yields this process's rank,
/// the world size and a Store shared by all ranks, from which backends build their communicators.
///
/// Variables read by env:// (as set by comm-run, torchrun and most launchers):
///   RANK, WORLD_SIZE            required; 0 <= RANK < WORLD_SIZE
///   MASTER_ADDR, MASTER_PORT    required; rank 0 hosts the TcpStore there, unless
///   COMM_AGENT_STORE=1          (set by comm-run) the launcher hosts it: every rank, rank 0 too,
///                               connects as a client, so the store outlives any rank
///   LOCAL_RANK, LOCAL_WORLD_SIZE optional; -1 in the result when not set
///   COMM_TIMEOUT                seconds, or a number with ms/s/m suffix (default 30 min)
/// Every value is checked: a bad one throws comm::InvalidArgument quoting the variable and value.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include <comm/detail/base/env.hpp>
#include <comm/error.hpp>
#include <comm/store.hpp>

namespace comm {

/// What an init method produced.
struct InitResult {
  /// This process's rank.
  int rank = 0;
  /// The number of ranks.
  int size = 1;
  int local_rank = -1;  ///< -1: not known (LOCAL_RANK not set)
  int local_size = -1;  ///< -1: not known (LOCAL_WORLD_SIZE not set)
  std::string master_addr;  ///< empty for file://
  /// The store's port (0 for file://).
  std::uint16_t master_port = 0;
  /// The rendezvous store (a TcpStore, or a FileStore for file://), connected.
  std::shared_ptr<Store> store;
};

/// The communicator timeout from COMM_TIMEOUT, else 30 minutes.
[[nodiscard]] inline std::chrono::milliseconds timeout_from_env() { return detail::default_timeout(); }

namespace detail {

/// rank/size checks shared by every init method; `origin` says where the values came from.
inline void check_rank_size(int rank, int size, std::string_view rank_name = "RANK",
                            std::string_view size_name = "WORLD_SIZE") {
  if (size < 1)
    throw InvalidArgument("init", -1, std::string(size_name) + "=" + std::to_string(size) + " must be at least 1");
  if (rank < 0 || rank >= size)
    throw InvalidArgument("init", -1,
                          std::string(rank_name) + "=" + std::to_string(rank) + " is not below " +
                              std::string(size_name) + "=" + std::to_string(size));
}

[[nodiscard]] inline int required_env_int(const char* name, std::string_view method) {
  auto v = env_nonneg_int(name);
  if (!v) throw InvalidArgument("init", -1, std::string(name) + " is not set (required by " + std::string(method) + ")");
  return *v;
}

/// COMM_AGENT_STORE: 1 when the launcher hosts the store (comm-run does), 0 or unset when rank 0
/// does; anything else is comm::InvalidArgument naming the variable.
[[nodiscard]] inline bool agent_hosts_store(int rank) {
  auto v = getenv_str("COMM_AGENT_STORE");
  if (!v) return false;
  const auto t = trim(*v);
  if (t.empty() || t == "0") return false;
  if (t == "1") return true;
  bad_env("init", rank, "COMM_AGENT_STORE", *v, "not 0 or 1 (1: the launcher hosts the store)");
}

/// The rendezvous store at host:port: rank 0 hosts it, unless the launcher does
/// (COMM_AGENT_STORE=1); the clients retry connecting until `timeout`.
[[nodiscard]] inline std::shared_ptr<Store> connect_tcp_store(const std::string& host, std::uint16_t port, int rank,
                                                              std::chrono::milliseconds timeout) {
  TcpStoreOptions o;
  o.is_server = rank == 0 && !agent_hosts_store(rank);
  o.rank = rank;
  o.timeout = timeout;
  auto store = std::make_shared<TcpStore>(host, port, o);
  store->set_rank(rank);
  return store;
}

/// Splits "host:port", "[v6]:port"; the port must be present and valid.
inline std::pair<std::string, std::uint16_t> split_host_port(std::string_view hp, std::string_view what) {
  std::string_view host, port;
  if (hp.starts_with('[')) {
    auto close = hp.find(']');
    if (close == std::string_view::npos || close + 1 >= hp.size() || hp[close + 1] != ':')
      throw InvalidArgument("init", -1, std::string(what) + " '" + std::string(hp) + "' is not [ipv6]:port");
    host = hp.substr(1, close - 1);
    port = hp.substr(close + 2);
  } else {
    auto colon = hp.rfind(':');
    if (colon == std::string_view::npos)
      throw InvalidArgument("init", -1, std::string(what) + " '" + std::string(hp) + "' has no port (host:port)");
    host = hp.substr(0, colon);
    port = hp.substr(colon + 1);
  }
  if (host.empty()) throw InvalidArgument("init", -1, std::string(what) + " '" + std::string(hp) + "' has no host");
  return {std::string(host), parse_port(std::string(what) + " port", port)};
}

}  // namespace detail

/// env://: reads the variables above; rank 0 hosts the TcpStore on MASTER_ADDR:MASTER_PORT
/// (bound to that address only: loopback for 127.0.0.1/localhost), or with COMM_AGENT_STORE=1 the
/// launcher does; the others (all ranks, then) connect to it, retrying until `timeout`.
[[nodiscard]] inline InitResult init_env(std::chrono::milliseconds timeout = timeout_from_env()) {
  InitResult r;
  r.rank = detail::required_env_int("RANK", "env://");
  r.size = detail::required_env_int("WORLD_SIZE", "env://");
  detail::check_rank_size(r.rank, r.size);
  r.local_rank = detail::env_nonneg_int("LOCAL_RANK").value_or(-1);
  r.local_size = detail::env_nonneg_int("LOCAL_WORLD_SIZE").value_or(-1);
  if (r.local_size == 0) throw InvalidArgument("init", r.rank, "LOCAL_WORLD_SIZE=0 must be at least 1");
  if (r.local_size > r.size)
    throw InvalidArgument("init", r.rank,
                          "LOCAL_WORLD_SIZE=" + std::to_string(r.local_size) + " exceeds WORLD_SIZE=" +
                              std::to_string(r.size));
  if (r.local_rank >= 0 && r.local_size > 0 && r.local_rank >= r.local_size)
    detail::check_rank_size(r.local_rank, r.local_size, "LOCAL_RANK", "LOCAL_WORLD_SIZE");
  auto addr = detail::getenv_str("MASTER_ADDR");
  if (!addr || detail::trim(*addr).empty())
    throw InvalidArgument("init", r.rank, "MASTER_ADDR is not set (required by env://)");
  auto port = detail::getenv_str("MASTER_PORT");
  if (!port || detail::trim(*port).empty())
    throw InvalidArgument("init", r.rank, "MASTER_PORT is not set (required by env://)");
  r.master_addr = std::string(detail::trim(*addr));
  r.master_port = detail::parse_port("MASTER_PORT", *port);
  r.store = detail::connect_tcp_store(r.master_addr, r.master_port, r.rank, timeout);
  return r;
}

/// Any init method: "env://" (rank and size from the environment when given as -1),
/// "tcp://host:port" (rank 0 hosts the store there, unless COMM_AGENT_STORE=1) or "file:///path" (a FileStore on a shared
/// file system). `rank` and `size` are required for tcp:// and file://.
[[nodiscard]] inline InitResult init_method(std::string_view url, int rank = -1, int size = -1,
                                            std::chrono::milliseconds timeout = timeout_from_env()) {
  if (url.empty() || url == "env://") {
    InitResult r = init_env(timeout);
    if (rank >= 0 && rank != r.rank)
      throw InvalidArgument("init", r.rank, "rank " + std::to_string(rank) + " conflicts with RANK=" + std::to_string(r.rank));
    if (size >= 0 && size != r.size)
      throw InvalidArgument("init", r.rank,
                            "world_size " + std::to_string(size) + " conflicts with WORLD_SIZE=" + std::to_string(r.size));
    return r;
  }
  const bool tcp = url.starts_with("tcp://");
  const bool file = url.starts_with("file://");
  if (!tcp && !file)
    throw InvalidArgument("init", rank,
                          "init_method '" + std::string(url) + "' is not env://, tcp://host:port or file:///path");
  if (rank < 0 || size < 0)
    throw InvalidArgument("init", rank, std::string(url.substr(0, url.find(':'))) + ":// needs rank and world_size");
  detail::check_rank_size(rank, size, "rank", "world_size");
  InitResult r;
  r.rank = rank;
  r.size = size;
  if (tcp) {
    auto [host, port] = detail::split_host_port(url.substr(6), "init_method");
    r.master_addr = host;
    r.master_port = port;
    r.store = detail::connect_tcp_store(host, port, rank, timeout);
  } else {
    auto path = url.substr(7);
    if (path.empty() || path.front() != '/')
      throw InvalidArgument("init", rank, "init_method '" + std::string(url) + "' needs an absolute path: file:///path");
    r.store = std::make_shared<FileStore>(std::string(path), timeout);
    r.store->set_rank(rank);
  }
  return r;
}

}  // namespace comm
