// comm-bench-alloc: does comm allocate per operation, and does that grow with the message size?
//
//   comm-run -n 2 comm-bench-alloc [--json] [--iters N]
//
// Replaces the global operator new/delete with counting versions (every thread: the caller's and
// gloo's event loops; libgloo.so's allocations reach them through symbol interposition). For each
// op at 1 KiB and 16 MiB it counts the heap allocations and bytes of N comm calls and of N raw
// Gloo calls (the engine alone, its own context), after warm-up, and prints per-op figures.
// Exits 1 when comm's per-op bytes beyond the raw engine's grow from 1 KiB to 16 MiB by more than
// 16 KiB (0.1% of the size difference: per-message bookkeeping in gloo's transport is allowed,
// anything proportional to the payload is not), which is what "comm adds no per-op allocation that
// grows with message size" means. The first call at each size is counted apart ("first"): it is
// where comm's reusable scratch (reduce_scatter) grows, once.

#include <malloc.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <new>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <comm/comm.hpp>

#include "common/bench.hpp"
#include "common/data.hpp"
#include "common/raw_gloo.hpp"
#include "common/views.hpp"

namespace {

std::atomic<bool> g_counting{false};
std::atomic<long> g_allocs{0};
std::atomic<long> g_bytes{0};
std::atomic<long> g_live{0};
std::atomic<long> g_peak{0};

void note_alloc(void* p) noexcept {
  if (!g_counting.load(std::memory_order_relaxed)) return;
  const long n = static_cast<long>(::malloc_usable_size(p));
  g_allocs.fetch_add(1, std::memory_order_relaxed);
  g_bytes.fetch_add(n, std::memory_order_relaxed);
  const long live = g_live.fetch_add(n, std::memory_order_relaxed) + n;
  long peak = g_peak.load(std::memory_order_relaxed);
  while (live > peak && !g_peak.compare_exchange_weak(peak, live, std::memory_order_relaxed)) {
  }
}

void note_free(void* p) noexcept {
  if (p == nullptr || !g_counting.load(std::memory_order_relaxed)) return;
  g_live.fetch_sub(static_cast<long>(::malloc_usable_size(p)), std::memory_order_relaxed);
}

void* counted_alloc(std::size_t n, std::size_t align) {
  void* p = align <= alignof(std::max_align_t) ? std::malloc(n ? n : 1)
                                                : std::aligned_alloc(align, (n + align - 1) / align * align);
  if (p == nullptr) throw std::bad_alloc();
  note_alloc(p);
  return p;
}

void counted_free(void* p) noexcept {
  note_free(p);
  std::free(p);
}

}  // namespace

void* operator new(std::size_t n) { return counted_alloc(n, 0); }
void* operator new[](std::size_t n) { return counted_alloc(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) { return counted_alloc(n, static_cast<std::size_t>(a)); }
void* operator new[](std::size_t n, std::align_val_t a) { return counted_alloc(n, static_cast<std::size_t>(a)); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return counted_alloc(n, 0);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return counted_alloc(n, 0);
  } catch (...) {
    return nullptr;
  }
}
void operator delete(void* p) noexcept { counted_free(p); }
void operator delete[](void* p) noexcept { counted_free(p); }
void operator delete(void* p, std::size_t) noexcept { counted_free(p); }
void operator delete[](void* p, std::size_t) noexcept { counted_free(p); }
void operator delete(void* p, std::align_val_t) noexcept { counted_free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { counted_free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { counted_free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { counted_free(p); }

namespace {

using namespace comm::bench;
using GlooComm = comm::Communicator<comm::backends::Gloo>;

struct Count {
  double allocs = 0, bytes = 0;  ///< per op
  double peak = 0;               ///< highest live heap above the start of the window, bytes
  double retained = 0;           ///< live heap at the end of the window above its start, bytes
};

template <class F>
Count count(int iters, F&& f) {
  g_allocs = 0;
  g_bytes = 0;
  g_live = 0;
  g_peak = 0;
  g_counting = true;
  for (int i = 0; i < iters; ++i) f();
  g_counting = false;
  return {static_cast<double>(g_allocs.load()) / iters, static_cast<double>(g_bytes.load()) / iters,
          static_cast<double>(g_peak.load()), static_cast<double>(g_live.load())};
}

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  int iters = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--json") {
      json = true;
    } else if (a == "--iters" && i + 1 < argc) {
      iters = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: comm-run -n N comm-bench-alloc [--json] [--iters N]\n");
      return 2;
    }
  }
  try {
    comm::InitResult init = comm::init_env();
    auto c = GlooComm::create(init.store, init.rank, init.size);
    const int rank = init.rank, n = init.size;
    auto raw_ctx = make_raw_context(init.store, rank, n, "comm-bench-alloc/raw/", c.backend().timeout());
    RawGloo<float> raw(raw_ctx, c.backend().timeout());
    const std::vector<std::size_t> sizes{std::size_t{1} << 10, std::size_t{16} << 20};
    bool ok = true;
    if (rank == 0 && !json)
      std::printf("# heap allocations per operation (operator new, all threads), world %d, float, %d ops each\n"
                  "# %-18s %7s %11s %11s %11s %11s %11s %13s %13s\n",
                  n, iters, "op", "size", "comm allocs", "comm bytes", "raw allocs", "raw bytes", "comm-raw",
                  "comm 1st kept", "raw 1st kept");

    struct Case {
      Op op;
      bool async;
    };
    const Case cases[] = {{Op::all_reduce, false}, {Op::all_reduce, true}, {Op::reduce_scatter, false},
                          {Op::all_gather, false}, {Op::broadcast, false}, {Op::gather, false}};
    for (const Case& k : cases) {
      Buffers<float> bufs;
      bufs.reserve(k.op, sizes, n, k.op == Op::all_reduce);
      std::vector<double> extra;  // comm - raw bytes per op, per size
      for (std::size_t bytes : sizes) {
        const Layout l = layout(k.op, bytes, sizeof(float), n);
        const View<float> v = view(bufs, k.op, l, k.op == Op::all_reduce, rank, 0);
        fill_view(v, k.op, rank);
        const std::span<const float> in(v.in, v.in_n);
        const std::span<float> out(v.out, v.out_n);
        auto comm_op = [&] {
          switch (k.op) {
            case Op::all_reduce:
              if (k.async)
                c.all_reduce(out, comm::ReduceOp::sum, comm::async).wait();
              else
                c.all_reduce(out, comm::ReduceOp::sum);
              break;
            case Op::reduce_scatter: c.reduce_scatter(in, out, comm::ReduceOp::sum); break;
            case Op::all_gather: c.all_gather(in, out); break;
            case Op::broadcast: c.broadcast(out, 0); break;
            case Op::gather: c.gather(in, out, 0); break;
            default: break;  // the cases above: the five ops raw Gloo has
          }
        };
        auto raw_op = [&] {
          switch (k.op) {
            case Op::all_reduce: raw.all_reduce(v.in, v.out, l.count, comm::ReduceOp::sum, "ring"); break;
            case Op::reduce_scatter: raw.reduce_scatter(v.in, v.out, l.block, comm::ReduceOp::sum, "hd"); break;
            case Op::all_gather: raw.all_gather(v.in, v.out, l.block); break;
            case Op::broadcast: raw.broadcast(v.out, l.count, 0); break;
            case Op::gather: raw.gather(v.in, v.out, l.block, 0); break;
            default: break;
          }
        };
        // First calls at this size: what each keeps (comm: its reusable scratch; raw hd: its object).
        c.barrier();
        const Count cf = count(1, comm_op);
        c.barrier();
        const Count rf = count(1, raw_op);
        for (int i = 0; i < 3; ++i) {
          comm_op();
          raw_op();
        }
        c.barrier();
        const Count cc = count(iters, comm_op);
        c.barrier();
        const Count rc = count(iters, raw_op);
        c.barrier();
        raw.clear_persistent();
        // Max over ranks (the root of gather/broadcast differs from the others).
        std::vector<double> v6{cc.allocs, cc.bytes, rc.allocs, rc.bytes, cc.peak, rc.peak, cf.retained, rf.retained};
        c.all_reduce(std::span<double>(v6), comm::ReduceOp::max);
        extra.push_back(v6[1] - v6[3]);
        const std::string name = std::string(to_string(k.op)) + (k.async ? "(async)" : "");
        if (rank == 0) {
          if (json)
            std::printf("{\"schema\":\"%s\",\"kind\":\"alloc\",\"op\":\"%s\",\"async\":%s,\"world\":%d,\"bytes\":%zu,"
                        "\"comm_allocs_per_op\":%.2f,\"comm_bytes_per_op\":%.1f,\"raw_allocs_per_op\":%.2f,"
                        "\"raw_bytes_per_op\":%.1f,\"comm_peak_transient_bytes\":%.0f,\"raw_peak_transient_bytes\":%.0f,"
                        "\"comm_first_call_kept_bytes\":%.0f,\"raw_first_call_kept_bytes\":%.0f}\n",
                        std::string(kSchema).c_str(), std::string(to_string(k.op)).c_str(), k.async ? "true" : "false",
                        n, l.bytes, v6[0], v6[1], v6[2], v6[3], v6[4], v6[5], v6[6], v6[7]);
          else
            std::printf("  %-18s %7s %11.1f %11.0f %11.1f %11.0f %11.0f %13.0f %13.0f\n", name.c_str(),
                        format_bytes(l.bytes).c_str(), v6[0], v6[1], v6[2], v6[3], v6[1] - v6[3], v6[6], v6[7]);
        }
      }
      // comm's extra bytes per op must not grow from 1 KiB to 16 MiB.
      const double growth = extra.back() - extra.front();
      if (growth > 16384) {
        ok = false;
        if (rank == 0)
          std::fprintf(stderr, "comm-bench-alloc: %s: comm allocates %.0f more bytes per op beyond the engine at 16 MiB "
                               "than at 1 KiB\n",
                       std::string(to_string(k.op)).c_str(), growth);
      }
    }
    std::fflush(stdout);
    c.barrier();
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "comm-bench-alloc: %s\n", e.what());
    return 1;
  }
}
