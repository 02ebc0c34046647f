#pragma once
// comm-bench --backend nccl: comm's NCCL backend, and with --baseline raw the raw NCCL call
// (ncclAllReduce...) on the same ncclComm_t and stream (backend().native_handle(), stream()),
// alternating call by call. Buffers are device memory (cudaMalloc). Each timed call is the
// enqueue plus cudaStreamSynchronize of the communicator's stream, for comm and raw alike, so the
// time is the completed operation as the host sees it. One GPU per rank: NCCL refuses two ranks on
// one device, so a machine with one GPU runs world 1.
//
// Only compiled where comm::nccl exists (COMM_HAS_NCCL).

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdio>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <comm/comm.hpp>

#include "bench.hpp"
#include "cli.hpp"
#include "data.hpp"
#include "harness.hpp"
#include "views.hpp"

namespace comm::bench {

using NcclComm = comm::Communicator<comm::backends::Nccl>;

inline void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
inline void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw std::runtime_error(std::string(what) + ": " + ncclGetErrorString(r));
}

template <class T>
ncclDataType_t nccl_type() {
  if constexpr (std::is_same_v<T, float>) return ncclFloat32;
  if constexpr (std::is_same_v<T, double>) return ncclFloat64;
  if constexpr (std::is_same_v<T, comm::half>) return ncclFloat16;
  if constexpr (std::is_same_v<T, comm::bfloat16>) return ncclBfloat16;
#if NCCL_VERSION_CODE >= 22400
  if constexpr (std::is_same_v<T, comm::float8_e4m3>) return ncclFloat8e4m3;
  if constexpr (std::is_same_v<T, comm::float8_e5m2>) return ncclFloat8e5m2;
#else
  if constexpr (std::is_same_v<T, comm::float8_e4m3> || std::is_same_v<T, comm::float8_e5m2>)
    return ncclUint8;  // fp8 before NCCL 2.24: moved as bytes only
#endif
  if constexpr (std::is_same_v<T, std::int8_t>) return ncclInt8;
  if constexpr (std::is_same_v<T, std::uint8_t>) return ncclUint8;
  if constexpr (std::is_same_v<T, std::int32_t>) return ncclInt32;
  if constexpr (std::is_same_v<T, std::uint32_t>) return ncclUint32;
  if constexpr (std::is_same_v<T, std::int64_t>) return ncclInt64;
  return ncclUint64;
}

inline ncclRedOp_t nccl_op(comm::ReduceOp op) {
  switch (op) {
    case comm::ReduceOp::sum: return ncclSum;
    case comm::ReduceOp::prod: return ncclProd;
    case comm::ReduceOp::min: return ncclMin;
    case comm::ReduceOp::max: return ncclMax;
    case comm::ReduceOp::avg: return ncclAvg;
    default: throw std::invalid_argument("NCCL has no " + std::string(comm::to_string(op)));
  }
}

/// Device copies of a host Buffers<T>: same layout, so view() works on either.
template <class T>
struct DeviceBuffers {
  T* in = nullptr;
  T* out = nullptr;
  std::size_t in_n = 0, out_n = 0;
  DeviceBuffers(std::size_t in_elems, std::size_t out_elems) : in_n(in_elems), out_n(out_elems) {
    if (in_n) cuda_check(cudaMalloc(&in, in_n * sizeof(T)), "cudaMalloc");
    if (out_n) cuda_check(cudaMalloc(&out, out_n * sizeof(T)), "cudaMalloc");
  }
  DeviceBuffers(const DeviceBuffers&) = delete;
  DeviceBuffers& operator=(const DeviceBuffers&) = delete;
  ~DeviceBuffers() {
    cudaFree(in);
    cudaFree(out);
  }
};

template <class T>
void run_nccl_dtype(const Options& o, NcclComm& c, const CrossRank& x, long& wrong_total) {
  const auto redop_opt = parse_redop(o.redop);
  if (!redop_opt) throw std::invalid_argument("unknown --redop '" + o.redop + "'");
  const comm::ReduceOp redop = *redop_opt;
  const int rank = c.rank(), n = c.size();
  const cudaStream_t stream = c.backend().stream();
  const ncclComm_t raw = c.backend().native_handle();
  const bool baseline = o.baseline == "raw";

  for (Op op : o.ops) {
    const auto sizes = sizes_for(o, op);
    const bool inplace = in_place(o, op);
    if (op == Op::send_recv && n < 2)
      throw std::invalid_argument("--op send_recv needs at least 2 ranks (NCCL: one GPU per rank)");
    // NCCL has no barrier call: comm's barrier runs alone.
    const bool with_raw = baseline && op != Op::barrier;
    Buffers<T> host;  // host mirror: fill and check happen here, then copy
    host.reserve(op, sizes, n, inplace);
    DeviceBuffers<T> dev(host.in.size(), host.out.size());
    if (rank == 0 && !o.json) {
      std::printf("# comm-bench %s: backend nccl (device %d, NCCL %s), world %d, dtype %s, redop %s, %s%s\n",
                  std::string(to_string(op)).c_str(), c.backend().device(),
                  comm::nccl::version_string(comm::nccl::runtime_version()).c_str(), n,
                  std::string(dtype_name<T>()).c_str(), is_reduction(op) ? o.redop.c_str() : "none",
                  inplace ? "in place" : "out of place", with_raw ? ", baseline raw NCCL" : "");
      print_table_header(o.check, with_raw);
    }
    for (std::size_t bytes : sizes) {
      const Layout l = layout(op, bytes, sizeof(T), n);
      const View<T> hv = view(host, op, l, inplace, rank, o.root);
      // The same view on the device buffers (offsets carried over).
      auto dptr = [&](T* p) -> T* {
        if (p == nullptr) return nullptr;
        if (!host.in.empty() && p >= host.in.data() && p <= host.in.data() + host.in.size())
          return dev.in + (p - host.in.data());
        return dev.out + (p - host.out.data());
      };
      View<T> dv = hv;
      dv.in = dptr(hv.in);
      dv.out = dptr(hv.out);
      auto fill = [&] {
        fill_view(hv, op, rank);
        if (!host.in.empty()) cuda_check(cudaMemcpy(dev.in, host.in.data(), host.in.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
        if (!host.out.empty()) cuda_check(cudaMemcpy(dev.out, host.out.data(), host.out.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
      };
      auto verify = [&] {
        if (hv.out_n) cuda_check(cudaMemcpy(hv.out, dv.out, hv.out_n * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
        return verify_view(hv, op, redop, l, rank, n, o.root);
      };
      auto sync = [&] { cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize"); };
      std::vector<Candidate> cands;
      cands.push_back({[&] {
                         if (o.async)
                           async_call(c, op, dv, redop, o.root);
                         else
                           blocking_call(c, op, dv, redop, o.root);
                         sync();
                       },
                       fill, verify});
      if (with_raw) {
        const ncclDataType_t dt = nccl_type<T>();
        cands.push_back({[&] {
                           switch (op) {
                             case Op::all_reduce:
                               nccl_check(ncclAllReduce(dv.in, dv.out, l.count, dt, nccl_op(redop), raw, stream), "ncclAllReduce");
                               break;
                             case Op::reduce_scatter:
                               nccl_check(ncclReduceScatter(dv.in, dv.out, l.block, dt, nccl_op(redop), raw, stream),
                                          "ncclReduceScatter");
                               break;
                             case Op::all_gather:
                               nccl_check(ncclAllGather(dv.in, dv.out, l.block, dt, raw, stream), "ncclAllGather");
                               break;
                             case Op::broadcast:
                               nccl_check(ncclBroadcast(dv.out, dv.out, l.count, dt, o.root, raw, stream), "ncclBroadcast");
                               break;
                             case Op::gather:
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
                               nccl_check(ncclGather(dv.in, dv.out, l.block, dt, o.root, raw, stream), "ncclGather");
#else
                               nccl_check(ncclGroupStart(), "ncclGroupStart");
                               if (rank == o.root)
                                 for (int q = 0; q < n; ++q)
                                   nccl_check(ncclRecv(dv.out + static_cast<std::size_t>(q) * l.block, l.block, dt, q, raw, stream), "ncclRecv");
                               nccl_check(ncclSend(dv.in, l.block, dt, o.root, raw, stream), "ncclSend");
                               nccl_check(ncclGroupEnd(), "ncclGroupEnd");
#endif
                               break;
                             case Op::reduce:
                               nccl_check(ncclReduce(dv.in, dv.out, l.count, dt, nccl_op(redop), o.root, raw, stream),
                                          "ncclReduce");
                               break;
                             case Op::scatter:
                               nccl_check(ncclGroupStart(), "ncclGroupStart");
                               if (rank == o.root)
                                 for (int q = 0; q < n; ++q)
                                   nccl_check(ncclSend(dv.in + static_cast<std::size_t>(q) * l.block, l.block, dt, q, raw, stream), "ncclSend");
                               nccl_check(ncclRecv(dv.out, l.block, dt, o.root, raw, stream), "ncclRecv");
                               nccl_check(ncclGroupEnd(), "ncclGroupEnd");
                               break;
                             case Op::all_to_all:
                             case Op::all_to_all_v: {
                               nccl_check(ncclGroupStart(), "ncclGroupStart");
                               std::size_t so = 0, ro = 0;
                               for (int q = 0; q < n; ++q) {
                                 const std::size_t sc = op == Op::all_to_all ? l.block : dv.in_counts[static_cast<std::size_t>(q)];
                                 const std::size_t rc = op == Op::all_to_all ? l.block : dv.out_counts[static_cast<std::size_t>(q)];
                                 nccl_check(ncclSend(dv.in + so, sc, dt, q, raw, stream), "ncclSend");
                                 nccl_check(ncclRecv(dv.out + ro, rc, dt, q, raw, stream), "ncclRecv");
                                 so += sc;
                                 ro += rc;
                               }
                               nccl_check(ncclGroupEnd(), "ncclGroupEnd");
                               break;
                             }
                             case Op::send_recv:
                               if (dv.peer < 0) break;
                               if (rank < dv.peer) {
                                 nccl_check(ncclSend(dv.in, l.count, dt, dv.peer, raw, stream), "ncclSend");
                                 nccl_check(ncclRecv(dv.out, l.count, dt, dv.peer, raw, stream), "ncclRecv");
                               } else {
                                 nccl_check(ncclRecv(dv.out, l.count, dt, dv.peer, raw, stream), "ncclRecv");
                                 nccl_check(ncclSend(dv.in, l.count, dt, dv.peer, raw, stream), "ncclSend");
                               }
                               break;
                             case Op::barrier: break;  // with_raw is false
                           }
                           sync();
                         },
                         fill, verify});
      }
      const Measured m = measure(o, cands, x);
      wrong_total += report(o, rank, n, op, std::string(dtype_name<T>()), inplace, l, m,
                            {o.async ? "comm-nccl-async" : "comm-nccl", "", with_raw ? "nccl-raw" : "", ""});
    }
  }
}

/// Runs every op of `o` on the NCCL backend; returns the process exit code.
inline int run_nccl(const Options& o) {
  comm::InitResult init = comm::init_env();
  auto c = NcclComm::create(init.store, init.rank, init.size);
  cuda_check(cudaSetDevice(c.backend().device()), "cudaSetDevice");
  double* scratch = nullptr;
  cuda_check(cudaMalloc(&scratch, sizeof(double) * 4096), "cudaMalloc");
  std::unique_ptr<double, decltype(&cudaFree)> scratch_owner(scratch, &cudaFree);
  // Cross-rank reductions of the timing vectors, through the communicator itself (untimed).
  auto reduce = [&](std::span<double> v, comm::ReduceOp op) {
    for (std::size_t off = 0; off < v.size(); off += 4096) {
      const std::size_t k = std::min<std::size_t>(4096, v.size() - off);
      cuda_check(cudaMemcpy(scratch, v.data() + off, k * sizeof(double), cudaMemcpyHostToDevice), "cudaMemcpy");
      c.all_reduce(std::span<double>(scratch, k), op);
      c.backend().synchronize();
      cuda_check(cudaMemcpy(v.data() + off, scratch, k * sizeof(double), cudaMemcpyDeviceToHost), "cudaMemcpy");
    }
  };
  CrossRank x;
  x.max = [&](std::span<double> v) { reduce(v, comm::ReduceOp::max); };
  x.sum = [&](std::span<double> v) { reduce(v, comm::ReduceOp::sum); };
  long wrong = 0;
  const bool known = with_dtype(o.dtype, [&](auto t) { run_nccl_dtype<decltype(t)>(o, c, x, wrong); });
  if (!known) throw std::invalid_argument("unknown --dtype '" + o.dtype + "'");
  std::vector<double> rss(static_cast<std::size_t>(init.size), 0.0);
  rss[static_cast<std::size_t>(init.rank)] = static_cast<double>(peak_rss_kb());
  x.max(rss);
  if (init.rank == 0 && o.json) print_json_memory("comm-nccl", init.size, std::vector<long>(rss.begin(), rss.end()));
  c.barrier();
  if (wrong > 0) {
    if (init.rank == 0) std::fprintf(stderr, "comm-bench: --check found %ld wrong elements\n", wrong);
    return 1;
  }
  return 0;
}

}  // namespace comm::bench
