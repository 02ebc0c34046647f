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
// (benchmarks/RESULTS.md, "memcpy at a distance of 1-15 bytes"; comm-bench-copy-distance). The
// other way round, copy_large_bytes puts a large copy that every rank makes at once on `rep movsb`
// in pieces.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace comm::detail {

/// Bytes per memcpy when the distance is short: below glibc's default rep_movsb threshold.
inline constexpr std::size_t kCopyPiece = 2048;
/// From here glibc leaves `rep movsb` on the VM measured (and pieces cost 30 % at 1 MiB).
inline constexpr std::size_t kCopyPiecesBelow = std::size_t{1} << 20;

/// From here copy_large_bytes goes in pieces of kLargeCopyPiece.
inline constexpr std::size_t kLargeCopyMin = std::size_t{16} << 20;
/// Below glibc's rep_movsb_stop_threshold (the L2 size, 1 MiB and up on the x86 CPUs that have
/// it), so that each piece goes on `rep movsb`.
inline constexpr std::size_t kLargeCopyPiece = std::size_t{256} << 10;
/// Whether `dst` lies 1-63 bytes past `src` modulo 4096, where `rep movsb` may slow down (1-15
/// measured slow; glibc itself treats up to 63 as short for another aliasing).
[[nodiscard]] inline bool short_copy_distance(const void* dst, const void* src) noexcept {
  const std::uintptr_t d = (reinterpret_cast<std::uintptr_t>(dst) - reinterpret_cast<std::uintptr_t>(src)) & 4095u;
  return d != 0 && d < 64;
}
/// Whether a forward copy from `src` to `dst` of `n` bytes goes in pieces: a short distance
/// (short_copy_distance) and a size `rep movsb` would take.
[[nodiscard]] inline bool copy_in_pieces(const void* dst, const void* src, std::size_t n) noexcept {
  // The size first: a small rooted step's few bytes pass with one comparison.
  if (n <= kCopyPiece || n >= kCopyPiecesBelow) return false;
  return short_copy_distance(dst, src);
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

/// copy_bytes for a large copy that every rank makes at the same time, each on its own core (an
/// all_gather's or all_to_all's own block by single copy, while the peers read the rank's input).
/// Above the core's L2 size glibc leaves `rep movsb` for a vector loop whose plain stores read each
/// destination line before writing it; `rep movsb` writes whole lines without reading them. With
/// every rank copying, memory is the limit: on this project's AMD EPYC VM two processes each
/// copying 64 MiB in step took 0.95x the time in 256 KiB pieces (2 MiB pieces, on the vector
/// loop: 1.11x), and the 2-rank 64 MiB all_gather and all_to_all 0.95-0.97x (one build, the pieces
/// switched by the environment; benchmarks/RESULTS.md, "Large copies in pieces below the L2
/// size"). From kLargeCopyMin only, where two ranks' sources and destinations outgrow a
/// last-level cache (32 MiB here; the 2-rank cells with 8 MiB blocks read 0.96-1.02x, no clear
/// gain), and not at a distance of 1-63 bytes, where `rep movsb` slows down: else copy_bytes.
inline void copy_large_bytes(void* dst, const void* src, std::size_t n) noexcept {
  if (n < kLargeCopyMin || short_copy_distance(dst, src)) return copy_bytes(dst, src, n);
  auto* o = static_cast<std::byte*>(dst);
  const auto* i = static_cast<const std::byte*>(src);
  for (std::size_t at = 0; at < n; at += kLargeCopyPiece) {
    std::size_t len = std::min(kLargeCopyPiece, n - at);
    asm("" : "+r"(len));  // as in copy_bytes: glibc's memcpy, not an inlined `rep movsq`
    std::memcpy(o + at, i + at, len);
  }
}

/// Whether [a, a + a_bytes) and [b, b + b_bytes) share a byte.
[[nodiscard]] inline bool ranges_overlap(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) noexcept {
  const auto pa = reinterpret_cast<std::uintptr_t>(a), pb = reinterpret_cast<std::uintptr_t>(b);
  return a_bytes != 0 && b_bytes != 0 && pa < pb + b_bytes && pb < pa + a_bytes;
}
/// Whether [dst, dst + n) and [src, src + n) share a byte.
[[nodiscard]] inline bool ranges_overlap(const void* dst, const void* src, std::size_t n) noexcept {
  return ranges_overlap(dst, n, src, n);
}

/// memmove of `n` bytes: overlapping ranges go to memmove as they are, others as copy_bytes.
inline void move_bytes(void* dst, const void* src, std::size_t n) noexcept {
  if (n == 0) return;
  if (ranges_overlap(dst, src, n))
    std::memmove(dst, src, n);
  else
    copy_bytes(dst, src, n);
}

/// move_bytes with copy_large_bytes for ranges that do not overlap.
inline void move_large_bytes(void* dst, const void* src, std::size_t n) noexcept {
  if (n != 0 && !ranges_overlap(dst, src, n)) return copy_large_bytes(dst, src, n);
  move_bytes(dst, src, n);
}

}  // namespace comm::detail
