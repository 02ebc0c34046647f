#pragma once
// Pieces shared by the stores: key quoting for messages, the integer encoding of add(),
// compare_set's rule, and durations in messages.

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdlib>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace comm::detail {

/// `key` quoted for an error message: non-printable bytes escaped as \xNN, long keys shortened.
[[nodiscard]] inline std::string quote_key(std::string_view key, std::size_t max_chars = 160) {
  static constexpr char hex[] = "0123456789abcdef";
  std::string s = "'";
  for (std::size_t i = 0; i < key.size(); ++i) {
    if (s.size() > max_chars) {
      s += "...(" + std::to_string(key.size()) + " bytes)";
      break;
    }
    const auto c = static_cast<unsigned char>(key[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '\'') {
      s += static_cast<char>(c);
    } else {
      s += "\\x";
      s += hex[c >> 4];
      s += hex[c & 15];
    }
  }
  return s + "'";
}

/// "key 'a'" or "keys 'a', 'b'" (at most `max_keys` listed, then "and N more").
[[nodiscard]] inline std::string describe_keys(std::span<const std::string> keys, std::size_t max_keys = 8) {
  std::string s = keys.size() == 1 ? "key " : "keys ";
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (i == max_keys) {
      s += " and " + std::to_string(keys.size() - i) + " more";
      break;
    }
    if (i > 0) s += ", ";
    s += quote_key(keys[i]);
  }
  return s;
}

[[nodiscard]] inline std::string format_ms(std::chrono::milliseconds t) {
  return std::to_string(t.count()) + " ms";
}

/// The value add() stores: a decimal integer, optional leading '-', nothing else.
[[nodiscard]] inline std::optional<std::int64_t> parse_counter(std::span<const std::uint8_t> v) {
  const auto* b = reinterpret_cast<const char*>(v.data());
  const auto* e = b + v.size();
  if (b == e) return std::nullopt;
  std::int64_t x = 0;
  auto [p, ec] = std::from_chars(b, e, x);
  if (ec != std::errc() || p != e) return std::nullopt;
  return x;
}

[[nodiscard]] inline std::vector<std::uint8_t> format_counter(std::int64_t x) {
  const std::string s = std::to_string(x);
  return {s.begin(), s.end()};
}

/// The outcome of add() on a current value (nullptr: key missing, counts as 0): the new value,
/// or an error text.
struct AddResult {
  std::int64_t value = 0;
  std::string error;
};
[[nodiscard]] inline AddResult apply_add(std::string_view key, const std::vector<std::uint8_t>* current,
                                         std::int64_t delta) {
  std::int64_t base = 0;
  if (current != nullptr) {
    auto v = parse_counter(*current);
    if (!v) return {0, "value of " + quote_key(key) + " is not an integer (" + std::to_string(current->size()) + " bytes)"};
    base = *v;
  }
  std::int64_t out = 0;
  if (__builtin_add_overflow(base, delta, &out))
    return {0, "adding " + std::to_string(delta) + " to " + quote_key(key) + " (" + std::to_string(base) +
                   ") overflows int64"};
  return {out, {}};
}

/// compare_set's rule: `expected` matches the current value, or is empty and the key is missing.
[[nodiscard]] inline bool cas_matches(const std::vector<std::uint8_t>* current,
                                      std::span<const std::uint8_t> expected) {
  if (current == nullptr) return expected.empty();
  return current->size() == expected.size() && std::equal(current->begin(), current->end(), expected.begin());
}

/// The job this process belongs to, for the store handshake: COMM_JOB_ID (comm-run sets a fresh
/// one per job), else TORCHELASTIC_RUN_ID, else SLURM_JOB_ID[.SLURM_STEP_ID], else "" (none:
/// processes started by hand). Stores of different jobs refuse each other's clients.
[[nodiscard]] inline std::string job_id_from_env() {
  auto get = [](const char* n) -> std::string {
    const char* v = std::getenv(n);
    return v != nullptr ? std::string(v) : std::string();
  };
  if (auto v = get("COMM_JOB_ID"); !v.empty()) return v;
  if (auto v = get("TORCHELASTIC_RUN_ID"); !v.empty()) return "torchelastic:" + v;
  if (auto v = get("SLURM_JOB_ID"); !v.empty()) {
    const auto step = get("SLURM_STEP_ID");
    return "slurm:" + v + (step.empty() ? "" : "." + step);
  }
  return {};
}

/// `job` quoted for messages ("no job id" when empty).
[[nodiscard]] inline std::string describe_job(std::string_view job) {
  return job.empty() ? std::string("no job id") : "job " + quote_key(job, 80);
}

[[nodiscard]] inline std::span<const std::uint8_t> as_bytes(std::string_view s) noexcept {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}

}  // namespace comm::detail
