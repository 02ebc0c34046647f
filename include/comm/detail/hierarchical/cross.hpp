#pragma once
// The forms of Hierarchical's cross-node all_reduce (hierarchical/engine.hpp), for B bytes per
// rank across M nodes:
//   member: the member's own all_reduce (Gloo: one exchange at 2 nodes, B each way, nothing less
//     exists; recursive doubling up to 256 KiB, log2(M) steps, two more when M is not a power of
//     two; a ring above);
//   rsag: an inter reduce_scatter then an inter all_gather: two latencies at any M and 2(M-1)/M B
//     each way, the least an all_reduce can move, where doubling sends log2(M) B (2 B at 3 and 4
//     nodes). Picked from 3 nodes and kCrossRsagMin while a node's block B/M is a message Gloo
//     sends directly (kCrossBlockMax), and, for a step that runs alone, while the member would
//     still double (up to kCrossRingFrom);
//   gather: an inter all_gather and a local reduction (one latency at any M, but M(M-1) messages
//     against doubling's M log2(M)): measured slower on this project's 2-core machine
//     (benchmarks/RESULTS.md, "Growth with nodes"), so only when forced.
// COMM_HIERARCHICAL_CROSS=member|gather|rsag forces one form (for measurements; every rank must
// set the same: the form decides the messages).

#include <cstddef>
#include <cstdint>
#include <string>

#include <comm/detail/base/env.hpp>
#include <comm/error.hpp>

namespace comm::detail::hierarchical {

enum class Cross : std::uint8_t { automatic, member, gather, rsag };

// rsag from kCrossRsagMin per rank: there the bytes decide on a link that never runs above its
// rate. On the emulated 1 Gbit link with tc's burst spent (60 iterations) or a 128 KiB bucket, an
// all_reduce of 64 KiB at 3-4 nodes took rsag 1.00-1.03x OpenMPI TCP at one rank per node
// (doubling, which sends 2 S where the bound is 1.5 S at 4 nodes: 1.33-1.54x), and at 32 and 48 KiB
// rsag took 0.67-0.93x doubling's time at 3-4 nodes of 1 and 2 ranks (at 2 ranks the nodes'
// first ranks carry 32-128 KiB alone: leaders_carry). Only while tc's 1.25 MB bucket carries the
// bytes, which no wire does, was doubling (one peer a step, where rsag's steps wait for every
// node) the faster. Below 32 KiB a rank doubling stays: latency is what counts.
// benchmarks/RESULTS.md, "The emulated link's bucket, and rsag from 64 KiB a node", "rsag from
// 32 KiB".
inline constexpr std::size_t kCrossRsagMin = std::size_t{32} << 10;
// Above kCrossBlockMax per block Gloo's ring is as frugal, in one operation
// (detail/gloo/checked.hpp's kCheckedMax is the largest message Gloo sends directly).
inline constexpr std::size_t kCrossBlockMax = std::size_t{256} << 10;
// Above kCrossRingFrom the member's all_reduce is its ring (detail/gloo/algorithms.hpp's
// doubling_max), which moves as few bytes as rsag. Alone, at 4 nodes of one rank, the ring was 1-3 %
// faster at 512 KiB-1 MiB and within 1 % at 384 KiB (its steps overlap receiving and reducing;
// rsag's all_gather starts only after the whole reduce_scatter), and as fast at 3. As a
// pipeline's segment rsag stays: the member queues the segments' steps back to back, and there
// rsag was as fast or faster (4 x 2, 8 and 16 MiB). benchmarks/RESULTS.md, "Steady state across
// nodes".
inline constexpr std::size_t kCrossRingFrom = std::size_t{256} << 10;

// With one rank per node, from 4 nodes and above kCrossSegmentedFrom of the buffer per node (B/M),
// the all_reduce crosses as the pipeline's rsag segments of at most kCrossBlockMax a block, queued
// back to back on the member (unless COMM_HIERARCHICAL_CROSS forces a form), instead of the
// member's ring alone. Gloo's ring cuts each rank's chunk into blocks of 2 MiB
// (detail/gloo/reduce_scatter.hpp: kBlockSegments x kSegmentBytes) that drain before the next
// starts; above one block a chunk, at 4 nodes of one rank on the emulated 1 Gbit link, the ring
// read 1.05x the link bound at 16 MiB in one run and 1.09-1.12x in four, 1.09-1.12x at 32 MiB, the
// segments 1.05-1.06x (the framing) in every run; at 2-8 MiB they were 1.00-1.03x the ring's
// time. At 3 nodes the ring held 1.05x at 8-32 MiB and the segments gained nothing
// (1.000-1.003x). benchmarks/RESULTS.md, "One rank per node: rsag segments above the ring's block".
inline constexpr std::size_t kCrossSegmentedFrom = std::size_t{2} << 20;

/// Whether an all_reduce of `bytes` per rank on `nodes` equal nodes of `local` ranks crosses in
/// rsag segments cut for the blocks (local > 1 has the slice pipeline, cut by segment_).
[[nodiscard]] constexpr bool cross_segmented(std::size_t local, std::size_t nodes, std::size_t bytes) noexcept {
  return local == 1 && nodes >= 4 && bytes / nodes > kCrossSegmentedFrom;
}

/// Whether a cross-node step runs alone or as one of a pipeline's segments.
enum class Step : std::uint8_t { alone, segment };

[[nodiscard]] inline Cross cross_from_env(int rank) {
  const auto v = getenv_str("COMM_HIERARCHICAL_CROSS");
  if (!v) return Cross::automatic;
  const std::string t(trim(*v));
  if (t.empty() || t == "auto") return Cross::automatic;
  if (t == "member") return Cross::member;
  if (t == "gather") return Cross::gather;
  if (t == "rsag") return Cross::rsag;
  throw InvalidArgument("hierarchical.init", rank,
                        "COMM_HIERARCHICAL_CROSS='" + t.substr(0, 32) + "': use auto, member, gather or rsag");
}

/// The form for `bytes` per rank across `nodes` nodes: the same on every rank, as it depends on
/// the size, the node count, the step and the forced form only.
[[nodiscard]] constexpr Cross cross_form(Cross forced, std::size_t nodes, std::size_t bytes, Step step) noexcept {
  if (forced != Cross::automatic) return forced;
  if (nodes <= 2 || bytes < kCrossRsagMin) return Cross::member;
  if (step == Step::alone && bytes > kCrossRingFrom) return Cross::member;
  return (bytes + nodes - 1) / nodes <= kCrossBlockMax ? Cross::rsag : Cross::member;
}

// From kLeadersMin to kLeadersMax bytes per rank, with several ranks per node, the node's leader
// carries the node's buffer across alone (on-node reduce, the leaders' cross-node all_reduce,
// on-node broadcast) instead of each local rank a slice of it: the same bytes on the link in L
// times fewer messages, and one cross-node step to wait for instead of the slowest of L. At 2-4
// nodes of 2 on the emulated 1 Gbit link, with tc's burst spent (60 iterations) or a 128 KiB
// bucket, it took 0.86-0.99x the slices' time at 32-128 KiB in 17 of 18 cells (4 x 2 at 32 KiB:
// 1.13x once, 0.91x in the other run), where the unchanged 16 and 256 KiB read 0.90-1.08x.
// Outside it the slices were as fast or faster (a test build: 8 KiB at 2 nodes, 256 KiB at 4).
// benchmarks/RESULTS.md, "One stream per node at 32-128 KiB".
inline constexpr std::size_t kLeadersMin = std::size_t{32} << 10;
inline constexpr std::size_t kLeadersMax = std::size_t{128} << 10;

/// Whether an all_reduce of `bytes` per rank on nodes of `local` ranks each (equal nodes) crosses
/// by the nodes' leaders alone.
[[nodiscard]] constexpr bool leaders_carry(std::size_t local, std::size_t bytes) noexcept {
  return local > 1 && bytes >= kLeadersMin && bytes <= kLeadersMax;
}

/// What a slice of a buffer cut for the local ranks must be a multiple of (in elements), so that
/// under rsag it divides into equal blocks for the nodes.
[[nodiscard]] constexpr std::size_t slice_grain(Cross c, std::size_t nodes) noexcept {
  return c == Cross::rsag ? nodes : 1;
}

}  // namespace comm::detail::hierarchical
