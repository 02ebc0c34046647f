// nccl_overhead: the per-call cost of comm's NCCL backend against raw NCCL calls, on the same
// communicator and stream, in the same process.
//
//   comm-run -n N nccl_overhead [--sizes 8,64M] [--iters 200] [--rounds 7] [--warmup 20]
//
// For each size (bytes of float all_reduce) five variants run in alternating rounds:
//   raw        ncclAllReduce(d, d, count, ncclFloat32, ncclSum, comm, stream) (+ ncclInProgress polling)
//   comm       c.all_reduce(span) with the communicator's stream as the current stream (no events)
//   comm+xs    c.all_reduce(span) from the default stream (cross-stream events both ways)
//   raw+sync   raw, then cudaStreamSynchronize after every call (a host round trip per call)
//   comm+wait  c.all_reduce(span, comm::async).wait() (the host waits through the watchdog)
// and two figures per call, the median over the rounds:
//   host      time until the calls return (what a caller pays per call; the GPU runs behind)
//   e2e       time until the stream has drained (calls + device work), per call
// comm's figures include its argument checks, the device-pointer check (cudaPointerGetAttributes),
// the completion event and the watchdog hand-off. Rank 0 prints a table and `RESULT` lines.
// Exits 77 (skipped) where no GPU is usable.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <comm/backends/nccl.hpp>
#include <comm/communicator.hpp>

namespace {

using Comm = comm::Communicator<comm::backends::Nccl>;
using Clock = std::chrono::steady_clock;

struct Args {
  std::vector<std::size_t> sizes{8, std::size_t{64} << 20};
  int iters = 200;
  int rounds = 7;
  int warmup = 20;
};

std::size_t parse_size(const std::string& s) {
  std::size_t mult = 1;
  std::string n = s;
  if (!n.empty() && (n.back() == 'K' || n.back() == 'M' || n.back() == 'G')) {
    mult = n.back() == 'K' ? 1024 : n.back() == 'M' ? (1024 * 1024) : (std::size_t{1} << 30);
    n.pop_back();
  }
  return static_cast<std::size_t>(std::stoull(n)) * mult;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "nccl_overhead: %s needs a value\n", k.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--sizes") {
      a.sizes.clear();
      std::string v = next();
      for (std::size_t p = 0; p <= v.size();) {
        const auto q = v.find(',', p);
        a.sizes.push_back(parse_size(v.substr(p, q == std::string::npos ? std::string::npos : q - p)));
        if (q == std::string::npos) break;
        p = q + 1;
      }
    } else if (k == "--iters") {
      a.iters = std::stoi(next());
    } else if (k == "--rounds") {
      a.rounds = std::stoi(next());
    } else if (k == "--warmup") {
      a.warmup = std::stoi(next());
    } else {
      std::fprintf(stderr, "usage: nccl_overhead [--sizes 8,64M] [--iters N] [--rounds N] [--warmup N]\n");
      std::exit(2);
    }
  }
  return a;
}

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "nccl_overhead: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

void raw_all_reduce(float* d, std::size_t count, ncclComm_t comm, cudaStream_t s) {
  ncclResult_t r = ncclAllReduce(d, d, count, ncclFloat32, ncclSum, comm, s);
  if (r == ncclInProgress) {
    do {
      (void)ncclCommGetAsyncError(comm, &r);
    } while (r == ncclInProgress);
  }
  if (r != ncclSuccess) {
    std::fprintf(stderr, "nccl_overhead: ncclAllReduce: %s\n", ncclGetErrorString(r));
    std::exit(1);
  }
}

struct Sample {
  double host_us = 0;
  double e2e_us = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

enum Variant { raw = 0, comm_same = 1, comm_cross = 2, raw_sync = 3, comm_wait = 4, kVariants = 5 };
const char* const kNames[] = {"raw ncclAllReduce", "comm (comm stream)", "comm (default stream)",
                              "raw + stream sync", "comm async + wait()"};
const char* const kTags[] = {"raw", "comm", "comm+xs", "raw+sync", "comm+wait"};
// What each variant's overhead is measured against.
const int kBaseline[] = {raw, raw, raw, raw_sync, raw_sync};

}  // namespace

int main(int argc, char** argv) try {
  const Args args = parse(argc, argv);
  if (const auto dc = comm::nccl::device_count(); dc.count <= 0) {
    std::printf("nccl_overhead: SKIPPED: no usable CUDA device (%s)\n", dc.why.c_str());
    return 77;
  }
  // The raw calls go to the same communicator from this thread; NCCL wants one thread at a time on
  // a communicator, so the watchdog's async-error polling (its only NCCL call) is pushed out to
  // once an hour here. Completion tracking (CUDA events) is unchanged.
  comm::backends::Nccl::Options o;
  o.watchdog_interval = std::chrono::hours(1);
  auto c = Comm::from_env(o);
  cuda_ok(cudaSetDevice(c.backend().device()), "cudaSetDevice");
  const cudaStream_t stream = c.backend().stream();
  const ncclComm_t raw_comm = c.backend().native_handle();
  const std::size_t max_bytes = *std::max_element(args.sizes.begin(), args.sizes.end());
  float* d = nullptr;
  cuda_ok(cudaMalloc(&d, std::max<std::size_t>(max_bytes, 4)), "cudaMalloc");
  cuda_ok(cudaMemset(d, 0, std::max<std::size_t>(max_bytes, 4)), "cudaMemset");

  if (c.rank() == 0) {
    cudaDeviceProp p{};
    cuda_ok(cudaGetDeviceProperties(&p, c.backend().device()), "cudaGetDeviceProperties");
    std::printf("nccl_overhead: NCCL %s (compiled %s), %d rank(s), device %d (%s), float all_reduce, %d calls x %d "
                "rounds, median\n",
                comm::nccl::version_string(comm::nccl::runtime_version()).c_str(),
                comm::nccl::version_string(comm::nccl::compiled_version).c_str(), c.size(), c.backend().device(),
                p.name, args.iters, args.rounds);
    std::printf("%-10s %-24s %14s %14s %24s\n", "size", "variant", "host us/call", "e2e us/call",
                "overhead vs raw");
  }

  for (const std::size_t bytes : args.sizes) {
    const std::size_t count = std::max<std::size_t>(bytes / sizeof(float), 1);
    const std::span<float> span(d, count);
    auto run = [&](int variant, int iters) {
      const auto t0 = Clock::now();
      if (variant == raw) {
        for (int i = 0; i < iters; ++i) raw_all_reduce(d, count, raw_comm, stream);
      } else if (variant == comm_same) {
        comm::nccl::StreamGuard g(stream);
        for (int i = 0; i < iters; ++i) c.all_reduce(span);
      } else if (variant == comm_cross) {
        for (int i = 0; i < iters; ++i) c.all_reduce(span);
      } else if (variant == raw_sync) {
        for (int i = 0; i < iters; ++i) {
          raw_all_reduce(d, count, raw_comm, stream);
          cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
        }
      } else {
        comm::nccl::StreamGuard g(stream);
        for (int i = 0; i < iters; ++i) c.all_reduce(span, comm::async).wait();
      }
      const auto t1 = Clock::now();
      cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      const auto t2 = Clock::now();
      return Sample{std::chrono::duration<double, std::micro>(t1 - t0).count() / iters,
                    std::chrono::duration<double, std::micro>(t2 - t0).count() / iters};
    };
    for (int v = kVariants - 1; v >= 0; --v) (void)run(v, args.warmup);
    std::vector<double> host[kVariants], e2e[kVariants];
    for (int r = 0; r < args.rounds; ++r) {
      for (int k = 0; k < kVariants; ++k) {
        const int v = (r + k) % kVariants;  // rotate the order so no variant always runs first
        c.barrier();
        const Sample s = run(v, args.iters);
        host[v].push_back(s.host_us);
        e2e[v].push_back(s.e2e_us);
      }
    }
    if (c.rank() == 0) {
      for (int v = 0; v < kVariants; ++v) {
        const double h = median(host[v]), e = median(e2e[v]);
        // The blocking variants compare host time per call; the waiting ones, time per round trip.
        const bool waits = v == raw_sync || v == comm_wait;
        const double mine = waits ? e : h;
        const double base = waits ? median(e2e[kBaseline[v]]) : median(host[kBaseline[v]]);
        char over[64] = "-";
        if (v != kBaseline[v])
          std::snprintf(over, sizeof(over), "%+.2f us (%.2fx)", mine - base, base > 0 ? mine / base : 0.0);
        const std::string size = bytes >= (1u << 20) ? std::to_string(bytes >> 20) + " MiB"
                                 : bytes >= 1024      ? std::to_string(bytes >> 10) + " KiB"
                                                      : std::to_string(bytes) + " B";
        std::printf("%-10s %-24s %14.2f %14.2f %24s\n", size.c_str(), kNames[v], h, e, over);
      }
      for (int v = 0; v < kVariants; ++v)
        std::printf("RESULT bytes=%zu variant=%s host_us=%.3f e2e_us=%.3f\n", bytes, kTags[v], median(host[v]),
                    median(e2e[v]));
    }
  }
  std::fflush(stdout);
  c.backend().synchronize();
  cuda_ok(cudaFree(d), "cudaFree");
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "nccl_overhead: %s\n", e.what());
  return 1;
}
