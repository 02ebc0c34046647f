#pragma once
// split and new_group (concepts.hpp, optional capability 8) for a policy over an engine core:
// the group arithmetic and store prefixes are the same for every backend (detail/engine/groups.hpp); a
// policy only says how to connect its engine among the members.
//
// The policy derives from Subgroups<Policy>, befriends it, has `engine_` (a pointer to an
// EngineCore-derived engine) and `Policy child(const Subgroup&) const`, which connects the
// subgroup. By default subgroups need the parent's store (the members rendezvous under the
// subgroup's prefix there); a policy whose engine can connect members without one (Mpi: through
// its parent MPI communicator) says `static constexpr bool subgroups_without_store = true`.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <comm/detail/engine/groups.hpp>
#include <comm/error.hpp>
#include <comm/store.hpp>

namespace comm::detail {

/// A subgroup as Subgroups hands it to the policy's child().
struct Subgroup {
  /// Its number k among this communicator's subgroups (the same on every rank).
  std::uint64_t index = 0;
  /// This rank's place in it, and its members as ranks of the parent, in its rank order.
  GroupPlace place;
  std::vector<int> members;
  /// Whether the members have already met (split: its color exchange ran on every rank); false
  /// for new_group, whose members have not communicated yet.
  bool met = false;
  /// A PrefixStore over the parent's store under the subgroup's prefix (null when the parent has
  /// no store).
  std::shared_ptr<Store> store;
  /// The rank in its dump file names (the parent's) and its name ("g3", "c2.g3").
  int file_rank = -1;
  std::string name;

  /// `c` (an engine's settings, derived from CoreConfig) with the subgroup's record names.
  template <class Config>
  [[nodiscard]] Config configured(Config c) const {
    c.file_rank = file_rank;
    c.name = name;
    return c;
  }
};

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
    // The members in the new communicator's order: (key, rank here), as split_place ranks them.
    std::vector<std::pair<std::int64_t, int>> order;
    for (std::size_t r = 0; 2 * r + 1 < all.size(); ++r)
      if (all[2 * r] == color) order.emplace_back(all[2 * r + 1], static_cast<int>(r));
    std::sort(order.begin(), order.end());
    std::vector<int> members;
    members.reserve(order.size());
    for (const auto& m : order) members.push_back(m.second);
    const std::string group = group_name(k);
    return self().child(make(k, *place, std::move(members), true, split_prefix(e.key_prefix(), group, color), group));
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
    return self().child(make(k, *place, std::vector<int>(ranks.begin(), ranks.end()), false,
                             group_prefix(e.key_prefix(), group), group));
  }

 private:
  [[nodiscard]] Policy& self() noexcept { return static_cast<Policy&>(*this); }

  [[nodiscard]] static constexpr bool without_store() noexcept {
    if constexpr (requires { Policy::subgroups_without_store; })
      return Policy::subgroups_without_store;
    else
      return false;
  }

  Subgroup make(std::uint64_t k, GroupPlace place, std::vector<int> members, bool met, const std::string& prefix,
                const std::string& group) {
    auto& e = *self().engine_;
    Subgroup g;
    g.index = k;
    g.place = place;
    g.members = std::move(members);
    g.met = met;
    if (e.store()) g.store = std::make_shared<PrefixStore>(prefix, e.store());
    g.file_rank = e.file_rank();
    g.name = child_name(e.name(), group);
    return g;
  }

  void require_store(const char* op) {
    if constexpr (!without_store()) {
      auto& e = *self().engine_;
      if (!e.store())
        throw InvalidArgument(op, e.rank(),
                              "this communicator was adopted and has no store; subgroups need one (create the "
                              "communicator with create() or from_env())");
    }
  }
};

}  // namespace comm::detail
