#pragma once
// Which ranks of a Hierarchical communicator share a node, and the two levels built from that
// (backend-neutral, no communication: every rank derives the same structure from the same table
// of node identities, in rank order).
//
//   - Nodes are numbered by their lowest rank; within a node, ranks are numbered in rank order
//     (the local rank).
//   - When every node has the same number of ranks L ("uniform"), there is one inter-node group
//     per local index l: the ranks with local rank l, one per node, ranked by node. All L groups
//     work at once, each on its share of the data.
//   - Otherwise only the local ranks 0 (the "leaders") form an inter-node group, ranked by node.

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

namespace comm::detail::hierarchical {

struct Topology {
  int size = 0;                          // ranks in the communicator
  std::vector<std::vector<int>> nodes;   // per node, its ranks in rank order (index = local rank)
  std::vector<int> node_of;              // per rank, its node
  std::vector<int> local_of;             // per rank, its local rank
  bool uniform = false;                  // every node has the same number of ranks

  [[nodiscard]] int num_nodes() const noexcept { return static_cast<int>(nodes.size()); }
  [[nodiscard]] int node_size(int node) const noexcept {
    return static_cast<int>(nodes[static_cast<std::size_t>(node)].size());
  }
  /// The rank with local rank `local` on `node`.
  [[nodiscard]] int rank_at(int node, int local) const noexcept {
    return nodes[static_cast<std::size_t>(node)][static_cast<std::size_t>(local)];
  }
  /// The ranks of the inter-node group of local index `local` (uniform), or of the leaders
  /// (local 0), in group-rank order: one per node, by node.
  [[nodiscard]] std::vector<int> inter_group(int local) const {
    std::vector<int> g;
    g.reserve(nodes.size());
    for (const auto& n : nodes) g.push_back(n[static_cast<std::size_t>(local)]);
    return g;
  }
  /// Whether rank = local * num_nodes() + node for every rank: the slice layout (rank blocks
  /// grouped by local index, then node) is the rank order, so no reordering copy is needed.
  [[nodiscard]] bool local_major_is_rank_order() const noexcept {
    if (!uniform) return false;
    const int m = num_nodes();
    for (int r = 0; r < size; ++r)
      if (r != local_of[static_cast<std::size_t>(r)] * m + node_of[static_cast<std::size_t>(r)]) return false;
    return true;
  }
  /// Whether rank = node * L + local for every rank (nodes hold consecutive ranks).
  [[nodiscard]] bool node_major_is_rank_order() const noexcept {
    if (!uniform) return false;
    const int l = size / std::max(num_nodes(), 1);
    for (int r = 0; r < size; ++r)
      if (r != node_of[static_cast<std::size_t>(r)] * l + local_of[static_cast<std::size_t>(r)]) return false;
    return true;
  }
  /// "2 nodes of 2 ranks" / "3 nodes of 2, 1, 1 ranks".
  [[nodiscard]] std::string describe() const {
    std::string s = std::to_string(nodes.size()) + (nodes.size() == 1 ? " node of " : " nodes of ");
    if (uniform) {
      s += std::to_string(nodes.empty() ? 0 : nodes[0].size());
    } else {
      for (std::size_t i = 0; i < nodes.size(); ++i) s += (i ? ", " : "") + std::to_string(nodes[i].size());
    }
    return s + (size == 1 ? " rank" : " ranks");
  }
};

/// The structure from every rank's node identity, `ids[r]` for rank r.
[[nodiscard]] inline Topology make_topology(const std::vector<std::string>& ids) {
  Topology t;
  t.size = static_cast<int>(ids.size());
  t.node_of.assign(ids.size(), -1);
  t.local_of.assign(ids.size(), -1);
  std::vector<std::string> seen;  // node identities, by node number
  for (std::size_t r = 0; r < ids.size(); ++r) {
    const auto it = std::find(seen.begin(), seen.end(), ids[r]);
    const auto node = static_cast<std::size_t>(it - seen.begin());
    if (it == seen.end()) {
      seen.push_back(ids[r]);
      t.nodes.emplace_back();
    }
    t.node_of[r] = static_cast<int>(node);
    t.local_of[r] = static_cast<int>(t.nodes[node].size());
    t.nodes[node].push_back(static_cast<int>(r));
  }
  t.uniform = std::all_of(t.nodes.begin(), t.nodes.end(),
                          [&](const std::vector<int>& n) { return n.size() == t.nodes.front().size(); });
  return t;
}

}  // namespace comm::detail::hierarchical
