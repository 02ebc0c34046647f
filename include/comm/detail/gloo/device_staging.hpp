#pragma once
// Device buffers on the Gloo backend: CUDA device memory is staged through pinned host memory so
// that gloo, which only reads and writes host memory, can move it (and several ranks can share one
// GPU, which NCCL does not allow before 2.30).
//
// How an operation with a device buffer runs:
//   issue (caller's thread)   the buffers are classified (cuda_driver.hpp) and a pinned block is
//                             leased from the communicator's pool; the engine gets host spans
//                             into that block (or the caller's own host buffers where they are
//                             host memory) and the two steps below as the operation's hooks.
//   before (executing thread) device inputs are copied into the block, in the operation's place
//                             in the issue order, so earlier queued operations that write the same
//                             device buffer are seen.
//   after (executing thread)  the result is copied back to device memory, once the collective
//                             succeeded and before the operation counts as complete, so a Work
//                             completes (and a blocking call returns) with the result on the device.
// Only what the operation reads is copied in and only what it writes is copied out: broadcast
// copies in on the root and out elsewhere; gather copies out on the root only; an in-place or
// device-to-device all_reduce / all_gather runs in place on one block.
//
// The pool is per communicator and grow-only: a request takes the smallest free block that fits,
// else a new block (a power of two, at least 64 KiB), so steady traffic allocates nothing; at most
// kMaxFree blocks are kept when several operations were in flight at once. Blocks are
// cuMemHostAlloc(PORTABLE) memory of the primary context of the first device seen (retained for
// the process), usable from every context. The pool lives as long as its last lease (an operation
// still queued keeps it alive after the communicator is gone).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <comm/detail/cuda/driver.hpp>
#include <comm/detail/engine/op.hpp>
#include <comm/detail/diagnostics/nvtx.hpp>
#include <comm/error.hpp>
#include <comm/types.hpp>

namespace comm::detail::gloo {

/// Pinned host blocks for staging (thread-safe: leases are taken on issuing threads and returned
/// on the executing thread).
class StagingPool : public std::enable_shared_from_this<StagingPool> {
 public:
  static constexpr std::size_t kMinBlock = std::size_t{64} << 10;
  static constexpr std::size_t kMaxFree = 4;

  struct Block {
    void* ptr = nullptr;
    std::size_t size = 0;
  };

  /// A block taken from the pool; goes back when destroyed.
  class Lease {
   public:
    Lease() = default;
    Lease(std::shared_ptr<StagingPool> pool, Block b) noexcept : pool_(std::move(pool)), block_(b) {}
    Lease(Lease&& o) noexcept : pool_(std::move(o.pool_)), block_(std::exchange(o.block_, Block{})) {}
    Lease& operator=(Lease&& o) noexcept {
      if (this != &o) {
        reset();
        pool_ = std::move(o.pool_);
        block_ = std::exchange(o.block_, Block{});
      }
      return *this;
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { reset(); }

    [[nodiscard]] std::byte* data() const noexcept { return static_cast<std::byte*>(block_.ptr); }

   private:
    void reset() noexcept {
      if (pool_ && block_.ptr != nullptr) pool_->give_back(block_);
      pool_.reset();
      block_ = Block{};
    }
    std::shared_ptr<StagingPool> pool_;
    Block block_;
  };

  StagingPool() = default;
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;
  ~StagingPool() {
    for (const auto& b : free_) free_block(b);
  }

  /// A block of at least `bytes`; `device` is a device the operation's buffers live on (new
  /// blocks are allocated in its primary context unless the pool already has a device).
  [[nodiscard]] Lease acquire(std::size_t bytes, int device, const std::string& op, int rank) {
    {
      std::lock_guard lock(mu_);
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it)
        if (it->size >= bytes && (best == free_.end() || it->size < best->size)) best = it;
      if (best != free_.end()) {
        const Block b = *best;
        free_.erase(best);
        return Lease(shared_from_this(), b);
      }
      if (device_ < 0) device_ = device;
    }
    std::size_t size = kMinBlock;
    while (size < bytes) size *= 2;
    auto& d = cuda::Driver::get();
    Block b{nullptr, size};
    {
      cuda::ScopedContext scope(d.primary_context(device_, op, rank), op, rank);
      const cuda::CUresult r = d.api().mem_host_alloc(&b.ptr, size, cuda::kHostAllocPortable);
      if (r != cuda::kSuccess)
        throw BackendError(op, rank,
                           "cannot allocate " + std::to_string(size) +
                               " bytes of pinned host memory to stage a device buffer: CUDA driver " +
                               d.describe("cuMemHostAlloc", r));
    }
    return Lease(shared_from_this(), b);
  }

  /// Blocks held, free or leased (for tests).
  [[nodiscard]] std::size_t free_blocks() const {
    std::lock_guard lock(mu_);
    return free_.size();
  }

 private:
  void give_back(Block b) noexcept {
    std::optional<Block> evicted;
    {
      std::lock_guard lock(mu_);
      free_.push_back(b);
      if (free_.size() > kMaxFree) {
        const auto smallest = std::min_element(free_.begin(), free_.end(),
                                               [](const Block& x, const Block& y) { return x.size < y.size; });
        evicted = *smallest;
        free_.erase(smallest);
      }
    }
    if (evicted) free_block(*evicted);
  }

  void free_block(const Block& b) noexcept {
    // Best effort: at process exit the driver may already be shut down, and the memory goes with it.
    try {
      auto& d = cuda::Driver::get();
      cuda::ScopedContext scope(d.primary_context(device_, "staging.free", -1), "staging.free", -1);
      (void)d.api().mem_free_host(b.ptr);
    } catch (...) {
    }
  }

  mutable std::mutex mu_;
  std::vector<Block> free_;
  int device_ = -1;  // whose primary context allocates (and frees) the blocks
};

/// The copies of one staged operation, run by its hooks.
class StagingPlan {
 public:
  struct Copy {
    void* dst;
    const void* src;
    std::size_t bytes;
    cuda::PointerInfo device;  // the device side of the copy
  };

  /// `count` and `dtype_code` (the operation's element count and comm::Dtype) only name its NVTX range.
  StagingPlan(const char* op, int rank, std::uint64_t count = 0, std::uint8_t dtype_code = 0xff)
      : op_(op), rank_(rank), count_(count), dtype_(dtype_code) {}

  /// Reserves `bytes` of the (single) pinned block, 64-byte aligned; returns its offset.
  std::size_t reserve(std::size_t bytes) {
    const std::size_t at = (size_ + 63) & ~std::size_t{63};
    size_ = at + bytes;
    return at;
  }
  /// Leases the block (after every reserve) and returns its start.
  std::byte* lease(StagingPool& pool, int device) {
    lease_ = pool.acquire(size_, device, op_, rank_);
    return lease_.data();
  }
  void copy_in(void* host, const void* dev, std::size_t bytes, const cuda::PointerInfo& info) {
    if (bytes != 0) in_.push_back({host, dev, bytes, info});
  }
  void copy_out(void* dev, const void* host, std::size_t bytes, const cuda::PointerInfo& info) {
    if (bytes != 0) out_.push_back({dev, host, bytes, info});
  }

  void before() const {
    for (const auto& c : in_) cuda::copy_to_host(c.dst, c.src, c.bytes, c.device, op_, rank_);
  }
  void after() const {
    for (const auto& c : out_) cuda::copy_to_device(c.dst, c.src, c.bytes, c.device, op_, rank_);
  }

  /// The engine hooks running this plan (an empty step where there is nothing to copy).
  static OpHooks hooks(std::shared_ptr<StagingPlan> p) {
    OpHooks h;
    if (nvtx::enabled()) [[unlikely]] {
      // COMM_NVTX=1: a range "comm.<op> count=<n> type=<t> staged" on the executing thread from
      // the copy-in to the copy-out; the plan ends it when the operation fails (detail/diagnostics/nvtx.hpp).
      h.before = [p] {
        p->range_.start(p->op_.c_str(), p->count_, p->dtype_);
        p->before();
      };
      h.after = [p] {
        p->after();
        p->range_.end();
      };
      return h;
    }
    if (!p->in_.empty()) h.before = [p] { p->before(); };
    if (!p->out_.empty()) h.after = [p] { p->after(); };
    return h;
  }

 private:
  std::string op_;
  int rank_;
  std::size_t size_ = 0;
  StagingPool::Lease lease_;
  std::vector<Copy> in_, out_;
  std::uint64_t count_ = 0;  // NVTX only
  std::uint8_t dtype_ = 0xff;
  nvtx::Range range_;
};

/// What the engine runs instead of the caller's buffers: host spans and the staging hooks.
template <class T>
struct Staged {
  std::span<const T> in;
  std::span<T> out;
  OpHooks hooks;
};

/// Decides per operation whether staging is needed and builds it. Without a usable CUDA driver
/// every entry point is one branch that returns nullopt. Movable; the pool is made on first use,
/// so a communicator that never sees device memory allocates nothing.
class DeviceStaging {
 public:
  DeviceStaging() noexcept = default;

  // The entry points: where no CUDA driver is usable they reduce to one branch the caller inlines
  // (the staging itself is kept out of line so that it does not weigh on every call site).
  template <class T>
  [[nodiscard]] std::optional<Staged<T>> all_reduce(std::span<const T> in, std::span<T> out, int rank) {
    if (!cuda::driver_usable()) return std::nullopt;
    return stage_all_reduce<T>(in, out, rank);
  }
  template <class T>
  [[nodiscard]] std::optional<Staged<T>> reduce_scatter(std::span<const T> in, std::span<T> out, int rank) {
    if (!cuda::driver_usable()) return std::nullopt;
    return stage_reduce_scatter<T>(in, out, rank);
  }
  template <class T>
  [[nodiscard]] std::optional<Staged<T>> all_gather(std::span<const T> in, std::span<T> out, int rank) {
    if (!cuda::driver_usable()) return std::nullopt;
    return stage_all_gather<T>(in, out, rank);
  }
  /// broadcast: the host span comes back as `out` (the engine takes one).
  template <class T>
  [[nodiscard]] std::optional<Staged<T>> broadcast(std::span<T> data, int root, int rank) {
    if (!cuda::driver_usable()) return std::nullopt;
    return stage_broadcast<T>(data, root, rank);
  }
  /// gather: `out` is only looked at on the root (it may be anything elsewhere).
  template <class T>
  [[nodiscard]] std::optional<Staged<T>> gather(std::span<const T> in, std::span<T> out, int root, int rank) {
    if (!cuda::driver_usable()) return std::nullopt;
    return stage_gather<T>(in, out, root, rank);
  }

  /// The pool (made on first use).
  [[nodiscard]] StagingPool& pool() {
    // One mutex for every communicator: it is only taken by operations that stage, where it is
    // nothing next to the copies.
    static std::mutex init;
    std::lock_guard lock(init);
    if (!pool_) pool_ = std::make_shared<StagingPool>();
    return *pool_;
  }

 private:
  template <class T>
  [[nodiscard, gnu::noinline]] std::optional<Staged<T>> stage_all_reduce(std::span<const T> in, std::span<T> out,
                                                                         int rank) {
    if (out.empty()) return std::nullopt;
    const bool in_place = static_cast<const void*>(in.data()) == static_cast<const void*>(out.data());
    const auto oi = cuda::pointer_info(out.data());
    const auto ii = in_place ? oi : cuda::pointer_info(in.data());
    if (!ii.device && !oi.device) return std::nullopt;
    const std::size_t bytes = out.size_bytes();
    auto plan = std::make_shared<StagingPlan>("all_reduce", rank, out.size(), static_cast<std::uint8_t>(dtype_of<T>));
    if (!oi.device) {
      // Device input, host output: bring the input into the output and reduce there in place.
      plan->copy_in(out.data(), in.data(), bytes, ii);
      return finish<T>(plan, out, out);
    }
    const std::size_t at = plan->reserve(bytes);
    auto* h = reinterpret_cast<T*>(plan->lease(pool(), oi.ordinal) + at);
    const std::span<T> host(h, out.size());
    plan->copy_out(out.data(), h, bytes, oi);
    if (ii.device) {
      plan->copy_in(h, in.data(), bytes, ii);  // in place on the block
      return finish<T>(plan, host, host);
    }
    return finish<T>(plan, in, host);
  }

  template <class T>
  [[nodiscard, gnu::noinline]] std::optional<Staged<T>> stage_reduce_scatter(std::span<const T> in, std::span<T> out,
                                                                             int rank) {
    if (out.empty()) return std::nullopt;
    return stage_separate("reduce_scatter", in, cuda::pointer_info(in.data()), out, cuda::pointer_info(out.data()),
                          rank, out.size());
  }

  template <class T>
  [[nodiscard, gnu::noinline]] std::optional<Staged<T>> stage_all_gather(std::span<const T> in, std::span<T> out,
                                                                         int rank) {
    if (in.empty()) return std::nullopt;
    const auto oi = cuda::pointer_info(out.data());
    const auto ii = cuda::pointer_info(in.data());
    if (!ii.device && !oi.device) return std::nullopt;
    const std::size_t slot = static_cast<std::size_t>(rank) * in.size();
    auto plan = std::make_shared<StagingPlan>("all_gather", rank, in.size(), static_cast<std::uint8_t>(dtype_of<T>));
    if (!oi.device) {
      // Device input, host output: copy it into this rank's slot and gather in place.
      plan->copy_in(out.data() + slot, in.data(), in.size_bytes(), ii);
      return finish<T>(plan, std::span<const T>(out.data() + slot, in.size()), out);
    }
    const std::size_t at = plan->reserve(out.size_bytes());
    auto* h = reinterpret_cast<T*>(plan->lease(pool(), oi.ordinal) + at);
    const std::span<T> host(h, out.size());
    plan->copy_out(out.data(), h, out.size_bytes(), oi);
    if (ii.device) {
      plan->copy_in(h + slot, in.data(), in.size_bytes(), ii);  // into its slot: gathered in place
      return finish<T>(plan, std::span<const T>(h + slot, in.size()), host);
    }
    return finish<T>(plan, in, host);
  }

  template <class T>
  [[nodiscard, gnu::noinline]] std::optional<Staged<T>> stage_broadcast(std::span<T> data, int root, int rank) {
    if (data.empty()) return std::nullopt;
    const auto di = cuda::pointer_info(data.data());
    if (!di.device) return std::nullopt;
    auto plan = std::make_shared<StagingPlan>("broadcast", rank, data.size(), static_cast<std::uint8_t>(dtype_of<T>));
    const std::size_t at = plan->reserve(data.size_bytes());
    auto* h = reinterpret_cast<T*>(plan->lease(pool(), di.ordinal) + at);
    if (rank == root)
      plan->copy_in(h, data.data(), data.size_bytes(), di);  // the root's data is not changed
    else
      plan->copy_out(data.data(), h, data.size_bytes(), di);
    const std::span<T> host(h, data.size());
    return finish<T>(plan, host, host);
  }

  template <class T>
  [[nodiscard, gnu::noinline]] std::optional<Staged<T>> stage_gather(std::span<const T> in, std::span<T> out, int root,
                                                                     int rank) {
    if (in.empty()) return std::nullopt;
    const auto oi = rank == root ? cuda::pointer_info(out.data()) : cuda::PointerInfo{};
    return stage_separate("gather", in, cuda::pointer_info(in.data()), out, oi, rank, in.size());
  }

  /// An operation that reads all of `in` and writes all of `out` (two separate buffers): each
  /// device one gets its own region of one block. `count`: the operation's element count (NVTX).
  template <class T>
  std::optional<Staged<T>> stage_separate(const char* op, std::span<const T> in, const cuda::PointerInfo& ii,
                                          std::span<T> out, const cuda::PointerInfo& oi, int rank,
                                          std::size_t count) {
    if (!ii.device && !oi.device) return std::nullopt;
    auto plan = std::make_shared<StagingPlan>(op, rank, count, static_cast<std::uint8_t>(dtype_of<T>));
    const std::size_t at_in = ii.device ? plan->reserve(in.size_bytes()) : 0;
    const std::size_t at_out = oi.device ? plan->reserve(out.size_bytes()) : 0;
    std::byte* base = plan->lease(pool(), ii.device ? ii.ordinal : oi.ordinal);
    std::span<const T> hin = in;
    std::span<T> hout = out;
    if (ii.device) {
      auto* h = reinterpret_cast<T*>(base + at_in);
      plan->copy_in(h, in.data(), in.size_bytes(), ii);
      hin = std::span<const T>(h, in.size());
    }
    if (oi.device) {
      auto* h = reinterpret_cast<T*>(base + at_out);
      plan->copy_out(out.data(), h, out.size_bytes(), oi);
      hout = std::span<T>(h, out.size());
    }
    return finish<T>(plan, hin, hout);
  }

  template <class T>
  static Staged<T> finish(std::shared_ptr<StagingPlan> plan, std::span<const T> in, std::span<T> out) {
    return Staged<T>{in, out, StagingPlan::hooks(std::move(plan))};
  }

  std::shared_ptr<StagingPool> pool_;
};

}  // namespace comm::detail::gloo
