// comm::detail::copy_bytes and move_bytes (detail/base/copy.hpp): at every distance modulo 4096
// from 0 to 70 and past 4096 - 70, sizes around the pieces' bounds, the destination holds the
// source's bytes and nothing around it changed; overlapping moves in both directions.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include <comm/detail/base/copy.hpp>

namespace {

// A buffer of `bytes` with `guard` bytes either side, filled from `seed`.
std::vector<unsigned char> pattern(std::size_t bytes, unsigned seed) {
  std::vector<unsigned char> v(bytes);
  std::uint32_t x = seed * 2654435761u + 1u;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    b = static_cast<unsigned char>(x);
  }
  return v;
}

constexpr std::size_t kGuard = 64;

// Copies `n` bytes between two places `dist` bytes apart modulo 4096 and checks every byte.
bool copies_right(std::size_t n, std::size_t dist, bool move) {
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
  if (move)
    comm::detail::move_bytes(dst_buf.data() + d0, src_buf.data() + s0, n);
  else
    comm::detail::copy_bytes(dst_buf.data() + d0, src_buf.data() + s0, n);
  const auto got = (reinterpret_cast<std::uintptr_t>(dst_buf.data() + d0) -
                    reinterpret_cast<std::uintptr_t>(src_buf.data() + s0)) & 4095u;
  if (got != dist % 4096) return false;
  for (std::size_t i = 0; i < span; ++i) {
    const bool inside = i >= d0 && i < d0 + n;
    const unsigned char want = inside ? src_buf[s0 + (i - d0)] : dst_before[i];
    if (dst_buf[i] != want) return false;
  }
  return true;
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
        REQUIRE(copies_right(n, d, move));
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
