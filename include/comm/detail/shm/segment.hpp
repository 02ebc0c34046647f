#pragma once
// The shared-memory segment of one Shm communicator: its layout, how the ranks map it through the
// store, and the identity that says whether ranks share a host.
//
// Layout (every part cache-line aligned, sizes computed by every rank from (size, chunk), never
// read from the segment):
//   Header                 magic, version, size, chunk, the abort words
//   RankCtl[size]          per rank: pid, the futex bell and its sleeper count, "left" flag
//   Head[size][kRing]      per rank, a ring of step header lines (by step mod kRing): {step, fp,
//                          check word} that the rank publishes in every step, then up to
//                          kInline bytes of payload (so a step of a few bytes moves one line)
//   Body[size][kBodyRing]  per rank, a ring of kLaneBytes payloads (by step mod kBodyRing) for
//                          the steps that carry more than kInline bytes and at most kLaneBytes
//   Half[size][2]          per rank, two halves (by step parity): `chunk` bytes of payload for the
//                          steps that carry more than kLaneBytes
//   ChannelCtl[size][size] point-to-point, per (sender, receiver): chunks posted (the sender's
//                          own count), chunks taken (written by the receiver)
//   Slot[size][size][2]    per channel two slots: a header line (the chunk's number + 1, which
//                          tells the receiver it is ready; the message's P2PHeader on its first
//                          chunk; the chunk's bytes; a payload of up to 16 bytes) and `p2p_chunk`
//                          bytes of payload
//
// Rendezvous: rank 0 creates the segment under a fresh name (shm_open O_CREAT|O_EXCL, mode 0600),
// sizes and initializes it, and publishes the name in the store; every rank maps it and adds
// itself to a counter; the rank that completes the count unlinks the name. So once the
// communicator exists nothing is left in /dev/shm, whatever happens to its processes later. If the
// rendezvous fails (a rank never comes), every rank that knows the name unlinks it before it
// throws. The one window left: rank 0 killed between creating the name and publishing it.
//
// Which ranks share a host: detail/init/host.hpp.

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <comm/detail/base/random.hpp>
#include <comm/detail/init/host.hpp>
#include <comm/error.hpp>
#include <comm/store.hpp>

namespace comm::detail::shm {

inline constexpr std::size_t kLine = 64;

/// Whether the host has a CPU for each of `n` ranks: waits spin only then (steps.hpp), and small
/// broadcasts, scatters and gathers and reduce_scatter move by a single copy (cma.hpp).
[[nodiscard]] inline bool core_per_rank(int n) noexcept {
  return std::thread::hardware_concurrency() >= static_cast<unsigned>(n);
}

/// The layout's version: 2 moved the step headers from the halves into the lanes, 3 added
/// RankCtl::cpu, 4 RankCtl::cma_slice_max, 5 RankCtl::cma_rooted_min and cma_own_core, 6
/// RankCtl::cma_reduce_min, 7 RankCtl::peer_fence, 8 the chunk number in a channel slot's line, 9
/// RankCtl::cma_broadcast_min and cma_all_gather_min, 10 RankCtl::cma_all_to_all_min, 11 no own
/// piece in a reduce_scatter's, all_to_all's or scatter's payload, 12 bodies of 64 KiB.
inline constexpr std::uint32_t kVersion = 12;

struct alignas(kLine) Header {
  static constexpr std::uint64_t kMagic = 0x636f6d6d73686d31ull;  // "commshm1"
  std::uint64_t magic;
  std::uint32_t version;
  std::int32_t size;
  std::uint64_t chunk;
  std::uint64_t total;
  alignas(kLine) std::atomic<std::uint32_t> dead;   // 1 + the rank found dead, 0: none
  alignas(kLine) std::atomic<std::uint32_t> abort;  // 1 + the rank that failed first, 0: none
};

struct alignas(kLine) RankCtl {
  std::int64_t pid;
  std::uint64_t probe;        // cross-memory attach: the address of a word that holds cma_probe(pid)
  std::atomic<std::uint32_t> cma;  // 2: this rank read every peer's probe word, 1: it could not
  std::uint32_t cma_own_core;      // 1: its host has a core for every rank (core_per_rank)
  std::uint64_t cma_min;           // its COMM_SHM_CMA_MIN
  std::uint64_t cma_slice_max;     // its COMM_SHM_CMA_SLICE_MAX
  std::uint64_t cma_rooted_min;    // its threshold for scatter and gather (CmaConfig::rooted_for)
  std::uint64_t cma_broadcast_min;  // its threshold for broadcast (CmaConfig::broadcast_for)
  std::uint64_t cma_all_gather_min;  // its threshold for all_gather (CmaConfig::all_gather_for)
  std::uint64_t cma_reduce_min;    // its threshold for reduce (CmaConfig::reduce_for)
  std::uint64_t cma_all_to_all_min;  // its threshold for all_to_all (CmaConfig::all_to_all_for)
  std::uint32_t peer_fence;        // 1: registered for its peers' fences (wait.hpp, register_peer_fence)
  alignas(kLine) std::atomic<std::uint32_t> bell;      // futex word: bumped when a waiter may sleep
  std::atomic<std::uint32_t> sleepers;                 // waiters on this rank's steps
  alignas(kLine) std::atomic<std::uint32_t> left;      // the rank destroyed its communicator
  alignas(kLine) std::atomic<std::int32_t> cpu;        // the CPU the rank last published from (-1: unknown)
};

/// A point-to-point channel's counters: the sender bumps `posted` after filling slot posted%2
/// (the slot's first word says so to the receiver), the receiver bumps `taken` after reading slot
/// taken%2 (at most two chunks in flight).
struct alignas(kLine) ChannelCtl {
  std::atomic<std::uint64_t> posted;
  alignas(kLine) std::atomic<std::uint64_t> taken;
};

/// A header line: the step it holds, then the fingerprint of that step's operation (32 bytes),
/// a check word (8 bytes; steps.hpp: at two ranks the step up to which the rank had compared its
/// steps with its peer, above two the sum over its last kRing steps), then up to kInline bytes of
/// the step's payload.
struct alignas(kLine) StepHeader {
  std::atomic<std::uint64_t> step;
  std::byte rest[kLine - sizeof(std::uint64_t)];
};

/// Header lines per rank. A rank may publish step s once every peer has published s - kRing + kLag:
/// a root of tiny broadcasts runs up to kRing - kLag steps ahead of the slowest reader instead of
/// one (two halves), which is what lets a small rooted operation return at once, as an MPI's eager
/// protocol does. A rank compares the fingerprints it did not read in a step at most kLag steps
/// later (steps.hpp), before the line can be rewritten. 32 steps of slack, where 8 held 4 ranks on
/// 2 cores to one context switch per 8 broadcasts (a 4-rank 8-byte broadcast's median 0.42 against
/// 0.28 us, its 90th percentile 15 us against 0.6: benchmarks/RESULTS.md, "A deeper ring").
inline constexpr std::uint64_t kRing = 64;
inline constexpr std::uint64_t kLag = 32;
static_assert(kLag >= 1 && kLag <= kRing - kLag);
/// Payload bytes in a header line, after the step, the fingerprint and the check word.
inline constexpr std::size_t kInline = kLine - 8 - 32 - 8;
/// Payload bytes of a body: every one-step operation up to this size moves through the lanes (the
/// default small all_reduce limit, 16 KiB, fits). Bodies are fewer than header lines (they are
/// 1,024 times larger): a root of rooted operations of kInline-kLaneBytes bytes runs up to
/// kBodyRing - 1 ahead. 64 KiB, where 16 held a root of larger payloads to one step ahead of its
/// slowest reader (a half's turn): with 4 ranks on 2 cores a 64 KiB broadcast took 16.7 against
/// 3.6 us (OpenMPI 14.8), a reduce 16.4 against 7.0 (20.4), a scatter 8.7 against 4.6 (11.0);
/// the other cells at 2 and 4 ranks, 4-64 KiB, faster or within the rounds' spread but the 4-rank
/// 64 KiB gather (4.1 against 4.7 us, OpenMPI 8.6) (benchmarks/RESULTS.md, "Bodies of 64 KiB").
/// The ring is 1 MiB per rank.
inline constexpr std::size_t kLaneBytes = std::size_t{64} << 10;
inline constexpr std::uint64_t kBodyRing = 16;

static_assert(std::atomic<std::uint64_t>::is_always_lock_free && std::atomic<std::uint32_t>::is_always_lock_free,
              "comm: the Shm backend needs lock-free 32- and 64-bit atomics in shared memory");

/// Byte offsets of the parts, from (size, chunk).
struct Layout {
  int size = 0;
  std::size_t chunk = 0;  // payload bytes per half (a multiple of kLine)
  std::size_t ctl = 0, lanes = 0, bodies = 0, halves = 0, half_bytes = 0;
  std::size_t p2p_chunk = 0;  // payload bytes per channel slot
  std::size_t channels = 0, slots = 0, slot_bytes = 0, total = 0;

  Layout(int n, std::size_t chunk_bytes) : size(n), chunk(chunk_bytes) {
    const auto un = static_cast<std::size_t>(n);
    ctl = sizeof(Header);
    lanes = ctl + un * sizeof(RankCtl);
    bodies = lanes + un * kRing * kLine;
    halves = bodies + un * kBodyRing * kLaneBytes;
    half_bytes = (chunk + kLine - 1) / kLine * kLine;
    channels = halves + un * 2 * half_bytes;
    // Channels grow with size^2: at most ~8 MiB of slots in all, 1-64 KiB per slot.
    p2p_chunk = std::clamp<std::size_t>((std::size_t{8} << 20) / (2 * un * un), std::size_t{1} << 10,
                                        std::size_t{64} << 10) / kLine * kLine;
    slots = channels + un * un * sizeof(ChannelCtl);
    slot_bytes = kLine + p2p_chunk;
    total = slots + un * un * 2 * slot_bytes;
  }
};


/// A mapped segment; unmaps on destruction.
class Mapping {
 public:
  Mapping() = default;
  Mapping(void* base, std::size_t bytes) noexcept : base_(base), bytes_(bytes) {}
  Mapping(Mapping&& o) noexcept : base_(std::exchange(o.base_, nullptr)), bytes_(o.bytes_) {}
  Mapping& operator=(Mapping&& o) noexcept {
    std::swap(base_, o.base_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~Mapping() {
    if (base_ != nullptr) ::munmap(base_, bytes_);
  }
  [[nodiscard]] std::byte* base() const noexcept { return static_cast<std::byte*>(base_); }

 private:
  void* base_ = nullptr;
  std::size_t bytes_ = 0;
};

[[nodiscard]] inline std::string errno_text(int e) { return std::strerror(e); }

/// Unlinks `name` when destroyed unless released: the creator's and the mappers' safety net.
class NameGuard {
 public:
  explicit NameGuard(std::string name) : name_(std::move(name)) {}
  NameGuard(const NameGuard&) = delete;
  NameGuard& operator=(const NameGuard&) = delete;
  ~NameGuard() {
    if (!name_.empty()) (void)::shm_unlink(name_.c_str());
  }
  void release() noexcept { name_.clear(); }

 private:
  std::string name_;
};

/// Creates (rank 0) or maps (others) the segment of the communicator whose keys start with
/// `prefix`, checks that every rank is on this host, and returns the mapping once every rank has
/// mapped it (the name is unlinked by then).
[[nodiscard]] inline Mapping rendezvous(Store& store, const std::string& prefix, int rank, const Layout& layout,
                                        std::chrono::milliseconds timeout) {
  const std::string op = "shm.init";
  // Every rank on one host: compare identities through the store.
  const std::string me = host_identity();
  store.set(prefix + "host/" + std::to_string(rank), me);
  for (int p = 0; p < layout.size; ++p) {
    if (p == rank) continue;
    const std::string key = prefix + "host/" + std::to_string(p);
    try {
      store.wait({key}, timeout);
    } catch (const Timeout&) {
      throw Timeout(op, rank,
                    "rank " + std::to_string(p) + " of " + std::to_string(layout.size) + " did not join within " +
                        std::to_string(timeout.count()) + " ms (no record " + key + ")",
                    "rank " + std::to_string(p));
    }
    const auto bytes = store.get(key);
    const std::string other(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    if (other != me)
      throw InvalidArgument(op, rank,
                            "rank " + std::to_string(p) + " is not on this host (it reports '" + other +
                                "', this process '" + me +
                                "'): the Shm backend needs every rank on one host and in one IPC, PID and network "
                                "namespace; use Gloo or Hierarchical across hosts");
  }

  const std::string name_key = prefix + "shm/name";
  std::string name;
  int fd = -1;
  if (rank == 0) {
    name = "/comm-shm-" + std::to_string(::getpid()) + "-" + std::to_string(random_u64()) + "-" +
           std::to_string(std::chrono::steady_clock::now().time_since_epoch().count());
    fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) throw BackendError(op, rank, "shm_open(" + name + ") failed: " + errno_text(errno));
  }
  NameGuard guard(name);
  if (rank == 0) {
    if (::ftruncate(fd, static_cast<off_t>(layout.total)) != 0) {
      const int e = errno;
      ::close(fd);
      throw BackendError(op, rank,
                         "ftruncate of the shared segment to " + std::to_string(layout.total) +
                             " bytes failed: " + errno_text(e) + " (is /dev/shm large enough?)");
    }
  } else {
    try {
      store.wait({name_key}, timeout);
    } catch (const Timeout&) {
      throw Timeout(op, rank, "rank 0 did not publish the shared segment within " + std::to_string(timeout.count()) +
                                  " ms", "rank 0");
    }
    const auto bytes = store.get(name_key);
    name.assign(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    if (!name.starts_with("/comm-shm-") || name.size() > 200 || name.find('/', 1) != std::string::npos)
      throw InvalidArgument(op, rank, "the segment name in the store is not comm's: '" + name.substr(0, 64) + "'");
    fd = ::shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) throw BackendError(op, rank, "shm_open(" + name + ") failed: " + errno_text(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || static_cast<std::size_t>(st.st_size) != layout.total) {
      ::close(fd);
      throw InvalidArgument(op, rank,
                            "the shared segment " + name + " has " + std::to_string(st.st_size) + " bytes, expected " +
                                std::to_string(layout.total) + ": do all ranks use the same Shm options?");
    }
  }
  void* base = ::mmap(nullptr, layout.total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  if (base == MAP_FAILED) throw BackendError(op, rank, "mmap of the shared segment failed: " + errno_text(map_errno));
  Mapping mapping(base, layout.total);
  if (rank == 0) {
    // The creator initializes everything before publishing the name (the store orders it).
    std::memset(base, 0, layout.total);
    auto* h = reinterpret_cast<Header*>(base);
    h->magic = Header::kMagic;
    h->version = kVersion;
    h->size = layout.size;
    h->chunk = layout.chunk;
    h->total = layout.total;
    store.set(name_key, name);
  } else {
    const auto* h = reinterpret_cast<const Header*>(base);
    if (h->magic != Header::kMagic || h->version != kVersion || h->size != layout.size || h->chunk != layout.chunk || h->total != layout.total)
      throw InvalidArgument(op, rank,
                            "the shared segment " + name + " does not match this communicator (size " +
                                std::to_string(h->size) + ", chunk " + std::to_string(h->chunk) + ", expected " +
                                std::to_string(layout.size) + ", " + std::to_string(layout.chunk) + ")");
  }
  // The last rank to map unlinks the name; everyone waits for that.
  const auto mapped = store.add(prefix + "shm/mapped", 1);
  if (mapped == layout.size) {
    (void)::shm_unlink(name.c_str());
    store.set(prefix + "shm/ready", "1");
  }
  try {
    store.wait({prefix + "shm/ready"}, timeout);
  } catch (const Timeout&) {
    const auto n = store.add(prefix + "shm/mapped", 0);
    throw Timeout(op, rank,
                  "only " + std::to_string(n) + " of " + std::to_string(layout.size) +
                      " ranks mapped the shared segment within " + std::to_string(timeout.count()) + " ms");
  }
  guard.release();
  return mapping;
}

}  // namespace comm::detail::shm
