#pragma once
/// \file
/// `comm::backends::Nccl`: the GPU backend, over NCCL and CUDA streams.
///
/// Use it through `comm::Communicator<comm::backends::Nccl>` (see communicator.hpp); link
/// `comm::nccl`. Buffers are device memory (cudaMalloc), managed memory or mapped pinned memory,
/// passed as `std::span<T>` like any other buffer; the element types are comm's (comm::half and
/// comm::bfloat16 are bit-compatible with `__half` / `__nv_bfloat16`).
///
/// ### The shared core, and the engine facts that differ from the host engines
/// Identity, key prefix on the store, subgroup counter, membership check, flight recorder and its
/// dumps, first-failure record and liveness watch are the same core as Gloo, Shm, Mpi and
/// Hierarchical use (detail/engine/comm_core.hpp). What remains different comes from NCCL and CUDA:
/// 1. Operations are enqueued on a stream and end on the device: the blocking form returns once
///    enqueued (see "Stream semantics"); "started" in the flight record means the operation reached
///    the head of the stream, not that a thread began it.
/// 2. A watchdog thread, not the calling thread, sees completion, NCCL's asynchronous errors and the
///    deadline. The first failure aborts the NCCL communicator (ncclCommAbort; an adopted one only
///    with `abort_adopted`; a root one is revoked and kept where NCCL can, see "Fault tolerance")
///    where a host engine closes its transport, then every pending Work fails.
///    The error keeps NCCL's or CUDA's native code (`nccl_result_of`, `cuda_error_of`).
/// 3. The liveness watch starts with the communicator (host engines: at the first operation). A
///    peer's death it reports is this communicator's failure (RemoteError naming the peer) and
///    aborts the NCCL communicator as above. NCCL's own failures are not announced on the liveness
///    channel nor re-attributed through it: NCCL reports a dead peer as ncclRemoteError, or the
///    deadline ends the operation.
/// 4. Sequence numbers are taken under the engine's lock when an operation is issued;
///    point-to-point operations take none of the collective numbers that the desync check compares.
/// 5. The desync check is an ncclAllGather of the fingerprints on the stream, waited for on the
///    host; point-to-point operations carry no header, so NCCL has no tags and does not detect
///    all_to_all_v counts that differ from the peer's.
/// 6. Reductions are NCCL's: no custom callables, no bitwise operations, avg on floating and
///    unsigned types only (see "Reductions and types").
/// 7. monitored_barrier first waits on the host for every operation issued so far.
/// 8. The comms log (COMM_COMMS_LOG) times operations with CUDA events, on the device.
///
/// ### Construction
/// - `Communicator<Nccl>::from_env()`: env:// rendezvous (RANK, WORLD_SIZE, MASTER_ADDR,
///   MASTER_PORT), then `create` on the store it yields.
/// - `Communicator<Nccl>::create(store, rank, size, options)`: rank 0 makes the ncclUniqueId and
///   shares it through the store (after the membership check: ranks started with different world
///   sizes fail with comm::InvalidArgument naming both, before a device is touched); every rank
///   then runs a non-blocking ncclCommInitRankConfig on its device, polled until `options.timeout`
///   (then the half-made communicator is aborted and comm::Timeout thrown). A rank that fails on the way tells the others through the store, so they
///   fail at once with comm::RemoteError naming it. The device is `options.device`, else
///   `LOCAL_RANK % device count`, else `rank % device count`. The communicator keeps the store
///   (and so, on rank 0 of env://, the TcpStore server) and its key prefix there
///   ("comm/nccl/<n>/", n counting this rank's NCCL communicators on that store) for new_group and
///   monitored_barrier.
/// - `Communicator<Nccl>::adopt(comm, stream [, options])`: wraps an existing, initialized
///   `ncclComm_t` without owning it (it is never destroyed, and never aborted unless
///   `options.abort_adopted`); operations run on `stream`. Do not issue on that communicator from
///   other code while the comm::Communicator is alive.
/// - No usable GPU: construction throws comm::BackendError "no usable CUDA device
///   (cudaGetDeviceCount: ...)"; `comm::nccl::device_count()` tells beforehand.
///
/// ### Stream semantics
/// Every operation runs on the communicator's stream (`options.stream`, else a non-blocking stream
/// the communicator creates; `backend().stream()`), ordered after the work already queued on the
/// caller's *current stream* — `comm::nccl::current_stream()`, a per-thread setting that
/// `comm::nccl::StreamGuard` changes; by default the default stream (nullptr).
/// - **Blocking form** (`c.all_reduce(buf)`): returns once the operation is enqueued. Work queued
///   afterwards on the communicator's stream or on the caller's current stream sees the result (the
///   current stream is made to wait for it; the host does not wait). Host code must synchronize
///   (a stream or `backend().synchronize()`) before it reads the result.
///   Exception: `barrier()` also waits on the host until every rank has entered it.
/// - **Async form** (`c.all_reduce(buf, comm::async)`): returns a comm::Work once enqueued; the
///   caller's current stream is *not* ordered after the operation, so independent work overlaps
///   with it. `Work::wait()` makes the waiting thread's current stream wait for the operation and
///   returns at once (torch.distributed's rule): the host does not block; an error already known
///   is rethrown, a later one fails the communicator's next call. An async barrier's
///   `Work::wait()` blocks the host until every rank entered it, as the blocking barrier does.
///   `Work::synchronize()` blocks the host until the operation completed on the device (or throws
///   its error; bounded by the timeout). `Work::is_completed()` tells without blocking.
/// - **Host-blocking wait for everything issued:** `c.backend().synchronize()`.
/// - Buffers must stay allocated until the operation has completed on the device.
/// ```cpp
/// auto c = comm::Communicator<comm::backends::Nccl>::from_env();
/// cudaSetDevice(c.backend().device());
/// float *d, *all;                                   // device memory
/// cudaMalloc(&d, n * sizeof(float));
/// cudaMalloc(&all, n * c.size() * sizeof(float));
/// cudaStream_t s; cudaStreamCreate(&s);
/// {
///   comm::nccl::StreamGuard g(s);                   // s is this thread's current stream
///   fill<<<grid, block, 0, s>>>(d, n);              // queued on s
///   c.all_reduce(std::span<float>(d, n));           // runs after fill; s waits for it
///   scale<<<grid, block, 0, s>>>(d, n);             // sees the sum
///   comm::Work w = c.all_gather(std::span<const float>(d, n), std::span<float>(all, n * c.size()), comm::async);
///   other<<<grid, block, 0, s>>>();                 // not ordered after the all_gather: overlaps
///   w.wait();                                       // s is ordered after the all_gather; host goes on
///   use<<<grid, block, 0, s>>>(all);
/// }
/// cudaStreamSynchronize(s);                         // the host reads results after this
/// ```
///
/// ### Reductions and types
/// sum, prod, min, max on every element type; avg on floating types (NCCL multiplies each input
/// by 1/size() before summing) and unsigned integers. Not available, as compile errors for
/// compile-time ops (comm::op::band, a lambda) and comm::InvalidArgument for ReduceOp values:
/// bitwise ops (NCCL has none), custom callables, and avg on signed integers (NCCL rounds toward
/// zero, comm's contract is floor division: use sum and divide). `comm::op::premul_sum(factor)`
/// (all_reduce, reduce_scatter, reduce; floating types) is NCCL's pre-multiplied sum: an operator
/// made with ncclRedOpCreatePreMulSum around each call, with the factor converted to the element
/// type on the host (float: rounded once; half, bfloat16, fp8: through float, as CUDA converts) and
/// applied on the device; it is destroyed once the call is enqueued. The factor may differ by rank.
/// The extra `backend().all_reduce_premul_sum(in, out, scalar)` takes the scalar in the element
/// type. fp8 (comm::float8_e4m3/e5m2, where comm defines them) is moved by every collective and
/// reduced (premul_sum included) where NCCL >= 2.24 and the device has compute capability >= 9.0.
///
/// ### More operations (reduce, scatter, all_to_all, all_to_all_v, send, recv, batch_isend_irecv)
/// Same stream rules, deadlines, watchdog, flight recorder and errors as the collectives above.
/// - `reduce`: ncclReduce; off the root NCCL gets a null receive buffer (`out` may be empty there,
///   and an in-place reduce leaves the non-root ranks' data as it was).
/// - `scatter`, `all_to_all`, `all_to_all_v`: ncclSend/ncclRecv in one group call (as
///   torch.distributed does; every NCCL), the rank's own block a device copy on the stream. Counts
///   are elements. all_to_all_v counts that do not match the peer's are not detected (NCCL's
///   send/recv must match; the watchdog's deadline ends a transfer that never completes).
/// - `send`, `recv`: ncclSend / ncclRecv in a group call. NCCL has no tags: a tag other than 0 is
///   comm::InvalidArgument. Messages between two ranks match in issue order. The blocking form
///   returns once enqueued, as every NCCL operation; a rank that sends to and receives from the
///   same peer uses batch_isend_irecv (or async forms issued in an order that matches the peer's).
/// - `batch_isend_irecv`: all entries in one ncclGroupStart/ncclGroupEnd, one operation (one
///   flight-recorder entry "batch_isend_irecv"); one Work per entry, all on that operation's
///   completion (Work::wait orders the caller's current stream after it, as for `comm::async`).
/// - Point-to-point operations (send, recv, batch_isend_irecv) involve two ranks, not the group:
///   they skip the desync check and do not advance the collective sequence number it compares.
///
/// ### gather
/// ncclGather where NCCL >= 2.28 (compiled and loaded), else ncclSend/ncclRecv in one group call
/// (the root receives each rank's block into its slot). `options.gather` or COMM_NCCL_GATHER
/// (`auto`, `native`, `p2p`) forces a path; every rank must use the same one.
///
/// ### Deadlines and errors
/// A watchdog thread per communicator completes Work as the device finishes, polls
/// ncclCommGetAsyncError, and fails any operation still running `options.timeout` after it was
/// issued (NCCL reports nothing when a peer on the same host dies; on a TcpStore, the liveness
/// watch reports a dead peer within COMM_LIVENESS_SILENCE and fails the communicator at once). On the first failure it
/// aborts the communicator (ncclCommAbort; a root one is revoked and kept where NCCL can, for a
/// later shrink) and fails every pending Work — comm::Timeout,
/// comm::RemoteError (ncclRemoteError) or comm::BackendError, naming the operation and the rank;
/// later operations fail at once with the first cause. NCCL and CUDA failures keep their native
/// code (`comm::nccl::nccl_result_of(e)`, `comm::nccl::cuda_error_of(e)`) and NCCL's text.
/// Destruction waits for issued operations (each bounded by its deadline), then finalizes and
/// destroys an owned communicator.
///
/// ### Fault tolerance (shrink, grow, revoke; detail/engine/elastic.hpp)
/// The members agree on who is alive through the store, as on the host backends. Then, where NCCL
/// >= 2.27 (compiled and loaded), at least one rank is left out and every member's old NCCL
/// communicator is intact, all call ncclCommShrink with the same exclude list (non-blocking,
/// polled to the timeout like split(); NCCL_SHRINK_ABORT while operations may still run on the old
/// communicator, else NCCL_SHRINK_DEFAULT); otherwise all make it afresh with `create()`. `grow()`
/// always makes it afresh. `backend().made_by()` says which. To keep the old communicator for
/// ncclCommShrink, shrink() holds its pending operations until NCCL stopped their kernels, and after
/// an earlier failure the watchdog revokes a root communicator (ncclCommRevoke, NCCL 2.28+;
/// `native_handle()` stays non-null) instead of aborting it. `revoke()` fails every member's
/// pending operations through the liveness watch. The rules, the known gap and what has run where:
/// docs/GPU.md, "Fault tolerance on NCCL"; the mechanism: detail/nccl/shrink.hpp.
///
/// ### Subgroups
/// - `split(color, key)`: ncclCommSplit, a collective over every rank of this communicator (an
///   operation "split" in its sequence); NCCL_SPLIT_NOCOLOR for a negative color (nullopt). Ranks
///   of one color are ranked by (key, rank here). Non-blocking and polled like construction: past
///   the timeout (or on a failure) this communicator is aborted and fails like after a failed
///   operation, the half-made new one is aborted, and comm::Timeout (or the failure) is thrown.
///   Works on adopted communicators too (an adopted *blocking* ncclComm_t blocks in ncclCommSplit
///   with no deadline of comm's).
/// - `new_group(ranks)`: members only; non-members get nullopt at once without communicating.
///   The first listed rank makes an ncclUniqueId and publishes it through a PrefixStore over this
///   communicator's store, under this communicator's key prefix and the group's number `g<k>`
///   (counted alike on every rank, members or not, and shared with split); the members then create
///   the communicator as `create` does (same deadline and failure publication). Needs the store:
///   an adopted communicator throws comm::InvalidArgument.
/// - The new communicator has this one's options and device, a stream of its own, its own
///   watchdog, flight recorder and operation sequence, and its own key prefix in the store (for its
///   own subgroups and monitored_barrier). Either may be destroyed first.
///
/// ### Diagnostics
/// - `monitored_barrier(timeout, wait_all_ranks)`: waits on the host until every operation issued
///   so far completed (bounded by this communicator's timeout), then runs the store barrier of
///   detail/diagnostics/monitored_barrier.hpp, naming the ranks that did not arrive. Needs the store.
/// - Flight recorder (`flight_record()`, `dump_flight_record(path)`, see <comm/diagnostics.hpp>):
///   queued when issued, started when the operation reaches the head of the communicator's stream
///   (the watchdog saw every earlier one complete), completed/failed as the watchdog sees it.
///   Dumped automatically (COMM_FLIGHT_RECORDER, else stderr at COMM_DEBUG >= WARN) once the
///   watchdog has handled the first failure (timeout, NCCL error), after a desync or a failed
///   monitored_barrier, and, with COMM_FLIGHT_RECORDER, when the communicator is destroyed.
/// - Desync check (`options.desync_check`, default on with COMM_DEBUG=DETAIL; the same on every
///   rank): before each operation (and split), an ncclAllGather of every rank's 32-byte fingerprint
///   of (sequence number, operation, element type, count, root, reduction) on the communicator's
///   stream, waited for on the host (so each operation also waits for the earlier ones: a debugging
///   mode), then comm::DesyncError on every rank when they differ; the communicator stays usable.
///
/// ### Threads
/// One watchdog thread per communicator. Operations from several threads on one communicator are
/// serialized (NCCL allows one thread at a time per communicator).

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <comm/concepts.hpp>
#include <comm/detail/engine/backend_diagnostics.hpp>
#include <comm/detail/engine/elastic.hpp>
#include <comm/detail/engine/forward.hpp>
#include <comm/detail/engine/policy.hpp>
#include <comm/detail/base/env.hpp>
#include <comm/detail/diagnostics/flight_recorder.hpp>
#include <comm/detail/engine/groups.hpp>
#include <comm/detail/base/logging.hpp>
#include <comm/detail/nccl/bootstrap.hpp>
#include <comm/detail/nccl/device.hpp>
#include <comm/detail/nccl/engine.hpp>
#include <comm/detail/nccl/errors.hpp>
#include <comm/detail/nccl/types.hpp>
#include <comm/diagnostics.hpp>
#include <comm/error.hpp>
#include <comm/options.hpp>
#include <comm/store.hpp>
#include <comm/types.hpp>
#include <comm/work.hpp>

namespace comm::nccl {

/// How gather is carried out (see nccl.hpp): automatic, native (ncclGather) or p2p.
using GatherAlgorithm = comm::detail::nccl::GatherAlgorithm;

/// The NCCL version comm was compiled against (NCCL_VERSION_CODE) and the one loaded at run time.
inline constexpr int compiled_version = comm::detail::nccl::compiled_version;
/// The NCCL version loaded at run time (ncclGetVersion), as a version code.
[[nodiscard]] inline int runtime_version() noexcept { return comm::detail::nccl::runtime_version(); }
/// "2.28.9" from a version code.
[[nodiscard]] inline std::string version_string(int code) { return comm::detail::nccl::version_string(code); }

}  // namespace comm::nccl

namespace comm::backends {

/// Options of comm::backends::Nccl (also spelled `comm::backends::Nccl::Options`). The common ones
/// are comm::CommonOptions': `timeout` bounds construction and every operation, counted from when
/// it is issued; the desync check is an ncclAllGather of 32 bytes per rank, waited for on the host.
struct NcclOptions : CommonOptions {
  /// CUDA device; -1: LOCAL_RANK % device count (else rank % device count).
  int device = -1;
  /// Stream the operations run on (not owned; it must belong to the device). Default: a
  /// non-blocking stream the communicator creates and destroys.
  std::optional<cudaStream_t> stream;
  /// gather path; `automatic` also honours COMM_NCCL_GATHER.
  comm::nccl::GatherAlgorithm gather = comm::nccl::GatherAlgorithm::automatic;
  /// Check that every buffer is memory the device can use, with a clear InvalidArgument when it is
  /// not (costs one cudaPointerGetAttributes per buffer and call). Turn off where the GPU reads
  /// pageable memory (HMM/ATS systems).
  bool check_pointers = true;
  /// Whether the watchdog may ncclCommAbort an adopted communicator after a failure (the handle is
  /// freed then: its owner must not use it again).
  bool abort_adopted = false;
  /// How often the watchdog polls ncclCommGetAsyncError.
  std::chrono::milliseconds watchdog_interval{50};
  /// ncclConfig_t fields; -1 / empty: NCCL's default.
  ///@{
  int cga_cluster_size = -1;
  int min_ctas = -1;
  int max_ctas = -1;
  std::string net_name;
  ///@}
  /// Called with the ncclConfig_t before ncclCommInitRankConfig (and ncclCommSplit), for fields
  /// not named here (`blocking` stays 0: construction depends on it).
  std::function<void(ncclConfig_t&)> configure;
};

/// The NCCL backend policy. Move-only; its moved-from state may only be destroyed or assigned.
class Nccl : public comm::detail::ForwardOps<Nccl>,
             public comm::detail::BackendDiagnostics<Nccl>,
             public comm::detail::Elastic<Nccl> {
 public:
  /// Opts in to the comm::backend concept (concepts.hpp).
  using backend_concept = comm::backend_t;
  /// The backend's name in the backend list (backends/list.hpp), in messages and in AnyCommunicator::backend(): "nccl".
  static constexpr std::string_view name = "nccl";

  /// The backend's options: NcclOptions.
  using Options = NcclOptions;

  /// An element type the NCCL this build was compiled against supports.
  static constexpr bool supports_dtype(Dtype d) noexcept { return comm::detail::nccl::dtype_supported(d); }
  /// A (reduction, element type) pair NCCL supports.
  static constexpr bool supports_reduction(ReduceOp op, Dtype d) noexcept {
    return comm::detail::nccl::reduction_supported(op, d);
  }
  /// NCCL takes no user callables as reductions.
  static constexpr bool custom_reductions = false;

  /// Connects `size` ranks through `store` (blocking; ends by `options.timeout`). Throws
  /// comm::BackendError when no CUDA device is usable.
  [[nodiscard]] static Nccl create(std::shared_ptr<Store> store, int rank, int size, const Options& options = {}) {
    comm::detail::check_create("nccl.init", store, rank, size, options);
    check_options(options, rank, "nccl.init");
    return connect(std::move(store), rank, size, options, nullptr);
  }

  /// Wraps an existing NCCL communicator without owning it; operations run on `stream`
  /// (`options.stream` is ignored).
  [[nodiscard]] static Nccl adopt(ncclComm_t comm, cudaStream_t stream, const Options& options = {}) {
    namespace dn = comm::detail::nccl;
    const std::string op = "nccl.adopt";
    if (comm == nullptr) throw InvalidArgument(op, -1, "the NCCL communicator is null");
    int rank = -1, size = 0, device = -1;
    // A non-blocking communicator still being created answers ncclInProgress.
    ncclResult_t state = ncclSuccess;
    COMM_NCCL_CHECK(ncclCommGetAsyncError(comm, &state), op, -1, comm);
    if (state == ncclInProgress)
      throw InvalidArgument(op, -1,
                            "the NCCL communicator is still being created (ncclInProgress); adopt it once "
                            "ncclCommGetAsyncError reports ncclSuccess");
    if (state != ncclSuccess) comm::detail::nccl::throw_nccl(state, "ncclCommGetAsyncError", op, -1, comm);
    COMM_NCCL_CHECK(ncclCommUserRank(comm, &rank), op, -1, comm);
    COMM_NCCL_CHECK(ncclCommCount(comm, &size), op, rank, comm);
    COMM_NCCL_CHECK(ncclCommCuDevice(comm, &device), op, rank, comm);
    comm::detail::check_timeout("nccl.adopt", rank, options);
    check_options(options, rank, op);
    const auto gather = dn::choose_gather(options.gather, COMM_NCCL_HAS_GATHER != 0, dn::runtime_version(), rank);
    dn::check_stream_device(stream, device, op, rank);
    Options kept = options;
    kept.stream.reset();  // not the adopted stream: subgroups make streams of their own
    return Nccl(std::make_unique<dn::Engine>(comm, false, rank, size, device, stream,
                                             settings(options, gather, options.abort_adopted),
                                             core_config(options, rank, "adopted"),
                                             comm::detail::adopted_place(rank, "adopted")),
                std::move(kept), "adopted");
  }

  /// Moves; the moved-from object may only be destroyed or assigned.
  Nccl(Nccl&&) noexcept = default;
  /// Moves; the moved-from object may only be destroyed or assigned.
  Nccl& operator=(Nccl&&) noexcept = default;
  ~Nccl() = default;

  // rank(), size(), timeout() and the operations (concepts.hpp, requirement 7 and capability 11;
  // see "More operations" above) come from ForwardOps (detail/engine/forward.hpp).

  /// The CUDA device of this rank.
  [[nodiscard]] int device() const noexcept { return engine_->device(); }
  /// The stream the operations run on.
  [[nodiscard]] cudaStream_t stream() const noexcept { return engine_->stream(); }
  /// The gather path in use (native or p2p).
  [[nodiscard]] comm::nccl::GatherAlgorithm gather_algorithm() const noexcept { return engine_->gather_algorithm(); }
  /// The NCCL communicator, for direct NCCL calls on `stream()` (null once aborted after a
  /// failure; a failed root communicator may instead stay revoked, see "Fault tolerance"). Do not
  /// call NCCL on it concurrently with this communicator's operations.
  [[nodiscard]] ncclComm_t native_handle() const { return engine_->comm(); }
  /// The communicator's first failure, or null.
  [[nodiscard]] std::exception_ptr failure() const { return engine_->failure(); }
  /// The NCCL call that made this communicator: "ncclCommInitRankConfig" (create, from_env,
  /// new_group, and shrink or grow where they make it afresh), "ncclCommSplit", "ncclCommShrink",
  /// or "adopted".
  [[nodiscard]] std::string_view made_by() const noexcept { return made_by_; }

  /// The live members' new communicator (see "Fault tolerance" above; the agreement and its
  /// errors are detail/engine/elastic.hpp's). This communicator stays failed: its pending
  /// operations end with their error before this returns.
  [[nodiscard]] Nccl shrink() {
    // The old communicator is held intact through the agreement, for ncclCommShrink; whatever
    // happens, the hold ends when this returns (the watchdog then aborts it).
    if (engine_) engine_->hold_next_retire();
    struct EndRetire {
      comm::detail::nccl::Engine* e;
      ~EndRetire() {
        if (e != nullptr) e->end_retire();
      }
    } end{engine_.get()};
    return comm::detail::Elastic<Nccl>::shrink();
  }

  /// Blocks the host until every operation issued so far completed on the device (bounded by the
  /// timeout); throws the communicator's failure if it has one.
  void synchronize() { engine_->synchronize(); }

  /// all_reduce with NCCL's pre-multiplied sum: `out` = sum over ranks of (scalar_r * in_r), each
  /// rank passing its own `scalar`. `in` and `out` have equal sizes (may be the same buffer).
  /// Blocking (enqueued, as the other operations) unless `comm::async` is passed last.
  template <element T>
  void all_reduce_premul_sum(std::span<const std::type_identity_t<T>> in, std::span<T> out,
                             std::type_identity_t<T> scalar) {
    engine_->premul_sum<T>(false, in, out, scalar, comm::blocking);
  }
  /// all_reduce_premul_sum with `comm::async`: returns a Work at once.
  template <element T>
  [[nodiscard]] Work all_reduce_premul_sum(std::span<const std::type_identity_t<T>> in, std::span<T> out,
                                           std::type_identity_t<T> scalar, async_t) {
    return engine_->premul_sum<T>(false, in, out, scalar, comm::async);
  }
  /// reduce_scatter with the pre-multiplied sum; `in` holds size()*out.size() elements.
  template <element T>
  void reduce_scatter_premul_sum(std::span<const std::type_identity_t<T>> in, std::span<T> out,
                                 std::type_identity_t<T> scalar) {
    engine_->premul_sum<T>(true, in, out, scalar, comm::blocking);
  }
  /// reduce_scatter_premul_sum with `comm::async`: returns a Work at once.
  template <element T>
  [[nodiscard]] Work reduce_scatter_premul_sum(std::span<const std::type_identity_t<T>> in, std::span<T> out,
                                               std::type_identity_t<T> scalar, async_t) {
    return engine_->premul_sum<T>(true, in, out, scalar, comm::async);
  }

  // ---- optional capabilities (see concepts.hpp): subgroups and diagnostics ----

  /// Collective over every rank of this communicator (ncclCommSplit; see "Subgroups" above): ranks
  /// with the same `color` >= 0 form a new communicator, ordered by (key, rank here); a negative
  /// color gives nullopt. The new communicator inherits these options and this device.
  [[nodiscard]] std::optional<Nccl> split(int color, int key) {
    namespace dn = comm::detail::nccl;
    const auto init = init_config(options_);
    const ncclComm_t child = engine_->split(color, key, init);
    const auto k = engine_->next_group_index();
    if (child == nullptr) return std::nullopt;
    const std::string group = comm::detail::group_name(k);
    int rank = -1, size = 0;
    Options o = child_options();
    const auto core = core_config(o, engine_->file_rank(), comm::detail::child_name(engine_->name(), group));
    comm::detail::CommPlace place = comm::detail::adopted_place(core.file_rank, core.name);
    try {
      COMM_NCCL_CHECK(ncclCommUserRank(child, &rank), "split", this->rank(), child);
      COMM_NCCL_CHECK(ncclCommCount(child, &size), "split", this->rank(), child);
      if (engine_->store())  // its own keys, and the membership check of its ranks
        place = comm::detail::join_store(
            std::make_shared<PrefixStore>(comm::detail::split_prefix(engine_->key_prefix(), group, color),
                                          engine_->store()),
            rank, size, core, "nccl");
    } catch (...) {
      dn::abort_comm(child, device());
      throw;
    }
    auto s = settings(o, gather_algorithm(), /*may_abort=*/true);
    return Nccl(std::make_unique<dn::Engine>(child, true, rank, size, device(), std::nullopt, std::move(s), core,
                                             std::move(place)),
                std::move(o), "ncclCommSplit");
  }

  /// A communicator of `ranks` (validated by the facade: in range, no duplicates), ranked in that
  /// order (see "Subgroups" above). Every rank calls it in the same order; non-members return
  /// nullopt at once, without communicating; members rendezvous through the store.
  [[nodiscard]] std::optional<Nccl> new_group(std::span<const int> ranks) {
    if (!engine_->store()) throw comm::detail::nccl::no_store_error("new_group", rank());
    const auto k = engine_->next_group_index();
    const auto place = comm::detail::group_place(ranks, rank());
    if (!place) return std::nullopt;
    const std::string group = comm::detail::group_name(k);
    auto store =
        std::make_shared<PrefixStore>(comm::detail::group_prefix(engine_->key_prefix(), group), engine_->store());
    const Parent parent{device(), gather_algorithm(), engine_->file_rank(),
                        comm::detail::child_name(engine_->name(), group)};
    return connect(std::move(store), place->rank, place->size, child_options(), &parent);
  }


 private:
  friend class comm::detail::ForwardOps<Nccl>;
  friend class comm::detail::BackendDiagnostics<Nccl>;  // monitored_barrier, flight_record, options
  friend class comm::detail::Elastic<Nccl>;             // shrink, grow: create(), options_

  Nccl(std::unique_ptr<comm::detail::nccl::Engine> e, Options o,
       const char* made_by = "ncclCommInitRankConfig") noexcept
      : engine_(std::move(e)), options_(std::move(o)), made_by_(made_by) {}

  /// Elastic<Nccl>::shrink's last step, once the members agreed on `members` (old ranks, in
  /// order; this rank is `rank` of `size` among them) with `store` for the new communicator's keys:
  /// ncclCommShrink of this communicator where every member can (NCCL >= 2.27 compiled and
  /// loaded, its communicator intact, at least one rank left out), else create() afresh. The
  /// members choose together through `store`, so they never take different paths. This
  /// communicator's pending operations have failed when it returns.
  [[nodiscard]] Nccl shrink_from_members(const std::vector<int>& members, std::shared_ptr<Store> store, int rank,
                                         int size, std::chrono::steady_clock::time_point retired_by) {
    namespace dn = comm::detail::nccl;
    auto& e = *engine_;
    const std::vector<int> exclude = dn::excluded_ranks(members, e.size());
    if (!e.agree_native(exclude, *store, rank, size, options_.timeout, retired_by))
      return create(std::move(store), rank, size, options_);
    // Its store place first (the membership check, its key prefix), as create() does.
    const auto core = core_config(options_, options_.record_file_rank, options_.record_name);
    comm::detail::CommPlace place = comm::detail::join_store(std::move(store), rank, size, core, "nccl");
    int flag = 0;
    const ncclComm_t child = e.shrink_to(exclude, init_config(options_), rank, size, options_.stream, flag);
    auto s = settings(options_, gather_algorithm(), /*may_abort=*/true);
    s.may_keep = true;
    auto engine = std::make_unique<dn::Engine>(child, true, rank, size, device(), options_.stream, std::move(s), core,
                                               std::move(place));
    comm::detail::log(comm::detail::LogLevel::info,
                      "nccl: shrink through ncclCommShrink (" +
                          std::string(flag == 0 ? "NCCL_SHRINK_DEFAULT" : "NCCL_SHRINK_ABORT") + "): rank " +
                          std::to_string(rank) + " of " + std::to_string(size) + ", without " +
                          comm::detail::elastic::named(exclude) + " of the old communicator");
    return Nccl(std::move(engine), options_, "ncclCommShrink");
  }

  /// What a new_group inherits from its parent communicator.
  struct Parent {
    int device;
    comm::nccl::GatherAlgorithm gather;
    int file_rank;
    std::string name;
  };

  /// Rendezvous through `store` and ncclCommInitRankConfig: a root communicator (`parent` null) or
  /// a new_group (`parent`: its device, gather path and name).
  [[nodiscard]] static Nccl connect(std::shared_ptr<Store> store, int rank, int size, const Options& options,
                                    const Parent* parent) {
    namespace dn = comm::detail::nccl;
    const std::string op = "nccl.init";
    const auto deadline = dn::Clock::now() + options.timeout;
    // Its number and key prefix on the store, and the membership check (ranks started with
    // different world sizes fail here, before any device is touched).
    const auto core = parent ? core_config(options, parent->file_rank, parent->name) : core_config(options, options.record_file_rank, options.record_name);
    comm::detail::CommPlace place = comm::detail::join_store(std::move(store), rank, size, core, "nccl");
    const dn::Rendezvous rv{place.store, place.key_prefix, place.number};
    int device = -1;
    ncclComm_t comm = nullptr;
    dn::GatherAlgorithm gather{};
    try {
      gather = parent ? parent->gather
                      : dn::choose_gather(options.gather, COMM_NCCL_HAS_GATHER != 0, dn::runtime_version(), rank);
      device = parent ? parent->device : dn::select_device(options.device, rank, op);
      if (options.stream) dn::check_stream_device(*options.stream, device, op, rank);
      const ncclUniqueId id = dn::exchange_unique_id(rv, rank, deadline, options.timeout);
      comm = dn::init_comm(id, rank, size, device, init_config(options), &rv, deadline, options.timeout);
    } catch (const std::exception& e) {
      dn::publish_failure(rv, rank, e.what());
      throw;
    }
    const std::string what = place.name.empty() ? std::string() : " (" + place.name + ")";
    auto s = settings(options, gather, /*may_abort=*/true);
    s.may_keep = parent == nullptr;  // a root: kept (revoked) after a failure, for ncclCommShrink
    auto engine = std::make_unique<dn::Engine>(comm, true, rank, size, device, options.stream, std::move(s), core,
                                               std::move(place));
    comm::detail::log(comm::detail::LogLevel::info,
                      "nccl: rank " + std::to_string(rank) + " of " + std::to_string(size) + what + " on device " +
                          std::to_string(device) + ", NCCL " + dn::version_string(dn::runtime_version()) +
                          ", gather " + std::string(dn::to_string(gather)));
    return Nccl(std::move(engine), options);
  }

  /// The options of a subgroup: these, on this device, with a stream of its own.
  [[nodiscard]] Options child_options() const {
    Options o = options_;
    o.device = device();
    o.stream.reset();
    return o;
  }

  static void check_options(const Options& o, int rank, const std::string& op) {
    if (o.watchdog_interval.count() <= 0)
      throw InvalidArgument(op, rank,
                            "watchdog_interval " + std::to_string(o.watchdog_interval.count()) +
                                " ms must be positive");
    if (o.device < -1) throw InvalidArgument(op, rank, "device " + std::to_string(o.device) + " is not -1 or a device");
  }

  static comm::detail::nccl::InitConfig init_config(const Options& o) {
    return {o.cga_cluster_size, o.min_ctas, o.max_ctas, o.net_name, o.configure};
  }

  static comm::detail::nccl::Settings settings(const Options& o, comm::nccl::GatherAlgorithm g, bool may_abort) {
    comm::detail::nccl::Settings s;
    s.gather = g;
    s.check_pointers = o.check_pointers;
    s.may_abort = may_abort;
    s.timing.async_poll = o.watchdog_interval;
    return s;
  }

  /// The core's part of the options; `file_rank` -1: a root communicator (see CoreConfig).
  static comm::detail::CoreConfig core_config(const Options& o, int file_rank, std::string name) {
    auto c = comm::detail::core_config(o);
    c.file_rank = file_rank;
    c.name = std::move(name);
    return c;
  }

  std::unique_ptr<comm::detail::nccl::Engine> engine_;
  Options options_;
  const char* made_by_ = "ncclCommInitRankConfig";  // see made_by()
};

static_assert(comm::backend<Nccl>);
static_assert(comm::supports_full_surface<Nccl>, "comm: the nccl backend must have the whole surface");

}  // namespace comm::backends
