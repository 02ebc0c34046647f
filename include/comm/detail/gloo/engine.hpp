#pragma once
// The Gloo engine behind comm::backends::Gloo: the connected gloo contexts (one per network
// device), the op queue, the collectives themselves, and the diagnostics around every operation:
// the flight recorder (queued/started/completed/failed) and, when on, the desync check (an
// exchange of a 32-byte fingerprint per rank before the operation: every rank sends its own to
// every other rank at once, one message latency; a gloo ring allgather above kDirectExchangeMax
// ranks, where n-1 messages per rank and operation would cost more than n-1 ring steps).
//
// The typed entry points (all_reduce<T>, ...) only fill an Op record (op.hpp); queueing,
// execution, diagnostics and the gloo calls are plain functions, compiled once per translation
// unit however many element types and reductions a program uses. gloo's typed options are used
// through carrier types of the element's size (uint8_t..uint64_t): gloo only uses sizeof(T).

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/context.h>
#include <gloo/gather.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <comm/concepts.hpp>
#include <comm/detail/gloo/abort.hpp>
#include <comm/detail/gloo/algorithms.hpp>
#include <comm/detail/gloo/device.hpp>
#include <comm/detail/gloo/errors.hpp>
#include <comm/detail/gloo/membership.hpp>
#include <comm/detail/gloo/op.hpp>
#include <comm/detail/gloo/op_queue.hpp>
#include <comm/detail/gloo/reduce_scatter.hpp>
#include <comm/detail/gloo/store_adapter.hpp>
#include <comm/detail/desync.hpp>
#include <comm/detail/flight_recorder.hpp>
#include <comm/detail/logging.hpp>
#include <comm/detail/monitored_barrier.hpp>
#include <comm/detail/reduce.hpp>
#include <comm/diagnostics.hpp>
#include <comm/error.hpp>
#include <comm/store.hpp>
#include <comm/types.hpp>
#include <comm/work.hpp>

namespace comm::detail::gloo {

template <class Red>
[[nodiscard]] constexpr bool is_avg(const Red& red) noexcept {
  if constexpr (std::is_same_v<Red, ReduceOp>)
    return red == ReduceOp::avg;
  else if constexpr (builtin_reduction<Red>)
    return reduce_op_of<Red> == ReduceOp::avg;
  else
    return false;
}

/// The flight recorder's / desync check's code of a reduction argument.
template <class Red>
[[nodiscard]] constexpr std::uint8_t reduce_code(const Red& red) noexcept {
  if constexpr (std::is_same_v<Red, ReduceOp>)
    return static_cast<std::uint8_t>(red);
  else if constexpr (builtin_reduction<Red>)
    return static_cast<std::uint8_t>(reduce_op_of<Red>);
  else
    return OpDesc::custom;
}

/// The reduction gloo (or comm's algorithms) call for `op`. Both forms fit std::function's small
/// buffer (a function pointer; two pointers), so building one does not allocate.
[[nodiscard]] inline ReduceFunc reduce_func(const Op& op) {
  if (op.custom == nullptr) return ReduceFunc(op.kernel);
  return [fn = op.custom, arg = op.custom_arg](void* out, const void* a, const void* b, std::size_t n) {
    fn(arg, out, a, b, n);
  };
}

/// What an Engine is built with besides its store, rank and size.
struct EngineConfig {
  std::chrono::milliseconds timeout{};
  std::vector<std::string> interfaces;
  std::string hostname;
  bool desync_check = false;
  std::size_t flight_recorder_size = 256;
  /// Subgroups: the rank (in its root communicator) used in dump file names, and the subgroup's
  /// name ("g0", "g0.g1"). -1 for a root communicator (its own rank; its name comes from its
  /// creation number on the store).
  int file_rank = -1;
  std::string name;
  /// Nice value added to the gloo devices' event-loop threads (see device.hpp); 0: inherit.
  /// Default: COMM_GLOO_LOOP_NICE, else 19.
  int loop_nice = loop_nice_default();
  /// all_reduce / reduce_scatter algorithm choice (see algorithms.hpp).
  AlgorithmConfig algorithms = algorithm_config_default();
};

class Engine;

/// Lets a Work whose wait gave up stop the operation; outlives the engine (Work may).
class AbortHandle {
 public:
  explicit AbortHandle(Engine* e) noexcept : engine_(e) {}
  /// Aborts the communicator's operations; false when the engine is gone.
  bool abort(const std::string& why, std::chrono::milliseconds grace);
  void detach() noexcept {
    std::lock_guard lock(mu_);
    engine_ = nullptr;
  }

 private:
  std::mutex mu_;
  Engine* engine_;
};

/// The Work state of an async Gloo operation. When Work::wait's (or synchronize's) deadline passes
/// it aborts the communicator and waits (bounded: at most timeout + 2 s more) for the operation to
/// end, so that the Timeout reaches the caller only once gloo no longer touches the operation's
/// buffers. Work::wait_for() lets the operation run on, as documented.
class GlooWorkState final : public WorkState {
 public:
  GlooWorkState(const char* op, int rank, std::chrono::milliseconds timeout, std::shared_ptr<AbortHandle> abort)
      : WorkState(op, rank, timeout), abort_(std::move(abort)) {}

  std::string on_wait_timeout() override {
    const std::string why = "Work::wait gave up after " + std::to_string(timeout().count()) +
                            " ms: the operation did not complete; the communicator was aborted";
    // The abort wakes every pending gloo wait at once, except a send the event loop had started
    // writing (libgloo), which ends by its own deadline: at most the timeout.
    const auto bound = timeout() + std::chrono::seconds(2);
    // (A communicator already destroyed has drained its queue: the operation has ended.)
    (void)abort_->abort(why, bound);
    if (wait_until(std::chrono::steady_clock::now() + bound)) return {};
    return "; the communicator was aborted, and the operation did not stop within " + std::to_string(bound.count()) +
           " ms more: its buffers may still be in use";
  }

 private:
  std::shared_ptr<AbortHandle> abort_;
};

class Engine {
  /// Tag of the barrier that ends connection. Operation tags are the sequence number modulo 2^31;
  /// the desync check's fingerprint exchange has a tag of its own (exchanges run one at a time,
  /// in the same order on every rank, and gloo keeps messages of one slot in order).
  static constexpr std::uint32_t kConnectTag = 0xffffffffu;
  static constexpr std::uint32_t kDesyncTag = 0x80000000u;
  /// Slot prefix of the direct fingerprint exchange (comm's own algorithms use 0x21 and up).
  static constexpr std::uint8_t kDesyncSlotPrefix = 0x22;
  static constexpr int kDirectExchangeMax = 64;
  /// Scratch kept between operations; more is freed after the operation that needed it.
  static constexpr std::size_t kScratchKeep = std::size_t{8} << 20;

  [[nodiscard]] static constexpr std::uint32_t tag_of(std::uint64_t seq) noexcept {
    return static_cast<std::uint32_t>(seq & 0x7fffffffu);
  }

 public:
  /// Connects `size` ranks through `store`: one gloo context per device (see device.hpp).
  Engine(std::shared_ptr<comm::Store> store, int rank, int size, const EngineConfig& cfg)
      : rank_(rank),
        size_(size),
        timeout_(cfg.timeout),
        store_(std::move(store)),
        desync_(cfg.desync_check),
        algorithms_(cfg.algorithms),
        fingerprints_(static_cast<std::size_t>(size)),
        recorder_(cfg.flight_recorder_size),
        dump_path_(flight_recorder_path()) {
    const auto specs = device_specs(cfg.interfaces, cfg.hostname);
    // Each rank counts its own communicators on this store; ranks that create communicators in
    // the same order get the same number, hence the same key prefix.
    const auto seq = store_->add("comm/gloo/seq/" + std::to_string(rank), 1);
    key_prefix_ = "comm/gloo/" + std::to_string(seq) + "/";
    if (cfg.file_rank < 0) {
      file_rank_ = rank;
      name_ = seq == 1 ? std::string() : "c" + std::to_string(seq);
    } else {
      file_rank_ = cfg.file_rank;
      name_ = cfg.name;
    }
    if (size > 1) check_membership(*store_, key_prefix_, static_cast<std::uint64_t>(seq), rank, size, timeout_);
    for (std::size_t i = 0; i < specs.size(); ++i) {
      auto dev = shared_device(specs[i], rank, cfg.loop_nice);
      auto ctx = std::make_shared<::gloo::rendezvous::Context>(rank, size);
      ctx->setTimeout(timeout_);
      StoreAdapter adapter(store_, key_prefix_ + std::to_string(i) + "/", timeout_);
      try {
        ctx->connectFullMesh(adapter, dev);
        // Once every rank has passed this barrier, every rank has finished reading the store, so
        // the store (e.g. rank 0's TcpStore server from env://) may go away right after create().
        ::gloo::BarrierOptions b(ctx);
        b.setTag(kConnectTag);
        b.setTimeout(timeout_);
        ::gloo::barrier(b);
      } catch (...) {
        rethrow_translated("gloo.connect", rank);
      }
      contexts_.push_back(std::move(ctx));
    }
  }

  /// Uses an already connected context (no store: no subgroups, no monitored_barrier).
  Engine(std::shared_ptr<::gloo::Context> ctx, const EngineConfig& cfg)
      : rank_(ctx->rank),
        size_(ctx->size),
        timeout_(cfg.timeout),
        file_rank_(ctx->rank),
        name_("adopted"),
        desync_(cfg.desync_check),
        algorithms_(cfg.algorithms),
        fingerprints_(static_cast<std::size_t>(ctx->size)),
        recorder_(cfg.flight_recorder_size),
        dump_path_(flight_recorder_path()) {
    contexts_.push_back(std::move(ctx));
  }

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  ~Engine() {
    queue_.shutdown();
    abort_->detach();
    if (!dump_path_.empty()) {
      try {
        write_text_file(dump_file(), to_string(flight_record()), rank_);
      } catch (const std::exception& e) {
        log(LogLevel::warn, e.what());
      }
    }
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  [[nodiscard]] const std::shared_ptr<::gloo::Context>& context(std::size_t i = 0) const { return contexts_.at(i); }
  [[nodiscard]] std::size_t num_contexts() const noexcept { return contexts_.size(); }
  /// The store this communicator rendezvoused on (null when adopted) and its key prefix there.
  [[nodiscard]] const std::shared_ptr<comm::Store>& store() const noexcept { return store_; }
  [[nodiscard]] const std::string& key_prefix() const noexcept { return key_prefix_; }
  [[nodiscard]] int file_rank() const noexcept { return file_rank_; }
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  [[nodiscard]] bool desync_check() const noexcept { return desync_; }
  /// The next subgroup number (split and new_group count on every rank of this communicator).
  [[nodiscard]] std::uint64_t next_group_index() noexcept { return groups_.fetch_add(1); }

  [[nodiscard]] FlightRecord flight_record() const { return recorder_.snapshot("gloo", rank_, size_, name_); }
  /// The file of automatic dumps: COMM_FLIGHT_RECORDER + "." + rank [+ "." + name].
  [[nodiscard]] std::string dump_file() const {
    return dump_path_ + "." + std::to_string(file_rank_) + (name_.empty() ? std::string() : "." + name_);
  }

  // ---- launch: blocking runs inline (after queued work), async queues and returns Work ----

  void launch(Op& op, blocking_t) { queue_.run_inline(op); }

  Work launch(Op& op, async_t) {
    auto state = std::make_shared<GlooWorkState>(op_name(op.desc.kind), rank_, timeout_, abort_);
    queue_.submit(std::move(op), state);
    return Work(std::move(state));
  }

  // ---- collectives (arguments were validated by the facade) ----
  // `hooks` (optional): steps run around the collective on the executing thread (see op.hpp).

  template <class T, class Red, class Launch>
  auto all_reduce(std::span<const T> in, std::span<T> out, Red red, Launch l, OpHooks hooks = {}) {
    Op op = make_op<T>(OpKind::all_reduce, in.data(), out.data(), in.size(), out.size());
    op.desc.reduce = reduce_code(red);
    op.desc.count = in.size();
    op.hooks = std::move(hooks);
    return with_reduction<T>(op, red, l);
  }

  template <class T, class Red, class Launch>
  auto reduce_scatter(std::span<const T> in, std::span<T> out, Red red, Launch l, OpHooks hooks = {}) {
    Op op = make_op<T>(OpKind::reduce_scatter, in.data(), out.data(), in.size(), out.size());
    op.desc.reduce = reduce_code(red);
    op.desc.count = out.size();
    op.hooks = std::move(hooks);
    return with_reduction<T>(op, red, l);
  }

  template <class T, class Launch>
  auto all_gather(std::span<const T> in, std::span<T> out, Launch l, OpHooks hooks = {}) {
    Op op = make_op<T>(OpKind::all_gather, in.data(), out.data(), in.size(), out.size());
    op.desc.count = in.size();
    op.hooks = std::move(hooks);
    return launch(op, l);
  }

  template <class T, class Launch>
  auto broadcast(std::span<T> data, int root, Launch l, OpHooks hooks = {}) {
    Op op = make_op<T>(OpKind::broadcast, nullptr, data.data(), 0, data.size());
    op.desc.root = root;
    op.desc.count = data.size();
    op.hooks = std::move(hooks);
    return launch(op, l);
  }

  template <class T, class Launch>
  auto gather(std::span<const T> in, std::span<T> out, int root, Launch l, OpHooks hooks = {}) {
    // The input count: the output is only meaningful (and sized) on the root.
    Op op = make_op<T>(OpKind::gather, in.data(), out.data(), in.size(), out.size());
    op.desc.root = root;
    op.desc.count = in.size();
    op.hooks = std::move(hooks);
    return launch(op, l);
  }

  template <class Launch>
  auto barrier(Launch l, OpHooks hooks = {}) {
    Op op;
    op.desc = OpDesc{OpKind::barrier, OpDesc::none, OpDesc::none, -1, 0};
    op.hooks = std::move(hooks);
    return launch(op, l);
  }

  /// split's collective step: every rank's (color, key), as 2*size() values in rank order.
  [[nodiscard]] std::vector<std::int64_t> exchange_color_key(int color, int key) {
    const std::array<std::int64_t, 2> mine{color, key};
    std::vector<std::int64_t> all(2 * static_cast<std::size_t>(size_));
    Op op = make_op<std::int64_t>(OpKind::split, mine.data(), all.data(), mine.size(), all.size());
    op.desc.count = 2;
    launch(op, blocking);
    return all;
  }

  /// See detail/monitored_barrier.hpp. Ordered after the queued operations, like barrier().
  void monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks) {
    if (!store_)
      throw InvalidArgument("monitored_barrier", rank_,
                            "this communicator was adopted from a gloo context and has no store; monitored_barrier "
                            "needs one (create the communicator with create() or from_env())");
    Op op;
    op.desc = OpDesc{OpKind::monitored_barrier, OpDesc::none, OpDesc::none, -1, 0};
    op.barrier_timeout = timeout;
    op.wait_all_ranks = wait_all_ranks;
    launch(op, blocking);
  }

  /// Makes every queued and running operation fail with Timeout(`why`) and the communicator
  /// unusable: pending gloo waits wake at once, the connections close (peers fail with
  /// RemoteError). Returns once no operation runs, or after `grace`.
  void abort(const std::string& why, std::chrono::milliseconds grace) {
    bool first = false;
    {
      std::lock_guard lock(failure_mu_);
      if (!failure_) {
        failure_ = Failure{FailureKind::timeout, why, {}};
        first = true;
      }
    }
    if (first) failure_to_dump_ = true;
    for (auto& ctx : contexts_) abort_context(*ctx);
    (void)queue_.wait_idle_until(std::chrono::steady_clock::now() + grace);
  }

 private:
  template <class T>
  [[nodiscard]] static Op make_op(OpKind kind, const T* in, T* out, std::size_t in_count, std::size_t out_count) {
    Op op;
    op.desc = OpDesc{kind, dtype_code<T>(), OpDesc::none, -1, 0};
    op.in = in;
    op.out = out;
    op.in_count = in_count;
    op.out_count = out_count;
    op.elem_size = sizeof(T);
    return op;
  }

  /// Sets the reduction of `op` from `red`, then launches it. A custom callable is referred to
  /// where it lives: in the caller's frame for a blocking call, in `op.keep` for an async one.
  template <class T, class Red, class Launch>
  auto with_reduction(Op& op, Red& red, Launch l) {
    if constexpr (std::is_same_v<Red, ReduceOp>) {
      op.kernel = reduce_kernel_for<T>(red);
    } else if constexpr (builtin_reduction<Red>) {
      constexpr ReduceOp r = reduce_op_of<Red> == ReduceOp::avg ? ReduceOp::sum : reduce_op_of<Red>;
      op.kernel = &reduce_kernel<r, T>;
    } else {
      using F = std::remove_cvref_t<decltype(red.fn)>;
      op.custom = &apply_custom<T, F>;
      if constexpr (std::is_same_v<Launch, async_t>) {
        auto held = std::make_shared<F>(std::move(red.fn));
        op.custom_arg = held.get();
        op.keep = std::move(held);
      } else {
        op.custom_arg = &red.fn;
      }
    }
    if (is_avg(red)) op.finish = &finish_avg_erased<T>;
    return launch(op, l);
  }

  static void execute_thunk(void* self, Op& op, std::uint64_t seq) { static_cast<Engine*>(self)->execute(op, seq); }
  static void issue_thunk(void* self, const Op& op, std::uint64_t seq) {
    static_cast<Engine*>(self)->recorder_.issued(seq, op.desc);
  }

  /// One operation: flight-recorder transitions, the desync check when on, the hooks and the
  /// collective.
  void execute(Op& op, std::uint64_t seq) {
    const char* name = op_name(op.desc.kind);
    recorder_.started(seq);
    try {
      if (op.desc.kind == OpKind::monitored_barrier) {
        // Store-based: its failure is a verdict about peers, not a broken connection.
        detail::monitored_barrier(*store_, key_prefix_ + "mb", monitored_barriers_++, rank_, size_,
                                  op.barrier_timeout, op.wait_all_ranks);
      } else {
        if (desync_ && size_ > 1) check_desync(op.desc, seq);
        const std::uint32_t tag = tag_of(seq);
        // `before` runs inside run(): when it fails (a device copy-in), this rank's part of the
        // collective never happens, so the communicator fails and closes its connections, and the
        // peers get RemoteError at once instead of waiting for their timeout.
        run(name, tag % contexts_.size(), [&](const std::shared_ptr<::gloo::Context>& ctx) {
          if (op.hooks.before) run_hook(name, op.hooks.before);
          perform(ctx, tag, op);
        });
        if (op.hooks.after) run_hook(name, op.hooks.after);
      }
      recorder_.completed(seq);
    } catch (const std::exception& e) {
      recorder_.failed(seq, e.what());
      // A desync (every rank throws it, the communicator stays usable) and the first failure are
      // dumped; operations failing at once after that are not.
      if (op.desc.kind == OpKind::monitored_barrier || dynamic_cast<const DesyncError*>(&e) != nullptr ||
          failure_to_dump_.exchange(false))
        dump_after_error();
      throw;
    }
  }

  void run_hook(const char* name, const std::function<void()>& hook) {
    try {
      hook();
    } catch (const Error&) {
      throw;
    } catch (const std::bad_alloc&) {
      throw;
    } catch (const std::exception& e) {
      throw BackendError(name, rank_, e.what());
    }
  }

  /// The collective of `op` on `ctx` (comm's own algorithms or gloo's).
  void perform(const std::shared_ptr<::gloo::Context>& ctx, std::uint32_t tag, Op& op) {
    switch (op.desc.kind) {
      case OpKind::all_reduce: {
        if (op.out_count == 0) return;
        const ReduceFunc fn = reduce_func(op);
        const void* in = op.in == op.out ? nullptr : op.in;
        run_all_reduce(ctx, tag, timeout_, in, op.out, op.out_count, op.elem_size, fn, algorithms_, scratch_);
        if (op.finish != nullptr) op.finish(op.out, op.out_count, size_);
        return;
      }
      case OpKind::reduce_scatter: {
        if (op.out_count == 0) return;
        const ReduceFunc fn = reduce_func(op);
        run_reduce_scatter(ctx, tag, timeout_, op.in, op.out, op.out_count, op.elem_size, fn, algorithms_, scratch_);
        // Defensive: every algorithm's scratch is bounded (a few MiB), but never hold more.
        if (scratch_.capacity() > kScratchKeep) Scratch().swap(scratch_);
        if (op.finish != nullptr) op.finish(op.out, op.out_count, size_);
        return;
      }
      case OpKind::all_gather:
      case OpKind::split: {
        if (op.in_count == 0) return;
        with_carrier(op.elem_size, [&](auto c) {
          using C = decltype(c);
          ::gloo::AllgatherOptions o(ctx);
          // An input that already sits in this rank's slot of the output is gathered in place.
          if (op.in != static_cast<C*>(op.out) + static_cast<std::size_t>(rank_) * op.in_count)
            o.setInput(const_cast<C*>(static_cast<const C*>(op.in)), op.in_count);
          o.setOutput(static_cast<C*>(op.out), op.out_count);
          o.setTag(tag);
          o.setTimeout(timeout_);
          ::gloo::allgather(o);
        });
        return;
      }
      case OpKind::broadcast: {
        if (op.out_count == 0) return;
        with_carrier(op.elem_size, [&](auto c) {
          using C = decltype(c);
          ::gloo::BroadcastOptions o(ctx);
          o.setOutput(static_cast<C*>(op.out), op.out_count);
          o.setRoot(op.desc.root);
          o.setTag(tag);
          o.setTimeout(timeout_);
          ::gloo::broadcast(o);
        });
        return;
      }
      case OpKind::gather: {
        if (op.in_count == 0) return;
        with_carrier(op.elem_size, [&](auto c) {
          using C = decltype(c);
          ::gloo::GatherOptions o(ctx);
          o.setInput(const_cast<C*>(static_cast<const C*>(op.in)), op.in_count);
          if (rank_ == op.desc.root) o.setOutput(static_cast<C*>(op.out), op.out_count);
          o.setRoot(op.desc.root);
          o.setTag(tag);
          o.setTimeout(timeout_);
          ::gloo::gather(o);
        });
        return;
      }
      case OpKind::barrier: {
        ::gloo::BarrierOptions o(ctx);
        o.setTag(tag);
        o.setTimeout(timeout_);
        ::gloo::barrier(o);
        return;
      }
      default: throw BackendError(op_name(op.desc.kind), rank_, "not an operation the gloo engine runs");
    }
  }

  /// Exchanges this operation's fingerprint with every rank and throws DesyncError on a mismatch.
  void check_desync(const OpDesc& d, std::uint64_t seq) {
    const char* op = op_name(d.kind);
    fingerprint_ = fingerprint(seq, d);
    try {
      run(op, 0, [&](const std::shared_ptr<::gloo::Context>& ctx) {
        constexpr std::size_t fp = sizeof(Fingerprint);
        if (size_ > kDirectExchangeMax) {
          ::gloo::AllgatherOptions o(ctx);
          o.setInput(reinterpret_cast<std::uint8_t*>(&fingerprint_), fp);
          o.setOutput(reinterpret_cast<std::uint8_t*>(fingerprints_.data()), fingerprints_.size() * fp);
          o.setTag(kDesyncTag);
          o.setTimeout(timeout_);
          ::gloo::allgather(o);
          return;
        }
        // Every exchange uses the same slot: they run one at a time, in the same order on every
        // rank, and gloo delivers the messages of one slot and pair in order.
        if (!fp_send_) {
          fp_send_ = ctx->createUnboundBuffer(&fingerprint_, fp);
          fp_recv_ = ctx->createUnboundBuffer(fingerprints_.data(), fingerprints_.size() * fp);
        }
        fingerprints_[static_cast<std::size_t>(rank_)] = fingerprint_;
        const auto slot = static_cast<std::uint64_t>(::gloo::Slot::build(kDesyncSlotPrefix, 0));
        for (int p = 0; p < size_; ++p) {
          if (p == rank_) continue;
          fp_recv_->recv(p, slot, static_cast<std::size_t>(p) * fp, fp);
          fp_send_->send(p, slot);
        }
        const Deadline deadline(timeout_);
        for (int i = 1; i < size_; ++i) wait_recv(*fp_recv_, deadline);
        for (int i = 1; i < size_; ++i) wait_send(*fp_send_, deadline);
      });
    } catch (const Timeout& e) {
      throw Timeout(e.op(), e.rank(),
                    e.detail() + " (in the desync check's fingerprint exchange before op #" + std::to_string(seq) +
                        ": a rank is late, hung, or runs without the check; it must be on for every rank or none)",
                    e.peer());
    }
    check_fingerprints(fingerprints_, op, rank_);
  }

  /// Writes the flight record where COMM_FLIGHT_RECORDER says, else to stderr at COMM_DEBUG>=WARN.
  void dump_after_error() noexcept {
    try {
      const auto text = to_string(flight_record());
      if (!dump_path_.empty()) {
        const auto file = dump_file();
        write_text_file(file, text, rank_);
        log(LogLevel::warn, "rank " + std::to_string(rank_) + ": flight record written to " + file);
      } else if (log_level() >= LogLevel::warn) {
        log(LogLevel::warn, "rank " + std::to_string(rank_) + ": flight record after the error:\n" +
                                text.substr(0, text.empty() ? 0 : text.size() - 1));
      }
    } catch (...) {  // diagnostics must not replace the error being reported
    }
  }

  /// Runs one operation on context `ctx_index`, turning gloo's exceptions into comm errors. After
  /// a failure the gloo context is unusable (gloo closes its connections on error), so every later
  /// operation fails at once with the first cause.
  template <class F>
  void run(const char* op, std::size_t ctx_index, F&& f) {
    {
      std::lock_guard lock(failure_mu_);
      if (failure_)
        throw_as(failure_->kind, op, rank_,
                 "the communicator is unusable after an earlier failure: " + failure_->what, failure_->peer);
    }
    try {
      std::forward<F>(f)(contexts_[ctx_index]);
    } catch (...) {
      try {
        rethrow_translated(op, rank_);
      } catch (const Error& e) {
        bool first = false;
        std::optional<Failure> earlier;
        {
          std::lock_guard lock(failure_mu_);
          if (!failure_) {
            failure_ = Failure{kind_of(e), e.what(), e.peer()};
            first = true;
          } else {
            earlier = failure_;
          }
        }
        // Close every connection now, so that peers blocked on this rank fail at once with
        // RemoteError instead of waiting for their own timeout.
        if (first) {
          failure_to_dump_ = true;
          for (auto& ctx : contexts_) abort_context(*ctx);
          throw;
        }
        // Woken by an abort (Work::wait gave up): report that cause, not gloo's echo of it.
        throw_as(earlier->kind, op, rank_, earlier->what, earlier->peer);
      }
    }
  }

  struct Failure {
    FailureKind kind;
    std::string what;
    std::string peer;
  };

  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<comm::Store> store_;  // null when adopted
  std::string key_prefix_;              // "comm/gloo/<n>/": this communicator's keys in store_
  int file_rank_ = 0;
  std::string name_;
  bool desync_;
  AlgorithmConfig algorithms_;
  std::vector<Fingerprint> fingerprints_;  // one per rank; operations run one at a time
  Fingerprint fingerprint_;                // this rank's, being sent
  std::vector<std::shared_ptr<::gloo::Context>> contexts_;
  // The direct exchange's buffers over fingerprint_ and fingerprints_ (made at the first check;
  // destroyed before the contexts).
  std::unique_ptr<::gloo::transport::UnboundBuffer> fp_send_, fp_recv_;
  Scratch scratch_;  // comm's algorithms' buffers; ops run one at a time
  std::atomic<std::uint64_t> groups_{0};
  std::uint64_t monitored_barriers_ = 0;  // only touched by the executing operation
  FlightRecorder recorder_;
  std::string dump_path_;  // COMM_FLIGHT_RECORDER
  std::atomic<bool> failure_to_dump_{false};
  std::mutex failure_mu_;
  std::optional<Failure> failure_;
  std::shared_ptr<AbortHandle> abort_ = std::make_shared<AbortHandle>(this);
  OpQueue queue_{this, &Engine::execute_thunk, &Engine::issue_thunk};  // last: drained first
};

inline bool AbortHandle::abort(const std::string& why, std::chrono::milliseconds grace) {
  std::lock_guard lock(mu_);
  if (engine_ == nullptr) return false;
  engine_->abort(why, grace);
  return true;
}

}  // namespace comm::detail::gloo
