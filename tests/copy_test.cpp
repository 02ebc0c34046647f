// comm::detail::copy_bytes and move_bytes (detail/base/copy.hpp): at every distance modulo 4096
// from 0 to 70 and past 4096 - 70, sizes around the pieces' bounds, the destination holds the
// source's bytes and nothing around it changed; overlapping moves in both directions. The same for
// copy_large_bytes and move_large_bytes around kLargeCopyMin, with a last piece shorter than the
// others, at distances that take the pieces and at ones that do not.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include <comm/detail/base/copy.hpp>

namespace {

// A buffer of `bytes` with `guard` bytes either side, filled from `seed`.
std::vector<unsigned char> pattern(std::size_t bytes, unsigned seed) {
  std::vector<unsigned char> v(bytes);
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1u;
  for (std::size_t at = 0; at < bytes; at += sizeof x) {  // eight bytes a step: MiB-sized cases stay quick
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(v.data() + at, &x, std::min(sizeof x, bytes - at));
  }
  return v;
}

constexpr std::size_t kGuard = 64;

enum class How { copy, move, copy_large, move_large };

// Copies `n` bytes between two places `dist` bytes apart modulo 4096 and checks every byte.
bool copies_right(std::size_t n, std::size_t dist, How how) {
  const std::size_t span = n + 2 * 4096 + 2 * kGuard;
  std::vector<unsigned char> src_buf = pattern(span, static_cast<unsigned>(n + dist));
  std::vector<unsigned char> dst_buf = pattern(span, static_cast<unsigned>(n * 7 + dist + 1));
  const std::vector<unsigned char> dst_before = dst_buf;
  // Both starts at the same offset within a page, then the destination `dist` further.
  const auto base_of = [](std::vector<unsigned char>& v) {
    const auto a = reinterpret_cast<std::uintptr_t>(v.data()) + kGuard;
    return static_cast<std::size_t>((4096 - (a & 4095u)) & 4095u) + kGuard;
  };
  const std::size_t s0 = base_of(src_buf) + 100;
  const std::size_t d0 = base_of(dst_buf) + 100 + dist;
  unsigned char* const dst = dst_buf.data() + d0;
  const unsigned char* const src = src_buf.data() + s0;
  switch (how) {
    case How::copy: comm::detail::copy_bytes(dst, src, n); break;
    case How::move: comm::detail::move_bytes(dst, src, n); break;
    case How::copy_large: comm::detail::copy_large_bytes(dst, src, n); break;
    case How::move_large: comm::detail::move_large_bytes(dst, src, n); break;
  }
  const auto got = (reinterpret_cast<std::uintptr_t>(dst_buf.data() + d0) -
                    reinterpret_cast<std::uintptr_t>(src_buf.data() + s0)) & 4095u;
  if (got != dist % 4096) return false;
  // Before the destination, the destination itself, after it.
  return std::memcmp(dst_buf.data(), dst_before.data(), d0) == 0 && (n == 0 || std::memcmp(dst, src, n) == 0) &&
         std::memcmp(dst_buf.data() + d0 + n, dst_before.data() + d0 + n, span - d0 - n) == 0;
}

}  // namespace

TEST_CASE("copy_bytes: every short distance and size around the pieces moves the source's bytes exactly") {
  const std::size_t sizes[] = {0, 1, 63, 2047, 2048, 2049, 4096, 6000, 32768 + 12, 300001};
  std::vector<std::size_t> dists;
  for (std::size_t d = 0; d <= 70; ++d) dists.push_back(d);
  for (std::size_t d = 4096 - 70; d < 4096; d += 3) dists.push_back(d);
  for (const bool move : {false, true})
    for (const std::size_t n : sizes)
      for (const std::size_t d : dists) {
        INFO("bytes ", n, ", distance ", d, move ? ", move_bytes" : ", copy_bytes");
        REQUIRE(copies_right(n, d, move ? How::move : How::copy));
      }
}

TEST_CASE("copy_large_bytes: below, at and above the large size, in pieces or not by the distance") {
  using comm::detail::kLargeCopyMin;
  using comm::detail::kLargeCopyPiece;
  const std::size_t sizes[] = {kLargeCopyMin - 4, kLargeCopyMin, kLargeCopyMin + 3 * kLargeCopyPiece + 12345};
  for (const How how : {How::copy_large, How::move_large})
    for (const std::size_t n : sizes)
      for (const std::size_t d : {std::size_t{0}, std::size_t{4}, std::size_t{64}, std::size_t{4000}}) {
        INFO("bytes ", n, ", distance ", d, how == How::move_large ? ", move_large_bytes" : ", copy_large_bytes");
        REQUIRE(copies_right(n, d, how));
      }
}

TEST_CASE("copy_in_pieces: only a destination 1-63 bytes past the source, from above one piece to below 1 MiB") {
  alignas(4096) static unsigned char buf[2 * 4096 + 64];
  const unsigned char* src = buf;
  CHECK(comm::detail::copy_in_pieces(buf + 4, src, 32768));
  CHECK(comm::detail::copy_in_pieces(buf + 4096 + 12, src, 4096));
  CHECK(comm::detail::copy_in_pieces(buf + 63, src, 2049));
  CHECK_FALSE(comm::detail::copy_in_pieces(buf, src, 32768));        // same offset
  CHECK_FALSE(comm::detail::copy_in_pieces(buf + 64, src, 32768));   // a line apart
  CHECK_FALSE(comm::detail::copy_in_pieces(buf + 4, src, 2048));     // one piece: memcpy's vector loop already
  CHECK_FALSE(comm::detail::copy_in_pieces(buf + 4, src, std::size_t{1} << 20));  // glibc's loop from here
  CHECK_FALSE(comm::detail::copy_in_pieces(src, buf + 4, 32768));    // destination before the source
}

TEST_CASE("move_bytes: overlapping ranges in either direction keep memmove's result") {
  for (const std::size_t n : {std::size_t{100}, std::size_t{5000}, std::size_t{70000}})
    for (const std::ptrdiff_t shift : {-4096, -100, -8, -4, 4, 8, 12, 100, 4096}) {
      INFO("bytes ", n, ", shift ", shift);
      std::vector<unsigned char> a = pattern(n + 2 * 4096, static_cast<unsigned>(n));
      std::vector<unsigned char> b = a;
      unsigned char* from = a.data() + 4096;
      comm::detail::move_bytes(from + shift, from, n);
      std::memmove(b.data() + 4096 + shift, b.data() + 4096, n);
      CHECK(a == b);
    }
}

TEST_CASE("move_large_bytes: overlapping large ranges keep memmove's result") {
  const std::size_t n = comm::detail::kLargeCopyMin + 100;
  for (const std::ptrdiff_t shift : {-4096, -8, 8, 4096, 300000}) {
    INFO("shift ", shift);
    std::vector<unsigned char> a = pattern(n + 2 * 300000, 7u);
    std::vector<unsigned char> b = a;
    unsigned char* from = a.data() + 300000;
    comm::detail::move_large_bytes(from + shift, from, n);
    std::memmove(b.data() + 300000 + shift, b.data() + 300000, n);
    CHECK(a == b);
  }
}
