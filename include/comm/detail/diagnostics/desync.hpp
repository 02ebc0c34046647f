#pragma once
// The desync check's fingerprint and its comparison (backend-neutral).
//
// Before each operation, with the check on, every rank contributes a 32-byte fingerprint of
// (sequence number, operation, element type, per-rank-invariant count, root, reduction) to one
// all-gather (Gloo: a gloo allgather on a tag of its own). Every rank then holds the same table and
// runs the same comparison, so either every rank throws the same DesyncError or none does, and
// nothing of the operation itself has been sent yet: the communicator stays usable.

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <comm/detail/diagnostics/flight_recorder.hpp>
#include <comm/detail/base/logging.hpp>
#include <comm/error.hpp>

namespace comm::detail {

struct Fingerprint {
  static constexpr std::uint32_t kMagic = 0x636d6664;  // "cmfd"
  static constexpr std::uint8_t kVersion = 1;

  std::uint32_t magic = kMagic;
  std::uint8_t version = kVersion;
  std::uint8_t kind = 0;
  std::uint8_t dtype = OpDesc::none;
  std::uint8_t reduce = OpDesc::none;
  std::int32_t root = -1;
  std::uint32_t reserved = 0;
  std::uint64_t seq = 0;
  std::uint64_t count = 0;
};
static_assert(sizeof(Fingerprint) == 32 && std::is_trivially_copyable_v<Fingerprint>);  // no padding: same() reads words

[[nodiscard]] inline Fingerprint fingerprint(std::uint64_t seq, const OpDesc& d) noexcept {
  Fingerprint f;
  f.kind = static_cast<std::uint8_t>(d.kind);
  f.dtype = d.dtype;
  f.reduce = d.reduce;
  f.root = d.root;
  f.seq = seq;
  f.count = d.count;
  return f;
}

[[nodiscard]] inline bool valid(const Fingerprint& f) noexcept {
  return f.magic == Fingerprint::kMagic && f.version == Fingerprint::kVersion;
}

/// Four words compared inline: a Shm reader compares the root's fingerprint on every step, where
/// a call to memcmp through the PLT was ~3 % of a 2-rank 8-byte gather's time.
[[nodiscard]] inline bool same(const Fingerprint& a, const Fingerprint& b) noexcept {
  std::uint64_t x[4], y[4];
  std::memcpy(x, &a, sizeof x);
  std::memcpy(y, &b, sizeof y);
  return ((x[0] ^ y[0]) | (x[1] ^ y[1]) | (x[2] ^ y[2]) | (x[3] ^ y[3])) == 0;
}

/// COMM_DEBUG=DETAIL turns the desync check on by default.
[[nodiscard]] inline bool desync_check_default() { return log_level() >= LogLevel::detail; }

/// The call a fingerprint stands for: "all_reduce(float x4, sum)".
[[nodiscard]] inline std::string describe_call(const Fingerprint& f) {
  OpDesc d;
  d.kind = static_cast<OpKind>(f.kind);
  d.dtype = f.dtype;
  d.reduce = f.reduce;
  d.root = f.root;
  d.count = f.count;
  return describe_call(d);
}

/// "rank 1", "ranks 0, 2, 3", "ranks 0, 1, 2, 3, 4, 5, 6, 7 and 24 more".
[[nodiscard]] inline std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  constexpr std::size_t kShown = 8;
  for (std::size_t i = 0; i < ranks.size() && i < kShown; ++i) {
    if (i) s += ", ";
    s += std::to_string(ranks[i]);
  }
  if (ranks.size() > kShown) s += " and " + std::to_string(ranks.size() - kShown) + " more";
  return s;
}

/// The message naming every distinct call, or "" when all fingerprints agree. Groups are listed
/// by their lowest rank, rank 0's last: "rank 1 called broadcast(float x4, root 0) while rank 0
/// called all_reduce(float x4, sum) at op #17".
[[nodiscard]] inline std::string desync_message(std::span<const Fingerprint> all) {
  bool agree = true;
  for (const auto& f : all) agree = agree && valid(f) && same(f, all[0]);
  if (agree) return {};
  struct Group {
    Fingerprint fp;
    std::vector<int> ranks;
  };
  std::vector<Group> groups;
  std::vector<int> invalid;
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (!valid(all[r])) {
      invalid.push_back(static_cast<int>(r));
      continue;
    }
    bool placed = false;
    for (auto& g : groups)
      if (same(g.fp, all[r])) {
        g.ranks.push_back(static_cast<int>(r));
        placed = true;
        break;
      }
    if (!placed) groups.push_back({all[r], {static_cast<int>(r)}});
  }
  bool same_seq = true;
  for (const auto& g : groups) same_seq = same_seq && g.fp.seq == groups.front().fp.seq;
  auto call = [&](const Group& g) {
    std::string s = rank_list(g.ranks) + " called " + describe_call(g.fp);
    if (!same_seq) s += " at op #" + std::to_string(g.fp.seq);
    return s;
  };
  std::string msg;
  if (!invalid.empty())
    msg = rank_list(invalid) +
          " sent no valid desync fingerprint (the desync check must be on for every rank or none: "
          "COMM_DEBUG=DETAIL or the desync_check option)";
  if (groups.size() > 1) {
    if (!msg.empty()) msg += "; ";
    // The groups without rank 0 first, then rank 0's ("... while rank 0 called ...").
    const bool first_has_zero = groups.front().ranks.front() == 0;
    for (std::size_t i = first_has_zero ? 1 : 0; i < groups.size(); ++i) {
      if (i > (first_has_zero ? 1u : 0u)) msg += ", ";
      msg += call(groups[i]);
    }
    if (first_has_zero) msg += " while " + call(groups.front());
    if (same_seq) msg += " at op #" + std::to_string(groups.front().fp.seq);
  }
  return msg;
}

/// Throws DesyncError for `op` on `rank` when the fingerprints of the ranks differ.
inline void check_fingerprints(std::span<const Fingerprint> all, std::string_view op, int rank) {
  auto msg = desync_message(all);
  if (!msg.empty()) throw DesyncError(std::string(op), rank, "desync: " + msg);
}

}  // namespace comm::detail
