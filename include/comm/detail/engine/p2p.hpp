#pragma once
// Point-to-point messages of the host engines, and the collectives the engine core composes from
// them. Engine-independent: the engines (Gloo, Shm, MPI) move the bytes; what a message says about
// itself and how a receiver checks it is here, once.
//
// Every message is preceded by a 32-byte header (Gloo, MPI: its own small message; Shm: the
// channel's header line) that says which operation sent it, the element type, the count, the tag
// and the sender's message number on this (sender, receiver) pair. The receiver compares it with
// what it posted before it accepts a byte of payload, so a mismatched tag, count, type or a
// collective received by a point-to-point receive is a comm::DesyncError naming both sides —
// never a payload written past a buffer, never a silently wrong match. The price is strictness:
// the messages of one pair are matched in the order they were sent (as NCCL does, and as MPI does
// for one tag); a receive cannot pick a later message by its tag.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <comm/detail/base/copy.hpp>
#include <comm/detail/engine/op.hpp>
#include <comm/detail/diagnostics/flight_recorder.hpp>
#include <comm/error.hpp>
#include <comm/types.hpp>

namespace comm::detail {

struct P2PHeader {
  static constexpr std::uint32_t kMagic = 0x70326331u;  // "p2c1"
  std::uint32_t magic = kMagic;
  std::uint8_t kind = 0;   // OpKind of the sending operation (send and p2p_batch count as send)
  std::uint8_t dtype = 0;
  std::uint16_t reserved = 0;
  std::int32_t tag = 0;
  std::uint32_t reserved2 = 0;
  std::uint64_t count = 0;  // elements
  std::uint64_t number = 0; // the sender's message number to this receiver (0, 1, ...)
};
static_assert(sizeof(P2PHeader) == 32);

/// The operation class a message belongs to: user point-to-point operations match each other
/// (a send is received by recv or by a batch's irecv), composed collectives only themselves.
[[nodiscard]] constexpr std::uint8_t p2p_class(OpKind k) noexcept {
  return is_p2p(k) ? static_cast<std::uint8_t>(OpKind::send) : static_cast<std::uint8_t>(k);
}

[[nodiscard]] inline P2PHeader p2p_header(const Op& op, const P2PItem& item, std::uint64_t number) noexcept {
  P2PHeader h;
  h.kind = p2p_class(op.desc.kind);
  h.dtype = op.desc.dtype;
  h.tag = item.tag;
  h.count = item.count;
  h.number = number;
  return h;
}

[[nodiscard]] inline std::string p2p_describe(std::uint8_t kind, std::uint8_t dtype, std::uint64_t count, int tag) {
  const auto k = static_cast<OpKind>(kind);
  std::string what = is_p2p(k) ? std::string("a send") : std::string("its part of ") + op_name(k);
  return what + " of " + std::to_string(count) + " " +
         std::string(dtype == OpDesc::none ? "bytes" : to_string(static_cast<Dtype>(dtype))) + " with tag " +
         std::to_string(tag);
}

/// Checks the header of the message that arrived from `item.peer` against receive `item` of `op`
/// (this rank's `number`-th message from that peer). Throws DesyncError naming both calls.
inline void check_p2p_header(const Op& op, const P2PItem& item, const P2PHeader& h, std::uint64_t number, int rank) {
  const char* name = op_name(op.desc.kind);
  if (h.magic != P2PHeader::kMagic) {
    const std::string from = "rank " + std::to_string(item.peer);
    throw DesyncError(name, rank, "malformed point-to-point header from " + from, from);
  }
  const auto want_kind = p2p_class(op.desc.kind);
  if (h.kind != want_kind || h.dtype != op.desc.dtype || h.count != item.count || h.tag != item.tag ||
      h.number != number) {
    const std::string from = "rank " + std::to_string(item.peer);
    std::string why = from + " sent " + p2p_describe(h.kind, h.dtype, h.count, h.tag) + " (its message #" +
                      std::to_string(h.number) + " to this rank), but this rank posted " +
                      (is_p2p(op.desc.kind) ? std::string("a receive") : std::string("its part of ") + name) +
                      " of " + std::to_string(item.count) + " " +
                      std::string(to_string(static_cast<Dtype>(op.desc.dtype))) + " with tag " +
                      std::to_string(item.tag) + " (message #" + std::to_string(number) +
                      " from that rank); point-to-point messages of a pair are matched in the order they were sent, "
                      "and tag, element type and count must agree";
    throw DesyncError(name, rank, why, from);
  }
}

/// Per-peer message numbers of one communicator (sends to, receives from each rank).
class P2PCounters {
 public:
  explicit P2PCounters(int size) : sent_(static_cast<std::size_t>(size), 0), received_(static_cast<std::size_t>(size), 0) {}
  [[nodiscard]] std::uint64_t next_send(int peer) noexcept { return sent_[static_cast<std::size_t>(peer)]++; }
  [[nodiscard]] std::uint64_t next_recv(int peer) noexcept { return received_[static_cast<std::size_t>(peer)]++; }

 private:
  std::vector<std::uint64_t> sent_, received_;
};

// ---- collectives as point-to-point batches (for engines without them) ----

/// scatter: the root sends slice p of `in` to rank p; every other rank receives its slice. The
/// root's own slice is copied by the caller.
inline void compose_scatter(const Op& op, int rank, int size, std::vector<P2PItem>& items) {
  const int root = op.desc.root;
  const std::size_t m = op.out_count;
  items.clear();
  if (rank == root) {
    auto* in = static_cast<std::byte*>(const_cast<void*>(op.in));
    for (int p = 0; p < size; ++p)
      if (p != root) items.push_back({true, in + static_cast<std::size_t>(p) * m * op.elem_size, m, p, 0});
  } else {
    items.push_back({false, op.out, m, root, 0});
  }
}

/// all_to_all (equal blocks of out_count/size) and all_to_all_v (op.counts: the send counts, then
/// the receive counts; displacements are their prefix sums): one send and one receive per peer.
inline void compose_all_to_all(const Op& op, int rank, int size, std::vector<P2PItem>& items) {
  const auto n = static_cast<std::size_t>(size);
  auto* in = static_cast<std::byte*>(const_cast<void*>(op.in));
  auto* out = static_cast<std::byte*>(op.out);
  const std::size_t e = op.elem_size;
  items.clear();
  std::size_t in_off = 0, out_off = 0;
  for (std::size_t p = 0; p < n; ++p) {
    const std::size_t sc = op.counts.empty() ? op.in_count / n : op.counts[p];
    const std::size_t rc = op.counts.empty() ? op.out_count / n : op.counts[n + p];
    if (static_cast<int>(p) != rank) {
      items.push_back({true, in + in_off * e, sc, static_cast<int>(p), 0});
      items.push_back({false, out + out_off * e, rc, static_cast<int>(p), 0});
    }
    in_off += sc;
    out_off += rc;
  }
}

/// The copy a composed all_to_all(_v) makes of this rank's own block (in and out do not overlap).
inline void all_to_all_self_copy(const Op& op, int rank, int size) {
  const auto n = static_cast<std::size_t>(size);
  const auto r = static_cast<std::size_t>(rank);
  std::size_t in_off = 0, out_off = 0;
  for (std::size_t p = 0; p < r; ++p) {
    in_off += op.counts.empty() ? op.in_count / n : op.counts[p];
    out_off += op.counts.empty() ? op.out_count / n : op.counts[n + p];
  }
  const std::size_t c = op.counts.empty() ? op.in_count / n : op.counts[r];
  copy_bytes(static_cast<std::byte*>(op.out) + out_off * op.elem_size,
             static_cast<const std::byte*>(op.in) + in_off * op.elem_size, c * op.elem_size);
}

}  // namespace comm::detail
