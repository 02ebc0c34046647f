// CPU-only tests of the NCCL backend's building blocks: element type and reduction maps, versions,
// the choice of gather path, the checking macros and their errors, the caller's current stream,
// and the argument checks that happen before any device is touched.
#include "nccl_test_util.hpp"

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <support/env_guard.hpp>

using namespace nccl_test;
using comm::Dtype;
using Nccl = comm::backends::Nccl;
namespace dn = comm::detail::nccl;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

using comm::test::ScopedEnv;

}  // namespace

/// Stands in for an NCCL call that fails.
ncclResult_t failing_nccl_call(int, int) { return ncclSystemError; }

namespace {

template <class E, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("unexpected exception type: " << e.what());
  }
  FAIL("no exception thrown");
  return {};
}

}  // namespace

// ---- the backend concept and capabilities, at compile time ----
static_assert(comm::backend<Nccl>);
static_assert(Nccl::name == "nccl");
static_assert(!comm::supports_custom_reduction<Nccl>);
static_assert(comm::supports_element<Nccl, comm::half> && comm::supports_element<Nccl, comm::bfloat16>);
static_assert(comm::supports_reduction<Nccl, float, ReduceOp::avg>);
static_assert(comm::supports_reduction<Nccl, std::uint32_t, ReduceOp::avg>);
static_assert(!comm::supports_reduction<Nccl, std::int32_t, ReduceOp::avg>);
static_assert(!comm::supports_reduction<Nccl, std::int32_t, ReduceOp::band>);
static_assert(!comm::supports_reduction<Nccl, std::uint64_t, ReduceOp::bxor>);
static_assert(comm::supports_reduction<Nccl, comm::bfloat16, ReduceOp::prod>);

TEST_CASE("maps: every element type has its NCCL datatype") {
  CHECK(dn::nccl_dtype(Dtype::int8) == ncclInt8);
  CHECK(dn::nccl_dtype(Dtype::uint8) == ncclUint8);
  CHECK(dn::nccl_dtype(Dtype::int32) == ncclInt32);
  CHECK(dn::nccl_dtype(Dtype::uint32) == ncclUint32);
  CHECK(dn::nccl_dtype(Dtype::int64) == ncclInt64);
  CHECK(dn::nccl_dtype(Dtype::uint64) == ncclUint64);
  CHECK(dn::nccl_dtype(Dtype::float16) == ncclFloat16);
  CHECK(dn::nccl_dtype(Dtype::bfloat16) == ncclBfloat16);
  CHECK(dn::nccl_dtype(Dtype::float32) == ncclFloat32);
  CHECK(dn::nccl_dtype(Dtype::float64) == ncclFloat64);
  for (Dtype d : {Dtype::int8, Dtype::uint8, Dtype::int32, Dtype::uint32, Dtype::int64, Dtype::uint64,
                  Dtype::float16, Dtype::bfloat16, Dtype::float32, Dtype::float64}) {
    CHECK(Nccl::supports_dtype(d));
    CHECK(dn::transfer_dtype(d) == dn::nccl_dtype(d));  // only fp8 moves as bytes
    CHECK_FALSE(dn::is_fp8(d));
  }
  // comm::half / bfloat16 and NCCL's 16-bit types have the same size.
  CHECK(sizeof(comm::half) == 2);
  CHECK(sizeof(comm::bfloat16) == 2);
}

TEST_CASE("maps: fp8 element types") {
  CHECK(dn::is_fp8(Dtype::float8_e4m3));
  CHECK(dn::is_fp8(Dtype::float8_e5m2));
  CHECK(dn::transfer_dtype(Dtype::float8_e4m3) == ncclUint8);
  CHECK(Nccl::supports_dtype(Dtype::float8_e5m2));
#if COMM_NCCL_FP8_REDUCTIONS
  CHECK(dn::nccl_dtype(Dtype::float8_e4m3) == ncclFloat8e4m3);
  CHECK(dn::nccl_dtype(Dtype::float8_e5m2) == ncclFloat8e5m2);
  CHECK(Nccl::supports_reduction(ReduceOp::sum, Dtype::float8_e4m3));
#else
  CHECK_FALSE(Nccl::supports_reduction(ReduceOp::sum, Dtype::float8_e4m3));
#endif
}

TEST_CASE("maps: reductions") {
  CHECK(dn::nccl_op(ReduceOp::sum) == ncclSum);
  CHECK(dn::nccl_op(ReduceOp::prod) == ncclProd);
  CHECK(dn::nccl_op(ReduceOp::min) == ncclMin);
  CHECK(dn::nccl_op(ReduceOp::max) == ncclMax);
  CHECK(dn::nccl_op(ReduceOp::avg) == ncclAvg);
  const Dtype all[] = {Dtype::int8,    Dtype::uint8,    Dtype::int32,   Dtype::uint32,  Dtype::int64,
                       Dtype::uint64,  Dtype::float16,  Dtype::bfloat16, Dtype::float32, Dtype::float64};
  for (Dtype d : all) {
    CAPTURE(comm::to_string(d));
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::prod, ReduceOp::min, ReduceOp::max}) CHECK(Nccl::supports_reduction(op, d));
    for (ReduceOp op : {ReduceOp::band, ReduceOp::bor, ReduceOp::bxor}) {
      CHECK_FALSE(Nccl::supports_reduction(op, d));
      CHECK(contains(dn::reduction_unsupported_reason(op, d), "no bitwise"));
    }
    const bool signed_int = d == Dtype::int8 || d == Dtype::int32 || d == Dtype::int64;
    CHECK(Nccl::supports_reduction(ReduceOp::avg, d) == !signed_int);
    if (signed_int) CHECK(contains(dn::reduction_unsupported_reason(ReduceOp::avg, d), "rounds toward zero"));
    CHECK(dn::reduction_unsupported_reason(ReduceOp::sum, d).empty());
  }
}

TEST_CASE("one rank: a pre-multiplied sum NCCL's one-rank kernel would not cover is cut into two it does") {
  // The count seen on an H200 (NCCL 2.28.3 and 2.28.9): avg of 2^20 + 3 floats left 3 unwritten.
  CHECK_FALSE(dn::one_rank_kernel_covers((std::size_t{1} << 20) + 3, 4));
  CHECK_FALSE(dn::one_rank_kernel_covers(65539, 8));
  CHECK(dn::one_rank_kernel_covers(7, 4));
  CHECK(dn::one_rank_kernel_covers(std::size_t{1} << 20, 4));
  std::size_t cut = 0;
  for (std::size_t elt : {std::size_t{1}, std::size_t{2}, std::size_t{4}, std::size_t{8}}) {
    for (std::size_t n = 0; n < 40000; n += 1 + n / 64) {
      for (std::size_t m : {n, n * 37 + 3, n * 1031 + 5}) {
        const std::size_t head = dn::one_rank_head(m, elt);
        CAPTURE(m);
        CAPTURE(elt);
        REQUIRE(head <= m);
        if (head == m) {
          CHECK(dn::one_rank_kernel_covers(m, elt));
          continue;
        }
        ++cut;
        CHECK(head > 0);
        CHECK(dn::one_rank_kernel_covers(head, elt));
        CHECK(dn::one_rank_kernel_covers(m - head, elt));
      }
    }
  }
  CHECK(cut > 100);  // the sweep does reach counts the kernel would not cover
}

TEST_CASE("versions: codes, strings, the loaded library") {
  CHECK(dn::version_code(2, 28, 9) == 22809);
  CHECK(dn::version_code(2, 30, 0) == 23000);
  CHECK(dn::version_code(2, 8, 4) == 2804);
  CHECK(dn::version_code(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH) == NCCL_VERSION_CODE);
  CHECK(comm::nccl::compiled_version == NCCL_VERSION_CODE);
  CHECK(dn::version_string(22809) == "2.28.9");
  CHECK(dn::version_string(23001) == "2.30.1");
  CHECK(dn::version_string(2804) == "2.8.4");
  // ncclGetVersion needs no GPU.
  const int v = comm::nccl::runtime_version();
  MESSAGE("NCCL compiled ", comm::nccl::version_string(comm::nccl::compiled_version), ", loaded ",
          comm::nccl::version_string(v));
  CHECK(v >= dn::version_code(2, 14, 0));
}

TEST_CASE("gather: the path follows the version, the option and COMM_NCCL_GATHER") {
  using G = dn::GatherAlgorithm;
  ScopedEnv unset("COMM_NCCL_GATHER", nullptr);
  const int v228 = dn::version_code(2, 28, 0), v227 = dn::version_code(2, 27, 7);
  CHECK(dn::choose_gather(G::automatic, true, v228, 0) == G::native);
  CHECK(dn::choose_gather(G::automatic, true, v227, 0) == G::p2p);   // older library loaded
  CHECK(dn::choose_gather(G::automatic, false, v228, 0) == G::p2p);  // older nccl.h compiled
  CHECK(dn::choose_gather(G::p2p, true, v228, 0) == G::p2p);
  CHECK(dn::choose_gather(G::native, true, v228, 0) == G::native);
  const auto msg = message_of<comm::InvalidArgument>([&] { (void)dn::choose_gather(G::native, true, v227, 2); });
  CHECK(contains(msg, "nccl.init on rank 2"));
  CHECK(contains(msg, "needs ncclGather (NCCL >= 2.28)"));
  CHECK(contains(msg, "running 2.27.7"));
  {
    ScopedEnv e("COMM_NCCL_GATHER", "p2p");
    CHECK(dn::choose_gather(G::automatic, true, v228, 0) == G::p2p);
    CHECK(dn::choose_gather(G::native, true, v228, 0) == G::native);  // the option wins
  }
  {
    ScopedEnv e("COMM_NCCL_GATHER", " native ");
    CHECK(dn::choose_gather(G::automatic, true, v228, 0) == G::native);
    CHECK_THROWS_AS((void)dn::choose_gather(G::automatic, true, v227, 0), comm::InvalidArgument);
  }
  {
    ScopedEnv e("COMM_NCCL_GATHER", "auto");
    CHECK(dn::choose_gather(G::automatic, true, v227, 0) == G::p2p);
  }
  {
    ScopedEnv e("COMM_NCCL_GATHER", "ring");
    const auto bad = message_of<comm::InvalidArgument>([&] { (void)dn::choose_gather(G::automatic, true, v228, 1); });
    CHECK(contains(bad, "COMM_NCCL_GATHER='ring' is not auto, native or p2p"));
  }
#if COMM_NCCL_HAS_GATHER
  CHECK(NCCL_VERSION_CODE >= 22800);
#endif
}

TEST_CASE("errors: COMM_NCCL_CHECK keeps the code and NCCL's text") {
  CHECK(COMM_NCCL_CHECK(ncclSuccess, "all_reduce", 0, nullptr) == ncclSuccess);
  CHECK(COMM_NCCL_CHECK(ncclInProgress, "all_reduce", 0, nullptr) == ncclInProgress);

  auto remote = [] { (void)COMM_NCCL_CHECK(ncclRemoteError, "all_reduce", 3, nullptr); };
  const auto m = message_of<comm::RemoteError>(remote);
  CHECK(contains(m, "comm: all_reduce on rank 3: ncclRemoteError failed:"));
  CHECK(contains(m, "[ncclRemoteError = 6]"));
  CHECK(contains(m, ncclGetErrorString(ncclRemoteError)));
  try {
    remote();
  } catch (const comm::Error& e) {
    REQUIRE(comm::nccl::nccl_result_of(e).has_value());
    CHECK(*comm::nccl::nccl_result_of(e) == ncclRemoteError);
    CHECK_FALSE(comm::nccl::cuda_error_of(e).has_value());
    CHECK(e.op() == "all_reduce");
    CHECK(e.rank() == 3);
  }
  CHECK_THROWS_AS((void)COMM_NCCL_CHECK(ncclInvalidArgument, "broadcast", 0, nullptr), comm::InvalidArgument);
  CHECK_THROWS_AS((void)COMM_NCCL_CHECK(ncclInvalidUsage, "broadcast", 0, nullptr), comm::InvalidArgument);
  CHECK_THROWS_AS((void)COMM_NCCL_CHECK(ncclSystemError, "broadcast", 0, nullptr), comm::BackendError);
  CHECK_THROWS_AS((void)COMM_NCCL_CHECK(ncclUnhandledCudaError, "broadcast", 0, nullptr), comm::BackendError);
  CHECK_THROWS_AS((void)COMM_NCCL_CHECK(ncclInternalError, "broadcast", 0, nullptr), comm::BackendError);
  // The call's name, not its arguments, goes into the message.
  const auto named = message_of<comm::BackendError>([] {
    (void)COMM_NCCL_CHECK(::failing_nccl_call(1, 2), "init", -1, nullptr);
  });
  CHECK(contains(named, "comm: init: failing_nccl_call failed:"));
  CHECK(contains(named, "[ncclSystemError = 2]"));
}

TEST_CASE("errors: COMM_CUDA_CHECK keeps the code and CUDA's text") {
  CHECK_NOTHROW(COMM_CUDA_CHECK(cudaSuccess, "x", 0));
  const auto m = message_of<comm::BackendError>([] { COMM_CUDA_CHECK(cudaErrorInvalidValue, "gather", 1); });
  CHECK(contains(m, "comm: gather on rank 1: cudaErrorInvalidValue failed:"));
  CHECK(contains(m, "[cudaErrorInvalidValue = 1]"));
  CHECK(contains(m, cudaGetErrorString(cudaErrorInvalidValue)));
  try {
    COMM_CUDA_CHECK(cudaErrorMemoryAllocation, "all_gather", 0);
  } catch (const comm::Error& e) {
    REQUIRE(comm::nccl::cuda_error_of(e).has_value());
    CHECK(*comm::nccl::cuda_error_of(e) == cudaErrorMemoryAllocation);
    CHECK_FALSE(comm::nccl::nccl_result_of(e).has_value());
  }
  CHECK(dn::call_name("cudaEventRecord(ready_, caller)") == "cudaEventRecord");
  CHECK(dn::call_name("::ncclAllReduce (a, b)") == "ncclAllReduce");
  // Errors that did not come from an engine carry no code.
  CHECK_FALSE(comm::nccl::nccl_result_of(comm::Timeout("x", 0, "y")).has_value());
}

TEST_CASE("errors: faults become errors of their kind, and later errors quote the first") {
  dn::Fault f;
  f.kind = dn::Fault::Kind::remote;
  f.detail = "peer went away";
  f.code = static_cast<int>(ncclRemoteError);
  auto e = dn::make_error(f, "broadcast", 2);
  CHECK_THROWS_AS(std::rethrow_exception(e), comm::RemoteError);
  CHECK(dn::kind_of(e) == dn::Fault::Kind::remote);
  auto later = dn::derived_error(e, "gather", 2, "not run");
  CHECK_THROWS_AS(std::rethrow_exception(later), comm::RemoteError);
  const auto m = dn::what_of(later);
  CHECK(contains(m, "comm: gather on rank 2: not run: comm: broadcast on rank 2: peer went away"));
  f.kind = dn::Fault::Kind::timeout;
  f.code = -1;
  CHECK_THROWS_AS(std::rethrow_exception(dn::make_error(f, "x", 0)), comm::Timeout);
  f.kind = dn::Fault::Kind::backend;
  CHECK_THROWS_AS(std::rethrow_exception(dn::make_error(f, "x", 0)), comm::BackendError);
}

TEST_CASE("streams: the current stream is per thread and scoped by StreamGuard") {
  auto* s1 = reinterpret_cast<cudaStream_t>(std::uintptr_t{0x1000});
  auto* s2 = reinterpret_cast<cudaStream_t>(std::uintptr_t{0x2000});
  CHECK(comm::nccl::current_stream() == nullptr);
  {
    comm::nccl::StreamGuard a(s1);
    CHECK(comm::nccl::current_stream() == s1);
    {
      comm::nccl::StreamGuard b(s2);
      CHECK(comm::nccl::current_stream() == s2);
      cudaStream_t seen = s1;
      std::thread([&] { seen = comm::nccl::current_stream(); }).join();
      CHECK(seen == nullptr);  // another thread has its own
    }
    CHECK(comm::nccl::current_stream() == s1);
  }
  CHECK(comm::nccl::current_stream() == nullptr);
}

TEST_CASE("devices: device_count says why none is usable") {
  const auto dc = comm::nccl::device_count();
  if (dc.count > 0) {
    CHECK(dc.why.empty());
    MESSAGE(dc.count, " CUDA device(s) usable");
  } else {
    CHECK(contains(dc.why, "cudaGetDeviceCount"));
    MESSAGE("no CUDA device: ", dc.why);
  }
}

TEST_CASE("arguments: checked before any device or store is used") {
  Nccl::Options o;
  auto store = std::make_shared<comm::HashStore>(std::chrono::seconds(5));
  CHECK(contains(message_of<comm::InvalidArgument>([&] { (void)Nccl::create(nullptr, 0, 1, o); }), "store is null"));
  CHECK(contains(message_of<comm::InvalidArgument>([&] { (void)Nccl::create(store, 2, 2, o); }),
                 "rank 2 is out of range [0, 2)"));
  CHECK(contains(message_of<comm::InvalidArgument>([&] { (void)Nccl::create(store, 0, 0, o); }),
                 "size 0 must be at least 1"));
  o.timeout = std::chrono::milliseconds(0);
  CHECK(contains(message_of<comm::InvalidArgument>([&] { (void)Nccl::create(store, 0, 1, o); }),
                 "nccl.init on rank 0: timeout 0 ms must be positive"));
  o = {};
  o.watchdog_interval = std::chrono::milliseconds(-1);
  CHECK(contains(message_of<comm::InvalidArgument>([&] { (void)Nccl::create(store, 0, 1, o); }),
                 "watchdog_interval -1 ms must be positive"));
  o = {};
  o.device = -2;
  CHECK(contains(message_of<comm::InvalidArgument>([&] { (void)Nccl::create(store, 0, 1, o); }),
                 "device -2 is not -1 or a device"));
  CHECK(contains(message_of<comm::InvalidArgument>([] { (void)Nccl::adopt(nullptr, nullptr); }),
                 "nccl.adopt: the NCCL communicator is null"));
  CHECK(contains(message_of<comm::InvalidArgument>([] { (void)Comm::adopt(ncclComm_t{}, cudaStream_t{}); }),
                 "is null"));
  CHECK(store->num_keys() == 0);  // nothing reached the store
}

int nccl_odr_second_tu();  // odr_second_tu.cpp

TEST_CASE("odr: a second translation unit includes the backend too") { CHECK(nccl_odr_second_tu() == 1); }
