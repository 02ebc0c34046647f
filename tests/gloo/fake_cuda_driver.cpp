// A stand-in libcuda.so.1 for machines without a GPU: the entry points cuda_driver.hpp resolves,
// with "device memory" that host code cannot touch. Device allocations are mmap'ed PROT_NONE and
// opened only inside cuMemcpy*, so any read or write of device memory that does not go through
// the driver (gloo touching an unstaged buffer) crashes the test instead of passing silently.
// Loaded through LD_LIBRARY_PATH by the gloo_device_staging_test.fake_driver tests only.

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace {

enum Kind { device, managed, pinned };
struct Range {
  std::size_t bytes;
  Kind kind;
};

std::mutex mu;                               // one copy at a time: protections are process-wide
std::map<std::uintptr_t, Range>& ranges() {  // start -> range
  static std::map<std::uintptr_t, Range> m;
  return m;
}
int fake_context = 0;
thread_local int pushed = 0;

const Range* find(std::uintptr_t p, std::uintptr_t* start) {
  auto& m = ranges();
  auto it = m.upper_bound(p);
  if (it == m.begin()) return nullptr;
  --it;
  if (p >= it->first + it->second.bytes) return nullptr;
  *start = it->first;
  return &it->second;
}

std::size_t round_up(std::size_t n) {
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return (n + page - 1) / page * page;
}

void* map(std::size_t bytes, Kind kind) {
  void* p = ::mmap(nullptr, round_up(bytes), kind == device ? PROT_NONE : PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  std::lock_guard lock(mu);
  ranges()[reinterpret_cast<std::uintptr_t>(p)] = Range{bytes, kind};
  return p;
}

int unmap(std::uintptr_t p) {
  std::lock_guard lock(mu);
  auto it = ranges().find(p);
  if (it == ranges().end()) return 1;  // CUDA_ERROR_INVALID_VALUE
  ::munmap(reinterpret_cast<void*>(p), round_up(it->second.bytes));
  ranges().erase(it);
  return 0;
}

/// Copies with device ranges opened for the duration; 1 when a device side is not device memory.
int copy(void* dst, const void* src, std::size_t n, bool dst_device) {
  if (pushed <= 0) return 201;  // CUDA_ERROR_INVALID_CONTEXT: staging must push a context
  std::lock_guard lock(mu);
  const auto dev = reinterpret_cast<std::uintptr_t>(dst_device ? dst : src);
  std::uintptr_t start = 0;
  const Range* r = find(dev, &start);
  if (r == nullptr || r->kind == pinned || dev + n > start + r->bytes) return 1;
  void* base = reinterpret_cast<void*>(start);
  if (r->kind == device) ::mprotect(base, round_up(r->bytes), PROT_READ | PROT_WRITE);
  std::memmove(dst, src, n);
  if (r->kind == device) ::mprotect(base, round_up(r->bytes), PROT_NONE);
  return 0;
}

}  // namespace

extern "C" {

int cuInit(unsigned) {
  return 0;
}
int cuDeviceGetCount(int* n) {
  *n = 1;
  return 0;
}
int cuGetErrorString(int e, const char** s) {
  *s = e == 0 ? "no error" : e == 201 ? "invalid device context" : "invalid argument";
  return 0;
}
int cuGetErrorName(int e, const char** s) {
  *s = e == 0 ? "CUDA_SUCCESS" : e == 201 ? "CUDA_ERROR_INVALID_CONTEXT" : "CUDA_ERROR_INVALID_VALUE";
  return 0;
}
int cuPointerGetAttributes(unsigned n, int* attrs, void** data, unsigned long long p) {
  std::lock_guard lock(mu);
  std::uintptr_t start = 0;
  const Range* r = find(static_cast<std::uintptr_t>(p), &start);
  for (unsigned i = 0; i < n; ++i) {
    switch (attrs[i]) {
      case 1:
        *static_cast<void**>(data[i]) = r != nullptr ? &fake_context : nullptr;
        break;
      case 2:
        *static_cast<unsigned*>(data[i]) = r == nullptr ? 0u : (r->kind == pinned ? 1u : 2u);
        break;
      case 8:
        *static_cast<bool*>(data[i]) = r != nullptr && r->kind == managed;
        break;
      case 9:
        *static_cast<int*>(data[i]) = r != nullptr ? 0 : -1;
        break;
      default:
        return 1;
    }
  }
  return 0;
}
int cuDevicePrimaryCtxRetain(void** ctx, int dev) {
  if (dev != 0) return 101;  // CUDA_ERROR_INVALID_DEVICE
  *ctx = &fake_context;
  return 0;
}
int cuCtxPushCurrent_v2(void* ctx) {
  if (ctx != &fake_context) return 201;
  ++pushed;
  return 0;
}
int cuCtxPopCurrent_v2(void** ctx) {
  if (pushed <= 0) return 201;
  --pushed;
  if (ctx != nullptr) *ctx = &fake_context;
  return 0;
}
int cuMemcpyDtoH_v2(void* dst, unsigned long long src, std::size_t n) {
  return copy(dst, reinterpret_cast<const void*>(src), n, false);
}
int cuMemcpyHtoD_v2(unsigned long long dst, const void* src, std::size_t n) {
  return copy(reinterpret_cast<void*>(dst), src, n, true);
}
int cuMemHostAlloc(void** p, std::size_t n, unsigned) {
  if (pushed <= 0) return 201;
  *p = map(n, pinned);
  return *p != nullptr ? 0 : 2;  // CUDA_ERROR_OUT_OF_MEMORY
}
int cuMemFreeHost(void* p) {
  return unmap(reinterpret_cast<std::uintptr_t>(p));
}
int cuMemAlloc_v2(unsigned long long* p, std::size_t n) {
  if (pushed <= 0) return 201;
  *p = reinterpret_cast<unsigned long long>(map(n, device));
  return *p != 0 ? 0 : 2;
}
int cuMemAllocManaged(unsigned long long* p, std::size_t n, unsigned) {
  *p = reinterpret_cast<unsigned long long>(map(n, managed));
  return *p != 0 ? 0 : 2;
}
int cuMemFree_v2(unsigned long long p) {
  return unmap(static_cast<std::uintptr_t>(p));
}

}  // extern "C"
