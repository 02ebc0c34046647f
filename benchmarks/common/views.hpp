#pragma once
// Where one rank's input and output live for an op at one size, and how they are filled and
// checked. Shared by every C++ program so that all of them move the same bytes.

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

#include "bench.hpp"
#include "data.hpp"

namespace comm::bench {

template <class T>
struct Buffers {
  std::vector<T> in, out;

  /// Room for every size of `sizes` (allocated and touched once, like nccl-tests); only the
  /// buffers that `view` uses for this op and placement.
  void reserve(Op op, const std::vector<std::size_t>& sizes, int n, bool inplace) {
    std::size_t in_cap = 0, out_cap = 0;
    for (auto s : sizes) {
      const Layout l = layout(op, s, sizeof(T), n);
      in_cap = std::max(in_cap, l.in_count);
      out_cap = std::max(out_cap, std::max(l.out_count, l.count));
    }
    const bool in_unused = op == Op::broadcast || (inplace && (op == Op::all_reduce || op == Op::all_gather));
    const bool out_unused = inplace && op == Op::reduce_scatter;
    in.assign(in_unused ? 0 : in_cap, T{});
    out.assign(out_unused ? 0 : out_cap, T{});
  }
};

template <class T>
struct View {
  T* in = nullptr;
  T* out = nullptr;
  std::size_t in_n = 0;   ///< elements at `in`
  std::size_t out_n = 0;  ///< elements at `out` (gather: 0 off the root)
};

template <class T>
[[nodiscard]] View<T> view(Buffers<T>& b, Op op, const Layout& l, bool inplace, int rank, int root) {
  View<T> v;
  const std::size_t mine = static_cast<std::size_t>(rank) * l.block;
  switch (op) {
    case Op::all_reduce:
      v.out = b.out.data();
      v.in = inplace ? v.out : b.in.data();
      v.in_n = v.out_n = l.count;
      break;
    case Op::reduce_scatter:
      v.in = b.in.data();
      v.out = inplace ? v.in + mine : b.out.data();
      v.in_n = l.in_count;
      v.out_n = l.block;
      break;
    case Op::all_gather:
      v.out = b.out.data();
      v.in = inplace ? v.out + mine : b.in.data();
      v.in_n = l.block;
      v.out_n = l.out_count;
      break;
    case Op::broadcast:
      v.in = v.out = b.out.data();
      v.in_n = v.out_n = l.count;
      break;
    case Op::gather:
      v.in = b.in.data();
      v.out = b.out.data();
      v.in_n = l.block;
      v.out_n = rank == root ? l.out_count : 0;
      break;
  }
  return v;
}

/// Rank `rank`'s inputs; outputs that are not inputs are zeroed so stale results cannot pass.
template <class T>
void fill_view(const View<T>& v, Op op, int rank) {
  const bool red = is_reduction(op);
  const bool separate = v.in != v.out && !(op == Op::all_gather && v.in >= v.out && v.in < v.out + v.out_n) &&
                        !(op == Op::reduce_scatter && v.out >= v.in && v.out < v.in + v.in_n);
  if (separate || op == Op::all_gather) std::fill(v.out, v.out + v.out_n, T{});
  fill(std::span<T>(v.in, v.in_n), red, rank);
}

template <class T>
[[nodiscard]] long verify_view(const View<T>& v, Op op, comm::ReduceOp redop, const Layout& l, int rank, int n,
                               int root) {
  return count_wrong<T>(op, redop, std::span<const T>(v.out, v.out_n), l, rank, n, root);
}

/// The blocking comm call of `op` on view `v`, for any comm::Communicator `c` (comm-bench's Gloo
/// and NCCL rows time the same calls).
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
  }
}

}  // namespace comm::bench
