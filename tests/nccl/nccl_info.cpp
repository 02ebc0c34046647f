// Prints what the NCCL backend sees on this machine, one `key=value` per line (scripts/gpu-check
// reads it): the NCCL versions (compiled, loaded), the CUDA runtime and driver, the devices, the
// gather path, and whether several ranks may share a GPU. Runs anywhere; never fails.
#include <cstdio>
#include <cstdlib>
#include <string>

#include <cuda_runtime_api.h>

#include <comm/backends/nccl.hpp>

int main() {
  namespace cn = comm::nccl;
  const int loaded = cn::runtime_version();
  std::printf("nccl_compiled=%s\n", cn::version_string(cn::compiled_version).c_str());
  std::printf("nccl_loaded=%s\n", cn::version_string(loaded).c_str());
  int rt = 0, drv = 0;
  (void)cudaRuntimeGetVersion(&rt);
  (void)cudaDriverGetVersion(&drv);
  (void)cudaGetLastError();
  std::printf("cuda_runtime=%d.%d\n", rt / 1000, (rt % 1000) / 10);
  std::printf("cuda_driver=%d.%d\n", drv / 1000, (drv % 1000) / 10);
  const auto dc = cn::device_count();
  std::printf("devices=%d\n", dc.count);
  if (dc.count <= 0) std::printf("no_device_reason=%s\n", dc.why.c_str());
  for (int d = 0; d < dc.count; ++d) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, d) != cudaSuccess) {
      (void)cudaGetLastError();
      continue;
    }
    std::printf("device%d=%s, compute capability %d.%d, %.1f GiB\n", d, p.name, p.major, p.minor,
                static_cast<double>(p.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
  }
  const bool native = COMM_NCCL_HAS_GATHER && loaded >= comm::detail::nccl::gather_version;
  std::printf("gather_default=%s\n", native ? "native" : "p2p");
  std::printf("fp8_reductions_compiled=%d\n", COMM_NCCL_FP8_REDUCTIONS);
  std::printf("multi_rank_gpu=%s\n", loaded >= comm::detail::nccl::multi_rank_gpu_version ? "yes" : "no");
  return 0;
}
