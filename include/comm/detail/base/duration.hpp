#pragma once
// The one duration syntax of comm: COMM_TIMEOUT and the other duration variables of the library,
// and comm-run's --timeout and --grace-period (tools/comm_run.cpp includes this header alone: it
// needs nothing else of comm).
//
// Syntax: a decimal number (digits, optionally a '.' and more digits) of seconds, or followed by
// `ms`, `s` or `m`; blanks around the number and before the suffix are allowed. The value is
// exact (no binary floating point) and rounds UP to a whole millisecond, so a deadline is never
// shorter than written and a positive value never becomes 0 ("1.0004s" is 1001 ms, "0.1ms" 1 ms).
// Rejected: no digits, signs, exponents, inf/nan, other suffixes, more than a year (a typo).

#include <chrono>
#include <cstdint>
#include <optional>
#include <string_view>

namespace comm::detail {

[[nodiscard]] constexpr std::optional<std::chrono::milliseconds> parse_duration(std::string_view s) noexcept {
  constexpr auto blank = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  auto trim = [&](std::string_view v) {
    while (!v.empty() && blank(v.front())) v.remove_prefix(1);
    while (!v.empty() && blank(v.back())) v.remove_suffix(1);
    return v;
  };
  s = trim(s);
  std::uint64_t scale = 1000;  // milliseconds per unit
  if (s.ends_with("ms")) {
    scale = 1;
    s.remove_suffix(2);
  } else if (s.ends_with('s')) {
    s.remove_suffix(1);
  } else if (s.ends_with('m')) {
    scale = 60'000;
    s.remove_suffix(1);
  }
  s = trim(s);
  constexpr std::uint64_t year_ms = 365ull * 24 * 3600 * 1000;
  std::uint64_t whole = 0;
  std::size_t i = 0;
  for (; i < s.size() && s[i] >= '0' && s[i] <= '9'; ++i) {
    whole = whole * 10 + static_cast<std::uint64_t>(s[i] - '0');
    if (whole > year_ms) return std::nullopt;
  }
  const std::size_t int_digits = i;
  // The fraction, to 9 digits (exact for every scale: 10^9 * 60000 fits in 64 bits); any further
  // non-zero digit only makes the value larger than that, which the rounding up below accounts for.
  std::uint64_t frac = 0, denom = 1;
  bool beyond = false;
  std::size_t frac_digits = 0;
  if (i < s.size() && s[i] == '.') {
    for (++i; i < s.size() && s[i] >= '0' && s[i] <= '9'; ++i, ++frac_digits) {
      if (denom < 1'000'000'000ull) {
        frac = frac * 10 + static_cast<std::uint64_t>(s[i] - '0');
        denom *= 10;
      } else if (s[i] != '0') {
        beyond = true;
      }
    }
  }
  if (i != s.size() || int_digits + frac_digits == 0) return std::nullopt;
  const std::uint64_t f = frac * scale;
  std::uint64_t ms = whole * scale + f / denom;
  if (f % denom != 0 || beyond) ++ms;
  if (ms > year_ms) return std::nullopt;
  return std::chrono::milliseconds(static_cast<std::int64_t>(ms));
}

}  // namespace comm::detail
