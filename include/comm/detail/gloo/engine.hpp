#pragma once
// The Gloo engine behind comm::backends::Gloo: the connected gloo contexts (one per network
// device), the op queue, and the collectives themselves.

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

#include <comm/concepts.hpp>
#include <comm/detail/gloo/device.hpp>
#include <comm/detail/gloo/errors.hpp>
#include <comm/detail/gloo/op_queue.hpp>
#include <comm/detail/gloo/reduce_scatter.hpp>
#include <comm/detail/gloo/store_adapter.hpp>
#include <comm/detail/reduce.hpp>
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

class Engine {
  /// Tag of the barrier that ends connection; operation tags count up from 0 and reach it only
  /// after 2^32 - 1 operations, long after that barrier completed.
  static constexpr std::uint32_t kConnectTag = 0xffffffffu;

 public:
  /// Connects `size` ranks through `store`: one gloo context per device (see device.hpp).
  Engine(const std::shared_ptr<comm::Store>& store, int rank, int size, std::chrono::milliseconds timeout,
         const std::vector<std::string>& interfaces, const std::string& hostname)
      : rank_(rank), size_(size), timeout_(timeout) {
    const auto specs = device_specs(interfaces, hostname);
    // Each rank counts its own communicators on this store; ranks that create communicators in
    // the same order get the same number, hence the same key prefix.
    const auto seq = store->add("comm/gloo/seq/" + std::to_string(rank), 1);
    for (std::size_t i = 0; i < specs.size(); ++i) {
      auto dev = shared_device(specs[i], rank);
      auto ctx = std::make_shared<::gloo::rendezvous::Context>(rank, size);
      ctx->setTimeout(timeout);
      StoreAdapter adapter(store, "comm/gloo/" + std::to_string(seq) + "/" + std::to_string(i) + "/", timeout);
      try {
        ctx->connectFullMesh(adapter, dev);
        // Once every rank has passed this barrier, every rank has finished reading the store, so
        // the store (e.g. rank 0's TcpStore server from env://) may go away right after create().
        ::gloo::BarrierOptions b(ctx);
        b.setTag(kConnectTag);
        b.setTimeout(timeout);
        ::gloo::barrier(b);
      } catch (...) {
        rethrow_translated("gloo.connect", rank);
      }
      contexts_.push_back(std::move(ctx));
    }
  }

  /// Uses an already connected context.
  Engine(std::shared_ptr<::gloo::Context> ctx, std::chrono::milliseconds timeout)
      : rank_(ctx->rank), size_(ctx->size), timeout_(timeout) {
    contexts_.push_back(std::move(ctx));
  }

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  ~Engine() { queue_.shutdown(); }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  [[nodiscard]] const std::shared_ptr<::gloo::Context>& context(std::size_t i = 0) const { return contexts_.at(i); }
  [[nodiscard]] std::size_t num_contexts() const noexcept { return contexts_.size(); }

  // ---- launch: blocking runs inline (after queued work), async queues and returns Work ----

  template <class F>
  void launch(const char* /*op*/, blocking_t, F&& f) {
    queue_.run_inline(std::forward<F>(f));
  }

  template <class F>
  Work launch(const char* op, async_t, F&& f) {
    auto state = std::make_shared<WorkState>(op, rank_, timeout_);
    queue_.submit(std::forward<F>(f), state);
    return Work(std::move(state));
  }

  // ---- collectives (arguments were validated by the facade) ----

  template <class T, class Red, class Launch>
  auto all_reduce(std::span<const T> in, std::span<T> out, Red red, Launch l) {
    return launch("all_reduce", l, [this, in, out, red = std::move(red)](std::uint32_t tag) {
      run("all_reduce", tag, [&](const std::shared_ptr<::gloo::Context>& ctx) {
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
    });
  }

  template <class T, class Red, class Launch>
  auto reduce_scatter(std::span<const T> in, std::span<T> out, Red red, Launch l) {
    return launch("reduce_scatter", l, [this, in, out, red = std::move(red)](std::uint32_t tag) {
      run("reduce_scatter", tag, [&](const std::shared_ptr<::gloo::Context>& ctx) {
        if (out.empty()) return;
        ring_reduce_scatter(ctx, tag, timeout_, in.data(), out.data(), out.size(), sizeof(T), reduce_func<T>(red),
                            scratch_);
        if (is_avg(red)) finish_avg<T>(out.data(), out.size(), size_);
      });
    });
  }

  template <class T, class Launch>
  auto all_gather(std::span<const T> in, std::span<T> out, Launch l) {
    return launch("all_gather", l, [this, in, out](std::uint32_t tag) {
      run("all_gather", tag, [&](const std::shared_ptr<::gloo::Context>& ctx) {
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
    });
  }

  template <class T, class Launch>
  auto broadcast(std::span<T> data, int root, Launch l) {
    return launch("broadcast", l, [this, data, root](std::uint32_t tag) {
      run("broadcast", tag, [&](const std::shared_ptr<::gloo::Context>& ctx) {
        if (data.empty()) return;
        ::gloo::BroadcastOptions o(ctx);
        o.setOutput(data.data(), data.size());
        o.setRoot(root);
        o.setTag(tag);
        o.setTimeout(timeout_);
        ::gloo::broadcast(o);
      });
    });
  }

  template <class T, class Launch>
  auto gather(std::span<const T> in, std::span<T> out, int root, Launch l) {
    return launch("gather", l, [this, in, out, root](std::uint32_t tag) {
      run("gather", tag, [&](const std::shared_ptr<::gloo::Context>& ctx) {
        if (in.empty()) return;
        ::gloo::GatherOptions o(ctx);
        o.setInput(const_cast<T*>(in.data()), in.size());
        if (rank_ == root) o.setOutput(out.data(), out.size());
        o.setRoot(root);
        o.setTag(tag);
        o.setTimeout(timeout_);
        ::gloo::gather(o);
      });
    });
  }

  template <class Launch>
  auto barrier(Launch l) {
    return launch("barrier", l, [this](std::uint32_t tag) {
      run("barrier", tag, [&](const std::shared_ptr<::gloo::Context>& ctx) {
        ::gloo::BarrierOptions o(ctx);
        o.setTag(tag);
        o.setTimeout(timeout_);
        ::gloo::barrier(o);
      });
    });
  }

 private:
  /// Runs one operation on the context its tag selects (round-robin over devices), turning
  /// gloo's exceptions into comm errors. After a failure the gloo context is unusable (gloo closes
  /// its connections on error), so every later operation fails at once with the first cause.
  template <class F>
  void run(const char* op, std::uint32_t tag, F&& f) {
    {
      std::lock_guard lock(failure_mu_);
      if (failure_)
        throw_as(failure_->kind, op, rank_,
                 "the communicator is unusable after an earlier failure: " + failure_->what, failure_->peer);
    }
    try {
      std::forward<F>(f)(contexts_[tag % contexts_.size()]);
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
        if (first) close_connections();
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
  std::vector<std::shared_ptr<::gloo::Context>> contexts_;
  std::vector<std::byte> scratch_;  // reduce_scatter buffers; ops run one at a time
  std::mutex failure_mu_;
  std::optional<Failure> failure_;
  OpQueue queue_;  // last: destroyed (drained) first, while the contexts still exist
};

}  // namespace comm::detail::gloo
