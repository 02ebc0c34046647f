// gloo_staging_bench: what comm's Gloo device-buffer staging costs against doing the copies by hand
// (scripts/gpu-check runs it at 4 ranks on one GPU).
//
//   comm-run -n N gloo_staging_bench [--sizes 8,16M] [--iters 20] [--rounds 5]
//
// Per size (bytes of a float sum all_reduce), in alternating rounds, the median time per call:
//   device        c.all_reduce(device span): comm stages it through its pinned pool
//   host+copies   cudaMemcpy to a pinned host buffer, c.all_reduce(host span), cudaMemcpy back
//   host          c.all_reduce(host span) alone (the floor: no device memory at all)
// Each timed call starts after a barrier, so every rank measures the same collective. Rank 0
// prints `RESULT bytes=<b> variant=<v> us=<median>`. Exits 77 (skipped) where no GPU is usable.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include <comm/backends/gloo.hpp>
#include <comm/backends/nccl.hpp>
#include <comm/communicator.hpp>

namespace {

using Clock = std::chrono::steady_clock;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "gloo_staging_bench: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

std::size_t parse_size(std::string n) {
  std::size_t mult = 1;
  if (!n.empty() && (n.back() == 'K' || n.back() == 'M')) {
    mult = n.back() == 'K' ? 1024 : 1024 * 1024;
    n.pop_back();
  }
  return static_cast<std::size_t>(std::stoull(n)) * mult;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::size_t> sizes{8, std::size_t{16} << 20};
  int iters = 20, rounds = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--sizes") {
      sizes.clear();
      for (std::size_t at = 0; at <= v.size();) {
        const auto comma = v.find(',', at);
        sizes.push_back(parse_size(v.substr(at, comma == std::string::npos ? std::string::npos : comma - at)));
        if (comma == std::string::npos) break;
        at = comma + 1;
      }
    } else if (k == "--iters") {
      iters = std::atoi(v.c_str());
    } else if (k == "--rounds") {
      rounds = std::atoi(v.c_str());
    }
  }
  const auto dc = comm::nccl::device_count();
  if (dc.count < 1) {
    std::printf("gloo_staging_bench: skipped: no usable CUDA device (%s)\n", dc.why.c_str());
    return 77;
  }
  const char* lr = std::getenv("LOCAL_RANK");
  check(cudaSetDevice(std::atoi(lr != nullptr ? lr : "0") % dc.count), "cudaSetDevice");
  auto c = comm::Communicator<comm::backends::Gloo>::from_env();
  const char* names[] = {"device", "host+copies", "host"};
  if (c.rank() == 0)
    std::printf("# gloo_staging_bench: world %d on %d GPU(s), float sum all_reduce, median us per call\n", c.size(),
                dc.count);
  for (const std::size_t bytes : sizes) {
    const std::size_t n = std::max<std::size_t>(bytes / sizeof(float), 1);
    float* dev = nullptr;
    float* pinned = nullptr;
    check(cudaMalloc(reinterpret_cast<void**>(&dev), n * sizeof(float)), "cudaMalloc");
    check(cudaMallocHost(reinterpret_cast<void**>(&pinned), n * sizeof(float)), "cudaMallocHost");
    std::vector<float> host(n, 1.0f);
    check(cudaMemcpy(dev, host.data(), n * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
    const std::span<float> dspan(dev, n), pspan(pinned, n), hspan(host.data(), n);
    auto run = [&](int v) {
      switch (v) {
        case 0: c.all_reduce(dspan, comm::ReduceOp::sum); break;
        case 1:
          check(cudaMemcpy(pinned, dev, n * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
          c.all_reduce(pspan, comm::ReduceOp::sum);
          check(cudaMemcpy(dev, pinned, n * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy H2D");
          break;
        default: c.all_reduce(hspan, comm::ReduceOp::sum); break;
      }
    };
    std::vector<double> med[3];
    for (int v = 0; v < 3; ++v) run(v);  // warm up (the pool's block, the connections)
    for (int r = 0; r < rounds; ++r) {
      for (int v = 0; v < 3; ++v) {
        std::vector<double> t;
        for (int i = 0; i < iters; ++i) {
          c.barrier();
          const auto t0 = Clock::now();
          run(v);
          t.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
        }
        med[v].push_back(median(t));
      }
    }
    if (c.rank() == 0)
      for (int v = 0; v < 3; ++v) std::printf("RESULT bytes=%zu variant=%s us=%.2f\n", bytes, names[v], median(med[v]));
    check(cudaFree(dev), "cudaFree");
    check(cudaFreeHost(pinned), "cudaFreeHost");
  }
  return 0;
}
