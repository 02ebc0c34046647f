#pragma once
/// \file
/// cdb, the DeepSpeed-style selector: one call that gives a program its world communicator however
/// it was launched, and `AnyCommunicator`, a communicator whose backend is chosen at run time.
///
/// ```cpp
/// comm::AnyCommunicator& w = comm::init_distributed();   // comm-run, torchrun, mpirun or srun
/// w.all_reduce(std::span<float>(grad), comm::ReduceOp::avg);
/// ```
///
/// `init_distributed(options)` follows deepspeed.comm.init_distributed:
/// 1. a world already exists (from an earlier call or `set_world`) → it is returned; options that
///    conflict with it (another backend, rank or world size) throw comm::InvalidArgument;
/// 2. `init_method` "tcp://host:port" or "file:///path" → that rendezvous with the given rank and
///    world_size;
/// 3. else the launcher variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
///    MASTER_PORT) when RANK is set;
/// 4. else, with `auto_mpi_discovery`, OpenMPI (OMPI_COMM_WORLD_*), MPICH/Intel MPI (PMI_RANK,
///    PMI_SIZE, MPI_LOCALRANKID), PMIx (PMIX_RANK) and SLURM (SLURM_PROCID, SLURM_NTASKS,
///    SLURM_LOCALID, master = first host of SLURM_JOB_NODELIST) variables. No MPI library is used.
///    MASTER_PORT defaults to 29500. Where no master address can be derived the error says to set
///    MASTER_ADDR. Discovered values are exported as RANK, WORLD_SIZE, LOCAL_RANK,
///    LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT when those are unset.
/// Backend "auto" picks NCCL where comm::nccl is compiled in and a CUDA device is usable, else Shm
/// when every rank is on this host (host identities compared through the store; see
/// backends/shm.hpp), else Hierarchical<Shm, Gloo>, and says which at COMM_DEBUG=INFO. "shm" names Shm. `describe_environment()` says where each value came from.
/// With comm::mpi linked, "mpi" names Mpi: MPI_COMM_WORLD adopted when MPI is initialized, else
/// steps 2-4 and MPI initialized by comm; "auto" picks it (after NCCL) when the application
/// initialized MPI under an MPI launcher.
/// "hierarchical" names Hierarchical<Shm, Gloo> (backends/hierarchical.hpp), which "auto" picks for
/// a CPU job whose ranks span several hosts (Shm within each host, Gloo across).
///
/// AnyCommunicator has the typed API of Communicator<B>: element types are checked at compile time;
/// the backend's capabilities (reductions per type, custom callables) at run time, with a clear
/// comm::InvalidArgument. Each call costs one virtual dispatch. Subgroups (`split`, `new_group`)
/// are AnyCommunicators of the same backend; `monitored_barrier`, `flight_record` and
/// `dump_flight_record` forward to the backend (comm::InvalidArgument where it lacks them).

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <comm/communicator.hpp>
#include <comm/detail/discovery.hpp>
#include <comm/detail/host.hpp>
#include <comm/detail/logging.hpp>
#include <comm/diagnostics.hpp>
#include <comm/init.hpp>
#include <comm/types.hpp>
#include <comm/work.hpp>

#include <comm/backends/shm.hpp>
#if defined(COMM_HAS_GLOO)
#include <comm/backends/gloo.hpp>
#include <comm/backends/hierarchical.hpp>
#endif
#if defined(COMM_HAS_NCCL)
#include <cuda_runtime_api.h>

#include <comm/backends/nccl.hpp>
#endif
#if defined(COMM_HAS_MPI)
#include <comm/backends/mpi.hpp>
#endif

namespace comm {

/// Options of init_distributed. -1 and empty values mean "from the environment".
struct InitOptions {
  std::string backend = "auto";          ///< "auto" | "gloo" | "nccl" | "shm" | "mpi" | "hierarchical"
  std::string init_method = "env://";    ///< "env://" | "tcp://host:port" | "file:///path"
  int rank = -1;
  int world_size = -1;
  std::chrono::milliseconds timeout{0};  ///< 0: COMM_TIMEOUT, else 30 minutes
  bool auto_mpi_discovery = true;
};

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
  /// timeout 0: the communicator's own.
  virtual void monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks) = 0;
  [[nodiscard]] virtual FlightRecord flight_record() const = 0;
  virtual void dump_flight_record(const std::string& path) const = 0;
};

/// Calls `f.template operator()<T>()` with T the element type named by `d`.
template <class F>
decltype(auto) visit_dtype(Dtype d, F&& f) {
  switch (d) {
    case Dtype::int8: return f.template operator()<std::int8_t>();
    case Dtype::uint8: return f.template operator()<std::uint8_t>();
    case Dtype::int32: return f.template operator()<std::int32_t>();
    case Dtype::uint32: return f.template operator()<std::uint32_t>();
    case Dtype::int64: return f.template operator()<std::int64_t>();
    case Dtype::uint64: return f.template operator()<std::uint64_t>();
    case Dtype::float16: return f.template operator()<half>();
    case Dtype::bfloat16: return f.template operator()<bfloat16>();
    case Dtype::float32: return f.template operator()<float>();
    case Dtype::float64: return f.template operator()<double>();
    case Dtype::float8_e4m3: return f.template operator()<float8_e4m3>();
    case Dtype::float8_e5m2: return f.template operator()<float8_e5m2>();
  }
  throw InvalidArgument("dispatch", -1, "unknown element type " + std::to_string(static_cast<int>(d)));
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
    return typed(d, "all_reduce", [&]<class T>() {
      return reduce(op, async, "all_reduce", [&](auto&& red, auto tag) {
        return run(tag, [&](auto... t) {
          return c_.all_reduce(std::span<const T>(static_cast<const T*>(in), in_n),
                               std::span<T>(static_cast<T*>(out), out_n), red, t...);
        });
      }, static_cast<T*>(nullptr));
    });
  }

  Work reduce_scatter(Dtype d, const void* in, std::size_t in_n, void* out, std::size_t out_n, const ErasedOp& op,
                      bool async) override {
    return typed(d, "reduce_scatter", [&]<class T>() {
      return reduce(op, async, "reduce_scatter", [&](auto&& red, auto tag) {
        return run(tag, [&](auto... t) {
          return c_.reduce_scatter(std::span<const T>(static_cast<const T*>(in), in_n),
                                   std::span<T>(static_cast<T*>(out), out_n), red, t...);
        });
      }, static_cast<T*>(nullptr));
    });
  }

  Work all_gather(Dtype d, const void* in, std::size_t in_n, void* out, std::size_t out_n, bool async) override {
    return typed(d, "all_gather", [&]<class T>() {
      return run_flag(async, [&](auto... t) {
        return c_.all_gather(std::span<const T>(static_cast<const T*>(in), in_n),
                             std::span<T>(static_cast<T*>(out), out_n), t...);
      });
    });
  }

  Work broadcast(Dtype d, void* data, std::size_t n, int root, bool async) override {
    return typed(d, "broadcast", [&]<class T>() {
      return run_flag(async, [&](auto... t) { return c_.broadcast(std::span<T>(static_cast<T*>(data), n), root, t...); });
    });
  }

  Work gather(Dtype d, const void* in, std::size_t in_n, void* out, std::size_t out_n, int root, bool async) override {
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

/// A communicator whose backend is chosen at run time (see the file comment). Move-only.
class AnyCommunicator {
 public:
  template <comm::backend B>
  explicit AnyCommunicator(Communicator<B>&& c)
      : impl_(std::make_unique<detail::AnyCommModel<B>>(std::move(c))) {}

  [[nodiscard]] int rank() const noexcept { return impl_->rank(); }
  [[nodiscard]] int size() const noexcept { return impl_->size(); }
  /// "gloo" or "nccl".
  [[nodiscard]] std::string_view backend() const noexcept { return impl_->backend_name(); }

  /// The typed communicator underneath when its backend is `B`, else nullptr.
  template <comm::backend B>
  [[nodiscard]] Communicator<B>* get_if() noexcept {
    return impl_->backend_type() == &detail::backend_type_id<B> ? static_cast<Communicator<B>*>(impl_->communicator())
                                                                : nullptr;
  }

  template <class Data, class... A>
    requires detail::any_buffer<Data> && detail::reduce_tail<A...>
  detail::reduce_result_t<A...> all_reduce(Data&& data, A&&... a) {
    using T = detail::element_value_t<Data>;
    check_output<Data>();
    auto s = detail::as_span(data);
    return reduce_call(detail::reduction_kind::all_reduce, std::span<const T>(s), s, std::forward<A>(a)...);
  }
  template <class In, class Out, class... A>
    requires detail::any_buffer<In> && detail::any_buffer<Out> && detail::reduce_tail<A...>
  detail::reduce_result_t<A...> all_reduce(In&& in, Out&& out, A&&... a) {
    check_output<Out>();
    using T = detail::element_value_t<Out>;
    return reduce_call(detail::reduction_kind::all_reduce, std::span<const T>(detail::as_span(in)),
                       detail::as_span(out), std::forward<A>(a)...);
  }
  template <class In, class Out, class... A>
    requires detail::any_buffer<In> && detail::any_buffer<Out> && detail::reduce_tail<A...>
  detail::reduce_result_t<A...> reduce_scatter(In&& in, Out&& out, A&&... a) {
    check_output<Out>();
    using T = detail::element_value_t<Out>;
    return reduce_call(detail::reduction_kind::reduce_scatter, std::span<const T>(detail::as_span(in)),
                       detail::as_span(out), std::forward<A>(a)...);
  }

  template <class In, class Out>
    requires detail::any_buffer<In> && detail::any_buffer<Out>
  void all_gather(In&& in, Out&& out) {
    (void)all_gather_call(in, out, false);
  }
  template <class In, class Out>
    requires detail::any_buffer<In> && detail::any_buffer<Out>
  Work all_gather(In&& in, Out&& out, async_t) {
    return all_gather_call(in, out, true);
  }
  template <class Data>
    requires detail::any_buffer<Data>
  void broadcast(Data&& data, int root) {
    (void)broadcast_call(data, root, false);
  }
  template <class Data>
    requires detail::any_buffer<Data>
  Work broadcast(Data&& data, int root, async_t) {
    return broadcast_call(data, root, true);
  }
  template <class In, class Out>
    requires detail::any_buffer<In> && detail::any_buffer<Out>
  void gather(In&& in, Out&& out, int root) {
    (void)gather_call(in, out, root, false);
  }
  template <class In, class Out>
    requires detail::any_buffer<In> && detail::any_buffer<Out>
  Work gather(In&& in, Out&& out, int root, async_t) {
    return gather_call(in, out, root, true);
  }
  void barrier() { (void)impl_->barrier(false); }
  Work barrier(async_t) { return impl_->barrier(true); }

  /// See Communicator::reduce (out of place; `(data, root, ...)` in place). premul_sum is not
  /// offered here: use the typed Communicator (get_if).
  template <class In, class Out, class... A>
    requires detail::any_buffer<In> && detail::any_buffer<Out> && detail::reduce_tail<A...>
  detail::reduce_result_t<A...> reduce(In&& in, Out&& out, int root, A&&... a) {
    check_output<Out>();
    using T = detail::element_value_t<Out>;
    return reduce_root_call(std::span<const T>(detail::as_span(in)), detail::as_span(out), root, std::forward<A>(a)...);
  }
  template <class Data, class... A>
    requires detail::any_buffer<Data> && detail::reduce_tail<A...>
  detail::reduce_result_t<A...> reduce(Data&& data, int root, A&&... a) {
    check_output<Data>();
    using T = detail::element_value_t<Data>;
    std::span<T> s = detail::as_span(data);
    return reduce_root_call(std::span<const T>(s), s, root, std::forward<A>(a)...);
  }
  /// See Communicator::scatter.
  template <class In, class Out>
    requires detail::any_buffer<In> && detail::any_buffer<Out>
  void scatter(In&& in, Out&& out, int root) {
    (void)two_buffer_call(in, out, [&](Dtype d, auto* i, std::size_t ni, auto* o, std::size_t no) {
      return impl_->scatter(d, i, ni, o, no, root, false);
    });
  }
  template <class In, class Out>
    requires detail::any_buffer<In> && detail::any_buffer<Out>
  Work scatter(In&& in, Out&& out, int root, async_t) {
    return two_buffer_call(in, out, [&](Dtype d, auto* i, std::size_t ni, auto* o, std::size_t no) {
      return impl_->scatter(d, i, ni, o, no, root, true);
    });
  }
  /// See Communicator::all_to_all.
  template <class In, class Out>
    requires detail::any_buffer<In> && detail::any_buffer<Out>
  void all_to_all(In&& in, Out&& out) {
    (void)two_buffer_call(in, out, [&](Dtype d, auto* i, std::size_t ni, auto* o, std::size_t no) {
      return impl_->all_to_all(d, i, ni, o, no, false);
    });
  }
  template <class In, class Out>
    requires detail::any_buffer<In> && detail::any_buffer<Out>
  Work all_to_all(In&& in, Out&& out, async_t) {
    return two_buffer_call(in, out, [&](Dtype d, auto* i, std::size_t ni, auto* o, std::size_t no) {
      return impl_->all_to_all(d, i, ni, o, no, true);
    });
  }
  /// See Communicator::all_to_all_v.
  template <class In, class Out>
    requires detail::any_buffer<In> && detail::any_buffer<Out>
  void all_to_all_v(In&& in, std::span<const std::size_t> in_counts, Out&& out, std::span<const std::size_t> out_counts) {
    (void)two_buffer_call(in, out, [&](Dtype d, auto* i, std::size_t ni, auto* o, std::size_t no) {
      return impl_->all_to_all_v(d, i, ni, in_counts, o, no, out_counts, false);
    });
  }
  template <class In, class Out>
    requires detail::any_buffer<In> && detail::any_buffer<Out>
  Work all_to_all_v(In&& in, std::span<const std::size_t> in_counts, Out&& out, std::span<const std::size_t> out_counts,
                    async_t) {
    return two_buffer_call(in, out, [&](Dtype d, auto* i, std::size_t ni, auto* o, std::size_t no) {
      return impl_->all_to_all_v(d, i, ni, in_counts, o, no, out_counts, true);
    });
  }
  /// See Communicator::send / recv.
  template <class Data>
    requires detail::any_buffer<Data>
  void send(Data&& data, int peer, int tag = 0) {
    (void)send_call(data, peer, tag, false);
  }
  template <class Data>
    requires detail::any_buffer<Data>
  Work send(Data&& data, int peer, int tag, async_t) {
    return send_call(data, peer, tag, true);
  }
  template <class Data>
    requires detail::any_buffer<Data>
  void recv(Data&& data, int peer, int tag = 0) {
    (void)recv_call(data, peer, tag, false);
  }
  template <class Data>
    requires detail::any_buffer<Data>
  Work recv(Data&& data, int peer, int tag, async_t) {
    return recv_call(data, peer, tag, true);
  }
  /// See Communicator::batch_isend_irecv.
  template <class T>
  std::vector<Work> batch_isend_irecv(std::span<const P2POp<T>> ops) {
    static_assert(sizeof(detail::checked_element_t<T>) != 0);  // the element message first
    std::vector<P2POp<std::byte>> erased;
    erased.reserve(ops.size());
    for (const auto& o : ops)
      erased.push_back(P2POp<std::byte>{o.op, std::span<std::byte>(reinterpret_cast<std::byte*>(o.buffer.data()),
                                                                   o.buffer.size()),
                                        o.peer, o.tag});
    return impl_->batch_isend_irecv(dtype_of<T>, erased);
  }
  template <class T>
  std::vector<Work> batch_isend_irecv(const std::vector<P2POp<T>>& ops) {
    return batch_isend_irecv(std::span<const P2POp<T>>(ops));
  }
  template <class T>
  std::vector<Work> batch_isend_irecv(std::initializer_list<P2POp<T>> ops) {
    return batch_isend_irecv(std::span<const P2POp<T>>(ops.begin(), ops.size()));
  }

  /// See Communicator::split: a collective; nullopt for a negative color.
  [[nodiscard]] std::optional<AnyCommunicator> split(int color, int key) { return wrap(impl_->split(color, key)); }
  [[nodiscard]] std::optional<AnyCommunicator> split(int color) { return split(color, rank()); }
  /// See Communicator::new_group: non-members get nullopt at once.
  [[nodiscard]] std::optional<AnyCommunicator> new_group(std::span<const int> ranks) {
    return wrap(impl_->new_group(ranks));
  }
  [[nodiscard]] std::optional<AnyCommunicator> new_group(std::initializer_list<int> ranks) {
    return new_group(std::span<const int>(ranks.begin(), ranks.size()));
  }
  /// See Communicator::monitored_barrier.
  void monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks = false) {
    if (timeout.count() <= 0)
      throw InvalidArgument("monitored_barrier", rank(),
                            "timeout " + std::to_string(timeout.count()) + " ms must be positive");
    impl_->monitored_barrier(timeout, wait_all_ranks);
  }
  void monitored_barrier() { impl_->monitored_barrier(std::chrono::milliseconds{0}, false); }
  /// See Communicator::flight_record / dump_flight_record.
  [[nodiscard]] FlightRecord flight_record() const { return impl_->flight_record(); }
  void dump_flight_record(const std::string& path) const { impl_->dump_flight_record(path); }

 private:
  explicit AnyCommunicator(std::unique_ptr<detail::AnyCommImpl> impl) noexcept : impl_(std::move(impl)) {}
  static std::optional<AnyCommunicator> wrap(std::unique_ptr<detail::AnyCommImpl> impl) {
    if (!impl) return std::nullopt;
    return AnyCommunicator(std::move(impl));
  }

  template <class Out>
  static constexpr void check_output() {
    static_assert(detail::is_mutable_buffer_v<Out>,
                  "comm: an output buffer must be mutable (std::span<T>, not std::span<const T> or a const container)");
  }
  template <class T>
  static constexpr void check_element() {
    static_assert(sizeof(detail::checked_element_t<T>) != 0);  // types.hpp's one message
  }

  template <class T, class Op>
  static detail::ErasedOp erase_op(const Op& o, std::optional<std::function<T(T, T)>>& holder) {
    using O = std::remove_cvref_t<Op>;
    if constexpr (std::is_same_v<O, ReduceOp>) {
      return {o, nullptr};
    } else if constexpr (builtin_reduction<O>) {
      constexpr ReduceOp r = reduce_op_of<O>;
      static_assert(!is_bitwise(r) || integral_element<T>,
                    "comm: bitwise reductions (band/bor/bxor) need an integer element type");
      return {r, nullptr};
    } else {
      static_assert(custom_reduction<O, T>,
                    "comm: a reduction must be a comm::ReduceOp, a comm::op::* object, std::plus<> and friends, or a "
                    "callable T(T, T) for the buffer's element type T");
      holder.emplace(o);
      return {ReduceOp::sum, &*holder};
    }
  }

  template <class T, class... A>
  detail::reduce_result_t<A...> reduce_call(detail::reduction_kind kind, std::span<const T> in, std::span<T> out,
                                            A&&... a) {
    check_element<T>();
    constexpr bool is_async = detail::reduce_tail_traits<A...>::is_async;
    std::optional<std::function<T(T, T)>> holder;
    detail::ErasedOp op;
    if constexpr (sizeof...(A) == 2 || (sizeof...(A) == 1 && !is_async)) {
      op = erase_op<T>(std::get<0>(std::forward_as_tuple(a...)), holder);
    }
    Work w = kind == detail::reduction_kind::all_reduce
                 ? impl_->all_reduce(dtype_of<T>, in.data(), in.size(), out.data(), out.size(), op, is_async)
                 : impl_->reduce_scatter(dtype_of<T>, in.data(), in.size(), out.data(), out.size(), op, is_async);
    if constexpr (is_async) return w;
  }

  template <class T, class... A>
  detail::reduce_result_t<A...> reduce_root_call(std::span<const T> in, std::span<T> out, int root, A&&... a) {
    check_element<T>();
    constexpr bool is_async = detail::reduce_tail_traits<A...>::is_async;
    std::optional<std::function<T(T, T)>> holder;
    detail::ErasedOp op;
    if constexpr (sizeof...(A) == 2 || (sizeof...(A) == 1 && !is_async)) {
      op = erase_op<T>(std::get<0>(std::forward_as_tuple(a...)), holder);
    }
    Work w = impl_->reduce(dtype_of<T>, in.data(), in.size(), out.data(), out.size(), root, op, is_async);
    if constexpr (is_async) return w;
  }

  template <class In, class Out, class F>
  Work two_buffer_call(In& in_r, Out& out_r, F&& f) {
    check_output<Out>();
    using T = detail::element_value_t<Out>;
    check_element<T>();
    static_assert(std::is_same_v<detail::element_value_t<In>, T>, "comm: input and output buffers must have the same element type");
    std::span<const T> in = detail::as_span(in_r);
    std::span<T> out = detail::as_span(out_r);
    return f(dtype_of<T>, static_cast<const void*>(in.data()), in.size(), static_cast<void*>(out.data()), out.size());
  }
  template <class Data>
  Work send_call(Data& d, int peer, int tag, bool async) {
    using T = detail::element_value_t<Data>;
    check_element<T>();
    std::span<const T> s = detail::as_span(d);
    return impl_->send(dtype_of<T>, s.data(), s.size(), peer, tag, async);
  }
  template <class Data>
  Work recv_call(Data& d, int peer, int tag, bool async) {
    check_output<Data>();
    using T = detail::element_value_t<Data>;
    check_element<T>();
    std::span<T> s = detail::as_span(d);
    return impl_->recv(dtype_of<T>, s.data(), s.size(), peer, tag, async);
  }

  template <class In, class Out>
  Work all_gather_call(In& in_r, Out& out_r, bool async) {
    check_output<Out>();
    using T = detail::element_value_t<Out>;
    check_element<T>();
    std::span<const T> in = detail::as_span(in_r);
    std::span<T> out = detail::as_span(out_r);
    return impl_->all_gather(dtype_of<T>, in.data(), in.size(), out.data(), out.size(), async);
  }
  template <class Data>
  Work broadcast_call(Data& d, int root, bool async) {
    check_output<Data>();
    using T = detail::element_value_t<Data>;
    check_element<T>();
    std::span<T> s = detail::as_span(d);
    return impl_->broadcast(dtype_of<T>, s.data(), s.size(), root, async);
  }
  template <class In, class Out>
  Work gather_call(In& in_r, Out& out_r, int root, bool async) {
    check_output<Out>();
    using T = detail::element_value_t<Out>;
    check_element<T>();
    std::span<const T> in = detail::as_span(in_r);
    std::span<T> out = detail::as_span(out_r);
    return impl_->gather(dtype_of<T>, in.data(), in.size(), out.data(), out.size(), root, async);
  }

  std::unique_ptr<detail::AnyCommImpl> impl_;
};

namespace detail {

struct WorldState {
  std::mutex mu;
  std::unique_ptr<AnyCommunicator> world;
};

inline WorldState& world_state() {
  static WorldState s;
  return s;
}

/// Whether a CUDA device is usable here; `why` says why not.
[[nodiscard]] inline bool cuda_usable([[maybe_unused]] std::string& why) {
#if defined(COMM_HAS_NCCL)
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    why = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(e);
    return false;
  }
  if (n == 0) {
    why = "no CUDA device";
    return false;
  }
  return true;
#else
  why = "comm was built without NCCL";
  return false;
#endif
}

inline void export_env(const char* name, const std::string& value) {
  ::setenv(name, value.c_str(), 0);  // the launcher's own values win
}

/// Rendezvous for init_distributed: steps 2-4 of the file comment.
[[nodiscard]] inline InitResult rendezvous_for(const InitOptions& o, std::chrono::milliseconds timeout) {
  if (!o.init_method.empty() && o.init_method != "env://") return init_method(o.init_method, o.rank, o.world_size, timeout);
  if (!getenv_str("RANK") && !o.auto_mpi_discovery)
    throw InvalidArgument("init_distributed", o.rank,
                          "RANK is not set and auto_mpi_discovery is off: launch with comm-run or set RANK, "
                          "WORLD_SIZE, MASTER_ADDR and MASTER_PORT");
  const Discovery d = discover_environment();
  log(LogLevel::info, describe(d));
  if (o.rank >= 0 && o.rank != d.rank.value)
    throw InvalidArgument("init_distributed", d.rank.value,
                          "rank " + std::to_string(o.rank) + " conflicts with " + d.rank.from + "=" +
                              std::to_string(d.rank.value));
  if (o.world_size >= 0 && o.world_size != d.size.value)
    throw InvalidArgument("init_distributed", d.rank.value,
                          "world_size " + std::to_string(o.world_size) + " conflicts with " + d.size.from + "=" +
                              std::to_string(d.size.value));
  export_env("RANK", std::to_string(d.rank.value));
  export_env("WORLD_SIZE", std::to_string(d.size.value));
  if (d.local_rank.known()) export_env("LOCAL_RANK", std::to_string(d.local_rank.value));
  if (d.local_size.known()) export_env("LOCAL_WORLD_SIZE", std::to_string(d.local_size.value));
  export_env("MASTER_ADDR", d.master_addr);
  export_env("MASTER_PORT", std::to_string(d.master_port));
  InitResult r;
  r.rank = d.rank.value;
  r.size = d.size.value;
  r.local_rank = d.local_rank.value;
  r.local_size = d.local_size.value;
  r.master_addr = d.master_addr;
  r.master_port = d.master_port;
  r.store = connect_tcp_store(d.master_addr, d.master_port, r.rank, timeout);
  return r;
}

/// Whether every rank of the store's world runs on this host (Shm's identity: boot id and
/// namespaces). Collective over the store: every rank publishes its identity and reads the others'.
[[nodiscard]] inline bool all_on_one_host(Store& store, int rank, int size, std::chrono::milliseconds timeout) {
  const std::string me = host_identity();
  store.set("comm/cdb/host/" + std::to_string(rank), me);
  bool same = true;
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    const std::string key = "comm/cdb/host/" + std::to_string(p);
    store.wait({key}, timeout);
    const auto v = store.get(key);
    same = same && std::string(reinterpret_cast<const char*>(v.data()), v.size()) == me;
  }
  return same;
}

#if defined(COMM_HAS_MPI)
/// Whether "auto" may pick MPI: the application initialized MPI and an MPI launcher started the job.
[[nodiscard]] inline bool mpi_world_ready() {
  return mpi::initialized() && !mpi::finalized() && mpi::launched_by_mpi();
}

/// The world over MPI: MPI_COMM_WORLD adopted when MPI is initialized (the rendezvous is not used:
/// MPI already knows the ranks; no store, so no monitored_barrier), else the rendezvous of steps
/// 2-4 and Mpi::create, which initializes MPI and checks the ranks against MPI_COMM_WORLD.
[[nodiscard]] inline std::unique_ptr<AnyCommunicator> init_mpi_world(const InitOptions& o,
                                                                     std::chrono::milliseconds timeout) {
  backends::Mpi::Options mo;
  mo.timeout = timeout;
  if (mpi::initialized() && !mpi::finalized()) {
    auto c = Communicator<backends::Mpi>::adopt(MPI_COMM_WORLD, mo);
    if (o.rank >= 0 && o.rank != c.rank())
      throw InvalidArgument("init_distributed", c.rank(),
                            "rank " + std::to_string(o.rank) + " conflicts with MPI_COMM_WORLD's rank " +
                                std::to_string(c.rank()));
    if (o.world_size >= 0 && o.world_size != c.size())
      throw InvalidArgument("init_distributed", c.rank(),
                            "world_size " + std::to_string(o.world_size) + " conflicts with MPI_COMM_WORLD's size " +
                                std::to_string(c.size()));
    log(LogLevel::info, "init_distributed: backend mpi, MPI_COMM_WORLD adopted (MPI was initialized)");
    return std::make_unique<AnyCommunicator>(std::move(c));
  }
  InitResult r = rendezvous_for(o, timeout);
  auto c = Communicator<backends::Mpi>::create(r.store, r.rank, r.size, mo);
  log(LogLevel::info, "init_distributed: backend mpi, MPI initialized by comm");
  return std::make_unique<AnyCommunicator>(std::move(c));
}
#endif

/// The backend to use: the requested one, or for "auto" (and a CPU job) "cpu", which
/// init_distributed resolves to Shm or Hierarchical once the ranks can compare hosts.
[[nodiscard]] inline std::string resolve_backend(const std::string& requested, int rank) {
#if defined(COMM_HAS_MPI)
  if (requested == "mpi") return requested;
#else
  if (requested == "mpi") throw InvalidArgument("init_distributed", rank, "backend 'mpi' is not compiled in (link comm::mpi)");
#endif
  if (requested == "shm") return requested;
  // Hierarchical<Shm, Gloo> (issue 14).
  if (requested == "hierarchical") {
#if !defined(COMM_HAS_GLOO)
    throw InvalidArgument("init_distributed", rank, "backend 'hierarchical' needs comm::gloo (link comm::gloo)");
#endif
    return requested;
  }
  if (requested == "gloo" || requested == "nccl") {
#if !defined(COMM_HAS_GLOO)
    if (requested == "gloo") throw InvalidArgument("init_distributed", rank, "backend 'gloo' is not compiled in (link comm::gloo)");
#endif
#if !defined(COMM_HAS_NCCL)
    if (requested == "nccl") throw InvalidArgument("init_distributed", rank, "backend 'nccl' is not compiled in (link comm::nccl)");
#endif
    return requested;
  }
  if (requested != "auto" && !requested.empty())
    throw InvalidArgument("init_distributed", rank, "backend '" + requested + "' is not auto, gloo, nccl, shm, mpi or hierarchical");
  std::string why;
  if (cuda_usable(why)) {
    log(LogLevel::info, "init_distributed: backend nccl (auto: a CUDA device is usable)");
    return "nccl";
  }
#if defined(COMM_HAS_MPI)
  if (mpi_world_ready()) {
    log(LogLevel::info, "init_distributed: backend mpi (auto: MPI is initialized and an MPI launcher started the job)");
    return "mpi";
  }
#endif
  log(LogLevel::info, "init_distributed: no GPU backend (auto: " + why + "); choosing a CPU backend by host");
  return "cpu";
}

}  // namespace detail

/// True once init_distributed() or set_world() installed a world and destroy() has not removed it.
[[nodiscard]] inline bool is_initialized() {
  auto& s = detail::world_state();
  std::lock_guard lock(s.mu);
  return s.world != nullptr;
}

/// The world communicator. Throws comm::Error when there is none.
[[nodiscard]] inline AnyCommunicator& world() {
  auto& s = detail::world_state();
  std::lock_guard lock(s.mu);
  if (!s.world) throw Error("world", -1, "comm is not initialized: call comm::init_distributed() first");
  return *s.world;
}

/// Installs a communicator the application built itself (create, from_env or adopt) as the world.
/// Throws comm::InvalidArgument when a world already exists.
template <backend B>
AnyCommunicator& set_world(Communicator<B>&& c) {
  auto& s = detail::world_state();
  std::lock_guard lock(s.mu);
  if (s.world)
    throw InvalidArgument("set_world", s.world->rank(), "a world is already initialized; call comm::destroy() first");
  s.world = std::make_unique<AnyCommunicator>(std::move(c));
  return *s.world;
}

/// Destroys the world (its pending work is finished or failed by the backend). Idempotent.
inline void destroy() {
  std::unique_ptr<AnyCommunicator> old;
  {
    auto& s = detail::world_state();
    std::lock_guard lock(s.mu);
    old = std::move(s.world);
  }
}

/// Says where rank, sizes and the master address would come from (the discovery of step 3-4).
[[nodiscard]] inline std::string describe_environment() { return detail::describe(detail::discover_environment()); }

/// The world communicator, created on first call (see the file comment for the steps).
inline AnyCommunicator& init_distributed(InitOptions o = {}) {
  auto& s = detail::world_state();
  std::lock_guard lock(s.mu);
  if (s.world) {
    auto& w = *s.world;
    if (o.backend != "auto" && !o.backend.empty() && o.backend != w.backend())
      throw InvalidArgument("init_distributed", w.rank(),
                            "backend '" + o.backend + "' conflicts with the initialized world's backend '" +
                                std::string(w.backend()) + "'");
    if (o.rank >= 0 && o.rank != w.rank())
      throw InvalidArgument("init_distributed", w.rank(),
                            "rank " + std::to_string(o.rank) + " conflicts with the initialized world's rank " +
                                std::to_string(w.rank()));
    if (o.world_size >= 0 && o.world_size != w.size())
      throw InvalidArgument("init_distributed", w.rank(),
                            "world_size " + std::to_string(o.world_size) + " conflicts with the initialized world's size " +
                                std::to_string(w.size()));
    detail::log(detail::LogLevel::info, "init_distributed: reusing the initialized world");
    return w;
  }
  const auto timeout = o.timeout.count() > 0 ? o.timeout : timeout_from_env();
  std::string backend = detail::resolve_backend(o.backend, o.rank);
#if defined(COMM_HAS_MPI)
  if (backend == "mpi") {
    s.world = detail::init_mpi_world(o, timeout);
    return *s.world;
  }
#endif
  InitResult r = detail::rendezvous_for(o, timeout);
  if (backend == "cpu") {
    if (r.size == 1 || detail::all_on_one_host(*r.store, r.rank, r.size, timeout)) {
      backend = "shm";
      detail::log(detail::LogLevel::info, "init_distributed: backend shm (auto: every rank is on this host)");
    } else {
#if defined(COMM_HAS_GLOO)
      backend = "hierarchical";
      detail::log(detail::LogLevel::info,
                  "init_distributed: backend hierarchical (auto: the ranks span several hosts; shm within each host, "
                  "gloo across hosts)");
#else
      throw InvalidArgument("init_distributed", r.rank,
                            "backend auto: the ranks span several hosts and comm::gloo is not compiled in");
#endif
    }
  }
  if (backend == "shm") {
    backends::Shm::Options so;
    so.timeout = timeout;
    s.world = std::make_unique<AnyCommunicator>(Communicator<backends::Shm>::create(r.store, r.rank, r.size, so));
  }
#if defined(COMM_HAS_NCCL)
  if (backend == "nccl") {
    backends::Nccl::Options no;
    no.timeout = timeout;
    s.world = std::make_unique<AnyCommunicator>(Communicator<backends::Nccl>::create(r.store, r.rank, r.size, no));
  }
#endif
#if defined(COMM_HAS_GLOO)
  if (backend == "gloo") {
    backends::Gloo::Options go;
    go.timeout = timeout;
    s.world = std::make_unique<AnyCommunicator>(Communicator<backends::Gloo>::create(r.store, r.rank, r.size, go));
  }
  // Hierarchical<Shm, Gloo> (issue 14).
  if (backend == "hierarchical") {
    using H = backends::Hierarchical<backends::Shm, backends::Gloo>;
    H::Options ho;
    ho.timeout = timeout;
    s.world = std::make_unique<AnyCommunicator>(Communicator<H>::create(r.store, r.rank, r.size, ho));
  }
#endif
  detail::log(detail::LogLevel::info, "init_distributed: rank " + std::to_string(r.rank) + " of " +
                                          std::to_string(r.size) + " ready on " + backend);
  return *s.world;
}

}  // namespace comm
