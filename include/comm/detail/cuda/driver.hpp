#pragma once
// The CUDA driver API, loaded at run time: what host backends need to recognise device pointers
// and copy through pinned host memory, with no CUDA at build time and none at run time.
//
// Why dlopen and not the toolkit: comm::gloo must build and run where CUDA is absent, and a link
// dependency on libcuda would make every Gloo program fail to start on such machines. The driver
// (libcuda.so.1) is opened once, on first use, under a function-local static (thread-safe); when
// it is missing, cuInit fails, no device is present or COMM_GLOO_DEVICE_BUFFERS=0, the result is
// cached and every later query is a single branch on that flag. The few types and constants used
// are declared here with the driver ABI's values (the test checks them against cuda.h where the
// toolkit is installed); the _v2 entry points are the ones cuda.h maps the plain names to.

#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <comm/detail/base/env.hpp>
#include <comm/error.hpp>

namespace comm::detail::cuda {

using CUresult = int;
using CUdevice = int;
using CUcontext = struct CUctx_st*;
using CUdeviceptr = unsigned long long;  // NOLINT: the driver's CUdeviceptr_v2

inline constexpr CUresult kSuccess = 0;
inline constexpr int kAttrContext = 1;             // CU_POINTER_ATTRIBUTE_CONTEXT
inline constexpr int kAttrMemoryType = 2;          // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
inline constexpr int kAttrIsManaged = 8;           // CU_POINTER_ATTRIBUTE_IS_MANAGED
inline constexpr int kAttrDeviceOrdinal = 9;       // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
inline constexpr unsigned kMemoryTypeDevice = 2;   // CU_MEMORYTYPE_DEVICE
inline constexpr unsigned kHostAllocPortable = 1;  // CU_MEMHOSTALLOC_PORTABLE
inline constexpr unsigned kMemAttachGlobal = 1;    // CU_MEM_ATTACH_GLOBAL

/// The driver entry points comm uses (resolved by name; null only before a successful load).
struct Api {
  CUresult (*init)(unsigned) = nullptr;
  CUresult (*device_get_count)(int*) = nullptr;
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;
  CUresult (*get_error_name)(CUresult, const char**) = nullptr;
  CUresult (*pointer_get_attributes)(unsigned, int*, void**, CUdeviceptr) = nullptr;
  CUresult (*primary_ctx_retain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*ctx_push)(CUcontext) = nullptr;
  CUresult (*ctx_pop)(CUcontext*) = nullptr;
  CUresult (*memcpy_dtoh)(void*, CUdeviceptr, std::size_t) = nullptr;
  CUresult (*memcpy_htod)(CUdeviceptr, const void*, std::size_t) = nullptr;
  CUresult (*mem_host_alloc)(void**, std::size_t, unsigned) = nullptr;
  CUresult (*mem_free_host)(void*) = nullptr;
  CUresult (*mem_alloc)(CUdeviceptr*, std::size_t) = nullptr;  // tests and tools
  CUresult (*mem_alloc_managed)(CUdeviceptr*, std::size_t, unsigned) = nullptr;
  CUresult (*mem_free)(CUdeviceptr) = nullptr;
};

/// The loaded driver: usable() once libcuda.so.1 loaded, cuInit succeeded and a device exists.
class Driver {
 public:
  /// The process-wide driver, loaded on the first call.
  [[nodiscard]] static Driver& get() {
    static Driver d;
    return d;
  }

  Driver(const Driver&) = delete;
  Driver& operator=(const Driver&) = delete;

  [[nodiscard]] bool usable() const noexcept { return usable_; }
  /// Why the driver is not usable ("" when it is).
  [[nodiscard]] const std::string& why_not() const noexcept { return why_not_; }
  [[nodiscard]] int device_count() const noexcept { return devices_; }
  [[nodiscard]] const Api& api() const noexcept { return api_; }

  /// "cuMemcpyDtoH: invalid argument (CUDA_ERROR_INVALID_VALUE, 1)".
  [[nodiscard]] std::string describe(const char* call, CUresult r) const {
    const char* text = nullptr;
    const char* name = nullptr;
    if (api_.get_error_string == nullptr || api_.get_error_string(r, &text) != kSuccess || text == nullptr)
      text = "unknown CUDA driver error";
    if (api_.get_error_name == nullptr || api_.get_error_name(r, &name) != kSuccess || name == nullptr)
      name = "CUDA_ERROR_?";
    return std::string(call) + ": " + text + " (" + name + ", " + std::to_string(r) + ")";
  }

  /// Throws comm::BackendError for `op` on `rank` when `r` is a failure of driver call `call`.
  void check(CUresult r, const char* call, const std::string& op, int rank) const {
    if (r != kSuccess) throw BackendError(op, rank, "CUDA driver " + describe(call, r));
  }

  /// The primary context of `device`, retained on first use and kept for the life of the process
  /// (pinned staging memory lives in it, so it must not go away while a communicator runs).
  [[nodiscard]] CUcontext primary_context(int device, const std::string& op, int rank) {
    std::lock_guard lock(mu_);
    if (device < 0 || device >= devices_)
      throw BackendError(
          op, rank,
          "CUDA device ordinal " + std::to_string(device) + " is out of range [0, " + std::to_string(devices_) + ")");
    auto& slot = primary_[static_cast<std::size_t>(device)];
    if (slot == nullptr) check(api_.primary_ctx_retain(&slot, device), "cuDevicePrimaryCtxRetain", op, rank);
    return slot;
  }

 private:
  Driver() {
    if (const auto v = getenv_str("COMM_GLOO_DEVICE_BUFFERS"); v && trim(*v) == "0") {
      why_not_ = "COMM_GLOO_DEVICE_BUFFERS=0";
      return;
    }
    // Never unloaded: the driver keeps process-wide state, and other code may use it too.
    handle_ = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (handle_ == nullptr) {
      const char* e = ::dlerror();
      why_not_ = std::string("libcuda.so.1 could not be loaded: ") + (e != nullptr ? e : "unknown error");
      return;
    }
    const bool all =
        resolve(api_.init, "cuInit") && resolve(api_.device_get_count, "cuDeviceGetCount") &&
        resolve(api_.get_error_string, "cuGetErrorString") && resolve(api_.get_error_name, "cuGetErrorName") &&
        resolve(api_.pointer_get_attributes, "cuPointerGetAttributes") &&
        resolve(api_.primary_ctx_retain, "cuDevicePrimaryCtxRetain") && resolve(api_.ctx_push, "cuCtxPushCurrent_v2") &&
        resolve(api_.ctx_pop, "cuCtxPopCurrent_v2") && resolve(api_.memcpy_dtoh, "cuMemcpyDtoH_v2") &&
        resolve(api_.memcpy_htod, "cuMemcpyHtoD_v2") && resolve(api_.mem_host_alloc, "cuMemHostAlloc") &&
        resolve(api_.mem_free_host, "cuMemFreeHost") && resolve(api_.mem_alloc, "cuMemAlloc_v2") &&
        resolve(api_.mem_alloc_managed, "cuMemAllocManaged") && resolve(api_.mem_free, "cuMemFree_v2");
    if (!all) return;
    if (const CUresult r = api_.init(0); r != kSuccess) {
      why_not_ = describe("cuInit", r);
      return;
    }
    if (const CUresult r = api_.device_get_count(&devices_); r != kSuccess) {
      why_not_ = describe("cuDeviceGetCount", r);
      devices_ = 0;
      return;
    }
    if (devices_ <= 0) {
      why_not_ = "the CUDA driver reports no device";
      return;
    }
    primary_.assign(static_cast<std::size_t>(devices_), nullptr);
    usable_ = true;
  }

  template <class Fn>
  bool resolve(Fn& fn, const char* name) {
    void* p = ::dlsym(handle_, name);
    if (p == nullptr) {
      why_not_ = std::string("libcuda.so.1 has no ") + name + " (driver too old)";
      return false;
    }
    fn = reinterpret_cast<Fn>(p);
    return true;
  }

  void* handle_ = nullptr;
  Api api_;
  bool usable_ = false;
  int devices_ = 0;
  std::string why_not_;
  std::mutex mu_;
  std::vector<CUcontext> primary_;
};

/// Whether the driver is usable in this process (cached: a branch after the first call).
[[nodiscard]] inline bool driver_usable() noexcept {
  static const bool usable = Driver::get().usable();
  return usable;
}

/// Where a buffer lives, as far as copies are concerned.
struct PointerInfo {
  bool device = false;          // device memory (not managed / unified, not host)
  CUcontext context = nullptr;  // the context it was allocated in (null for some VMM allocations)
  int ordinal = -1;             // its device
};

/// Classifies `p`. Host memory (pageable, pinned, registered), managed memory and pointers the
/// driver does not know count as host; so does everything where the driver is not usable.
[[nodiscard]] inline PointerInfo pointer_info(const void* p) noexcept {
  if (!driver_usable() || p == nullptr) return {};
  // Each slot is zeroed and 8 bytes wide, so values of any width the driver writes (a 4-byte
  // enum, a 1-byte bool, an 8-byte handle) read back correctly as integers on little-endian hosts.
  std::uint64_t type = 0, managed = 0, ordinal = 0;
  CUcontext ctx = nullptr;
  int attrs[] = {kAttrMemoryType, kAttrIsManaged, kAttrDeviceOrdinal, kAttrContext};
  void* data[] = {&type, &managed, &ordinal, &ctx};
  // cuPointerGetAttributes (unlike the singular call) succeeds for pointers the driver does not
  // know, leaving the attributes zero; a failure is treated the same way.
  const auto& api = Driver::get().api();
  if (api.pointer_get_attributes(4, attrs, data, reinterpret_cast<CUdeviceptr>(p)) != kSuccess) return {};
  if (static_cast<unsigned>(type) != kMemoryTypeDevice || managed != 0) return {};
  return {true, ctx, static_cast<int>(static_cast<std::uint32_t>(ordinal))};
}

/// Whether `p` is device memory that host code must not touch (see pointer_info).
[[nodiscard]] inline bool is_device_pointer(const void* p) noexcept {
  return pointer_info(p).device;
}

/// Makes `ctx` current on this thread for the scope (pushes, then pops).
class ScopedContext {
 public:
  ScopedContext(CUcontext ctx, const std::string& op, int rank) {
    auto& d = Driver::get();
    d.check(d.api().ctx_push(ctx), "cuCtxPushCurrent", op, rank);
  }
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;
  ~ScopedContext() {
    CUcontext popped = nullptr;
    (void)Driver::get().api().ctx_pop(&popped);  // cannot fail after a successful push
  }
};

/// The context to use for copies of a buffer: its own, else its device's primary context.
[[nodiscard]] inline CUcontext copy_context(const PointerInfo& info, const std::string& op, int rank) {
  return info.context != nullptr ? info.context : Driver::get().primary_context(info.ordinal, op, rank);
}

/// Copies `bytes` from device memory `src` to host memory `dst`; returns once the copy is done.
inline void copy_to_host(void* dst, const void* src, std::size_t bytes, const PointerInfo& info, const std::string& op,
                         int rank) {
  if (bytes == 0) return;
  auto& d = Driver::get();
  ScopedContext scope(copy_context(info, op, rank), op, rank);
  d.check(d.api().memcpy_dtoh(dst, reinterpret_cast<CUdeviceptr>(src), bytes), "cuMemcpyDtoH", op, rank);
}

/// Copies `bytes` from host memory `src` to device memory `dst`; returns once the copy is done
/// (synchronous for pinned sources, which is what staging uses).
inline void copy_to_device(void* dst, const void* src, std::size_t bytes, const PointerInfo& info,
                           const std::string& op, int rank) {
  if (bytes == 0) return;
  auto& d = Driver::get();
  ScopedContext scope(copy_context(info, op, rank), op, rank);
  d.check(d.api().memcpy_htod(reinterpret_cast<CUdeviceptr>(dst), src, bytes), "cuMemcpyHtoD", op, rank);
}

}  // namespace comm::detail::cuda
