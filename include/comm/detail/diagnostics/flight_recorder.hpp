#pragma once
// The flight recorder behind Communicator<B>::flight_record() (see <comm/diagnostics.hpp>): a
// fixed ring of the last N operations of one communicator, and the description of an operation
// (OpDesc) that it shares with the desync check. Backend-neutral: a backend records each
// operation when it is issued (under the lock that fixes its sequence number), started, completed
// or failed. Nothing is allocated per operation (the slots are preallocated; an error text is
// copied only on failure).
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
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
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

/// The recorder's lock: every operation takes it twice (issued and started, ended) on the thread
/// that runs it, and nobody else but an occasional snapshot (which copies the ring, so a waiter
/// may yield for microseconds).
using RecorderLock = YieldLock;

class FlightRecorder {
  using Clock = std::chrono::steady_clock;
  using Stamp = std::uint64_t;  // RecorderClock::now(); 0: not yet

 public:
  explicit FlightRecorder(std::size_t capacity) : slots_(capacity) { RecorderClock::prime(); }

  [[nodiscard]] std::size_t capacity() const noexcept { return slots_.size(); }

  /// Operation `seq` was issued. Sequence numbers must be given in increasing order.
  void issued(std::uint64_t seq, const OpDesc& d) noexcept { issue(seq, d, false); }
  /// Operation `seq` was issued and starts at once (a blocking call with nothing queued before
  /// it): one timestamp and one lock for both transitions.
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
    f.capacity = slots_.size();
    const RecorderClock::Reader steady_of;
    const auto steady_now = Clock::now();
    const auto sys_now = std::chrono::system_clock::now();
    auto wall = [&](Stamp stamp) {
      if (stamp == 0) return OpRecord::time_point{};
      return sys_now - std::chrono::duration_cast<std::chrono::system_clock::duration>(steady_now - steady_of(stamp));
    };
    std::lock_guard lock(mu_);
    f.total_ops = total_;
    if (slots_.empty()) return f;
    const std::uint64_t first = total_ > slots_.size() ? total_ - slots_.size() : 0;
    f.ops.reserve(static_cast<std::size_t>(total_ - first));
    for (std::uint64_t seq = first; seq < total_; ++seq) {
      const Slot& s = slots_[seq % slots_.size()];
      if (!s.used || s.seq != seq) continue;
      OpRecord r;
      r.seq = s.seq;
      r.op = op_name(s.desc.kind);
      r.dtype = dtype_from_code(s.desc.dtype);
      r.count = s.desc.count;
      r.root = s.desc.root;
      r.reduce = reduce_from_code(s.desc.reduce);
      r.custom_reduce = s.desc.reduce == OpDesc::custom;
      r.state = s.state;
      r.queued = wall(s.queued);
      r.started = wall(s.started);
      r.ended = wall(s.ended);
      r.error = s.error;
      f.ops.push_back(std::move(r));
    }
    return f;
  }

 private:
  struct Slot {
    std::uint64_t seq = 0;
    OpDesc desc;
    OpState state = OpState::queued;
    Stamp queued = 0, started = 0, ended = 0;
    std::string error;
    bool used = false;
  };

  void issue(std::uint64_t seq, const OpDesc& d, bool start) noexcept {
    if (slots_.empty()) return;
    const Stamp now = stamp();
    std::lock_guard lock(mu_);
    Slot& s = slots_[seq % slots_.size()];
    s.seq = seq;
    s.desc = d;
    s.state = start ? OpState::started : OpState::queued;
    s.queued = now;
    s.started = start ? now : 0;
    s.ended = 0;
    s.error.clear();  // keeps its capacity: no allocation
    s.used = true;
    total_ = seq + 1;
  }

  /// Never 0 (0 marks a transition not yet reached).
  [[nodiscard]] static Stamp stamp() noexcept {
    const Stamp t = RecorderClock::now();
    return t != 0 ? t : 1;
  }

  void transition(std::uint64_t seq, OpState to, const char* what) noexcept {
    if (slots_.empty()) return;
    const Stamp now = stamp();
    std::lock_guard lock(mu_);
    Slot& s = slots_[seq % slots_.size()];
    if (!s.used || s.seq != seq) return;  // overwritten by a newer operation
    s.state = to;
    // Never before the record's previous transition: with TSC stamps the transitions of one
    // operation may be read on two cores (queued by the caller, run by the worker).
    const Stamp at = std::max(now, std::max(s.queued, s.started));
    if (to == OpState::started)
      s.started = at;
    else
      s.ended = at;
    if (what != nullptr) {
      try {
        s.error = what;
      } catch (...) {  // out of memory: the state alone says it failed
      }
    }
  }

  mutable RecorderLock mu_;
  std::vector<Slot> slots_;
  std::uint64_t total_ = 0;
};

}  // namespace comm::detail
