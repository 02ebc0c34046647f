#pragma once
// What every backend policy does before its engine exists: check the arguments of create() (and
// the timeout of adopt()) and map the common options to the engine core's settings. Written once
// so that a bad argument reads the same on every backend: "<backend>.init on rank R: <what>".

#include <memory>
#include <string>

#include <comm/detail/engine/core.hpp>
#include <comm/error.hpp>
#include <comm/options.hpp>
#include <comm/store.hpp>

namespace comm::detail {

/// comm::InvalidArgument from `op` ("gloo.adopt") unless the timeout is positive.
inline void check_timeout(const char* op, int rank, const CommonOptions& o) {
  if (o.timeout.count() <= 0)
    throw InvalidArgument(op, rank, "timeout " + std::to_string(o.timeout.count()) + " ms must be positive");
}

/// The checks of `create(store, rank, size, options)`: a store, size >= 1, rank in [0, size), a
/// positive timeout; comm::InvalidArgument from `op` ("shm.init") naming the value otherwise.
inline void check_create(const char* op, const std::shared_ptr<Store>& store, int rank, int size,
                         const CommonOptions& o) {
  if (!store) throw InvalidArgument(op, rank, "store is null");
  if (size < 1) throw InvalidArgument(op, rank, "size " + std::to_string(size) + " must be at least 1");
  if (rank < 0 || rank >= size)
    throw InvalidArgument(op, rank,
                          "rank " + std::to_string(rank) + " is out of range [0, " + std::to_string(size) + ")");
  check_timeout(op, rank, o);
}

/// The engine core's settings from the common options.
[[nodiscard]] inline CoreConfig core_config(const CommonOptions& o) {
  CoreConfig c;
  c.timeout = o.timeout;
  c.desync_check = o.desync_check;
  c.flight_recorder_size = o.flight_recorder_size;
  c.file_rank = o.record_file_rank;
  c.name = o.record_name;
  return c;
}

/// What a host engine reduces: every element type, every reduction but the bitwise ones on
/// floating types, and user callables (comm's kernels run on the host). A host backend policy
/// derives from it instead of writing these three answers again.
struct HostReductions {
  static constexpr bool supports_dtype(Dtype) noexcept { return true; }
  static constexpr bool supports_reduction(ReduceOp op, Dtype d) noexcept { return !is_bitwise(op) || !is_floating(d); }
  static constexpr bool custom_reductions = true;
};

/// An engine's settings (a struct derived from CoreConfig) with its core part from `o`; the
/// caller fills in the engine's own fields.
template <class Config>
[[nodiscard]] Config engine_config(const CommonOptions& o) {
  Config c;
  static_cast<CoreConfig&>(c) = core_config(o);
  return c;
}

}  // namespace comm::detail
