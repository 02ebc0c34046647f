#pragma once
// split and new_group (concepts.hpp, optional capability 8) for a policy over an engine core:
// the group arithmetic and store prefixes are the same for every backend (detail/groups.hpp); a
// policy only says how to connect its engine among the members under a store prefix.
//
// The policy derives from Subgroups<Policy>, befriends it, has `engine_` (a pointer to an
// EngineCore-derived engine) and `Policy child(const std::string& prefix, const std::string& group,
// int rank, int size) const`, which connects the subgroup under `prefix` in a PrefixStore over the
// engine's store.

#include <algorithm>
#include <optional>
#include <span>
#include <string>

#include <comm/detail/groups.hpp>
#include <comm/error.hpp>

namespace comm::detail {

template <class Policy>
class Subgroups {
 public:
  /// Collective over every rank of this communicator (an operation "split" in its sequence):
  /// ranks with the same `color` >= 0 form a new communicator, ordered by (key, rank here); a
  /// negative color gives nullopt. The new communicator inherits these options.
  [[nodiscard]] std::optional<Policy> split(int color, int key) {
    auto& e = *self().engine_;
    require_store("split");
    const auto all = e.exchange_color_key(color, key);
    const auto k = e.next_group_index();
    const auto place = split_place(all, color, key, e.rank());
    if (!place) return std::nullopt;
    const std::string group = group_name(k);
    return self().child(split_prefix(e.key_prefix(), group, color), group, place->rank, place->size);
  }

  /// A communicator of `ranks` (validated by the facade: in range, no duplicates), ranked in
  /// that order. Every rank calls it in the same order; non-members return nullopt at once
  /// (without communicating), members connect among themselves only.
  [[nodiscard]] std::optional<Policy> new_group(std::span<const int> ranks) {
    auto& e = *self().engine_;
    require_store("new_group");
    const auto k = e.next_group_index();
    const auto place = group_place(ranks, e.rank());
    if (!place) return std::nullopt;
    const std::string group = group_name(k);
    return self().child(group_prefix(e.key_prefix(), group), group, place->rank, place->size);
  }

 private:
  [[nodiscard]] Policy& self() noexcept { return static_cast<Policy&>(*this); }

  void require_store(const char* op) {
    auto& e = *self().engine_;
    if (!e.store())
      throw InvalidArgument(op, e.rank(),
                            "this communicator was adopted and has no store; subgroups need one (create the "
                            "communicator with create() or from_env())");
  }
};

}  // namespace comm::detail
