#pragma once
// The engine-neutral state of a communicator, the same for the host engines (through EngineCore,
// core.hpp) and the NCCL engine (detail/nccl/engine.hpp):
//   - identity: backend, rank, size, timeout, the store and this communicator's key prefix on it,
//     the rank and name used in dump files, the subgroup counter;
//   - the membership check when a communicator joins its store (join_store);
//   - the flight recorder and its dumps (after an error, and at the end with COMM_FLIGHT_RECORDER);
//   - the first-failure record: after the first Timeout/RemoteError/BackendError the communicator
//     is unusable and every later operation fails at once with that first cause;
//   - the liveness watch (root communicators on a TcpStore), whose news becomes the first failure.
// What runs the operations (the host OpQueue, NCCL's stream and watchdog) and how a failure ends
// pending work (closing a transport, aborting an NCCL communicator) is the engine's.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include <comm/detail/engine/failure.hpp>
#include <comm/detail/diagnostics/flight_recorder.hpp>
#include <comm/detail/engine/liveness.hpp>
#include <comm/detail/base/logging.hpp>
#include <comm/detail/engine/membership.hpp>
#include <comm/detail/diagnostics/monitored_barrier.hpp>
#include <comm/diagnostics.hpp>
#include <comm/error.hpp>
#include <comm/store.hpp>

namespace comm::detail {

/// What every engine is built with besides its store, rank and size.
struct CoreConfig {
  std::chrono::milliseconds timeout{};
  bool desync_check = false;
  std::size_t flight_recorder_size = 256;
  /// Subgroups: the rank (in its root communicator) used in dump file names, and the subgroup's
  /// name ("g0", "g0.g1"). -1 for a root communicator (its own rank; its name comes from its
  /// creation number on the store).
  int file_rank = -1;
  std::string name;
};

/// Where a communicator lives: its store (null when adopted), its keys there, and how its dumps
/// are named.
struct CommPlace {
  std::shared_ptr<comm::Store> store;
  std::string key_prefix;   ///< "comm/<backend>/<n>/"
  std::int64_t number = 0;  ///< n: this rank's communicators of this backend on the store so far
  int file_rank = 0;
  std::string name;   ///< "" (root), "c2" (2nd root on its store), "g0", "g0.g1", "adopted"
  bool root = false;  ///< a root communicator (not a subgroup): it runs the liveness watch
};

/// The communicators one root communicator becomes through shrink() and grow()
/// (detail/engine/elastic.hpp): they share a store and a place on it where replacements wait.
struct Lineage {
  std::shared_ptr<comm::Store> base;  ///< the store of the lineage's first communicator
  std::string room;                   ///< its keys there: "<first communicator's prefix>elastic/"
  std::uint64_t epoch = 0;            ///< reconfigurations so far (the same on every member)
  std::uint64_t next_grow = 0;        ///< grow() calls so far (the same on every member)
  std::uint64_t shrinks = 0;          ///< shrink() attempts on this communicator
};

/// Takes this communicator's number on `store` (each rank counts its own communicators, so ranks
/// that create them in the same order agree) and, for size > 1, runs the membership check, so
/// that ranks started with different world sizes fail before the engine connects.
[[nodiscard]] inline CommPlace join_store(std::shared_ptr<comm::Store> store, int rank, int size,
                                          const CoreConfig& cfg, const char* backend) {
  const std::string base = std::string("comm/") + backend + "/";
  const auto n = store->add(base + "seq/" + std::to_string(rank), 1);
  CommPlace p;
  p.key_prefix = base + std::to_string(n) + "/";
  p.number = n;
  p.root = cfg.file_rank < 0;
  p.file_rank = p.root ? rank : cfg.file_rank;
  p.name = p.root ? (n == 1 ? std::string() : "c" + std::to_string(n)) : cfg.name;
  if (size > 1)
    check_membership(*store, p.key_prefix, static_cast<std::uint64_t>(n), rank, size, cfg.timeout,
                     std::string(backend) + ".init");
  p.store = std::move(store);
  return p;
}

/// The place of a communicator over an engine group made elsewhere (no store: no subgroups through
/// the store, no monitored_barrier, no liveness watch).
[[nodiscard]] inline CommPlace adopted_place(int file_rank, std::string name) {
  CommPlace p;
  p.file_rank = file_rank;
  p.name = std::move(name);
  return p;
}

class CommCore {
 public:
  /// `writers`: how the flight recorder's writes may overlap (FlightRecorder::Writers).
  CommCore(CommPlace place, int rank, int size, const CoreConfig& cfg, const char* backend,
           FlightRecorder::Writers writers = FlightRecorder::Writers::any)
      : backend_(backend),
        rank_(rank),
        size_(size),
        timeout_(cfg.timeout),
        desync_(cfg.desync_check),
        place_(std::move(place)),
        recorder_(cfg.flight_recorder_size, writers),
        dump_path_(flight_recorder_path()) {
    // A root communicator starts a lineage: shrink() and grow() may follow it.
    if (place_.root && place_.store) lineage_ = Lineage{place_.store, place_.key_prefix + "elastic/"};
  }

  CommCore(const CommCore&) = delete;
  CommCore& operator=(const CommCore&) = delete;
  ~CommCore() { stop_liveness(); }

  [[nodiscard]] const char* backend_name() const noexcept { return backend_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  /// The store this communicator rendezvoused on (null when adopted) and its key prefix there.
  [[nodiscard]] const std::shared_ptr<comm::Store>& store() const noexcept { return place_.store; }
  [[nodiscard]] const std::string& key_prefix() const noexcept { return place_.key_prefix; }
  [[nodiscard]] int file_rank() const noexcept { return place_.file_rank; }
  [[nodiscard]] const std::string& name() const noexcept { return place_.name; }
  [[nodiscard]] bool desync_check() const noexcept { return desync_; }
  /// The next subgroup number (split and new_group count on every rank of this communicator).
  [[nodiscard]] std::uint64_t next_group_index() noexcept { return groups_.fetch_add(1); }

  [[nodiscard]] FlightRecord flight_record() const { return recorder_.snapshot(backend_, rank_, size_, place_.name); }
  /// The file of automatic dumps: COMM_FLIGHT_RECORDER + "." + rank [+ "." + name].
  [[nodiscard]] std::string dump_file() const {
    return dump_path_ + "." + std::to_string(place_.file_rank) + (place_.name.empty() ? std::string() : "." + place_.name);
  }

  /// Its lineage (room empty: none, a subgroup or an adopted communicator).
  [[nodiscard]] Lineage& lineage() noexcept { return lineage_; }
  /// Makes this communicator the next of `l` (after shrink/grow): it watches its members' liveness
  /// as a root communicator does. Before its first operation (the watch starts there).
  void continue_lineage(Lineage l) {
    lineage_ = std::move(l);
    place_.root = true;
  }
  /// The rank hosting the store server, where this communicator's liveness watch knows it (-1:
  /// none of its ranks, or not known).
  [[nodiscard]] int store_host() const noexcept { return liveness_ ? liveness_->store_host() : -1; }

  /// revoke()'s message to every member (their liveness watches wake on it; the first death or
  /// revoke stays), and the text this rank fails with. Without a store only this rank knows.
  std::string publish_revoke(const std::string& reason) {
    if (place_.store) {
      try {
        const auto v = Liveness::revoke_value(rank_, reason);
        (void)place_.store->compare_set(Liveness::key(place_.key_prefix), {},
                                        std::span(reinterpret_cast<const std::uint8_t*>(v.data()), v.size()));
      } catch (const std::exception& e) {  // the store is gone: the members find out by their own means
        log(LogLevel::warn, std::string("comm: revoke could not tell the other ranks: ") + e.what());
      }
    }
    return "rank " + std::to_string(rank_) + " revoked the communicator" + (reason.empty() ? std::string() : ": " + reason);
  }

  /// True when the communicator has failed (cheap; for engines' wait loops).
  [[nodiscard]] bool has_failed() const noexcept { return failed_.load(std::memory_order_acquire); }

  /// While one lives, this rank is on its way to recording a failure of its own: EngineCore::run's
  /// catch block, and before it the teardown a failed step starts (Hierarchical's members). The
  /// liveness watch waits for it before it takes a peer's echo (EngineCore::peer_failed).
  class FailingScope {
   public:
    explicit FailingScope(std::atomic<int>& n) noexcept : n_(n) { n_.fetch_add(1, std::memory_order_acq_rel); }
    FailingScope(const FailingScope&) = delete;
    FailingScope& operator=(const FailingScope&) = delete;
    ~FailingScope() { n_.fetch_sub(1, std::memory_order_acq_rel); }

   private:
    std::atomic<int>& n_;
  };
  [[nodiscard]] FailingScope failing_scope() const noexcept { return FailingScope(failing_); }
  [[nodiscard]] bool failing() const noexcept { return failing_.load(std::memory_order_acquire) > 0; }
  /// The first failure's text, or "" while the communicator is healthy.
  [[nodiscard]] std::string failure_text() const {
    std::lock_guard lock(failure_mu_);
    return failure_ ? failure_->what : std::string();
  }

 protected:
  struct Failure {
    FailureKind kind;
    std::string what;
    std::string peer;
  };

  /// Records the first failure (to be dumped once: take_failure_dump); false when there was one
  /// already.
  bool record_failure(FailureKind kind, const std::string& what, const std::string& peer) {
    std::lock_guard lock(failure_mu_);
    if (failure_) return false;
    failure_ = Failure{kind, what, peer};
    failure_to_dump_.store(true, std::memory_order_relaxed);
    failed_.store(true, std::memory_order_release);
    return true;
  }
  [[nodiscard]] std::optional<Failure> first_failure() const {
    std::lock_guard lock(failure_mu_);
    return failure_;
  }
  /// After a failure: `op` fails at once with the first cause, "unusable after an earlier failure".
  void throw_if_failed(const char* op) const {
    if (!has_failed()) [[likely]]
      return;
    std::lock_guard lock(failure_mu_);
    throw_as(failure_->kind, op, rank_, "the communicator is unusable after an earlier failure: " + failure_->what,
             failure_->peer);
  }
  /// The first failure as `op`'s error (an engine's echo of it replaced by the cause).
  [[noreturn]] void throw_failure(const char* op) const {
    std::lock_guard lock(failure_mu_);
    throw_as(failure_->kind, op, rank_, failure_->what, failure_->peer);
  }
  /// True once after the first failure: that failure is dumped, operations failing after it not.
  bool take_failure_dump() noexcept { return failure_to_dump_.exchange(false); }

  /// The liveness watch's news (`why`: "rank 2 is dead: ...", "rank 1's operation failed: ...") as
  /// this communicator's failure (RemoteError naming `peer` and the operation running here). The
  /// text when it is the first failure (the engine then ends its pending work), else nullopt.
  std::optional<Failure> note_peer_failure(int peer, const std::string& why) {
    std::string running;
    for (const auto& r : recorder_.snapshot(backend_, rank_, size_, place_.name).ops)
      if (r.state == OpState::started) running = "op #" + std::to_string(r.seq) + " (" + r.op + ")";
    Failure f{FailureKind::remote,
              why + "; seen by rank " + std::to_string(rank_) + "'s liveness watch " +
                  (running.empty() ? std::string("between operations") : "during " + running),
              "rank " + std::to_string(peer)};
    if (!record_failure(f.kind, f.what, f.peer)) return std::nullopt;
    return f;
  }

  /// Starts the liveness watch at the first call, for root communicators with a store (a TcpStore:
  /// see liveness.hpp). Called once the engine is fully built, since `on_dead` may run at once.
  template <class OnDead>
  void start_liveness_once(OnDead&& on_dead) {
    if (liveness_started_) return;
    liveness_started_ = true;
    if (!place_.store || !place_.root) return;
    try {
      liveness_ = Liveness::start(place_.store, place_.key_prefix, rank_, size_, std::forward<OnDead>(on_dead));
    } catch (const std::exception& e) {
      log(LogLevel::warn, std::string("comm: liveness watch not started: ") + e.what());
    }
  }
  [[nodiscard]] Liveness* liveness() const noexcept { return liveness_.get(); }
  /// First in an engine's teardown: the watch may call into the engine.
  void stop_liveness() noexcept {
    if (liveness_) liveness_->stop();
  }

  [[nodiscard]] FlightRecorder& recorder() noexcept { return recorder_; }

  /// The store barrier of detail/diagnostics/monitored_barrier.hpp under this communicator's keys (`index`:
  /// its number among this communicator's monitored barriers, next_monitored_barrier()).
  void store_barrier(std::uint64_t index, std::chrono::milliseconds timeout, bool wait_all_ranks) {
    detail::monitored_barrier(*place_.store, place_.key_prefix + "mb", index, rank_, size_, timeout, wait_all_ranks);
  }
  [[nodiscard]] std::uint64_t next_monitored_barrier() noexcept { return monitored_barriers_++; }

  /// Writes the flight record where COMM_FLIGHT_RECORDER says, else to stderr at COMM_DEBUG>=WARN.
  void dump_after_error() noexcept {
    try {
      const auto text = to_string(flight_record());
      const std::string who = std::string(backend_) + " on rank " + std::to_string(rank_);
      if (!dump_path_.empty()) {
        const auto file = dump_file();
        write_text_file(file, text, rank_);
        log(LogLevel::warn, who + ": flight record written to " + file);
      } else if (log_level() >= LogLevel::warn) {
        log(LogLevel::warn, who + ": flight record after the error:\n" + text.substr(0, text.empty() ? 0 : text.size() - 1));
      }
    } catch (...) {  // diagnostics must not replace the error being reported
    }
  }

  /// The last dump, when the communicator ends (COMM_FLIGHT_RECORDER only).
  void dump_at_end() noexcept {
    if (dump_path_.empty()) return;
    try {
      write_text_file(dump_file(), to_string(flight_record()), rank_);
    } catch (const std::exception& e) {
      try {
        log(LogLevel::warn, e.what());
      } catch (...) {
      }
    }
  }

 private:
  const char* backend_;
  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  bool desync_;
  CommPlace place_;
  std::atomic<std::uint64_t> groups_{0};
  std::uint64_t monitored_barriers_ = 0;  // touched by one operation at a time (the engine's order)
  FlightRecorder recorder_;
  std::string dump_path_;  // COMM_FLIGHT_RECORDER
  std::atomic<bool> failure_to_dump_{false};
  std::atomic<bool> failed_{false};
  mutable std::atomic<int> failing_{0};  // live FailingScopes
  mutable std::mutex failure_mu_;
  std::optional<Failure> failure_;
  bool liveness_started_ = false;
  std::unique_ptr<Liveness> liveness_;
  Lineage lineage_;
};

}  // namespace comm::detail
