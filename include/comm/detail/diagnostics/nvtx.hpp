#pragma once
// NVTX ranges around comm's operations on GPU buffers, for Nsight Systems and other NVTX tools
// Each range is named
//
//   comm.<op> count=<n> type=<dtype> seq=<s>        e.g. "comm.all_reduce count=1024 type=float seq=7"
//
// in the NVTX domain "comm", with the element count as its uint64 payload. Where an operation's
// sequence number is not known (Gloo's device-buffer staging, whose hooks do not see it) the
// " seq=" field is replaced by " staged".
//
//   COMM_NVTX=1   ranges on. Read once per process, at the first operation; any other value, or
//                 none, is off. (reload() reads it again, for tests.)
//
// Header-only through the CUDA toolkit's NVTX3 headers (<nvtx3/nvToolsExt.h>,
// /usr/local/cuda/include/nvtx3): there is nothing to link, NVTX3 loads the tool's injection
// library (NVTX_INJECTION64_PATH, which nsys sets) at its first call, and without a tool every
// NVTX call returns at once. Where those headers are not on the include path (a Gloo-only build
// without the toolkit's include directory), or COMM_NO_NVTX is defined, everything here compiles
// to nothing and enabled() is a constant false.
//
// Cost when off: one relaxed load of a cached flag and one predictable branch per operation; no
// formatting and no NVTX call (benchmarks/RESULTS.md, "NVTX ranges", has the figures).
//
// Who uses it: the NCCL engine (detail/nccl/engine.hpp) pushes a range on the issuing thread around
// every operation's host side (desync check, stream ordering, the NCCL enqueue, and the host wait
// of a blocking barrier); Gloo's device-buffer staging (detail/gloo/device_staging.hpp) opens one
// on the executing thread before the copy-in and closes it after the copy-out (or when the
// operation is dropped after a failure).

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include <comm/types.hpp>

#if !defined(COMM_NO_NVTX) && defined(__has_include)
#if __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define COMM_NVTX_AVAILABLE 1
#endif
#endif
#ifndef COMM_NVTX_AVAILABLE
#define COMM_NVTX_AVAILABLE 0
#endif

namespace comm::detail::nvtx {

/// The process-wide switch: -1 COMM_NVTX not read yet, 0 off, 1 on. Constant-initialized, so it is
/// valid from any static initializer; shared by translation units built with and without NVTX.
inline std::atomic<int> state{-1};

/// The element type's name in messages ("float", "half", ...), "none" for an operation without one.
[[nodiscard]] constexpr std::string_view type_name(std::uint8_t dtype_code) noexcept {
  if (dtype_code > static_cast<std::uint8_t>(Dtype::float8_e5m2)) return "none";
  return to_string(static_cast<Dtype>(dtype_code));
}

/// Marks a range without a sequence number (see the header comment).
inline constexpr std::uint64_t no_seq = ~std::uint64_t{0};

/// Writes "comm.<op> count=<n> type=<type> seq=<s>" (" staged" for no_seq) into `buf`, truncated
/// to `cap` - 1 characters and always terminated; returns the length written.
inline std::size_t format_label(char* buf, std::size_t cap, std::string_view op, std::uint64_t count,
                                std::string_view type, std::uint64_t seq) noexcept {
  if (cap == 0) return 0;
  const int n =
      seq == no_seq
          ? std::snprintf(buf, cap, "comm.%.*s count=%llu type=%.*s staged", static_cast<int>(op.size()), op.data(),
                          static_cast<unsigned long long>(count), static_cast<int>(type.size()), type.data())
          : std::snprintf(buf, cap, "comm.%.*s count=%llu type=%.*s seq=%llu", static_cast<int>(op.size()), op.data(),
                          static_cast<unsigned long long>(count), static_cast<int>(type.size()), type.data(),
                          static_cast<unsigned long long>(seq));
  if (n < 0) {
    buf[0] = '\0';
    return 0;
  }
  return static_cast<std::size_t>(n) < cap ? static_cast<std::size_t>(n) : cap - 1;
}

/// The same as a string (tests, messages).
[[nodiscard]] inline std::string message(std::string_view op, std::uint64_t count, std::uint8_t dtype_code,
                                         std::uint64_t seq) {
  char buf[192];
  const std::size_t n = format_label(buf, sizeof buf, op, count, type_name(dtype_code), seq);
  return std::string(buf, n);
}

// Translation units built with and without the NVTX headers get different names for what differs
// (no ODR clash when a program mixes both).
#if COMM_NVTX_AVAILABLE
inline namespace with_nvtx3 {
#else
inline namespace without_nvtx {
#endif

/// Whether this translation unit can emit ranges (the NVTX3 headers were found).
inline constexpr bool compiled_in = COMM_NVTX_AVAILABLE != 0;

/// Reads COMM_NVTX again and returns whether ranges are now on (always false when not compiled in).
inline bool reload() noexcept {
  const char* v = std::getenv("COMM_NVTX");
  const bool on = v != nullptr && v[0] == '1' && v[1] == '\0';
  state.store(on ? 1 : 0, std::memory_order_relaxed);
  return compiled_in && on;
}

[[gnu::cold, gnu::noinline]] inline bool first_read() noexcept { return reload(); }

/// Whether ranges are on: COMM_NVTX=1 and compiled in. Off: one load and one predictable branch.
[[nodiscard]] inline bool enabled() noexcept {
  if constexpr (!compiled_in) {
    return false;
  } else {
    const int s = state.load(std::memory_order_relaxed);
    if (s == 0) [[likely]]
      return false;
    return s > 0 || first_read();
  }
}

#if COMM_NVTX_AVAILABLE
namespace impl {

/// The domain "comm" (made at the first range; NVTX3 loads the tool, if any, then).
inline nvtxDomainHandle_t domain() noexcept {
  static const nvtxDomainHandle_t d = nvtxDomainCreateA("comm");
  return d;
}

inline nvtxEventAttributes_t attributes(const char* text, std::uint64_t count) noexcept {
  nvtxEventAttributes_t a{};
  a.version = NVTX_VERSION;
  a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  a.messageType = NVTX_MESSAGE_TYPE_ASCII;
  a.message.ascii = text;
  a.payloadType = NVTX_PAYLOAD_TYPE_UNSIGNED_INT64;
  a.payload.ullValue = count;
  return a;
}

// Out of line and cold: the call sites keep only the branch.
[[gnu::cold, gnu::noinline]] inline void push(const char* op, std::uint64_t count, std::uint8_t type,
                                              std::uint64_t seq) noexcept {
  char buf[192];
  (void)format_label(buf, sizeof buf, op, count, type_name(type), seq);
  const nvtxEventAttributes_t a = attributes(buf, count);
  (void)nvtxDomainRangePushEx(domain(), &a);
}

[[gnu::cold, gnu::noinline]] inline void pop() noexcept { (void)nvtxDomainRangePop(domain()); }

[[gnu::cold, gnu::noinline]] inline std::uint64_t start(const char* op, std::uint64_t count, std::uint8_t type,
                                                        std::uint64_t seq) noexcept {
  char buf[192];
  (void)format_label(buf, sizeof buf, op, count, type_name(type), seq);
  const nvtxEventAttributes_t a = attributes(buf, count);
  return nvtxDomainRangeStartEx(domain(), &a);
}

[[gnu::cold, gnu::noinline]] inline void end(std::uint64_t id) noexcept { nvtxDomainRangeEnd(domain(), id); }

}  // namespace impl
#endif

/// A push/pop range on the calling thread, for an operation whose host side is one scope: push()
/// (at most once) after the sequence number is known; popped when the object goes.
class ScopedRange {
 public:
  ScopedRange() noexcept = default;
  ScopedRange(const char* op, std::uint64_t count, std::uint8_t dtype_code, std::uint64_t seq) noexcept {
    push(op, count, dtype_code, seq);
  }
  ScopedRange(const ScopedRange&) = delete;
  ScopedRange& operator=(const ScopedRange&) = delete;
  ~ScopedRange() {
#if COMM_NVTX_AVAILABLE
    if (pushed_) [[unlikely]]
      impl::pop();
#endif
  }

  void push([[maybe_unused]] const char* op, [[maybe_unused]] std::uint64_t count,
            [[maybe_unused]] std::uint8_t dtype_code, [[maybe_unused]] std::uint64_t seq) noexcept {
#if COMM_NVTX_AVAILABLE
    if (enabled()) [[unlikely]] {
      impl::push(op, count, dtype_code, seq);
      pushed_ = true;
    }
#endif
  }

 private:
  [[maybe_unused]] bool pushed_ = false;
};

/// A start/end range, which may end on another thread than the one that started it; the
/// destructor ends one still open (an operation dropped after a failure).
class Range {
 public:
  Range() noexcept = default;
  Range(const Range&) = delete;
  Range& operator=(const Range&) = delete;
  ~Range() { end(); }

  void start([[maybe_unused]] const char* op, [[maybe_unused]] std::uint64_t count,
             [[maybe_unused]] std::uint8_t dtype_code, [[maybe_unused]] std::uint64_t seq = no_seq) noexcept {
#if COMM_NVTX_AVAILABLE
    if (enabled() && !open_) [[unlikely]] {
      id_ = impl::start(op, count, dtype_code, seq);
      open_ = true;
    }
#endif
  }
  void end() noexcept {
#if COMM_NVTX_AVAILABLE
    if (open_) [[unlikely]] {
      open_ = false;
      impl::end(id_);
    }
#endif
  }
  [[nodiscard]] bool open() const noexcept { return open_; }

 private:
  [[maybe_unused]] std::uint64_t id_ = 0;
  bool open_ = false;
};

}  // inline namespace with_nvtx3 / without_nvtx
}  // namespace comm::detail::nvtx
