#pragma once
// Copies between buffers whose addresses the caller does not choose: a user's buffer and Shm's
// segment, Gloo's frames, Mpi's receive slots, or another of the user's (an output's own block).
// Every engine copies with these. glibc's memcpy moves 2 KiB to ~1 MiB with `rep movsb` on x86 (on
// this project's AMD EPYC VM its x86_rep_movsb_threshold is 2,112 bytes; from the core's L2 size on
// it runs a vector loop), and there `rep movsb` took 16-33x as long when the destination lay 1-15
// bytes past the source modulo 4096: 32 KiB 9.5-11 us against 0.6, 256 KiB 75 against 4.6. A float
// buffer that starts 4, 8 or 12 bytes off the segment's 64-byte lines at the matching page offset
// (a subspan can) meets that distance on every call. In pieces of 2 KiB, each below the threshold,
// the copy stays on the vector loop and takes an aligned copy's time at any distance
// (benchmarks/RESULTS.md, "memcpy at a distance of 1-15 bytes"; comm-bench-copy-distance).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace comm::detail {

/// Bytes per memcpy when the distance is short: below glibc's default rep_movsb threshold.
inline constexpr std::size_t kCopyPiece = 2048;
/// From here glibc leaves `rep movsb` on the VM measured (and pieces cost 30 % at 1 MiB).
inline constexpr std::size_t kCopyPiecesBelow = std::size_t{1} << 20;

/// Whether a forward copy from `src` to `dst` of `n` bytes goes in pieces: a destination 1-63
/// bytes past the source modulo 4096 (1-15 measured slow; glibc itself treats up to 63 as short
/// for another aliasing), and a size `rep movsb` would take.
[[nodiscard]] inline bool copy_in_pieces(const void* dst, const void* src, std::size_t n) noexcept {
  // The size first: a small rooted step's few bytes pass with one comparison.
  if (n <= kCopyPiece || n >= kCopyPiecesBelow) return false;
  const std::uintptr_t d = (reinterpret_cast<std::uintptr_t>(dst) - reinterpret_cast<std::uintptr_t>(src)) & 4095u;
  return d != 0 && d < 64;
}

/// memcpy of `n` bytes (the ranges must not overlap); nothing for 0, where data() may be null.
inline void copy_bytes(void* dst, const void* src, std::size_t n) noexcept {
  if (n == 0) return;
  if (!copy_in_pieces(dst, src, n)) {
    std::memcpy(dst, src, n);
    return;
  }
  auto* o = static_cast<std::byte*>(dst);
  const auto* i = static_cast<const std::byte*>(src);
  for (std::size_t at = 0; at < n; at += kCopyPiece) {
    std::size_t len = std::min(kCopyPiece, n - at);
    // A length the compiler can bound is copied inline as `rep movsq`, which is as slow at these
    // distances (1.9 against 0.66 us for 32 KiB): the empty asm hides it, so glibc's memcpy runs.
    asm("" : "+r"(len));
    std::memcpy(o + at, i + at, len);
  }
}

/// memmove of `n` bytes: overlapping ranges go to memmove as they are, others as copy_bytes.
inline void move_bytes(void* dst, const void* src, std::size_t n) noexcept {
  if (n == 0) return;
  const auto o = reinterpret_cast<std::uintptr_t>(dst), i = reinterpret_cast<std::uintptr_t>(src);
  if (o < i + n && i < o + n)
    std::memmove(dst, src, n);
  else
    copy_bytes(dst, src, n);
}

}  // namespace comm::detail
