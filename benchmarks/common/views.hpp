#pragma once
// Where one rank's input and output live for an op at one size, and how they are filled and
// checked. Shared by every C++ program so that all of them move the same bytes.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench.hpp"
#include "data.hpp"

namespace comm::bench {

template <class T>
struct Buffers {
  std::vector<T> in, out;
  std::size_t in_at = 0, out_at = 0;  ///< where the buffers start in `in` and `out` (elements)

  [[nodiscard]] T* in_data() noexcept { return in.data() + in_at; }
  [[nodiscard]] T* out_data() noexcept { return out.data() + out_at; }

  /// Room for every size of `sizes` (allocated and touched once, like nccl-tests); only the
  /// buffers that `view` uses for this op and placement. With `place`, each buffer starts that
  /// many bytes past a page boundary (a multiple of the element size: std::invalid_argument).
  void reserve(Op op, const std::vector<std::size_t>& sizes, int n, bool inplace, Place place = {}) {
    std::size_t in_cap = 0, out_cap = 0;
    for (auto s : sizes) {
      const Layout l = layout(op, s, sizeof(T), n);
      in_cap = std::max(in_cap, l.in_count);
      out_cap = std::max(out_cap, std::max(l.out_count, l.count));
    }
    const bool in_unused = op == Op::broadcast || op == Op::barrier ||
                           (inplace && (op == Op::all_reduce || op == Op::all_gather || op == Op::reduce));
    const bool out_unused = op == Op::barrier || (inplace && op == Op::reduce_scatter);
    in_at = out_at = 0;
    in.assign(in_unused ? 0 : in_cap, T{});
    out.assign(out_unused ? 0 : out_cap, T{});
    auto shift = [](std::vector<T>& v, long offset, std::size_t& at) {
      if (offset < 0 || v.empty()) return;
      if (static_cast<std::size_t>(offset) % sizeof(T) != 0)
        throw std::invalid_argument("--offset " + std::to_string(offset) + " is not a multiple of the element size (" +
                                    std::to_string(sizeof(T)) + " bytes)");
      const std::size_t cap = v.size();
      v.assign(cap + (4096 + static_cast<std::size_t>(offset)) / sizeof(T) + 1, T{});
      const auto a = reinterpret_cast<std::uintptr_t>(v.data());
      at = (((4096 - (a & 4095u)) & 4095u) + static_cast<std::size_t>(offset)) / sizeof(T);
    };
    shift(in, place.in, in_at);
    shift(out, place.out, out_at);
  }
};

template <class T>
struct View {
  T* in = nullptr;
  T* out = nullptr;
  std::size_t in_n = 0;   ///< elements at `in`
  std::size_t out_n = 0;  ///< elements at `out` (gather, reduce: 0 off the root)
  std::vector<std::size_t> in_counts, out_counts;  ///< all_to_all_v: per peer, packed in rank order
  int peer = -1;  ///< send_recv: the partner (rank ^ 1); -1 for the last rank of an odd world
};

/// send_recv's partner of `rank` in a world of `n`: (0,1), (2,3)...; -1 for the odd one out.
[[nodiscard]] constexpr int ping_pong_peer(int rank, int n) noexcept {
  const int p = rank ^ 1;
  return p < n ? p : -1;
}

template <class T>
[[nodiscard]] View<T> view(Buffers<T>& b, Op op, const Layout& l, bool inplace, int rank, int root) {
  View<T> v;
  const std::size_t mine = static_cast<std::size_t>(rank) * l.block;
  switch (op) {
    case Op::all_reduce:
      v.out = b.out_data();
      v.in = inplace ? v.out : b.in_data();
      v.in_n = v.out_n = l.count;
      break;
    case Op::reduce_scatter:
      v.in = b.in_data();
      v.out = inplace ? v.in + mine : b.out_data();
      v.in_n = l.in_count;
      v.out_n = l.block;
      break;
    case Op::all_gather:
      v.out = b.out_data();
      v.in = inplace ? v.out + mine : b.in_data();
      v.in_n = l.block;
      v.out_n = l.out_count;
      break;
    case Op::broadcast:
      v.in = v.out = b.out_data();
      v.in_n = v.out_n = l.count;
      break;
    case Op::gather:
      v.in = b.in_data();
      v.out = b.out_data();
      v.in_n = l.block;
      v.out_n = rank == root ? l.out_count : 0;
      break;
    case Op::reduce:
      v.out = b.out_data();
      v.in = inplace ? v.out : b.in_data();
      v.in_n = l.count;
      // In place every rank passes its whole buffer; out of place only the root has an output.
      v.out_n = inplace || rank == root ? l.count : 0;
      break;
    case Op::scatter:
      v.in = b.in_data();
      v.in_n = rank == root ? l.in_count : 0;
      v.out = inplace && rank == root ? v.in + mine : b.out_data();
      v.out_n = l.block;
      break;
    case Op::all_to_all:
      v.in = b.in_data();
      v.out = b.out_data();
      v.in_n = v.out_n = l.count;
      break;
    case Op::all_to_all_v:
      v.in = b.in_data();
      v.out = b.out_data();
      for (int p = 0; p < l.world; ++p) {
        v.in_counts.push_back(a2av_count(rank, p, l.block));
        v.out_counts.push_back(a2av_count(p, rank, l.block));
        v.in_n += v.in_counts.back();
        v.out_n += v.out_counts.back();
      }
      break;
    case Op::send_recv:
      v.in = b.in_data();
      v.out = b.out_data();
      v.in_n = v.out_n = l.count;
      v.peer = ping_pong_peer(rank, l.world);
      break;
    case Op::barrier: break;
  }
  return v;
}

/// Rank `rank`'s inputs; outputs that are not inputs are zeroed so stale results cannot pass.
template <class T>
void fill_view(const View<T>& v, Op op, int rank) {
  const bool red = is_reduction(op);
  const bool overlap = v.in && v.out && v.in < v.out + v.out_n && v.out < v.in + v.in_n;
  if (!overlap || op == Op::all_gather) std::fill(v.out, v.out + v.out_n, T{});
  fill(std::span<T>(v.in, v.in_n), red, rank);
}

template <class T>
[[nodiscard]] long verify_view(const View<T>& v, Op op, comm::ReduceOp redop, const Layout& l, int rank, int n,
                               int root) {
  if (op == Op::all_to_all_v) {
    // Block q of the output came from rank q, which packed its block for `rank` at the prefix sum
    // of its counts (rank q's input element j is input_value(q, j)).
    long wrong = 0;
    std::size_t at = 0;
    for (int q = 0; q < n; ++q) {
      std::size_t from = 0;
      for (int p = 0; p < rank; ++p) from += a2av_count(q, p, l.block);
      for (std::size_t i = 0; i < v.out_counts[static_cast<std::size_t>(q)]; ++i, ++at)
        wrong += !same(v.out[at], input_value(false, q, from + i), false);
    }
    return wrong;
  }
  if (op == Op::send_recv) {
    if (v.peer < 0) return 0;
    long wrong = 0;
    for (std::size_t i = 0; i < v.out_n; ++i) wrong += !same(v.out[i], input_value(false, v.peer, i), false);
    return wrong;
  }
  return count_wrong<T>(op, redop, std::span<const T>(v.out, v.out_n), l, rank, n, root);
}

/// One ping-pong: the lower rank of the pair sends then receives, the upper one the reverse.
template <class C, class T>
void ping_pong(C& c, const View<T>& v, bool async) {
  if (v.peer < 0) return;
  const std::span<const T> in(v.in, v.in_n);
  const std::span<T> out(v.out, v.out_n);
  auto send = [&] {
    if (async)
      c.send(in, v.peer, comm::async).wait();
    else
      c.send(in, v.peer);
  };
  auto recv = [&] {
    if (async)
      c.recv(out, v.peer, comm::async).wait();
    else
      c.recv(out, v.peer);
  };
  if (c.rank() < v.peer) {
    send();
    recv();
  } else {
    recv();
    send();
  }
}

/// The blocking comm call of `op` on view `v`, for any comm::Communicator `c` (comm-bench's host,
/// MPI and NCCL rows time the same calls).
template <class C, class T>
void blocking_call(C& c, Op op, const View<T>& v, comm::ReduceOp redop, int root) {
  const std::span<const T> in(v.in, v.in_n);
  const std::span<T> out(v.out, v.out_n);
  switch (op) {
    case Op::all_reduce:
      if (v.in == v.out)
        c.all_reduce(out, redop);
      else
        c.all_reduce(in, out, redop);
      break;
    case Op::reduce_scatter: c.reduce_scatter(in, out, redop); break;
    case Op::all_gather: c.all_gather(in, out); break;
    case Op::broadcast: c.broadcast(out, root); break;
    case Op::gather: c.gather(in, out, root); break;
    case Op::reduce:
      if (v.in == v.out)
        c.reduce(out, root, redop);
      else
        c.reduce(in, out, root, redop);
      break;
    case Op::scatter: c.scatter(in, out, root); break;
    case Op::all_to_all: c.all_to_all(in, out); break;
    case Op::all_to_all_v: c.all_to_all_v(in, v.in_counts, out, v.out_counts); break;
    case Op::send_recv: ping_pong(c, v, false); break;
    case Op::barrier: c.barrier(); break;
  }
}

/// The same call in comm's async form, waited for at once (comm-bench -z 0 / --async).
template <class C, class T>
void async_call(C& c, Op op, const View<T>& v, comm::ReduceOp redop, int root) {
  const std::span<const T> in(v.in, v.in_n);
  const std::span<T> out(v.out, v.out_n);
  switch (op) {
    case Op::all_reduce:
      (v.in == v.out ? c.all_reduce(out, redop, comm::async) : c.all_reduce(in, out, redop, comm::async)).wait();
      break;
    case Op::reduce_scatter: c.reduce_scatter(in, out, redop, comm::async).wait(); break;
    case Op::all_gather: c.all_gather(in, out, comm::async).wait(); break;
    case Op::broadcast: c.broadcast(out, root, comm::async).wait(); break;
    case Op::gather: c.gather(in, out, root, comm::async).wait(); break;
    case Op::reduce:
      (v.in == v.out ? c.reduce(out, root, redop, comm::async) : c.reduce(in, out, root, redop, comm::async)).wait();
      break;
    case Op::scatter: c.scatter(in, out, root, comm::async).wait(); break;
    case Op::all_to_all: c.all_to_all(in, out, comm::async).wait(); break;
    case Op::all_to_all_v: c.all_to_all_v(in, v.in_counts, out, v.out_counts, comm::async).wait(); break;
    case Op::send_recv: ping_pong(c, v, true); break;
    case Op::barrier: c.barrier(comm::async).wait(); break;
  }
}

}  // namespace comm::bench
