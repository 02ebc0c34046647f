#pragma once
// Cross-memory attach (single copy) for the Shm engine (shm/engine.hpp).
//
// Large messages: each rank publishes its buffers' addresses in a step and the peers read them
// with process_vm_readv (or write a reduced slice into them with process_vm_writev), one copy by
// the kernel between the two processes' buffers (where the segment path copies into the segment
// and out again). The kernel allows it between processes of one user unless Yama's ptrace_scope
// is 1 (then each rank allows it with PR_SET_PTRACER_ANY, as Open MPI's vader does), 2 or 3, or a
// seccomp policy forbids the calls: every rank reads and rewrites every peer's probe word once at
// creation, and the ranks use it only when all succeeded, else the segment path.
//
// SingleCopy is a base of the engine (CRTP): its steps are the engine's steps (steps.hpp), so they
// carry the fingerprints and the failure checks of every other step.

#include <sys/prctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <string>
#include <vector>

#include <comm/detail/base/copy.hpp>
#include <comm/detail/base/env.hpp>
#include <comm/detail/engine/op.hpp>
#include <comm/detail/shm/segment.hpp>
#include <comm/error.hpp>

namespace comm::detail::shm {

/// The value a rank's probe word holds: a peer that reads it through process_vm_readv knows that
/// cross-memory attach works between them.
[[nodiscard]] inline std::uint64_t cma_probe(std::int64_t pid) noexcept {
  return 0x636d615f70726f62ull ^ static_cast<std::uint64_t>(pid);  // "cma_prob"
}

/// Cross-memory attach settings, from the environment (the same on every rank, or the ranks agree
/// on the smaller capability: see SingleCopy::agree_cma).
struct CmaConfig {
  bool enabled = true;              // COMM_SHM_CMA=0 turns it off
  std::size_t min_bytes = 0;        // COMM_SHM_CMA_MIN: smallest buffer moved by it (but rooted_min, reduce_min; 0: min_for)
  std::size_t block = 0;            // COMM_SHM_CMA_BLOCK: bytes per read in a reduction (0: block_for)
  std::size_t slice_max = SIZE_MAX;  // COMM_SHM_CMA_SLICE_MAX: largest slice a non-root reduces (reduce)
  std::size_t rooted_min = 0;       // COMM_SHM_CMA_ROOTED_MIN: broadcast; scatter, gather per rank (0: rooted_for)
  std::size_t reduce_min = 0;       // COMM_SHM_CMA_REDUCE_MIN: reduce (0: reduce_for)
  std::size_t broadcast_min = 0;    // broadcast: the agreed broadcast_for (set by agree_cma, not by the environment)
  std::size_t all_gather_min = 0;   // all_gather: the agreed all_gather_for (set by agree_cma, not by the environment)
  std::size_t all_to_all_min = 0;   // all_to_all: the agreed all_to_all_for (set by agree_cma, not by the environment)
  static CmaConfig from_env() {
    CmaConfig c;
    if (auto v = env_nonneg_int("COMM_SHM_CMA")) c.enabled = *v != 0;
    if (auto v = env_nonneg_int("COMM_SHM_CMA_MIN")) c.min_bytes = std::max<std::size_t>(static_cast<std::size_t>(*v), 4096);
    if (auto v = env_nonneg_int("COMM_SHM_CMA_ROOTED_MIN"))
      c.rooted_min = std::max<std::size_t>(static_cast<std::size_t>(*v), 4096);
    if (auto v = env_nonneg_int("COMM_SHM_CMA_REDUCE_MIN"))
      c.reduce_min = std::max<std::size_t>(static_cast<std::size_t>(*v), 4096);
    if (auto v = env_nonneg_int("COMM_SHM_CMA_SLICE_MAX")) c.slice_max = static_cast<std::size_t>(*v);
    if (auto v = env_nonneg_int("COMM_SHM_CMA_BLOCK"))
      c.block = std::clamp<std::size_t>(static_cast<std::size_t>(*v), 4096, std::size_t{64} << 20) / kLine * kLine;
    return c;
  }
  /// Smallest all_reduce and reduce_scatter buffer moved by a single copy (all_gather, all_to_all,
  /// reduce: their own thresholds below), given whether every rank has a core of its own. Then
  /// from 32 KiB: at 2 ranks the segment's reads of data a peer has just written slow 2-4x
  /// whenever moving a written line between the cores costs ~170 ns instead of ~30 (this VM
  /// switches between the two within seconds), single copy's by ~15 % (all_gather and all_to_all
  /// 32 KiB 11.6-11.8 us by the segment against 5.4-5.5, OpenMPI 5.2-5.5); in the fast state the
  /// segment was the faster at 32 KiB (3.6 against 4.7) but single copy stayed below both MPIs
  /// (OpenMPI 5.1), which at 16 KiB it did not (all_gather 3.5 against MPICH's 2.1). From 64 KiB
  /// single copy was the faster in both states (all_reduce 128 KiB 16.5 against 21.6 us, all_gather
  /// 256 KiB 13.1 against 19-20, all_to_all 128 KiB 9.7 against 14.1). Where ranks share cores the
  /// readers queue for them, and the segment wins up to 1 MiB (benchmarks/RESULTS.md, "Single copy
  /// from 64 KiB where every rank has a core"; "Rooted single copy from 16 KiB: the two line states").
  [[nodiscard]] std::size_t min_for(bool own_core) const noexcept {
    if (min_bytes != 0) return min_bytes;
    return own_core ? std::size_t{32} << 10 : std::size_t{1} << 20;
  }
  /// Smallest all_gather (the whole output) moved by a single copy: COMM_SHM_CMA_MIN where it is
  /// set, else min_for's 32 KiB where every rank has a core, and none where ranks share cores: as
  /// for broadcast (broadcast_for), each rank there pulls every other rank's block out of memory
  /// in its turn on a core, where the segment's chunks are still in the cache. With 3 and 4 ranks
  /// on 2 cores the segment took 0.54-0.80x single copy's time at 4-64 MiB (3 ranks) and 1-64 MiB
  /// (4 ranks): 4 ranks 16 MiB 2.87 against 5.34 ms (OpenMPI 8.00), 64 MiB 14.9 against 25.7;
  /// all_reduce, all_to_all and reduce kept single copy's lead or par at 1-4 MiB, so they keep
  /// it (min_for, all_to_all_for, reduce_for; RESULTS.md, "Broadcast and all_gather on shared
  /// cores: the segment").
  [[nodiscard]] std::size_t all_gather_for(bool own_core) const noexcept {
    if (min_bytes != 0 || own_core) return min_for(own_core);
    return SIZE_MAX;
  }
  /// Smallest all_to_all (one rank's input) moved by a single copy: COMM_SHM_CMA_MIN where it is
  /// set, else 32 KiB whether or not ranks share cores. Through the segment every block is copied
  /// twice, in steps of chunk / ranks bytes a piece that every rank must reach, and where ranks
  /// share cores each step waits for the ranks' turns on them: on the Intel Xeon VM of 2026-12-07,
  /// with 3 and 4 ranks on its 2 cores, the segment took 1.1-2.2x OpenMPI's time at 31-512 KiB
  /// (4 ranks 256 KiB 60.1 against 28.5 us) and single copy 0.85-0.94x (25.2 us); at 16 KiB the
  /// segment kept its lead (6.9 against 10.6 us, OpenMPI 11.6). On the AMD VM single copy had
  /// taken a 4-rank 1 MiB all_to_all from 621 to 159 us. (benchmarks/RESULTS.md, "all_to_all
  /// on shared cores by single copy from 32 KiB".)
  [[nodiscard]] std::size_t all_to_all_for() const noexcept { return min_for(true); }
  /// Smallest broadcast (scatter, gather: block per rank) moved by a single copy: 16 KiB where
  /// every rank has a core, 64 KiB elsewhere. Where every rank has a core, one read by the kernel
  /// from the root's buffer beat the segment's two copies at 2 ranks (broadcast 64 KiB 6.2 against
  /// 7.8-9.9 us, 256 KiB 19-20 against 25-31). From 16 KiB it also keeps a step's time when moving
  /// a written line between the two cores costs ~170 ns instead of ~30 (this VM switches between
  /// the two within seconds): there the segment's copies slowed 2-4x (a 32 KiB scatter 10.0 us
  /// against 4.3 by single copy, a 32 KiB broadcast 19.0 against 4.8; OpenMPI 4.7 and 5.6) and
  /// single copy by 3-15 %. In the fast state the segment was up to 1.6x the faster at 16-32 KiB
  /// (a gather's 16 KiB block 2.3 against 3.8 us) but single copy stayed below both MPIs (4.6 and
  /// 5.3); at 8 KiB only the segment kept up with MPICH there (a broadcast 1.3 against 2.5, MPICH
  /// 1.1), so it keeps the sizes below. Where ranks share cores it was 1 MiB, for the segment lets the root return at once;
  /// measured again with 4 ranks on 2 cores the segment's copies slowed 2-6x in most rounds and
  /// single copy did not (gather 1 MiB 51 against 57-329 us, scatter 1 MiB 57 against 92-274,
  /// broadcast 256 KiB 58 against 55-206), while the symmetric operations kept the segment's lead
  /// there (min_for). (benchmarks/RESULTS.md, "Single copy for broadcast, scatter and
  /// reduce_scatter"; "Rooted single copy from 64 KiB on shared cores"; "Rooted single copy from
  /// 16 KiB: the two line states".)
  [[nodiscard]] std::size_t rooted_for(bool own_core) const noexcept {
    if (rooted_min != 0) return rooted_min;
    return own_core ? std::size_t{16} << 10 : std::size_t{64} << 10;
  }
  /// Smallest broadcast moved by a single copy: COMM_SHM_CMA_ROOTED_MIN where it is set, else
  /// rooted_for's 16 KiB where every rank has a core, and none where ranks share cores. There the
  /// readers take their turns on a core one after another, and each pulls the whole message from
  /// the root's buffer, out of memory by then, while the segment's chunks stay in the cache
  /// between the root's write and the last reader: with 3 and 4 ranks on 2 cores the segment took
  /// 0.50-0.81x single copy's time at 64-256 KiB and 16-64 MiB and 0.96-1.18x at 1-4 MiB (within
  /// the rounds' spread), 4 ranks 64 KiB 35.9 against 55.1 us (OpenMPI 41.7), 64 MiB 12.2 against
  /// 19.7 ms; scatter and gather kept single copy's lead from 1 MiB (4 ranks 4 MiB 167 / 151 us
  /// against 376 / 274 by the segment; RESULTS.md, "Broadcast and all_gather on shared cores: the
  /// segment").
  [[nodiscard]] std::size_t broadcast_for(bool own_core) const noexcept {
    if (rooted_min != 0 || own_core) return rooted_for(own_core);
    return SIZE_MAX;
  }
  /// Smallest reduce moved by a single copy: 64 KiB where every rank has a core, 1 MiB elsewhere
  /// (as min_for; the one-step segment reduce, or an all_reduce above the chunk, below it). The
  /// segment's step has the non-root copy its input into lines the root read two steps before, so
  /// each line it writes is first taken back from the root's cache; what that costs depends on
  /// where the host placed the two CPUs, which is set per job: on this project's Zen 4 VM
  /// (2026-12-06, six runs of 8-60 jobs) between one job in 30 and one in 2 ran every segment step
  /// 3-5x slower (64 KiB 29.7-38.1 against a median of 7.7 us, 96 KiB 43.7 against 11.5; the
  /// non-root's copy took 4-5x its usual time), where single copy never passed 1.35x its median
  /// (10.6 against 7.5; OpenMPI 8.1 and 11.0 by medians). From 64 KiB single copy was also the
  /// faster by medians (96 KiB 9.8 against 11.5); at 32-48 KiB the segment keeps its lead by
  /// medians (32 KiB 4.0 against 5.6 us, OpenMPI 5.2; its slow jobs 14.8). (benchmarks/RESULTS.md,
  /// "Reduce by single copy from 64 KiB again"; on another VM the segment had led at 64-96 KiB,
  /// "Reduce: the segment up to 96 KiB".)
  [[nodiscard]] std::size_t reduce_for(bool own_core) const noexcept {
    if (reduce_min != 0) return reduce_min;
    return own_core ? std::size_t{64} << 10 : std::size_t{1} << 20;
  }
  /// Bytes per read in a reduction among `n` ranks: 1 MiB, less where n - 1 blocks of scratch would
  /// pass 4 MiB, never under 64 KiB. Each read pins its pages and runs one syscall; at 2 ranks,
  /// 1 MiB blocks took 1 MiB all_reduce from 168 to 123 us and 4 MiB from 498 to 454 us against
  /// 64 KiB ones (benchmarks/RESULTS.md, "Single copy: all_to_all, a reduce split over the ranks,
  /// larger reads").
  [[nodiscard]] std::size_t block_for(int n) const noexcept {
    if (block != 0) return block;
    const std::size_t fit = (std::size_t{4} << 20) / static_cast<std::size_t>(std::max(n - 1, 1)) / kLine * kLine;
    return std::clamp<std::size_t>(fit, std::size_t{64} << 10, std::size_t{1} << 20);
  }
};

/// The single-copy path of `Engine` (shm::Engine): large all_reduce, broadcast, scatter,
/// all_gather, all_to_all, reduce and reduce_scatter.
template <class Engine>
class SingleCopy {
 protected:
  /// One more symmetric step at creation: every rank tries every peer's probe word and publishes
  /// whether all reads succeeded; cross-memory attach is on only when every rank says so.
  void agree_cma() {
    self().op_name_ = "shm.init";
    bool ok = cma_.enabled;
    if (ok && yama_scope() == 1) (void)::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
    // The PR_SET_PTRACER above takes effect for the peers' reads after the step below.
    std::uint64_t s = self().next_step();
    self().publish(s);
    self().wait_all(s);
    for (int p = 0; p < self().size() && ok; ++p) {
      if (p == self().rank()) continue;
      std::uint64_t v = 0;
      iovec local{&v, sizeof v};
      iovec remote{reinterpret_cast<void*>(static_cast<std::uintptr_t>(self().ctl(p).probe)), sizeof v};
      const std::int64_t pid = self().ctl(p).pid;
      ok = ::process_vm_readv(static_cast<pid_t>(pid), &local, 1, &remote, 1, 0) == static_cast<ssize_t>(sizeof v) &&
           v == cma_probe(pid);
      // all_reduce and reduce write their slices into the peers (the same permission, but a
      // seccomp policy may tell the two calls apart): the word goes back unchanged.
      ok = ok && ::process_vm_writev(static_cast<pid_t>(pid), &local, 1, &remote, 1, 0) == static_cast<ssize_t>(sizeof v);
    }
    const bool own_core = core_per_rank(self().size());
    self().ctl(self().rank()).cma_min = cma_.min_for(own_core);
    self().ctl(self().rank()).cma_slice_max = cma_.slice_max;
    self().ctl(self().rank()).cma_own_core = own_core ? 1 : 0;
    self().ctl(self().rank()).cma_rooted_min = cma_.rooted_for(own_core);
    self().ctl(self().rank()).cma_broadcast_min = cma_.broadcast_for(own_core);
    self().ctl(self().rank()).cma_all_gather_min = cma_.all_gather_for(own_core);
    self().ctl(self().rank()).cma_reduce_min = cma_.reduce_for(own_core);
    self().ctl(self().rank()).cma_all_to_all_min = cma_.all_to_all_for();
    self().ctl(self().rank()).cma.store(ok ? 2 : 1, std::memory_order_relaxed);
    s = self().next_step();
    self().publish(s);
    self().wait_all(s);
    // Which path an operation takes must not depend on a rank's environment: the largest
    // threshold and the smallest slice wins (the path is not in the fingerprint).
    cma_on_ = true;
    cma_own_core_ = true;
    cma_.rooted_min = 0;
    cma_.broadcast_min = 0;
    cma_.all_gather_min = 0;
    cma_.reduce_min = 0;
    cma_.all_to_all_min = 0;
    cma_.min_bytes = 0;
    for (int p = 0; p < self().size(); ++p) {
      cma_own_core_ = cma_own_core_ && self().ctl(p).cma_own_core == 1;
      cma_.rooted_min = std::max<std::size_t>(cma_.rooted_min, self().ctl(p).cma_rooted_min);
      cma_.broadcast_min = std::max<std::size_t>(cma_.broadcast_min, self().ctl(p).cma_broadcast_min);
      cma_.all_gather_min = std::max<std::size_t>(cma_.all_gather_min, self().ctl(p).cma_all_gather_min);
      cma_.reduce_min = std::max<std::size_t>(cma_.reduce_min, self().ctl(p).cma_reduce_min);
      cma_.all_to_all_min = std::max<std::size_t>(cma_.all_to_all_min, self().ctl(p).cma_all_to_all_min);
      cma_on_ = cma_on_ && self().ctl(p).cma.load(std::memory_order_relaxed) == 2;
      cma_.min_bytes = std::max<std::size_t>(cma_.min_bytes, self().ctl(p).cma_min);
      cma_.slice_max = std::min<std::size_t>(cma_.slice_max, self().ctl(p).cma_slice_max);
    }
  }

  static int yama_scope() {
    std::ifstream f("/proc/sys/kernel/yama/ptrace_scope");
    int v = 0;
    return f >> v ? v : 0;
  }

  [[nodiscard]] bool use_cma(std::size_t bytes) const noexcept { return cma_on_ && bytes >= cma_.min_bytes && bytes != 0; }
  /// For scatter and gather (a rank's block): the agreed rooted threshold.
  [[nodiscard]] bool use_cma_rooted(std::size_t bytes) const noexcept {
    return cma_on_ && bytes >= cma_.rooted_min && bytes != 0;
  }
  /// For all_gather (the whole output): the agreed all_gather threshold (all_gather_for).
  [[nodiscard]] bool use_cma_all_gather(std::size_t bytes) const noexcept {
    return cma_on_ && bytes >= cma_.all_gather_min && bytes != 0;
  }
  /// For all_to_all (one rank's input): the agreed all_to_all threshold (all_to_all_for).
  [[nodiscard]] bool use_cma_all_to_all(std::size_t bytes) const noexcept {
    return cma_on_ && bytes >= cma_.all_to_all_min && bytes != 0;
  }
  /// For broadcast (the message): the agreed broadcast threshold (broadcast_for).
  [[nodiscard]] bool use_cma_broadcast(std::size_t bytes) const noexcept {
    return cma_on_ && bytes >= cma_.broadcast_min && bytes != 0;
  }
  /// For reduce (the message): the agreed reduce threshold.
  [[nodiscard]] bool use_cma_reduce(std::size_t bytes) const noexcept {
    return cma_on_ && bytes >= cma_.reduce_min && bytes != 0;
  }
  /// reduce_scatter (the whole input): only where every rank has a core. There it beat the
  /// segment at 2 ranks, 1-4 MiB (72-73 against 78-81 us at 1 MiB), and kept its figures where the
  /// segment's reads of freshly written halves slowed 3.5x (1 MiB 73 against 280 us); 4 ranks on 2
  /// cores were up to 2.5x slower by it than by the segment (RESULTS.md, as above).
  [[nodiscard]] bool use_cma_reduce_scatter(std::size_t bytes) const noexcept {
    return cma_own_core_ && use_cma(bytes);
  }

  /// Copies `bytes` from address `from` in peer `p`'s process into `to`.
  void cma_read(int p, void* to, std::uint64_t from, std::size_t bytes) {
    cma_copy(p, static_cast<std::byte*>(to), from, bytes, false);
  }
  /// Copies `bytes` from `from` into address `to` in peer `p`'s process.
  void cma_write(int p, std::uint64_t to, const void* from, std::size_t bytes) {
    cma_copy(p, const_cast<std::byte*>(static_cast<const std::byte*>(from)), to, bytes, true);
  }
  /// The kernel copies a process_vm_readv / writev with `rep movs`, and on this project's AMD EPYC
  /// VM that took 3.5-5.8x as long when the destination lay 1-15 bytes past the source modulo 4096,
  /// as glibc's memcpy does (copy.hpp): 32 KiB 12.5-14.1 against 3.5 us, 2 MiB 765-829 against 156
  /// (and glibc leaves `rep movsb` from ~1 MiB, the kernel does not). Such a transfer goes through
  /// scratch placed at the peer's page offset (distance 0), in pieces of kBouncePiece, and
  /// copy_bytes moves each piece between the scratch and this rank's buffer (benchmarks/RESULTS.md,
  /// "Cross-memory attach at a distance of 1-15 bytes").
  void cma_copy(int p, std::byte* mine, std::uint64_t theirs, std::size_t bytes, bool write) {
    const auto at = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(mine));
    const std::uint64_t distance = (write ? theirs - at : at - theirs) & 4095u;
    if (distance == 0 || distance > 15) return cma_transfer(p, mine, theirs, bytes, write);
    if (cma_bounce_.size() < kBouncePiece + 8192) cma_bounce_.resize(kBouncePiece + 8192);
    std::byte* const scratch = first_page(cma_bounce_) + (theirs & 4095u);
    for (std::size_t off = 0; off < bytes; off += kBouncePiece) {
      const std::size_t len = std::min(kBouncePiece, bytes - off);
      if (write) copy_bytes(scratch, mine + off, len);
      cma_transfer(p, scratch, theirs + off, len, write);
      if (!write) copy_bytes(mine + off, scratch, len);
    }
  }
  static constexpr std::size_t kBouncePiece = std::size_t{256} << 10;  // a whole number of pages, in L2
  /// The first page boundary in `v` (scratch sized a page more than it holds).
  [[nodiscard]] static std::byte* first_page(std::vector<std::byte>& v) noexcept {
    const auto a = reinterpret_cast<std::uintptr_t>(v.data());
    return v.data() + ((4096 - (a & 4095u)) & 4095u);
  }
  void cma_transfer(int p, std::byte* mine, std::uint64_t theirs, std::size_t bytes, bool write) {
    while (bytes != 0) {
      iovec local{mine, bytes};
      iovec remote{reinterpret_cast<void*>(static_cast<std::uintptr_t>(theirs)), bytes};
      const auto pid = static_cast<pid_t>(self().ctl(p).pid);
      const ssize_t got = write ? ::process_vm_writev(pid, &local, 1, &remote, 1, 0)
                                : ::process_vm_readv(pid, &local, 1, &remote, 1, 0);
      if (got <= 0) {
        const int err = got < 0 ? errno : EIO;
        if (err == EINTR) continue;
        Engine& e = self();
        const std::string op_no = "op #" + std::to_string(e.op_seq_);
        if (err == ESRCH) {
          e.declare_dead(p);
          throw RemoteError(e.op_name_, e.rank(),
                            "rank " + std::to_string(p) + " (pid " + std::to_string(e.ctl(p).pid) + ") exited while this rank " +
                                (write ? "wrote to" : "read") + " its buffer (" + op_no + ")",
                            "rank " + std::to_string(p));
        }
        // A peer that gave up the operation (another rank died or aborted) may have freed the
        // buffer: report that cause, as a wait would, rather than the copy's EFAULT.
        (void)e.check_peer(p, Clock::time_point::max(), true, [] { return false; },
                           [&] { return " (" + op_no + ")"; });
        throw BackendError(e.op_name_, e.rank(),
                           std::string(write ? "process_vm_writev" : "process_vm_readv") + " of " + std::to_string(bytes) +
                               " bytes " + (write ? "to" : "from") + " rank " + std::to_string(p) + " failed: " +
                               errno_text(err) + " (" + op_no + "; COMM_SHM_CMA=0 avoids it)",
                           "rank " + std::to_string(p));
      }
      mine += got;
      theirs += static_cast<std::uint64_t>(got);
      bytes -= static_cast<std::size_t>(got);
    }
  }

  static constexpr std::size_t kAddressBytes = 2 * sizeof(std::uint64_t);  // at most two addresses per step

  /// Publishes step `s` with `addrs` (buffer addresses) as payload and waits for every peer.
  void publish_addresses(std::uint64_t s, std::initializer_list<const void*> addrs) {
    std::byte* mine = self().begin(s, kAddressBytes);
    for (const void* a : addrs) {
      const auto v = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(a));
      std::memcpy(mine, &v, sizeof v);
      mine += sizeof v;
    }
    self().publish(s);
    self().wait_all(s);
  }
  [[nodiscard]] std::uint64_t address_of(int p, std::uint64_t s, int i) const noexcept {
    std::uint64_t v = 0;
    std::memcpy(&v, self().payload(p, s, kAddressBytes) + static_cast<std::size_t>(i) * sizeof v, sizeof v);
    return v;
  }

  /// Elements [lo, hi) of the reduction of this rank's `in` and every peer's input (the first
  /// address of step `a`), read in blocks into scratch, written to `dst` (element lo's place), or
  /// with `dst` null to one block of scratch (at the page offset of `target` + off elements, where
  /// the caller writes it); `done(off, c, at)` runs after each block (elements [off, off + c),
  /// reduced at `at`), while it is still in this core's cache. Each block of scratch starts at
  /// the page offset of what is read into it or written from it: no transfer of cma_copy's slow
  /// distances, so none goes through its extra copy.
  ///
  /// Where every rank has a core and `dst`'s block lies outside this rank's input (out of place),
  /// one peer's block is read straight into it and reduced there in place. The kernel's copy writes
  /// whole lines; the reduction's stores into a block not yet in the cache read every line from
  /// memory first. 2 ranks, one build with and without it, 10-12 rounds (benchmarks/RESULTS.md,
  /// "Reductions read into the output"): reduce_scatter 0.87-0.95x, reduce 0.93-0.95x, an
  /// out-of-place all_reduce 0.93-0.98x the time; in place (no other block to read into) 1.00x.
  /// That peer is the lowest other rank, the fold's operand 0 or 1: a custom callable may take
  /// its output as either of its first two operands (reduce_from).
  template <class Done>
  void reduce_read(const Op& op, std::uint64_t a, const std::byte* in, std::byte* dst, std::size_t lo, std::size_t hi,
                   Done&& done, std::uint64_t target = 0) {
    const std::size_t e = op.elem_size;
    const int n = self().size();
    const std::size_t k = std::max<std::size_t>(std::min(cma_.block_for(n) / e, hi - lo), 1);
    const auto blocks = static_cast<std::size_t>(dst == nullptr ? n : n - 1);
    const std::size_t slot = (k * e + 4095) / 4096 * 4096 + 4096;  // a block at any page offset
    // Grown only: a resize up within the capacity would zero the new bytes on every call.
    if (const std::size_t need = blocks * slot + 4096; cma_tmp_.size() < need) cma_tmp_.resize(need);
    std::byte* const tmp0 = first_page(cma_tmp_);
    const int into_dst = self().rank() == 0 ? 1 : 0;  // the peer read into dst's block
    for (std::size_t off = lo; off < hi; off += k) {
      const std::size_t c = std::min(k, hi - off);
      std::byte* at = dst != nullptr ? dst : tmp0 + static_cast<std::size_t>(n - 1) * slot + ((target + off * e) & 4095u);
      if (dst != nullptr) at += (off - lo) * e;
      // Not into any part of this rank's input: the peers read their slices of it meanwhile.
      const bool direct = dst != nullptr && cma_own_core_ && !ranges_overlap(at, c * e, in, op.in_count * e);
      std::size_t t = 0;
      for (int p = 0; p < n; ++p) {
        if (p == self().rank()) {
          self().srcs_[static_cast<std::size_t>(p)] = in + off * e;
          continue;
        }
        const std::uint64_t from = address_of(p, a, 0) + off * e;
        std::byte* to = direct && p == into_dst ? at : tmp0 + t++ * slot + (from & 4095u);
        cma_read(p, to, from, c * e);
        self().srcs_[static_cast<std::size_t>(p)] = to;
      }
      self().reduce_from(op, at, c, true);
      done(off, c, at);
    }
  }
  void reduce_read(const Op& op, std::uint64_t a, const std::byte* in, std::byte* dst, std::size_t lo, std::size_t hi) {
    reduce_read(op, a, in, dst, lo, hi, [](std::size_t, std::size_t, const std::byte*) {});
  }

  /// Rank p's slice of a reduction by cross-memory attach: elements [lo(p), hi(p)), whole cache
  /// lines, the same on every rank (count, size, element size and root agree when the
  /// fingerprints do). Equal slices of q, or with a `heavy` rank (a reduce's root) n shares to
  /// every other rank's n - 1: each of the others reads n - 1 inputs and writes its slice into the
  /// root, one copy more per element than the root makes. At 2 ranks (the root two thirds) it took
  /// a reduce's 64 KiB from 9.8-10.6 to 8.0-8.8 us and 1 MiB from 113 to 96 (benchmarks/RESULTS.md,
  /// "Reduce by single copy from 64 KiB"); where ranks share cores the time is the sum of every
  /// rank's copies, not the slowest rank's, and the equal split was as fast (4 ranks, 1-16 MiB).
  struct Slices {
    std::size_t count, q;
    int n, heavy;
    std::size_t extra = 0;  // the heavy rank's elements beyond q, whole lines
    Slices(std::size_t count_, int n_, std::size_t e, int heavy_ = -1) : count(count_), n(n_), heavy(heavy_) {
      const auto un = static_cast<std::size_t>(n);
      const std::size_t align = std::max<std::size_t>(kLine / e, 1);
      if (heavy < 0 || n < 2) {
        heavy = -1;
        q = ((count + un - 1) / un + align - 1) / align * align;
        return;
      }
      // q = ceil(count * (n - 1) / shares) without the product (count may be near SIZE_MAX / 2).
      const std::size_t shares = un + (un - 1) * (un - 1);
      const std::size_t ceil = count / shares * (un - 1) + ((count % shares) * (un - 1) + shares - 1) / shares;
      q = (ceil + align - 1) / align * align;
      if (un * q < count) extra = (count - un * q) / align * align;  // the last rank takes what is left
    }
    [[nodiscard]] std::size_t lo(int p) const noexcept {
      if (p >= n) return count;
      return std::min(count, q * static_cast<std::size_t>(p) + (heavy >= 0 && p > heavy ? extra : 0));
    }
    [[nodiscard]] std::size_t hi(int p) const noexcept { return lo(p + 1); }
  };

  /// all_reduce by cross-memory attach: step a (addresses), every rank reduces its slice from the
  /// peers' inputs read in blocks into cache-sized scratch and writes each reduced block into
  /// every peer's output while it is still in cache (the whole slice at the end was read back
  /// from memory once it outgrew the cache: 2-rank 64 MiB 14.8-19.7 against 11.8-15.3 ms); step
  /// b (every slice written, no input read any more). Nothing else touches
  /// the region a rank writes: in place, a peer's input there was read only by the writer itself.
  /// Writing the slice, which is in the writer's cache, instead of each rank reading the peers'
  /// just-reduced slices took 2-rank 1 MiB from 124-151 to 111-114 us and 4-rank 1 MiB from
  /// 1,168-1,272 to 561-563 us, and up to 5.7x where moving a line another core has just written
  /// is slow (RESULTS.md, "all_reduce and reduce: write the reduced slices").
  void cma_all_reduce(Op& op) {
    const std::size_t e = op.elem_size;
    const std::size_t count = op.out_count;
    const auto* in = static_cast<const std::byte*>(op.in);
    auto* out = static_cast<std::byte*>(op.out);
    const int n = self().size();
    const int me = self().rank();
    const Slices sl(count, n, e);
    const std::uint64_t a = self().next_step();
    publish_addresses(a, {in, out});
    reduce_read(op, a, in, out + sl.lo(me) * e, sl.lo(me), sl.hi(me), [&](std::size_t off, std::size_t c, const std::byte* at) {
      for (int i = 1; i < n; ++i) {
        const int p = (me + i) % n;
        cma_write(p, address_of(p, a, 1) + off * e, at, c * e);
      }
    });
    const std::uint64_t b = self().next_step();
    self().publish(b);
    self().wait_all(b);
  }

  /// broadcast by cross-memory attach: the others read the root's buffer into theirs (read_root),
  /// in n - 1 parts, each reader starting at its own part, so that the readers do not pin and copy
  /// the same pages at once: 3 ranks 4 MiB 553-758 against 910-1,220 us, 4 ranks 16 MiB 7.8-8.3
  /// against 8.2-8.9 ms (RESULTS.md, "A broadcast's readers start at their own parts"). From
  /// share_min() the root, which otherwise waits, copies too: the message goes in n parts, and the
  /// root writes into each reader the one part that reader does not read (the last of its order).
  void cma_broadcast(Op& op) {
    const bool share = op.out_count * op.elem_size >= share_min();
    read_root(op, op.out, 0, share ? Parts::shared : Parts::staggered);
  }
  /// Where every rank has a core, 128 KiB: at 2 ranks 16 MiB took 666 against 2,036 us, 1 MiB 23
  /// against 48, 128 KiB 6.3 against 7.0, but 64 KiB 5.3 against 5.0 (one more call and a wait
  /// for the root). Where ranks share cores (a broadcast goes by single copy there only when
  /// COMM_SHM_CMA_ROOTED_MIN asks it: broadcast_for), 64 KiB: 4 ranks on 2 cores 64 KiB 38 against
  /// 47 us, 64 MiB 18.2-18.4 against 24.1-25.3 ms (RESULTS.md, "A broadcast's root copies too").
  [[nodiscard]] std::size_t share_min() const noexcept {
    return cma_own_core_ ? std::size_t{128} << 10 : std::size_t{64} << 10;
  }

  /// scatter by cross-memory attach: each rank takes its block of the root's input (read_root).
  void cma_scatter(Op& op) {
    read_root(op, op.in, static_cast<std::size_t>(self().rank()) * op.out_count * op.elem_size, Parts::whole);
  }

  /// How read_root's readers take the root's bytes: in one read; in n - 1 parts, each reader
  /// starting at its own; or in n parts, one of them written by the root (cma_broadcast).
  enum class Parts { whole, staggered, shared };

  /// Step a (`buffer`'s address on the root, and on the others the address of `op.out`;
  /// symmetric), each other rank reads `op.out`'s bytes from the root's buffer at byte `at` (the
  /// root moves them itself unless they are already there), step b (the root waits for every
  /// reader; Parts::shared: a reader waits for the root too, whose writes into it end there).
  void read_root(Op& op, const void* buffer, std::size_t at, Parts how) {
    const int root = op.desc.root;
    const int me = self().rank();
    const int n = self().size();
    const std::size_t bytes = op.out_count * op.elem_size;
    const auto* from = static_cast<const std::byte*>(buffer) + at;
    auto* out = static_cast<std::byte*>(op.out);
    const std::uint64_t a = self().next_step();
    publish_addresses(a, {me == root ? buffer : out});
    const auto parts = static_cast<std::size_t>(how == Parts::whole ? 1 : how == Parts::staggered ? n - 1 : n);
    const std::size_t part = ((bytes + parts - 1) / parts + kLine - 1) / kLine * kLine;  // parts * part >= bytes
    auto lo_of = [&](std::size_t i) { return std::min(bytes, i * part); };
    auto hi_of = [&](std::size_t i) { return std::min(bytes, i * part + part); };
    // A reader's place among the readers, 0 .. n - 2: the part it starts at.
    auto place = [&](int p) { return static_cast<std::size_t>((p - root + n) % n - 1); };
    if (me != root) {
      const std::size_t v = place(me);
      const std::size_t reads = how == Parts::shared ? parts - 1 : parts;
      for (std::size_t i = 0; i < reads; ++i) {
        const std::size_t lo = lo_of((v + i) % parts), hi = hi_of((v + i) % parts);
        if (hi > lo) cma_read(root, out + lo, address_of(root, a, 0) + at + lo, hi - lo);
      }
    } else {
      if (out != from) Engine::move(out, from, bytes);
      if (how == Parts::shared)
        for (int p = 0; p < n; ++p) {
          if (p == root) continue;
          const std::size_t i = (place(p) + parts - 1) % parts;
          if (hi_of(i) > lo_of(i)) cma_write(p, address_of(p, a, 0) + lo_of(i), from + lo_of(i), hi_of(i) - lo_of(i));
        }
    }
    const std::uint64_t b = self().next_step();
    self().publish(b);
    if (me == root)
      self().wait_all(b);
    else if (how == Parts::shared)
      self().wait_step(root, b);
  }

  /// gather by cross-memory attach: step a (the root's output address; symmetric), every other
  /// rank writes its input into its block of the root's output, step b (the root waits for every
  /// writer; a writer is done with its input when its write returns). The writers copy at once,
  /// each on its own core, where the root reading every block would copy them one after another.
  void cma_gather(Op& op) {
    const std::size_t bytes = op.in_count * op.elem_size;
    const int me = self().rank();
    const int root = op.desc.root;
    const auto* in = static_cast<const std::byte*>(op.in);
    auto* out = static_cast<std::byte*>(op.out);
    const std::uint64_t a = self().next_step();
    publish_addresses(a, {out});
    const std::size_t at = static_cast<std::size_t>(me) * bytes;
    if (me != root)
      cma_write(root, address_of(root, a, 0) + at, in, bytes);
    else if (out + at != in)
      Engine::move(out + at, in, bytes);
    const std::uint64_t b = self().next_step();
    self().publish(b);
    if (me == root) self().wait_all(b);
  }

  /// reduce_scatter by cross-memory attach, as all_reduce's first half with the slices the
  /// caller's blocks: step a (input addresses), every rank reduces its block of every input, read
  /// in blocks into scratch, into its output; step b (no input is read any more). The segment
  /// path copies every block into the segment before a peer reads it.
  void cma_reduce_scatter(Op& op) {
    const std::size_t m = op.out_count;
    const std::size_t lo = static_cast<std::size_t>(self().rank()) * m;
    const auto* in = static_cast<const std::byte*>(op.in);
    const std::uint64_t a = self().next_step();
    publish_addresses(a, {in});
    reduce_read(op, a, in, static_cast<std::byte*>(op.out), lo, lo + m);
    const std::uint64_t b = self().next_step();
    self().publish(b);
    self().wait_all(b);
  }

  /// reduce by cross-memory attach, as all_reduce: step a (input addresses, and the root's
  /// output), every rank reduces its slice of every input (the root into its output, the others
  /// block by block into scratch, each block written into the root's output while it is in
  /// cache; the root's slice the larger where every rank has a core: Slices), step b (every
  /// slice in place, no input read any more). The root alone reading and
  /// reducing every input left the others idle: 1.4-1.7x OpenMPI's reduce at 2 ranks, 1-16 MiB.
  /// Where a slice passes slice_max (COMM_SHM_CMA_SLICE_MAX; no limit by default, since a non-root
  /// holds one block at a time) the root reduces alone (cma_reduce_at_root). slice_max is the
  /// same on every rank (agree_cma: the smallest wins), so every rank takes one path.
  void cma_reduce(Op& op) {
    const std::size_t e = op.elem_size;
    const int n = self().size();
    const int me = self().rank();
    const int root = op.desc.root;
    const Slices sl(op.in_count, n, e, cma_own_core_ ? root : -1);
    if (sl.q * e > cma_.slice_max) return cma_reduce_at_root(op);  // q: the others' slice
    const auto* in = static_cast<const std::byte*>(op.in);
    auto* out = static_cast<std::byte*>(op.out);
    const std::uint64_t a = self().next_step();
    publish_addresses(a, {in, out});
    reduce_read(
        op, a, in, me == root ? out + sl.lo(me) * e : nullptr, sl.lo(me), sl.hi(me),
        [&](std::size_t off, std::size_t c, const std::byte* at) {
          if (me != root) cma_write(root, address_of(root, a, 1) + off * e, at, c * e);
        },
        address_of(root, a, 1));
    const std::uint64_t b = self().next_step();
    self().publish(b);
    self().wait_all(b);
  }

  /// reduce of a large message by cross-memory attach: step a (input addresses; symmetric), the
  /// root reads every peer's input in blocks and reduces them into its output, step b (the root is
  /// done reading: the others, which waited for it, may return and reuse their inputs). The others
  /// need no buffer of the message's size.
  void cma_reduce_at_root(Op& op) {
    const int root = op.desc.root;
    const auto* in = static_cast<const std::byte*>(op.in);
    const std::uint64_t a = self().next_step();
    publish_addresses(a, {in});
    if (self().rank() == root) reduce_read(op, a, in, static_cast<std::byte*>(op.out), 0, op.in_count);
    const std::uint64_t b = self().next_step();
    self().publish(b);
    if (self().rank() != root) self().wait_step(root, b);
  }

  /// all_gather by cross-memory attach: every rank reads every peer's input into that peer's
  /// block of its output (read_blocks).
  void cma_all_gather(Op& op) { read_blocks(op, op.in_count * op.elem_size, 0, false); }

  /// all_to_all by cross-memory attach: every rank reads its block of every peer's input straight
  /// into that peer's block of its output, starting with the next rank so that the ranks do not
  /// all read one peer at once, and copies its own block last (read_blocks): at 2 ranks 4 / 16 /
  /// 64 MiB took 0.91 / 0.91-0.97 / 0.89-0.90x the time with the own block first (14 rounds in
  /// two runs; RESULTS.md, "all_to_all: the own block last"; an all_gather's order made no
  /// difference, 1.01-1.08x, and stays). The segment path copies each block twice (into the
  /// sender's payload, out to the receiver).
  void cma_all_to_all(Op& op) {
    const std::size_t bytes = op.in_count / static_cast<std::size_t>(self().size()) * op.elem_size;
    read_blocks(op, bytes, static_cast<std::size_t>(self().rank()) * bytes, true);
  }

  /// Step a (input addresses), then block p of `out` (`bytes` each) from peer p's input at byte
  /// `from`, this rank's own from its input at `from` (in place: already there), in order from
  /// this rank's successor round to itself when `staggered`, else from rank 0; step b (every rank
  /// done reading, so each may reuse its input). Where every rank has a core, all of them copy
  /// their own blocks at once, and a large one goes in pieces (copy_large_bytes); with ranks
  /// sharing cores the 4-rank 32-64 MiB cells were no faster that way (1.00-1.03x).
  void read_blocks(Op& op, std::size_t bytes, std::size_t from, bool staggered) {
    const int n = self().size();
    const int me = self().rank();
    const auto* in = static_cast<const std::byte*>(op.in);
    auto* out = static_cast<std::byte*>(op.out);
    const std::uint64_t a = self().next_step();
    publish_addresses(a, {in});
    for (int i = 0; i < n; ++i) {
      const int p = staggered ? (me + i + 1) % n : i;
      std::byte* dst = out + static_cast<std::size_t>(p) * bytes;
      if (p != me)
        cma_read(p, dst, address_of(p, a, 0) + from, bytes);
      else if (dst != in + from)
        cma_own_core_ ? Engine::move_large(dst, in + from, bytes) : Engine::move(dst, in + from, bytes);
    }
    const std::uint64_t b = self().next_step();
    self().publish(b);
    self().wait_all(b);
  }

  CmaConfig cma_ = CmaConfig::from_env();
  bool cma_on_ = false;
  bool cma_own_core_ = false;  // every rank's host has a core for each rank (agree_cma)
  std::vector<std::byte> cma_tmp_;       // reduce_read's blocks read from the peers
  std::vector<std::byte> cma_bounce_;    // cma_copy's scratch at a peer's page offset
  std::uint64_t probe_ = cma_probe(static_cast<std::int64_t>(::getpid()));  // read by the peers at creation

 private:
  [[nodiscard]] Engine& self() noexcept { return static_cast<Engine&>(*this); }
  [[nodiscard]] const Engine& self() const noexcept { return static_cast<const Engine&>(*this); }
};

}  // namespace comm::detail::shm
