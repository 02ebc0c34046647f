#pragma once
// The flight recorder behind Communicator<B>::flight_record() (see <comm/diagnostics.hpp>): a
// fixed ring of the last N operations of one communicator, and the description of an operation
// (OpDesc) that it shares with the desync check. Backend-neutral: a backend records each
// operation when it is issued (under the lock that fixes its sequence number), started, completed
// or failed. Nothing is allocated per operation (the slots are preallocated; an error text is
// copied only on failure). Where the backend runs one operation at a time (every engine on
// EngineCore) the writes take no lock: a per-call lock's exchange and the second clock read were
// each ~0.01 us of a 2-rank 8-byte Shm broadcast of 0.18 us (benchmarks/RESULTS.md, "The flight
// recorder without a lock").
//
// Its timestamps are the largest part of an operation's fixed cost if taken with steady_clock:
// each read is ~55 ns through the vDSO on a VM (benchmarks/RESULTS.md, "The engine core's per-call
// cost"; 34 ns under kvm-clock, 2026-12-02), against ~14-20 ns for the TSC. So where the kernel's
// clock is the TSC itself or kvm-clock over an invariant TSC (RecorderClock::tsc() says why) the
// slots hold raw TSC ticks, turned into steady_clock times only when a snapshot is taken.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif

#include <comm/detail/base/env.hpp>
#include <comm/detail/base/yield_lock.hpp>
#include <comm/detail/base/logging.hpp>
#include <comm/diagnostics.hpp>
#include <comm/error.hpp>
#include <comm/types.hpp>

namespace comm::detail {

/// Point-to-point operations involve two ranks, not the whole group: they take no collective
/// sequence number (see OpQueue) and are never in the desync check's all-rank exchange.
[[nodiscard]] constexpr bool is_p2p(OpKind k) noexcept {
  return k == OpKind::send || k == OpKind::recv || k == OpKind::p2p_batch;
}

[[nodiscard]] constexpr const char* op_name(OpKind k) noexcept { return to_string(k).data(); }

template <class T>
[[nodiscard]] constexpr std::uint8_t dtype_code() noexcept {
  return static_cast<std::uint8_t>(dtype_of<T>);
}

[[nodiscard]] inline std::optional<Dtype> dtype_from_code(std::uint8_t c) noexcept {
  if (c > static_cast<std::uint8_t>(Dtype::float8_e5m2)) return std::nullopt;
  return static_cast<Dtype>(c);
}
[[nodiscard]] inline std::optional<ReduceOp> reduce_from_code(std::uint8_t c) noexcept {
  if (c > static_cast<std::uint8_t>(ReduceOp::bxor)) return std::nullopt;
  return static_cast<ReduceOp>(c);
}

/// "all_reduce(float x4, sum)" for an OpDesc.
[[nodiscard]] inline std::string describe_call(const OpDesc& d) {
  return describe_call(op_name(d.kind), dtype_from_code(d.dtype), d.count, d.root, reduce_from_code(d.reduce),
                       d.reduce == OpDesc::custom);
}

/// COMM_FLIGHT_RECORDER_SIZE, else 256.
[[nodiscard]] inline std::size_t flight_recorder_size_default() {
  const auto n = env_nonneg_int("COMM_FLIGHT_RECORDER_SIZE");
  return n ? static_cast<std::size_t>(*n) : std::size_t{256};
}

/// COMM_FLIGHT_RECORDER (the path prefix of automatic dumps), or "".
[[nodiscard]] inline std::string flight_recorder_path() {
  auto v = getenv_str("COMM_FLIGHT_RECORDER");
  return v ? std::string(trim(*v)) : std::string();
}

/// Writes `text` to `path` ("-": stderr). Throws comm::BackendError naming the path on failure.
inline void write_text_file(const std::string& path, const std::string& text, int rank) {
  if (path == "-") {
    std::fwrite(text.data(), 1, text.size(), stderr);
    return;
  }
  std::ofstream f(path, std::ios::out | std::ios::trunc);
  if (f) f << text;
  if (f) f.flush();
  if (!f) throw BackendError("dump_flight_record", rank, "cannot write the flight record to '" + path + "'");
}

/// The flight recorder's clock: raw TSC ticks where the kernel's clock is read from the TSC (see
/// tsc()), else steady_clock nanoseconds. A tick becomes a steady_clock time by the line through two
/// (steady_clock, TSC) pairs: one taken when the process first recorded an operation, one when the
/// snapshot is taken; a time between them is placed to within about the two reads' duration
/// (~0.1 us), whatever their distance, and the order of times is kept.
class RecorderClock {
 public:
  using Steady = std::chrono::steady_clock;

  [[nodiscard]] static std::uint64_t now() noexcept {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (tsc()) return __builtin_ia32_rdtsc();
#endif
    return static_cast<std::uint64_t>(Steady::now().time_since_epoch().count());
  }

  /// Turns stamps of now() into steady_clock times; built once per snapshot.
  class Reader {
   public:
    Reader() noexcept {
      if (!tsc()) return;
      const Anchor& a = anchor();
      const Anchor b = Anchor::take();
      base_ = a.steady;
      from_ = a.ticks;
      const double span = static_cast<double>(b.ticks - a.ticks);
      per_tick_ = b.ticks > a.ticks ? static_cast<double>((b.steady - a.steady).count()) / span : 0.0;
    }
    [[nodiscard]] Steady::time_point operator()(std::uint64_t stamp) const noexcept {
      if (!tsc()) return Steady::time_point(Steady::duration(static_cast<Steady::rep>(stamp)));
      // Signed: a stamp taken on another core may read a few ticks before the anchor.
      const double ticks = static_cast<double>(static_cast<std::int64_t>(stamp - from_));
      return base_ + Steady::duration(static_cast<Steady::rep>(std::floor(ticks * per_tick_)));
    }

   private:
    Steady::time_point base_{};
    std::uint64_t from_ = 0;
    double per_tick_ = 0.0;
  };

  /// The first (steady_clock, TSC) pair; taken at the first recorder's construction.
  static void prime() noexcept {
    if (tsc()) (void)anchor();
  }

 private:
  struct Anchor {
    Steady::time_point steady;
    std::uint64_t ticks = 0;
    static Anchor take() noexcept {
      Anchor a;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
      a.ticks = __builtin_ia32_rdtsc();
#endif
      a.steady = Steady::now();
      return a;
    }
  };
  static const Anchor& anchor() noexcept {
    static const Anchor a = Anchor::take();
    return a;
  }
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  /// CPUID's invariant-TSC bit: the TSC counts at one rate in every power state.
  static bool invariant_tsc() noexcept {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_max(0x80000000u, nullptr) < 0x80000007u) return false;
    __cpuid(0x80000007u, a, b, c, d);
    return ((d >> 8) & 1u) != 0;
  }
#endif
  /// Whether the kernel's clock is read from the TSC (decided once per process): clocksource
  /// "tsc" (invariant and synchronized across cores, or the kernel would not use it), or
  /// "kvm-clock" on a CPU whose TSC is invariant (CPUID 0x80000007, EDX bit 8). kvm-clock's own
  /// read in the vDSO is the TSC scaled by the hypervisor's parameters, so its stamps follow the
  /// TSC by a line, which is how Reader converts them; a VM booted with tsc=unstable (Firecracker's
  /// guests are) keeps kvm-clock as its clocksource while its TSC still counts at one rate. The
  /// vCPUs' TSCs differed by 60-120 ns in a two-thread ping-pong on such a guest (2026-12-02),
  /// inside the ~0.1 us the conversion promises; transition() keeps each record's times in order.
  static bool tsc() noexcept {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && defined(__linux__)
    static const bool on = [] {
      std::FILE* f = std::fopen("/sys/devices/system/clocksource/clocksource0/current_clocksource", "r");
      if (f == nullptr) return false;
      char buf[16] = {};
      const std::size_t n = std::fread(buf, 1, sizeof buf - 1, f);
      std::fclose(f);
      const std::string_view source = trim(std::string_view(buf, n));
      if (source == "tsc") return true;
      return source == "kvm-clock" && invariant_tsc();
    }();
    return on;
#else
    return false;
#endif
  }
};

/// The recorder's lock: taken by every write where a recorder's writers may overlap
/// (Writers::any), and around error texts and snapshots.
using RecorderLock = YieldLock;

class FlightRecorder {
  using Clock = std::chrono::steady_clock;
  using Stamp = std::uint64_t;  // RecorderClock::now(); 0: not yet

 public:
  /// Who writes a record. `one_at_a_time`: issues never overlap each other and at most one
  /// operation runs at a time, as in OpQueue (issues under its lock, one operation running): the
  /// writes take no lock, only a snapshot does (it reads each record under the record's version
  /// count, retrying a record that changed while it read it). `any`: transitions may come from
  /// other threads at any time (NCCL's watchdog), so every write takes the lock.
  enum class Writers { one_at_a_time, any };

  explicit FlightRecorder(std::size_t capacity, Writers writers = Writers::any)
      : slots_(capacity == 0 ? nullptr : std::make_unique<Slot[]>(capacity)),
        capacity_(capacity),
        mask_(capacity != 0 && (capacity & (capacity - 1)) == 0 ? capacity - 1 : 0),
        locked_(writers == Writers::any) {
    RecorderClock::prime();
  }

  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }

  /// Operation `seq` was issued. Sequence numbers must be given in increasing order. A record
  /// whose operation has not ended (queued or started `capacity` operations ago) is kept, and
  /// the new operation goes unrecorded: an operation that hangs stays in the record.
  void issued(std::uint64_t seq, const OpDesc& d) noexcept { issue(seq, d, false); }
  /// Operation `seq` was issued and starts at once (a blocking call with nothing queued before
  /// it): one timestamp for both transitions.
  void issued_started(std::uint64_t seq, const OpDesc& d) noexcept { issue(seq, d, true); }

  void started(std::uint64_t seq) noexcept { transition(seq, OpState::started, nullptr); }
  void completed(std::uint64_t seq) noexcept { transition(seq, OpState::completed, nullptr); }
  void failed(std::uint64_t seq, const char* what) noexcept { transition(seq, OpState::failed, what); }

  /// The recorded operations, oldest first, with wall-clock times.
  [[nodiscard]] FlightRecord snapshot(std::string backend, int rank, int size, std::string name) const {
    FlightRecord f;
    f.backend = std::move(backend);
    f.rank = rank;
    f.size = size;
    f.name = std::move(name);
    f.capacity = capacity_;
    const RecorderClock::Reader steady_of;
    const auto steady_now = Clock::now();
    const auto sys_now = std::chrono::system_clock::now();
    auto wall = [&](Stamp stamp) {
      if (stamp == 0) return OpRecord::time_point{};
      return sys_now - std::chrono::duration_cast<std::chrono::system_clock::duration>(steady_now - steady_of(stamp));
    };
    // The lock holds the error texts still (and, with Writers::any, every record).
    std::lock_guard lock(mu_);
    const std::uint64_t total = total_.load(std::memory_order_acquire);
    f.total_ops = total;
    if (capacity_ == 0) return f;
    // The ring holds the last `capacity` operations, except where one of them went unrecorded
    // to keep an older one still in flight (issue()): each record in the order of its number.
    std::vector<std::pair<Copy, const Slot*>> held;
    held.reserve(std::min<std::uint64_t>(total, capacity_));
    for (std::size_t i = 0; i < capacity_; ++i) {
      Copy c;
      if (read(slots_[i], c) && c.seq < total) held.emplace_back(c, &slots_[i]);
    }
    std::sort(held.begin(), held.end(), [](const auto& a, const auto& b) { return a.first.seq < b.first.seq; });
    f.ops.reserve(held.size());
    for (const auto& [c, slot] : held) {
      const Slot& s = *slot;
      OpRecord r;
      r.seq = c.seq;
      r.op = op_name(c.desc.kind);
      r.dtype = dtype_from_code(c.desc.dtype);
      r.count = c.desc.count;
      r.root = c.desc.root;
      r.reduce = reduce_from_code(c.desc.reduce);
      r.custom_reduce = c.desc.reduce == OpDesc::custom;
      r.state = c.state;
      r.queued = wall(c.queued);
      r.started = wall(c.started);
      r.ended = wall(c.ended);
      if (c.has_error) r.error = s.error;
      f.ops.push_back(std::move(r));
    }
    return f;
  }

 private:
  static constexpr std::uint64_t kUnused = ~std::uint64_t{0};

  // Every field but the error text is an atomic word. A writer makes `version` odd, stores the
  // fields (release) and makes it even again (release); a snapshot loads it (acquire), the fields
  // (acquire) and it again: the same even version both times means no writer touched the record
  // in between (a field it saw from a later write would carry the odd version with it). On x86
  // none of this is a locked instruction. The text is written and read under mu_ only, on failure.
  struct Slot {
    std::atomic<std::uint64_t> version{0};
    std::atomic<std::uint64_t> seq{kUnused};
    std::atomic<std::uint64_t> head{0};  // kind, dtype, reduce, root (pack())
    std::atomic<std::uint64_t> count{0};
    std::atomic<std::uint64_t> queued{0}, started{0}, ended{0};
    std::atomic<std::uint8_t> state{static_cast<std::uint8_t>(OpState::queued)};
    std::atomic<bool> has_error{false};
    std::string error;
  };

  struct Copy {
    std::uint64_t seq = kUnused;
    OpDesc desc;
    OpState state = OpState::queued;
    Stamp queued = 0, started = 0, ended = 0;
    bool has_error = false;
  };

  [[nodiscard]] static std::uint64_t pack(const OpDesc& d) noexcept {
    return static_cast<std::uint64_t>(d.kind) | std::uint64_t{d.dtype} << 8 | std::uint64_t{d.reduce} << 16 |
           std::uint64_t{static_cast<std::uint32_t>(d.root)} << 32;
  }
  [[nodiscard]] static OpDesc unpack(std::uint64_t head, std::uint64_t count) noexcept {
    OpDesc d;
    d.kind = static_cast<OpKind>(head & 0xff);
    d.dtype = static_cast<std::uint8_t>(head >> 8);
    d.reduce = static_cast<std::uint8_t>(head >> 16);
    d.root = static_cast<int>(static_cast<std::uint32_t>(head >> 32));
    d.count = count;
    return d;
  }

  /// One writer's turn at a record (the caller makes sure there is one at a time).
  class Writing {
   public:
    explicit Writing(Slot& s) noexcept : s_(s), v_(s.version.load(std::memory_order_relaxed)) {
      s_.version.store(v_ + 1, std::memory_order_relaxed);
    }
    ~Writing() { s_.version.store(v_ + 2, std::memory_order_release); }
    Writing(const Writing&) = delete;
    Writing& operator=(const Writing&) = delete;

   private:
    Slot& s_;
    std::uint64_t v_;
  };

  /// Copies `s` whole; false if a writer kept changing it (it is then left out of the snapshot:
  /// a writer is inside a record for tens of nanoseconds, so that takes a preempted writer).
  [[nodiscard]] static bool read(const Slot& s, Copy& c) noexcept {
    for (int attempt = 0; attempt < 1000; ++attempt) {
      const std::uint64_t v = s.version.load(std::memory_order_acquire);
      if ((v & 1) != 0) {
        std::this_thread::yield();
        continue;
      }
      c.seq = s.seq.load(std::memory_order_acquire);
      c.desc = unpack(s.head.load(std::memory_order_acquire), s.count.load(std::memory_order_acquire));
      c.state = static_cast<OpState>(s.state.load(std::memory_order_acquire));
      c.queued = s.queued.load(std::memory_order_acquire);
      c.started = s.started.load(std::memory_order_acquire);
      c.ended = s.ended.load(std::memory_order_acquire);
      c.has_error = s.has_error.load(std::memory_order_acquire);
      if (s.version.load(std::memory_order_relaxed) == v) return true;
    }
    return false;
  }

  /// Operation `seq`'s record. A power-of-two capacity (the default, 256) takes a mask: a 64-bit
  /// division was a tenth of a recorded 8-byte Shm call's time (benchmarks/RESULTS.md, "The
  /// operation queue without a lock on the calling thread").
  [[nodiscard]] Slot& slot(std::uint64_t seq) noexcept {
    return slots_[mask_ != 0 || capacity_ == 1 ? seq & mask_ : seq % capacity_];
  }

  [[nodiscard]] static bool ended(OpState st) noexcept { return st == OpState::completed || st == OpState::failed; }

  void issue(std::uint64_t seq, const OpDesc& d, bool start) noexcept {
    if (capacity_ == 0) return;
    const Stamp now = stamp();
    std::unique_lock lock(mu_, std::defer_lock);
    if (locked_) lock.lock();
    Slot& s = slot(seq);
    // The operation `capacity` back may still run on another thread: its record is reused only
    // once its writer has left it ended. The state is read as read() reads a record, between two
    // loads of the version: an ended state stored by a write still in progress (its version not
    // yet even again) shows as a changed version, and the record counts as in flight. Reusing it
    // then would have had two writers in the record at once, and their version stores crossing
    // leave it odd for good (every later issue into it skipped, every snapshot without it).
    const std::uint64_t v = s.version.load(std::memory_order_acquire);
    const auto prev = static_cast<OpState>(s.state.load(std::memory_order_acquire));
    const bool settled = (v & 1) == 0 && s.version.load(std::memory_order_acquire) == v;
    if (s.seq.load(std::memory_order_relaxed) != kUnused && (!settled || !ended(prev))) {
      total_.store(seq + 1, std::memory_order_release);
      return;
    }
    const bool clear_error = s.has_error.load(std::memory_order_relaxed);
    if (clear_error && !lock.owns_lock()) lock.lock();  // the text changes: not under a snapshot
    {
      const Writing w(s);
      s.seq.store(seq, std::memory_order_release);
      s.head.store(pack(d), std::memory_order_release);
      s.count.store(d.count, std::memory_order_release);
      s.queued.store(now, std::memory_order_release);
      s.started.store(start ? now : 0, std::memory_order_release);
      s.ended.store(0, std::memory_order_release);
      if (clear_error) {
        s.error.clear();  // keeps its capacity: no allocation
        s.has_error.store(false, std::memory_order_release);
      }
      s.state.store(static_cast<std::uint8_t>(start ? OpState::started : OpState::queued), std::memory_order_release);
    }
    total_.store(seq + 1, std::memory_order_release);
  }

  /// Never 0 (0 marks a transition not yet reached).
  [[nodiscard]] static Stamp stamp() noexcept {
    const Stamp t = RecorderClock::now();
    return t != 0 ? t : 1;
  }

  void transition(std::uint64_t seq, OpState to, const char* what) noexcept {
    if (capacity_ == 0) return;
    const Stamp now = stamp();
    std::unique_lock lock(mu_, std::defer_lock);
    if (locked_ || what != nullptr) lock.lock();
    Slot& s = slot(seq);
    // Not recorded (its slot held an unfinished operation when it was issued), or overwritten.
    if (s.seq.load(std::memory_order_relaxed) != seq) return;
    {
      const Writing w(s);
      // Never before the record's previous transition: with TSC stamps the transitions of one
      // operation may be read on two cores (queued by the caller, run by the worker).
      const Stamp at = std::max(now, std::max(s.queued.load(std::memory_order_relaxed),
                                              s.started.load(std::memory_order_relaxed)));
      if (to == OpState::started)
        s.started.store(at, std::memory_order_release);
      else
        s.ended.store(at, std::memory_order_release);
      if (what != nullptr) {
        try {
          s.error = what;
          s.has_error.store(true, std::memory_order_release);
        } catch (...) {  // out of memory: the state alone says it failed
        }
      }
      s.state.store(static_cast<std::uint8_t>(to), std::memory_order_release);
    }  // the version's release store: from here an issue may reuse the record
  }

  mutable RecorderLock mu_;
  std::unique_ptr<Slot[]> slots_;
  std::size_t capacity_;
  std::size_t mask_;  // capacity_ - 1 where that is a power of two (and 1), else 0
  bool locked_;
  std::atomic<std::uint64_t> total_{0};
};

}  // namespace comm::detail
