#pragma once
// Subgroups, backend-neutral: where a rank lands in a split or a new_group, and the names and store
// prefixes of the new communicators.
//
// Every communicator counts its subgroups (split and new_group alike, on every rank, members or
// not), so that subgroup k has the same number everywhere. Its store keys live under
// `<parent key prefix>g<k>` (split: `.../g<k>/c<color>`, one communicator per color), in a
// PrefixStore over the parent's store; its name, used in flight-record dumps, is `g<k>` below a
// root communicator and `<parent name>.g<k>` below a subgroup.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace comm::detail {

/// A rank's place in a new communicator.
struct GroupPlace {
  int rank = 0;
  int size = 0;
};

/// split: this rank's place among the ranks of its color, ordered by (key, rank in the parent),
/// from every rank's (color, key) as 2*size values in rank order; nullopt for a negative color.
[[nodiscard]] inline std::optional<GroupPlace> split_place(std::span<const std::int64_t> color_key, int color,
                                                           int key, int rank) {
  if (color < 0) return std::nullopt;
  std::vector<std::pair<std::int64_t, int>> members;  // (key, rank in the parent)
  for (std::size_t r = 0; 2 * r + 1 < color_key.size(); ++r)
    if (color_key[2 * r] == color) members.emplace_back(color_key[2 * r + 1], static_cast<int>(r));
  std::sort(members.begin(), members.end());
  const auto me = std::find(members.begin(), members.end(), std::pair<std::int64_t, int>{key, rank});
  if (me == members.end()) return std::nullopt;  // this rank's own entry is missing: not a member
  return GroupPlace{static_cast<int>(me - members.begin()), static_cast<int>(members.size())};
}

/// new_group: this rank's place in `ranks` (ranked in list order), nullopt when it is not listed.
[[nodiscard]] inline std::optional<GroupPlace> group_place(std::span<const int> ranks, int rank) {
  const auto me = std::find(ranks.begin(), ranks.end(), rank);
  if (me == ranks.end()) return std::nullopt;
  return GroupPlace{static_cast<int>(me - ranks.begin()), static_cast<int>(ranks.size())};
}

/// "g<k>": subgroup k of a communicator.
[[nodiscard]] inline std::string group_name(std::uint64_t k) { return "g" + std::to_string(k); }

/// The store prefix of subgroup `group` (new_group) below a communicator with `key_prefix`.
[[nodiscard]] inline std::string group_prefix(const std::string& key_prefix, const std::string& group) {
  return key_prefix + group;
}

/// The store prefix of the communicator of `color` made by split number `group`.
[[nodiscard]] inline std::string split_prefix(const std::string& key_prefix, const std::string& group, int color) {
  return key_prefix + group + "/c" + std::to_string(color);
}

/// The name of subgroup `group` of a communicator named `parent` ("" for a root communicator).
[[nodiscard]] inline std::string child_name(const std::string& parent, const std::string& group) {
  return parent.empty() ? group : parent + "." + group;
}

}  // namespace comm::detail
