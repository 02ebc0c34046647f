#pragma once
// Element types and reductions on MPI.
//
// Types MPI has (the integers, float, double) map to MPI's predefined datatypes and, for the
// built-in reductions, to MPI's predefined ops, so MPI runs its own (often vectorised, sometimes
// offloaded) reduction. half, bfloat16 and the fp8 types have no MPI datatype: they move as
// MPI_UINT16_T / MPI_UINT8_T and reduce with a user-defined MPI_Op that runs comm's kernel, as do
// custom callables on any type.
//
// Why a datatype attribute: an MPI_User_function receives no user pointer, and the thread that runs
// it is not necessarily the one that issued the operation (with MPI_THREAD_MULTIPLE any thread
// inside MPI may progress another thread's non-blocking collective), so neither a global nor a
// thread_local can say which kernel to run. Each engine owns contiguous "element of n bytes"
// datatypes carrying a pointer to the engine's ReduceSlot as an attribute; the one user-defined op
// reads the slot back from the datatype it is handed. Operations of one communicator run one at a
// time, so the slot holds the kernel of the operation in flight.

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <type_traits>

#include <comm/detail/engine/op.hpp>
#include <comm/detail/mpi/errors.hpp>
#include <comm/detail/engine/reduce.hpp>
#include <comm/types.hpp>

namespace comm::detail::mpi {

/// The datatype and op one reduction runs with (MPI's own, or the engine's slot op).
struct Reduction {
  MPI_Datatype type;
  MPI_Op op;
};

/// The MPI datatype that moves (and, where MPI can, reduces) elements of type T.
template <element T>
[[nodiscard]] MPI_Datatype datatype() noexcept {
  if constexpr (std::is_same_v<T, std::int8_t>) return MPI_INT8_T;
  else if constexpr (std::is_same_v<T, std::uint8_t>) return MPI_UINT8_T;
  else if constexpr (std::is_same_v<T, std::int32_t>) return MPI_INT32_T;
  else if constexpr (std::is_same_v<T, std::uint32_t>) return MPI_UINT32_T;
  else if constexpr (std::is_same_v<T, std::int64_t>) return MPI_INT64_T;
  else if constexpr (std::is_same_v<T, std::uint64_t>) return MPI_UINT64_T;
  else if constexpr (std::is_same_v<T, float>) return MPI_FLOAT;
  else if constexpr (std::is_same_v<T, double>) return MPI_DOUBLE;
  else if constexpr (sizeof(T) == 2) return MPI_UINT16_T;  // half, bfloat16: moved as their bits
  else {
    static_assert(sizeof(T) == 1, "comm: an element type without an MPI mapping");
    return MPI_UINT8_T;  // float8_e4m3, float8_e5m2
  }
}

/// Whether MPI's predefined ops reduce T (else comm's kernel runs in a user-defined op).
template <element T>
inline constexpr bool mpi_reduces_v = std::is_integral_v<T> || std::is_same_v<T, float> || std::is_same_v<T, double>;

/// datatype<T>() for an element type known by its code (the op record's).
[[nodiscard]] inline MPI_Datatype datatype_of(Dtype d) noexcept {
  switch (d) {
    case Dtype::int8: return datatype<std::int8_t>();
    case Dtype::uint8: return datatype<std::uint8_t>();
    case Dtype::int32: return datatype<std::int32_t>();
    case Dtype::uint32: return datatype<std::uint32_t>();
    case Dtype::int64: return datatype<std::int64_t>();
    case Dtype::uint64: return datatype<std::uint64_t>();
    case Dtype::float16: return datatype<half>();
    case Dtype::bfloat16: return datatype<bfloat16>();
    case Dtype::float32: return datatype<float>();
    case Dtype::float64: return datatype<double>();
    case Dtype::float8_e4m3: return datatype<float8_e4m3>();
    case Dtype::float8_e5m2: return datatype<float8_e5m2>();
  }
  return MPI_DATATYPE_NULL;
}

/// mpi_reduces_v for an element type known by its code.
[[nodiscard]] constexpr bool mpi_reduces(Dtype d) noexcept {
  switch (d) {
    case Dtype::float16:
    case Dtype::bfloat16:
    case Dtype::float8_e4m3:
    case Dtype::float8_e5m2: return false;
    default: return true;
  }
}

/// MPI's predefined op for a built-in reduction (avg arrives as sum; the engine divides after).
[[nodiscard]] inline MPI_Op op_of(ReduceOp r) noexcept {
  switch (r) {
    case ReduceOp::sum:
    case ReduceOp::avg: return MPI_SUM;
    case ReduceOp::prod: return MPI_PROD;
    case ReduceOp::min: return MPI_MIN;
    case ReduceOp::max: return MPI_MAX;
    case ReduceOp::band: return MPI_BAND;
    case ReduceOp::bor: return MPI_BOR;
    case ReduceOp::bxor: return MPI_BXOR;
  }
  return MPI_OP_NULL;
}

/// What the user-defined op runs for the operation in flight on one engine.
struct ReduceSlot {
  reduce_fn kernel = nullptr;         // a built-in reduction on a type MPI cannot reduce, or
  custom_reduce_fn custom = nullptr;  // ... a user callable at `arg`
  const void* arg = nullptr;
};

/// The attribute key under which an engine's datatypes carry their ReduceSlot (one per process).
[[nodiscard]] inline int slot_keyval() {
  static const int key = [] {
    int k = MPI_KEYVAL_INVALID;
    COMM_MPI_CHECK(MPI_Type_create_keyval(MPI_TYPE_NULL_COPY_FN, MPI_TYPE_NULL_DELETE_FN, &k, nullptr),
                   "mpi.init", -1);
    return k;
  }();
  return key;
}

/// inout[i] = in[i] R inout[i] with the kernel of the slot attached to `*dt` (see the file comment).
// Called by MPI; must not throw. A datatype without a slot cannot reach here: only the engines'
// own datatypes are ever passed with this op.
inline void slot_reduce(void* in, void* inout, int* len, MPI_Datatype* dt) {
  void* value = nullptr;
  int found = 0;
  if (MPI_Type_get_attr(*dt, slot_keyval(), &value, &found) != MPI_SUCCESS || found == 0) {
    MPI_Abort(MPI_COMM_WORLD, 70);  // an internal invariant broke: no result would be right
    return;
  }
  const auto* s = static_cast<const ReduceSlot*>(value);
  const auto n = static_cast<std::size_t>(*len);
  if (s->custom != nullptr)
    s->custom(s->arg, inout, in, inout, n);
  else
    s->kernel(inout, in, inout, n);
}

/// The user-defined op every engine uses for comm's kernels (commutative: comm's reductions are).
[[nodiscard]] inline MPI_Op slot_op() {
  static const MPI_Op op = [] {
    MPI_Op o = MPI_OP_NULL;
    COMM_MPI_CHECK(MPI_Op_create(&slot_reduce, 1, &o), "mpi.init", -1);
    return o;
  }();
  return op;
}

}  // namespace comm::detail::mpi
