#pragma once
// The engine core: everything about running a communicator's operations that does not depend on
// the engine that moves the bytes. Gloo, Shm and the next host backends derive from it (CRTP, no
// virtual call on the hot path) and supply the engine calls only:
//
//   void perform(Op& op, std::uint64_t seq);                 // this rank's part of a collective;
//                                                            //   kinds it lacks: this->compose(op, seq)
//   void perform_p2p(const Op& op, std::span<P2PItem> items); // sends and receives, progressing
//                                                            //   together, headers checked (p2p.hpp)
//   void exchange_fingerprints(std::uint64_t seq);           // fill fingerprints() from every rank
//   [[noreturn]] void rethrow_translated(const char* op);    // optional: in a catch block -> comm::Error
//   void close_transport() noexcept;                         // wake pending waits, fail peers fast
//   bool exchange_before(const Op& op) const;                 // optional: exchange fingerprints before
//                                                            //   `op` even without the desync check
//
// EngineCore builds on CommCore (comm_core.hpp: identity, membership check, flight recorder and
// dumps, first-failure record, liveness watch, shared with the NCCL engine) and adds the host
// execution machinery:
//   - the typed entry points (all_reduce<T>...): they fill one Op record (op.hpp), so everything
//     behind them is compiled once, whatever the element types and reductions a program uses;
//   - issue order, sequence numbers and async Work (op_queue.hpp), Work::wait's abort on timeout;
//   - the flight recorder's transitions (queued/started/completed/failed) and the dump after an error;
//   - the desync check (a 32-byte fingerprint per rank compared before each operation);
//   - monitored_barrier through the store;
//   - failure handling: the engine's transport is closed at the first failure so that peers fail
//     at once instead of waiting for their timeout; a peer the liveness watch saw die is named as
//     the cause.

#include <algorithm>
#include <array>
#include <cstring>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <comm/concepts.hpp>
#include <comm/detail/base/copy.hpp>
#include <comm/detail/diagnostics/comms_log.hpp>
#include <comm/detail/cuda/driver.hpp>
#include <comm/detail/diagnostics/desync.hpp>
#include <comm/detail/engine/comm_core.hpp>
#include <comm/detail/engine/failure.hpp>
#include <comm/detail/engine/op.hpp>
#include <comm/detail/engine/op_queue.hpp>
#include <comm/detail/engine/p2p.hpp>
#include <comm/detail/engine/work_state.hpp>
#include <comm/detail/diagnostics/flight_recorder.hpp>
#include <comm/detail/engine/liveness.hpp>
#include <comm/detail/base/logging.hpp>
#include <comm/detail/engine/membership.hpp>
#include <comm/detail/diagnostics/monitored_barrier.hpp>
#include <comm/detail/engine/reduce.hpp>
#include <comm/diagnostics.hpp>
#include <comm/error.hpp>
#include <comm/store.hpp>
#include <comm/types.hpp>
#include <comm/work.hpp>

namespace comm::detail {

/// The traffic of an engine-core operation record.
[[nodiscard]] inline Traffic traffic_of(const Op& op, int n) noexcept {
  if (op.desc.kind == OpKind::all_to_all_v) {
    std::uint64_t sent = 0, received = 0;
    const std::size_t half = op.counts.size() / 2;
    for (std::size_t i = 0; i < op.counts.size(); ++i) (i < half ? sent : received) += op.counts[i];
    return traffic(OpKind::all_to_all_v, std::max(sent, received), op.elem_size, n);
  }
  if (op.desc.kind == OpKind::p2p_batch) {
    std::uint64_t sent = 0, received = 0;
    for (const P2PItem& it : op.p2p) (it.send ? sent : received) += it.count;
    return traffic(OpKind::p2p_batch, std::max(sent, received), op.elem_size, n);
  }
  return traffic(op.desc.kind, op.desc.count, op.elem_size, n);
}

template <class Derived>
class EngineCore : public CommCore {
 public:
  /// A communicator of `size` ranks over `store` (see join_store: its number and the membership
  /// check). `backend` names it in keys, errors and dumps.
  EngineCore(std::shared_ptr<comm::Store> store, int rank, int size, const CoreConfig& cfg, const char* backend)
      : CommCore(join_store(std::move(store), rank, size, cfg, backend), rank, size, cfg, backend, kRecorderWriters),
        fingerprints_(static_cast<std::size_t>(size)) {
    log_.attach(backend, file_rank(), rank, size, name());  // COMM_COMMS_LOG / COMM_TRACE (comms_log.hpp)
  }

  /// A communicator over an engine group made elsewhere (no store: no subgroups, no
  /// monitored_barrier).
  EngineCore(int rank, int size, const CoreConfig& cfg, const char* backend, std::string name)
      : CommCore(adopted_place(rank, std::move(name)), rank, size, cfg, backend, kRecorderWriters),
        fingerprints_(static_cast<std::size_t>(size)) {
    log_.attach(backend, file_rank(), rank, size, this->name());
  }

  EngineCore(const EngineCore&) = delete;
  EngineCore& operator=(const EngineCore&) = delete;
  ~EngineCore() { shutdown(); }

  // ---- launch: blocking runs inline (after queued work), async queues and returns Work ----

  void launch(Op& op, blocking_t) {
    check_host_buffers(op);
    start_liveness_once();
    queue_.run_inline(op);
  }

  Work launch(Op& op, async_t) {
    check_host_buffers(op);
    start_liveness_once();
    auto state = std::make_shared<EngineWorkState>(op_name(op.desc.kind), rank(), timeout(), abort_);
    queue_.submit(std::move(op), state);
    return Work(std::move(state));
  }

  // ---- collectives (arguments were validated by the facade) ----
  // `hooks` (optional): steps run around the collective on the executing thread (see op.hpp).

  template <class T, class Red, class Launch>
  auto all_reduce(std::span<const T> in, std::span<T> out, Red red, Launch l, OpHooks hooks = {}) {
    return typed_reduction(OpKind::all_reduce, in, out, -1, red, l, std::move(hooks));
  }

  template <class T, class Red, class Launch>
  auto reduce_scatter(std::span<const T> in, std::span<T> out, Red red, Launch l, OpHooks hooks = {}) {
    return typed_reduction(OpKind::reduce_scatter, in, out, -1, red, l, std::move(hooks));
  }

  template <class T, class Launch>
  auto all_gather(std::span<const T> in, std::span<T> out, Launch l, OpHooks hooks = {}) {
    Op op = make_op<T>(OpKind::all_gather, in.data(), out.data(), in.size(), out.size());
    set_hooks(op, std::move(hooks));
    return launch(op, l);
  }

  template <class T, class Launch>
  auto broadcast(std::span<T> data, int root, Launch l, OpHooks hooks = {}) {
    Op op = make_op<T>(OpKind::broadcast, nullptr, data.data(), 0, data.size(), root);
    set_hooks(op, std::move(hooks));
    return launch(op, l);
  }

  template <class T, class Launch>
  auto gather(std::span<const T> in, std::span<T> out, int root, Launch l, OpHooks hooks = {}) {
    // The input count: the output is only meaningful (and sized) on the root.
    Op op = make_op<T>(OpKind::gather, in.data(), out.data(), in.size(), out.size(), root);
    set_hooks(op, std::move(hooks));
    return launch(op, l);
  }

  template <class T, class Red, class Launch>
  auto reduce(std::span<const T> in, std::span<T> out, int root, Red red, Launch l) {
    // Off the root `out` may be empty: the engine (or compose) gives it scratch.
    return typed_reduction(OpKind::reduce, in, out, root, red, l, {});
  }

  template <class T, class Launch>
  auto scatter(std::span<const T> in, std::span<T> out, int root, Launch l) {
    Op op = make_op<T>(OpKind::scatter, in.data(), out.data(), in.size(), out.size(), root);
    return launch(op, l);
  }

  template <class T, class Launch>
  auto all_to_all(std::span<const T> in, std::span<T> out, Launch l) {
    Op op = make_op<T>(OpKind::all_to_all, in.data(), out.data(), in.size(), out.size());
    return launch(op, l);
  }

  /// The counts are copied: an async call's caller need not keep them.
  template <class T, class Launch>
  auto all_to_all_v(std::span<const T> in, std::span<const std::size_t> in_counts, std::span<T> out,
                    std::span<const std::size_t> out_counts, Launch l) {
    Op op = make_op<T>(OpKind::all_to_all_v, in.data(), out.data(), in.size(), out.size());
    op.counts.reserve(in_counts.size() + out_counts.size());
    op.counts.insert(op.counts.end(), in_counts.begin(), in_counts.end());
    op.counts.insert(op.counts.end(), out_counts.begin(), out_counts.end());
    return launch(op, l);
  }

  template <class T, class Launch>
  auto send(std::span<const T> data, int peer, int tag, Launch l) {
    Op op = make_op<T>(OpKind::send, data.data(), nullptr, data.size(), 0, peer);
    op.p2p.push_back(P2PItem{true, const_cast<T*>(data.data()), data.size(), peer, tag});
    return launch(op, l);
  }

  template <class T, class Launch>
  auto recv(std::span<T> data, int peer, int tag, Launch l) {
    Op op = make_op<T>(OpKind::recv, nullptr, data.data(), 0, data.size(), peer);
    op.p2p.push_back(P2PItem{false, data.data(), data.size(), peer, tag});
    return launch(op, l);
  }

  /// One operation whose sends and receives progress together (so that a batch that sends to and
  /// receives from the same peers cannot deadlock); every returned Work completes with it.
  template <class T>
  std::vector<Work> batch_isend_irecv(std::span<const P2POp<T>> ops) {
    std::vector<Work> works;
    if (ops.empty()) return works;
    Op op = make_op<T>(OpKind::p2p_batch, nullptr, nullptr, 0, 0);
    op.p2p.reserve(ops.size());
    for (const auto& o : ops)
      op.p2p.push_back(P2PItem{o.op == P2PKind::isend, o.buffer.data(), o.buffer.size(), o.peer, o.tag});
    op.desc.root = ops.front().peer;
    op.desc.count = ops.size();
    check_host_buffers(op);
    start_liveness_once();
    auto state = std::make_shared<EngineWorkState>(op_name(op.desc.kind), rank(), timeout(), abort_);
    queue_.submit(std::move(op), state);
    works.reserve(ops.size());
    for (std::size_t i = 0; i < ops.size(); ++i) works.emplace_back(state);
    return works;
  }

  template <class Launch>
  auto barrier(Launch l, OpHooks hooks = {}) {
    Op op;
    op.desc = OpDesc{OpKind::barrier, OpDesc::none, OpDesc::none, -1, 0};
    set_hooks(op, std::move(hooks));
    return launch(op, l);
  }

  /// split's collective step: every rank's (color, key), as 2*size() values in rank order (an
  /// all_gather of kind `split`, which the engine runs as an all_gather).
  [[nodiscard]] std::vector<std::int64_t> exchange_color_key(int color, int key) {
    const std::array<std::int64_t, 2> mine{color, key};
    std::vector<std::int64_t> all(2 * static_cast<std::size_t>(size()));
    Op op = make_op<std::int64_t>(OpKind::split, mine.data(), all.data(), mine.size(), all.size());
    op.desc.count = 2;
    launch(op, blocking);
    return all;
  }

  /// See detail/diagnostics/monitored_barrier.hpp. Ordered after the queued operations, like barrier().
  void monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks) {
    if (!store())
      throw InvalidArgument("monitored_barrier", rank(),
                            "this communicator was adopted and has no store; monitored_barrier needs one (create the "
                            "communicator with create() or from_env())");
    Op op;
    op.desc = OpDesc{OpKind::monitored_barrier, OpDesc::none, OpDesc::none, -1, 0};
    op.barrier_timeout = timeout;
    op.wait_all_ranks = wait_all_ranks;
    launch(op, blocking);
  }

  /// Makes every queued and running operation fail with Timeout(`why`) and the communicator
  /// unusable: the engine's pending waits wake at once, its transport closes (peers fail with
  /// RemoteError). Returns once no operation runs, or after `grace`.
  void abort(const std::string& why, std::chrono::milliseconds grace) {
    if (record_failure(FailureKind::timeout, why, {})) derived().close_transport();
    (void)queue_.wait_idle_until(std::chrono::steady_clock::now() + grace);
  }

  /// Ends this communicator for a reconfiguration (shrink): its failure is recorded unless it
  /// failed already and the transport closes, which wakes the pending waits.
  void retire(const std::string& why) {
    if (record_failure(FailureKind::remote, why, {})) derived().close_transport();
  }
  /// Waits until queued and running operations have ended (with their error, after retire), at
  /// most `grace`; false if one still runs (a wait the transport's close does not reach, e.g. a
  /// send libgloo began writing: it ends by its own deadline).
  bool wait_retired(std::chrono::milliseconds grace) {
    return queue_.wait_idle_until(std::chrono::steady_clock::now() + grace);
  }

  /// revoke(): every member's pending and future operations end with RemoteError naming this
  /// rank. Published first on the liveness key (every member's watch wakes on it within ms), then
  /// failed here. Without a store (adopted) only this rank's operations end.
  void revoke(const std::string& reason) {
    const std::string why = publish_revoke(reason);
    if (record_failure(FailureKind::remote, why, "rank " + std::to_string(rank()))) derived().close_transport();
  }

  // ---- liveness (detail/engine/liveness.hpp) ----

  /// The liveness watch's news (`why`: "rank 2 is dead: ...", "rank 1's operation failed: ..."):
  /// fails the communicator with RemoteError naming `peer` and the operation running here, and
  /// closes the transport so that the running operation ends now. Any thread.
  /// `echo` (Liveness::Verdict, held by the watch for Liveness::kEchoGrace): a peer's closed
  /// connection that blames this rank. While this rank's engine is recording a failure of its own
  /// it waits for that to be recorded (consult_liveness: after a Timeout here the echo is not the
  /// cause), then counts only if nothing was: a catch that threw before recording leaves the
  /// communicator failed by the echo, not without a watch.
  void peer_failed(int peer, const std::string& why, bool echo = false) {
    if (echo) {
      // Bounded: a teardown of connections, a store probe and at most two announcements (200 ms
      // each); the 5 s is a guard, not a deadline anything waits for.
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (failing() && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (note_peer_failure(peer, why)) derived().close_transport();
  }

  /// The engine's error `e` (a peer closed, or a wait timed out) may be the echo of a death the
  /// liveness watch knows of: ask it now, and let that death be the recorded cause. Not for a
  /// Timeout and a peer's closed connection that blames this rank: that close was this timeout's.
  void consult_liveness(const Error& e) {
    if (liveness() == nullptr || has_failed()) return;
    const bool timed_out = dynamic_cast<const Timeout*>(&e) != nullptr;
    if (dynamic_cast<const RemoteError*>(&e) == nullptr && !timed_out) return;
    const auto v = liveness()->verdict_now(std::chrono::milliseconds(500));
    if (v && v->source != rank() && v->explains(timed_out) && note_peer_failure(v->rank, v->why))
      derived().close_transport();
  }

 protected:
  /// Derived destructors call this first, so that no operation runs on a half-destroyed engine.
  void shutdown() noexcept {
    if (shut_down_) return;
    stop_liveness();  // first: it may call peer_failed()
    shut_down_ = true;
    queue_.shutdown();
    abort_->detach();
    log_.finish();  // the comms log's summary
    dump_at_end();
  }

  /// The fingerprints of the operation being checked, one per rank; exchange_fingerprints() fills
  /// every rank's slot from the peers (this rank's is already set).
  [[nodiscard]] std::vector<Fingerprint>& fingerprints() noexcept { return fingerprints_; }
  [[nodiscard]] const Fingerprint& own_fingerprint() const noexcept {
    return fingerprints_[static_cast<std::size_t>(rank())];
  }

  /// Runs one engine step, turning its exceptions into comm errors (Derived::rethrow_translated).
  /// After a failure the communicator is unusable, so every later step fails at once with the
  /// first cause.
  template <class F>
  void run(const char* op, F&& f) {
    throw_if_failed(op);
    try {
      std::forward<F>(f)();
    } catch (...) {
      const auto scope = failing_scope();  // the liveness watch waits for this block before it takes an echo
      try {
        derived().rethrow_translated(op);
      } catch (const Error& e) {
        consult_liveness(e);  // a peer the store saw die is the cause, not the rank that told us
        if (record_failure(kind_of(e), e.what(), e.peer())) {
          // Close the transport now, so that peers blocked on this rank fail at once with
          // RemoteError instead of waiting for their own timeout; and tell them through the
          // liveness channel, for a wait a closed connection does not wake (liveness.hpp). A
          // desync the others cannot see for themselves goes out before the close: a peer woken
          // by the close then finds it as the cause (consult_liveness) instead of announcing the
          // closed connection as its own failure first.
          const bool unshared = dynamic_cast<const UnsharedDesync*>(&e) != nullptr;
          if (liveness() != nullptr && unshared) liveness()->announce_failure(rank_named(e.peer()), e.what(), true);
          derived().close_transport();
          if (liveness() != nullptr && kind_of(e) == FailureKind::remote)
            liveness()->announce_failure(rank_named(e.peer()), e.what());
          throw;
        }
        // A mismatch this rank diagnosed itself (DesyncError) is no echo: it stands, even when a
        // peer's announced failure (which the mismatch caused) reached the liveness watch first.
        if (dynamic_cast<const InvalidArgument*>(&e) != nullptr) throw;
        // Woken by an abort (Work::wait gave up) or an earlier failure: report that cause, not the
        // engine's echo of it.
        throw_failure(op);
      }
    }
  }

  /// The collectives an engine does not run itself, from the ones it does: reduce as an
  /// all_reduce (into scratch off the root), scatter and all_to_all(_v) as point-to-point batches
  /// (perform_p2p), whose headers carry the collective's kind. Engines call it for kinds they lack.
  void compose(Op& op, std::uint64_t seq) {
    switch (op.desc.kind) {
      case OpKind::reduce: {
        Op sub;
        sub.desc = op.desc;
        sub.desc.kind = OpKind::all_reduce;  // root stays set: a plain all_reduce's fingerprint differs
        sub.in = op.in;
        sub.in_count = op.in_count;
        sub.out_count = op.in_count;
        sub.elem_size = op.elem_size;
        sub.kernel = op.kernel;
        sub.many = op.many;
        sub.custom = op.custom;
        sub.custom_arg = op.custom_arg;
        sub.finish = op.finish;
        if (rank() == op.desc.root) {
          sub.out = op.out;
        } else {
          compose_scratch_.resize(op.in_count * op.elem_size);
          sub.out = compose_scratch_.data();
        }
        derived().perform(sub, seq);
        release_scratch(compose_scratch_);
        return;
      }
      case OpKind::scatter: {
        compose_scatter(op, rank(), size(), compose_items_);
        if (rank() == op.desc.root) {
          const auto* mine = static_cast<const std::byte*>(op.in) +
                             static_cast<std::size_t>(rank()) * op.out_count * op.elem_size;
          if (mine != op.out) copy_bytes(op.out, mine, op.out_count * op.elem_size);
        }
        derived().perform_p2p(op, std::span<P2PItem>(compose_items_));
        return;
      }
      case OpKind::all_to_all:
      case OpKind::all_to_all_v: {
        compose_all_to_all(op, rank(), size(), compose_items_);
        all_to_all_self_copy(op, rank(), size());
        derived().perform_p2p(op, std::span<P2PItem>(compose_items_));
        return;
      }
      default:
        throw BackendError(op_name(op.desc.kind), rank(), std::string("not an operation the ") + backend_name() +
                                                             " engine runs");
    }
  }

  /// The default translation of an engine's exception (call inside a catch block): comm::Error
  /// and std::bad_alloc pass, any other exception becomes BackendError with its text. Engines
  /// whose library throws its own types define their own (Gloo).
  [[noreturn]] void rethrow_translated(const char* op) { rethrow_as_error(op, rank(), "unknown exception"); }

  /// Engines that read and write buffers with the CPU set this: a CUDA device buffer is then a
  /// comm::InvalidArgument before anything is sent, not a crash (one branch per operation where no
  /// CUDA driver is usable).
  void host_buffers_only(const char* hint) noexcept { host_only_hint_ = hint; }
  /// The same for the operations a policy does not stage itself (Gloo stages the five
  /// collectives: their buffers reach the engine as host copies, or unused, or empty).
  void host_buffers_unless_staged(const char* hint) noexcept {
    host_only_hint_ = hint;
    staged_exempt_ = true;
  }

 private:
  friend class OpQueue;

  /// OpQueue issues under its lock and runs one operation at a time: the flight recorder's
  /// writes never overlap, so they take no lock.
  static constexpr FlightRecorder::Writers kRecorderWriters = FlightRecorder::Writers::one_at_a_time;

  [[nodiscard]] Derived& derived() noexcept { return static_cast<Derived&>(*this); }

  void check_host_buffers(const Op& op) const {
    if (host_only_hint_ == nullptr || !cuda::driver_usable()) return;
    if (staged_exempt_) {
      switch (op.desc.kind) {
        case OpKind::all_reduce:
        case OpKind::reduce_scatter:
        case OpKind::all_gather:
        case OpKind::broadcast:
        case OpKind::gather: return;
        default: break;
      }
    }
    auto reject = [&](const void* p) {
      if (cuda::is_device_pointer(p))
        throw InvalidArgument(op_name(op.desc.kind), rank(),
                              std::string("a buffer is CUDA device memory, which the ") + backend_name() +
                                  " backend cannot read here: " + host_only_hint_);
    };
    reject(op.in);
    reject(op.out);
    for (const P2PItem& it : op.p2p) reject(it.buf);
  }

  /// A reduction of kind `kind` (all_reduce, reduce_scatter, reduce) with reduction argument `red`.
  template <class T, class Red, class Launch>
  auto typed_reduction(OpKind kind, std::span<const T> in, std::span<T> out, int root, Red& red, Launch l,
                       OpHooks hooks) {
    Op op = make_op<T>(kind, in.data(), out.data(), in.size(), out.size(), root);
    set_hooks(op, std::move(hooks));
    set_typed_reduction<T, Launch>(op, red);
    return launch(op, l);
  }

  /// Hooks are rare (device staging): an empty pair is not moved.
  static void set_hooks(Op& op, OpHooks&& hooks) noexcept {
    if (hooks.before || hooks.after) op.hooks = std::move(hooks);
  }

  /// The record of a typed call (erased_op: desc.count follows the kind; `root`: root or peer).
  template <class T>
  [[nodiscard]] static Op make_op(OpKind kind, const T* in, T* out, std::size_t in_count, std::size_t out_count,
                                  int root = -1) {
    return erased_op(kind, dtype_of<T>, in, out, in_count, out_count, root);
  }

  static void execute_thunk(void* self, Op& op, std::uint64_t id, std::uint64_t seq, bool started) {
    static_cast<EngineCore*>(self)->execute(op, id, seq, started);
  }
  static void issue_thunk(void* self, const Op& op, std::uint64_t id, std::uint64_t /*seq*/, bool started) {
    if (started)
      static_cast<EngineCore*>(self)->recorder().issued_started(id, op.desc);
    else
      static_cast<EngineCore*>(self)->recorder().issued(id, op.desc);
  }
  static void abort_thunk(void* self, const std::string& why, std::chrono::milliseconds grace) {
    static_cast<EngineCore*>(self)->abort(why, grace);
  }

  /// One operation: flight-recorder transitions (`started`: its start is recorded already), the
  /// desync check when on, the hooks and the engine's part.
  void execute(Op& op, std::uint64_t id, std::uint64_t seq, bool started) {
    const char* name = op_name(op.desc.kind);
    if (!started) recorder().started(id);
    const auto log_start = log_.start();  // one branch when the comms log is off
    try {
      if (op.desc.kind == OpKind::monitored_barrier) {
        // Store-based: its failure is a verdict about peers, not a broken transport.
        store_barrier(next_monitored_barrier(), op.barrier_timeout, op.wait_all_ranks);
      } else {
        // Point-to-point operations involve two ranks: their check is the message header's.
        const bool p2p = is_p2p(op.desc.kind);
        if (size() > 1 && !p2p && (desync_check() || wants_exchange(op))) check_desync(op.desc, seq, desync_check());
        // `before` runs inside run(): when it fails (a device copy-in), this rank's part of the
        // operation never happens, so the communicator fails and closes its transport, and the
        // peers get RemoteError at once instead of waiting for their timeout.
        run(name, [&] {
          if (op.hooks.before) run_hook(name, op.hooks.before);
          if (op.prescale != nullptr) apply_prescale(op);
          if (p2p)
            derived().perform_p2p(op, std::span<P2PItem>(op.p2p));
          else
            derived().perform(op, seq);
        });
        if (op.prescale != nullptr) release_scratch(prescale_scratch_);
        if (op.hooks.after) run_hook(name, op.hooks.after);
      }
      recorder().completed(id);
      if (log_.on()) log_.record(op.desc, traffic_of(op, size()), seq, log_start, CommsLog::Clock::now() - log_start);
    } catch (const std::exception& e) {
      recorder().failed(id, e.what());
      // A desync (every rank throws it, the communicator stays usable) and the first failure are
      // dumped; operations failing at once after that are not.
      if (op.desc.kind == OpKind::monitored_barrier || dynamic_cast<const DesyncError*>(&e) != nullptr ||
          take_failure_dump())
        dump_after_error();
      throw;
    }
  }

  /// premul_sum: the input, scaled by the factor, becomes the operation's input (a copy: the
  /// caller's input is const, and an in-place buffer is overwritten by the result anyway).
  void apply_prescale(Op& op) {
    const void* src = op.in != nullptr ? op.in : op.out;
    prescale_scratch_.resize(op.in_count * op.elem_size);
    if (op.in_count != 0) op.prescale(prescale_scratch_.data(), src, op.in_count, op.factor);
    op.in = prescale_scratch_.data();
  }

  /// Large scratch is not kept between operations.
  static void release_scratch(std::vector<std::byte>& v) {
    if (v.capacity() > (std::size_t{8} << 20)) std::vector<std::byte>().swap(v);
  }

  void run_hook(const char* name, const Hook& hook) {
    try {
      hook();
    } catch (...) {
      rethrow_as_error(name, rank());  // an exception of no std type goes on as it is
    }
  }

  /// Engines whose transport cannot survive ranks that disagree about an operation (Gloo: a
  /// longer message than the posted receive ends the process) exchange fingerprints first for the
  /// operations they say, whether or not the desync check is on.
  bool wants_exchange(const Op& op) {
    if constexpr (requires { derived().exchange_before(op); })
      return derived().exchange_before(op);
    else
      return false;
  }

  /// Exchanges this operation's fingerprint with every rank and throws DesyncError on a mismatch.
  /// `configured`: the desync check asked for it (every rank must have it on), else the engine.
  void check_desync(const OpDesc& d, std::uint64_t seq, bool configured) {
    const char* op = op_name(d.kind);
    fingerprints_[static_cast<std::size_t>(rank())] = fingerprint(seq, d);
    try {
      run(op, [&] { derived().exchange_fingerprints(seq); });
    } catch (const Timeout& e) {
      throw Timeout(e.op(), e.rank(),
                    e.detail() + " (in the fingerprint exchange before op #" + std::to_string(seq) +
                        (configured ? ": a rank is late, hung, or runs without the desync check; it must be on for "
                                      "every rank or none)"
                                    : ": a rank is late, hung, or called another operation)"),
                    e.peer());
    }
    check_fingerprints(fingerprints_, op, rank());
  }

  const char* host_only_hint_ = nullptr;  // see host_buffers_only()
  bool staged_exempt_ = false;            // see host_buffers_unless_staged()
  bool shut_down_ = false;
  std::vector<Fingerprint> fingerprints_;  // one per rank; operations run one at a time
  std::vector<std::byte> prescale_scratch_;  // premul_sum's scaled input
  std::vector<std::byte> compose_scratch_;   // compose(): a reduce's result off the root
  std::vector<P2PItem> compose_items_;       // compose(): a collective's sends and receives
  CommsLog log_;  // COMM_COMMS_LOG, COMM_TRACE
  void start_liveness_once() {
    CommCore::start_liveness_once(
        [this](int peer, const std::string& why, bool echo) { peer_failed(peer, why, echo); });
  }
  std::shared_ptr<AbortHandle> abort_ = std::make_shared<AbortHandle>(this, &EngineCore::abort_thunk);
  OpQueue queue_{this, &EngineCore::execute_thunk, &EngineCore::issue_thunk};  // last: drained first
};

}  // namespace comm::detail
