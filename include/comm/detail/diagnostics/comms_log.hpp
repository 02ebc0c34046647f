#pragma once
// The comms log and the trace: what every operation of a communicator cost, without adding any
// synchronization. Off unless the environment asks for it:
//
//   COMM_COMMS_LOG=path   one CSV line per operation, per rank: `path` with "{rank}" replaced by the
//                         rank, else `path.<rank>`; at a communicator's destroy its summary table
//                         (by op and size: count, total and average latency, algbw, busbw) is
//                         appended as "#" lines, and world rank 0 also prints it to stderr.
//   COMM_TRACE=path.json  the same operations as a Chrome / Perfetto trace, per rank `path.json.<rank>`
//                         (pid = rank, one track per communicator); comm-run merges the ranks' files
//                         into `path.json` when the job ends.
//
// Log columns (header line first):
//   comm         the communicator: backend, then ":" and its name for a subgroup ("gloo:g0"), a
//                second communicator on the same store ("shm:c2") or a member of a hierarchical
//                communicator ("shm:intra", "gloo:inter")
//   seq          the collective sequence number (matches across ranks); point-to-point operations
//                count separately
//   op, dtype    "all_reduce", "float"; dtype empty for barrier
//   count        elements as the flight recorder counts them (all_reduce, broadcast, reduce: the
//                buffer; reduce_scatter, scatter: the output; all_gather, gather: the input;
//                all_to_all: the whole input; send/recv: the message; batch_isend_irecv: the
//                number of sends and receives)
//   bytes        nccl-tests' size: all_reduce, broadcast, reduce, send, recv: count x element;
//                reduce_scatter, all_gather, gather, scatter: size() x count x element (the whole
//                buffer); all_to_all(_v): the larger of what this rank sends and receives;
//                batch_isend_irecv: the larger of its bytes sent and received; barriers 0
//   peer         the root (broadcast, gather, reduce, scatter) or peer (send, recv, the first of a
//                batch); empty otherwise
//   start_us     when this rank started the operation (microseconds since the Unix epoch)
//   duration_us  how long this rank's part took: on host backends from the start of its turn to its
//                end (the desync check and device staging included, the wait in the queue not);
//                on NCCL the GPU time between CUDA events recorded around the NCCL call, read once
//                complete (never a stream synchronization)
//   algbw_GBps   bytes / duration, in GB/s (1e9 B/s)
//   busbw_GBps   algbw x nccl-tests' bus factor: all_reduce 2(n-1)/n; reduce_scatter, all_gather,
//                gather, scatter, all_to_all(_v) (n-1)/n; broadcast, reduce, send, recv, batches 1
//
// Cost: off, one predictable branch before and after each operation; on, two clock reads and a
// line formatted into a buffer (written every 64 KiB); measured in benchmarks/RESULTS.md.

#include <algorithm>
#include <charconv>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <unistd.h>

#include <comm/detail/base/env.hpp>
#include <comm/detail/diagnostics/flight_recorder.hpp>
#include <comm/detail/base/logging.hpp>
#include <comm/error.hpp>
#include <comm/types.hpp>

namespace comm::detail {

/// nccl-tests' size of one operation and its bus-bandwidth factor.
struct Traffic {
  std::uint64_t bytes = 0;
  double bus_factor = 0.0;
};

/// Bytes per element of a Dtype code (0 for OpDesc::none).
[[nodiscard]] constexpr std::size_t dtype_bytes(std::uint8_t code) noexcept {
  switch (code) {
    case static_cast<std::uint8_t>(Dtype::int8):
    case static_cast<std::uint8_t>(Dtype::uint8):
    case static_cast<std::uint8_t>(Dtype::float8_e4m3):
    case static_cast<std::uint8_t>(Dtype::float8_e5m2): return 1;
    case static_cast<std::uint8_t>(Dtype::float16):
    case static_cast<std::uint8_t>(Dtype::bfloat16): return 2;
    case static_cast<std::uint8_t>(Dtype::int32):
    case static_cast<std::uint8_t>(Dtype::uint32):
    case static_cast<std::uint8_t>(Dtype::float32): return 4;
    case static_cast<std::uint8_t>(Dtype::int64):
    case static_cast<std::uint8_t>(Dtype::uint64):
    case static_cast<std::uint8_t>(Dtype::float64): return 8;
    default: return 0;
  }
}

/// The traffic of an operation of `count` elements of `elem` bytes over `n` ranks (the file
/// comment's table). all_to_all_v and batch_isend_irecv need their counts: see traffic_of(Op) in
/// detail/engine/core.hpp.
[[nodiscard]] inline Traffic traffic(OpKind kind, std::uint64_t count, std::size_t elem, int n) noexcept {
  const double ranks = n > 0 ? static_cast<double>(n) : 1.0;
  const double shared = (ranks - 1.0) / ranks;  // (n-1)/n
  const std::uint64_t un = n > 0 ? static_cast<std::uint64_t>(n) : 1;
  const std::uint64_t b = count * elem;
  switch (kind) {
    case OpKind::all_reduce: return {b, 2.0 * shared};
    case OpKind::reduce_scatter:
    case OpKind::all_gather:
    case OpKind::split:
    case OpKind::gather:
    case OpKind::scatter: return {b * un, shared};
    case OpKind::all_to_all:
    case OpKind::all_to_all_v: return {b, shared};
    case OpKind::broadcast:
    case OpKind::reduce:
    case OpKind::send:
    case OpKind::recv:
    case OpKind::p2p_batch: return {b, 1.0};
    case OpKind::barrier:
    case OpKind::monitored_barrier: return {0, 0.0};
  }
  return {b, 1.0};
}


/// `path` with every "{rank}" replaced by `rank`, else `path.<rank>`.
[[nodiscard]] inline std::string comms_log_file(const std::string& path, int rank) {
  const std::string r = std::to_string(rank);
  constexpr std::string_view token = "{rank}";
  if (path.find(token) == std::string::npos) return path + "." + r;
  std::string out;
  std::size_t from = 0;
  for (std::size_t at; (at = path.find(token, from)) != std::string::npos; from = at + token.size())
    out.append(path, from, at - from).append(r);
  return out.append(path, from, std::string::npos);
}

/// The per-rank trace file: `path.<rank>` (comm-run merges them into `path`).
[[nodiscard]] inline std::string trace_file(const std::string& path, int rank) {
  return path + "." + std::to_string(rank);
}

/// One operation as the log and the trace see it.
struct CommsEvent {
  const char* op = "";       // static
  std::uint32_t tid = 0;     // the communicator's track
  std::uint8_t dtype = OpDesc::none;
  int peer = -1;
  std::uint64_t seq = 0;
  std::uint64_t count = 0;
  std::uint64_t bytes = 0;
  std::int64_t start_ns = 0;  // since the Unix epoch
  std::int64_t dur_ns = 0;
  double algbw = 0;          // GB/s
  double busbw = 0;          // GB/s
};

/// The files of one rank of this process, shared by every communicator of that rank (the world,
/// its subgroups, a hierarchical communicator's members): the log is written as operations end
/// (64 KiB at a time); the trace is kept in memory and the whole file rewritten at every
/// communicator's destroy and at exit, so that it is valid JSON whenever a communicator is gone.
class CommsSink {
 public:
  /// At most this many trace events are kept per rank; later ones are counted, not kept.
  static constexpr std::size_t max_trace_events = std::size_t{1} << 21;

  CommsSink(std::string log_file, std::string trace_file, int rank)
      : log_file_(std::move(log_file)), trace_file_(std::move(trace_file)), rank_(rank) {
    using namespace std::chrono;
    sys_minus_steady_ns_ = duration_cast<nanoseconds>(system_clock::now().time_since_epoch()).count() -
                           duration_cast<nanoseconds>(steady_clock::now().time_since_epoch()).count();
    if (!log_file_.empty()) {
      log_ = std::fopen(log_file_.c_str(), "w");
      if (log_ == nullptr)
        throw InvalidArgument("COMM_COMMS_LOG", rank, "cannot open the comms log '" + log_file_ + "' for writing");
      static constexpr std::string_view header =
          "comm,seq,op,dtype,count,bytes,peer,start_us,duration_us,algbw_GBps,busbw_GBps\n";
      std::fwrite(header.data(), 1, header.size(), log_);
      std::fflush(log_);
    }
    if (!trace_file_.empty()) {
      // Written now (an empty, valid trace), so that a path that cannot be written fails at once.
      if (!write_trace_locked())
        throw InvalidArgument("COMM_TRACE", rank, "cannot write the trace '" + trace_file_ + "'");
    }
  }
  CommsSink(const CommsSink&) = delete;
  CommsSink& operator=(const CommsSink&) = delete;
  ~CommsSink() {
    flush();
    if (log_ != nullptr) std::fclose(log_);
  }

  /// The sink of (log, trace, rank) in this process, made on first use.
  [[nodiscard]] static std::shared_ptr<CommsSink> get(const std::string& log_file, const std::string& trace_file,
                                                      int rank) {
    auto& r = registry();
    std::lock_guard lock(r.mu);
    auto& slot = r.sinks[log_file + '\n' + trace_file + '\n' + std::to_string(rank)];
    if (!slot) slot = std::make_shared<CommsSink>(log_file, trace_file, rank);
    return slot;
  }

  /// A new track (Chrome trace "thread") named `label`.
  [[nodiscard]] std::uint32_t add_track(std::string label) {
    std::lock_guard lock(mu_);
    tracks_.push_back(std::move(label));
    return static_cast<std::uint32_t>(tracks_.size() - 1);
  }

  [[nodiscard]] std::int64_t to_epoch_ns(std::chrono::steady_clock::time_point t) const noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count() + sys_minus_steady_ns_;
  }

  void add(const CommsEvent& e) {
    std::lock_guard lock(mu_);
    if (log_ != nullptr) {
      append_csv(e);
      if (buf_.size() >= (std::size_t{64} << 10)) write_log_locked();
    }
    if (!trace_file_.empty()) {
      if (events_.size() < max_trace_events)
        events_.push_back(e);
      else
        ++dropped_;
    }
  }

  /// Appends `text` ("#" lines) to the log.
  void add_text(std::string_view text) {
    std::lock_guard lock(mu_);
    if (log_ == nullptr) return;
    buf_.append(text);
  }

  /// Writes what is buffered: the log's lines, and the whole trace file. Never throws.
  void flush() noexcept {
    std::lock_guard lock(mu_);
    write_log_locked();
    if (log_ != nullptr) std::fflush(log_);
    if (!trace_file_.empty() && written_ != events_.size() + dropped_) {
      if (!write_trace_locked()) {
        try {
          log(LogLevel::warn, "rank " + std::to_string(rank_) + ": cannot write the trace '" + trace_file_ + "'");
        } catch (...) {
        }
      }
    }
  }

  [[nodiscard]] const std::string& log_file() const noexcept { return log_file_; }
  [[nodiscard]] const std::string& trace_file() const noexcept { return trace_file_; }

 private:
  struct Registry {
    std::mutex mu;
    std::map<std::string, std::shared_ptr<CommsSink>> sinks;
    // At exit, the sinks of communicators that were never destroyed (a leaked world) are written.
    ~Registry() {
      for (auto& [key, sink] : sinks) sink->flush();
    }
  };
  static Registry& registry() {
    static Registry r;
    return r;
  }

  template <class V>
  static void put_num(std::string& s, V v) {
    char tmp[32];
    const auto res = std::to_chars(tmp, tmp + sizeof tmp, v);
    s.append(tmp, res.ptr);
  }
  /// Six significant digits (bandwidths of small messages are tiny, of large ones large).
  static void put_general(std::string& s, double v) {
    char tmp[64];
    const auto res = std::to_chars(tmp, tmp + sizeof tmp, v, std::chars_format::general, 6);
    if (res.ec == std::errc()) s.append(tmp, res.ptr);
  }
  /// Nanoseconds as microseconds with three decimals, exactly.
  static void put_us(std::string& s, std::int64_t ns) {
    if (ns < 0) {
      s.push_back('-');
      ns = -ns;
    }
    put_num(s, ns / 1000);
    char frac[4] = {'0', '0', '0', '\0'};
    std::int64_t r = ns % 1000;
    for (int i = 2; i >= 0; --i, r /= 10) frac[i] = static_cast<char>('0' + r % 10);
    s.push_back('.');
    s.append(frac, 3);
  }
  // What a log line or trace event is written from: text as is, a number in decimal, a time
  // (put_us) or a bandwidth (put_general); one call per line instead of one per field.
  struct Us {
    std::int64_t ns;
  };
  struct General {
    double v;
  };
  static void put(std::string& s, std::string_view v) { s.append(v); }
  static void put(std::string& s, char c) { s.push_back(c); }
  static void put(std::string& s, Us t) { put_us(s, t.ns); }
  static void put(std::string& s, General g) { put_general(s, g.v); }
  template <std::integral V>
  static void put(std::string& s, V v) {
    put_num(s, v);
  }
  static void append(std::string& s, const auto&... parts) { (put(s, parts), ...); }

  static std::string_view dtype_name(std::uint8_t code) {
    const auto d = dtype_from_code(code);
    return d ? to_string(*d) : std::string_view();
  }

  void append_csv(const CommsEvent& e) {
    append(buf_, std::string_view(tracks_[e.tid]), ',', e.seq, ',', std::string_view(e.op), ',', dtype_name(e.dtype),
           ',', e.count, ',', e.bytes, ',');
    if (e.peer >= 0) put_num(buf_, e.peer);
    append(buf_, ',', Us{e.start_ns}, ',', Us{e.dur_ns}, ',', General{e.algbw}, ',', General{e.busbw}, '\n');
  }

  void write_log_locked() noexcept {
    if (log_ == nullptr || buf_.empty()) return;
    std::fwrite(buf_.data(), 1, buf_.size(), log_);
    buf_.clear();
  }

  /// The whole trace, to a temporary file renamed over the old one.
  bool write_trace_locked() noexcept {
    try {
      std::string out;
      out.reserve(256 + events_.size() * 240);
      out += "{\"traceEvents\":[\n";
      const std::string pid = std::to_string(rank_);
      out += "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" + pid + ",\"tid\":0,\"args\":{\"name\":\"rank " + pid +
             "\"}},\n";
      out += "{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":" + pid + ",\"tid\":0,\"args\":{\"sort_index\":" +
             pid + "}}";
      for (std::size_t t = 0; t < tracks_.size(); ++t) {
        out += ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" + pid + ",\"tid\":" + std::to_string(t) +
               ",\"args\":{\"name\":\"";
        append_json_string(out, tracks_[t]);
        out += "\"}}";
      }
      for (const CommsEvent& e : events_) {
        append(out, ",\n{\"name\":\"", std::string_view(e.op), "\",\"cat\":\"comm\",\"ph\":\"X\",\"pid\":",
               std::string_view(pid), ",\"tid\":", e.tid, ",\"ts\":", Us{e.start_ns}, ",\"dur\":", Us{e.dur_ns},
               ",\"args\":{\"seq\":", e.seq, ",\"dtype\":\"", dtype_name(e.dtype), "\",\"count\":", e.count,
               ",\"bytes\":", e.bytes, ",\"peer\":", e.peer, ",\"algbw_GBps\":", General{e.algbw},
               ",\"busbw_GBps\":", General{e.busbw}, "}}");
      }
      out += "\n],\n\"displayTimeUnit\":\"ms\",\"otherData\":{\"producer\":\"comm\",\"rank\":" + pid +
             ",\"dropped_events\":" + std::to_string(dropped_) + "}}\n";
      const std::string tmp = trace_file_ + ".tmp" + std::to_string(::getpid());
      std::FILE* f = std::fopen(tmp.c_str(), "w");
      if (f == nullptr) return false;
      const bool ok = std::fwrite(out.data(), 1, out.size(), f) == out.size();
      if (std::fclose(f) != 0 || !ok || std::rename(tmp.c_str(), trace_file_.c_str()) != 0) {
        (void)std::remove(tmp.c_str());
        return false;
      }
      written_ = events_.size() + dropped_;
      return true;
    } catch (...) {
      return false;
    }
  }

  static void append_json_string(std::string& out, std::string_view s) {
    for (const char c : s) {
      if (c == '"' || c == '\\') {
        out += '\\';
        out += c;
      } else if (static_cast<unsigned char>(c) < 0x20) {
        char tmp[8];
        std::snprintf(tmp, sizeof tmp, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
        out += tmp;
      } else {
        out += c;
      }
    }
  }

  std::string log_file_;
  std::string trace_file_;
  int rank_;
  std::int64_t sys_minus_steady_ns_ = 0;
  std::mutex mu_;
  std::FILE* log_ = nullptr;
  std::string buf_;                  // log lines not yet written
  std::vector<std::string> tracks_;  // by tid
  std::vector<CommsEvent> events_;   // the trace
  std::size_t dropped_ = 0;
  std::size_t written_ = static_cast<std::size_t>(-1);  // events in the trace file now
};

/// One communicator's comms log and trace: on when COMM_COMMS_LOG or COMM_TRACE is set when the
/// communicator is made. Not thread-safe by itself: record() is called by the thread that runs the
/// communicator's operations (one at a time), finish() once they have all ended.
class CommsLog {
 public:
  using Clock = std::chrono::steady_clock;

  CommsLog() {
    if (auto v = getenv_str("COMM_COMMS_LOG"); v && !trim(*v).empty()) log_path_ = std::string(trim(*v));
    if (auto v = getenv_str("COMM_TRACE"); v && !trim(*v).empty()) trace_path_ = std::string(trim(*v));
    on_ = !log_path_.empty() || !trace_path_.empty();
  }
  CommsLog(const CommsLog&) = delete;
  CommsLog& operator=(const CommsLog&) = delete;
  ~CommsLog() { finish(); }

  /// The branch every operation pays when the log is off.
  [[nodiscard]] bool on() const noexcept { return on_; }
  /// The start of an operation (a clock read only when on).
  [[nodiscard]] Clock::time_point start() const noexcept { return on_ ? Clock::now() : Clock::time_point{}; }

  /// Opens this rank's files (shared with the rank's other communicators): `file_rank` names them,
  /// `rank`/`size` are this communicator's. Throws comm::InvalidArgument when a file cannot be
  /// written.
  void attach(const char* backend, int file_rank, int rank, int size, const std::string& name) {
    if (!on_) return;
    sink_ = CommsSink::get(log_path_.empty() ? std::string() : comms_log_file(log_path_, file_rank),
                           trace_path_.empty() ? std::string() : trace_file(trace_path_, file_rank), file_rank);
    label_ = std::string(backend) + (name.empty() ? std::string() : ":" + name);
    tid_ = sink_->add_track(label_);
    file_rank_ = file_rank;
    rank_ = rank;
    size_ = size;
  }

  /// Any operation: its description, traffic, sequence number, start and duration.
  void record(const OpDesc& d, Traffic t, std::uint64_t seq, Clock::time_point start, Clock::duration dur) noexcept {
    if (!sink_) return;
    try {
      CommsEvent e;
      e.op = op_name(d.kind);
      e.tid = tid_;
      e.dtype = d.dtype;
      e.peer = d.root;
      e.seq = seq & ~(std::uint64_t{1} << 63);  // a point-to-point operation's own count
      e.count = d.count;
      e.bytes = t.bytes;
      e.start_ns = sink_->to_epoch_ns(start);
      e.dur_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(dur).count();
      e.algbw = e.dur_ns > 0 ? static_cast<double>(t.bytes) / static_cast<double>(e.dur_ns) : 0.0;  // B/ns = GB/s
      e.busbw = e.algbw * t.bus_factor;
      sink_->add(e);
      // Programs repeat the same operation: the last row is looked up first.
      const Key key{d.kind, t.bytes};
      if (last_ == stats_.end() || !(last_->first == key)) last_ = stats_.try_emplace(key).first;
      Stat& s = last_->second;
      ++s.count;
      s.total_ns += e.dur_ns;
      s.bus_factor = t.bus_factor;
    } catch (...) {  // diagnostics never fail an operation (out of memory: the event is lost)
    }
  }

  /// Writes the summary (log on) and flushes this rank's files. Idempotent; never throws.
  void finish() noexcept {
    if (!sink_) return;
    try {
      if (!sink_->log_file().empty() && !stats_.empty()) {
        const std::string text = summary();
        sink_->add_text(text);
        if (file_rank_ == 0) std::fwrite(text.data(), 1, text.size(), stderr);
      }
    } catch (...) {
    }
    sink_->flush();
    sink_.reset();
  }

  /// The summary table by op and size ("#" lines), like DeepSpeed's log_summary.
  [[nodiscard]] std::string summary() const {
    std::string out = "# comms summary: " + label_ + ", rank " + std::to_string(rank_) + " of " +
                      std::to_string(size_) + "\n";
    char line[256];
    std::snprintf(line, sizeof line, "# %-18s %12s %9s %12s %12s %11s %11s\n", "op", "size", "count", "total_ms",
                  "avg_us", "algbw_GBps", "busbw_GBps");
    out += line;
    // By op name, then size.
    std::vector<std::pair<Key, Stat>> rows(stats_.begin(), stats_.end());
    std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) {
      const std::string_view x = op_name(a.first.kind), y = op_name(b.first.kind);
      return x != y ? x < y : a.first.bytes < b.first.bytes;
    });
    for (const auto& [k, s] : rows) {
      const double total_us = static_cast<double>(s.total_ns) / 1000.0;
      const double avg_us = total_us / static_cast<double>(s.count);
      const double algbw = avg_us > 0 ? static_cast<double>(k.bytes) / (avg_us * 1e-6) * 1e-9 : 0.0;
      std::snprintf(line, sizeof line, "# %-18s %12s %9llu %12.3f %12.3f %11.4g %11.4g\n", op_name(k.kind),
                    size_text(k.bytes).c_str(), static_cast<unsigned long long>(s.count), total_us / 1000.0,
                    avg_us, algbw, algbw * s.bus_factor);
      out += line;
    }
    return out;
  }

 private:
  struct Key {
    OpKind kind;
    std::uint64_t bytes;
    bool operator==(const Key&) const = default;
    bool operator<(const Key& o) const noexcept { return kind != o.kind ? kind < o.kind : bytes < o.bytes; }
  };
  struct Stat {
    std::uint64_t count = 0;
    std::int64_t total_ns = 0;
    double bus_factor = 0;
  };

  static std::string size_text(std::uint64_t b) {
    char tmp[32];
    if (b >= (std::uint64_t{1} << 30) && b % (std::uint64_t{1} << 30) == 0)
      std::snprintf(tmp, sizeof tmp, "%llu GiB", static_cast<unsigned long long>(b >> 30));
    else if (b >= (std::uint64_t{1} << 20) && b % (std::uint64_t{1} << 20) == 0)
      std::snprintf(tmp, sizeof tmp, "%llu MiB", static_cast<unsigned long long>(b >> 20));
    else if (b >= (std::uint64_t{1} << 10) && b % (std::uint64_t{1} << 10) == 0)
      std::snprintf(tmp, sizeof tmp, "%llu KiB", static_cast<unsigned long long>(b >> 10));
    else
      std::snprintf(tmp, sizeof tmp, "%llu B", static_cast<unsigned long long>(b));
    return tmp;
  }

  bool on_ = false;
  std::string log_path_;    // COMM_COMMS_LOG
  std::string trace_path_;  // COMM_TRACE
  std::shared_ptr<CommsSink> sink_;
  std::string label_;
  std::uint32_t tid_ = 0;
  int file_rank_ = 0;
  int rank_ = 0;
  int size_ = 1;
  std::map<Key, Stat> stats_;
  std::map<Key, Stat>::iterator last_ = stats_.end();  // the row of the previous operation
};

}  // namespace comm::detail
