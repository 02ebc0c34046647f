#pragma once
// Shared helpers of the collective suites, which run once per backend of the list (tests/collectives/
// CMakeLists.txt builds each suite with COMM_TEST_BACKEND=<name> defined): the backend under test,
// communicator creation, deterministic inputs, and reference reductions computed locally
// (independently of comm's kernels) for every element type and op.

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

#if !defined(COMM_TEST_BACKEND)
#define COMM_TEST_BACKEND gloo
#define COMM_TEST_BACKEND_GLOO 1
#endif
#include <comm/backends/registry.hpp>
#if defined(COMM_TEST_BACKEND_HIERARCHICAL)
#include <comm/detail/base/env.hpp>
#endif
#include <comm/communicator.hpp>
#include <support/collective_test_util.hpp>
#include <support/multirank.hpp>

namespace suite {

/// The backend under test: the list's entry named COMM_TEST_BACKEND (one struct per compiled-in
/// entry, named like it).
namespace by_name {
#define COMM_BACKEND(name, has, target, ...) \
  COMM_PP_WHEN(COMM_PP_IS_ONE(has))(struct name { using type = __VA_ARGS__; };)
#include <comm/backends/list.hpp>
#undef COMM_BACKEND
}  // namespace by_name
using Backend = by_name::COMM_TEST_BACKEND::type;
using Comm = comm::Communicator<Backend>;
using Options = Backend::Options;
using comm::ReduceOp;
/// The backend's name, as flight records and AnyCommunicator::backend() say it.
inline const std::string kBackendName(Backend::name);

#if defined(COMM_TEST_BACKEND_HIERARCHICAL)
/// Hierarchical on one machine: with COMM_TEST_RANKS_PER_NODE=k the world is cut into
/// m = ceil(size/k) fake nodes by node id, dealt out back and forth (ranks 0..m-1 to nodes
/// 0..m-1, the next m to nodes m-1..0, ...), so that a node's ranks are neither consecutive nor
/// m apart and both of the engine's reorderings run: 4 ranks are nodes {0, 3} and {1, 2}, 3 ranks
/// nodes {0} and {1, 2} (different sizes: leaders-only). Shm works inside each fake node, as all
/// ranks share one host.
inline std::string test_node_id(int rank, int size) {
  const auto k = comm::detail::env_nonneg_int("COMM_TEST_RANKS_PER_NODE");
  if (!k || *k < 1) return {};
  const int m = (size + *k - 1) / *k;
  const int node = (rank / m) % 2 == 0 ? rank % m : m - 1 - rank % m;
  return "test-node-" + std::to_string(node);
}
#endif

inline Comm make_comm(Options o = {}) {
  const auto& w = comm::test::world();
#if defined(COMM_TEST_BACKEND_HIERARCHICAL)
  if (o.node_id.empty()) o.node_id = test_node_id(w.rank, w.size);
#endif
  return Comm::create(comm::test::fresh_store(), w.rank, w.size, o);
}

#define COMM_TEST_ALL_TYPES                                                                              \
  std::int8_t, std::uint8_t, std::int32_t, std::uint32_t, std::int64_t, std::uint64_t, float, double, \
      comm::half, comm::bfloat16, comm::float8_e4m3, comm::float8_e5m2

using comm::test::is_fp8;
using comm::test::is_int;

template <class T>
std::vector<ReduceOp> ops_for() {
  std::vector<ReduceOp> ops{ReduceOp::sum, ReduceOp::prod, ReduceOp::min, ReduceOp::max, ReduceOp::avg};
  if constexpr (is_int<T>) {
    ops.push_back(ReduceOp::band);
    ops.push_back(ReduceOp::bor);
    ops.push_back(ReduceOp::bxor);
  }
  return ops;
}

using comm::test::input_value;
using comm::test::mix;

/// The reduction of element `i` over `n` ranks, computed without comm's kernels.
template <class T>
T reference(ReduceOp op, int n, std::size_t i) {
  if constexpr (is_int<T>) {
    std::uint64_t acc = static_cast<std::uint64_t>(static_cast<std::make_unsigned_t<T>>(input_value<T>(0, i, op)));
    if (op == ReduceOp::prod) acc = static_cast<std::uint64_t>(static_cast<std::int64_t>(input_value<T>(0, i, op)));
    T best = input_value<T>(0, i, op);
    for (int r = 1; r < n; ++r) {
      const T x = input_value<T>(r, i, op);
      switch (op) {
        case ReduceOp::sum:
        case ReduceOp::avg: acc += static_cast<std::uint64_t>(static_cast<std::int64_t>(x)); break;
        case ReduceOp::prod: acc *= static_cast<std::uint64_t>(static_cast<std::int64_t>(x)); break;
        case ReduceOp::min: best = std::min(best, x); break;
        case ReduceOp::max: best = std::max(best, x); break;
        case ReduceOp::band: best = static_cast<T>(best & x); break;
        case ReduceOp::bor: best = static_cast<T>(best | x); break;
        case ReduceOp::bxor: best = static_cast<T>(best ^ x); break;
      }
    }
    if (op == ReduceOp::sum || op == ReduceOp::prod) return static_cast<T>(acc);  // modulo 2^bits
    if (op == ReduceOp::avg) {
      const auto s = static_cast<T>(acc);
      if constexpr (std::is_signed_v<T>) {  // floor division
        long long q = static_cast<long long>(s) / n;
        if (static_cast<long long>(s) % n != 0 && s < 0) --q;
        return static_cast<T>(q);
      } else {
        return static_cast<T>(s / static_cast<T>(n));
      }
    }
    return best;
  } else {
    double acc = static_cast<float>(input_value<T>(0, i, op));
    double best = acc;
    for (int r = 1; r < n; ++r) {
      const double x = static_cast<float>(input_value<T>(r, i, op));
      switch (op) {
        case ReduceOp::sum:
        case ReduceOp::avg: acc += x; break;
        case ReduceOp::prod: acc *= x; break;
        case ReduceOp::min: best = std::min(best, x); break;
        case ReduceOp::max: best = std::max(best, x); break;
        default: break;
      }
    }
    if (op == ReduceOp::min || op == ReduceOp::max) return T(static_cast<float>(best));
    if (op != ReduceOp::avg) return T(static_cast<float>(acc));
    // avg: the exact sum in T, times 1/n (documented: multiply by 1/size at the end).
    if constexpr (std::is_same_v<T, double>)
      return acc * (1.0 / n);
    else if constexpr (std::is_same_v<T, float>)
      return static_cast<float>(acc) * (1.0f / static_cast<float>(n));
    else
      return T(static_cast<float>(T(static_cast<float>(acc))) * (1.0f / static_cast<float>(n)));
  }
}

template <class T>
std::string show(T v) {
  if constexpr (is_int<T>)
    return std::to_string(static_cast<long long>(v));
  else
    return std::to_string(static_cast<double>(static_cast<float>(v)));
}

using comm::test::same;

/// Index of the first element where `got` differs from `want(i)`, or -1. On a mismatch it
/// also prints both values.
template <class T, class F>
long long first_mismatch(const std::vector<T>& got, F want, std::size_t offset = 0, std::size_t count = SIZE_MAX) {
  const std::size_t end = count == SIZE_MAX ? got.size() : offset + count;
  for (std::size_t i = offset; i < end; ++i) {
    const T w = want(i);
    if (!same(got[i], w)) {
      MESSAGE("element ", i, ": got ", show(got[i]), ", expected ", show(w));
      return static_cast<long long>(i);
    }
  }
  return -1;
}

inline const char* type_name(comm::Dtype d) { return comm::to_string(d).data(); }

}  // namespace suite
