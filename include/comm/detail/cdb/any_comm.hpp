#pragma once
// The one virtual layer under comm::AnyCommunicator (any_communicator.hpp): the erased call
// surface, and its model over a typed Communicator<B>. Where B's engine takes operation records
// (every EngineCore engine: Gloo, Shm, Mpi, Hierarchical), a call stays erased all the way down:
// the model runs the facade's checks (detail/facade/checks.hpp) on the erased arguments, builds
// one Op record and hands it to the engine. NCCL, and device buffers (Gloo stages them in its typed
// operations), take the typed path through Communicator<B>.

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <comm/communicator.hpp>
#include <comm/detail/cuda/driver.hpp>
#include <comm/detail/engine/forward.hpp>
#include <comm/detail/engine/op.hpp>
#include <comm/detail/facade/checks.hpp>
#include <comm/diagnostics.hpp>
#include <comm/types.hpp>
#include <comm/work.hpp>

namespace comm {

namespace detail {

/// A reduction after type erasure: a built-in op, or a pointer to a `std::function<T(T, T)>` for
/// the call's element type (alive for the duration of the call; the backend copies it).
struct ErasedOp {
  ReduceOp builtin = ReduceOp::sum;
  const void* custom = nullptr;
};

/// The one virtual layer under AnyCommunicator.
class AnyCommImpl {
 public:
  virtual ~AnyCommImpl() = default;
  [[nodiscard]] virtual int rank() const noexcept = 0;
  [[nodiscard]] virtual int size() const noexcept = 0;
  [[nodiscard]] virtual std::string_view backend_name() const noexcept = 0;
  [[nodiscard]] virtual const void* backend_type() const noexcept = 0;
  [[nodiscard]] virtual void* communicator() noexcept = 0;
  virtual Work all_reduce(Dtype, const void* in, std::size_t in_n, void* out, std::size_t out_n, const ErasedOp&,
                          bool async) = 0;
  virtual Work reduce_scatter(Dtype, const void* in, std::size_t in_n, void* out, std::size_t out_n,
                              const ErasedOp&, bool async) = 0;
  virtual Work all_gather(Dtype, const void* in, std::size_t in_n, void* out, std::size_t out_n, bool async) = 0;
  virtual Work broadcast(Dtype, void* data, std::size_t n, int root, bool async) = 0;
  virtual Work gather(Dtype, const void* in, std::size_t in_n, void* out, std::size_t out_n, int root,
                      bool async) = 0;
  virtual Work barrier(bool async) = 0;
  // The rest of the surface (capability 11): InvalidArgument where the backend lacks it.
  virtual Work reduce(Dtype, const void* in, std::size_t in_n, void* out, std::size_t out_n, int root,
                      const ErasedOp&, bool async) = 0;
  virtual Work scatter(Dtype, const void* in, std::size_t in_n, void* out, std::size_t out_n, int root,
                       bool async) = 0;
  virtual Work all_to_all(Dtype, const void* in, std::size_t in_n, void* out, std::size_t out_n, bool async) = 0;
  virtual Work all_to_all_v(Dtype, const void* in, std::size_t in_n, std::span<const std::size_t> in_counts, void* out,
                            std::size_t out_n, std::span<const std::size_t> out_counts, bool async) = 0;
  virtual Work send(Dtype, const void* data, std::size_t n, int peer, int tag, bool async) = 0;
  virtual Work recv(Dtype, void* data, std::size_t n, int peer, int tag, bool async) = 0;
  /// The entries' buffers as bytes pointers and element counts of type `Dtype`.
  virtual std::vector<Work> batch_isend_irecv(Dtype, std::span<const P2POp<std::byte>> ops) = 0;
  /// Subgroups: null for "no group" (negative color, not a member).
  [[nodiscard]] virtual std::unique_ptr<AnyCommImpl> split(int color, int key) = 0;
  [[nodiscard]] virtual std::unique_ptr<AnyCommImpl> new_group(std::span<const int> ranks) = 0;
  /// Fault tolerance (capability 12): the next communicator; InvalidArgument where the backend
  /// lacks it.
  [[nodiscard]] virtual std::unique_ptr<AnyCommImpl> shrink() = 0;
  [[nodiscard]] virtual std::unique_ptr<AnyCommImpl> grow() = 0;
  virtual void revoke(std::string_view reason) = 0;
  virtual void close_joins() = 0;
  /// timeout 0: the communicator's own.
  virtual void monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks) = 0;
  [[nodiscard]] virtual FlightRecord flight_record() const = 0;
  virtual void dump_flight_record(const std::string& path) const = 0;
};

/// A custom reduction of AnyCommunicator (a `std::function<T(T, T)>` of the call's element type)
/// as the engine core's erased record takes it: its applier, and a copy an async call keeps.
struct ErasedCustomFns {
  custom_reduce_fn apply = nullptr;
  std::shared_ptr<const void> (*hold)(const void* fn) = nullptr;
};
[[nodiscard]] inline const ErasedCustomFns& erased_custom(Dtype d) {
  constexpr std::size_t kDtypes = static_cast<std::size_t>(Dtype::float8_e5m2) + 1;
  static const std::array<ErasedCustomFns, kDtypes> table = [] {
    std::array<ErasedCustomFns, kDtypes> t{};
    for (std::size_t i = 0; i < kDtypes; ++i)
      visit_dtype(static_cast<Dtype>(i), [&]<class T>() {
        using F = std::function<T(T, T)>;
        t[i] = ErasedCustomFns{&apply_custom<T, F>, [](const void* fn) -> std::shared_ptr<const void> {
                                 return std::make_shared<const F>(*static_cast<const F*>(fn));
                               }};
      });
    return t;
  }();
  return table[static_cast<std::size_t>(d)];
}

template <class B>
inline constexpr char backend_type_id = 0;  // its address identifies B without RTTI

template <class B>
class AnyCommModel final : public AnyCommImpl {
 public:
  explicit AnyCommModel(Communicator<B>&& c) : c_(std::move(c)) {}

  int rank() const noexcept override { return c_.rank(); }
  int size() const noexcept override { return c_.size(); }
  std::string_view backend_name() const noexcept override { return B::name; }
  const void* backend_type() const noexcept override { return &backend_type_id<B>; }
  void* communicator() noexcept override { return &c_; }

  Work all_reduce(Dtype d, const void* in, std::size_t in_n, void* out, std::size_t out_n, const ErasedOp& op,
                  bool async) override {
    return symmetric_reduction<OpKind::all_reduce>(d, in, in_n, out, out_n, op, async);
  }

  Work reduce_scatter(Dtype d, const void* in, std::size_t in_n, void* out, std::size_t out_n, const ErasedOp& op,
                      bool async) override {
    return symmetric_reduction<OpKind::reduce_scatter>(d, in, in_n, out, out_n, op, async);
  }

  Work all_gather(Dtype d, const void* in, std::size_t in_n, void* out, std::size_t out_n, bool async) override {
    if constexpr (kErased) {
      if (host(in, out)) {
        checks(d, "all_gather").all_gather({in, in_n}, {out, out_n});
        Op o = erased_op(OpKind::all_gather, d, in, out, in_n, out_n);
        return launch(o, async);
      }
    }
    return typed(d, "all_gather", [&]<class T>() {
      return run_flag(async, [&](auto... t) {
        return c_.all_gather(std::span<const T>(static_cast<const T*>(in), in_n),
                             std::span<T>(static_cast<T*>(out), out_n), t...);
      });
    });
  }

  Work broadcast(Dtype d, void* data, std::size_t n, int root, bool async) override {
    if constexpr (kErased) {
      if (host(data)) {
        checks(d, "broadcast").root(root);
        Op o = erased_op(OpKind::broadcast, d, nullptr, data, 0, n, root);
        return launch(o, async);
      }
    }
    return typed(d, "broadcast", [&]<class T>() {
      return run_flag(async, [&](auto... t) { return c_.broadcast(std::span<T>(static_cast<T*>(data), n), root, t...); });
    });
  }

  Work gather(Dtype d, const void* in, std::size_t in_n, void* out, std::size_t out_n, int root, bool async) override {
    if constexpr (kErased) {
      if (host(in, out)) {
        checks(d, "gather").gather({in, in_n}, {out, out_n}, root);
        Op o = erased_op(OpKind::gather, d, in, out, in_n, out_n, root);
        return launch(o, async);
      }
    }
    return typed(d, "gather", [&]<class T>() {
      return run_flag(async, [&](auto... t) {
        return c_.gather(std::span<const T>(static_cast<const T*>(in), in_n), std::span<T>(static_cast<T*>(out), out_n),
                         root, t...);
      });
    });
  }

  Work barrier(bool async) override {
    return run_flag(async, [&](auto... t) { return c_.barrier(t...); });
  }

  Work reduce(Dtype d, const void* in, std::size_t in_n, void* out, std::size_t out_n, int root, const ErasedOp& op,
              bool async) override {
    if constexpr (kErased && supports_full_surface<B>) {
      if (host(in, out)) {
        const ArgChecks chk = checks(d, "reduce");
        check_custom(op, "reduce");
        chk.reduce({in, in_n}, {out, out_n}, root);
        Op o = erased_op(OpKind::reduce, d, in, out, in_n, out_n, root);
        set_erased_reduction(chk, o, d, op, async);
        return launch(o, async);
      }
    }
    if constexpr (supports_full_surface<B>) {
      return typed(d, "reduce", [&]<class T>() {
        return reduce(op, async, "reduce", [&](auto&& red, auto tag) {
          return run(tag, [&](auto... t) {
            return c_.reduce(std::span<const T>(static_cast<const T*>(in), in_n),
                             std::span<T>(static_cast<T*>(out), out_n), root, red, t...);
          });
        }, static_cast<T*>(nullptr));
      });
    } else {
      throw lacks("reduce", "reduce to a root");
    }
  }

  Work scatter(Dtype d, const void* in, std::size_t in_n, void* out, std::size_t out_n, int root, bool async) override {
    if constexpr (kErased && supports_full_surface<B>) {
      if (host(in, out)) {
        checks(d, "scatter").scatter({in, in_n}, {out, out_n}, root);
        Op o = erased_op(OpKind::scatter, d, in, out, in_n, out_n, root);
        return launch(o, async);
      }
    }
    if constexpr (supports_full_surface<B>) {
      return typed(d, "scatter", [&]<class T>() {
        return run_flag(async, [&](auto... t) {
          return c_.scatter(std::span<const T>(static_cast<const T*>(in), in_n),
                            std::span<T>(static_cast<T*>(out), out_n), root, t...);
        });
      });
    } else {
      throw lacks("scatter", "scatter");
    }
  }

  Work all_to_all(Dtype d, const void* in, std::size_t in_n, void* out, std::size_t out_n, bool async) override {
    if constexpr (kErased && supports_full_surface<B>) {
      if (host(in, out)) {
        checks(d, "all_to_all").all_to_all({in, in_n}, {out, out_n});
        Op o = erased_op(OpKind::all_to_all, d, in, out, in_n, out_n);
        return launch(o, async);
      }
    }
    if constexpr (supports_full_surface<B>) {
      return typed(d, "all_to_all", [&]<class T>() {
        return run_flag(async, [&](auto... t) {
          return c_.all_to_all(std::span<const T>(static_cast<const T*>(in), in_n),
                               std::span<T>(static_cast<T*>(out), out_n), t...);
        });
      });
    } else {
      throw lacks("all_to_all", "run all_to_all");
    }
  }

  Work all_to_all_v(Dtype d, const void* in, std::size_t in_n, std::span<const std::size_t> in_counts, void* out,
                    std::size_t out_n, std::span<const std::size_t> out_counts, bool async) override {
    if constexpr (kErased && supports_full_surface<B>) {
      if (host(in, out)) {
        checks(d, "all_to_all_v").all_to_all_v({in, in_n}, in_counts, {out, out_n}, out_counts);
        Op o = erased_op(OpKind::all_to_all_v, d, in, out, in_n, out_n);
        o.counts.assign(in_counts.begin(), in_counts.end());
        o.counts.insert(o.counts.end(), out_counts.begin(), out_counts.end());
        return launch(o, async);
      }
    }
    if constexpr (supports_full_surface<B>) {
      return typed(d, "all_to_all_v", [&]<class T>() {
        return run_flag(async, [&](auto... t) {
          return c_.all_to_all_v(std::span<const T>(static_cast<const T*>(in), in_n), in_counts,
                                 std::span<T>(static_cast<T*>(out), out_n), out_counts, t...);
        });
      });
    } else {
      throw lacks("all_to_all_v", "run all_to_all_v");
    }
  }

  Work send(Dtype d, const void* data, std::size_t n, int peer, int tag, bool async) override {
    if constexpr (kErased && supports_full_surface<B>) {
      if (host(data)) {
        checks(d, "send").peer(peer, tag);
        Op o = erased_op(OpKind::send, d, data, nullptr, n, 0, peer);
        o.p2p.push_back(P2PItem{true, const_cast<void*>(data), n, peer, tag});
        return launch(o, async);
      }
    }
    if constexpr (supports_full_surface<B>) {
      return typed(d, "send", [&]<class T>() {
        return run_flag(async, [&](auto... t) {
          return c_.send(std::span<const T>(static_cast<const T*>(data), n), peer, tag, t...);
        });
      });
    } else {
      throw lacks("send", "send");
    }
  }

  Work recv(Dtype d, void* data, std::size_t n, int peer, int tag, bool async) override {
    if constexpr (kErased && supports_full_surface<B>) {
      if (host(data)) {
        checks(d, "recv").peer(peer, tag);
        Op o = erased_op(OpKind::recv, d, nullptr, data, 0, n, peer);
        o.p2p.push_back(P2PItem{false, data, n, peer, tag});
        return launch(o, async);
      }
    }
    if constexpr (supports_full_surface<B>) {
      return typed(d, "recv", [&]<class T>() {
        return run_flag(async, [&](auto... t) { return c_.recv(std::span<T>(static_cast<T*>(data), n), peer, tag, t...); });
      });
    } else {
      throw lacks("recv", "receive");
    }
  }

  std::vector<Work> batch_isend_irecv(Dtype d, std::span<const P2POp<std::byte>> ops) override {
    if constexpr (supports_full_surface<B>) {
      return visit_dtype(d, [&]<class T>() -> std::vector<Work> {
        if constexpr (supports_element<B, T>) {
          std::vector<P2POp<T>> typed_ops;
          typed_ops.reserve(ops.size());
          for (const auto& o : ops)
            typed_ops.push_back(P2POp<T>{o.op, std::span<T>(reinterpret_cast<T*>(o.buffer.data()), o.buffer.size()),
                                         o.peer, o.tag});
          return c_.batch_isend_irecv(typed_ops);
        } else {
          throw InvalidArgument("batch_isend_irecv", c_.rank(),
                                "element type " + std::string(to_string(d)) + " is not supported by the " +
                                    std::string(B::name) + " backend");
        }
      });
    } else {
      throw lacks("batch_isend_irecv", "send or receive");
    }
  }

  std::unique_ptr<AnyCommImpl> split(int color, int key) override {
    if constexpr (supports_split<B>) {
      auto g = c_.split(color, key);
      return g ? std::make_unique<AnyCommModel<B>>(std::move(*g)) : nullptr;
    } else {
      throw lacks("split", "split communicators");
    }
  }

  std::unique_ptr<AnyCommImpl> new_group(std::span<const int> ranks) override {
    if constexpr (supports_new_group<B>) {
      auto g = c_.new_group(ranks);
      return g ? std::make_unique<AnyCommModel<B>>(std::move(*g)) : nullptr;
    } else {
      throw lacks("new_group", "make groups");
    }
  }

  std::unique_ptr<AnyCommImpl> shrink() override {
    if constexpr (supports_shrink<B>)
      return std::make_unique<AnyCommModel<B>>(c_.shrink());
    else
      throw lacks("shrink", "shrink communicators");
  }

  std::unique_ptr<AnyCommImpl> grow() override {
    if constexpr (supports_grow<B>)
      return std::make_unique<AnyCommModel<B>>(c_.grow());
    else
      throw lacks("grow", "grow communicators");
  }

  void revoke(std::string_view reason) override {
    if constexpr (supports_revoke<B>)
      c_.revoke(reason);
    else
      throw lacks("revoke", "revoke communicators");
  }

  void close_joins() override {
    if constexpr (supports_close_joins<B>)
      c_.close_joins();
    else
      throw lacks("close_joins", "grow communicators");
  }

  void monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks) override {
    if constexpr (supports_monitored_barrier<B>) {
      if (timeout.count() > 0)
        c_.monitored_barrier(timeout, wait_all_ranks);
      else
        c_.monitored_barrier();
    } else {
      throw lacks("monitored_barrier", "run a monitored_barrier");
    }
  }

  FlightRecord flight_record() const override {
    if constexpr (supports_flight_recorder<B>)
      return c_.flight_record();
    else
      throw lacks("flight_record", "record operations");
  }

  void dump_flight_record(const std::string& path) const override {
    if constexpr (supports_flight_recorder<B>)
      c_.dump_flight_record(path);
    else
      throw lacks("dump_flight_record", "record operations");
  }

 private:
  /// all_reduce or reduce_scatter (`K`): the erased path on host buffers, else the typed call.
  template <OpKind K>
  Work symmetric_reduction(Dtype d, const void* in, std::size_t in_n, void* out, std::size_t out_n,
                           const ErasedOp& op, bool async) {
    constexpr bool ar = K == OpKind::all_reduce;
    constexpr const char* name = ar ? "all_reduce" : "reduce_scatter";
    if constexpr (kErased) {
      if (host(in, out)) {
        const ArgChecks chk = checks(d, name);
        check_custom(op, name);
        Op o = erased_op(K, d, in, out, in_n, out_n);
        set_erased_reduction(chk, o, d, op, async);
        if constexpr (ar)
          chk.all_reduce({in, in_n}, {out, out_n});
        else
          chk.reduce_scatter({in, in_n}, {out, out_n});
        return launch(o, async);
      }
    }
    return typed(d, name, [&]<class T>() {
      return reduce(op, async, name, [&](auto&& red, auto tag) {
        return run(tag, [&](auto... t) {
          const std::span<const T> i(static_cast<const T*>(in), in_n);
          const std::span<T> o(static_cast<T*>(out), out_n);
          if constexpr (ar)
            return c_.all_reduce(i, o, red, t...);
          else
            return c_.reduce_scatter(i, o, red, t...);
        });
      }, static_cast<T*>(nullptr));
    });
  }

  // ---- the erased form: for backends whose engine takes Op records (not NCCL), a call is one
  // record, built here after the facade's checks (detail/facade/checks.hpp) and handed to the
  // engine's erased entry: no re-typing. Device buffers take the typed path (Gloo stages them). ----
  static constexpr bool kErased = erased_launch<B>;

  [[nodiscard]] static bool host(const void* a, const void* b = nullptr) {
    if (!cuda::driver_usable()) return true;
    return !cuda::is_device_pointer(a) && !cuda::is_device_pointer(b);
  }

  /// The checks of `name` on elements of `d`, after the element type's.
  [[nodiscard]] ArgChecks checks(Dtype d, const char* name) const {
    if (!B::supports_dtype(d))
      throw InvalidArgument(name, c_.rank(),
                            "element type " + std::string(to_string(d)) + " is not supported by the " +
                                std::string(B::name) + " backend");
    return ArgChecks{name, c_.rank(), c_.size(), size_of(d)};
  }

  /// A custom callable's support (after the element type's, before the rest, as in the typed path).
  void check_custom(const ErasedOp& r, const char* name) const {
    if (r.custom != nullptr && !supports_custom_reduction<B>)
      throw InvalidArgument(name, c_.rank(),
                            "the " + std::string(B::name) + " backend cannot run custom reduction callables");
  }
  /// Sets the reduction `r` on `op`: a built-in one (checked), or the user's callable, referred
  /// to where it lives: the caller's frame for a blocking call, a copy in `op.keep` for an async one.
  void set_erased_reduction(const ArgChecks& chk, Op& op, Dtype d, const ErasedOp& r, bool async) const {
    if (r.custom == nullptr) {
      chk.reduction(r.builtin, d, B::supports_reduction(r.builtin, d), B::name);
      return set_reduction(op, r.builtin);
    }
    const ErasedCustomFns& f = erased_custom(d);
    op.desc.reduce = OpDesc::custom;
    op.custom = f.apply;
    if (async) {
      op.keep = f.hold(r.custom);
      op.custom_arg = op.keep.get();
    } else {
      op.custom_arg = r.custom;
    }
  }

  template <class Policy = B>
    requires erased_launch<Policy>
  Work launch(Op& op, bool async) {
    if (async) return ErasedLaunch::launch(c_.backend(), op, comm::async);
    ErasedLaunch::launch(c_.backend(), op, blocking);
    return Work{};
  }

  // Runs `f` with or without the comm::async tag and always returns a Work (completed when blocking).
  template <class F>
  static Work run_flag(bool async, F&& f) {
    if (async) return f(comm::async);
    f();
    return Work{};
  }
  template <class F>
  static Work run(async_t, F&& f) { return f(comm::async); }
  template <class F>
  static Work run(blocking_t, F&& f) {
    f();
    return Work{};
  }

  [[nodiscard]] InvalidArgument lacks(const char* op, const char* what) const {
    return InvalidArgument(op, c_.rank(), "the " + std::string(B::name) + " backend cannot " + what);
  }

  template <class F>
  Work typed(Dtype d, const char* name, F&& f) {
    return visit_dtype(d, [&]<class T>() -> Work {
      if constexpr (supports_element<B, T>) {
        return f.template operator()<T>();
      } else {
        throw InvalidArgument(name, c_.rank(),
                              "element type " + std::string(to_string(d)) + " is not supported by the " +
                                  std::string(B::name) + " backend");
      }
    });
  }

  // Turns the erased op into what Communicator<B> takes: a ReduceOp value (checked at run time by
  // the facade) or the user's typed callable.
  template <class T, class F>
  Work reduce(const ErasedOp& op, bool async, const char* name, F&& f, T*) {
    if (op.custom == nullptr) {
      return async ? f(op.builtin, comm::async) : f(op.builtin, blocking);
    }
    if constexpr (supports_custom_reduction<B>) {
      const auto& fn = *static_cast<const std::function<T(T, T)>*>(op.custom);
      return async ? f(fn, comm::async) : f(fn, blocking);
    } else {
      throw InvalidArgument(name, c_.rank(),
                            "the " + std::string(B::name) + " backend cannot run custom reduction callables");
    }
  }

  Communicator<B> c_;
};

}  // namespace detail

}  // namespace comm
