#pragma once
// Parsing of environment values with errors that quote the variable and the bad value.

#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <string_view>

#include <comm/detail/base/duration.hpp>
#include <comm/error.hpp>

namespace comm::detail {

[[nodiscard]] inline std::optional<std::string> getenv_str(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

[[nodiscard]] inline std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n' || s.back() == '\r'))
    s.remove_suffix(1);
  return s;
}

/// Parses a whole decimal integer; nullopt on junk, trailing characters or overflow.
template <class Int>
[[nodiscard]] std::optional<Int> parse_int(std::string_view s) {
  s = trim(s);
  if (!s.empty() && s.front() == '+') s.remove_prefix(1);
  Int v{};
  const auto* end = s.data() + s.size();
  auto [p, ec] = std::from_chars(s.data(), end, v);
  if (ec != std::errc() || p != end || s.empty()) return std::nullopt;
  return v;
}

/// `NAME='value' is not <what>` as an InvalidArgument for `op`.
[[noreturn]] inline void bad_env(std::string_view op, int rank, std::string_view name, std::string_view value,
                                 std::string_view what) {
  throw InvalidArgument(std::string(op), rank,
                        std::string(name) + "='" + std::string(value) + "' is " + std::string(what));
}

/// A non-negative int from variable `name`; nullopt when unset or empty.
[[nodiscard]] inline std::optional<int> env_nonneg_int(const char* name, std::string_view op = "init") {
  auto v = getenv_str(name);
  if (!v || trim(*v).empty()) return std::nullopt;
  auto n = parse_int<int>(*v);
  if (!n || *n < 0) bad_env(op, -1, name, *v, "not a non-negative integer");
  return n;
}

/// A TCP port (1..65535) parsed from `value`; errors name `name`.
[[nodiscard]] inline std::uint16_t parse_port(std::string_view name, std::string_view value,
                                              std::string_view op = "init", bool allow_zero = false) {
  auto n = parse_int<long>(value);
  if (!n || *n < (allow_zero ? 0 : 1) || *n > 65535) bad_env(op, -1, name, value, "not a port number");
  return static_cast<std::uint16_t>(*n);
}

/// The default timeout: COMM_TIMEOUT if set (errors name it), else 30 minutes.
[[nodiscard]] inline std::chrono::milliseconds default_timeout() {
  auto v = getenv_str("COMM_TIMEOUT");
  if (!v || trim(*v).empty()) return std::chrono::minutes(30);
  auto d = parse_duration(*v);
  if (!d || d->count() == 0)
    bad_env("init", -1, "COMM_TIMEOUT", *v, "not a duration (seconds, or a number with ms, s or m)");
  return *d;
}

}  // namespace comm::detail
