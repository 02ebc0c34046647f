#pragma once
// The run-time argument checks of every operation, on erased buffers (pointer, element count,
// element size). Communicator<B> runs them for its typed calls and AnyCommunicator's model for
// its erased ones, so a call is validated by one code whichever way it came in, and the messages
// are the same. Compile-time checks (element type, mutability, op objects) stay in the facade:
// they need the types.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <comm/detail/base/copy.hpp>
#include <comm/error.hpp>
#include <comm/types.hpp>

namespace comm::detail {

/// A buffer as the checks see it: where it starts and how many elements it holds.
struct ArgBuf {
  const void* data = nullptr;
  std::size_t n = 0;
};

/// The checks of one call: operation `op` on `rank` of `size` ranks, elements of `elem` bytes.
/// Each throws comm::InvalidArgument naming the operation, the rank and the values.
struct ArgChecks {
  const char* op;
  int rank;
  int size;
  std::size_t elem = 1;

  [[noreturn]] void invalid(const std::string& what) const { throw InvalidArgument(op, rank, what); }
  // The checks on every call's path (root, blocks, slot_overlap, all_reduce) keep their messages
  // in cold functions, so that what is left inlines into the call: a blocking 8-byte call is
  // ~1,200 instructions, of which these checks were ~100.
  [[noreturn, gnu::cold, gnu::noinline]] void bad_root(int root) const {
    invalid("root " + std::to_string(root) + " is out of range [0, " + std::to_string(size) + ")");
  }

  static std::string n_elems(std::size_t n) { return std::to_string(n) + (n == 1 ? " element" : " elements"); }

  [[nodiscard]] std::size_t ranks() const noexcept { return static_cast<std::size_t>(size); }
  [[nodiscard]] bool overlaps(ArgBuf a, ArgBuf b) const noexcept {
    return ranges_overlap(a.data, a.n * elem, b.data, b.n * elem);
  }

  /// A ReduceOp value against the element type and the backend (`supported`: the backend's
  /// supports_reduction answer, `backend`: its name).
  void reduction(ReduceOp r, Dtype d, bool supported, std::string_view backend) const {
    if (static_cast<unsigned>(r) > static_cast<unsigned>(ReduceOp::bxor))
      invalid("reduction value " + std::to_string(static_cast<unsigned>(r)) + " is not a ReduceOp");
    if (is_bitwise(r) && is_floating(d))
      invalid("reduction " + std::string(to_string(r)) + " is not supported for element type " +
              std::string(to_string(d)) + ": bitwise reductions (band/bor/bxor) need an integer element type");
    if (!supported)
      invalid("reduction " + std::string(to_string(r)) + " is not supported for element type " +
              std::string(to_string(d)) + " by the " + std::string(backend) + " backend");
  }

  void root(int root) const {
    if (root < 0 || root >= size) [[unlikely]]
      bad_root(root);
  }

  void peer(int peer, int tag) const {
    if (peer < 0 || peer >= size)
      invalid("peer " + std::to_string(peer) + " is out of range [0, " + std::to_string(size) + ")");
    if (peer == rank)
      invalid("peer " + std::to_string(peer) + " is this rank; a rank cannot send to or receive from itself");
    if (tag < 0) invalid("tag " + std::to_string(tag) + " is negative; tags are >= 0");
  }

  void group_ranks(std::span<const int> list) const {
    if (list.empty()) invalid("the list of ranks is empty: a group needs at least one rank");
    std::vector<char> seen(ranks(), 0);
    for (const int r : list) {
      if (r < 0 || r >= size)
        invalid("rank " + std::to_string(r) + " is out of range [0, " + std::to_string(size) + ")");
      if (seen[static_cast<std::size_t>(r)]++) invalid("rank " + std::to_string(r) + " is listed twice");
    }
  }

  /// `part` must be disjoint from `whole`, or exactly this rank's slot of it.
  void slot_overlap(ArgBuf part, ArgBuf whole, const char* part_name, const char* whole_name) const {
    const auto* slot = static_cast<const std::byte*>(whole.data) + static_cast<std::size_t>(rank) * part.n * elem;
    if (part.data != slot && overlaps(part, whole)) [[unlikely]]
      bad_slot_overlap(part_name, whole_name);
  }
  [[noreturn, gnu::cold, gnu::noinline]] void bad_slot_overlap(const char* part_name, const char* whole_name) const {
    invalid(std::string(part_name) + " overlaps " + whole_name + " other than exactly at this rank's slot (" +
            whole_name + " + rank()*" + part_name + ".size())");
  }

  /// `whole` holds size() blocks of `block` (the other buffer: `block_name`).
  void blocks(std::size_t whole, std::size_t block, const char* whole_name, const char* block_name,
              const char* where = "") const {
    if (whole != ranks() * block) [[unlikely]]
      bad_blocks(whole, block, whole_name, block_name, where);
  }
  [[noreturn, gnu::cold, gnu::noinline]] void bad_blocks(std::size_t whole, std::size_t block, const char* whole_name,
                                                        const char* block_name, const char* where) const {
    // Sizes that fit with the two buffers exchanged are most likely torch's (output, input) order.
    const bool swapped = size > 1 && block == ranks() * whole;
    invalid(std::string(whole_name) + " has " + n_elems(whole) + where + ", expected size()*" + block_name + " = " +
            std::to_string(ranks() * block) + " (size() = " + std::to_string(size) + ", " + block_name + " has " +
            n_elems(block) + ")" +
            (swapped ? "; the arguments are (input, output), the reverse of torch's (output, input): were they swapped?"
                     : ""));
  }

  // ---- one function per operation (after the reduction's check, where it has one) ----

  void all_reduce(ArgBuf in, ArgBuf out) const {
    if (in.n != out.n || (in.data != out.data && overlaps(in, out))) [[unlikely]]
      bad_all_reduce(in, out);
  }
  [[noreturn, gnu::cold, gnu::noinline]] void bad_all_reduce(ArgBuf in, ArgBuf out) const {
    if (in.n != out.n) invalid("input has " + n_elems(in.n) + " but output has " + std::to_string(out.n) + "; they must be equal");
    invalid("input and output overlap partially; pass one buffer for an in-place all_reduce");
  }
  void reduce_scatter(ArgBuf in, ArgBuf out) const {
    blocks(in.n, out.n, "input", "output");
    slot_overlap(out, in, "output", "input");
  }
  void all_gather(ArgBuf in, ArgBuf out) const {
    blocks(out.n, in.n, "output", "input");
    slot_overlap(in, out, "input", "output");
  }
  void gather(ArgBuf in, ArgBuf out, int r) const {
    root(r);
    if (rank != r) return;
    blocks(out.n, in.n, "output", "input", " on the root");
    slot_overlap(in, out, "input", "output");
  }
  void reduce(ArgBuf in, ArgBuf out, int r) const {
    root(r);
    if (rank != r) return;
    if (out.n != in.n)
      invalid("output has " + n_elems(out.n) + " on the root but input has " + n_elems(in.n) + "; they must be equal");
    if (in.data != out.data && overlaps(in, out))
      invalid("input and output overlap partially; pass one buffer for an in-place reduce");
  }
  void scatter(ArgBuf in, ArgBuf out, int r) const {
    root(r);
    if (rank != r) return;
    blocks(in.n, out.n, "input", "output", " on the root");
    slot_overlap(out, in, "output", "input");
  }
  void all_to_all(ArgBuf in, ArgBuf out) const {
    if (in.n != out.n || in.n % ranks() != 0)
      invalid("input has " + n_elems(in.n) + " and output " + n_elems(out.n) + "; both must hold size() = " +
              std::to_string(size) + " equal blocks");
    if (overlaps(in, out)) invalid("input and output overlap; all_to_all needs separate buffers");
  }
  void all_to_all_v(ArgBuf in, std::span<const std::size_t> in_counts, ArgBuf out,
                    std::span<const std::size_t> out_counts) const {
    if (in_counts.size() != ranks() || out_counts.size() != ranks())
      invalid("in_counts has " + std::to_string(in_counts.size()) + " entries and out_counts " +
              std::to_string(out_counts.size()) + "; both need size() = " + std::to_string(size));
    auto total = [&](std::span<const std::size_t> c, const char* what) {
      std::size_t t = 0;
      for (const std::size_t x : c) {
        if (x > std::numeric_limits<std::size_t>::max() - t) invalid(std::string(what) + " overflow when summed");
        t += x;
      }
      return t;
    };
    const std::size_t ti = total(in_counts, "in_counts"), to = total(out_counts, "out_counts");
    if (ti != in.n) invalid("in_counts sum to " + std::to_string(ti) + " but input has " + n_elems(in.n));
    if (to != out.n) invalid("out_counts sum to " + std::to_string(to) + " but output has " + n_elems(out.n));
    const auto r = static_cast<std::size_t>(rank);
    if (in_counts[r] != out_counts[r])
      invalid("this rank sends itself " + std::to_string(in_counts[r]) + " but receives " +
              std::to_string(out_counts[r]) + " (in_counts[rank()] != out_counts[rank()])");
    if (overlaps(in, out)) invalid("input and output overlap; all_to_all_v needs separate buffers");
  }
  /// The entries of a batch_isend_irecv.
  template <class T>
  void p2p_batch(std::span<const P2POp<T>> ops) const {
    for (const auto& o : ops) {
      if (o.op != P2PKind::isend && o.op != P2PKind::irecv) invalid("an entry's op is neither isend nor irecv");
      peer(o.peer, o.tag);
    }
  }
};

}  // namespace comm::detail
