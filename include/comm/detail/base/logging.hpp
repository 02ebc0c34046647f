#pragma once
// COMM_DEBUG logging: OFF (default) | WARN | INFO | DETAIL. Lines go to stderr, one write each, so
// lines of several threads do not interleave.

#include <cstdio>
#include <string>
#include <string_view>

#include <comm/detail/base/env.hpp>

namespace comm::detail {

enum class LogLevel { off = 0, warn = 1, info = 2, detail = 3 };

[[nodiscard]] inline LogLevel parse_log_level(std::string_view v) {
  v = trim(v);
  auto eq = [&](std::string_view a) {
    if (a.size() != v.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i)
      if ((v[i] | 0x20) != a[i]) return false;  // ASCII case-insensitive
    return true;
  };
  if (v.empty() || eq("off") || eq("0")) return LogLevel::off;
  if (eq("warn")) return LogLevel::warn;
  if (eq("info")) return LogLevel::info;
  if (eq("detail")) return LogLevel::detail;
  throw InvalidArgument("init", -1, "COMM_DEBUG='" + std::string(v) + "' is not OFF, WARN, INFO or DETAIL");
}

/// The level from COMM_DEBUG, read on every call so tests and programs can change it at run time.
[[nodiscard]] inline LogLevel log_level() {
  auto v = getenv_str("COMM_DEBUG");
  return v ? parse_log_level(*v) : LogLevel::off;
}

inline void log(LogLevel level, std::string_view msg) {
  if (log_level() < level) return;
  static constexpr const char* names[] = {"", "WARN", "INFO", "DETAIL"};
  std::string line = "comm ";
  line += names[static_cast<int>(level)];
  line += ": ";
  line += msg;
  line += '\n';
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace comm::detail
