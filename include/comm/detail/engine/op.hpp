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

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#include <comm/detail/diagnostics/flight_recorder.hpp>
#include <comm/detail/engine/reduce.hpp>
#include <comm/types.hpp>

namespace comm::detail {

/// Optional steps around one operation, run on the thread that executes it (the caller's for a
/// blocking call, the communicator's worker for an async one), in the operation's place in the
/// issue order: `before` after the desync check and right before the collective, `after` once the
/// collective succeeded (not after a failure). An exception from `before` fails the operation and
/// the communicator (this rank's part never ran: its peers must not wait for it); one from `after`
/// fails only the operation (the collective itself completed everywhere). Empty by
/// default (a test of a null std::function each). Device-buffer staging uses them: copy a device
/// input to host memory in `before`, the host result back to the device in `after`. Keep the
/// captures small (two pointers) or the std::function allocates.
struct OpHooks {
  std::function<void()> before;
  std::function<void()> after;
};

/// out = a R b over n elements of a user callable at `fn` (type-erased; see EngineCore::with_reduction).
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
  std::vector<P2PItem> p2p;          // send, recv, p2p_batch (one item for send / recv)
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

}  // namespace comm::detail
