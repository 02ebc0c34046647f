// NVTX ranges (detail/diagnostics/nvtx.hpp): the COMM_NVTX switch, the range names, and what an
// NVTX tool sees. The tool is tests/nccl/nvtx_injection.cpp, loaded by NVTX3 itself from
// NVTX_INJECTION64_PATH (ctest sets it; without it the tool cases skip and say so).
//
//   CPU (everywhere): the switch read once and re-read, the message format, ranges pushed and
//   started through the range helpers reaching the tool in domain "comm", and nothing at all
//   reaching it while COMM_NVTX is off.
//   GPU (skip without one): every NCCL operation of a communicator emits one push/pop range named
//   after its op, count, type and sequence number.
//   Gloo device staging (built with comm::gloo; needs a CUDA driver: the real one, or
//   tests/gloo's stand-in through LD_LIBRARY_PATH): one start/end range per staged operation.
#include <doctest/doctest.h>

#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include <comm/detail/diagnostics/nvtx.hpp>
#include <support/env_guard.hpp>

#include "nccl_test_util.hpp"

#if defined(COMM_HAS_GLOO)
#include <comm/backends/gloo.hpp>
#include <comm/detail/cuda/driver.hpp>
#endif

namespace nvtx = comm::detail::nvtx;
using comm::test::ScopedEnv;

namespace {

constexpr auto f32 = static_cast<std::uint8_t>(comm::Dtype::float32);

/// The injected tool's event log, or nullopt when NVTX_INJECTION64_PATH is not set.
class Tool {
 public:
  static const char* path() {
    const char* p = std::getenv("NVTX_INJECTION64_PATH");
    return p != nullptr && *p != '\0' ? p : nullptr;
  }

  /// The lines recorded so far (loads nothing: the tool is there once NVTX loaded it).
  static std::vector<std::string> events() {
    void* h = ::dlopen(path(), RTLD_NOW | RTLD_NOLOAD);
    if (h == nullptr) return {"(the tool was not loaded)"};
    using Fn = const char* (*)();
    auto fn = reinterpret_cast<Fn>(::dlsym(h, "comm_nvtx_test_events"));
    std::vector<std::string> out;
    if (fn != nullptr) {
      std::istringstream in(fn());
      for (std::string line; std::getline(in, line);) out.push_back(line);
    }
    ::dlclose(h);
    return out;
  }
  /// Only the lines of domain "comm" (NCCL emits ranges of its own).
  static std::vector<std::string> comm_events() {
    std::vector<std::string> out;
    for (auto& e : events())
      if (e.rfind("push comm|", 0) == 0 || e == "pop comm" || e.rfind("start comm|", 0) == 0 ||
          e.rfind("end comm ", 0) == 0)
        out.push_back(e);
    return out;
  }
  static void clear() {
    if (void* h = ::dlopen(path(), RTLD_NOW | RTLD_NOLOAD)) {
      if (auto fn = reinterpret_cast<void (*)()>(::dlsym(h, "comm_nvtx_test_clear"))) fn();
      ::dlclose(h);
    }
  }
};

#define NVTX_REQUIRE_TOOL()                                                                          \
  do {                                                                                               \
    if (Tool::path() == nullptr) {                                                                   \
      nccl_test::report_skip("NVTX_INJECTION64_PATH is not set (ctest sets it to the test tool)");   \
      return;                                                                                        \
    }                                                                                                \
  } while (0)

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& e : v) s += e + "\n";
  return s;
}

}  // namespace

// First, before anything else reads the switch: it is read at the first use, from the
// environment the process started with (ctest runs this test once without COMM_NVTX and once
// with COMM_NVTX=1).
TEST_CASE("nvtx: the switch is read at the first use, from COMM_NVTX") {
  CHECK(nvtx::state.load() == -1);  // nothing read it yet
  const char* v = std::getenv("COMM_NVTX");
  const bool want = v != nullptr && std::string(v) == "1";
  CHECK(nvtx::enabled() == want);
  CHECK(nvtx::state.load() == (want ? 1 : 0));
  CHECK(nvtx::enabled() == want);  // cached
}

TEST_CASE("nvtx: compiled in where the toolkit's NVTX3 headers are on the include path") {
  CHECK(nvtx::compiled_in);
  CHECK(COMM_NVTX_AVAILABLE == 1);
}

TEST_CASE("nvtx: only COMM_NVTX=1 turns ranges on") {
  const bool before = nvtx::enabled();
  {
    ScopedEnv e("COMM_NVTX", nullptr);
    CHECK_FALSE(nvtx::reload());
    CHECK_FALSE(nvtx::enabled());
  }
  for (const char* off : {"0", "", "true", "on", "10", " 1"}) {
    ScopedEnv e("COMM_NVTX", off);
    CHECK_MESSAGE(!nvtx::reload(), "COMM_NVTX='" << off << "'");
    CHECK_FALSE(nvtx::enabled());
  }
  {
    ScopedEnv e("COMM_NVTX", "1");
    CHECK(nvtx::reload());
    CHECK(nvtx::enabled());
    // Read once: a later change of the environment is not seen until reload().
    ::setenv("COMM_NVTX", "0", 1);
    CHECK(nvtx::enabled());
  }
  CHECK(nvtx::reload() == before);
}

TEST_CASE("nvtx: range names") {
  CHECK(nvtx::message("all_reduce", 1024, f32, 7) == "comm.all_reduce count=1024 type=float seq=7");
  CHECK(nvtx::message("reduce_scatter", 3, static_cast<std::uint8_t>(comm::Dtype::bfloat16), 0) ==
        "comm.reduce_scatter count=3 type=bfloat16 seq=0");
  CHECK(nvtx::message("all_gather", 5, static_cast<std::uint8_t>(comm::Dtype::float16), 18446744073709551614ull) ==
        "comm.all_gather count=5 type=half seq=18446744073709551614");
  CHECK(nvtx::message("broadcast", 0, static_cast<std::uint8_t>(comm::Dtype::float8_e4m3), 2) ==
        "comm.broadcast count=0 type=float8_e4m3 seq=2");
  CHECK(nvtx::message("barrier", 0, 0xff, 9) == "comm.barrier count=0 type=none seq=9");
  CHECK(nvtx::message("gather", 4, static_cast<std::uint8_t>(comm::Dtype::int64), nvtx::no_seq) ==
        "comm.gather count=4 type=int64 staged");
  CHECK(nvtx::type_name(200) == "none");
  // Truncated, always terminated.
  char buf[16];
  CHECK(nvtx::format_label(buf, sizeof buf, "all_reduce", 1024, "float", 7) == 15);
  CHECK(std::string(buf) == "comm.all_reduce");
  CHECK(nvtx::format_label(buf, 0, "all_reduce", 1, "float", 1) == 0);
  char one[1] = {'x'};
  CHECK(nvtx::format_label(one, 1, "all_reduce", 1, "float", 1) == 0);
  CHECK(one[0] == '\0');
}

TEST_CASE("nvtx: ranges reach an injected NVTX tool in domain comm, and nothing does while off") {
  NVTX_REQUIRE_TOOL();
  {
    ScopedEnv e("COMM_NVTX", "0");
    REQUIRE_FALSE(nvtx::reload());
    {
      nvtx::ScopedRange r("all_reduce", 4, f32, 1);
      nvtx::Range s;
      s.start("broadcast", 2, f32);
      CHECK_FALSE(s.open());
    }
    // Off: not one NVTX call, so NVTX has not even loaded the tool (this runs before any range).
    CHECK(Tool::events() == std::vector<std::string>{"(the tool was not loaded)"});
  }
  {
    ScopedEnv e("COMM_NVTX", "1");
    REQUIRE(nvtx::reload());
    {
      nvtx::ScopedRange r("all_reduce", 4, f32, 3);
      nvtx::ScopedRange inner;
      inner.push("barrier", 0, 0xff, 4);
    }
    nvtx::Range s;
    s.start("broadcast", 8, static_cast<std::uint8_t>(comm::Dtype::int32));
    CHECK(s.open());
    s.end();
    CHECK_FALSE(s.open());
    s.end();  // once only
    {
      nvtx::Range dropped;  // an operation dropped after a failure: the destructor ends it
      dropped.start("gather", 1, f32, 5);
    }
    const auto ev = Tool::events();
    INFO(joined(ev));
    const std::vector<std::string> want{
        "init",
        "create comm",
        "push comm|comm.all_reduce count=4 type=float seq=3|4",
        "push comm|comm.barrier count=0 type=none seq=4|0",
        "pop comm",
        "pop comm",
        "start comm|comm.broadcast count=8 type=int32 staged|8 #1",
        "end comm #1",
        "start comm|comm.gather count=1 type=float seq=5|1 #2",
        "end comm #2",
    };
    CHECK(ev == want);
  }
  Tool::clear();
  {
    ScopedEnv e("COMM_NVTX", nullptr);
    REQUIRE_FALSE(nvtx::reload());
    nvtx::ScopedRange r("all_reduce", 4, f32, 6);
    nvtx::Range s;
    s.start("broadcast", 1, f32);
  }
  CHECK(Tool::events().empty());
  (void)nvtx::reload();
}

TEST_CASE("nvtx: every NCCL operation is one range named op, count, type and seq (GPU)") {
  NVTX_REQUIRE_TOOL();
  NCCL_REQUIRE_GPU();
  ScopedEnv e("COMM_NVTX", "1");
  REQUIRE(nvtx::reload());
  auto c = nccl_test::make_comm();
  nccl_test::DeviceBuffer<float> f(1000);
  nccl_test::DeviceBuffer<std::int32_t> i32(10);
  nccl_test::DeviceBuffer<double> d_in(5), d_out(5 * static_cast<std::size_t>(c.size()));
  nccl_test::DeviceBuffer<comm::half> h(64);
  Tool::clear();
  c.all_reduce(f.span(), comm::ReduceOp::sum);
  c.broadcast(i32.span(), 0);
  c.all_gather(d_in.cspan(), d_out.span());
  c.all_reduce(h.span(), comm::ReduceOp::max, comm::async).wait();
  c.barrier();
  NCCL_TEST_CUDA(cudaDeviceSynchronize());
  const auto ev = Tool::comm_events();
  INFO(joined(Tool::events()));
  REQUIRE(ev.size() == 10);
  // The first one fixes the sequence number; the others follow it.
  const std::string first = ev[0];
  const auto at = first.find(" seq=");
  REQUIRE(at != std::string::npos);
  const std::uint64_t s0 = std::stoull(first.substr(at + 5));
  const auto push = [&](const std::string& op, std::size_t count, const char* type, std::uint64_t k) {
    return "push comm|comm." + op + " count=" + std::to_string(count) + " type=" + type +
           " seq=" + std::to_string(s0 + k) + "|" + std::to_string(count);
  };
  const std::vector<std::string> want{
      push("all_reduce", 1000, "float", 0), "pop comm",
      push("broadcast", 10, "int32", 1),    "pop comm",
      push("all_gather", 5, "double", 2),   "pop comm",
      push("all_reduce", 64, "half", 3),    "pop comm",
      push("barrier", 0, "none", 4),        "pop comm",
  };
  CHECK(ev == want);
  (void)nvtx::reload();
}

#if defined(COMM_HAS_GLOO)
TEST_CASE("nvtx: Gloo device-buffer staging opens one range per staged operation") {
  NVTX_REQUIRE_TOOL();
  namespace cu = comm::detail::cuda;
  if (!cu::driver_usable()) {
    nccl_test::report_skip("no usable CUDA driver/device (" + cu::Driver::get().why_not() + ")");
    return;
  }
  ScopedEnv e("COMM_NVTX", "1");
  REQUIRE(nvtx::reload());
  const auto& w = comm::test::world();
  auto c = comm::Communicator<comm::backends::Gloo>::create(comm::test::fresh_store(), w.rank, w.size);
  auto& d = cu::Driver::get();
  cu::ScopedContext scope(d.primary_context(0, "test", -1), "test", -1);
  constexpr std::size_t n = 256;
  cu::CUdeviceptr p = 0;
  REQUIRE(d.api().mem_alloc(&p, n * sizeof(float)) == cu::kSuccess);
  std::vector<float> host(n, 1.0f);
  REQUIRE(d.api().memcpy_htod(p, host.data(), n * sizeof(float)) == cu::kSuccess);
  const std::span<float> dev(reinterpret_cast<float*>(p), n);
  std::vector<float> plain(n, 2.0f);
  Tool::clear();
  c.all_reduce(dev, comm::ReduceOp::sum);                         // staged: one range
  c.broadcast(dev, 0, comm::async).wait();                        // staged, async: one range
  c.all_reduce(std::span<float>(plain), comm::ReduceOp::sum);     // host buffers: none
  const auto ev = Tool::comm_events();
  INFO(joined(Tool::events()));
  REQUIRE(ev.size() == 4);
  CHECK(ev[0].rfind("start comm|comm.all_reduce count=256 type=float staged|256 #", 0) == 0);
  CHECK(ev[1] == "end comm #" + ev[0].substr(ev[0].rfind('#') + 1));
  CHECK(ev[2].rfind("start comm|comm.broadcast count=256 type=float staged|256 #", 0) == 0);
  CHECK(ev[3] == "end comm #" + ev[2].substr(ev[2].rfind('#') + 1));
  REQUIRE(d.api().memcpy_dtoh(host.data(), p, n * sizeof(float)) == cu::kSuccess);
  CHECK(host[0] == static_cast<float>(w.size));
  (void)d.api().mem_free(p);
  (void)nvtx::reload();
}
#endif
