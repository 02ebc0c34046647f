#pragma once
// A process started to replace a dead rank (comm-run --max-restarts sets COMM_RESTART_COUNT > 0,
// as torchrun sets TORCHELASTIC_RESTART_COUNT): from_env() joins the running job through its store
// instead of rendezvousing as RANK (detail/engine/elastic.hpp, Elastic::join).

#include <chrono>
#include <memory>
#include <string>

#include <comm/detail/base/env.hpp>
#include <comm/error.hpp>
#include <comm/store.hpp>

namespace comm::detail {

/// COMM_RESTART_COUNT (0 when unset; a value that is not a non-negative integer is
/// comm::InvalidArgument naming it).
[[nodiscard]] inline int elastic_restart_count() {
  return static_cast<int>(env_nonneg_int("COMM_RESTART_COUNT", "init").value_or(0));
}

/// The job's store as a client, whatever RANK says: the rank this process replaces may have
/// hosted it, and its replacement must not try to host it again.
[[nodiscard]] inline std::shared_ptr<Store> join_store_from_env(std::chrono::milliseconds timeout) {
  auto addr = getenv_str("MASTER_ADDR");
  if (!addr || trim(*addr).empty()) throw InvalidArgument("init", -1, "MASTER_ADDR is not set (required to rejoin a job)");
  auto port = getenv_str("MASTER_PORT");
  if (!port || trim(*port).empty()) throw InvalidArgument("init", -1, "MASTER_PORT is not set (required to rejoin a job)");
  TcpStoreOptions o;
  o.is_server = false;
  o.timeout = timeout;
  return std::make_shared<TcpStore>(std::string(trim(*addr)), parse_port("MASTER_PORT", *port), o);
}

}  // namespace comm::detail
