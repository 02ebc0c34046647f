// Without a usable GPU, constructing an NCCL communicator is a clear comm::Error on every rank,
// promptly, and the other ranks are told through the store. (Skipped where a GPU is usable.)
#include "nccl_test_util.hpp"

#include <chrono>
#include <cstdlib>
#include <string>
#include <support/env_guard.hpp>

using namespace nccl_test;
using namespace std::chrono_literals;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// Skips the case where a GPU is usable: the no-GPU path cannot be exercised there.
#define NCCL_REQUIRE_NO_GPU()                                                                  \
  do {                                                                                         \
    if (comm::nccl::device_count().count > 0) {                                                \
      ::nccl_test::report_skip("a CUDA device is usable here; the no-GPU path is not exercised"); \
      return;                                                                                  \
    }                                                                                          \
  } while (0)

using comm::test::ScopedEnv;

void check_no_gpu_error(const comm::BackendError& e, int rank) {
  const std::string m = e.what();
  INFO("message: ", m);
  CHECK(contains(m, "comm: nccl.init on rank " + std::to_string(rank) + ": no usable CUDA device (cudaGetDeviceCount: "));
  CHECK(contains(m, "the NCCL backend needs a GPU"));
  CHECK(e.op() == "nccl.init");
  CHECK(e.rank() == rank);
  const auto dc = comm::nccl::device_count();
  if (dc.error != cudaSuccess) {
    REQUIRE(comm::nccl::cuda_error_of(e).has_value());
    CHECK(*comm::nccl::cuda_error_of(e) == dc.error);
  }
}

}  // namespace

TEST_CASE("no GPU: create() throws a clear BackendError on every rank, fast") {
  NCCL_REQUIRE_NO_GPU();
  const auto& w = comm::test::world();
  auto store = comm::test::fresh_store();
  const auto t0 = std::chrono::steady_clock::now();
  bool thrown = false;
  try {
    auto c = Comm::create(store, w.rank, w.size);
  } catch (const comm::BackendError& e) {
    thrown = true;
    check_no_gpu_error(e, w.rank);
  }
  CHECK(thrown);
  CHECK(std::chrono::steady_clock::now() - t0 < 10s);
  // Each rank told the others (so none waits for its deadline).
  CHECK(store->check("comm/nccl/1/failed"));
  comm::test::barrier();
}

TEST_CASE("no GPU: the second communicator on a store fails the same way") {
  NCCL_REQUIRE_NO_GPU();
  const auto& w = comm::test::world();
  auto store = comm::test::fresh_store();
  for (int i = 0; i < 2; ++i) CHECK_THROWS_AS((void)Comm::create(store, w.rank, w.size), comm::BackendError);
  CHECK(store->check("comm/nccl/2/failed"));
  comm::test::barrier();
}

TEST_CASE("no GPU: from_env() says why") {
  NCCL_REQUIRE_NO_GPU();
  // With several ranks, rank 0 (hosting the env:// store) may fail and leave before the others
  // have connected; one rank shows the message without that race.
  if (comm::test::world().size != 1) {
    report_skip("runs with one rank only");
    return;
  }
  ScopedEnv port("MASTER_PORT", std::to_string(comm::test::shared_free_port()));
  ScopedEnv own_store("COMM_AGENT_STORE", nullptr);  // rank 0 hosts this one (comm-run hosts the harness's)
  try {
    auto c = Comm::from_env();
    FAIL("no error");
  } catch (const comm::BackendError& e) {
    check_no_gpu_error(e, 0);
  }
}

TEST_CASE("no GPU: explicit device options do not hide the cause") {
  NCCL_REQUIRE_NO_GPU();
  comm::backends::Nccl::Options o;
  o.device = 3;
  o.gather = comm::nccl::GatherAlgorithm::p2p;
  const auto& w = comm::test::world();
  CHECK_THROWS_AS((void)Comm::create(comm::test::fresh_store(), w.rank, w.size, o), comm::BackendError);
  comm::test::barrier();
}

TEST_CASE("no GPU: the GPU tests' skip message") {
  NCCL_REQUIRE_NO_GPU();
  const auto why = gpu_skip_reason();
  CHECK(contains(why, "no usable CUDA device (cudaGetDeviceCount: "));
}
