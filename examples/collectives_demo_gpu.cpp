// The seed scenario on the GPU: every collective once, on device memory, over NCCL.
//
//   comm-run -n 4 ./collectives_demo_gpu      (4 GPUs, or NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1)
//   comm-run -n 1 ./collectives_demo_gpu      (one GPU)
//
// Each rank prints its values before and after each operation; with 4 ranks:
//   all_reduce(rank)               -> 6 on every rank (0+1+2+3)
//   reduce_scatter([rank] * 4)     -> 6 on every rank (its slot summed over the ranks)
//   all_gather(rank)               -> [0, 1, 2, 3]
//   broadcast(world size, root 0)  -> 4 on every rank
//   gather(rank * 10, root 0)      -> [0, 10, 20, 30] on rank 0
//   async all_reduce(rank + 1)     -> 10, waited on through a comm::Work
//
// The buffers live on the device. The blocking calls return once the operation is queued on the
// communicator's stream and make this thread's current stream (the default stream here) wait for
// it, so the cudaMemcpy that reads a result back (on the default stream) sees it.
// Exits with 77 (skipped) and says why where no GPU is usable.
#include <cstdio>
#include <exception>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include <comm/comm.hpp>

namespace {

template <class T>
std::string show(const std::vector<T>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

/// A device copy of a host vector, read back with get().
template <class T>
class Device {
 public:
  explicit Device(const std::vector<T>& v) : n_(v.size()) {
    if (n_ > 0) {
      check(cudaMalloc(reinterpret_cast<void**>(&p_), n_ * sizeof(T)), "cudaMalloc");
      check(cudaMemcpy(p_, v.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
    }
  }
  ~Device() {
    if (p_ != nullptr) cudaFree(p_);
  }
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
  std::span<T> span() { return {p_, n_}; }
  std::vector<T> get() const {
    std::vector<T> v(n_);
    if (n_ > 0) check(cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
    return v;
  }

 private:
  T* p_ = nullptr;
  std::size_t n_;
};

}  // namespace

int main() try {
  if (const auto dc = comm::nccl::device_count(); dc.count <= 0) {
    std::printf("collectives_demo_gpu: SKIPPED: no usable CUDA device (%s)\n", dc.why.c_str());
    return 77;
  }
  // env:// rendezvous (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, set by comm-run); the device is
  // LOCAL_RANK % device count.
  auto c = comm::Communicator<comm::backends::Nccl>::from_env();
  const int rank = c.rank();
  const int n = c.size();
  check(cudaSetDevice(c.backend().device()), "cudaSetDevice");  // where this rank's buffers go
  if (rank == 0)
    std::printf("NCCL %s on %d rank(s)\n", comm::nccl::version_string(comm::nccl::runtime_version()).c_str(), n);

  // all_reduce in place: the sum of all ranks.
  Device<int> mine(std::vector<int>{rank});
  std::printf("rank %d: all_reduce      before %s", rank, show(mine.get()).c_str());
  c.all_reduce(mine.span());
  std::printf("  after %s\n", show(mine.get()).c_str());

  // reduce_scatter: every rank contributes [rank] * n; rank r receives the sum of slot r.
  const std::vector<int> contrib_host(static_cast<std::size_t>(n), rank);
  Device<int> contrib(contrib_host), slot(std::vector<int>{-1});
  c.reduce_scatter(contrib.span(), slot.span());
  std::printf("rank %d: reduce_scatter  before %s  after %s\n", rank, show(contrib_host).c_str(),
              show(slot.get()).c_str());

  // all_gather: everyone's rank, in rank order.
  Device<int> me(std::vector<int>{rank}), everyone(std::vector<int>(static_cast<std::size_t>(n), -1));
  c.all_gather(me.span(), everyone.span());
  std::printf("rank %d: all_gather      before [%d]  after %s\n", rank, rank, show(everyone.get()).c_str());

  // broadcast: rank 0 tells everyone the world size.
  Device<int> size_from_root(std::vector<int>{rank == 0 ? n : -1});
  std::printf("rank %d: broadcast       before %s", rank, show(size_from_root.get()).c_str());
  c.broadcast(size_from_root.span(), /*root=*/0);
  std::printf("  after %s\n", show(size_from_root.get()).c_str());

  // gather: rank 0 collects rank * 10 from everyone; the others pass an empty output.
  Device<int> tens(std::vector<int>{rank * 10});
  Device<int> gathered(std::vector<int>(rank == 0 ? static_cast<std::size_t>(n) : 0, -1));
  c.gather(tens.span(), gathered.span(), /*root=*/0);
  if (rank == 0)
    std::printf("rank %d: gather          before [%d]  after %s\n", rank, rank * 10, show(gathered.get()).c_str());
  else
    std::printf("rank %d: gather          sent [%d] to rank 0\n", rank, rank * 10);

  // async all_reduce: returns a Work at once; wait() blocks until the device is done (or rethrows
  // the error) and orders this thread's current stream after the operation.
  Device<float> async_buf(std::vector<float>{static_cast<float>(rank + 1)});
  comm::Work work = c.all_reduce(async_buf.span(), comm::async);
  work.wait();
  std::printf("rank %d: async all_reduce before [%d]  after [%g]\n", rank, rank + 1,
              static_cast<double>(async_buf.get()[0]));
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "collectives_demo_gpu: %s\n", e.what());
  return 1;
}
