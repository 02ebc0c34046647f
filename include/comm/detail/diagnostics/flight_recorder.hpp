#pragma once
// The flight recorder behind Communicator<B>::flight_record() (see <comm/diagnostics.hpp>): a
// fixed ring of the last N operations of one communicator, and the description of an operation
// (OpDesc) that it shares with the desync check. Backend-neutral: a backend records each
// operation when it is issued (under the lock that fixes its sequence number), started, completed
// or failed. Nothing is allocated per operation (the slots are preallocated; an error text is
// copied only on failure).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <comm/detail/base/env.hpp>
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

class FlightRecorder {
  using Clock = std::chrono::steady_clock;

 public:
  explicit FlightRecorder(std::size_t capacity) : slots_(capacity) {}

  [[nodiscard]] std::size_t capacity() const noexcept { return slots_.size(); }

  /// Operation `seq` was issued. Sequence numbers must be given in increasing order.
  void issued(std::uint64_t seq, const OpDesc& d) noexcept {
    if (slots_.empty()) return;
    const auto now = Clock::now();
    std::lock_guard lock(mu_);
    Slot& s = slots_[seq % slots_.size()];
    s.seq = seq;
    s.desc = d;
    s.state = OpState::queued;
    s.queued = now;
    s.started = s.ended = Clock::time_point{};
    s.error.clear();  // keeps its capacity: no allocation
    s.used = true;
    total_ = seq + 1;
  }

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
    const auto steady_now = Clock::now();
    const auto sys_now = std::chrono::system_clock::now();
    auto wall = [&](Clock::time_point t) {
      if (t == Clock::time_point{}) return OpRecord::time_point{};
      return sys_now - std::chrono::duration_cast<std::chrono::system_clock::duration>(steady_now - t);
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
    Clock::time_point queued, started, ended;
    std::string error;
    bool used = false;
  };

  void transition(std::uint64_t seq, OpState to, const char* what) noexcept {
    if (slots_.empty()) return;
    const auto now = Clock::now();
    std::lock_guard lock(mu_);
    Slot& s = slots_[seq % slots_.size()];
    if (!s.used || s.seq != seq) return;  // overwritten by a newer operation
    s.state = to;
    if (to == OpState::started)
      s.started = now;
    else
      s.ended = now;
    if (what != nullptr) {
      try {
        s.error = what;
      } catch (...) {  // out of memory: the state alone says it failed
      }
    }
  }

  mutable std::mutex mu_;
  std::vector<Slot> slots_;
  std::uint64_t total_ = 0;
};

}  // namespace comm::detail
