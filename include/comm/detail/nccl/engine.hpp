#pragma once
// The NCCL engine behind comm::backends::Nccl: the communicator handle, its stream, the per-op
// stream ordering and Work states, the collectives, and the watchdog target.
//
// Per operation (under the engine's lock: NCCL allows one thread at a time per communicator):
//   1. the communicator's stream waits for the caller's current stream (an event, skipped when
//      they are the same stream);
//   2. the NCCL call is enqueued on the communicator's stream; a non-blocking communicator may
//      answer ncclInProgress, then ncclCommGetAsyncError is polled until it is enqueued (bounded by
//      the deadline);
//   3. a completion event is recorded and handed to the watchdog with the deadline;
//   4. blocking form: the caller's current stream waits for that event (no host wait; barrier
//      also waits on the host); async form: a Work on the event is returned.
// With the desync check on, step 1 is preceded by an ncclAllGather of every rank's 32-byte
// fingerprint of the operation on the communicator's stream, which the host waits for (so the
// operation waits for the earlier ones) before it compares them (detail/desync.hpp).
// Point-to-point operations (send, recv, batch_isend_irecv) involve two ranks, not the group: they
// skip the desync check and take no collective sequence number (the fingerprint's), so that it
// matches across ranks whatever point-to-point operations some of them run in between.
//
// Every operation (and split, monitored_barrier) gets the next sequence number under the lock and
// goes into the flight recorder: queued when issued, started when it reaches the head of the
// stream (the watchdog saw its predecessors complete), completed or failed as the watchdog sees it.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <comm/concepts.hpp>
#include <comm/detail/desync.hpp>
#include <comm/detail/flight_recorder.hpp>
#include <comm/detail/logging.hpp>
#include <comm/detail/monitored_barrier.hpp>
#include <comm/detail/nccl/bootstrap.hpp>
#include <comm/detail/nccl/comms_timing.hpp>
#include <comm/detail/nccl/device.hpp>
#include <comm/detail/nccl/errors.hpp>
#include <comm/detail/nccl/types.hpp>
#include <comm/detail/nccl/watchdog.hpp>
#include <comm/detail/nccl/work.hpp>
#include <comm/detail/nvtx.hpp>
#include <comm/diagnostics.hpp>
#include <comm/error.hpp>
#include <comm/store.hpp>
#include <comm/types.hpp>
#include <comm/work.hpp>

namespace comm::detail::nccl {

/// What the engine needs from the backend options, resolved.
struct Settings {
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  GatherAlgorithm gather = GatherAlgorithm::p2p;  ///< native or p2p (never automatic)
  bool check_pointers = true;
  bool may_abort = true;  ///< the watchdog may ncclCommAbort the communicator after a failure
  WatchdogTiming timing{};
  bool desync_check = false;
  std::size_t flight_recorder_size = 256;
};

/// Where a communicator lives on its store, and how its flight-record dumps are named.
struct Origin {
  std::shared_ptr<comm::Store> store;  ///< the rendezvous store; null when adopted
  std::string key_prefix;              ///< "comm/nccl/<n>/": this communicator's keys in `store`
  int file_rank = 0;                   ///< the rank in dump file names (a subgroup: its root's)
  std::string name;                    ///< "" (root), "c2" (2nd on its store), "g0", "g0.g1", "adopted"
};

/// The error for a subgroup or monitored_barrier on a communicator without a store.
[[nodiscard]] inline InvalidArgument no_store_error(const std::string& op, int rank) {
  return InvalidArgument(op, rank,
                         "this communicator was adopted from an ncclComm_t and has no store; " + op +
                             " needs one (create the communicator with create() or from_env(); split works "
                             "without a store)");
}

/// ncclCommAbort on `device` (the caller's device is restored).
inline void abort_comm(ncclComm_t comm, int device) noexcept {
  if (comm == nullptr) return;
  int prev = -1;
  const bool restore = cudaGetDevice(&prev) == cudaSuccess && prev != device;
  if (restore) (void)cudaSetDevice(device);
  (void)ncclCommAbort(comm);
  if (restore) (void)cudaSetDevice(prev);
}

template <class>
inline constexpr bool always_false = false;

/// Checks that `stream` (when it is an ordinary stream) belongs to `device`.
inline void check_stream_device([[maybe_unused]] cudaStream_t stream, [[maybe_unused]] int device,
                                [[maybe_unused]] const std::string& op, [[maybe_unused]] int rank) {
#if CUDART_VERSION >= 12080
  if (stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread) return;
  int d = -1;
  COMM_CUDA_CHECK(cudaStreamGetDevice(stream, &d), op, rank);
  if (d != device)
    throw InvalidArgument(op, rank,
                          "the stream belongs to device " + std::to_string(d) + " but the communicator uses device " +
                              std::to_string(device));
#endif
}

class Engine final : public WatchTarget {
 public:
  /// Takes `comm` (destroyed, or aborted after a failure, by the engine when `owns_comm`; else left
  /// to its owner) and runs on `stream`, or on a stream of its own when there is none.
  Engine(ncclComm_t comm, bool owns_comm, int rank, int size, int device, std::optional<cudaStream_t> stream,
         Settings settings, Origin origin = {})
      : comm_(comm),
        owns_comm_(owns_comm),
        rank_(rank),
        size_(size),
        device_(device),
        settings_(std::move(settings)),
        origin_(std::move(origin)),
        recorder_(settings_.flight_recorder_size),
        dump_path_(flight_recorder_path()),
        events_(std::make_shared<EventPool>(device)),
        watchdog_(*this, rank, settings_.timing) {
    try {
      const std::string op = "nccl.init";
      DeviceGuard guard(device_, op, rank_);
      if (stream) {
        stream_ = *stream;
      } else {
        COMM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), op, rank_);
        owns_stream_ = true;
      }
      COMM_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), op, rank_);
      COMM_CUDA_CHECK(cudaMalloc(&scratch_, sizeof(float)), op, rank_);
      COMM_CUDA_CHECK(cudaMemsetAsync(scratch_, 0, sizeof(float), stream_), op, rank_);
      COMM_CUDA_CHECK(cudaDeviceGetAttribute(&cc_major_, cudaDevAttrComputeCapabilityMajor, device_), op, rank_);
      COMM_CUDA_CHECK(cudaDeviceGetAttribute(&cc_minor_, cudaDevAttrComputeCapabilityMinor, device_), op, rank_);
      if (settings_.desync_check) {
        // The fingerprint exchange: every rank's in fp_dev_[0, size), this rank's own at [size].
        const std::size_t bytes = (static_cast<std::size_t>(size_) + 1) * sizeof(Fingerprint);
        COMM_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&fp_dev_), bytes), op, rank_);
        COMM_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&fp_host_), bytes, cudaHostAllocDefault), op, rank_);
        COMM_CUDA_CHECK(cudaEventCreateWithFlags(&fp_done_, cudaEventDisableTiming), op, rank_);
      }
      comms_.attach(origin_.file_rank, rank_, size_, origin_.name);  // COMM_COMMS_LOG / COMM_TRACE
    } catch (...) {
      release(/*healthy=*/false);
      throw;
    }
    watchdog_.start();
  }

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  /// Lets issued operations finish (each ends by its deadline), stops the watchdog, then
  /// finalizes and destroys an owned communicator (aborting it if that does not finish in time).
  ~Engine() override {
    (void)watchdog_.wait_idle(Clock::now() + settings_.timeout + std::chrono::seconds(5));
    watchdog_.stop();
    comms_.finish(device_);  // the comms log's last operations and summary
    if (!dump_path_.empty()) {
      try {
        write_text_file(dump_file(), to_string(flight_record()), rank_);
      } catch (const std::exception& e) {
        try {
          log(LogLevel::warn, e.what());
        } catch (...) {
        }
      }
    }
    release(/*healthy=*/!watchdog_.failed());
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return settings_.timeout; }
  [[nodiscard]] GatherAlgorithm gather_algorithm() const noexcept { return settings_.gather; }
  [[nodiscard]] bool owns_comm() const noexcept { return owns_comm_; }
  /// The NCCL communicator (null once the watchdog aborted it).
  [[nodiscard]] ncclComm_t comm() const {
    std::lock_guard lock(nccl_mu_);
    return comm_;
  }
  /// Operations issued and not yet seen complete.
  [[nodiscard]] std::size_t pending() const { return watchdog_.pending(); }
  /// The first failure of the communicator, or null.
  [[nodiscard]] std::exception_ptr failure() const { return watchdog_.failure(); }

  /// The store this communicator rendezvoused on (null when adopted) and its key prefix there.
  [[nodiscard]] const std::shared_ptr<comm::Store>& store() const noexcept { return origin_.store; }
  [[nodiscard]] const std::string& key_prefix() const noexcept { return origin_.key_prefix; }
  [[nodiscard]] int file_rank() const noexcept { return origin_.file_rank; }
  [[nodiscard]] const std::string& name() const noexcept { return origin_.name; }
  [[nodiscard]] bool desync_check() const noexcept { return settings_.desync_check; }
  /// The next subgroup number (split and new_group count on every rank of this communicator).
  [[nodiscard]] std::uint64_t next_group_index() noexcept { return groups_.fetch_add(1); }

  [[nodiscard]] FlightRecord flight_record() const {
    return recorder_.snapshot("nccl", rank_, size_, origin_.name);
  }
  /// The file of automatic dumps: COMM_FLIGHT_RECORDER + "." + rank [+ "." + name].
  [[nodiscard]] std::string dump_file() const {
    return dump_path_ + "." + std::to_string(origin_.file_rank) +
           (origin_.name.empty() ? std::string() : "." + origin_.name);
  }

  /// Blocks the host until every operation issued so far has completed (bounded by the timeout),
  /// then throws the communicator's failure if it has one.
  void synchronize() { wait_issued("synchronize"); }

  /// ncclCommSplit, a collective over every rank (an operation "split" in the sequence, with the
  /// desync check when on): the new communicator (the caller owns it), or null for a negative
  /// color. Ends by the timeout; a failure or the deadline fails (and aborts) this communicator,
  /// as a failed operation does, and aborts the half-made new one.
  [[nodiscard]] ncclComm_t split(int color, int key, const InitConfig& config) {
    constexpr const char* op = "split";
    const OpDesc d{OpKind::split, OpDesc::none, OpDesc::none, -1, 0};
    std::lock_guard lock(nccl_mu_);
    throw_if_failed(op);
    if (comm_ == nullptr) throw BackendError(op, rank_, "the NCCL communicator is no longer usable");
    DeviceGuard guard(device_, op, rank_);
    const std::uint64_t seq = seq_++;
    const std::uint64_t coll = coll_seq_++;
    const nvtx::ScopedRange range(op, 0, OpDesc::none, seq);  // COMM_NVTX=1 (detail/nvtx.hpp)
    recorder_.issued(seq, d);
    op_deadline_ = Clock::now() + settings_.timeout;
    try {
      if (settings_.desync_check) check_desync(d, seq, coll);
      recorder_.started(seq);
      ncclComm_t child = split_comm(color, key, config, seq);
      recorder_.completed(seq);
      return child;
    } catch (...) {
      op_error(seq, std::current_exception());
      throw;
    }
  }

  /// See detail/monitored_barrier.hpp: through the store, after every operation issued so far has
  /// completed (waited for on the host, bounded by this communicator's timeout).
  void monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks) {
    constexpr const char* op = "monitored_barrier";
    if (!origin_.store) throw no_store_error(op, rank_);
    std::uint64_t seq = 0, index = 0;
    nvtx::ScopedRange range;  // COMM_NVTX=1 (detail/nvtx.hpp)
    {
      std::lock_guard lock(nccl_mu_);
      throw_if_failed(op);
      seq = seq_++;
      range.push(op, 0, OpDesc::none, seq);
      index = monitored_barriers_++;
      recorder_.issued(seq, OpDesc{OpKind::monitored_barrier, OpDesc::none, OpDesc::none, -1, 0});
    }
    try {
      wait_issued(op);
      recorder_.started(seq);
      comm::detail::monitored_barrier(*origin_.store, origin_.key_prefix + "mb", index, rank_, size_, timeout,
                                      wait_all_ranks);
      recorder_.completed(seq);
    } catch (const std::exception& e) {
      recorder_.failed(seq, e.what());
      dump_after_error();
      throw;
    }
  }

  // ---- collectives (arguments already checked by the facade, except device pointers) ----

  // `red`: a ReduceOp value, a comm::op::builtin<R> object or comm::op::premul_sum_t (see
  // reduction_arg).

  template <class T, class Red, class Launch>
  auto all_reduce(std::span<const T> in, std::span<T> out, const Red& red, Launch l) {
    constexpr const char* op = "all_reduce";
    RedArg a = reduction_arg<T>(op, red);
    check_buffer(op, in.data(), in.size_bytes(), "input");
    check_buffer(op, out.data(), out.size_bytes(), "output");
    const ncclDataType_t dt = nccl_dtype(dtype_of<T>);
    const OpDesc d{OpKind::all_reduce, dtype_code<T>(), a.code, -1, in.size()};
    return issue(d, l, out.empty(), [&](ncclComm_t c, cudaStream_t s) {
      return with_red_op(op, a, dt, c, [&](ncclRedOp_t o) {
        return COMM_NCCL_CHECK(ncclAllReduce(in.data(), out.data(), out.size(), dt, o, c, s), op, rank_, c);
      });
    });
  }

  template <class T, class Red, class Launch>
  auto reduce_scatter(std::span<const T> in, std::span<T> out, const Red& red, Launch l) {
    constexpr const char* op = "reduce_scatter";
    RedArg a = reduction_arg<T>(op, red);
    check_buffer(op, in.data(), in.size_bytes(), "input");
    check_buffer(op, out.data(), out.size_bytes(), "output");
    const ncclDataType_t dt = nccl_dtype(dtype_of<T>);
    const OpDesc d{OpKind::reduce_scatter, dtype_code<T>(), a.code, -1, out.size()};
    return issue(d, l, out.empty(), [&](ncclComm_t c, cudaStream_t s) {
      return with_red_op(op, a, dt, c, [&](ncclRedOp_t o) {
        return COMM_NCCL_CHECK(ncclReduceScatter(in.data(), out.data(), out.size(), dt, o, c, s), op, rank_, c);
      });
    });
  }

  /// ncclReduce: `out` is used on the root only (in place when it is `in`); elsewhere NCCL gets a
  /// null receive buffer (its rule: recvbuff is only used on the root), so an empty `out` is fine
  /// and an in-place call leaves the non-root ranks' data as it was.
  template <class T, class Red, class Launch>
  auto reduce(std::span<const T> in, std::span<T> out, int root, const Red& red, Launch l) {
    constexpr const char* op = "reduce";
    RedArg a = reduction_arg<T>(op, red);
    check_buffer(op, in.data(), in.size_bytes(), "input");
    if (rank_ == root) check_buffer(op, out.data(), out.size_bytes(), "output");
    const ncclDataType_t dt = nccl_dtype(dtype_of<T>);
    void* recv = rank_ == root ? static_cast<void*>(out.data()) : nullptr;
    const OpDesc d{OpKind::reduce, dtype_code<T>(), a.code, root, in.size()};
    return issue(d, l, in.empty(), [&](ncclComm_t c, cudaStream_t s) {
      return with_red_op(op, a, dt, c, [&](ncclRedOp_t o) {
        return COMM_NCCL_CHECK(ncclReduce(in.data(), recv, in.size(), dt, o, root, c, s), op, rank_, c);
      });
    });
  }

  /// all_reduce (scatter = false) or reduce_scatter (true) with NCCL's pre-multiplied sum:
  /// every rank's input is multiplied by its own `scalar`, then summed.
  template <class T, class Launch>
  auto premul_sum(bool scatter, std::span<const T> in, std::span<T> out, T scalar, Launch l) {
    const char* op = scatter ? "reduce_scatter" : "all_reduce";
    const std::size_t n = static_cast<std::size_t>(size_);
    if (!scatter && in.size() != out.size())
      throw InvalidArgument(op, rank_,
                            "premul_sum: input has " + std::to_string(in.size()) + " elements but output has " +
                                std::to_string(out.size()));
    if (scatter && in.size() != n * out.size())
      throw InvalidArgument(op, rank_,
                            "premul_sum: input has " + std::to_string(in.size()) + " elements, expected size()*output = " +
                                std::to_string(n * out.size()));
    static_assert(reduction_supported(ReduceOp::sum, dtype_of<T>),
                  "comm: the nccl backend does not reduce this element type");
    check_reduction_runtime<T>(op);
    check_buffer(op, in.data(), in.size_bytes(), "input");
    check_buffer(op, out.data(), out.size_bytes(), "output");
    const ncclDataType_t dt = nccl_dtype(dtype_of<T>);
    RedArg a;
    a.premul = true;
    std::memcpy(a.scalar, &scalar, sizeof(T));
    a.code = static_cast<std::uint8_t>(ReduceOp::sum);
    const OpDesc d{scatter ? OpKind::reduce_scatter : OpKind::all_reduce, dtype_code<T>(), a.code, -1, out.size()};
    return issue(d, l, out.empty(), [&](ncclComm_t c, cudaStream_t s) {
      return with_red_op(op, a, dt, c, [&](ncclRedOp_t o) {
        return scatter
                   ? COMM_NCCL_CHECK(ncclReduceScatter(in.data(), out.data(), out.size(), dt, o, c, s), op, rank_, c)
                   : COMM_NCCL_CHECK(ncclAllReduce(in.data(), out.data(), out.size(), dt, o, c, s), op, rank_, c);
      });
    });
  }

  template <class T, class Launch>
  auto all_gather(std::span<const T> in, std::span<T> out, Launch l) {
    constexpr const char* op = "all_gather";
    check_buffer(op, in.data(), in.size_bytes(), "input");
    check_buffer(op, out.data(), out.size_bytes(), "output");
    const ncclDataType_t dt = transfer_dtype(dtype_of<T>);
    const OpDesc d{OpKind::all_gather, dtype_code<T>(), OpDesc::none, -1, in.size()};
    return issue(d, l, in.empty(), [&](ncclComm_t c, cudaStream_t s) {
      return COMM_NCCL_CHECK(ncclAllGather(in.data(), out.data(), in.size(), dt, c, s), op, rank_, c);
    });
  }

  template <class T, class Launch>
  auto broadcast(std::span<T> data, int root, Launch l) {
    constexpr const char* op = "broadcast";
    check_buffer(op, data.data(), data.size_bytes(), "data");
    const ncclDataType_t dt = transfer_dtype(dtype_of<T>);
    const OpDesc d{OpKind::broadcast, dtype_code<T>(), OpDesc::none, root, data.size()};
    return issue(d, l, data.empty(), [&](ncclComm_t c, cudaStream_t s) {
      return COMM_NCCL_CHECK(ncclBroadcast(data.data(), data.data(), data.size(), dt, root, c, s), op, rank_, c);
    });
  }

  template <class T, class Launch>
  auto gather(std::span<const T> in, std::span<T> out, int root, Launch l) {
    constexpr const char* op = "gather";
    check_buffer(op, in.data(), in.size_bytes(), "input");
    if (rank_ == root) check_buffer(op, out.data(), out.size_bytes(), "output");
    const ncclDataType_t dt = transfer_dtype(dtype_of<T>);
    void* recv = rank_ == root ? static_cast<void*>(out.data()) : nullptr;
    const OpDesc d{OpKind::gather, dtype_code<T>(), OpDesc::none, root, in.size()};
#if COMM_NCCL_HAS_GATHER
    if (settings_.gather == GatherAlgorithm::native)
      return issue(d, l, in.empty(), [&](ncclComm_t c, cudaStream_t s) {
        return COMM_NCCL_CHECK(ncclGather(in.data(), recv, in.size(), dt, root, c, s), op, rank_, c);
      });
#endif
    return issue(d, l, in.empty(), [&](ncclComm_t c, cudaStream_t s) {
      return gather_p2p(in.data(), recv, in.size(), sizeof(T), dt, root, c, s);
    });
  }

  /// NCCL has no barrier: an all_reduce of one float. The blocking form also waits on the host
  /// until it completed, so it returns once every rank has entered the barrier.
  template <class Launch>
  auto barrier(Launch l) {
    constexpr const char* op = "barrier";
    return issue(
        OpDesc{OpKind::barrier, OpDesc::none, OpDesc::none, -1, 0}, l, false,
        [&](ncclComm_t c, cudaStream_t s) {
          return COMM_NCCL_CHECK(ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, c, s), op, rank_, c);
        },
        /*host_wait=*/true);
  }

  // ---- the rest of the surface (concepts.hpp, capability 11) ----
  // scatter, all_to_all(_v), send, recv and batch_isend_irecv are ncclSend/ncclRecv in one group
  // call (ncclGroupStart/End), as torch.distributed does, on every NCCL; a rank's own block is a
  // device copy on the communicator's stream. Data moves in the element's NCCL datatype (fp8 as
  // bytes: transfer_dtype), so counts are elements. Zero-element transfers are left out (on both
  // sides, since the counts of a pair agree).

  /// On `root`, `in` holds size() blocks of out.size() elements; block r goes to rank r. `out` may
  /// be the root's own block of `in`.
  template <class T, class Launch>
  auto scatter(std::span<const T> in, std::span<T> out, int root, Launch l) {
    constexpr const char* op = "scatter";
    if (rank_ == root) check_buffer(op, in.data(), in.size_bytes(), "input");
    check_buffer(op, out.data(), out.size_bytes(), "output");
    const ncclDataType_t dt = transfer_dtype(dtype_of<T>);
    const std::size_t count = out.size();
    const OpDesc d{OpKind::scatter, dtype_code<T>(), OpDesc::none, root, count};
    return issue(d, l, count == 0, [&](ncclComm_t c, cudaStream_t s) {
      if (rank_ == root) {
        const T* mine = in.data() + static_cast<std::size_t>(root) * count;
        if (mine != out.data())
          COMM_CUDA_CHECK(cudaMemcpyAsync(out.data(), mine, count * sizeof(T), cudaMemcpyDefault, s), op, rank_);
      }
      return in_group(op, c, [&] {
        if (rank_ == root) {
          for (int r = 0; r < size_; ++r)
            if (r != root)
              COMM_NCCL_CHECK(ncclSend(in.data() + static_cast<std::size_t>(r) * count, count, dt, r, c, s), op,
                              rank_, c);
        } else {
          COMM_NCCL_CHECK(ncclRecv(out.data(), count, dt, root, c, s), op, rank_, c);
        }
      });
    });
  }

  /// `in` and `out` hold size() equal blocks (the facade checked it, and that they do not
  /// overlap): block p of `in` goes to rank p, block q of `out` comes from rank q.
  template <class T, class Launch>
  auto all_to_all(std::span<const T> in, std::span<T> out, Launch l) {
    constexpr const char* op = "all_to_all";
    check_buffer(op, in.data(), in.size_bytes(), "input");
    check_buffer(op, out.data(), out.size_bytes(), "output");
    const ncclDataType_t dt = transfer_dtype(dtype_of<T>);
    const std::size_t block = in.size() / static_cast<std::size_t>(size_);
    const OpDesc d{OpKind::all_to_all, dtype_code<T>(), OpDesc::none, -1, in.size()};
    return issue(d, l, block == 0, [&](ncclComm_t c, cudaStream_t s) {
      const auto me = static_cast<std::size_t>(rank_);
      COMM_CUDA_CHECK(cudaMemcpyAsync(out.data() + me * block, in.data() + me * block, block * sizeof(T),
                                      cudaMemcpyDefault, s),
                      op, rank_);
      return in_group(op, c, [&] {
        for (int r = 0; r < size_; ++r) {
          if (r == rank_) continue;
          const std::size_t at = static_cast<std::size_t>(r) * block;
          COMM_NCCL_CHECK(ncclSend(in.data() + at, block, dt, r, c, s), op, rank_, c);
          COMM_NCCL_CHECK(ncclRecv(out.data() + at, block, dt, r, c, s), op, rank_, c);
        }
      });
    });
  }

  /// in_counts[p] elements to rank p, out_counts[q] from rank q, blocks at the prefix sums (the
  /// facade checked the sums, the sizes and in_counts[rank] == out_counts[rank]). A count that
  /// differs from the peer's is not detected by NCCL (see nccl.hpp).
  template <class T, class Launch>
  auto all_to_all_v(std::span<const T> in, std::span<const std::size_t> in_counts, std::span<T> out,
                    std::span<const std::size_t> out_counts, Launch l) {
    constexpr const char* op = "all_to_all_v";
    check_buffer(op, in.data(), in.size_bytes(), "input");
    check_buffer(op, out.data(), out.size_bytes(), "output");
    const ncclDataType_t dt = transfer_dtype(dtype_of<T>);
    // The count differs by rank: the fingerprint compares the operation and element type only.
    const OpDesc d{OpKind::all_to_all_v, dtype_code<T>(), OpDesc::none, -1, 0};
    return issue(d, l, in.empty() && out.empty(), [&](ncclComm_t c, cudaStream_t s) {
      std::size_t in_at = 0, out_at = 0;
      for (int r = 0; r < rank_; ++r) {
        in_at += in_counts[static_cast<std::size_t>(r)];
        out_at += out_counts[static_cast<std::size_t>(r)];
      }
      const std::size_t own = in_counts[static_cast<std::size_t>(rank_)];
      if (own != 0)
        COMM_CUDA_CHECK(cudaMemcpyAsync(out.data() + out_at, in.data() + in_at, own * sizeof(T), cudaMemcpyDefault, s),
                        op, rank_);
      return in_group(op, c, [&] {
        std::size_t si = 0, ro = 0;
        for (int r = 0; r < size_; ++r) {
          const auto ur = static_cast<std::size_t>(r);
          if (r != rank_) {
            if (in_counts[ur] != 0) COMM_NCCL_CHECK(ncclSend(in.data() + si, in_counts[ur], dt, r, c, s), op, rank_, c);
            if (out_counts[ur] != 0)
              COMM_NCCL_CHECK(ncclRecv(out.data() + ro, out_counts[ur], dt, r, c, s), op, rank_, c);
          }
          si += in_counts[ur];
          ro += out_counts[ur];
        }
      });
    });
  }

  /// ncclSend in a group call. NCCL has no message tags: `tag` must be 0.
  template <class T, class Launch>
  auto send(std::span<const T> data, int peer, int tag, Launch l) {
    constexpr const char* op = "send";
    check_tag(op, tag, "");
    check_buffer(op, data.data(), data.size_bytes(), "data");
    const ncclDataType_t dt = transfer_dtype(dtype_of<T>);
    const OpDesc d{OpKind::send, dtype_code<T>(), OpDesc::none, peer, data.size()};
    return issue(d, l, data.empty(), [&](ncclComm_t c, cudaStream_t s) {
      return in_group(op, c,
                      [&] { COMM_NCCL_CHECK(ncclSend(data.data(), data.size(), dt, peer, c, s), op, rank_, c); });
    });
  }

  /// ncclRecv in a group call. NCCL has no message tags: `tag` must be 0.
  template <class T, class Launch>
  auto recv(std::span<T> data, int peer, int tag, Launch l) {
    constexpr const char* op = "recv";
    check_tag(op, tag, "");
    check_buffer(op, data.data(), data.size_bytes(), "data");
    const ncclDataType_t dt = transfer_dtype(dtype_of<T>);
    const OpDesc d{OpKind::recv, dtype_code<T>(), OpDesc::none, peer, data.size()};
    return issue(d, l, data.empty(), [&](ncclComm_t c, cudaStream_t s) {
      return in_group(op, c,
                      [&] { COMM_NCCL_CHECK(ncclRecv(data.data(), data.size(), dt, peer, c, s), op, rank_, c); });
    });
  }

  /// Every entry's ncclSend / ncclRecv in one group call: one operation (one flight-recorder
  /// entry, one completion event), and one Work per entry, all on that completion (each behaves
  /// as an async operation's Work). Tags must be 0. No entries: no operation, no Work.
  template <class T>
  std::vector<Work> batch_isend_irecv(std::span<const P2POp<T>> ops) {
    constexpr const char* op = "batch_isend_irecv";
    std::vector<Work> works;
    if (ops.empty()) return works;
    bool empty = true;
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const auto& o = ops[i];
      const std::string entry = " (entry " + std::to_string(i) + ")";
      check_tag(op, o.tag, entry.c_str());
      check_buffer(op, o.buffer.data(), o.buffer.size_bytes(),
                   o.op == P2PKind::isend ? "a send buffer" : "a receive buffer");
      empty = empty && o.buffer.empty();
    }
    const ncclDataType_t dt = transfer_dtype(dtype_of<T>);
    const OpDesc d{OpKind::p2p_batch, dtype_code<T>(), OpDesc::none, ops.front().peer, ops.size()};
    auto enqueue = [&](ncclComm_t c, cudaStream_t s) {
      return in_group(op, c, [&] {
        for (const auto& o : ops) {
          if (o.buffer.empty()) continue;
          if (o.op == P2PKind::isend)
            COMM_NCCL_CHECK(ncclSend(o.buffer.data(), o.buffer.size(), dt, o.peer, c, s), op, rank_, c);
          else
            COMM_NCCL_CHECK(ncclRecv(o.buffer.data(), o.buffer.size(), dt, o.peer, c, s), op, rank_, c);
        }
      });
    };
    nvtx::ScopedRange range;  // COMM_NVTX=1 (detail/nvtx.hpp)
    const std::shared_ptr<NcclOp> state = issue_state(d, /*is_async=*/true, empty, enqueue, range);
    works.reserve(ops.size());
    for (std::size_t i = 0; i < ops.size(); ++i) works.emplace_back(std::shared_ptr<WorkState>(state));
    return works;
  }

  // ---- WatchTarget ----

  void on_watchdog_start() noexcept override { (void)cudaSetDevice(device_); }

  std::optional<Fault> async_error() noexcept override {
    std::unique_lock lock(nccl_mu_, std::try_to_lock);
    if (!lock.owns_lock() || comm_ == nullptr) return std::nullopt;  // busy issuing: it checks itself
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r == ncclSuccess && (state == ncclSuccess || state == ncclInProgress)) return std::nullopt;
    Fault f;
    f.engine = NativeEngine::nccl;
    const ncclResult_t bad = r != ncclSuccess ? r : state;
    f.code = static_cast<int>(bad);
    f.kind = bad == ncclRemoteError ? Fault::Kind::remote : Fault::Kind::backend;
    try {
      f.detail = (r != ncclSuccess ? "ncclCommGetAsyncError failed: " : "NCCL reported an asynchronous error: ") +
                 describe(bad, comm_) + "; the watchdog aborted the communicator";
    } catch (...) {
    }
    return f;
  }

  void abort() noexcept override {
    // An adopted communicator is its owner's to abort (checked before locking: a blocking adopted
    // communicator may hold the lock inside an NCCL call that waits for a dead peer).
    if (!settings_.may_abort) return;
    std::lock_guard lock(nccl_mu_);
    if (comm_ == nullptr) return;
    int prev = -1;
    const bool restore = cudaGetDevice(&prev) == cudaSuccess && prev != device_;
    if (restore) (void)cudaSetDevice(device_);
    (void)ncclCommAbort(comm_);
    comm_ = nullptr;
    if (restore) (void)cudaSetDevice(prev);
  }

  void op_started(std::uint64_t seq) noexcept override { recorder_.started(seq); }
  void op_completed(std::uint64_t seq) noexcept override { recorder_.completed(seq); }
  void op_failed(std::uint64_t seq, const std::exception_ptr& e) noexcept override { record_failure(seq, e); }
  void failure_handled(const std::exception_ptr&) noexcept override { dump_after_error(); }

 private:
  // ---- the common path of every operation ----

  template <class Launch, class Enqueue>
  auto issue(const OpDesc& d, Launch, bool empty, Enqueue&& enqueue, bool host_wait = false) {
    constexpr bool is_async = std::is_same_v<Launch, async_t>;
    // COMM_NVTX=1: "comm.<op> count=<n> type=<t> seq=<s>" around the host side, up to the return
    // (a blocking barrier's host wait included); off, one branch (detail/nvtx.hpp).
    nvtx::ScopedRange range;
    std::shared_ptr<NcclOp> state = issue_state(d, is_async, empty, enqueue, range);
    if constexpr (is_async) {
      return Work(std::move(state));
    } else {
      if (host_wait) wait_host(*state);
    }
  }

  /// Steps 1-3 of every operation (see the top of this file), and step 4 of the blocking form
  /// (`is_async` false: the caller's current stream waits for the operation): the issued
  /// operation's state, followed by the watchdog. Point-to-point operations (send, recv,
  /// batch_isend_irecv) take no collective sequence number and skip the desync check.
  template <class Enqueue>
  std::shared_ptr<NcclOp> issue_state(const OpDesc& d, bool is_async, bool empty, Enqueue& enqueue,
                                      nvtx::ScopedRange& range) {
    const char* op = op_name(d.kind);
    std::shared_ptr<NcclOp> state;
    std::lock_guard lock(nccl_mu_);
    throw_if_failed(op);
    if (comm_ == nullptr)  // adopted and failed, or aborted: failure() says why
      throw BackendError(op, rank_, "the NCCL communicator is no longer usable");
    DeviceGuard guard(device_, op, rank_);
    const std::uint64_t seq = seq_++;
    const bool p2p = is_p2p(d.kind);
    const std::uint64_t coll = p2p ? 0 : coll_seq_++;
    range.push(op, d.count, d.dtype, seq);
    recorder_.issued(seq, d);
    op_deadline_ = Clock::now() + settings_.timeout;
    const cudaStream_t caller = comm::nccl::current_stream();
    const bool same_stream = caller == stream_;
    try {
      if (settings_.desync_check && !p2p) check_desync(d, seq, coll);
      if (!same_stream) {
        COMM_CUDA_CHECK(cudaEventRecord(ready_, caller), op, rank_);
        COMM_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0), op, rank_);
      }
      state = std::make_shared<NcclOp>(op, rank_, settings_.timeout, seq, events_, stream_);
      // COMM_COMMS_LOG / COMM_TRACE: timing events around the NCCL call, read later (comms_timing.hpp).
      const cudaEvent_t log_start = comms_.on() ? comms_.begin(stream_) : nullptr;
      if (!empty) enqueue_checked(op, seq, enqueue);
      if (log_start != nullptr) comms_.end(log_start, stream_, d, p2p ? seq : coll);
      try {
        COMM_CUDA_CHECK(cudaEventRecord(state->event(), stream_), op, rank_);
        watchdog_.track(state, op_deadline_);
      } catch (...) {
        // Issued but no longer followed: nothing could tell when it ends, so the communicator
        // cannot be trusted any more.
        fail_comm(seq, std::current_exception());
        throw;
      }
    } catch (...) {
      op_error(seq, std::current_exception());
      throw;
    }
    if (!is_async && !same_stream) COMM_CUDA_CHECK(cudaStreamWaitEvent(caller, state->event(), 0), op, rank_);
    return state;
  }

  /// Runs the NCCL call(s); InvalidArgument leaves the communicator usable (NCCL did nothing),
  /// every other failure is the communicator's failure.
  template <class Enqueue>
  void enqueue_checked(const char* op, std::uint64_t seq, Enqueue& enqueue) {
    try {
      if (enqueue(comm_, stream_) == ncclInProgress) wait_enqueued(op);
    } catch (const InvalidArgument&) {
      throw;
    } catch (...) {
      fail_comm(seq, std::current_exception());
      throw;
    }
  }

  /// Operation `seq` failed on the issuing thread: the flight recorder says so (a desync, after
  /// which the communicator stays usable, is also dumped).
  void op_error(std::uint64_t seq, const std::exception_ptr& e) noexcept {
    record_failure(seq, e);
    try {
      std::rethrow_exception(e);
    } catch (const DesyncError&) {
      dump_after_error();
    } catch (...) {
    }
  }

  /// Operation `seq` failed and takes the communicator with it: recorded before the watchdog
  /// aborts and dumps.
  void fail_comm(std::uint64_t seq, std::exception_ptr e) {
    record_failure(seq, e);
    watchdog_.fail(std::move(e));
  }

  void record_failure(std::uint64_t seq, const std::exception_ptr& e) noexcept {
    try {
      recorder_.failed(seq, what_of(e).c_str());
    } catch (...) {  // no memory for the text: the state alone says it failed
      recorder_.failed(seq, nullptr);
    }
  }

  /// Writes the flight record where COMM_FLIGHT_RECORDER says, else to stderr at COMM_DEBUG>=WARN.
  void dump_after_error() noexcept {
    try {
      const auto text = to_string(flight_record());
      const std::string who = "nccl on rank " + std::to_string(rank_);
      if (!dump_path_.empty()) {
        const auto file = dump_file();
        write_text_file(file, text, rank_);
        log(LogLevel::warn, who + ": flight record written to " + file);
      } else if (log_level() >= LogLevel::warn) {
        log(LogLevel::warn, who + ": flight record after the error:\n" + text.substr(0, text.size() - 1));
      }
    } catch (...) {  // diagnostics must not replace the error being reported
    }
  }

  /// Host wait until every operation issued so far completed (bounded), then the failure if any.
  void wait_issued(const char* op) {
    const auto limit = settings_.timeout + std::chrono::seconds(2);
    if (!watchdog_.wait_idle(Clock::now() + limit))
      throw Timeout(op, rank_, "operations still running after " + std::to_string(limit.count()) + " ms");
    throw_if_failed(op);
  }

  /// The desync check (under nccl_mu_, on the device): an ncclAllGather of every rank's
  /// fingerprint of operation `seq` (the flight recorder's number; the fingerprint carries `coll`,
  /// the collective sequence number, which matches across ranks whatever point-to-point operations
  /// some of them ran), waited for on the host, then the comparison. A mismatch throws DesyncError
  /// on every rank and leaves the communicator usable (nothing of the operation was sent); a failed
  /// or late exchange is the communicator's failure. Never called for point-to-point operations.
  void check_desync(const OpDesc& d, std::uint64_t seq, std::uint64_t coll) {
    const char* op = op_name(d.kind);
    constexpr std::size_t fp = sizeof(Fingerprint);
    const std::size_t n = static_cast<std::size_t>(size_);
    try {
      Fingerprint* mine = fp_host_ + n;
      *mine = fingerprint(coll, d);
      std::byte* dev_mine = fp_dev_ + n * fp;
      COMM_CUDA_CHECK(cudaMemcpyAsync(dev_mine, mine, fp, cudaMemcpyHostToDevice, stream_), op, rank_);
      if (COMM_NCCL_CHECK(ncclAllGather(dev_mine, fp_dev_, fp, ncclUint8, comm_, stream_), op, rank_, comm_) ==
          ncclInProgress)
        wait_enqueued(op);
      COMM_CUDA_CHECK(cudaMemcpyAsync(fp_host_, fp_dev_, n * fp, cudaMemcpyDeviceToHost, stream_), op, rank_);
      COMM_CUDA_CHECK(cudaEventRecord(fp_done_, stream_), op, rank_);
      Backoff backoff(std::chrono::microseconds(2), std::chrono::milliseconds(1));
      for (;;) {
        const cudaError_t e = cudaEventQuery(fp_done_);
        if (e == cudaSuccess) break;
        if (e != cudaErrorNotReady) {
          (void)cudaGetLastError();
          throw_cuda(e, "cudaEventQuery", op, rank_, "the desync check's fingerprint exchange failed: ");
        }
        ncclResult_t state = ncclSuccess;
        COMM_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state), op, rank_, comm_);
        if (state != ncclSuccess && state != ncclInProgress)
          throw_nccl(state, "ncclCommGetAsyncError", op, rank_, comm_);
        throw_if_failed(op);
        if (Clock::now() >= op_deadline_)
          throw Timeout(op, rank_,
                        "the desync check's fingerprint exchange before op #" + std::to_string(seq) +
                            " did not complete within " + std::to_string(settings_.timeout.count()) +
                            " ms (a rank is late, hung, or runs without the check: it must be on for every rank "
                            "or none); the communicator was aborted");
        backoff.pause();
      }
    } catch (...) {
      fail_comm(seq, std::current_exception());
      throw;
    }
    check_fingerprints(std::span<const Fingerprint>(fp_host_, n), op, rank_);
  }

  /// The NCCL part of split (under nccl_mu_, device set). See split().
  ncclComm_t split_comm([[maybe_unused]] int color, [[maybe_unused]] int key,
                        [[maybe_unused]] const InitConfig& config, [[maybe_unused]] std::uint64_t seq) {
    constexpr const char* op = "split";
#if NCCL_VERSION_CODE >= 21800
    ncclConfig_t cfg = make_config(config);
    // A non-blocking split runs on NCCL's own thread, which writes the new communicator here when
    // it ends: on the heap, so that a split abandoned at its deadline cannot write into a dead frame.
    auto* slot = new ncclComm_t(nullptr);
    bool job_done = false;  // NCCL no longer writes *slot
    try {
      const ncclResult_t r = ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, slot, &cfg);
      if (r != ncclSuccess && r != ncclInProgress) {
        job_done = true;
        throw_nccl(r, "ncclCommSplit", op, rank_, comm_);
      }
      wait_ready(comm_, op, "ncclCommSplit", std::chrono::microseconds(200), std::chrono::milliseconds(20),
                 "ncclCommSplit did not complete",
                 " (a rank that did not call split, or failed); the communicator was aborted", &job_done);
      const ncclComm_t child = *slot;
      delete slot;
      slot = nullptr;
      if (color < 0) {
        if (child != nullptr) abort_comm(child, device_);  // not expected: NCCL makes none
        return nullptr;
      }
      if (child == nullptr)
        throw BackendError(op, rank_, "ncclCommSplit succeeded but returned no communicator for color " +
                                          std::to_string(color));
      try {
        wait_ready(child, op, "ncclCommSplit", std::chrono::microseconds(100), std::chrono::milliseconds(20),
                   "the communicator made by ncclCommSplit was not ready", "; the communicator was aborted");
      } catch (...) {
        abort_comm(child, device_);
        throw;
      }
      return child;
    } catch (...) {
      if (settings_.may_abort && comm_ != nullptr) {
        // Also stops NCCL's split thread and joins it (the parent's abort reaches the child).
        (void)ncclCommAbort(comm_);
        comm_ = nullptr;
        job_done = true;
      }
      if (slot != nullptr && job_done) {
        abort_comm(*slot, device_);
        delete slot;
      }  // else NCCL may still write *slot: left allocated on purpose
      fail_comm(seq, std::current_exception());
      throw;
    }
#else
    throw InvalidArgument(op, rank_,
                          "split needs ncclCommSplit (NCCL >= 2.18); comm was compiled against NCCL " +
                              version_string(compiled_version));
#endif
  }

  /// A non-blocking communicator answered ncclInProgress: poll until the call is enqueued.
  void wait_enqueued(const char* op) {
    wait_ready(comm_, op, "ncclCommGetAsyncError", std::chrono::microseconds(5), std::chrono::milliseconds(1),
               "NCCL did not finish enqueuing the operation",
               " (a peer that never issued it, or died); the communicator was aborted");
  }

  /// Polls ncclCommGetAsyncError(`comm`) until it leaves ncclInProgress (a non-blocking call that
  /// NCCL finishes on its own thread): returns at ncclSuccess; throws NCCL's error (as a failure of
  /// `call`), the communicator's failure, or past op_deadline_ comm::Timeout "<late> within <t> ms
  /// <why>". `settled`, when given, becomes true once NCCL reported anything but ncclInProgress.
  void wait_ready(ncclComm_t comm, const char* op, const char* call, std::chrono::microseconds first,
                  std::chrono::microseconds max, const char* late, const char* why, bool* settled = nullptr) {
    Backoff backoff(first, max);
    for (;;) {
      ncclResult_t state = ncclInProgress;
      COMM_NCCL_CHECK(ncclCommGetAsyncError(comm, &state), op, rank_, comm);
      if (state != ncclInProgress && settled != nullptr) *settled = true;
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) throw_nccl(state, call, op, rank_, comm);
      throw_if_failed(op);
      if (Clock::now() >= op_deadline_)
        throw Timeout(op, rank_,
                      std::string(late) + " within " + std::to_string(settings_.timeout.count()) + " ms" + why);
      backoff.pause();
    }
  }

  /// Host wait for a blocking barrier. The watchdog ends the operation by its deadline; wait a
  /// little longer so that its verdict (after the abort) is the one reported.
  void wait_host(NcclOp& s) {
    const auto limit = settings_.timeout + std::chrono::seconds(2);
    if (!s.wait_until(Clock::now() + limit))
      throw Timeout(s.op(), rank_, "did not complete within " + std::to_string(limit.count()) + " ms");
    if (auto e = s.error()) std::rethrow_exception(e);
  }

  void throw_if_failed(const char* op) const {
    if (!watchdog_.failed()) [[likely]]
      return;
    std::rethrow_exception(
        derived_error(watchdog_.failure(), op, rank_, "the communicator is unusable after an earlier failure"));
  }

  void check_buffer(const char* op, const void* p, std::size_t bytes, const char* what) const {
    if (settings_.check_pointers) check_device_buffer(p, bytes, device_, what, op, rank_);
  }

  /// The comm::ReduceOp of a reduction argument: a runtime value (checked here too, for callers
  /// that bypass the facade) or a compile-time op (checked when the call compiles).
  template <class T, class Red>
  ReduceOp checked_op(const char* op, const Red& red) const {
    ReduceOp r{};
    if constexpr (std::is_same_v<Red, ReduceOp>) {
      r = red;
      if (!reduction_supported(r, dtype_of<T>))
        throw InvalidArgument(op, rank_,
                              "reduction " + std::string(to_string(r)) + " is not supported for element type " +
                                  std::string(to_string(dtype_of<T>)) + " by the nccl backend: " +
                                  reduction_unsupported_reason(r, dtype_of<T>));
    } else if constexpr (builtin_reduction<Red>) {
      static_assert(reduction_supported(reduce_op_of<Red>, dtype_of<T>),
                    "comm: the nccl backend does not support this reduction on this element type");
      r = reduce_op_of<Red>;
    } else {
      static_assert(always_false<Red>, "comm: the nccl backend cannot run custom reduction callables");
    }
    check_reduction_runtime<T>(op);
    return r;
  }

  /// A reduction as the enqueue step needs it: a built-in NCCL op, or the scalar of a
  /// pre-multiplied sum (in the element type, as ncclRedOpCreatePreMulSum reads it) from which
  /// with_red_op makes an NCCL op around the call. `code`: the OpDesc reduction code (premul_sum is
  /// OpDesc::custom, as in the engine core: the factor may differ by rank, the kind may not).
  struct RedArg {
    ncclRedOp_t op = ncclSum;
    bool premul = false;
    alignas(8) unsigned char scalar[8] = {};
    std::uint8_t code = OpDesc::none;
  };

  /// The RedArg of a reduction argument: what checked_op accepts, or comm::op::premul_sum_t on a
  /// floating type whose sum NCCL runs (fp8: NCCL >= 2.24 and compute capability >= 9.0, as for
  /// its other reductions; NCCL itself computes fp8 avg as a PreMulSum).
  template <class T, class Red>
  RedArg reduction_arg(const char* op, const Red& red) const {
    RedArg a;
    if constexpr (std::is_same_v<Red, op::premul_sum_t>) {
      static_assert(floating_element<T>, "comm: premul_sum needs a floating element type");
      static_assert(reduction_supported(ReduceOp::sum, dtype_of<T>),
                    "comm: the nccl backend does not support this reduction on this element type");
      static_assert(sizeof(T) <= sizeof(a.scalar));
      check_reduction_runtime<T>(op);
      const T scalar = premul_scalar<T>(red.factor);
      std::memcpy(a.scalar, &scalar, sizeof(T));
      a.premul = true;
      a.code = OpDesc::custom;
    } else {
      const ReduceOp r = checked_op<T>(op, red);
      a.op = nccl_op(r);
      a.code = static_cast<std::uint8_t>(r);
    }
    return a;
  }

  /// The premul_sum factor in the element type: double as is, float rounded once, half, bfloat16
  /// and fp8 through float (round to nearest even, fp8 saturating: what CUDA's __float2half,
  /// __float2bfloat16 and __nv_cvt_float_to_fp8(..., __NV_SATFINITE, ...) give).
  template <class T>
  [[nodiscard]] static T premul_scalar(double factor) noexcept {
    if constexpr (std::is_same_v<T, double>)
      return factor;
    else if constexpr (std::is_same_v<T, float>)
      return static_cast<float>(factor);
    else
      return T(static_cast<float>(factor));
  }

  /// Runs `call(nccl op)`, which returns the NCCL call's result. A premul_sum's operator is made
  /// just before (ncclRedOpCreatePreMulSum, ncclScalarHostImmediate: the scalar is read at once) and
  /// destroyed once the call is enqueued (NCCL allows it as soon as the call has returned).
  template <class Call>
  ncclResult_t with_red_op(const char* op, RedArg& a, ncclDataType_t dt, ncclComm_t c, Call&& call) {
    if (!a.premul) return call(a.op);
    ncclRedOp_t pm{};
    if (COMM_NCCL_CHECK(ncclRedOpCreatePreMulSum(&pm, a.scalar, dt, ncclScalarHostImmediate, c), op, rank_, c) ==
        ncclInProgress)
      wait_enqueued(op);
    struct Destroy {
      ncclRedOp_t op;
      ncclComm_t comm;
      ~Destroy() { (void)ncclRedOpDestroy(op, comm); }
    } destroy{pm, c};
    if (call(pm) == ncclInProgress) wait_enqueued(op);
    return ncclSuccess;
  }

  /// ncclGroupStart, `body` (ncclSend / ncclRecv calls), ncclGroupEnd; the group is closed when
  /// `body` throws. Returns ncclGroupEnd's result (ncclInProgress on a non-blocking communicator
  /// that is still enqueuing).
  template <class Body>
  ncclResult_t in_group(const char* op, ncclComm_t c, Body&& body) {
    COMM_NCCL_CHECK(ncclGroupStart(), op, rank_, c);
    try {
      body();
    } catch (...) {
      (void)ncclGroupEnd();  // a group must always be closed
      throw;
    }
    return COMM_NCCL_CHECK(ncclGroupEnd(), op, rank_, c);
  }

  /// NCCL matches messages between two ranks in issue order and has no tags.
  void check_tag(const char* op, int tag, const char* where) const {
    if (tag != 0)
      throw InvalidArgument(op, rank_,
                            "tag " + std::to_string(tag) + std::string(where) +
                                ": NCCL has no message tags; use tag 0 (messages between two ranks are matched in "
                                "the order they are issued)");
  }

  /// fp8 reductions need NCCL >= 2.24 at run time and a device of compute capability >= 9.0.
  template <class T>
  void check_reduction_runtime([[maybe_unused]] const char* op) const {
    if constexpr (is_fp8(dtype_of<T>)) {
      if (runtime_version() < fp8_version)
        throw InvalidArgument(op, rank_,
                              "fp8 reductions need NCCL >= 2.24; the loaded NCCL is " +
                                  version_string(runtime_version()));
      if (cc_major_ < 9)
        throw InvalidArgument(op, rank_,
                              "fp8 reductions need a device of compute capability >= 9.0; device " +
                                  std::to_string(device_) + " is " + std::to_string(cc_major_) + "." +
                                  std::to_string(cc_minor_));
    }
  }

  /// gather on ncclSend/ncclRecv: the root copies its own block and receives every other rank's
  /// block into its slot, all in one group call.
  ncclResult_t gather_p2p(const void* in, void* out, std::size_t count, std::size_t elem, ncclDataType_t dt, int root,
                          ncclComm_t c, cudaStream_t s) {
    constexpr const char* op = "gather";
    const std::size_t block = count * elem;
    auto* base = static_cast<std::byte*>(out);
    if (rank_ == root) {
      std::byte* mine = base + static_cast<std::size_t>(root) * block;
      if (mine != in) COMM_CUDA_CHECK(cudaMemcpyAsync(mine, in, block, cudaMemcpyDefault, s), op, rank_);
    }
    COMM_NCCL_CHECK(ncclGroupStart(), op, rank_, c);
    try {
      if (rank_ == root) {
        for (int r = 0; r < size_; ++r)
          if (r != root)
            COMM_NCCL_CHECK(ncclRecv(base + static_cast<std::size_t>(r) * block, count, dt, r, c, s), op, rank_, c);
      } else {
        COMM_NCCL_CHECK(ncclSend(in, count, dt, root, c, s), op, rank_, c);
      }
    } catch (...) {
      (void)ncclGroupEnd();  // a group must always be closed
      throw;
    }
    return COMM_NCCL_CHECK(ncclGroupEnd(), op, rank_, c);
  }

  /// Frees what the engine owns. `healthy`: the communicator may be finalized (else aborted).
  void release(bool healthy) noexcept {
    int prev = -1;
    const bool restore = cudaGetDevice(&prev) == cudaSuccess && prev != device_;
    if (restore) (void)cudaSetDevice(device_);
    {
      std::lock_guard lock(nccl_mu_);
      if (comm_ != nullptr && owns_comm_) {
        if (healthy)
          finalize_and_destroy();
        else
          (void)ncclCommAbort(comm_);
      }
      comm_ = nullptr;
    }
    if (scratch_ != nullptr) (void)cudaFree(scratch_);
    if (ready_ != nullptr) (void)cudaEventDestroy(ready_);
    if (fp_dev_ != nullptr) (void)cudaFree(fp_dev_);
    if (fp_host_ != nullptr) (void)cudaFreeHost(fp_host_);
    if (fp_done_ != nullptr) (void)cudaEventDestroy(fp_done_);
    fp_dev_ = nullptr;
    fp_host_ = nullptr;
    fp_done_ = nullptr;
    if (owns_stream_ && stream_ != nullptr) (void)cudaStreamDestroy(stream_);
    scratch_ = nullptr;
    ready_ = nullptr;
    stream_ = nullptr;
    (void)cudaGetLastError();
    if (restore) (void)cudaSetDevice(prev);
  }

  /// ncclCommFinalize (flushes the communicator's work), polled until done or the timeout, then
  /// ncclCommDestroy; ncclCommAbort when finalizing fails or takes too long.
  void finalize_and_destroy() noexcept {
    ncclResult_t r = ncclCommFinalize(comm_);
    ncclResult_t state = r;
    if (r == ncclSuccess || r == ncclInProgress) {
      const auto deadline = Clock::now() + settings_.timeout;
      Backoff backoff(std::chrono::microseconds(50), std::chrono::milliseconds(10));
      for (;;) {
        if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) state = ncclInternalError;
        if (state != ncclInProgress || Clock::now() >= deadline) break;
        try {
          backoff.pause();
        } catch (...) {
        }
      }
    }
    if (state == ncclSuccess) {
      (void)ncclCommDestroy(comm_);
      return;
    }
    try {
      log(LogLevel::warn, "nccl on rank " + std::to_string(rank_) + ": finalizing the communicator " +
                              (state == ncclInProgress ? "timed out" : "failed") + "; aborting it");
    } catch (...) {
    }
    (void)ncclCommAbort(comm_);
  }

  mutable std::mutex nccl_mu_;  // one thread at a time on the communicator (NCCL's rule)
  ncclComm_t comm_;
  bool owns_comm_;
  int rank_;
  int size_;
  int device_;
  Settings settings_;
  cudaStream_t stream_ = nullptr;
  bool owns_stream_ = false;
  cudaEvent_t ready_ = nullptr;  // caller's stream -> communicator's stream; reused under nccl_mu_
  float* scratch_ = nullptr;     // the barrier's all_reduce buffer
  int cc_major_ = 0;
  int cc_minor_ = 0;
  std::uint64_t seq_ = 0;  // the next operation's number (0, 1, ...), under nccl_mu_
  // The next collective's number (point-to-point operations take none: they involve two ranks, so
  // their count differs by rank), the desync fingerprint's sequence number; under nccl_mu_.
  std::uint64_t coll_seq_ = 0;
  Clock::time_point op_deadline_{};
  Origin origin_;
  std::atomic<std::uint64_t> groups_{0};
  std::uint64_t monitored_barriers_ = 0;  // under nccl_mu_
  std::byte* fp_dev_ = nullptr;           // desync check: (size + 1) fingerprints on the device
  Fingerprint* fp_host_ = nullptr;        // and in pinned host memory
  cudaEvent_t fp_done_ = nullptr;
  FlightRecorder recorder_;
  CommsTimer comms_;       // COMM_COMMS_LOG, COMM_TRACE; under nccl_mu_
  std::string dump_path_;  // COMM_FLIGHT_RECORDER
  std::shared_ptr<EventPool> events_;
  Watchdog watchdog_;  // last: stopped explicitly in the destructor, before the rest goes
};

}  // namespace comm::detail::nccl
