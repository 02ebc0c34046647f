#pragma once
// comm's own schedules for the MPI engine (mpi/engine.hpp): on 2..kOwnMaxRanks ranks,
// all_reduce, reduce_scatter, all_gather and broadcast (and the barrier, in rounds of empty
// messages) are point-to-point messages on the data communicator (tags kStepTag, kGatherTag,
// kCountTag, kBarrierTag; collectives never match them) that every rank posts
// to every other at once (sends first: each message leaves one MPI_Irecv sooner; the receives are
// posted before the first MPI_Testall), then MPI_Reduce_local. MPI's non-blocking collectives run
// their own, slower schedules (OpenMPI's libnbc: 1.5-6x its blocking calls on one node); MPI's blocking calls
// would keep no deadline (a handshake before them cannot stop a rank that timed out from leaving
// the others blocked); these point-to-point messages go through the same shared-memory path as the
// blocking calls' own, and every request is polled to the deadline, so a Timeout can name the peer
// whose message is missing. all_reduce reduces in rank order (up to Tuning::exchange_max, where
// every rank reduces every input) or block by block on one rank each, so every rank gets the same
// bits. Where the library's own non-blocking all_reduce measured faster (MPICH from 512 KiB:
// Tuning::library_all_reduce), the engine runs MPI_Iallreduce instead, after check_count: the
// ranks' sizes are compared first, so a mismatch is still an error naming the peer.
//
// OwnSchedules is a base of the engine (CRTP): the schedules use the engine's data communicator,
// its failure watch (look_out) and its leak-on-failure storage (Pending), so a request left pending
// after a Timeout keeps what it writes alive exactly as the engine's other requests do.

#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <comm/detail/base/copy.hpp>
#include <comm/detail/engine/op.hpp>
#include <comm/detail/mpi/errors.hpp>
#include <comm/detail/mpi/types.hpp>
#include <comm/detail/mpi/wait.hpp>
#include <comm/error.hpp>

namespace comm::detail::mpi {

/// Scratch above this size is given back after an operation (smaller stays for the next one).
inline constexpr std::size_t kScratchKeep = std::size_t{8} << 20;
/// A cache line: the receive slots of a schedule are placed by it (recv_slots).
inline constexpr std::size_t kSlotAlign = 64;

/// Sizes the own schedules are picked by, per MPI library (its eager limit on one node: the
/// largest message sent without a rendezvous round trip). Measured on both libraries
/// (benchmarks/RESULTS.md, "Mpi backend vs blocking MPI").
struct Tuning {
  /// all_reduce and reduce_scatter: messages above it (up to pieces_max) go as eager pieces.
  std::size_t eager = ~std::size_t{0};
  std::size_t pieces_max = 0;
  std::size_t exchange_max = std::size_t{4} << 10;  // all_reduce: one exchange up to here
  /// The reduce-scatter step sends a block up to this size as one message (reduce_step).
  std::size_t whole_max = 0;
  /// all_reduce from this size is the library's MPI_Iallreduce after a count check (library_all_reduce).
  std::size_t library_all_reduce = ~std::size_t{0};
  /// all_gather: an own block from this size is copied into place before the exchange.
  std::size_t copy_first = ~std::size_t{0};
  /// all_gather: an own block from this size (below copy_first) is copied after the exchange,
  /// a smaller one while the messages travel.
  std::size_t copy_after = std::size_t{256} << 10;
  /// all_reduce: the reduce-scatter step's receive slots are placed like the output (recv_slots).
  bool place_slots = false;
  /// broadcast on 3 or more ranks: from this size in parts read in turn (broadcast_parts).
  std::size_t broadcast_parts = ~std::size_t{0};
};

/// OpenMPI's shared memory (vader) sends 4 KiB eagerly, its header included: all_reduce's and
/// reduce_scatter's messages up to 12 KB go as eager pieces (piece_of). Other libraries: no
/// pieces, and the exchange only up to 4 KiB. Under OpenMPI a broadcast from 256 KiB on 3 or more
/// ranks goes in parts (broadcast_parts); under MPICH, whose 3 and 4 ranks on the measuring VM's
/// 2 cores spin through the scheduler's slices (milliseconds a call either way), 16 MiB in 64
/// parts took 1.01x MPI_Bcast at 3 ranks against 0.81x whole, and nothing smaller gained.
///
/// MPICH 4 (Debian's build: ch4 over UCX), each measured at 2 ranks against the blocking call
/// (benchmarks/RESULTS.md, "Mpi under MPICH: its own all_reduce from 512 KiB"):
///   - all_reduce from 512 KiB: comm's chunked reduce-scatter and all-gather took 1.04-1.09x
///     MPI_Allreduce at 1-16 MiB, MPICH's own MPI_Iallreduce 1.00-1.02x;
///   - MPI_Allreduce of 16 KiB is two 8 KiB eager messages and a reduction of 8 KiB, where one
///     exchange of the whole 16 KiB took 1.11x that: the exchange stops at 8 KiB (1.03-1.05x);
///   - a 1 MiB reduce_scatter took 1.04x with its 512 KiB blocks whole against 1.08x in two
///     chunks; on a later VM (2026-12-04, "Mpi under MPICH: reduce_scatter blocks whole up to
///     8 MiB") 4 and 16 MiB ones took 0.93-1.02x and 0.90-0.99x with their blocks whole against
///     1.07-1.14x and 1.03-1.11x in 256 KiB chunks, but a 64 MiB one 158-183 ms whole against
///     13-16 ms in chunks (MPICH's own MPI_Reduce_scatter_block, one message per block, takes as
///     long): blocks go whole up to 8 MiB;
///   - a 16 MiB all_gather with its own 8 MiB block copied before the exchange 1.01x, after it
///     1.07x (and from 0.90 to 1.09x between rounds);
///   - no eager pieces (MPICH 4 sends 8 KiB eagerly): this machine has a fast and a slow state
///     (the 64 KiB all_gather 8 against 28 us), and messages of 8-32 KiB in 8 KiB pieces took
///     0.55-0.86x the blocking calls in the fast one but 1.2-2.7x in the slow one (a 32 KiB
///     broadcast 2.69x), where whole messages took at most 1.03x (by the median) in both.
[[nodiscard]] inline Tuning tuning_for_library() noexcept {
  char text[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  if (MPI_Get_library_version(text, &len) != MPI_SUCCESS) return {};
  const std::string_view v(text, static_cast<std::size_t>(std::max(len, 0)));
  constexpr std::size_t KiB = 1024;
  if (v.find("Open MPI") != std::string_view::npos)
    return {.eager = 4000,
            .pieces_max = 12000,
            .exchange_max = 32 * KiB,
            .copy_after = ~std::size_t{0},
            .place_slots = true,
            .broadcast_parts = 256 * KiB};
  if (v.substr(0, 5) == "MPICH")
    return {.exchange_max = 8 * KiB,
            .whole_max = 8192 * KiB,
            .library_all_reduce = 512 * KiB,
            .copy_first = 4096 * KiB};
  return {};
}

/// One step of a schedule: its requests, and for each the peer, (receives) the bytes expected
/// and the caller's tag for in-order processing. (The requests are one array, as MPI_Testall takes
/// them; what comm keeps about each is one record beside it, so posting a message appends twice.)
struct Step {
  static constexpr std::size_t kSend = ~std::size_t{0};
  struct Info {
    int peer = -1;
    std::size_t expect = kSend;  // bytes; kSend for a send
    std::size_t user = kSend;    // receives: passed to finish_step's on_recv (kSend: not)
  };
  std::vector<MPI_Request> reqs;
  std::vector<Info> info;          // one per request
  std::vector<std::size_t> recvs;  // indices of the receives, in the order posted
  std::vector<MPI_Status> status;
  /// Messages go whole, never in eager pieces (OwnSchedules::piece_of): set per operation.
  bool whole = false;
  void clear() noexcept {
    reqs.clear();
    info.clear();
    recvs.clear();
    whole = false;
  }
};

/// The own schedules of `Engine` (mpi::Engine): run_own() runs `op` when own_schedule(op).
template <class Engine>
class OwnSchedules {
 protected:
  /// Communicators up to this size run all_reduce, reduce_scatter, all_gather and broadcast as
  /// comm's direct schedules (every rank talks to every other at once); larger ones keep MPI's
  /// non-blocking collectives, whose trees scale with the rank count.
  static constexpr int kOwnMaxRanks = 8;

  /// The reduce-scatter step goes in chunks of about kChunk bytes per peer, each reduced as soon as
  /// it arrived (while it is still in cache) and in the same order on every chunk; at most kDepth
  /// of them in flight per peer.
  static constexpr std::size_t kChunk = std::size_t{256} << 10;
  static constexpr std::size_t kDepth = 4;
  /// A broadcast in parts (broadcast_parts, from Tuning::broadcast_parts) goes in parts of about
  /// kPart bytes, at least one per reader and at most kPartsMax.
  static constexpr std::size_t kPart = std::size_t{256} << 10;
  static constexpr std::size_t kPartsMax = 64;
  /// Tags on the data communicator: the schedules' two steps (MPI keeps the messages of one
  /// source and tag in order, so consecutive operations never mix).
  static constexpr int kStepTag = 1;
  static constexpr int kGatherTag = 2;
  /// check_count's sizes (behind an empty message on kStepTag: see there), and the size a
  /// broadcast in parts sends first (broadcast_parts).
  static constexpr int kCountTag = 3;
  /// The barrier's empty messages. Within one barrier each round hears from another peer (the
  /// distances 1, 2, 4 differ modulo every size up to kOwnMaxRanks), so the messages one source
  /// sends this rank on this tag all belong to one round and match in order, barrier after barrier.
  static constexpr int kBarrierTag = 4;

  /// Whether `op` runs as comm's own schedule: one of the four operations or a barrier,
  /// 2..kOwnMaxRanks ranks, every message within MPI's int count of bytes, and not a
  /// library_all_reduce.
  [[nodiscard]] bool own_schedule(const Op& op) const noexcept {
    if (self().size() < 2 || self().size() > kOwnMaxRanks) return false;
    std::size_t bytes = 0;  // the largest message of the operation
    switch (op.desc.kind) {
      case OpKind::barrier: return true;
      case OpKind::all_reduce:
        if (library_all_reduce(op)) return false;
        [[fallthrough]];
      case OpKind::broadcast: bytes = op.out_count * op.elem_size; break;
      case OpKind::reduce_scatter: bytes = op.out_count * op.elem_size; break;
      case OpKind::all_gather: bytes = op.in_count * op.elem_size; break;
      default: return false;
    }
    return bytes <= Engine::kMaxCount;
  }

  /// Whether `op` is an all_reduce that the engine leaves to the library's MPI_Iallreduce on a
  /// communicator where comm's own schedules run (Tuning::library_all_reduce): the engine calls
  /// check_count first, so that ranks with different counts still get a BackendError naming the
  /// peer before any data moves.
  [[nodiscard]] bool library_all_reduce(const Op& op) const noexcept {
    return op.desc.kind == OpKind::all_reduce && self().size() >= 2 && self().size() <= kOwnMaxRanks &&
           op.out_count * op.elem_size >= tuning_.library_all_reduce;
  }

  /// Every rank sends its operation's size in bytes to every other and compares what comes back:
  /// a peer with another size is a BackendError naming it. The sizes go on their own tag behind an
  /// empty message on the schedules' tag, which no schedule sends (an operation of no bytes moves
  /// nothing): a peer in one of the own schedules instead gets that empty message where it expects
  /// data, and this rank the peer's data where it expects nothing, a length error on both sides.
  /// (Sent on the schedules' tag, an 8-byte size would have been taken as the data of a peer's
  /// 8-byte all_reduce, which would then have returned a wrong sum without an error.)
  void check_count(std::size_t bytes, const char* name, std::uint64_t seq, Deadline& deadline) {
    const int me = self().rank(), n = self().size();
    Step& s = self().pending_->step;
    s.clear();
    // The peers' sizes in slots 0 .. n-2, this rank's in the last (sent from there: the slots
    // outlive a send left pending by a failure).
    const Slots slots = recv_slots(static_cast<std::size_t>(n), sizeof(std::uint64_t));
    const auto mine = static_cast<std::uint64_t>(bytes);
    std::byte* own = slots.at(static_cast<std::size_t>(n - 1));
    std::memcpy(own, &mine, sizeof mine);
    for (int p = 0; p < n; ++p)
      if (p != me) {
        post_send(s, own, 0, p, kStepTag, name);
        post_send(s, own, sizeof mine, p, kCountTag, name);
      }
    for (int p = 0; p < n; ++p)
      if (p != me) {
        post_recv(s, slots.at(slot_of(p)), 0, p, kStepTag, name);
        post_recv(s, slots.at(slot_of(p)), sizeof mine, p, kCountTag, name);
      }
    finish_step(s, name, seq, deadline);
    for (int p = 0; p < n; ++p)
      if (p != me) check_size(slots.at(slot_of(p)), mine, p, "called it with", name);
  }

  /// A BackendError naming peer `p` unless the size it sent (8 bytes at `theirs_at`) is `mine`.
  void check_size(const std::byte* theirs_at, std::uint64_t mine, int p, const char* verb, const char* name) const {
    std::uint64_t theirs = 0;
    std::memcpy(&theirs, theirs_at, sizeof theirs);
    if (theirs != mine)
      throw BackendError(name, self().rank(),
                         "rank " + std::to_string(p) + " " + verb + " " + std::to_string(theirs) +
                             " bytes where this rank has " + std::to_string(mine) +
                             ": the ranks called this operation with different counts",
                         std::to_string(p));
  }

  /// Block `j` of `count` elements split over size() ranks: [lo(j), lo(j + 1)).
  [[nodiscard]] std::size_t block_lo(std::size_t count, int j) const noexcept {
    return count * static_cast<std::size_t>(j) / static_cast<std::size_t>(self().size());
  }

  /// The receive slot of peer `p` (the peers in rank order, this rank left out).
  [[nodiscard]] std::size_t slot_of(int p) const noexcept {
    return static_cast<std::size_t>(p < self().rank() ? p : p - 1);
  }


  /// The size of the pieces a message of `bytes` goes in: in all_reduce and reduce_scatter,
  /// messages a little above the library's eager limit go as several eager ones, which both sides
  /// compute alike from the length. Above the limit OpenMPI's shared memory sends a message by
  /// single copy (the receiver's `process_vm_readv`), whose cost is the host's: on the AMD EPYC
  /// VM of 2026-11-27 a 4 KiB exchange took 1.8 us in pieces against 2.9 whole, on the Intel Xeon
  /// VM of 2026-12-07 the 2-rank all_reduce 2.6 against 3.7 us, but a 4-8 KiB broadcast 1.9-2.5
  /// against 1.4-1.5 (MPI_Bcast 1.3-1.5) and an 8-12 KiB all_gather 2.4-2.6 against 2.1-2.3.
  /// broadcast and all_gather (`whole`) send their messages as the library's own call does, so
  /// that they cost what it costs on any host (benchmarks/RESULTS.md, "The Intel Xeon VM").
  [[nodiscard]] std::size_t piece_of(std::size_t bytes, bool whole) const noexcept {
    if (whole || bytes <= tuning_.eager || bytes > tuning_.pieces_max) return bytes;
    const std::size_t k = (bytes + tuning_.eager - 1) / tuning_.eager;
    return (bytes + k - 1) / k;
  }

  void post_recv(Step& s, void* buf, std::size_t bytes, int peer, int tag, const char* name, std::size_t user = 0) {
    const std::size_t piece = piece_of(bytes, s.whole);
    auto* b = static_cast<std::byte*>(buf);
    for (std::size_t off = 0; off < bytes || off == 0; off += piece) {
      const std::size_t len = std::min(piece, bytes - off);
      MPI_Request r = MPI_REQUEST_NULL;
      COMM_MPI_CHECK(MPI_Irecv(b + off, static_cast<int>(len), MPI_BYTE, peer, tag, self().comm(), &r), name,
                     self().rank());
      s.recvs.push_back(s.reqs.size());
      s.reqs.push_back(r);
      s.info.push_back({peer, len, off + len < bytes ? Step::kSend : user});  // handed over with its last piece
      if (bytes == 0) break;
    }
  }

  void post_send(Step& s, const void* buf, std::size_t bytes, int peer, int tag, const char* name) {
    const std::size_t piece = piece_of(bytes, s.whole);
    const auto* b = static_cast<const std::byte*>(buf);
    for (std::size_t off = 0; off < bytes || off == 0; off += piece) {
      const std::size_t len = std::min(piece, bytes - off);
      MPI_Request r = MPI_REQUEST_NULL;
      COMM_MPI_CHECK(MPI_Isend(b + off, static_cast<int>(len), MPI_BYTE, peer, tag, self().comm(), &r), name,
                     self().rank());
      s.reqs.push_back(r);
      s.info.push_back({peer, Step::kSend, 0});
      if (bytes == 0) break;
    }
  }

  /// A received message of another length than expected: the ranks called with different counts.
  void check_length(const Step& s, std::size_t i, const MPI_Status& st, const char* name) {
    const Step::Info& m = s.info[i];
    const std::size_t got = received_bytes(st, name);
    if (got != m.expect)
      throw BackendError(name, self().rank(),
                         "rank " + std::to_string(m.peer) + " sent " + std::to_string(got) + " bytes where " +
                             std::to_string(m.expect) +
                             " were expected: the ranks called this operation with different counts",
                         std::to_string(m.peer));
  }

  /// A failed MPI_Test (of request `i`) or MPI_Testall (`i` = the count: look in every status) of
  /// step `s`. A receive shorter than the peer's message (ranks that called with different counts)
  /// is said so, naming the peer; else MPI's error.
  [[noreturn]] void step_failed(const Step& s, int rc, std::size_t i, const char* call, const char* name) {
    const bool one = i < s.reqs.size();
    // MPI_Testall's statuses hold the requests' errors only with MPI_ERR_IN_STATUS.
    if (!one && rc != MPI_ERR_IN_STATUS) throw_mpi_error(rc, call, name, self().rank());
    for (std::size_t j = one ? i : 0; j < (one ? i + 1 : s.reqs.size()); ++j) {
      const int e = one ? rc : s.status[j].MPI_ERROR;
      if (e == MPI_SUCCESS || e == MPI_ERR_PENDING) continue;
      int cls = MPI_SUCCESS;
      if (MPI_Error_class(e, &cls) == MPI_SUCCESS && cls == MPI_ERR_TRUNCATE && s.info[j].expect != Step::kSend)
        throw EngineError(e, name, self().rank(),
                          "rank " + std::to_string(s.info[j].peer) + " sent more than the " +
                              std::to_string(s.info[j].expect) +
                              " bytes expected: the ranks called this operation with different counts (" + call +
                              ": " + error_text(e) + ")");
      throw_mpi_error(e, call, name, self().rank());
    }
    throw_mpi_error(rc, call, name, self().rank());
  }

  /// The bytes a completed receive of MPI_BYTE got. OpenMPI and MPICH keep it in their status as
  /// bytes (`_ucount`; `count_lo` and the high bits of `count_hi_and_cancelled`, as their
  /// MPI_Get_count reads it); reading it here saves MPI_Get_count's call and checks (~80
  /// instructions a receive, on the path between a message's arrival and the call's return).
  /// Other libraries: MPI_Get_count.
  std::size_t received_bytes(const MPI_Status& st, const char* name) const {
#if defined(OPEN_MPI)
    (void)name;
    return st._ucount;
#elif defined(MPICH)
    (void)name;
    return static_cast<std::size_t>(static_cast<unsigned>(st.count_lo)) |
           (static_cast<std::size_t>(static_cast<unsigned>(st.count_hi_and_cancelled) >> 1) << 32);
#else
    int got = 0;
    COMM_MPI_CHECK(MPI_Get_count(&st, MPI_BYTE, &got), name, self().rank());
    return static_cast<std::size_t>(got);
#endif
  }

  void finish_step(Step& s, const char* name, std::uint64_t seq, Deadline& deadline) {
    finish_step(s, name, seq, deadline, static_cast<void (*)(std::size_t)>(nullptr));
  }

  /// Waits for every request of `s` by the deadline (poll: failure notices are looked for while
  /// waiting). With `on_recv`, each receive is handed to it (its `user` value) as soon as it and
  /// every receive posted before it completed. A Timeout names the first peer whose message did not
  /// arrive, else the first that did not take this rank's; a message of another length than
  /// expected is a BackendError naming its sender.
  template <class OnRecv>
  void finish_step(Step& s, const char* name, std::uint64_t seq, Deadline& deadline, OnRecv&& on_recv) {
    constexpr bool in_order = !std::is_same_v<std::decay_t<OnRecv>, void (*)(std::size_t)>;
    std::size_t next = 0;  // in_order: receives handed over so far
    int all = 0;
    // on_recv may post more requests: the statuses follow (in order only; otherwise once here).
    auto fit = [&] {
      if (s.status.size() < s.reqs.size()) s.status.resize(s.reqs.size());
    };
    fit();
    auto test = [&] {
      if constexpr (in_order) {
        while (next < s.recvs.size()) {
          fit();
          const std::size_t i = s.recvs[next];
          int done = 0;
          if (const int rc = MPI_Test(&s.reqs[i], &done, &s.status[i]); rc != MPI_SUCCESS)
            step_failed(s, rc, i, "MPI_Test", name);
          if (done == 0) return false;
          check_length(s, i, s.status[i], name);
          if (s.info[i].user != Step::kSend) on_recv(s.info[i].user);
          ++next;
        }
        fit();
      }
      if (const int rc = MPI_Testall(static_cast<int>(s.reqs.size()), s.reqs.data(), &all, s.status.data());
          rc != MPI_SUCCESS)
        step_failed(s, rc, s.reqs.size(), "MPI_Testall", name);
      return all != 0;
    };
    if (!test() && !poll(test, [&] { self().look_out(name); }, deadline)) {
      self().leaked_ = true;
      // The first receive still pending, else the first send.
      std::size_t late = s.reqs.size();
      for (const bool sends : {false, true})
        for (std::size_t i = 0; i < s.reqs.size() && late == s.reqs.size(); ++i) {
          if ((s.info[i].expect == Step::kSend) != sends) continue;
          int done = 0;
          MPI_Request_get_status(s.reqs[i], &done, MPI_STATUS_IGNORE);
          if (done == 0) late = i;
        }
      const std::string peer = late < s.reqs.size() ? std::to_string(s.info[late].peer) : std::string();
      const std::string what = late == s.reqs.size()                   ? std::string("its messages did not complete")
                               : s.info[late].expect != Step::kSend ? "no data from rank " + peer + " arrived"
                                                                : "rank " + peer + " did not take this rank's data";
      throw Timeout(name, self().rank(),
                    "op #" + std::to_string(seq) + " did not complete within " +
                        std::to_string(self().timeout().count()) + " ms: " + what +
                        " (a rank is late, hung, or did not call it). Its MPI requests stay pending (MPI may still "
                        "read and write this operation's buffers if the peers arrive later) and this communicator "
                        "is unusable",
                    peer);
    }
    if constexpr (!in_order)
      for (const std::size_t i : s.recvs) check_length(s, i, s.status[i], name);
    s.clear();
  }

  /// The receive buffer of a schedule: `count` slots of at least `bytes` bytes. It lives in
  /// pending_, which a failure leaks with the requests that may still write it.
  ///
  /// `placed` slots have a line to spare, and one whose data is reduced into `dst` starts at the
  /// same offset within a cache line as `dst` (`at(i, dst)`): the reduction's loads and stores
  /// then cross lines alike. Only all_reduce under OpenMPI (Tuning::place_slots), where a message
  /// is read by single copy and reduced by the library's AVX-512 loop: a 2-rank 1 MiB all_reduce
  /// of a std::vector (16 bytes past a page) took 1.12-1.16x MPI_Allreduce with its chunks on line
  /// starts and 0.95-0.97x placed so, whatever the page offset between them. A reduce_scatter,
  /// whose output this rank has just written, took 1.00-1.05x its line starts' time placed, and
  /// MPICH (which copies a message out of its cells) 1.02-1.03x at 1-4 MiB (benchmarks/RESULTS.md,
  /// "Mpi: receive slots placed like the output"). Other slots start on a line: an earlier layout
  /// that put a chunk 4 bytes past one took 178 us against 111 on one ("Mpi: receive slots on
  /// cache lines").
  struct Slots {
    std::byte* base;
    std::size_t stride;
    bool placed;
    [[nodiscard]] std::byte* at(std::size_t i) const noexcept { return base + i * stride; }
    [[nodiscard]] std::byte* at(std::size_t i, const void* dst) const noexcept {
      return at(i) + (placed ? reinterpret_cast<std::uintptr_t>(dst) % kSlotAlign : 0);
    }
  };
  Slots recv_slots(std::size_t count, std::size_t bytes, bool placed = false) {
    const std::size_t stride = (bytes + (placed ? 2 : 1) * kSlotAlign - 1) / kSlotAlign * kSlotAlign;
    auto& b = self().pending_->recv;
    if (b.size() < count * stride + kSlotAlign) b.resize(count * stride + kSlotAlign);
    const auto misaligned = reinterpret_cast<std::uintptr_t>(b.data()) % kSlotAlign;
    return {b.data() + (misaligned == 0 ? 0 : kSlotAlign - misaligned), stride, placed};
  }

  /// (The slots' alignment slack on top of kScratchKeep is kept too: a whole 8 MiB block's slot
  /// given back after every operation cost a zero-filled 8 MiB at the next, 1.03-1.07x against
  /// 0.90-0.99x the blocking call for a 2-rank 16 MiB reduce_scatter under MPICH.)
  void release_slots() {
    auto& b = self().pending_->recv;
    if (b.capacity() > kScratchKeep + kSlotAlign) std::vector<std::byte>().swap(b);
  }

  /// The end of a reduction schedule of `count` elements: the scratch given back, then the
  /// reduction's finish (avg).
  void finish_reduction(Op& op, std::size_t count) {
    release_slots();
    if (op.finish != nullptr) op.finish(op.out, count, self().size());
  }

  /// all_reduce, reduce_scatter, all_gather and broadcast as comm's direct schedules over
  /// point-to-point messages on the data communicator (see the file comment).
  void run_own(Op& op, std::uint64_t seq, Deadline& deadline) {
    const char* name = op_name(op.desc.kind);
    const std::size_t es = op.elem_size;
    const int me = self().rank(), n = self().size();
    Step& s = self().pending_->step;
    s.clear();
    switch (op.desc.kind) {
      case OpKind::all_reduce: {
        const std::size_t count = op.out_count;
        if (count == 0) return;
        const Reduction red = self().reduction(op);
        auto* out = static_cast<std::byte*>(op.out);
        const std::byte* in = op.in == nullptr ? out : static_cast<const std::byte*>(op.in);
        const std::size_t bytes = count * es;
        if (bytes <= tuning_.exchange_max) {
          // Every rank sends its whole input to every other, then reduces all inputs in rank order
          // (the same order on every rank, so every rank has the same result).
          const Slots slots = recv_slots(static_cast<std::size_t>(n), bytes);
          for (int p = 0; p < n; ++p)
            if (p != me) post_send(s, in, bytes, p, kStepTag, name);
          for (int p = 0; p < n; ++p)
            if (p != me) post_recv(s, slots.at(slot_of(p)), bytes, p, kStepTag, name);
          finish_step(s, name, seq, deadline);
          if (n == 2) {
            // a (op) b == b (op) a bit for bit (the ops are commutative): no order to keep.
            if (in != out) copy_bytes(out, in, bytes);
            reduce_local(slots.at(0), out, count, red, name);
            return finish_reduction(op, count);
          }
          // In place, this rank's input is the output: keep it in the last slot before reducing.
          const std::byte* own = in;
          if (in == out && me != 0) {
            copy_bytes(slots.at(static_cast<std::size_t>(n - 1)), in, bytes);
            own = slots.at(static_cast<std::size_t>(n - 1));
          }
          auto src = [&](int p) { return p == me ? own : slots.at(slot_of(p)); };
          if (src(0) != out) copy_bytes(out, src(0), bytes);
          for (int p = 1; p < n; ++p) reduce_local(src(p), out, count, red, name);
        } else {
          // Direct reduce-scatter: block j of every input goes to rank j, which reduces it...
          const std::size_t lo = block_lo(count, me), len = block_lo(count, me + 1) - lo;
          if (in != out) copy_bytes(out + lo * es, in + lo * es, len * es);
          reduce_step(in, [&](int p) { return std::pair{block_lo(count, p), block_lo(count, p + 1) - block_lo(count, p)}; },
                      out + lo * es, len, es, red, name, seq, deadline, tuning_.place_slots);
          // ... then a direct all-gather of the reduced blocks (after every send of the first step
          // completed: in place, those read the blocks now received).
          for (int p = 0; p < n; ++p)
            if (p != me) post_send(s, out + lo * es, len * es, p, kGatherTag, name);
          for (int p = 0; p < n; ++p) {
            if (p == me) continue;
            const std::size_t plo = block_lo(count, p), plen = block_lo(count, p + 1) - plo;
            post_recv(s, out + plo * es, plen * es, p, kGatherTag, name);
          }
          finish_step(s, name, seq, deadline);
        }
        return finish_reduction(op, count);
      }
      case OpKind::reduce_scatter: {
        const std::size_t block = op.out_count;
        if (block == 0) return;
        const Reduction red = self().reduction(op);
        const std::size_t bytes = block * es;
        const auto* in = static_cast<const std::byte*>(op.in);
        auto* out = static_cast<std::byte*>(op.out);
        const std::byte* own = in + static_cast<std::size_t>(me) * bytes;
        if (own != out) copy_bytes(out, own, bytes);  // the output is never a block another rank reads
        reduce_step(in, [&](int p) { return std::pair{block * static_cast<std::size_t>(p), block}; }, out, block, es,
                    red, name, seq, deadline);
        return finish_reduction(op, block);
      }
      case OpKind::all_gather: {
        const std::size_t block = op.in_count;
        if (block == 0) return;
        const std::size_t bytes = block * es;
        auto* out = static_cast<std::byte*>(op.out);
        std::byte* mine = out + static_cast<std::size_t>(me) * bytes;
        const auto* in = static_cast<const std::byte*>(op.in);
        // A small own block is copied while the messages travel, a large one (Tuning::copy_after)
        // after them: MPICH moves a large message through its shared-memory cells while both
        // ranks make progress, and the copy beside it held a 2-rank 1 MiB all_gather at 75-77 us
        // against 56-58 after it (benchmarks/RESULTS.md, "Mpi all_gather: the own block after the
        // exchange"). OpenMPI reads a large message by single copy, and there the copy beside it
        // was the same on the AMD VM and ahead on the Intel Xeon VM (1 MiB: 1.01-1.04x the
        // blocking call against 1.07-1.09x after; "The Intel Xeon VM", last part), so under
        // OpenMPI it always goes beside. From Tuning::copy_first it is copied before anything is
        // posted (and sent from there), as MPICH's own MPI_Allgather does: after the exchange a
        // 16 MiB all_gather spread over 0.90-1.29x the blocking call under MPICH, before it
        // 0.98-1.06x.
        if (bytes >= tuning_.copy_first && in != mine) {
          copy_bytes(mine, in, bytes);
          in = mine;
        }
        const bool copy_after = bytes >= tuning_.copy_after;
        s.whole = true;
        for (int p = 0; p < n; ++p)
          if (p != me) post_send(s, in, bytes, p, kStepTag, name);
        for (int p = 0; p < n; ++p)
          if (p != me) post_recv(s, out + static_cast<std::size_t>(p) * bytes, bytes, p, kStepTag, name);
        if (!copy_after && in != mine) copy_bytes(mine, in, bytes);
        finish_step(s, name, seq, deadline);
        if (copy_after && in != mine) copy_bytes(mine, in, bytes);
        return;
      }
      case OpKind::broadcast: {
        const std::size_t bytes = op.out_count * es;
        if (bytes == 0) return;
        const int root = op.desc.root;
        s.whole = true;
        if (n >= 3 && bytes >= tuning_.broadcast_parts)
          return broadcast_parts(static_cast<std::byte*>(op.out), bytes, root, name, seq, deadline);
        if (me == root) {
          for (int p = 0; p < n; ++p)
            if (p != me) post_send(s, op.out, bytes, p, kStepTag, name);
        } else {
          post_recv(s, op.out, bytes, root, kStepTag, name);
        }
        finish_step(s, name, seq, deadline);
        return;
      }
      case OpKind::barrier: {
        // Dissemination: in round r every rank tells the rank 2^r after it that it has come this
        // far and waits for the word of the rank 2^r before it; after ceil(log2 n) rounds each
        // has heard, directly or through others, from every rank. MPI_Ibarrier polled took 0.60
        // us at 2 ranks under OpenMPI (MPI_Barrier 0.39) and 0.70 under MPICH; these rounds 0.45
        // and 0.49 (benchmarks/RESULTS.md, "Mpi: the barrier over empty messages").
        for (int d = 1; d < n; d *= 2) {
          post_send(s, nullptr, 0, (me + d) % n, kBarrierTag, name);
          post_recv(s, nullptr, 0, (me - d + n) % n, kBarrierTag, name);
          finish_step(s, name, seq, deadline);
        }
        return;
      }
      default: throw BackendError(name, self().rank(), "not an operation of comm's own MPI schedules");
    }
  }

  /// A large broadcast on 3 or more ranks (under OpenMPI: Tuning::broadcast_parts): the root sends
  /// its buffer to every reader in m parts (about kPart bytes each, at least one per reader),
  /// reader j (the j-th after the root) taking them from part j * m / (n - 1) on, round to the one
  /// before it, so that the readers do not all read the same part at once. A single copy between
  /// processes has the kernel pin each page of the root's buffer that it reads, and the readers of
  /// one whole message pinned the same pages at the same moment, each page's counters moving
  /// between the cores. On the Intel Xeon VM of 2026-12-07, 8 rounds beside MPI_Bcast under
  /// OpenMPI, in parts against whole: 3 ranks 1 / 4 / 16 MiB 171 / 511 / 2159 us against 268 / 966
  /// / 3568 (0.70 / 0.49 / 0.72x MPI_Bcast against 0.99-1.01x), 4 ranks 256 KiB / 1 / 4 / 16 MiB
  /// 0.83 / 1.05 / 1.07 / 0.98x against 1.02 / 1.14 / 1.16 / 1.12x; from 32 to 128 KiB the extra
  /// messages cost more than they saved (benchmarks/RESULTS.md, "Mpi: a large broadcast in parts
  /// read in turn"). Before any part the root sends each reader its size on kCountTag, and each
  /// reader compares it with its own, so that ranks with different counts get a BackendError
  /// naming the root (parts alike in length would otherwise go unnoticed); the root's parts then
  /// go unread, and the root fails by the readers' notice or at its deadline.
  void broadcast_parts(std::byte* buf, std::size_t bytes, int root, const char* name, std::uint64_t seq,
                       Deadline& deadline) {
    const int me = self().rank(), n = self().size();
    const auto readers = static_cast<std::size_t>(n - 1);
    std::size_t m = std::clamp<std::size_t>((bytes + kPart - 1) / kPart, readers, kPartsMax);
    const std::size_t part = (bytes + m - 1) / m;
    m = (bytes + part - 1) / part;  // the last part may be short, and a part of nothing is not sent
    auto in_turn = [&](int reader, auto&& post) {
      const std::size_t first = static_cast<std::size_t>((reader - root + n) % n - 1) * m / readers;
      for (std::size_t i = 0; i < m; ++i) {
        const std::size_t at = (first + i) % m * part;
        post(buf + at, std::min(part, bytes - at));
      }
    };
    Step& s = self().pending_->step;
    // The size a rank sends or receives lies in a slot, which outlives a request left pending.
    std::byte* const size = recv_slots(1, sizeof(std::uint64_t)).at(0);
    const auto mine = static_cast<std::uint64_t>(bytes);
    if (me == root) {
      std::memcpy(size, &mine, sizeof mine);
      for (int p = 0; p < n; ++p) {
        if (p == me) continue;
        post_send(s, size, sizeof mine, p, kCountTag, name);
        in_turn(p, [&](std::byte* at, std::size_t len) { post_send(s, at, len, p, kStepTag, name); });
      }
      finish_step(s, name, seq, deadline);
      return;
    }
    post_recv(s, size, sizeof mine, root, kCountTag, name);
    finish_step(s, name, seq, deadline);
    check_size(size, mine, root, "broadcast", name);
    s.clear();
    s.whole = true;
    in_turn(me, [&](std::byte* at, std::size_t len) { post_recv(s, at, len, root, kStepTag, name); });
    finish_step(s, name, seq, deadline);
  }

  /// A direct reduce-scatter step: `in`'s block of each peer p (`block_of(p)`: first element and
  /// length) goes to p, and the peers' contributions to this rank's block (`len` elements) are
  /// reduced into `acc`, which holds this rank's own. Each peer's block goes in chunks of about
  /// kChunk bytes (a block up to Tuning::whole_max as one), received into kDepth slots per peer
  /// that are reused as the chunks are reduced (bounded scratch, kept between operations; each
  /// chunk reduced while still in cache), the peers in rank order within every chunk: every
  /// element is reduced in the same order. `placed`: the slots are placed like `acc` (recv_slots).
  template <class BlockOf>
  void reduce_step(const std::byte* in, BlockOf&& block_of, std::byte* acc, std::size_t len, std::size_t es,
                   const Reduction& red, const char* name, std::uint64_t seq, Deadline& deadline,
                   bool placed = false) {
    const int me = self().rank(), n = self().size();
    const auto un = static_cast<std::size_t>(n);
    Step& s = self().pending_->step;
    auto chunks = [&](std::size_t elems) {
      const std::size_t bytes = elems * es;
      return bytes <= tuning_.whole_max ? 1 : std::max<std::size_t>(1, (bytes + kChunk - 1) / kChunk);
    };
    const std::size_t nc = chunks(len);
    const std::size_t depth = std::min(nc, kDepth);
    const std::size_t chunk_bytes = (len + nc - 1) / nc * es;  // the largest chunk: exactly a whole block
    const Slots slots = recv_slots((un - 1) * depth, chunk_bytes, placed);
    // Each chunk placed like its part of `acc`, into which it is reduced.
    auto slot = [&](int p, std::size_t c) {
      return slots.at(slot_of(p) * depth + c % depth, acc + len * c / nc * es);
    };
    auto post = [&](std::size_t c, int p) {
      const std::size_t clo = len * c / nc, clen = len * (c + 1) / nc - clo;
      post_recv(s, slot(p, c), clen * es, p, kStepTag, name, c * un + static_cast<std::size_t>(p));
    };
    for (std::size_t c = 0; c < depth; ++c)
      for (int p = 0; p < n; ++p)
        if (p != me) post(c, p);
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      const auto [plo, plen] = block_of(p);
      const std::size_t pc = chunks(plen);
      for (std::size_t c = 0; c < pc; ++c) {
        const std::size_t clo = plen * c / pc, clen = plen * (c + 1) / pc - clo;
        post_send(s, in + (plo + clo) * es, clen * es, p, kStepTag, name);
      }
    }
    // Handed over in the order posted: chunk by chunk, the peers in rank order within each.
    finish_step(s, name, seq, deadline, [&](std::size_t u) {
      const std::size_t c = u / un;
      const int p = static_cast<int>(u % un);
      const std::size_t clo = len * c / nc, clen = len * (c + 1) / nc - clo;
      reduce_local(slot(p, c), acc + clo * es, clen, red, name);
      if (c + depth < nc) post(c + depth, p);  // into the slot just freed
    });
  }

  /// inout = in (op) inout over `count` elements, by MPI's own op or the slot op (comm's kernel).
  void reduce_local(const std::byte* in, std::byte* inout, std::size_t count, const Reduction& red, const char* name) {
    COMM_MPI_CHECK(MPI_Reduce_local(in, inout, static_cast<int>(count), red.type, red.op), name, self().rank());
  }

  Tuning tuning_;

 private:
  [[nodiscard]] Engine& self() noexcept { return static_cast<Engine&>(*this); }
  [[nodiscard]] const Engine& self() const noexcept { return static_cast<const Engine&>(*this); }
};

}  // namespace comm::detail::mpi
