// What a 2-rank 64 MiB float all_reduce costs on this host when nothing but its data movement runs:
// two processes at once, each reducing its half, in three plain-code forms of the ways Shm can
// move the bytes, and the floor under them all (benchmarks/RESULTS.md, "64 MiB at two ranks on
// this VM", "64 MiB at two ranks: the host's floor"):
//   direct    each rank reads the peer's input and writes the peer's output in place, as if the
//             peer's buffers were mapped (XPMEM; no such kernel module here): per block, copy the
//             peer's block into a cache-resident buffer, add its own, write the sum to both outputs
//   cma       the same blocks through process_vm_readv and process_vm_writev on private buffers
//             (Shm's single-copy path); `cma-read` and `cma-write` time one direction alone
//   memcpy    each rank copies its own input to its own output, both at once, nothing shared: the
//             least memory traffic any 2-rank all_reduce, all_gather or all_to_all of this size
//             moves (every byte of the two outputs written once, as many read), so its time is
//             the host's floor for all of them
//   segment   Shm's segment algorithm: per chunk each rank stages the peer's slice of its input in
//             a shared half, reduces its own slice into another half, and copies both reduced
//             slices out; two spin barriers per chunk
// With `thp` after the block, the private buffers lie on transparent huge pages (2 MiB-aligned,
// madvise MADV_HUGEPAGE), as glibc's malloc gives them with GLIBC_TUNABLES=glibc.malloc.hugetlb=1:
// the kernel then pins the peer's pages for cma a folio at a time instead of 4 KiB at a time
// (benchmarks/RESULTS.md, "Transparent huge pages").
// Usage: comm-bench-copy-bounds MODE [BLOCK_KIB [thp]]   (block or chunk, default 256)

#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr std::size_t kFloats = std::size_t{16} << 20;  // 64 MiB per rank
constexpr int kReps = 12;

void* shared(std::size_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  std::memset(p, 0, bytes);
  return p;
}

// A private buffer of `n` floats set to `v`, on huge pages with `thp` (the kernel may still refuse).
float* private_floats(std::size_t n, float v, bool thp) {
  constexpr std::size_t kHuge = std::size_t{2} << 20;
  const std::size_t bytes = (n * sizeof(float) + kHuge - 1) / kHuge * kHuge;
  void* p = nullptr;
  if (::posix_memalign(&p, kHuge, bytes) != 0) {
    std::perror("posix_memalign");
    std::exit(1);
  }
  if (thp) (void)::madvise(p, bytes, MADV_HUGEPAGE);
  auto* f = static_cast<float*>(p);
  std::fill(f, f + n, v);
  return f;
}

// Both processes arrive, generation by generation.
void barrier(std::atomic<long>* b, long& gen) {
  ++gen;
  b->fetch_add(1);
  while (b->load() < 2 * gen) {
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const long kib = argc > 2 ? std::atol(argv[2]) : 256;
  const bool thp = argc > 3 && std::string(argv[3]) == "thp";
  if ((argc > 3 && !thp) || (mode != "direct" && mode != "memcpy" && mode != "cma" && mode != "cma-read" && mode != "cma-write" && mode != "segment") ||
      kib < 4 || kib > 65536) {
    std::fprintf(stderr, "usage: %s direct|memcpy|cma|cma-read|cma-write|segment [BLOCK_KIB 4..65536 [thp]]\n", argv[0]);
    return 2;
  }
  const std::size_t blk = static_cast<std::size_t>(kib) * 1024 / sizeof(float);
  auto* bar = static_cast<std::atomic<long>*>(shared(4096));
  // direct: both ranks' inputs and outputs shared; segment: four halves of one chunk.
  float* sh_in = mode == "direct" ? static_cast<float*>(shared(2 * kFloats * 4)) : nullptr;
  float* sh_out = mode == "direct" ? static_cast<float*>(shared(2 * kFloats * 4)) : nullptr;
  float* seg = mode == "segment" ? static_cast<float*>(shared(4 * blk * 4)) : nullptr;
  const pid_t parent = ::getpid();
  const pid_t child = ::fork();
  if (child < 0) {
    std::perror("fork");
    return 1;
  }
  const int me = child == 0 ? 1 : 0;
  const pid_t peer = me == 0 ? child : parent;
  // Forked: the private buffers lie at the same addresses in both processes.
  // Held for the process's life (freed at exit).
  float* const in = private_floats(kFloats, 1.f + static_cast<float>(me), thp);
  float* const out = private_floats(kFloats, 0.f, thp);
  float* const tmp = private_floats(blk, 0.f, thp);
  if (sh_in != nullptr) std::fill(sh_in + me * kFloats, sh_in + (me + 1) * kFloats, 1.f + static_cast<float>(me));
  long gen = 0;
  std::vector<double> ms;
  for (int rep = 0; rep < kReps; ++rep) {
    barrier(bar, gen);
    const auto t0 = std::chrono::steady_clock::now();
    if (mode == "segment") {
      float* staged[2] = {seg, seg + 2 * blk};
      float* reduced[2] = {seg + blk, seg + 3 * blk};
      for (std::size_t off = 0; off < kFloats; off += blk) {
        const std::size_t m = std::min(blk, kFloats - off), q = m / 2;
        const std::size_t lo = me == 0 ? 0 : q, hi = me == 0 ? q : m;      // this rank's slice
        const std::size_t plo = me == 0 ? q : 0, phi = me == 0 ? m : q;    // the peer's
        std::memcpy(staged[me] + plo, in + off + plo, (phi - plo) * 4);
        barrier(bar, gen);
        float* r = reduced[me] + lo;
        const float* theirs = staged[1 - me] + lo;
        const float* mine = in + off + lo;
        for (std::size_t i = 0; i < hi - lo; ++i) r[i] = mine[i] + theirs[i];
        barrier(bar, gen);
        std::memcpy(out + off + lo, r, (hi - lo) * 4);
        std::memcpy(out + off + plo, reduced[1 - me] + plo, (phi - plo) * 4);
      }
    } else if (mode == "memcpy") {
      for (std::size_t off = 0; off < kFloats; off += blk)
        std::memcpy(out + off, in + off, std::min(blk, kFloats - off) * 4);
    } else {
      const std::size_t lo = me * kFloats / 2, hi = lo + kFloats / 2;
      const float* mine = sh_in != nullptr ? sh_in + me * kFloats : in;
      for (std::size_t off = lo; off < hi; off += blk) {
        const std::size_t c = std::min(blk, hi - off);
        if (mode == "direct") {
          std::memcpy(tmp, sh_in + (1 - me) * kFloats + off, c * 4);
        } else if (mode != "cma-write") {
          iovec l{tmp, c * 4}, r{in + off, c * 4};
          if (::process_vm_readv(peer, &l, 1, &r, 1, 0) != static_cast<ssize_t>(c * 4)) {
            std::perror("process_vm_readv");
            return 1;
          }
        }
        float* o = (sh_out != nullptr ? sh_out + me * kFloats : out) + off;
        for (std::size_t i = 0; i < c; ++i) o[i] = mine[off + i] + tmp[i];
        if (mode == "direct") {
          std::memcpy(sh_out + (1 - me) * kFloats + off, o, c * 4);
        } else if (mode != "cma-read") {
          iovec l{o, c * 4}, r{out + off, c * 4};
          if (::process_vm_writev(peer, &l, 1, &r, 1, 0) != static_cast<ssize_t>(c * 4)) {
            std::perror("process_vm_writev");
            return 1;
          }
        }
      }
    }
    barrier(bar, gen);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  // Every element of every full run is 1 + 2 = 3 (cma-read and cma-write move one direction only;
  // memcpy's output is the rank's own input).
  const float* res = sh_out != nullptr ? sh_out + me * kFloats : out;
  const bool whole = mode != "cma-read" && mode != "cma-write";
  const float want = mode == "memcpy" ? 1.f + static_cast<float>(me) : 3.f;
  if (whole && (res[0] != want || res[kFloats - 1] != want)) {
    std::fprintf(stderr, "rank %d: wrong result %g %g\n", me, static_cast<double>(res[0]),
                 static_cast<double>(res[kFloats - 1]));
    return 1;
  }
  std::sort(ms.begin(), ms.end());
  if (me == 0)
    std::printf("%s%s, %ld KiB blocks: median %.2f ms (busbw %.2f GB/s), best %.2f ms, %d runs\n", mode.c_str(), thp ? " (thp)" : "", kib,
                ms[kReps / 2], 64.0 * 1048576 / (ms[kReps / 2] * 1e-3) / 1e9, ms[0], kReps);
  if (me == 1) return 0;
  int status = 0;
  ::wait(&status);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
