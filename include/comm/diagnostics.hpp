#pragma once
/// \file
/// What the diagnostics of a communicator report: the flight recorder's records of its last
/// operations (`Communicator<B>::flight_record()`, `dump_flight_record(path)`), and how an
/// operation is described in them and in desync errors ("all_reduce(float x4, sum)").
///
/// ### Flight recorder
/// Every communicator (every backend) keeps its last N operations in a fixed ring:
/// sequence number, operation, element type, count, root, reduction, state (queued, started,
/// completed, failed), the times of those transitions, and the error of a failed one.
/// - N: the backend option `flight_recorder_size`, default COMM_FLIGHT_RECORDER_SIZE, else 256;
///   0 turns recording off.
/// - A record whose operation has not ended is kept: when the ring comes round to it, the new
///   operation goes unrecorded (counted in total_ops), so a hung operation stays in the dump.
/// - Cost: no allocation per operation; two clock reads per blocking operation, and on the host
///   backends no lock (docs/DIAGNOSTICS.md).
/// - Dumps: `dump_flight_record(path)` on demand. With `COMM_FLIGHT_RECORDER=path` each
///   communicator writes `path.<rank>` automatically on its first failure (Timeout, RemoteError,
///   BackendError, a DesyncError or a failed monitored_barrier) and when it is destroyed; a
///   subgroup writes `path.<rank of its root communicator>.g<k>` (nested: `.g<k>.g<j>`), a second
///   communicator on the same store `path.<rank>.c<n>`. Without COMM_FLIGHT_RECORDER the failure
///   dump goes to stderr when COMM_DEBUG is WARN or more.
/// - Format: a `#` header line, then one line per operation, oldest first, `key=value` fields:
///   `#17 all_reduce(float x4, sum) state=completed queued=2025-01-31T12:00:00.123456Z wait_ms=0.002 run_ms=0.051`.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <comm/types.hpp>

namespace comm {

/// Where an operation is in its life.
enum class OpState : std::uint8_t { queued, started, completed, failed };

/// The state's name: "queued", "started", "completed", "failed".
[[nodiscard]] constexpr std::string_view to_string(OpState s) noexcept {
  switch (s) {
    case OpState::queued: return "queued";
    case OpState::started: return "started";
    case OpState::completed: return "completed";
    case OpState::failed: return "failed";
  }
  return "unknown";
}

/// The operations a communicator records and checks. The values are stable: they travel in
/// desync fingerprints; new operations get new numbers.
enum class OpKind : std::uint8_t {
  all_reduce = 1,
  reduce_scatter = 2,
  all_gather = 3,
  broadcast = 4,
  gather = 5,
  barrier = 6,
  split = 7,
  monitored_barrier = 8,
  reduce = 9,
  scatter = 10,
  all_to_all = 11,
  all_to_all_v = 12,
  send = 13,  // point-to-point: OpDesc::root is the peer
  recv = 14,
  p2p_batch = 15,  // batch_isend_irecv: several sends and receives that progress together
};

/// The operation's name as OpRecord::op shows it ("all_reduce", "batch_isend_irecv").
[[nodiscard]] constexpr std::string_view to_string(OpKind k) noexcept {
  switch (k) {
    case OpKind::all_reduce: return "all_reduce";
    case OpKind::reduce_scatter: return "reduce_scatter";
    case OpKind::all_gather: return "all_gather";
    case OpKind::broadcast: return "broadcast";
    case OpKind::gather: return "gather";
    case OpKind::barrier: return "barrier";
    case OpKind::split: return "split";
    case OpKind::monitored_barrier: return "monitored_barrier";
    case OpKind::reduce: return "reduce";
    case OpKind::scatter: return "scatter";
    case OpKind::all_to_all: return "all_to_all";
    case OpKind::all_to_all_v: return "all_to_all_v";
    case OpKind::send: return "send";
    case OpKind::recv: return "recv";
    case OpKind::p2p_batch: return "batch_isend_irecv";
  }
  return "unknown_op";
}

/// What is known of an operation when it is issued: what a backend hands the flight recorder
/// and the desync check. `count` is the per-rank-invariant element count (see OpRecord::count).
struct OpDesc {
  /// No element type or reduction (dtype, reduce).
  static constexpr std::uint8_t none = 0xff;
  static constexpr std::uint8_t custom = 0xfe;  ///< reduce: a user callable

  /// The operation.
  OpKind kind = OpKind::barrier;
  std::uint8_t dtype = none;   ///< a Dtype value or none
  std::uint8_t reduce = none;  ///< a ReduceOp value, custom or none
  /// The root or peer; -1 when none.
  int root = -1;
  /// The element count that is the same on every rank (see OpRecord::count).
  std::uint64_t count = 0;
};

/// One operation as the flight recorder saw it.
struct OpRecord {
  /// Wall-clock time of a transition.
  using time_point = std::chrono::system_clock::time_point;
  /// Position in this rank's sequence of operations on the communicator (0-based). It is the
  /// desync check's "op #" as long as no point-to-point operation ran: send, recv and
  /// batch_isend_irecv count here but not in the collectives' sequence, which must match across
  /// ranks.
  std::uint64_t seq = 0;
  /// "all_reduce", "reduce_scatter", "all_gather", "broadcast", "gather", "barrier", "split",
  /// "monitored_barrier", "reduce", "scatter", "all_to_all", "all_to_all_v", "send", "recv",
  /// "batch_isend_irecv".
  std::string op;
  /// Element type; none for barriers and other operations without a buffer.
  std::optional<Dtype> dtype;
  /// The element count that is the same on every rank: the input count (gather, all_gather,
  /// all_reduce, reduce, all_to_all), the output count (reduce_scatter, scatter), the buffer
  /// (broadcast, send, recv); 0 for all_to_all_v (counts differ by rank), the number of entries
  /// for batch_isend_irecv.
  std::uint64_t count = 0;
  /// The root (broadcast, gather, reduce, scatter, monitored_barrier) or the peer (send, recv; a
  /// batch's first entry); -1 when none.
  int root = -1;
  /// The built-in reduction; none for non-reducing operations and custom callables.
  std::optional<ReduceOp> reduce;
  /// The reduction was a user callable.
  bool custom_reduce = false;
  /// Where the operation is in its life.
  OpState state = OpState::queued;
  /// Wall-clock times of the transitions; a default (epoch) time_point when not reached.
  ///@{
  time_point queued{}, started{}, ended{};
  ///@}
  /// The error of a failed operation.
  std::string error;
};

/// The flight recorder's contents for one communicator, oldest operation first.
struct FlightRecord {
  std::string backend;  ///< "gloo"
  /// This rank in the communicator.
  int rank = -1;
  /// The communicator's size.
  int size = 0;
  std::string name;             ///< "" for a root communicator, "g0", "g0.g1" for subgroups, "c2"...
  std::uint64_t total_ops = 0;  ///< operations issued since creation (the oldest may have been dropped)
  std::size_t capacity = 0;     ///< ring size (0: recording is off)
  /// The last `capacity` operations at most (one not yet ended before newer ones), oldest first.
  std::vector<OpRecord> ops;
};

namespace detail {

/// "all_reduce(float x4, sum)", "broadcast(float x4, root 0)", "barrier()".
[[nodiscard]] inline std::string describe_call(std::string_view op, std::optional<Dtype> dtype, std::uint64_t count,
                                               int root, std::optional<ReduceOp> reduce, bool custom) {
  std::string s(op);
  s += '(';
  bool first = true;
  auto sep = [&] {
    if (!first) s += ", ";
    first = false;
  };
  if (dtype) {
    sep();
    s += to_string(*dtype);
    s += " x";
    s += std::to_string(count);
  }
  if (reduce || custom) {
    sep();
    s += custom ? std::string("custom") : std::string(to_string(*reduce));
  }
  if (root >= 0) {
    sep();
    s += "root ";
    s += std::to_string(root);
  }
  s += ')';
  return s;
}

/// "2025-01-31T12:00:00.123456Z", or "-" for the epoch.
[[nodiscard]] inline std::string iso_time(std::chrono::system_clock::time_point t) {
  if (t.time_since_epoch().count() == 0) return "-";
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
  const std::time_t secs = static_cast<std::time_t>(us / 1000000);
  std::tm tm{};
  ::gmtime_r(&secs, &tm);
  char buf[96];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%06uZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<unsigned>((us % 1000000 + 1000000) % 1000000));
  return buf;
}

[[nodiscard]] inline std::string ms_between(OpRecord::time_point a, OpRecord::time_point b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", std::chrono::duration<double, std::milli>(b - a).count());
  return buf;
}

}  // namespace detail

/// `op(...)` as in a desync message: "all_reduce(float x4, sum)".
[[nodiscard]] inline std::string describe_call(const OpRecord& r) {
  return detail::describe_call(r.op, r.dtype, r.count, r.root, r.reduce, r.custom_reduce);
}

/// One line: `#17 all_reduce(float x4, sum) state=completed queued=... wait_ms=... run_ms=...`;
/// an operation still running shows `running_ms` up to `now`, a failed one its `error="..."`.
[[nodiscard]] inline std::string to_string(const OpRecord& r,
                                           OpRecord::time_point now = std::chrono::system_clock::now()) {
  std::string s = "#" + std::to_string(r.seq) + " " + describe_call(r) + " state=" + std::string(to_string(r.state)) +
                  " queued=" + detail::iso_time(r.queued);
  const bool started = r.started.time_since_epoch().count() != 0;
  const bool ended = r.ended.time_since_epoch().count() != 0;
  if (started) s += " wait_ms=" + detail::ms_between(r.queued, r.started);
  if (started && ended) s += " run_ms=" + detail::ms_between(r.started, r.ended);
  if (started && !ended) s += " running_ms=" + detail::ms_between(r.started, now);
  if (!started && !ended) s += " queued_ms=" + detail::ms_between(r.queued, now);
  if (!r.error.empty()) {
    s += " error=\"";
    for (char c : r.error) s += (c == '"' ? '\'' : (c == '\n' ? ' ' : c));
    s += '"';
  }
  return s;
}

/// The dump format: a `#` header line, then one line per operation (see to_string(OpRecord)).
[[nodiscard]] inline std::string to_string(const FlightRecord& f) {
  const auto now = std::chrono::system_clock::now();
  std::string s = "# comm flight record: backend=" + f.backend + " rank=" + std::to_string(f.rank) +
                  " size=" + std::to_string(f.size) + " comm=" + (f.name.empty() ? std::string("root") : f.name) +
                  " ops=" + std::to_string(f.total_ops) + " shown=" + std::to_string(f.ops.size()) +
                  " capacity=" + std::to_string(f.capacity) + " dumped=" + detail::iso_time(now) + "\n";
  for (const auto& r : f.ops) {
    s += to_string(r, now);
    s += '\n';
  }
  return s;
}

}  // namespace comm
