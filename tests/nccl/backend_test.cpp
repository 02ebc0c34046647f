// The NCCL backend as a whole on a GPU: stream semantics (the caller's current stream, a stream of
// the user's, Work::wait), the watchdog ending a stuck operation with Timeout and aborting, adopt(),
// from_env(), device-pointer checks, runtime ReduceOp checks, several communicators, destruction
// with work in flight. Skipped with the reason printed where no GPU (or not enough) is usable.
#include "nccl_test_util.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>
#include <support/env_guard.hpp>

using namespace nccl_test;
using namespace std::chrono_literals;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

using comm::test::ScopedEnv;

/// A CUDA stream for the test's duration.
class Stream {
 public:
  Stream() { NCCL_TEST_CUDA(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~Stream() {
    if (s_ != nullptr) (void)cudaStreamDestroy(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  operator cudaStream_t() const noexcept { return s_; }  // NOLINT

 private:
  cudaStream_t s_ = nullptr;
};

/// Pinned host memory, so that async copies are truly asynchronous.
template <class T>
class Pinned {
 public:
  explicit Pinned(std::size_t n) : n_(n) { NCCL_TEST_CUDA(cudaMallocHost(reinterpret_cast<void**>(&p_), n * sizeof(T))); }
  ~Pinned() {
    if (p_ != nullptr) (void)cudaFreeHost(p_);
  }
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
  T* data() noexcept { return p_; }
  T& operator[](std::size_t i) noexcept { return p_[i]; }

 private:
  T* p_ = nullptr;
  std::size_t n_;
};

/// A host function that blocks its stream until released (or until `limit`), to hold an
/// operation back without a kernel.
struct Gate {
  std::atomic<bool> open{false};
  std::chrono::steady_clock::time_point limit = std::chrono::steady_clock::now() + 20s;
  static void CUDART_CB hold(void* p) {
    auto* g = static_cast<Gate*>(p);
    while (!g->open.load() && std::chrono::steady_clock::now() < g->limit) std::this_thread::sleep_for(1ms);
  }
};

}  // namespace

TEST_CASE("streams: operations are ordered after the caller's current stream, and it after them") {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  Stream s;
  constexpr std::size_t n = std::size_t{16} << 20;  // 64 MiB of int32: long enough to expose a race
  DeviceBuffer<std::int32_t> d(n);
  Pinned<std::int32_t> host(n);
  for (int round = 0; round < 3; ++round) {
    const int byte = round + 1;
    {
      comm::nccl::StreamGuard g(s);
      NCCL_TEST_CUDA(cudaMemsetAsync(d.data(), byte, n * sizeof(std::int32_t), s));  // queued on s
      c.all_reduce(d.span());  // must read what the memset wrote
      NCCL_TEST_CUDA(cudaMemcpyAsync(host.data(), d.data(), n * sizeof(std::int32_t), cudaMemcpyDeviceToHost, s));
    }
    NCCL_TEST_CUDA(cudaStreamSynchronize(s));
    std::int32_t one = 0;
    std::memset(&one, byte, sizeof(one));
    const std::int32_t want = one * c.size();
    CHECK(host[0] == want);
    CHECK(host[n / 2] == want);
    CHECK(host[n - 1] == want);
  }
}

TEST_CASE("streams: Work::wait orders the waiting thread's current stream after the operation") {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  Stream s;
  constexpr std::size_t n = std::size_t{8} << 20;
  DeviceBuffer<float> d(std::vector<float>(n, 1.0f));
  Pinned<float> host(n);
  comm::nccl::StreamGuard g(s);
  auto w = c.all_reduce(d.span(), comm::async);
  w.wait();  // s waits for the all_reduce; the host does not
  NCCL_TEST_CUDA(cudaMemcpyAsync(host.data(), d.data(), n * sizeof(float), cudaMemcpyDeviceToHost, s));
  NCCL_TEST_CUDA(cudaStreamSynchronize(s));
  CHECK(host[n - 1] == float(c.size()));
  w.synchronize();  // host-blocking form
  CHECK(w.is_completed());
}

TEST_CASE("streams: a user stream in the options is the communicator's stream") {
  NCCL_REQUIRE_GPU();
  Stream s;
  comm::backends::Nccl::Options o;
  o.stream = static_cast<cudaStream_t>(s);
  auto c = make_comm(o);
  CHECK(c.backend().stream() == static_cast<cudaStream_t>(s));
  DeviceBuffer<double> d(std::vector<double>(1000, 2.0));
  comm::nccl::StreamGuard g(s);  // same stream: no cross-stream events
  c.all_reduce(d.span());
  c.all_reduce(d.span());
  NCCL_TEST_CUDA(cudaStreamSynchronize(s));
  const double n = c.size();
  CHECK(d.download()[999] == 2.0 * n * n);
}

TEST_CASE("synchronize: waits on the host for everything issued") {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  DeviceBuffer<float> d(std::vector<float>(1 << 20, 1.0f));
  for (int i = 0; i < 5; ++i) c.all_reduce(d.span());
  c.backend().synchronize();
  float x = 0;
  NCCL_TEST_CUDA(cudaMemcpy(&x, d.data(), sizeof(float), cudaMemcpyDeviceToHost));
  float want = 1.0f;
  for (int i = 0; i < 5; ++i) want *= float(c.size());
  CHECK(x == want);
}

TEST_CASE("watchdog: a stuck operation ends with Timeout naming it and the rank; the communicator is aborted") {
  NCCL_REQUIRE_GPU();
  if (comm::test::world().size != 1) {
    report_skip("holds the stream of one rank; runs with one rank");
    return;
  }
  comm::backends::Nccl::Options o;
  o.timeout = 1500ms;
  auto c = make_comm(o);
  DeviceBuffer<float> d(std::vector<float>(16, 1.0f));
  Gate gate;
  gate.limit = std::chrono::steady_clock::now() + 4s;  // releases the stream even if the test fails
  NCCL_TEST_CUDA(cudaLaunchHostFunc(c.backend().stream(), &Gate::hold, &gate));
  auto w = c.all_reduce(d.span(), comm::async);
  const auto t0 = std::chrono::steady_clock::now();
  std::string msg;
  try {
    w.synchronize();  // a host wait: Work::wait on NCCL only orders the caller's stream
  } catch (const comm::Timeout& e) {
    msg = e.what();
  }
  const auto took = std::chrono::steady_clock::now() - t0;
  gate.open = true;
  INFO("message: ", msg);
  CHECK(contains(msg, "comm: all_reduce on rank 0"));
  CHECK(took < 10s);
  // Later operations fail at once with the first cause, also while the watchdog is still inside
  // NCCL's abort (which took a second on an H200 with NCCL 2.28.3).
  const auto t1 = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(c.all_reduce(d.span()), comm::Timeout);
  CHECK(std::chrono::steady_clock::now() - t1 < 200ms);
  CHECK(c.backend().failure() != nullptr);
}

TEST_CASE("adopt: reuses an existing NCCL communicator without owning it") {
  NCCL_REQUIRE_GPU();
  const auto& w = comm::test::world();
  ncclComm_t raw = raw_nccl_comm();
  Stream s;
  DeviceBuffer<std::int64_t> d(std::vector<std::int64_t>(5, 3));
  {
    auto c = Comm::adopt(raw, static_cast<cudaStream_t>(s));
    CHECK(c.rank() == w.rank);
    CHECK(c.size() == w.size);
    CHECK(c.backend().native_handle() == raw);
    CHECK(c.backend().stream() == static_cast<cudaStream_t>(s));
    c.all_reduce(d.span());
  }
  // Still usable by its owner after the comm::Communicator is gone.
  REQUIRE(ncclAllReduce(d.data(), d.data(), 5, ncclInt64, ncclSum, raw, s) == ncclSuccess);
  NCCL_TEST_CUDA(cudaStreamSynchronize(s));
  CHECK(d.download() == std::vector<std::int64_t>(5, 3 * std::int64_t{w.size} * w.size));
  CHECK(ncclCommDestroy(raw) == ncclSuccess);
}

TEST_CASE("construction: from_env (env:// rendezvous), device from LOCAL_RANK") {
  NCCL_REQUIRE_GPU();
  ScopedEnv port("MASTER_PORT", std::to_string(comm::test::shared_free_port()));
  ScopedEnv own_store("COMM_AGENT_STORE", nullptr);  // rank 0 hosts this one (comm-run hosts the harness's)
  auto c = Comm::from_env();
  CHECK(c.rank() == comm::test::world().rank);
  CHECK(c.size() == comm::test::world().size);
  const char* lr = std::getenv("LOCAL_RANK");
  const int local = lr ? std::atoi(lr) : c.rank();
  CHECK(c.backend().device() == local % comm::nccl::device_count().count);
  DeviceBuffer<std::int32_t> d(std::vector<std::int32_t>{c.rank()});
  DeviceBuffer<std::int32_t> all(static_cast<std::size_t>(c.size()));
  c.all_gather(d.cspan(), all.span());
  const auto got = all.download();
  for (int r = 0; r < c.size(); ++r) CHECK(got[static_cast<std::size_t>(r)] == r);
}

TEST_CASE("arguments: host memory, runtime ReduceOps NCCL lacks, and sizes: InvalidArgument, still usable") {
  NCCL_REQUIRE_GPU();
  auto c = make_comm();
  const std::string rank = "on rank " + std::to_string(c.rank());
  std::vector<float> host(8, 1.0f);
  try {
    c.all_reduce(host);
    FAIL("no error");
  } catch (const comm::InvalidArgument& e) {
    CHECK(contains(e.what(), "all_reduce " + rank));
    CHECK(contains(e.what(), "input is host memory"));
  }
  DeviceBuffer<std::int32_t> di(std::vector<std::int32_t>(4, 1));
  try {
    c.all_reduce(di.span(), ReduceOp::band);
    FAIL("no error");
  } catch (const comm::InvalidArgument& e) {
    CHECK(contains(e.what(), "reduction band is not supported for element type int32 by the nccl backend"));
  }
  CHECK_THROWS_AS(c.all_reduce(di.span(), ReduceOp::avg), comm::InvalidArgument);
  DeviceBuffer<std::int32_t> small(3);
  CHECK_THROWS_AS(c.all_reduce(di.cspan(), small.span()), comm::InvalidArgument);
  // Still usable.
  c.all_reduce(di.span());
  CHECK(di.download() == std::vector<std::int32_t>(4, c.size()));
  // Checks can be turned off (the caller vouches for the pointers).
  comm::backends::Nccl::Options o;
  o.check_pointers = false;
  auto unchecked = make_comm(o);
  unchecked.all_reduce(di.span());
  CHECK(di.download() == std::vector<std::int32_t>(4, c.size() * c.size()));
}

TEST_CASE("options: a device that does not exist, forcing a gather path NCCL lacks") {
  NCCL_REQUIRE_GPU();
  comm::backends::Nccl::Options o;
  o.device = comm::nccl::device_count().count;
  const auto& w = comm::test::world();
  try {
    (void)Comm::create(comm::test::fresh_store(), w.rank, w.size, o);
    FAIL("no error");
  } catch (const comm::InvalidArgument& e) {
    CHECK(contains(e.what(), "does not exist"));
  }
  comm::test::barrier();
  if (comm::nccl::runtime_version() < 22800 || !COMM_NCCL_HAS_GATHER) {
    comm::backends::Nccl::Options g;
    g.gather = comm::nccl::GatherAlgorithm::native;
    CHECK_THROWS_AS((void)Comm::create(comm::test::fresh_store(), w.rank, w.size, g), comm::InvalidArgument);
    comm::test::barrier();
  }
  ScopedEnv env("COMM_NCCL_GATHER", "p2p");
  auto c = make_comm();
  CHECK(c.backend().gather_algorithm() == comm::nccl::GatherAlgorithm::p2p);
}

TEST_CASE("several communicators at once, interleaved") {
  NCCL_REQUIRE_GPU();
  auto a = make_comm();
  auto b = make_comm();
  DeviceBuffer<float> x(std::vector<float>(100, 1.0f)), y(std::vector<float>(100, 2.0f));
  for (int i = 0; i < 4; ++i) {
    auto wa = a.all_reduce(x.span(), comm::async);
    b.all_reduce(y.span());
    wa.wait();
  }
  float n4 = 1.0f;
  for (int i = 0; i < 4; ++i) n4 *= float(a.size());
  CHECK(x.download()[0] == n4);
  CHECK(y.download()[0] == 2.0f * n4);
}

TEST_CASE("destruction waits for work in flight; Work outlives the communicator") {
  NCCL_REQUIRE_GPU();
  DeviceBuffer<float> d(std::vector<float>(1 << 20, 1.0f));
  std::vector<comm::Work> works;
  {
    auto c = make_comm();
    for (int i = 0; i < 8; ++i) works.push_back(c.all_reduce(d.span(), comm::async));
  }
  for (auto& w : works) {
    CHECK(w.is_completed());
    CHECK_NOTHROW(w.wait());
  }
}

TEST_CASE("moved communicators keep working") {
  NCCL_REQUIRE_GPU();
  auto a = make_comm();
  Comm b = std::move(a);
  DeviceBuffer<std::uint8_t> d(std::vector<std::uint8_t>(3, 1));
  b.all_reduce(d.span(), comm::op::max);
  CHECK(d.download() == std::vector<std::uint8_t>(3, 1));
}
