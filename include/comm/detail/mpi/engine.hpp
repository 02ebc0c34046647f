#pragma once
// The MPI engine behind comm::backends::Mpi: three MPI communicators of its own (a data one for the
// collectives, a control one for subgroup creation and failure notices, and one for
// point-to-point messages, so that they never match a collective's) and the MPI calls.
// Everything else — issue order, async Work, the flight recorder, the desync check,
// monitored_barrier, failure state — is the engine core's (detail/engine/core.hpp).
//
// comm's own schedules (run_own, detail/mpi/schedules.hpp): on 2..kOwnMaxRanks ranks, all_reduce,
// reduce_scatter, all_gather and broadcast are point-to-point messages on the data communicator.
//
// Every other collective is MPI's non-blocking one (MPI_Iallreduce, MPI_Ireduce_scatter_block,
// MPI_Iallgather, MPI_Ibcast, MPI_Igather, MPI_Ireduce, MPI_Iscatter, MPI_Ialltoall,
// MPI_Ialltoallv, MPI_Ibarrier) polled with MPI_Test until it completes or
// the operation's deadline passes: spinning for the first kSpinFor (as MPI's own blocking calls
// do; OpenMPI's progress yields by itself when mpirun oversubscribes the cores), then sched_yield
// between tests, then short sleeps once the operation is clearly waiting for a late peer. MPI cannot cancel a collective: after a Timeout the request stays pending — MPI may
// still read the inputs and write the outputs if the peers arrive later — and the communicator is
// unusable. Its MPI communicators, datatypes and the request are then deliberately leaked.
//
// Failure notices: the rank that fails first (Timeout, MPI error, Work::wait abort) sends a short
// text to every peer on the control communicator; a rank whose operation has waited for more than
// kLookEvery probes for one and fails with comm::RemoteError naming that rank and its cause,
// instead of waiting for its own deadline.
//
// Tags on the control communicator: MPI_Comm_create_group's (1 .. kTagSpan), the store-less
// new_group gate's (kGateTagBase ..), the notices' (kNoticeTag); the data communicator carries
// collectives and the own schedules' messages.
//
// Point-to-point (send, recv, batch_isend_irecv): each message is a 32-byte header (p2p.hpp: kind,
// element type, count, the user's tag, the message number of the pair) on tag kHeaderTag of the
// point-to-point communicator, with a payload of up to kPackMax bytes behind it in the same MPI
// message; a larger payload follows on kPayloadTag (in pieces of at most INT_MAX elements). A
// receiver posts room for a header and kPackMax bytes whatever it expects, so a sender whose count
// differs still lands whole and its header names the mismatch. The user's tag travels in the header, never as an MPI tag
// (so any tag >= 0 works, and MPI's ordering of one (source, tag) keeps the pair's messages in the
// order they were sent). Every receive's header and every send are posted before anything is
// waited for (a batch that exchanges in both directions cannot deadlock); a payload receive is
// posted only once its header checked out (check_p2p_header: a mismatch is comm::DesyncError,
// never a payload written past a buffer), each peer's headers in the order posted and the peers'
// as they come (a receive whose sender waits on another peer must not hold up that peer's). Like
// a collective, a point-to-point operation that times out leaves its requests pending (leaked).

#include <mpi.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <thread>
#include <utility>
#include <vector>

#include <comm/detail/base/copy.hpp>
#include <comm/detail/diagnostics/desync.hpp>
#include <comm/detail/engine/core.hpp>
#include <comm/detail/diagnostics/flight_recorder.hpp>
#include <comm/detail/mpi/comms.hpp>
#include <comm/detail/mpi/errors.hpp>
#include <comm/detail/mpi/runtime.hpp>
#include <comm/detail/mpi/schedules.hpp>
#include <comm/detail/mpi/types.hpp>
#include <comm/detail/mpi/wait.hpp>
#include <comm/detail/engine/narrow.hpp>
#include <comm/error.hpp>
#include <comm/store.hpp>
#include <comm/types.hpp>

namespace comm::detail::mpi {

class Engine : public EngineCore<Engine>, OwnSchedules<Engine> {
  using Core = EngineCore<Engine>;
  using Clock = std::chrono::steady_clock;

 public:
  /// Largest element count of one MPI call (MPI counts are int). all_reduce and broadcast go in
  /// chunks above it; the backend refuses larger per-rank blocks for the other operations.
  static constexpr std::size_t kMaxCount = static_cast<std::size_t>(INT_MAX);
  static constexpr int kTagSpan = 9999;
  static constexpr int kGateTagBase = 10000;
  static constexpr int kNoticeTag = 32000;  // MPI guarantees tags up to 32767
  /// Tags on the point-to-point communicator (see the file comment).
  static constexpr int kHeaderTag = 1;
  static constexpr int kPayloadTag = 2;
  /// Payloads up to this size travel in the header's message: one MPI message instead of two. It
  /// stays under both libraries' eager limits on one node with the header (OpenMPI's vader 4 KiB,
  /// MPICH 8 KiB), so a send still never waits for its receiver (benchmarks/RESULTS.md, "Mpi
  /// point-to-point: the payload in the header's message").
  static constexpr std::size_t kPackMax = 2048;

  /// MPI_Comm_create_group's tag of subgroup number `k`.
  [[nodiscard]] static int group_tag(std::uint64_t k) noexcept { return 1 + static_cast<int>(k % kTagSpan); }

  /// A communicator over `store` (membership check first, then the MPI communicators).
  Engine(std::shared_ptr<comm::Store> store, int rank, int size, const CoreConfig& cfg, const CommSource& src)
      : Core(std::move(store), rank, size, cfg, "mpi"), p2p_numbers_(size) {
    connect(src);
  }

  /// A communicator without a store (adopted, or a subgroup of an adopted one).
  Engine(int rank, int size, const CoreConfig& cfg, std::string name, const CommSource& src)
      : Core(rank, size, cfg, "mpi", std::move(name)), p2p_numbers_(size) {
    connect(src);
  }

  ~Engine() {
    shutdown();
    if (!initialized() || finalized()) return;  // MPI is gone: so are its objects
    if (has_failed() || leaked_) {
      // A pending request may still use the communicators, the datatypes, the slot and the
      // point-to-point headers / all_to_all_v counts.
      (void)slot_.release();
      (void)pending_.release();
      return;
    }
    for (auto& t : types_)
      if (t != MPI_DATATYPE_NULL) MPI_Type_free(&t);
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
    if (p2p_ != MPI_COMM_NULL) MPI_Comm_free(&p2p_);
    // The control communicator is never freed: a peer that fails after this rank is done (a
    // receiver whose header check fails once this rank's send returned, a peer that times out
    // later) still sends its failure notice here, and OpenMPI hands a message for a freed
    // communicator to the next communicator that reuses its context id (a spurious RemoteError
    // there, or a crash when that one is smaller). One communicator handle per destroyed
    // communicator; MPI_Finalize releases them.
  }

  /// The data communicator (collectives only).
  [[nodiscard]] MPI_Comm comm() const noexcept { return comm_; }
  /// The control communicator (subgroup creation, notices).
  [[nodiscard]] MPI_Comm control() const noexcept { return ctl_; }
  /// The point-to-point communicator (send, recv, batch_isend_irecv).
  [[nodiscard]] MPI_Comm point_to_point() const noexcept { return p2p_; }
  /// Whether MPI runs at MPI_THREAD_MULTIPLE (needed for async operations).
  [[nodiscard]] bool multi_threaded() const noexcept { return thread_level_ >= MPI_THREAD_MULTIPLE; }
  [[nodiscard]] int thread_level() const noexcept { return thread_level_; }

  /// new_group on a communicator without a store: the members meet on the control communicator
  /// (rank members[0] collects the others) before MPI_Comm_create_group, which has no deadline, so
  /// a member that does not come is a comm::Timeout naming it instead of a hang. Members only.
  void gate(std::span<const int> members, std::uint64_t k) {
    static constexpr const char* op = "new_group";
    if (members.size() <= 1) return;
    const int tag = kGateTagBase + static_cast<int>(k % kTagSpan);
    auto deadline = Deadline::from_now(timeout());
    // Send buffers in static storage: a freed send request may complete after this returns.
    static const int kHere = 1, kGo = 1, kStop = 0;
    const int leader = members[0];
    if (rank() == leader) {
      const std::size_t m = members.size() - 1;
      std::vector<int> got(m, 0);
      std::vector<MPI_Request> reqs(m, MPI_REQUEST_NULL);
      for (std::size_t j = 0; j < m; ++j)
        COMM_MPI_CHECK(MPI_Irecv(&got[j], 1, MPI_INT, members[j + 1], tag, ctl_, &reqs[j]), op, rank());
      int all = 0;
      const bool done = poll([&] {
        COMM_MPI_CHECK(MPI_Testall(static_cast<int>(m), reqs.data(), &all, MPI_STATUSES_IGNORE), op, rank());
        return all != 0;
      }, [] {}, deadline);
      if (done) {
        for (std::size_t j = 0; j < m; ++j) send_and_forget(&kGo, members[j + 1], tag, op);
        return;
      }
      std::string missing;
      std::string first;
      for (std::size_t j = 0; j < m; ++j) {
        // (MPI_Testall leaves every request as it was unless all completed: look at each.)
        int arrived = 0;
        MPI_Status st;
        MPI_Test(&reqs[j], &arrived, &st);
        if (arrived == 0) {
          MPI_Cancel(&reqs[j]);
          MPI_Wait(&reqs[j], &st);
          int cancelled = 0;
          MPI_Test_cancelled(&st, &cancelled);
          arrived = cancelled == 0;  // matched before the cancel took effect
        }
        if (arrived != 0) {  // tell it to give up at once
          send_and_forget(&kStop, members[j + 1], tag, op);
          continue;
        }
        const std::string r = std::to_string(members[j + 1]);
        if (first.empty()) first = r;
        missing += (missing.empty() ? "" : ", ") + r;
      }
      throw Timeout(op, rank(),
                    std::string(missing.find(',') == std::string::npos ? "rank " : "ranks ") + missing +
                        " of this communicator did not reach new_group within " + std::to_string(timeout().count()) +
                        " ms",
                    first);
    }
    send_and_forget(&kHere, leader, tag, op);
    int verdict = -1;
    MPI_Request r = MPI_REQUEST_NULL;
    COMM_MPI_CHECK(MPI_Irecv(&verdict, 1, MPI_INT, leader, tag, ctl_, &r), op, rank());
    int flag = 0;
    const bool done = poll([&] {
      COMM_MPI_CHECK(MPI_Test(&r, &flag, MPI_STATUS_IGNORE), op, rank());
      return flag != 0;
    }, [] {}, deadline);
    if (!done) {
      MPI_Cancel(&r);
      MPI_Wait(&r, MPI_STATUS_IGNORE);
      throw Timeout(op, rank(),
                    "rank " + std::to_string(leader) + " (the group's first member) did not answer within " +
                        std::to_string(timeout().count()) + " ms",
                    std::to_string(leader));
    }
    if (verdict != kGo)
      throw Timeout(op, rank(),
                    "rank " + std::to_string(leader) +
                        " (the group's first member) reports that another member did not reach new_group in time",
                    std::to_string(leader));
  }

 private:
  friend Core;
  friend OwnSchedules<Engine>;

  static constexpr std::size_t kNoticeMax = 1000;  // bytes: small enough for MPI's eager protocol

  // ---- the engine calls the core makes ----

  void perform(Op& op, std::uint64_t seq) {
    try {
      run_collective(op, seq);
    } catch (const std::bad_alloc&) {
      out_of_memory(op_name(op.desc.kind));
    }
  }

  /// A failed allocation while this operation's requests may be posted: a std::bad_alloc would
  /// pass the core as it is and leave the communicator usable, with MPI still writing into this
  /// engine's buffers; as a BackendError it fails the communicator, which keeps them alive.
  [[noreturn]] void out_of_memory(const char* name) {
    leaked_ = true;
    throw BackendError(name, rank(),
                       "out of memory while this operation's MPI requests were posted: they stay pending and this "
                       "communicator is unusable");
  }

  void run_collective(Op& op, std::uint64_t seq) {
    const char* name = op_name(op.desc.kind);
    Deadline deadline(timeout());
    const std::size_t es = op.elem_size;
    const int root = op.desc.root;  // rooted operations only
    const bool is_root = rank() == root;
    if (own_schedule(op)) return run_own(op, seq, deadline);
    switch (op.desc.kind) {
      case OpKind::all_reduce: {
        if (op.out_count == 0) return;
        if (library_all_reduce(op)) check_count(op.out_count * es, name, seq, deadline);
        const Reduction red = reduction(op);
        const bool in_place = op.in == op.out;
        in_pieces(op.out_count, "MPI_Iallreduce", name, seq, deadline, [&](std::size_t done, int n, MPI_Request* req) {
          const std::size_t off = done * es;
          return MPI_Iallreduce(in_place ? MPI_IN_PLACE : static_cast<const std::byte*>(op.in) + off,
                                static_cast<std::byte*>(op.out) + off, n, red.type, red.op, comm_, req);
        });
        if (op.finish != nullptr) op.finish(op.out, op.out_count, size());
        return;
      }
      case OpKind::reduce_scatter: {
        if (op.out_count == 0) return;
        const Reduction red = reduction(op);
        const std::size_t bytes = op.out_count * es;
        // In place (the output is this rank's block of the input): MPI_IN_PLACE would put the
        // result at the start of the input and may use the rest as scratch, so the result goes to
        // scratch and is copied to the block; the input is only read.
        const bool in_place = is_block(op.out, op.in, rank(), bytes);
        void* recv = op.out;
        if (in_place) {
          if (scratch_.size() < bytes) scratch_.resize(bytes);
          recv = scratch_.data();
        }
        const int n = narrow_count(name, rank(), op.out_count);
        collective("MPI_Ireduce_scatter_block", name, seq, deadline, [&](MPI_Request* req) {
          return MPI_Ireduce_scatter_block(op.in, recv, n, red.type, red.op, comm_, req);
        });
        if (in_place) {
          copy_bytes(op.out, recv, bytes);
          if (scratch_.capacity() > kScratchKeep) std::vector<std::byte>().swap(scratch_);
        }
        if (op.finish != nullptr) op.finish(op.out, op.out_count, size());
        return;
      }
      case OpKind::all_gather:
      case OpKind::split: {
        if (op.in_count == 0) return;
        const MPI_Datatype type = type_of(op);
        const bool in_place = is_block(op.in, op.out, rank(), op.in_count * es);
        const int n = narrow_count(name, rank(), op.in_count);
        collective("MPI_Iallgather", name, seq, deadline, [&](MPI_Request* req) {
          return MPI_Iallgather(in_place ? MPI_IN_PLACE : op.in, n, type, op.out, n, type, comm_, req);
        });
        return;
      }
      case OpKind::broadcast: {
        if (op.out_count == 0) return;
        const MPI_Datatype type = type_of(op);
        in_pieces(op.out_count, "MPI_Ibcast", name, seq, deadline, [&](std::size_t done, int n, MPI_Request* req) {
          return MPI_Ibcast(static_cast<std::byte*>(op.out) + done * es, n, type, root, comm_, req);
        });
        return;
      }
      case OpKind::gather: {
        if (op.in_count == 0) return;
        const MPI_Datatype type = type_of(op);
        const bool in_place = is_root && is_block(op.in, op.out, root, op.in_count * es);
        const int n = narrow_count(name, rank(), op.in_count);
        collective("MPI_Igather", name, seq, deadline, [&](MPI_Request* req) {
          return MPI_Igather(in_place ? MPI_IN_PLACE : op.in, n, type, is_root ? op.out : nullptr, n, type, root, comm_,
                             req);
        });
        return;
      }
      case OpKind::reduce: {
        if (op.in_count == 0) return;
        const Reduction red = reduction(op);
        // In place on the root only; off the root the output is not used (and may be empty).
        const bool in_place = is_root && op.in == op.out;
        in_pieces(op.in_count, "MPI_Ireduce", name, seq, deadline, [&](std::size_t done, int n, MPI_Request* req) {
          const std::size_t off = done * es;
          return MPI_Ireduce(in_place ? MPI_IN_PLACE : static_cast<const std::byte*>(op.in) + off,
                             is_root ? static_cast<std::byte*>(op.out) + off : nullptr, n, red.type, red.op, root, comm_,
                             req);
        });
        if (is_root && op.finish != nullptr) op.finish(op.out, op.in_count, size());
        return;
      }
      case OpKind::scatter: {
        if (op.out_count == 0) return;
        const MPI_Datatype type = type_of(op);
        // On the root the output may be its own slice of the input.
        const bool in_place = is_root && is_block(op.out, op.in, root, op.out_count * es);
        const int n = narrow_count(name, rank(), op.out_count);  // the backend refuses larger blocks
        collective("MPI_Iscatter", name, seq, deadline, [&](MPI_Request* req) {
          return MPI_Iscatter(is_root ? op.in : nullptr, n, type, in_place ? MPI_IN_PLACE : op.out, n, type, root, comm_,
                              req);
        });
        return;
      }
      case OpKind::all_to_all: {
        const std::size_t block = op.in_count / static_cast<std::size_t>(size());
        if (block == 0) return;
        const MPI_Datatype type = type_of(op);
        const int n = narrow_count(name, rank(), block);  // the backend refuses larger blocks
        collective("MPI_Ialltoall", name, seq, deadline,
                   [&](MPI_Request* req) { return MPI_Ialltoall(op.in, n, type, op.out, n, type, comm_, req); });
        return;
      }
      case OpKind::all_to_all_v: {
        // int counts and packed displacements (the backend refused any beyond INT_MAX). They live
        // in pending_, which a request left pending after a failure keeps alive.
        const MPI_Datatype type = type_of(op);
        const auto p = static_cast<std::size_t>(size());
        auto& c = pending_->counts;
        c.assign(4 * p, 0);
        int* scounts = c.data();
        int* sdispls = scounts + p;
        int* rcounts = sdispls + p;
        int* rdispls = rcounts + p;
        std::size_t soff = 0, roff = 0;
        for (std::size_t i = 0; i < p; ++i) {
          scounts[i] = narrow_count(name, rank(), op.counts[i]);
          rcounts[i] = narrow_count(name, rank(), op.counts[p + i]);
          sdispls[i] = narrow_count(name, rank(), soff, "displacement");
          rdispls[i] = narrow_count(name, rank(), roff, "displacement");
          soff += op.counts[i];
          roff += op.counts[p + i];
        }
        collective("MPI_Ialltoallv", name, seq, deadline, [&](MPI_Request* req) {
          return MPI_Ialltoallv(op.in, scounts, sdispls, type, op.out, rcounts, rdispls, type, comm_, req);
        });
        return;
      }
      case OpKind::barrier: {
        collective("MPI_Ibarrier", name, seq, deadline, [&](MPI_Request* req) { return MPI_Ibarrier(comm_, req); });
        return;
      }
      default: throw BackendError(name, rank(), "not an operation the MPI engine runs");
    }
  }

  /// Sends and receives of one operation on the point-to-point communicator (see the file
  /// comment): every receive's header and every send (header with a packed payload, or header then
  /// payload) posted first, then the headers checked as they arrive, each one's packed payload
  /// copied out or payload receive posted once it checked out, and everything waited for by the
  /// deadline. One peer's headers are taken in the order posted (its payloads must be received in
  /// the order it sent them), the peers' independently: a receive whose sender first waits for
  /// another rank (a large send that rank must take) must not hold up the receive from that rank.
  void perform_p2p(const Op& op, std::span<P2PItem> items) {
    const char* name = op_name(op.desc.kind);
    const std::size_t n = items.size();
    if (n == 0) return;
    Deadline deadline(timeout());
    const MPI_Datatype type = type_of(op);
    const std::size_t es = op.elem_size;
    auto& numbers = pending_->numbers;
    numbers.assign(n, 0);
    // Each item's header message: the header, then a packed payload (kPackMax room on a receive).
    constexpr std::size_t stride = sizeof(P2PHeader) + kPackMax;
    auto& packed = pending_->packed;
    if (packed.size() < n * stride) packed.resize(n * stride);  // grown only: no zeroing per call
    auto packs = [&](const P2PItem& it) { return it.count * es <= kPackMax; };
    // The receives' header requests (by item), then everything else: sends and payload receives.
    // Kept in pending_ and reused, as `packed` is: allocating them per call cost ~0.09 us of an
    // 8-byte send's 0.7 (benchmarks/RESULTS.md, "request lists kept between calls").
    auto& hreqs = pending_->hreqs;
    hreqs.assign(n, MPI_REQUEST_NULL);
    auto& reqs = pending_->reqs;
    reqs.clear();
    auto& recvs = pending_->recvs;  // items that receive, in order
    recvs.clear();
    auto& arrived = pending_->arrived;  // by item: its header checked out
    arrived.assign(n, 0);
    auto& blocked = pending_->blocked;  // by peer: the pass that found one of its headers missing
    if (blocked.size() < static_cast<std::size_t>(size())) blocked.assign(static_cast<std::size_t>(size()), 0);
    auto payload = [&](const P2PItem& it, bool send) {
      auto* buf = static_cast<std::byte*>(it.buf);
      for (std::size_t done = 0; done < it.count;) {
        const std::size_t c = std::min(it.count - done, kMaxCount);
        MPI_Request r = MPI_REQUEST_NULL;
        if (send)
          COMM_MPI_CHECK(MPI_Isend(buf + done * es, narrow_count(name, rank(), c), type, it.peer, kPayloadTag, p2p_, &r), name,
                         rank());
        else
          COMM_MPI_CHECK(MPI_Irecv(buf + done * es, narrow_count(name, rank(), c), type, it.peer, kPayloadTag, p2p_, &r), name,
                         rank());
        reqs.push_back(r);
        done += c;
      }
    };
    // A header message arrived for receive i: checks its length and header, then takes a packed
    // payload or posts the payload's receives.
    auto received = [&](std::size_t i, const MPI_Status& st) {
      const P2PItem& it = items[i];
      const std::byte* msg = packed.data() + i * stride;
      int got = 0;
      COMM_MPI_CHECK(MPI_Get_count(&st, MPI_BYTE, &got), name, rank());
      auto from = [&] { return "rank " + std::to_string(it.peer); };
      if (got < static_cast<int>(sizeof(P2PHeader)))
        throw DesyncError(name, rank(),
                          "malformed point-to-point header from " + from() + " (" + std::to_string(got) + " bytes)", from());
      P2PHeader h;
      std::memcpy(&h, msg, sizeof h);
      check_p2p_header(op, it, h, numbers[i], rank());
      const std::size_t bytes = it.count * es;
      const std::size_t want = sizeof(P2PHeader) + (packs(it) ? bytes : 0);
      if (static_cast<std::size_t>(got) != want)
        throw DesyncError(name, rank(), from() + "'s message of " + std::to_string(it.count) + " elements came as " +
                                            std::to_string(got) + " bytes where " + std::to_string(want) + " were due",
                          from());
      if (!packs(it))
        payload(it, false);
      else if (bytes != 0)
        std::memcpy(it.buf, msg + sizeof(P2PHeader), bytes);
    };
    try {
      for (std::size_t i = 0; i < n; ++i) {
        const P2PItem& it = items[i];
        if (it.send) continue;
        recvs.push_back(i);
        numbers[i] = p2p_numbers_.next_recv(it.peer);
        COMM_MPI_CHECK(MPI_Irecv(packed.data() + i * stride, static_cast<int>(stride), MPI_BYTE, it.peer, kHeaderTag, p2p_,
                                 &hreqs[i]),
                       name, rank());
      }
      for (std::size_t i = 0; i < n; ++i) {
        const P2PItem& it = items[i];
        if (!it.send) continue;
        std::byte* msg = packed.data() + i * stride;
        const P2PHeader h = p2p_header(op, it, p2p_numbers_.next_send(it.peer));
        std::memcpy(msg, &h, sizeof h);
        const std::size_t bytes = it.count * es;
        if (packs(it) && bytes != 0) std::memcpy(msg + sizeof h, it.buf, bytes);
        MPI_Request r = MPI_REQUEST_NULL;
        COMM_MPI_CHECK(MPI_Isend(msg, static_cast<int>(sizeof h + (packs(it) ? bytes : 0)), MPI_BYTE, it.peer, kHeaderTag,
                                 p2p_, &r),
                       name, rank());
        reqs.push_back(r);
        if (!packs(it)) payload(it, true);
      }
      std::size_t first = 0;           // recvs before it have all checked out
      std::size_t open = recvs.size();  // receives whose header has not checked out
      const bool done = poll([&] {
        if (open > 0) {
          const std::uint64_t pass = ++pending_->pass;
          for (std::size_t k = first; k < recvs.size(); ++k) {
            const std::size_t i = recvs[k];
            const auto peer = static_cast<std::size_t>(items[i].peer);
            if (arrived[i] != 0 || blocked[peer] == pass) continue;
            int flag = 0;
            MPI_Status st;
            COMM_MPI_CHECK(MPI_Test(&hreqs[i], &flag, &st), name, rank());
            if (flag == 0) {
              blocked[peer] = pass;  // this peer's later headers wait for this one
              continue;
            }
            received(i, st);
            arrived[i] = 1;
            --open;
          }
          while (first < recvs.size() && arrived[recvs[first]] != 0) ++first;
          if (open > 0) return false;
        }
        int all = 0;
        COMM_MPI_CHECK(MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &all, MPI_STATUSES_IGNORE), name,
                       rank());
        return all != 0;
      }, [&] { look_out(name); }, deadline);
      if (done) {
        // Every request completed: a batch's buffer beyond the keep size goes back.
        if (packed.capacity() > kScratchKeep) std::vector<std::byte>().swap(packed);
        return;
      }
      // Name a peer: the first whose message has not arrived, else the first not yet received.
      std::string peer, what;
      if (first < recvs.size()) {
        const P2PItem& it = items[recvs[first]];
        peer = std::to_string(it.peer);
        what = "no message from rank " + peer + " arrived (this rank posted a receive of " +
               std::to_string(it.count) + " elements with tag " + std::to_string(it.tag) + ")";
      } else {
        for (std::size_t i = 0; i < n && peer.empty(); ++i)
          if (items[i].send) peer = std::to_string(items[i].peer);
        what = "this operation's messages did not all complete" +
               (peer.empty() ? std::string() : " (rank " + peer + " did not receive)");
      }
      throw Timeout(name, rank(),
                    what + " within " + std::to_string(timeout().count()) +
                        " ms (a rank is late, hung, or did not post the matching call). Its MPI requests stay pending "
                        "(MPI may still read and write this operation's buffers) and this communicator is unusable",
                    peer);
    } catch (const std::bad_alloc&) {
      out_of_memory(name);
    } catch (...) {
      leaked_ = true;  // requests may be pending: nothing they use is freed
      throw;
    }
  }

  /// Fills fingerprints() from every rank: an in-place allgather of 32 bytes per rank.
  void exchange_fingerprints(std::uint64_t seq) {
    const char* name = op_name(static_cast<OpKind>(own_fingerprint().kind));
    auto& all = fingerprints();
    Deadline deadline(timeout());
    collective("MPI_Iallgather", name, seq, deadline, [&](MPI_Request* req) {
      return MPI_Iallgather(MPI_IN_PLACE, 0, MPI_BYTE, all.data(), static_cast<int>(sizeof(Fingerprint)), MPI_BYTE,
                            comm_, req);
    });
  }

  // rethrow_translated: the core's default (MPI errors are already comm::Errors here).

  /// Tells every peer that this communicator failed, with the first cause (see the file comment).
  /// MPI has no way to interrupt this rank's own pending request: the wait loop sees has_failed().
  void close_transport() noexcept {
    if (ctl_ == MPI_COMM_NULL || notified_.exchange(true)) return;
    if (!initialized() || finalized()) return;
    try {
      std::string text = failure_text();
      if (text.size() > kNoticeMax) text.resize(kNoticeMax);
      // Leaked on purpose: a freed send request may read it after this communicator is gone.
      const auto* notice = new std::string(std::move(text));
      for (int p = 0; p < size(); ++p) {
        if (p == rank()) continue;
        MPI_Request r = MPI_REQUEST_NULL;
        if (MPI_Isend(notice->data(), static_cast<int>(notice->size()), MPI_CHAR, p, kNoticeTag, ctl_, &r) ==
            MPI_SUCCESS)
          MPI_Request_free(&r);
      }
    } catch (...) {  // best effort: peers still end by their own deadline
    }
  }

  // ---- helpers ----

  /// MPI's own type and op where MPI reduces the element type, else this engine's datatype of the
  /// element's size with the slot op running comm's kernel or the user's callable.
  Reduction reduction(const Op& op) {
    const auto d = static_cast<Dtype>(op.desc.dtype);
    // desc.reduce is the ReduceOp's code for a built-in reduction (avg maps to MPI_SUM).
    if (op.custom == nullptr && mpi_reduces(d)) {
      // premul_sum sums its scaled input (its code in desc.reduce is not a ReduceOp's).
      const auto r = op.prescale != nullptr ? ReduceOp::sum : static_cast<ReduceOp>(op.desc.reduce);
      return {datatype_of(d), op_of(r)};
    }
    slot_->kernel = op.kernel;
    slot_->custom = op.custom;
    slot_->arg = op.custom_arg;
    return {erased_type(op.elem_size, op_name(op.desc.kind)), slot_op()};
  }

  /// Contiguous `bytes`-byte elements carrying this engine's ReduceSlot (made on first use).
  MPI_Datatype erased_type(std::size_t bytes, const char* name) {
    const std::size_t i = bytes == 1 ? 0 : bytes == 2 ? 1 : bytes == 4 ? 2 : 3;
    MPI_Datatype& t = types_[i];
    if (t == MPI_DATATYPE_NULL) {
      MPI_Datatype made = MPI_DATATYPE_NULL;
      COMM_MPI_CHECK(MPI_Type_contiguous(static_cast<int>(bytes), MPI_BYTE, &made), name, rank());
      COMM_MPI_CHECK(MPI_Type_commit(&made), name, rank());
      COMM_MPI_CHECK(MPI_Type_set_attr(made, slot_keyval(), slot_.get()), name, rank());
      t = made;
    }
    return t;
  }

  /// Whether `part` is block `index` (of `bytes` bytes) of `whole`: the caller's in-place form.
  [[nodiscard]] static bool is_block(const void* part, const void* whole, int index, std::size_t bytes) noexcept {
    return part == static_cast<const std::byte*>(whole) + static_cast<std::size_t>(index) * bytes;
  }

  [[nodiscard]] static MPI_Datatype type_of(const Op& op) { return datatype_of(static_cast<Dtype>(op.desc.dtype)); }

  /// Starts one collective, `start(&req)` returning the code of the MPI call named `call`, and
  /// waits for it (await).
  template <class Start>
  void collective(const char* call, const char* name, std::uint64_t seq, Deadline& deadline, Start&& start) {
    MPI_Request req = MPI_REQUEST_NULL;
    if (const int rc = start(&req); rc != MPI_SUCCESS) throw_mpi_error(rc, call, name, rank());
    await(req, name, seq, deadline);
  }

  /// collective() over pieces of at most kMaxCount of `count` elements (MPI counts are int), one
  /// after the other: `start(done, n, &req)` starts the piece of `n` elements at element `done`.
  template <class Start>
  void in_pieces(std::size_t count, const char* call, const char* name, std::uint64_t seq, Deadline& deadline,
                 Start&& start) {
    for (std::size_t done = 0; done < count;) {
      const std::size_t n = std::min(count - done, kMaxCount);
      const int piece = narrow_count(name, rank(), n);
      collective(call, name, seq, deadline, [&](MPI_Request* req) { return start(done, piece, req); });
      done += n;
    }
  }

  /// Waits for the request of operation `seq` (see the file comment); on a Timeout, an abort or a
  /// peer's failure notice the request is left pending (leaked) and the error thrown.
  void await(MPI_Request& req, const char* name, std::uint64_t seq, Deadline& deadline) {
    int done = 0;
    COMM_MPI_CHECK(MPI_Test(&req, &done, MPI_STATUS_IGNORE), name, rank());
    if (done != 0) return;
    const bool completed = poll([&] {
      COMM_MPI_CHECK(MPI_Test(&req, &done, MPI_STATUS_IGNORE), name, rank());
      return done != 0;
    }, [&] { look_out(name); }, deadline);
    if (completed) return;
    leaked_ = true;
    throw Timeout(name, rank(),
                  "op #" + std::to_string(seq) + " did not complete within " + std::to_string(timeout().count()) +
                      " ms (a rank is late, hung, or did not call it). MPI cannot cancel a collective: its request "
                      "stays pending (MPI may still read and write this operation's buffers if the peers arrive "
                      "later) and this communicator is unusable");
  }

  /// While waiting: fail at once when the communicator was aborted, or when a peer says it failed.
  void look_out(const char* name) {
    if (has_failed()) {
      leaked_ = true;
      throw Timeout(name, rank(), "aborted");  // run() reports the abort's own cause instead
    }
    int flag = 0;
    MPI_Status st;
    COMM_MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, kNoticeTag, ctl_, &flag, &st), name, rank());
    if (flag == 0) return;
    int len = 0;
    COMM_MPI_CHECK(MPI_Get_count(&st, MPI_CHAR, &len), name, rank());
    std::string text(static_cast<std::size_t>(std::max(len, 0)), '\0');
    COMM_MPI_CHECK(MPI_Recv(text.data(), len, MPI_CHAR, st.MPI_SOURCE, kNoticeTag, ctl_, MPI_STATUS_IGNORE), name,
                   rank());
    leaked_ = true;
    throw RemoteError(name, rank(), "rank " + std::to_string(st.MPI_SOURCE) + " failed: " + text,
                      std::to_string(st.MPI_SOURCE));
  }

  void send_and_forget(const int* value, int to, int tag, const char* op) {
    MPI_Request r = MPI_REQUEST_NULL;
    COMM_MPI_CHECK(MPI_Isend(value, 1, MPI_INT, to, tag, ctl_, &r), op, rank());
    MPI_Request_free(&r);
  }

  /// Makes the data, control and point-to-point communicators (blocking, ends by the timeout).
  void connect(const CommSource& src) {
    thread_level_ = mpi::thread_level();
    tuning_ = tuning_for_library();
    const Comms made = make_comms(src, rank(), timeout(), name());
    comm_ = made.data;
    ctl_ = made.control;
    p2p_ = made.p2p;
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm ctl_ = MPI_COMM_NULL;
  MPI_Comm p2p_ = MPI_COMM_NULL;
  int thread_level_ = MPI_THREAD_SINGLE;
  bool leaked_ = false;  // a request was left pending (only the executing thread writes it)
  std::atomic<bool> notified_{false};
  std::unique_ptr<ReduceSlot> slot_ = std::make_unique<ReduceSlot>();
  std::array<MPI_Datatype, 4> types_{MPI_DATATYPE_NULL, MPI_DATATYPE_NULL, MPI_DATATYPE_NULL, MPI_DATATYPE_NULL};
  std::vector<std::byte> scratch_;  // in-place reduce_scatter's result; ops run one at a time
  /// What pending requests of the operation in flight point to: point-to-point header messages and
  /// all_to_all_v's int counts (leaked with the requests after a failure; see the destructor).
  struct Pending {
    std::vector<std::byte> packed;       // point-to-point: each item's header message (perform_p2p)
    std::vector<std::uint64_t> numbers;  // each receive's expected message number
    std::vector<MPI_Request> hreqs;      // ... each receive's header request (by item)
    std::vector<MPI_Request> reqs;       // ... the sends and payload receives
    std::vector<std::size_t> recvs;      // ... the items that receive, in order
    std::vector<std::uint8_t> arrived;   // ... by item: its header checked out
    std::vector<std::uint64_t> blocked;  // ... by peer: the last pass that found its header missing
    std::uint64_t pass = 0;              // ... the header passes so far
    std::vector<int> counts;             // all_to_all_v: send counts, displs, receive counts, displs
    Step step;                           // the own schedules' requests in flight
    std::vector<std::byte> recv;         // ... and the blocks they receive
  };
  std::unique_ptr<Pending> pending_ = std::make_unique<Pending>();
  P2PCounters p2p_numbers_;
};

}  // namespace comm::detail::mpi
