#pragma once
// The NCCL engine behind comm::backends::Nccl: the operations, each one NCCL call (or a group of
// ncclSend/ncclRecv) issued through NcclCore (engine_core.hpp: the stream ordering, the watchdog,
// the flight recorder, the failure record and the liveness watch).

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <comm/concepts.hpp>
#include <comm/detail/diagnostics/flight_recorder.hpp>
#include <comm/detail/nccl/engine_core.hpp>
#include <comm/detail/nccl/errors.hpp>
#include <comm/detail/nccl/reduction.hpp>
#include <comm/detail/nccl/types.hpp>
#include <comm/detail/nccl/work.hpp>
#include <comm/detail/diagnostics/nvtx.hpp>
#include <comm/error.hpp>
#include <comm/types.hpp>
#include <comm/work.hpp>

namespace comm::detail::nccl {

class Engine final : public NcclCore {
 public:
  using NcclCore::NcclCore;

  // ---- collectives (arguments already checked by the facade, except device pointers) ----

  // `red`: a ReduceOp value, a comm::op::builtin<R> object or comm::op::premul_sum_t (see
  // reduction_arg).

  template <class T, class Red, class Launch>
  auto all_reduce(std::span<const T> in, std::span<T> out, const Red& red, Launch l) {
    return symmetric_reduction<OpKind::all_reduce>(in, out, red, l);
  }

  template <class T, class Red, class Launch>
  auto reduce_scatter(std::span<const T> in, std::span<T> out, const Red& red, Launch l) {
    return symmetric_reduction<OpKind::reduce_scatter>(in, out, red, l);
  }

  /// ncclReduce: `out` is used on the root only (in place when it is `in`); elsewhere NCCL gets a
  /// null receive buffer (its rule: recvbuff is only used on the root), so an empty `out` is fine
  /// and an in-place call leaves the non-root ranks' data as it was.
  template <class T, class Red, class Launch>
  auto reduce(std::span<const T> in, std::span<T> out, int root, const Red& red, Launch l) {
    constexpr const char* op = "reduce";
    RedArg a = rules().reduction_arg<T>(op, red);
    check_buffer(op, in.data(), in.size_bytes(), "input");
    if (rank() == root) check_buffer(op, out.data(), out.size_bytes(), "output");
    const ncclDataType_t dt = nccl_dtype(dtype_of<T>);
    void* recv = rank() == root ? static_cast<void*>(out.data()) : nullptr;
    const OpDesc d{OpKind::reduce, dtype_code<T>(), a.code, root, in.size()};
    return issue(d, l, in.empty(), [&](ncclComm_t c, cudaStream_t s) {
      return with_red_op(op, a, dt, c, [&](ncclRedOp_t o) {
        return in_pieces<T>(op, a, in.size(), [&](std::size_t at, std::size_t k) {
          T* to = recv == nullptr ? nullptr : static_cast<T*>(recv) + at;
          return COMM_NCCL_CHECK(ncclReduce(in.data() + at, to, k, dt, o, root, c, s), op, rank(), c);
        });
      });
    });
  }

  /// all_reduce (scatter = false) or reduce_scatter (true) with NCCL's pre-multiplied sum:
  /// every rank's input is multiplied by its own `scalar`, then summed.
  template <class T, class Launch>
  auto premul_sum(bool scatter, std::span<const T> in, std::span<T> out, T scalar, Launch l) {
    const char* op = scatter ? "reduce_scatter" : "all_reduce";
    const std::size_t n = static_cast<std::size_t>(size());
    if (!scatter && in.size() != out.size())
      throw InvalidArgument(op, rank(),
                            "premul_sum: input has " + std::to_string(in.size()) + " elements but output has " +
                                std::to_string(out.size()));
    if (scatter && in.size() != n * out.size())
      throw InvalidArgument(op, rank(),
                            "premul_sum: input has " + std::to_string(in.size()) + " elements, expected size()*output = " +
                                std::to_string(n * out.size()));
    static_assert(reduction_supported(ReduceOp::sum, dtype_of<T>),
                  "comm: the nccl backend does not reduce this element type");
    rules().check_reduction_runtime<T>(op);
    check_in_out(op, in, out);
    const ncclDataType_t dt = nccl_dtype(dtype_of<T>);
    RedArg a;
    a.premul = true;
    std::memcpy(a.scalar, &scalar, sizeof(T));
    a.code = static_cast<std::uint8_t>(ReduceOp::sum);
    const OpDesc d{scatter ? OpKind::reduce_scatter : OpKind::all_reduce, dtype_code<T>(), a.code, -1, out.size()};
    return issue(d, l, out.empty(), [&](ncclComm_t c, cudaStream_t s) {
      return with_red_op(op, a, dt, c, [&](ncclRedOp_t o) {
        return in_pieces<T>(op, a, out.size(), [&](std::size_t at, std::size_t k) {
          return scatter ? COMM_NCCL_CHECK(ncclReduceScatter(in.data() + at, out.data() + at, k, dt, o, c, s), op,
                                           rank(), c)
                         : COMM_NCCL_CHECK(ncclAllReduce(in.data() + at, out.data() + at, k, dt, o, c, s), op, rank(), c);
        });
      });
    });
  }

  template <class T, class Launch>
  auto all_gather(std::span<const T> in, std::span<T> out, Launch l) {
    constexpr const char* op = "all_gather";
    check_in_out(op, in, out);
    const ncclDataType_t dt = transfer_dtype(dtype_of<T>);
    const OpDesc d{OpKind::all_gather, dtype_code<T>(), OpDesc::none, -1, in.size()};
    return issue(d, l, in.empty(), [&](ncclComm_t c, cudaStream_t s) {
      return COMM_NCCL_CHECK(ncclAllGather(in.data(), out.data(), in.size(), dt, c, s), op, rank(), c);
    });
  }

  template <class T, class Launch>
  auto broadcast(std::span<T> data, int root, Launch l) {
    constexpr const char* op = "broadcast";
    check_buffer(op, data.data(), data.size_bytes(), "data");
    const ncclDataType_t dt = transfer_dtype(dtype_of<T>);
    const OpDesc d{OpKind::broadcast, dtype_code<T>(), OpDesc::none, root, data.size()};
    return issue(d, l, data.empty(), [&](ncclComm_t c, cudaStream_t s) {
      return COMM_NCCL_CHECK(ncclBroadcast(data.data(), data.data(), data.size(), dt, root, c, s), op, rank(), c);
    });
  }

  template <class T, class Launch>
  auto gather(std::span<const T> in, std::span<T> out, int root, Launch l) {
    constexpr const char* op = "gather";
    check_buffer(op, in.data(), in.size_bytes(), "input");
    if (rank() == root) check_buffer(op, out.data(), out.size_bytes(), "output");
    const ncclDataType_t dt = transfer_dtype(dtype_of<T>);
    void* recv = rank() == root ? static_cast<void*>(out.data()) : nullptr;
    const OpDesc d{OpKind::gather, dtype_code<T>(), OpDesc::none, root, in.size()};
#if COMM_NCCL_HAS_GATHER
    if (gather_algorithm() == GatherAlgorithm::native)
      return issue(d, l, in.empty(), [&](ncclComm_t c, cudaStream_t s) {
        return COMM_NCCL_CHECK(ncclGather(in.data(), recv, in.size(), dt, root, c, s), op, rank(), c);
      });
#endif
    return issue(d, l, in.empty(), [&](ncclComm_t c, cudaStream_t s) {
      return gather_p2p(in.data(), recv, in.size(), sizeof(T), dt, root, c, s);
    });
  }

  /// NCCL has no barrier: an all_reduce of one float. The blocking form also waits on the host
  /// until it completed, so it returns once every rank has entered the barrier.
  template <class Launch>
  auto barrier(Launch l) {
    constexpr const char* op = "barrier";
    return issue(
        OpDesc{OpKind::barrier, OpDesc::none, OpDesc::none, -1, 0}, l, false,
        [&](ncclComm_t c, cudaStream_t s) {
          return COMM_NCCL_CHECK(ncclAllReduce(scratch(), scratch(), 1, ncclFloat32, ncclSum, c, s), op, rank(), c);
        },
        /*host_wait=*/true);
  }

  // ---- the rest of the surface (concepts.hpp, capability 11) ----
  // scatter, all_to_all(_v), send, recv and batch_isend_irecv are ncclSend/ncclRecv in one group
  // call (ncclGroupStart/End), as torch.distributed does, on every NCCL; a rank's own block is a
  // device copy on the communicator's stream. Data moves in the element's NCCL datatype (fp8 as
  // bytes: transfer_dtype), so counts are elements. Zero-element transfers are left out (on both
  // sides, since the counts of a pair agree).

  /// On `root`, `in` holds size() blocks of out.size() elements; block r goes to rank r. `out` may
  /// be the root's own block of `in`.
  template <class T, class Launch>
  auto scatter(std::span<const T> in, std::span<T> out, int root, Launch l) {
    constexpr const char* op = "scatter";
    if (rank() == root) check_buffer(op, in.data(), in.size_bytes(), "input");
    check_buffer(op, out.data(), out.size_bytes(), "output");
    const ncclDataType_t dt = transfer_dtype(dtype_of<T>);
    const std::size_t count = out.size();
    const OpDesc d{OpKind::scatter, dtype_code<T>(), OpDesc::none, root, count};
    return issue(d, l, count == 0, [&](ncclComm_t c, cudaStream_t s) {
      if (rank() == root) {
        const T* mine = in.data() + static_cast<std::size_t>(root) * count;
        if (mine != out.data())
          COMM_CUDA_CHECK(cudaMemcpyAsync(out.data(), mine, count * sizeof(T), cudaMemcpyDefault, s), op, rank());
      }
      return in_group(op, c, [&] {
        if (rank() == root) {
          for (int r = 0; r < size(); ++r)
            if (r != root)
              COMM_NCCL_CHECK(ncclSend(in.data() + static_cast<std::size_t>(r) * count, count, dt, r, c, s), op,
                              rank(), c);
        } else {
          COMM_NCCL_CHECK(ncclRecv(out.data(), count, dt, root, c, s), op, rank(), c);
        }
      });
    });
  }

  /// `in` and `out` hold size() equal blocks (the facade checked it, and that they do not
  /// overlap): block p of `in` goes to rank p, block q of `out` comes from rank q.
  template <class T, class Launch>
  auto all_to_all(std::span<const T> in, std::span<T> out, Launch l) {
    constexpr const char* op = "all_to_all";
    check_in_out(op, in, out);
    const ncclDataType_t dt = transfer_dtype(dtype_of<T>);
    const std::size_t block = in.size() / static_cast<std::size_t>(size());
    const OpDesc d{OpKind::all_to_all, dtype_code<T>(), OpDesc::none, -1, in.size()};
    return issue(d, l, block == 0, [&](ncclComm_t c, cudaStream_t s) {
      const auto me = static_cast<std::size_t>(rank());
      COMM_CUDA_CHECK(cudaMemcpyAsync(out.data() + me * block, in.data() + me * block, block * sizeof(T),
                                      cudaMemcpyDefault, s),
                      op, rank());
      return in_group(op, c, [&] {
        for (int r = 0; r < size(); ++r) {
          if (r == rank()) continue;
          const std::size_t at = static_cast<std::size_t>(r) * block;
          COMM_NCCL_CHECK(ncclSend(in.data() + at, block, dt, r, c, s), op, rank(), c);
          COMM_NCCL_CHECK(ncclRecv(out.data() + at, block, dt, r, c, s), op, rank(), c);
        }
      });
    });
  }

  /// in_counts[p] elements to rank p, out_counts[q] from rank q, blocks at the prefix sums (the
  /// facade checked the sums, the sizes and in_counts[rank] == out_counts[rank]). A count that
  /// differs from the peer's is not detected by NCCL (see nccl.hpp).
  template <class T, class Launch>
  auto all_to_all_v(std::span<const T> in, std::span<const std::size_t> in_counts, std::span<T> out,
                    std::span<const std::size_t> out_counts, Launch l) {
    constexpr const char* op = "all_to_all_v";
    check_in_out(op, in, out);
    const ncclDataType_t dt = transfer_dtype(dtype_of<T>);
    // The count differs by rank: the fingerprint compares the operation and element type only.
    const OpDesc d{OpKind::all_to_all_v, dtype_code<T>(), OpDesc::none, -1, 0};
    return issue(d, l, in.empty() && out.empty(), [&](ncclComm_t c, cudaStream_t s) {
      std::size_t in_at = 0, out_at = 0;
      for (int r = 0; r < rank(); ++r) {
        in_at += in_counts[static_cast<std::size_t>(r)];
        out_at += out_counts[static_cast<std::size_t>(r)];
      }
      const std::size_t own = in_counts[static_cast<std::size_t>(rank())];
      if (own != 0)
        COMM_CUDA_CHECK(cudaMemcpyAsync(out.data() + out_at, in.data() + in_at, own * sizeof(T), cudaMemcpyDefault, s),
                        op, rank());
      return in_group(op, c, [&] {
        std::size_t si = 0, ro = 0;
        for (int r = 0; r < size(); ++r) {
          const auto ur = static_cast<std::size_t>(r);
          if (r != rank()) {
            if (in_counts[ur] != 0) COMM_NCCL_CHECK(ncclSend(in.data() + si, in_counts[ur], dt, r, c, s), op, rank(), c);
            if (out_counts[ur] != 0)
              COMM_NCCL_CHECK(ncclRecv(out.data() + ro, out_counts[ur], dt, r, c, s), op, rank(), c);
          }
          si += in_counts[ur];
          ro += out_counts[ur];
        }
      });
    });
  }

  /// ncclSend in a group call. NCCL has no message tags: `tag` must be 0.
  template <class T, class Launch>
  auto send(std::span<const T> data, int peer, int tag, Launch l) {
    return one_message<OpKind::send>(data, peer, tag, l);
  }

  /// ncclRecv in a group call. NCCL has no message tags: `tag` must be 0.
  template <class T, class Launch>
  auto recv(std::span<T> data, int peer, int tag, Launch l) {
    return one_message<OpKind::recv>(data, peer, tag, l);
  }

  /// Every entry's ncclSend / ncclRecv in one group call: one operation (one flight-recorder
  /// entry, one completion event), and one Work per entry, all on that completion (each behaves
  /// as an async operation's Work). Tags must be 0. No entries: no operation, no Work.
  template <class T>
  std::vector<Work> batch_isend_irecv(std::span<const P2POp<T>> ops) {
    constexpr const char* op = "batch_isend_irecv";
    std::vector<Work> works;
    if (ops.empty()) return works;
    bool empty = true;
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const auto& o = ops[i];
      const std::string entry = " (entry " + std::to_string(i) + ")";
      check_tag(op, o.tag, entry.c_str());
      check_buffer(op, o.buffer.data(), o.buffer.size_bytes(),
                   o.op == P2PKind::isend ? "a send buffer" : "a receive buffer");
      empty = empty && o.buffer.empty();
    }
    const ncclDataType_t dt = transfer_dtype(dtype_of<T>);
    const OpDesc d{OpKind::p2p_batch, dtype_code<T>(), OpDesc::none, ops.front().peer, ops.size()};
    auto enqueue = [&](ncclComm_t c, cudaStream_t s) {
      return in_group(op, c, [&] {
        for (const auto& o : ops) {
          if (o.buffer.empty()) continue;
          if (o.op == P2PKind::isend)
            COMM_NCCL_CHECK(ncclSend(o.buffer.data(), o.buffer.size(), dt, o.peer, c, s), op, rank(), c);
          else
            COMM_NCCL_CHECK(ncclRecv(o.buffer.data(), o.buffer.size(), dt, o.peer, c, s), op, rank(), c);
        }
      });
    };
    nvtx::ScopedRange range;  // COMM_NVTX=1 (detail/diagnostics/nvtx.hpp)
    const std::shared_ptr<NcclOp> state = issue_state(d, /*is_async=*/true, empty, enqueue, range);
    works.reserve(ops.size());
    for (std::size_t i = 0; i < ops.size(); ++i) works.emplace_back(std::shared_ptr<WorkState>(state));
    return works;
  }

 private:
  /// check_buffer of an operation's input and output (both on this rank).
  template <class T>
  void check_in_out(const char* op, std::span<const T> in, std::span<T> out) const {
    check_buffer(op, in.data(), in.size_bytes(), "input");
    check_buffer(op, out.data(), out.size_bytes(), "output");
  }

  /// send or recv (`K`): one ncclSend / ncclRecv in a group call.
  template <OpKind K, class T, class Launch>
  auto one_message(std::span<T> data, int peer, int tag, Launch l) {
    constexpr bool is_send = K == OpKind::send;
    constexpr const char* op = is_send ? "send" : "recv";
    using E = std::remove_const_t<T>;
    check_tag(op, tag, "");
    check_buffer(op, data.data(), data.size_bytes(), "data");
    const ncclDataType_t dt = transfer_dtype(dtype_of<E>);
    const OpDesc d{K, dtype_code<E>(), OpDesc::none, peer, data.size()};
    return issue(d, l, data.empty(), [&](ncclComm_t c, cudaStream_t s) {
      return in_group(op, c, [&] {
        if constexpr (is_send)
          COMM_NCCL_CHECK(ncclSend(data.data(), data.size(), dt, peer, c, s), op, rank(), c);
        else
          COMM_NCCL_CHECK(ncclRecv(data.data(), data.size(), dt, peer, c, s), op, rank(), c);
      });
    });
  }

  /// all_reduce or reduce_scatter (`K`): ncclAllReduce / ncclReduceScatter of out.size() elements.
  template <OpKind K, class T, class Red, class Launch>
  auto symmetric_reduction(std::span<const T> in, std::span<T> out, const Red& red, Launch l) {
    constexpr bool ar = K == OpKind::all_reduce;
    constexpr const char* op = ar ? "all_reduce" : "reduce_scatter";
    RedArg a = rules().reduction_arg<T>(op, red);
    check_in_out(op, in, out);
    const ncclDataType_t dt = nccl_dtype(dtype_of<T>);
    const OpDesc d{K, dtype_code<T>(), a.code, -1, ar ? in.size() : out.size()};
    return issue(d, l, out.empty(), [&](ncclComm_t c, cudaStream_t s) {
      return with_red_op(op, a, dt, c, [&](ncclRedOp_t o) {
        return in_pieces<T>(op, a, out.size(), [&](std::size_t at, std::size_t k) {
          if constexpr (ar)
            return COMM_NCCL_CHECK(ncclAllReduce(in.data() + at, out.data() + at, k, dt, o, c, s), op, rank(), c);
          else
            return COMM_NCCL_CHECK(ncclReduceScatter(in.data() + at, out.data() + at, k, dt, o, c, s), op, rank(), c);
        });
      });
    });
  }

  /// Runs `call(nccl op)`, which returns the NCCL call's result. A premul_sum's operator is made
  /// just before (ncclRedOpCreatePreMulSum, ncclScalarHostImmediate: the scalar is read at once) and
  /// destroyed once the call is enqueued (NCCL allows it as soon as the call has returned).
  template <class Call>
  ncclResult_t with_red_op(const char* op, RedArg& a, ncclDataType_t dt, ncclComm_t c, Call&& call) {
    if (!a.premul) return call(a.op);
    ncclRedOp_t pm{};
    if (COMM_NCCL_CHECK(ncclRedOpCreatePreMulSum(&pm, a.scalar, dt, ncclScalarHostImmediate, c), op, rank(), c) ==
        ncclInProgress)
      wait_enqueued(op);
    struct Destroy {
      ncclRedOp_t op;
      ncclComm_t comm;
      ~Destroy() { (void)ncclRedOpDestroy(op, comm); }
    } destroy{pm, c};
    if (call(pm) == ncclInProgress) wait_enqueued(op);
    return ncclSuccess;
  }

  /// `call(offset, count)` over [0, n) elements: one call, or two on a communicator of one rank
  /// where NCCL's one-rank kernel would leave elements of a pre-multiplied sum (avg, premul_sum)
  /// unwritten (one_rank_kernel_covers in reduction.hpp). NCCL's one-rank path has no fp8 kernel
  /// for a pre-multiplied sum: NCCL 2.28.3 and 2.28.9 answered ncclInvalidArgument on an H200, and
  /// the next call on that communicator failed the same way, even a plain fp8 sum that works on a
  /// fresh one (gpu-check, 2026-11-28). So it is refused here, before NCCL sees it.
  template <class T, class Call>
  ncclResult_t in_pieces(const char* op, const RedArg& a, std::size_t n, Call&& call) {
    const bool scaled = a.premul || a.code == static_cast<std::uint8_t>(ReduceOp::avg);
    if (size() != 1 || !scaled) return call(0, n);
    if (is_fp8(dtype_of<T>))
      throw InvalidArgument(op, rank(),
                            "a pre-multiplied sum (avg, premul_sum) of fp8 on a communicator of one rank: "
                            "NCCL's one-rank path has no fp8 kernel for it (NCCL " +
                                version_string(runtime_version()) +
                                " here; NCCL 2.28 refuses it and leaves the communicator failing), so comm does "
                                "not call it: use two or more ranks, or a wider type");
    const std::size_t head = one_rank_head(n, sizeof(T));
    if (head == n) return call(0, n);
    if (call(0, head) == ncclInProgress) wait_enqueued(op);
    return call(head, n - head);
  }

  /// ncclGroupStart, `body` (ncclSend / ncclRecv calls), ncclGroupEnd; the group is closed when
  /// `body` throws. Returns ncclGroupEnd's result (ncclInProgress on a non-blocking communicator
  /// that is still enqueuing).
  template <class Body>
  ncclResult_t in_group(const char* op, ncclComm_t c, Body&& body) {
    COMM_NCCL_CHECK(ncclGroupStart(), op, rank(), c);
    try {
      body();
    } catch (...) {
      (void)ncclGroupEnd();  // a group must always be closed
      throw;
    }
    return COMM_NCCL_CHECK(ncclGroupEnd(), op, rank(), c);
  }

  /// NCCL matches messages between two ranks in issue order and has no tags.
  void check_tag(const char* op, int tag, const char* where) const {
    if (tag != 0)
      throw InvalidArgument(op, rank(),
                            "tag " + std::to_string(tag) + std::string(where) +
                                ": NCCL has no message tags; use tag 0 (messages between two ranks are matched in "
                                "the order they are issued)");
  }

  /// gather on ncclSend/ncclRecv: the root copies its own block and receives every other rank's
  /// block into its slot, all in one group call.
  ncclResult_t gather_p2p(const void* in, void* out, std::size_t count, std::size_t elem, ncclDataType_t dt, int root,
                          ncclComm_t c, cudaStream_t s) {
    constexpr const char* op = "gather";
    const std::size_t block = count * elem;
    auto* base = static_cast<std::byte*>(out);
    if (rank() == root) {
      std::byte* mine = base + static_cast<std::size_t>(root) * block;
      if (mine != in) COMM_CUDA_CHECK(cudaMemcpyAsync(mine, in, block, cudaMemcpyDefault, s), op, rank());
    }
    COMM_NCCL_CHECK(ncclGroupStart(), op, rank(), c);
    try {
      if (rank() == root) {
        for (int r = 0; r < size(); ++r)
          if (r != root)
            COMM_NCCL_CHECK(ncclRecv(base + static_cast<std::size_t>(r) * block, count, dt, r, c, s), op, rank(), c);
      } else {
        COMM_NCCL_CHECK(ncclSend(in, count, dt, root, c, s), op, rank(), c);
      }
    } catch (...) {
      (void)ncclGroupEnd();  // a group must always be closed
      throw;
    }
    return COMM_NCCL_CHECK(ncclGroupEnd(), op, rank(), c);
  }

};

}  // namespace comm::detail::nccl
