// CUDA device buffers on the Gloo backend (detail/gloo/device_staging.hpp): every collective,
// blocking and async, on device memory of device 0 shared by all ranks, in every mix of host and
// device arguments (mixed across ranks too), in-place forms, and async chains on one device
// buffer (copies happen in issue order). Device memory comes from the same driver loader
// (cuMemAlloc). Where no CUDA driver or device is usable every case prints why and skips.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include <comm/backends/shm.hpp>
#include <comm/detail/cuda/driver.hpp>

#include "backend_test_util.hpp"

#if defined(COMM_TEST_CUDA_HEADERS)
#include <cuda.h>
// The constants cuda_driver.hpp declares itself must be the driver ABI's.
static_assert(comm::detail::cuda::kAttrContext == CU_POINTER_ATTRIBUTE_CONTEXT);
static_assert(comm::detail::cuda::kAttrMemoryType == CU_POINTER_ATTRIBUTE_MEMORY_TYPE);
static_assert(comm::detail::cuda::kAttrIsManaged == CU_POINTER_ATTRIBUTE_IS_MANAGED);
static_assert(comm::detail::cuda::kAttrDeviceOrdinal == CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL);
static_assert(comm::detail::cuda::kMemoryTypeDevice == CU_MEMORYTYPE_DEVICE);
static_assert(comm::detail::cuda::kHostAllocPortable == CU_MEMHOSTALLOC_PORTABLE);
static_assert(comm::detail::cuda::kMemAttachGlobal == CU_MEM_ATTACH_GLOBAL);
static_assert(comm::detail::cuda::kSuccess == CUDA_SUCCESS);
static_assert(sizeof(comm::detail::cuda::CUdeviceptr) == sizeof(CUdeviceptr));
#endif

using namespace suite;
namespace cu = comm::detail::cuda;

namespace {

/// Why device tests cannot run here ("" when they can); the same on every rank of one host.
std::string skip_reason() {
  if (!cu::driver_usable()) return "no usable CUDA driver/device (" + cu::Driver::get().why_not() + ")";
  return {};
}

#define STAGING_REQUIRE_GPU()                                                                \
  do {                                                                                       \
    if (const std::string why_ = skip_reason(); !why_.empty()) {                             \
      if (comm::test::world().rank == 0)                                                     \
        std::printf("SKIPPED '%s': %s\n", comm::test::current_test().c_str(), why_.c_str()); \
      MESSAGE("skipped: ", why_);                                                            \
      return;                                                                                \
    }                                                                                        \
  } while (0)

void check_cu(cu::CUresult r, const char* what) {
  if (r != cu::kSuccess) FAIL(cu::Driver::get().describe(what, r));
}

/// `n` elements of T in device memory of device 0 (managed memory with `managed`).
template <class T>
class DeviceVec {
 public:
  explicit DeviceVec(std::size_t n, bool managed = false) : n_(n) {
    auto& d = cu::Driver::get();
    cu::ScopedContext scope(d.primary_context(0, "test", -1), "test", -1);
    const std::size_t bytes = n == 0 ? 1 : n * sizeof(T);
    check_cu(managed ? d.api().mem_alloc_managed(&p_, bytes, cu::kMemAttachGlobal) : d.api().mem_alloc(&p_, bytes),
             "cuMemAlloc");
  }
  explicit DeviceVec(const std::vector<T>& v) : DeviceVec(v.size()) { upload(v); }
  DeviceVec(const DeviceVec&) = delete;
  DeviceVec& operator=(const DeviceVec&) = delete;
  ~DeviceVec() {
    auto& d = cu::Driver::get();
    cu::ScopedContext scope(d.primary_context(0, "test", -1), "test", -1);
    (void)d.api().mem_free(p_);
  }
  [[nodiscard]] T* data() const { return reinterpret_cast<T*>(p_); }
  [[nodiscard]] std::span<T> span() const { return {data(), n_}; }
  [[nodiscard]] std::span<const T> cspan() const { return {data(), n_}; }
  void upload(const std::vector<T>& v) const {
    REQUIRE(v.size() == n_);
    cu::copy_to_device(data(), v.data(), n_ * sizeof(T), cu::pointer_info(data()), "test", -1);
  }
  [[nodiscard]] std::vector<T> download() const {
    std::vector<T> v(n_);
    cu::copy_to_host(v.data(), data(), n_ * sizeof(T), cu::pointer_info(data()), "test", -1);
    return v;
  }

 private:
  std::size_t n_;
  cu::CUdeviceptr p_ = 0;
};

template <class T>
std::vector<T> inputs(int rank, std::size_t n, ReduceOp op) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = input_value<T>(rank, i, op);
  return v;
}

template <class T>
std::vector<T> reduced(ReduceOp op, int size, std::size_t n, std::size_t offset = 0) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = reference<T>(op, size, offset + i);
  return v;
}

/// Everyone's inputs in rank order (what all_gather/gather produce).
template <class T>
std::vector<T> gathered(int size, std::size_t n) {
  std::vector<T> v;
  for (int r = 0; r < size; ++r) {
    const auto x = inputs<T>(r, n, ReduceOp::min);
    v.insert(v.end(), x.begin(), x.end());
  }
  return v;
}

template <class T>
bool equal(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!same(a[i], b[i])) {
      MESSAGE("element ", i, ": got ", show(a[i]), ", expected ", show(b[i]));
      return false;
    }
  return true;
}

/// Sizes across the pool's block sizes: tiny, odd, and above the 64 KiB minimum block.
const std::size_t kSizes[] = {1, 7, 1000, 40000};

}  // namespace

TEST_CASE("device staging: pointer classification") {
  STAGING_REQUIRE_GPU();
  DeviceVec<float> dev(16);
  DeviceVec<float> managed(16, true);
  std::vector<float> host(16);
  CHECK(cu::is_device_pointer(dev.data()));
  CHECK(cu::pointer_info(dev.data()).ordinal == 0);
  CHECK_FALSE(cu::is_device_pointer(host.data()));
  CHECK_FALSE(cu::is_device_pointer(managed.data()));  // managed memory counts as host
  CHECK_FALSE(cu::is_device_pointer(nullptr));
  auto& d = cu::Driver::get();
  void* pinned = nullptr;
  {
    cu::ScopedContext scope(d.primary_context(0, "test", -1), "test", -1);
    check_cu(d.api().mem_host_alloc(&pinned, 64, cu::kHostAllocPortable), "cuMemHostAlloc");
  }
  CHECK_FALSE(cu::is_device_pointer(pinned));
  {
    cu::ScopedContext scope(d.primary_context(0, "test", -1), "test", -1);
    (void)d.api().mem_free_host(pinned);
  }
}

TEST_CASE_TEMPLATE("device staging: all_reduce, every op, in place and out of place, blocking and async", T, float,
                   std::int32_t, comm::half) {
  STAGING_REQUIRE_GPU();
  auto c = make_comm();
  const int n = c.size(), r = c.rank();
  for (std::size_t count : kSizes) {
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::prod, ReduceOp::min, ReduceOp::max, ReduceOp::avg}) {
      INFO("all_reduce ", type_name(comm::dtype_of<T>), " ", comm::to_string(op), " count=", count);
      const auto want = reduced<T>(op, n, count);
      DeviceVec<T> d(inputs<T>(r, count, op));
      c.all_reduce(d.span(), op);
      CHECK(equal(d.download(), want));
      d.upload(inputs<T>(r, count, op));
      c.all_reduce(d.span(), op, comm::async).wait();
      CHECK(equal(d.download(), want));
      DeviceVec<T> in(inputs<T>(r, count, op)), out(count);
      c.all_reduce(in.cspan(), out.span(), op);
      CHECK(equal(out.download(), want));
      CHECK(equal(in.download(), inputs<T>(r, count, op)));  // the input is not written
    }
  }
}

TEST_CASE("device staging: every collective with host/device mixes, blocking and async") {
  STAGING_REQUIRE_GPU();
  using T = float;
  auto c = make_comm();
  const int n = c.size(), r = c.rank();
  const auto un = static_cast<std::size_t>(n);
  for (std::size_t count : kSizes) {
    CAPTURE(count);
    for (int mix = 0; mix < 3; ++mix) {  // 0: both device, 1: host in / device out, 2: device in / host out
      CAPTURE(mix);
      const bool din = mix != 1, dout = mix != 2;
      for (bool async : {false, true}) {
        CAPTURE(async);
        auto run = [&](auto&& call) {
          if (async)
            call(comm::async).wait();
          else
            call();
        };
        // all_reduce
        {
          const auto hin = inputs<T>(r, count, ReduceOp::sum);
          DeviceVec<T> din_v(hin), dout_v(count);
          std::vector<T> hout(count);
          std::span<const T> in = din ? din_v.cspan() : std::span<const T>(hin);
          std::span<T> out = dout ? dout_v.span() : std::span<T>(hout);
          run([&](auto... a) { return c.all_reduce(in, out, ReduceOp::sum, a...); });
          CHECK(equal(dout ? dout_v.download() : hout, reduced<T>(ReduceOp::sum, n, count)));
        }
        // reduce_scatter
        {
          const auto hin = inputs<T>(r, un * count, ReduceOp::max);
          DeviceVec<T> din_v(hin), dout_v(count);
          std::vector<T> hout(count);
          std::span<const T> in = din ? din_v.cspan() : std::span<const T>(hin);
          std::span<T> out = dout ? dout_v.span() : std::span<T>(hout);
          run([&](auto... a) { return c.reduce_scatter(in, out, ReduceOp::max, a...); });
          CHECK(equal(dout ? dout_v.download() : hout,
                      reduced<T>(ReduceOp::max, n, count, static_cast<std::size_t>(r) * count)));
        }
        // all_gather
        {
          const auto hin = inputs<T>(r, count, ReduceOp::min);
          DeviceVec<T> din_v(hin), dout_v(un * count);
          std::vector<T> hout(un * count);
          std::span<const T> in = din ? din_v.cspan() : std::span<const T>(hin);
          std::span<T> out = dout ? dout_v.span() : std::span<T>(hout);
          run([&](auto... a) { return c.all_gather(in, out, a...); });
          CHECK(equal(dout ? dout_v.download() : hout, gathered<T>(n, count)));
        }
        // gather to every root (the output exists on the root only)
        for (int root = 0; root < n; ++root) {
          CAPTURE(root);
          const auto hin = inputs<T>(r, count, ReduceOp::min);
          DeviceVec<T> din_v(hin), dout_v(r == root ? un * count : 0);
          std::vector<T> hout(r == root ? un * count : 0);
          std::span<const T> in = din ? din_v.cspan() : std::span<const T>(hin);
          std::span<T> out = dout ? dout_v.span() : std::span<T>(hout);
          run([&](auto... a) { return c.gather(in, out, root, a...); });
          if (r == root) CHECK(equal(dout ? dout_v.download() : hout, gathered<T>(n, count)));
        }
        // broadcast from every root; the ranks of odd (rank + mix) use host memory
        for (int root = 0; root < n; ++root) {
          CAPTURE(root);
          const bool on_device = (r + mix) % 2 == 0;
          auto mine = inputs<T>(r, count, ReduceOp::max);
          DeviceVec<T> dv(mine);
          std::span<T> data = on_device ? dv.span() : std::span<T>(mine);
          run([&](auto... a) { return c.broadcast(data, root, a...); });
          CHECK(equal(on_device ? dv.download() : mine, inputs<T>(root, count, ReduceOp::max)));
        }
      }
    }
  }
}

TEST_CASE("device staging: in-place all_gather on a device buffer") {
  STAGING_REQUIRE_GPU();
  using T = std::int64_t;
  auto c = make_comm();
  const int n = c.size(), r = c.rank();
  const std::size_t count = 33, slot = static_cast<std::size_t>(r) * count;
  std::vector<T> init(static_cast<std::size_t>(n) * count, -1);
  const auto mine = inputs<T>(r, count, ReduceOp::min);
  std::copy(mine.begin(), mine.end(), init.begin() + static_cast<std::ptrdiff_t>(slot));
  DeviceVec<T> d(init);
  c.all_gather(std::span<const T>(d.data() + slot, count), d.span());
  CHECK(equal(d.download(), gathered<T>(n, count)));
}

TEST_CASE("device staging: async chains on one device buffer run their copies in issue order") {
  STAGING_REQUIRE_GPU();
  using T = float;
  auto c = make_comm();
  const int n = c.size(), r = c.rank();
  const std::size_t count = 5000;
  DeviceVec<T> d(std::vector<T>(count, static_cast<T>(r + 1)));
  // all_reduce (sum: n(n+1)/2), then all_reduce again (times n), then broadcast from the last rank:
  // each step must read what the previous one wrote to device memory.
  auto w1 = c.all_reduce(d.span(), ReduceOp::sum, comm::async);
  auto w2 = c.all_reduce(d.span(), ReduceOp::sum, comm::async);
  auto w3 = c.broadcast(d.span(), n - 1, comm::async);
  std::vector<T> host(count, 0.0f);
  auto w4 = c.all_reduce(host, ReduceOp::sum, comm::async);  // host ops interleave freely
  w1.wait();
  w2.wait();
  w3.wait();
  w4.wait();
  const float want = static_cast<float>(n * (n + 1) / 2 * n);
  CHECK(equal(d.download(), std::vector<T>(count, want)));
  // A blocking op after queued async work sees their device results too.
  auto w5 = c.all_reduce(d.span(), ReduceOp::max, comm::async);
  c.all_reduce(d.span(), ReduceOp::sum);
  w5.wait();
  CHECK(equal(d.download(), std::vector<T>(count, want * static_cast<float>(n))));
}

TEST_CASE("device staging: fp8 and other element types move through device memory") {
  STAGING_REQUIRE_GPU();
  auto c = make_comm();
  const int n = c.size(), r = c.rank();
  const std::size_t count = 257;
  auto check_type = [&](auto tag) {
    using T = decltype(tag);
    DeviceVec<T> d(inputs<T>(r, count, ReduceOp::sum));
    c.all_reduce(d.span(), ReduceOp::sum);
    CHECK(equal(d.download(), reduced<T>(ReduceOp::sum, n, count)));
  };
  check_type(comm::float8_e4m3{});
  check_type(comm::float8_e5m2{});
  check_type(comm::bfloat16{});
  check_type(double{});
  check_type(std::uint8_t{});
}

TEST_CASE("device staging: empty device buffers and the communicator stays usable") {
  STAGING_REQUIRE_GPU();
  auto c = make_comm();
  DeviceVec<float> d(0);
  c.all_reduce(std::span<float>(d.data(), 0));
  c.broadcast(std::span<float>(d.data(), 0), 0);
  c.barrier();
  DeviceVec<float> one(std::vector<float>{1.0f});
  c.all_reduce(one.span());
  CHECK(one.download()[0] == static_cast<float>(c.size()));
}

TEST_CASE("Shm, which reads buffers with the CPU, rejects device buffers with InvalidArgument") {
  STAGING_REQUIRE_GPU();
  const auto& w = comm::test::world();
  auto c = comm::Communicator<comm::backends::Shm>::create(comm::test::fresh_store(), w.rank, w.size);
  DeviceVec<float> d(std::vector<float>{1.0f, 2.0f});
  std::vector<float> host{1.0f, 2.0f};
  try {
    c.all_reduce(d.span());
    FAIL("no error for a device buffer");
  } catch (const comm::InvalidArgument& e) {
    CHECK(std::string(e.what()).find("CUDA device memory") != std::string::npos);
    CHECK(std::string(e.what()).find("all_reduce") != std::string::npos);
  }
  std::vector<float> gathered(2 * static_cast<std::size_t>(c.size()));
  CHECK_THROWS_AS(c.all_gather(d.cspan(), gathered), comm::InvalidArgument);
  // Nothing was sent: the communicator stays usable.
  c.all_reduce(host);
  CHECK(host[1] == 2.0f * static_cast<float>(c.size()));
}

TEST_CASE("Gloo rejects device buffers in the operations it does not stage (reduce, scatter, point-to-point...)") {
  STAGING_REQUIRE_GPU();
  auto c = make_comm();
  const int n = c.size(), r = c.rank();
  DeviceVec<float> d(std::vector<float>(static_cast<std::size_t>(n), 1.0f));
  std::vector<float> host(static_cast<std::size_t>(n), 1.0f), out(static_cast<std::size_t>(n));
  try {
    c.reduce(d.span(), 0);
    FAIL("no error for a device buffer");
  } catch (const comm::InvalidArgument& e) {
    CHECK(std::string(e.what()).find("CUDA device memory") != std::string::npos);
    CHECK(std::string(e.what()).find("reduce") != std::string::npos);
  }
  CHECK_THROWS_AS(c.all_to_all(d.cspan(), out), comm::InvalidArgument);
  if (n > 1) {
    // A batch whose receive buffer is on the device: rejected before anything is sent.
    CHECK_THROWS_AS((void)c.batch_isend_irecv({comm::isend(host, (r + 1) % n), comm::irecv(d.span(), (r + n - 1) % n)}),
                    comm::InvalidArgument);
  }
  // Nothing was sent: the communicator stays usable, and the staged collectives still take the
  // device buffer.
  c.all_reduce(d.span());
  CHECK(d.download()[0] == static_cast<float>(n));
}
