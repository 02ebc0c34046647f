#pragma once
// The Gloo engine behind comm::backends::Gloo: the connected gloo contexts (one per network
// device), the op queue, the collectives themselves, and the diagnostics around every operation:
// the flight recorder (queued/started/completed/failed) and, when on, the desync check (an
// exchange of a 32-byte fingerprint per rank before the operation: every rank sends its own to
// every other rank at once, one message latency; a gloo ring allgather above kDirectExchangeMax
// ranks, where n-1 messages per rank and operation would cost more than n-1 ring steps).

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
#include <comm/detail/gloo/device.hpp>
#include <comm/detail/gloo/errors.hpp>
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

/// The reduction function gloo calls; for a custom op it refers to `red.fn`, which must outlive it.
template <class T, class Red>
[[nodiscard]] ReduceFunc reduce_func(const Red& red) {
  if constexpr (std::is_same_v<Red, ReduceOp>) {
    return ReduceFunc(reduce_kernel_for<T>(red));
  } else if constexpr (builtin_reduction<Red>) {
    constexpr ReduceOp r = reduce_op_of<Red> == ReduceOp::avg ? ReduceOp::sum : reduce_op_of<Red>;
    return ReduceFunc(&reduce_kernel<r, T>);
  } else {
    const auto* f = &red.fn;
    return [f](void* out, const void* a, const void* b, std::size_t n) {
      reduce_custom<T>(*f, static_cast<T*>(out), static_cast<const T*>(a), static_cast<const T*>(b), n);
    };
  }
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
    for (std::size_t i = 0; i < specs.size(); ++i) {
      auto dev = shared_device(specs[i], rank);
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
        fingerprints_(static_cast<std::size_t>(ctx->size)),
        recorder_(cfg.flight_recorder_size),
        dump_path_(flight_recorder_path()) {
    contexts_.push_back(std::move(ctx));
  }

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  ~Engine() {
    queue_.shutdown();
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

  template <class Body>
  void launch(const OpDesc& d, blocking_t, Body&& body) {
    queue_.run_inline([&](std::uint64_t seq) { execute(d, seq, body); },
                      [&](std::uint64_t seq) { recorder_.issued(seq, d); });
  }

  template <class Body>
  Work launch(const OpDesc& d, async_t, Body&& body) {
    auto state = std::make_shared<WorkState>(op_name(d.kind), rank_, timeout_);
    queue_.submit([this, d, body = std::forward<Body>(body)](std::uint64_t seq) mutable { execute(d, seq, body); },
                  state, [&](std::uint64_t seq) { recorder_.issued(seq, d); });
    return Work(std::move(state));
  }

  // ---- collectives (arguments were validated by the facade) ----

  template <class T, class Red, class Launch>
  auto all_reduce(std::span<const T> in, std::span<T> out, Red red, Launch l) {
    const OpDesc d{OpKind::all_reduce, dtype_code<T>(), reduce_code(red), -1, in.size()};
    return launch(d, l, [this, in, out, red = std::move(red)](const std::shared_ptr<::gloo::Context>& ctx,
                                                              std::uint32_t tag) {
      if (out.empty()) return;
      ::gloo::AllreduceOptions o(ctx);
      if (in.data() != out.data()) o.setInput(const_cast<T*>(in.data()), in.size());
      o.setOutput(out.data(), out.size());
      o.setReduceFunction(reduce_func<T>(red));
      o.setTag(tag);
      o.setTimeout(timeout_);
      ::gloo::allreduce(o);
      if (is_avg(red)) finish_avg<T>(out.data(), out.size(), size_);
    });
  }

  template <class T, class Red, class Launch>
  auto reduce_scatter(std::span<const T> in, std::span<T> out, Red red, Launch l) {
    const OpDesc d{OpKind::reduce_scatter, dtype_code<T>(), reduce_code(red), -1, out.size()};
    return launch(d, l, [this, in, out, red = std::move(red)](const std::shared_ptr<::gloo::Context>& ctx,
                                                              std::uint32_t tag) {
      if (out.empty()) return;
      ring_reduce_scatter(ctx, tag, timeout_, in.data(), out.data(), out.size(), sizeof(T), reduce_func<T>(red),
                          scratch_);
      if (is_avg(red)) finish_avg<T>(out.data(), out.size(), size_);
    });
  }

  template <class T, class Launch>
  auto all_gather(std::span<const T> in, std::span<T> out, Launch l) {
    const OpDesc d{OpKind::all_gather, dtype_code<T>(), OpDesc::none, -1, in.size()};
    return launch(d, l, [this, in, out](const std::shared_ptr<::gloo::Context>& ctx, std::uint32_t tag) {
      if (in.empty()) return;
      ::gloo::AllgatherOptions o(ctx);
      // An input that already sits in this rank's slot of the output is gathered in place.
      if (in.data() != out.data() + static_cast<std::size_t>(rank_) * in.size())
        o.setInput(const_cast<T*>(in.data()), in.size());
      o.setOutput(out.data(), out.size());
      o.setTag(tag);
      o.setTimeout(timeout_);
      ::gloo::allgather(o);
    });
  }

  template <class T, class Launch>
  auto broadcast(std::span<T> data, int root, Launch l) {
    const OpDesc d{OpKind::broadcast, dtype_code<T>(), OpDesc::none, root, data.size()};
    return launch(d, l, [this, data, root](const std::shared_ptr<::gloo::Context>& ctx, std::uint32_t tag) {
      if (data.empty()) return;
      ::gloo::BroadcastOptions o(ctx);
      o.setOutput(data.data(), data.size());
      o.setRoot(root);
      o.setTag(tag);
      o.setTimeout(timeout_);
      ::gloo::broadcast(o);
    });
  }

  template <class T, class Launch>
  auto gather(std::span<const T> in, std::span<T> out, int root, Launch l) {
    // The input count: the output is only meaningful (and sized) on the root.
    const OpDesc d{OpKind::gather, dtype_code<T>(), OpDesc::none, root, in.size()};
    return launch(d, l, [this, in, out, root](const std::shared_ptr<::gloo::Context>& ctx, std::uint32_t tag) {
      if (in.empty()) return;
      ::gloo::GatherOptions o(ctx);
      o.setInput(const_cast<T*>(in.data()), in.size());
      if (rank_ == root) o.setOutput(out.data(), out.size());
      o.setRoot(root);
      o.setTag(tag);
      o.setTimeout(timeout_);
      ::gloo::gather(o);
    });
  }

  template <class Launch>
  auto barrier(Launch l) {
    const OpDesc d{OpKind::barrier, OpDesc::none, OpDesc::none, -1, 0};
    return launch(d, l, [this](const std::shared_ptr<::gloo::Context>& ctx, std::uint32_t tag) {
      ::gloo::BarrierOptions o(ctx);
      o.setTag(tag);
      o.setTimeout(timeout_);
      ::gloo::barrier(o);
    });
  }

  /// split's collective step: every rank's (color, key), as 2*size() values in rank order.
  [[nodiscard]] std::vector<std::int64_t> exchange_color_key(int color, int key) {
    const std::array<std::int64_t, 2> mine{color, key};
    std::vector<std::int64_t> all(2 * static_cast<std::size_t>(size_));
    const OpDesc d{OpKind::split, dtype_code<std::int64_t>(), OpDesc::none, -1, 2};
    launch(d, blocking, [&](const std::shared_ptr<::gloo::Context>& ctx, std::uint32_t tag) {
      ::gloo::AllgatherOptions o(ctx);
      o.setInput(const_cast<std::int64_t*>(mine.data()), mine.size());
      o.setOutput(all.data(), all.size());
      o.setTag(tag);
      o.setTimeout(timeout_);
      ::gloo::allgather(o);
    });
    return all;
  }

  /// See detail/monitored_barrier.hpp. Ordered after the queued operations, like barrier().
  void monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks) {
    if (!store_)
      throw InvalidArgument("monitored_barrier", rank_,
                            "this communicator was adopted from a gloo context and has no store; monitored_barrier "
                            "needs one (create the communicator with create() or from_env())");
    const OpDesc d{OpKind::monitored_barrier, OpDesc::none, OpDesc::none, -1, 0};
    queue_.run_inline(
        [&](std::uint64_t seq) {
          recorder_.started(seq);
          try {
            detail::monitored_barrier(*store_, key_prefix_ + "mb", monitored_barriers_++, rank_, size_, timeout,
                                      wait_all_ranks);
            recorder_.completed(seq);
          } catch (const std::exception& e) {
            recorder_.failed(seq, e.what());
            dump_after_error();
            throw;
          }
        },
        [&](std::uint64_t seq) { recorder_.issued(seq, d); });
  }

 private:
  /// One operation: flight-recorder transitions, the desync check when on, then `body(ctx, tag)`.
  template <class Body>
  void execute(const OpDesc& d, std::uint64_t seq, Body& body) {
    const char* op = op_name(d.kind);
    recorder_.started(seq);
    try {
      if (desync_ && size_ > 1) check_desync(d, seq);
      const std::uint32_t tag = tag_of(seq);
      run(op, tag % contexts_.size(), [&](const std::shared_ptr<::gloo::Context>& ctx) { body(ctx, tag); });
      recorder_.completed(seq);
    } catch (const std::exception& e) {
      recorder_.failed(seq, e.what());
      // A desync (every rank throws it, the communicator stays usable) and the first failure are
      // dumped; operations failing at once after that are not.
      if (dynamic_cast<const DesyncError*>(&e) != nullptr || failure_to_dump_.exchange(false)) dump_after_error();
      throw;
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
        const auto deadline = std::chrono::steady_clock::now() + timeout_;
        auto left = [&] {
          return std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                            deadline - std::chrono::steady_clock::now()));
        };
        for (int i = 1; i < size_; ++i) fp_recv_->waitRecv(left());
        for (int i = 1; i < size_; ++i) fp_send_->waitSend(left());
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
        {
          std::lock_guard lock(failure_mu_);
          if (!failure_) {
            failure_ = Failure{kind_of(e), e.what(), e.peer()};
            first = true;
          }
        }
        // Close every connection now, so that peers blocked on this rank fail at once with
        // RemoteError instead of waiting for their own timeout.
        if (first) {
          failure_to_dump_ = true;
          close_connections();
        }
        throw;
      }
    }
  }

  void close_connections() noexcept {
    for (auto& ctx : contexts_) {
      try {
        ctx->closeConnections();
      } catch (...) {  // best effort: the connections are being abandoned anyway
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
  std::vector<Fingerprint> fingerprints_;  // one per rank; operations run one at a time
  Fingerprint fingerprint_;                // this rank's, being sent
  std::vector<std::shared_ptr<::gloo::Context>> contexts_;
  // The direct exchange's buffers over fingerprint_ and fingerprints_ (made at the first check;
  // destroyed before the contexts).
  std::unique_ptr<::gloo::transport::UnboundBuffer> fp_send_, fp_recv_;
  std::vector<std::byte> scratch_;  // reduce_scatter buffers; ops run one at a time
  std::atomic<std::uint64_t> groups_{0};
  std::uint64_t monitored_barriers_ = 0;  // only touched inside run_inline
  FlightRecorder recorder_;
  std::string dump_path_;  // COMM_FLIGHT_RECORDER
  std::atomic<bool> failure_to_dump_{false};
  std::mutex failure_mu_;
  std::optional<Failure> failure_;
  OpQueue queue_;  // last: destroyed (drained) first, while the contexts still exist
};

}  // namespace comm::detail::gloo
