#pragma once
// Shared helpers of the NCCL tests: when a GPU test can run here (and the skip message when it
// cannot), device buffers, communicator creation, deterministic inputs and reference results.

#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <comm/backends/nccl.hpp>
#include <comm/communicator.hpp>
#include <support/collective_test_util.hpp>
#include <support/multirank.hpp>

namespace nccl_test {

using Comm = comm::Communicator<comm::backends::Nccl>;
using comm::ReduceOp;

/// Ranks on this host (comm-run starts them all here).
inline int local_ranks() {
  if (const char* v = std::getenv("LOCAL_WORLD_SIZE"); v != nullptr && *v != '\0') return std::atoi(v);
  return comm::test::world().size;
}

/// Why GPU tests cannot run here with this world, or "" when they can. The same on every rank.
inline std::string gpu_skip_reason() {
  const auto dc = comm::nccl::device_count();
  if (dc.count <= 0) return "no usable CUDA device (" + dc.why + ")";
  const int local = local_ranks();
  if (local > dc.count) {
    const int v = comm::nccl::runtime_version();
    const char* env = std::getenv("NCCL_MULTI_RANK_GPU_ENABLE");
    const bool enabled = env != nullptr && std::string(env) == "1";
    if (v < comm::detail::nccl::multi_rank_gpu_version)
      return std::to_string(local) + " ranks would share " + std::to_string(dc.count) + " GPU(s) and NCCL " +
             comm::nccl::version_string(v) +
             " refuses several ranks on one GPU (needs NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1)";
    if (!enabled)
      return std::to_string(local) + " ranks would share " + std::to_string(dc.count) +
             " GPU(s): set NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL " + comm::nccl::version_string(v) + ")";
  }
  return {};
}

inline void report_skip(const std::string& why) {
  if (comm::test::world().rank == 0)
    std::printf("SKIPPED '%s': %s\n", comm::test::current_test().c_str(), why.c_str());
}

}  // namespace nccl_test

/// At the top of a TEST_CASE that needs a GPU: without one (or with more ranks than this NCCL
/// allows on the GPUs here), print why and skip the case.
#define NCCL_REQUIRE_GPU()                                                    \
  do {                                                                        \
    if (const std::string why_ = ::nccl_test::gpu_skip_reason(); !why_.empty()) { \
      ::nccl_test::report_skip(why_);                                         \
      return;                                                                 \
    }                                                                         \
  } while (0)

namespace nccl_test {

/// Checks a CUDA call in test code.
#define NCCL_TEST_CUDA(expr)                                                                        \
  do {                                                                                              \
    const cudaError_t e_ = (expr);                                                                  \
    if (e_ != cudaSuccess) FAIL(#expr << " failed: " << cudaGetErrorString(e_) << " (" << static_cast<int>(e_) << ")"); \
  } while (0)

/// A device allocation of `n` elements of T on the current device.
template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t n) : n_(n) {
    if (n_ > 0) NCCL_TEST_CUDA(cudaMalloc(reinterpret_cast<void**>(&p_), n_ * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& v) : DeviceBuffer(v.size()) { upload(v); }
  ~DeviceBuffer() {
    if (p_ != nullptr) (void)cudaFree(p_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  /// Synchronous copy in (legacy default stream).
  void upload(const std::vector<T>& v) {
    REQUIRE(v.size() == n_);
    if (n_ > 0) NCCL_TEST_CUDA(cudaMemcpy(p_, v.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  /// Synchronous copy out (legacy default stream: ordered after a blocking comm operation issued
  /// with the default current stream).
  [[nodiscard]] std::vector<T> download() const {
    std::vector<T> v(n_);
    if (n_ > 0) NCCL_TEST_CUDA(cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
  [[nodiscard]] std::span<T> span() noexcept { return {p_, n_}; }
  [[nodiscard]] std::span<const T> cspan() const noexcept { return {p_, n_}; }
  [[nodiscard]] T* data() noexcept { return p_; }
  [[nodiscard]] std::size_t size() const noexcept { return n_; }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

/// A blocking ncclComm_t of the whole world made with NCCL's own calls (the unique id shared
/// through a store private to the calling test case), on this rank's device, which it makes
/// current. The caller destroys it.
inline ncclComm_t raw_nccl_comm() {
  const auto& w = comm::test::world();
  auto store = comm::test::fresh_store();
  const char* lr = std::getenv("LOCAL_RANK");
  const int device = std::atoi(lr ? lr : "0") % comm::nccl::device_count().count;
  NCCL_TEST_CUDA(cudaSetDevice(device));
  ncclUniqueId id{};
  if (w.rank == 0) {
    REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
    store->set("uid", std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(&id), sizeof(id)));
  } else {
    auto v = store->get("uid");
    REQUIRE(v.size() == sizeof(id));
    std::memcpy(&id, v.data(), sizeof(id));
  }
  ncclComm_t raw = nullptr;
  REQUIRE(ncclCommInitRank(&raw, w.size, id, w.rank) == ncclSuccess);
  return raw;
}

/// A communicator over a store private to the calling test case.
inline Comm make_comm(comm::backends::Nccl::Options o = {}) {
  const auto& w = comm::test::world();
  return Comm::create(comm::test::fresh_store(), w.rank, w.size, o);
}

#define NCCL_TEST_ALL_TYPES                                                                              \
  std::int8_t, std::uint8_t, std::int32_t, std::uint32_t, std::int64_t, std::uint64_t, float, double, \
      comm::half, comm::bfloat16

using comm::test::input_value;
using comm::test::is_int;
using comm::test::same;

/// The reductions the NCCL backend runs on T.
template <class T>
std::vector<ReduceOp> ops_for() {
  std::vector<ReduceOp> ops{ReduceOp::sum, ReduceOp::prod, ReduceOp::min, ReduceOp::max};
  if (comm::backends::Nccl::supports_reduction(ReduceOp::avg, comm::dtype_of<T>)) ops.push_back(ReduceOp::avg);
  return ops;
}

/// The reference result of `op` over ranks 0..n-1 at element `i`, as a double.
template <class T>
double expected(ReduceOp op, std::size_t i, int n) {
  double acc = static_cast<double>(input_value<T>(0, i, op));
  for (int r = 1; r < n; ++r) {
    const double x = static_cast<double>(input_value<T>(r, i, op));
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg: acc += x; break;
      case ReduceOp::prod: acc *= x; break;
      case ReduceOp::min: acc = std::min(acc, x); break;
      case ReduceOp::max: acc = std::max(acc, x); break;
      default: break;
    }
  }
  if (op == ReduceOp::avg) acc = is_int<T> ? std::floor(acc / n) : acc / n;
  if constexpr (is_int<T>) {
    // Products of small values can wrap in 8-bit types: compare in the element type.
    return static_cast<double>(static_cast<T>(static_cast<long long>(acc)));
  }
  return acc;
}

/// Whether `got` matches `want` for T (avg on floating types is rounded: NCCL pre-multiplies).
template <class T>
bool close(T got, double want, ReduceOp op) {
  const double g = static_cast<double>(got);
  if (is_int<T> || op != ReduceOp::avg) return g == want;
  const double tol = std::is_same_v<T, comm::half> || std::is_same_v<T, comm::bfloat16> ? 2e-2 : 1e-6;
  return std::abs(g - want) <= tol * std::max(1.0, std::abs(want));
}

template <class T>
std::vector<T> inputs(int rank, std::size_t n, ReduceOp op, std::size_t offset = 0) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = input_value<T>(rank, offset + i, op);
  return v;
}

/// A value that identifies (rank, element) for data-movement tests, exact in every type.
template <class T>
T tag(int rank, std::size_t i) {
  const long long v = static_cast<long long>(rank) * 10 + static_cast<long long>(i % 7);
  if constexpr (is_int<T>)
    return static_cast<T>(v);
  else
    return T(static_cast<float>(v));
}

}  // namespace nccl_test
