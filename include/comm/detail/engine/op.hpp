#pragma once
// The record of one operation, built by the engine core's typed entry points (core.hpp) and run by
// non-template code, whatever the backend.
//
// Why a record: every (element type x reduction x launch) used to instantiate its own lambda,
// queue task, worker-thread closure and set of gloo option templates, so a program that uses
// every type (AnyCommunicator) compiled the engine dozens of times. Now the typed entry points
// only fill this record (pointers, counts, element size, codes, function pointers); everything
// behind them is compiled once per translation unit, and gloo's typed options are instantiated
// per element *size* (gloo only uses sizeof(T)).

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <array>
#include <type_traits>
#include <utility>
#include <vector>

#include <comm/detail/diagnostics/flight_recorder.hpp>
#include <comm/detail/engine/reduce.hpp>
#include <comm/types.hpp>

namespace comm::detail {

/// One step of OpHooks: a callable with no arguments, held by shared ownership (an async
/// operation's record is moved into the queue, so the hook must own what it captured).
///
/// Why not std::function: a default-constructed std::function zeroes its 16-byte buffer, which GCC
/// emits as `rep stos`, and every operation built four of them (the entry point's default `hooks`
/// argument and the record's own pair), even though hooks are only set for device staging. perf
/// put those four stores at about a fifth of a one-rank 8-byte Shm broadcast (benchmarks/RESULTS.md,
/// "The call path: what an operation costs before it moves a byte"). An empty Hook is three
/// null pointers; a set one costs one allocation, which the staging that sets it makes anyway.
class Hook {
 public:
  // User-provided on purpose: `OpHooks hooks = {}` value-initializes, which for a defaulted
  // constructor zero-fills the whole object first (GCC: `rep stos` again).
  Hook() noexcept {}  // NOLINT(modernize-use-equals-default)
  template <class F>
    requires(!std::is_same_v<std::remove_cvref_t<F>, Hook> && std::is_invocable_v<std::remove_cvref_t<F>&>)
  Hook& operator=(F&& f) {
    using Fn = std::remove_cvref_t<F>;
    state_ = std::make_shared<Fn>(std::forward<F>(f));
    call_ = [](void* fn) { (*static_cast<Fn*>(fn))(); };
    return *this;
  }
  explicit operator bool() const noexcept { return call_ != nullptr; }
  void operator()() const { call_(state_.get()); }

 private:
  std::shared_ptr<void> state_;
  void (*call_)(void*) = nullptr;
};

/// Optional steps around one operation, run on the thread that executes it (the caller's for a
/// blocking call, the communicator's worker for an async one), in the operation's place in the
/// issue order: `before` after the desync check and right before the collective, `after` once the
/// collective succeeded (not after a failure). An exception from `before` fails the operation and
/// the communicator (this rank's part never ran: its peers must not wait for it); one from `after`
/// fails only the operation (the collective itself completed everywhere). Empty by default (a
/// test of a null pointer each). Device-buffer staging uses them: copy a device input to host
/// memory in `before`, the host result back to the device in `after`.
struct OpHooks {
  Hook before;
  Hook after;
};

/// out = a R b over n elements of a user callable at `fn` (type-erased; see set_typed_reduction).
using custom_reduce_fn = void (*)(const void* fn, void* out, const void* a, const void* b, std::size_t n);
/// Turns a sum over `size` ranks into the average, in place.
using finish_fn = void (*)(void* data, std::size_t n, int size);
/// dst = factor * src over n elements (premul_sum; half-like types through float).
using prescale_fn = void (*)(void* dst, const void* src, std::size_t n, double factor);

/// One send or receive of a point-to-point operation: send, recv, batch_isend_irecv, and the
/// collectives the engine core composes from them (scatter, all_to_all, all_to_all_v).
struct P2PItem {
  bool send = false;
  void* buf = nullptr;    // read only for a send
  std::size_t count = 0;  // elements
  int peer = -1;
  int tag = 0;
};

/// The items of a point-to-point operation: a send or a receive holds one, kept in place (a
/// vector of one item cost each call a heap allocation and its release), a batch a vector.
class P2PItems {
 public:
  void push_back(const P2PItem& it) {
    if (many_.empty() && !one_used_) {
      one_ = it;
      one_used_ = true;
      return;
    }
    spill(2);
    many_.push_back(it);
  }
  void reserve(std::size_t n) {
    if (n > 1) spill(n);
  }
  template <class It>
  void assign(It first, It last) {
    clear();
    for (; first != last; ++first) push_back(*first);
  }
  void clear() noexcept {
    many_.clear();
    one_used_ = false;
  }
  [[nodiscard]] std::size_t size() const noexcept { return many_.empty() ? (one_used_ ? 1 : 0) : many_.size(); }
  [[nodiscard]] bool empty() const noexcept { return size() == 0; }
  [[nodiscard]] P2PItem* data() noexcept { return many_.empty() ? &one_ : many_.data(); }
  [[nodiscard]] const P2PItem* data() const noexcept { return many_.empty() ? &one_ : many_.data(); }
  [[nodiscard]] P2PItem* begin() noexcept { return data(); }
  [[nodiscard]] P2PItem* end() noexcept { return data() + size(); }
  [[nodiscard]] const P2PItem* begin() const noexcept { return data(); }
  [[nodiscard]] const P2PItem* end() const noexcept { return data() + size(); }
  P2PItem& operator[](std::size_t i) noexcept { return data()[i]; }
  const P2PItem& operator[](std::size_t i) const noexcept { return data()[i]; }

 private:
  /// Moves the items to the vector (once more than one is wanted).
  void spill(std::size_t want) {
    if (!many_.empty()) {
      many_.reserve(want);
      return;
    }
    many_.reserve(std::max<std::size_t>(want, 2));
    if (one_used_) many_.push_back(one_);
    one_used_ = false;
  }
  P2PItem one_;
  bool one_used_ = false;
  std::vector<P2PItem> many_;  // two or more items (empty otherwise)
};

struct Op {
  OpDesc desc;                  // kind, dtype / reduction codes, root, count: recorder + desync check
  const void* in = nullptr;     // null for in-place / output-only operations
  void* out = nullptr;
  std::size_t in_count = 0;     // elements
  std::size_t out_count = 0;    // elements
  std::size_t elem_size = 0;    // bytes per element: 1, 2, 4 or 8
  reduce_fn kernel = nullptr;   // a built-in reduction (avg runs as sum), or
  reduce_many_fn many = nullptr;       // ... its n-input form (built-in reductions only)
  custom_reduce_fn custom = nullptr;
  const void* custom_arg = nullptr;  // the callable `custom` applies
  finish_fn finish = nullptr;   // avg: runs after a successful reduction
  std::shared_ptr<const void> keep;  // owns the callable of an async custom reduction
  OpHooks hooks;
  prescale_fn prescale = nullptr;  // premul_sum: the input is scaled by `factor` first
  double factor = 1.0;
  P2PItems p2p;                      // send, recv, p2p_batch (one item for send / recv)
  std::vector<std::size_t> counts;   // all_to_all_v: size() send counts, then size() receive counts
  std::chrono::milliseconds barrier_timeout{};  // monitored_barrier
  bool wait_all_ranks = false;                  // monitored_barrier
};

template <class T, class F>
void apply_custom(const void* fn, void* out, const void* a, const void* b, std::size_t n) {
  reduce_custom<T>(*static_cast<const F*>(fn), static_cast<T*>(out), static_cast<const T*>(a),
                   static_cast<const T*>(b), n);
}

template <class T>
void prescale_erased(void* dst, const void* src, std::size_t n, double factor) {
  auto* d = static_cast<T*>(dst);
  const auto* x = static_cast<const T*>(src);
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    const auto f = static_cast<T>(factor);
    for (std::size_t i = 0; i < n; ++i) d[i] = x[i] * f;
  } else {  // half, bfloat16, fp8: in float, rounded once
    const auto f = static_cast<float>(factor);
    for (std::size_t i = 0; i < n; ++i) d[i] = T(static_cast<float>(x[i]) * f);
  }
}

template <class T>
void finish_avg_erased(void* data, std::size_t n, int size) {
  finish_avg<T>(static_cast<T*>(data), n, size);
}

/// The record of an operation from its erased arguments (`root`: the root or peer, -1 for none).
/// `desc.count` is what ranks compare in the desync check: the typed entry points (core.hpp) and
/// AnyCommunicator's erased calls build it here, so both forms of a call describe it alike.
[[nodiscard]] inline Op erased_op(OpKind kind, Dtype d, const void* in, void* out, std::size_t in_n,
                                  std::size_t out_n, int root = -1) {
  Op op;
  std::size_t count = in_n;
  switch (kind) {
    case OpKind::reduce_scatter:
    case OpKind::scatter:
    case OpKind::broadcast:
    case OpKind::recv: count = out_n; break;
    case OpKind::all_to_all_v: count = 0; break;  // differs by rank: message headers check each pair
    default: break;
  }
  op.desc = OpDesc{kind, static_cast<std::uint8_t>(d), OpDesc::none, root, count};
  op.in = in;
  op.out = out;
  op.in_count = in_n;
  op.out_count = out_n;
  op.elem_size = size_of(d);
  return op;
}

/// The kernels of built-in reduction `r` on element type `d`, both known at run time (avg as sum
/// plus its finish; kernel null where `r` does not apply to `d`). One table, built once with the
/// dtype visitor: no per-call re-typing.
struct ReductionKernels {
  reduce_fn kernel = nullptr;
  reduce_many_fn many = nullptr;
  finish_fn finish = nullptr;
};
[[nodiscard]] inline const ReductionKernels& reduction_kernels(Dtype d, ReduceOp r) {
  constexpr std::size_t kDtypes = static_cast<std::size_t>(Dtype::float8_e5m2) + 1;
  constexpr std::size_t kOps = static_cast<std::size_t>(ReduceOp::bxor) + 1;
  using Table = std::array<std::array<ReductionKernels, kOps>, kDtypes>;
  static const Table table = [] {
    Table t{};
    for (std::size_t i = 0; i < kDtypes; ++i)
      visit_dtype(static_cast<Dtype>(i), [&]<class T>() {
        for (std::size_t j = 0; j < kOps; ++j) {
          const auto op = static_cast<ReduceOp>(j);
          t[i][j] = ReductionKernels{reduce_kernel_for<T>(op), reduce_many_for<T>(op),
                                     op == ReduceOp::avg ? &finish_avg_erased<T> : nullptr};
        }
      });
    return t;
  }();
  return table[static_cast<std::size_t>(d)][static_cast<std::size_t>(r)];
}

/// Sets built-in reduction `r` on `op` (its element type: op.desc.dtype).
inline void set_reduction(Op& op, ReduceOp r) {
  const ReductionKernels& k = reduction_kernels(static_cast<Dtype>(op.desc.dtype), r);
  op.desc.reduce = static_cast<std::uint8_t>(r);
  op.kernel = k.kernel;
  op.many = k.many;
  op.finish = k.finish;
}

/// Whether a reduction argument is avg (a sum finished by dividing by the rank count).
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

/// Sets the reduction of `op` (a typed call's record, element type T) from the reduction argument
/// `red`, for a call launched as `Launch`. A custom callable is referred to where it lives: in the
/// caller's frame for a blocking call, in `op.keep` for an async one.
template <class T, class Launch, class Red>
void set_typed_reduction(Op& op, Red& red) {
  op.desc.reduce = reduce_code(red);
  if constexpr (std::is_same_v<Red, ReduceOp>) {
    op.kernel = reduce_kernel_for<T>(red);
    op.many = reduce_many_for<T>(red);
  } else if constexpr (std::is_same_v<Red, op::premul_sum_t>) {
    op.kernel = &reduce_kernel<ReduceOp::sum, T>;
    op.many = &reduce_many_kernel<ReduceOp::sum, T>;
    op.prescale = &prescale_erased<T>;
    op.factor = red.factor;
  } else if constexpr (builtin_reduction<Red>) {
    constexpr ReduceOp r = reduce_op_of<Red> == ReduceOp::avg ? ReduceOp::sum : reduce_op_of<Red>;
    op.kernel = &reduce_kernel<r, T>;
    op.many = &reduce_many_kernel<r, T>;
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
}

}  // namespace comm::detail
