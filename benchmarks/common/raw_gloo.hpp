#pragma once
// Raw Gloo, called the way a program that uses libgloo directly would: the baseline of
// `comm-bench --baseline raw` and the engine of the raw Gloo peer (peers/gloo_peer.cpp).
//
// It owns its own gloo context (own TCP device, own connections), rendezvoused through a
// comm::Store via a small adapter, so the comm communicator and the raw context in one process
// share nothing but the store. It also carries algorithm prototypes (--algo) that measure what a
// backend could gain by choosing the algorithm by size:
//   all_reduce      ring (default: gloo::allreduce, which always runs its ring)
//                   bcube (gloo::allreduce with Algorithm::BCUBE: halving/doubling for 2^k ranks)
//                   hd, oldring (the older gloo::AllreduceHalvingDoubling / AllreduceRing classes;
//                                built once per buffer and size outside the timed loop)
//                   direct (prototype: every rank sends its whole buffer to every other rank and
//                           reduces locally in rank order; one round of messages)
//                   rd (prototype: recursive doubling, log2(n) exchanges of the whole buffer; 2^k ranks)
//   reduce_scatter  hd (default: gloo::ReduceScatterHalvingDoubling, built once per buffer and size)
//                   allreduce (gloo::allreduce on the whole buffer, then copy this rank's block:
//                              the usual workaround where no reduce-scatter exists, as in torch 1.13)
//   all_gather, broadcast, gather: gloo::allgather, gloo::broadcast, gloo::gather.

#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <exception>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <gloo/algorithm.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/alltoallv.h>
#include <gloo/allreduce_halving_doubling.h>
#include <gloo/allreduce_ring.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/gather.h>
#include <gloo/math.h>
#include <gloo/reduce.h>
#include <gloo/reduce_scatter.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/scatter.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/types.h>

#include <comm/store.hpp>
#include <comm/types.hpp>

namespace comm::bench {

/// gloo::rendezvous::Store over a comm::Store, every key under `prefix`.
class GlooStoreAdapter final : public ::gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(std::shared_ptr<comm::Store> s, std::string prefix, std::chrono::milliseconds timeout)
      : s_(std::move(s)), prefix_(std::move(prefix)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    s_->set(prefix_ + key, std::span(reinterpret_cast<const std::uint8_t*>(data.data()), data.size()));
  }
  std::vector<char> get(const std::string& key) override {
    s_->wait({prefix_ + key}, timeout_);
    auto b = s_->get(prefix_ + key);
    return {b.begin(), b.end()};
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& t) override {
    std::vector<std::string> full;
    for (const auto& k : keys) full.push_back(prefix_ + k);
    s_->wait(full, t.count() > 0 ? t : timeout_);
  }

 private:
  std::shared_ptr<comm::Store> s_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
};

/// A TCP device whose event-loop thread runs at nice value `nice` (0: unchanged). The loop thread
/// inherits the nice value of the thread that creates the device, so a short-lived helper thread
/// lowers its own priority and creates it. Prototype of a mitigation (see RESULTS.md): gloo's loop
/// thread busy-polls epoll while a caller holds a pair's mutex, and at equal priority it takes the
/// CPU from the very thread it waits for.
[[nodiscard]] inline std::shared_ptr<::gloo::transport::Device> make_device(const std::string& host, int nice) {
  ::gloo::transport::tcp::attr attr;
  attr.hostname = host;
  if (nice == 0) return ::gloo::transport::tcp::CreateDevice(attr);
  std::shared_ptr<::gloo::transport::Device> dev;
  std::exception_ptr err;
  std::thread t([&] {
    ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), nice);
    try {
      dev = ::gloo::transport::tcp::CreateDevice(attr);
    } catch (...) {
      err = std::current_exception();
    }
  });
  t.join();
  if (err) std::rethrow_exception(err);
  return dev;
}

/// COMM_BENCH_LOOP_NICE: nice value of the raw gloo event-loop thread (default 0).
[[nodiscard]] inline int loop_nice_from_env() {
  const char* v = std::getenv("COMM_BENCH_LOOP_NICE");
  return v ? std::atoi(v) : 0;
}

/// A connected gloo context of its own (own TCP device bound to `host`).
[[nodiscard]] inline std::shared_ptr<::gloo::Context> make_raw_context(const std::shared_ptr<comm::Store>& store,
                                                                       int rank, int size, const std::string& prefix,
                                                                       std::chrono::milliseconds timeout,
                                                                       const std::string& host = "127.0.0.1") {
  const char* h = std::getenv("COMM_BENCH_GLOO_HOST");  // e.g. a non-loopback local address
  auto dev = make_device(h && *h ? std::string(h) : host, loop_nice_from_env());
  auto ctx = std::make_shared<::gloo::rendezvous::Context>(rank, size);
  ctx->setTimeout(timeout);
  GlooStoreAdapter adapter(store, prefix, timeout);
  ctx->connectFullMesh(adapter, dev);
  return ctx;
}

/// The element type gloo computes on for `T` (comm::half is bit-compatible with gloo::float16).
template <class T>
struct gloo_elem {
  using type = T;
};
template <>
struct gloo_elem<comm::half> {
  using type = ::gloo::float16;
};
template <class T>
using gloo_elem_t = typename gloo_elem<T>::type;

/// The algorithm RawGloo runs for `op` when none is named (see RawGloo's member functions).
[[nodiscard]] inline std::string raw_default_algo(Op op) {
  if (op == Op::all_reduce) return "ring";
  if (op == Op::reduce_scatter) return "hd";
  return "";
}

template <class T>
inline constexpr bool raw_supported_v = !std::is_same_v<T, comm::bfloat16> && !std::is_same_v<T, comm::float8_e4m3> &&
                                        !std::is_same_v<T, comm::float8_e5m2>;  // gloo has no bfloat16 or fp8

/// Tags of the raw calls: one sequence per process, shared by every RawGloo<T> (all of them use
/// the same context in practice), so that no two calls ever use the same slot.
struct RawTags {
  static inline std::uint32_t next = 0;
};

template <class T>
class RawGloo {
  using G = gloo_elem_t<T>;

 public:
  using Fn = void (*)(void*, const void*, const void*, std::size_t);

  RawGloo(std::shared_ptr<::gloo::Context> ctx, std::chrono::milliseconds timeout)
      : ctx_(std::move(ctx)), timeout_(timeout) {}

  [[nodiscard]] int rank() const { return ctx_->rank; }
  [[nodiscard]] int size() const { return ctx_->size; }

  static Fn fn(comm::ReduceOp op) {
    switch (op) {
      case comm::ReduceOp::sum: return &::gloo::sum<G>;
      case comm::ReduceOp::prod: return &::gloo::product<G>;
      case comm::ReduceOp::min: return &::gloo::min<G>;
      case comm::ReduceOp::max: return &::gloo::max<G>;
      default: throw std::invalid_argument("raw gloo has no built-in " + std::string(comm::to_string(op)));
    }
  }
  static const ::gloo::ReductionFunction<G>* old_fn(comm::ReduceOp op) {
    switch (op) {
      case comm::ReduceOp::sum: return ::gloo::ReductionFunction<G>::sum;
      case comm::ReduceOp::prod: return ::gloo::ReductionFunction<G>::product;
      case comm::ReduceOp::min: return ::gloo::ReductionFunction<G>::min;
      case comm::ReduceOp::max: return ::gloo::ReductionFunction<G>::max;
      default: throw std::invalid_argument("raw gloo has no built-in " + std::string(comm::to_string(op)));
    }
  }

  /// `in == out` is in place.
  void all_reduce(const T* in, T* out, std::size_t n, comm::ReduceOp op, const std::string& algo) {
    if (algo.empty() || algo == "ring" || algo == "bcube") {
      ::gloo::AllreduceOptions o(ctx_);
      if (in != out) o.setInput(g(const_cast<T*>(in)), n);
      o.setOutput(g(out), n);
      o.setReduceFunction(fn(op));
      o.setTag(RawTags::next++);
      o.setTimeout(timeout_);
      if (algo == "bcube") o.setAlgorithm(::gloo::AllreduceOptions::Algorithm::BCUBE);
      ::gloo::allreduce(o);
    } else if (algo == "hd" || algo == "oldring") {
      if (in != out) std::memcpy(out, in, n * sizeof(T));
      auto& a = persistent_[{algo, static_cast<void*>(out), n, static_cast<int>(op)}];
      if (!a) {
        std::vector<G*> ptrs{g(out)};
        const int cnt = static_cast<int>(n);
        if (algo == "hd")
          a = std::make_unique<::gloo::AllreduceHalvingDoubling<G>>(ctx_, ptrs, cnt, old_fn(op));
        else
          a = std::make_unique<::gloo::AllreduceRing<G>>(ctx_, ptrs, cnt, old_fn(op));
      }
      a->run();
    } else if (algo == "direct") {
      direct_all_reduce(in, out, n, fn(op));
    } else if (algo == "rd") {
      rd_all_reduce(in, out, n, fn(op));
    } else {
      throw std::invalid_argument("unknown all_reduce --algo '" + algo + "' (ring|bcube|hd|oldring|direct|rd)");
    }
  }

  /// `in` holds size()*block elements; `out` (block elements) may be in + rank*block.
  void reduce_scatter(T* in, T* out, std::size_t block, comm::ReduceOp op, const std::string& algo) {
    const std::size_t total = block * static_cast<std::size_t>(size());
    T* mine = in + static_cast<std::size_t>(rank()) * block;
    if (algo.empty() || algo == "hd") {
      auto& a = persistent_[{"rs-hd", static_cast<void*>(in), total, static_cast<int>(op)}];
      if (!a) {
        std::vector<G*> ptrs{g(in)};
        std::vector<int> recv(static_cast<std::size_t>(size()), static_cast<int>(block));
        a = std::make_unique<::gloo::ReduceScatterHalvingDoubling<G>>(ctx_, ptrs, static_cast<int>(total), recv,
                                                                       old_fn(op));
      }
      a->run();  // this rank's block lands at the start of `in`
      if (out != in) std::memmove(out, in, block * sizeof(T));
    } else if (algo == "allreduce") {
      all_reduce(in, in, total, op, "ring");
      if (out != mine) std::memcpy(out, mine, block * sizeof(T));
    } else {
      throw std::invalid_argument("unknown reduce_scatter --algo '" + algo + "' (hd|allreduce)");
    }
  }

  /// `in` may be out + rank*block (in place).
  void all_gather(const T* in, T* out, std::size_t block) {
    ::gloo::AllgatherOptions o(ctx_);
    if (in != out + static_cast<std::size_t>(rank()) * block) o.setInput(g(const_cast<T*>(in)), block);
    o.setOutput(g(out), block * static_cast<std::size_t>(size()));
    o.setTag(RawTags::next++);
    o.setTimeout(timeout_);
    ::gloo::allgather(o);
  }

  void broadcast(T* data, std::size_t n, int root) {
    ::gloo::BroadcastOptions o(ctx_);
    o.setOutput(g(data), n);
    o.setRoot(root);
    o.setTag(RawTags::next++);
    o.setTimeout(timeout_);
    ::gloo::broadcast(o);
  }

  void gather(const T* in, T* out, std::size_t block, int root) {
    ::gloo::GatherOptions o(ctx_);
    o.setInput(g(const_cast<T*>(in)), block);
    if (rank() == root) o.setOutput(g(out), block * static_cast<std::size_t>(size()));
    o.setRoot(root);
    o.setTag(RawTags::next++);
    o.setTimeout(timeout_);
    ::gloo::gather(o);
  }

  /// `in == out` is in place (gloo reduces into the output on every rank).
  void reduce(const T* in, T* out, std::size_t n, comm::ReduceOp op, int root) {
    ::gloo::ReduceOptions o(ctx_);
    if (in != out) o.setInput(g(const_cast<T*>(in)), n);
    if (rank() == root || in == out) {
      o.setOutput(g(out), n);
    } else {
      // Off the root comm's output may be empty, but gloo accumulates in every rank's output.
      scratch_.resize(n * sizeof(T));
      o.setOutput(reinterpret_cast<G*>(scratch_.data()), n);
    }
    o.setRoot(root);
    o.setReduceFunction(fn(op));
    o.setTag(RawTags::next++);
    o.setTimeout(timeout_);
    ::gloo::reduce(o);
  }

  /// `in` (root only) holds size()*block elements.
  void scatter(const T* in, T* out, std::size_t block, int root) {
    ::gloo::ScatterOptions o(ctx_);
    if (rank() == root) {
      std::vector<G*> ptrs;
      for (int q = 0; q < size(); ++q) ptrs.push_back(g(const_cast<T*>(in)) + static_cast<std::size_t>(q) * block);
      o.setInputs(ptrs, block);
    }
    o.setOutput(g(out), block);
    o.setRoot(root);
    o.setTag(RawTags::next++);
    o.setTimeout(timeout_);
    ::gloo::scatter(o);
  }

  void all_to_all(const T* in, T* out, std::size_t block) {
    ::gloo::AlltoallOptions o(ctx_);
    const std::size_t total = block * static_cast<std::size_t>(size());
    o.setInput(g(const_cast<T*>(in)), total);
    o.setOutput(g(out), total);
    o.setTag(RawTags::next++);
    o.setTimeout(timeout_);
    ::gloo::alltoall(o);
  }

  void all_to_all_v(const T* in, const std::vector<std::size_t>& in_counts, T* out,
                    const std::vector<std::size_t>& out_counts) {
    ::gloo::AlltoallvOptions o(ctx_);
    o.setInput(g(const_cast<T*>(in)), std::vector<std::int64_t>(in_counts.begin(), in_counts.end()));
    o.setOutput(g(out), std::vector<std::int64_t>(out_counts.begin(), out_counts.end()));
    o.setTag(RawTags::next++);
    o.setTimeout(timeout_);
    ::gloo::alltoallv(o);
  }

  /// One ping-pong with `peer` (comm-bench's send_recv): the lower rank sends first.
  void ping_pong(const T* in, T* out, std::size_t n, int peer) {
    // The idle rank of an odd world takes its tag too: every rank's RawTags must stay in step.
    const auto slot = static_cast<std::uint64_t>(::gloo::Slot::build(0x32, RawTags::next++));
    if (peer < 0) return;
    auto src = ctx_->createUnboundBuffer(const_cast<T*>(in), n * sizeof(T));
    auto dst = ctx_->createUnboundBuffer(out, n * sizeof(T));
    auto send = [&] {
      src->send(peer, slot);
      if (!src->waitSend(timeout_)) throw std::runtime_error("raw gloo ping-pong: send timed out");
    };
    auto recv = [&] {
      dst->recv(peer, slot);
      if (!dst->waitRecv(timeout_)) throw std::runtime_error("raw gloo ping-pong: recv timed out");
    };
    if (rank() < peer) {
      send();
      recv();
    } else {
      recv();
      send();
    }
  }

  void barrier() {
    ::gloo::BarrierOptions o(ctx_);
    o.setTag(RawTags::next++);
    o.setTimeout(timeout_);
    ::gloo::barrier(o);
  }

  /// Drops the persistent algorithm objects (their buffers are about to go away).
  void clear_persistent() { persistent_.clear(); }

 private:
  static G* g(T* p) { return reinterpret_cast<G*>(p); }

  // Prototype: one round; every rank sends its buffer to every other rank.
  void direct_all_reduce(const T* in, T* out, std::size_t n, Fn f) {
    const int p = size(), r = rank();
    const std::size_t bytes = n * sizeof(T);
    const auto slot = static_cast<std::uint64_t>(::gloo::Slot::build(0x31, RawTags::next++));
    scratch_.resize(bytes * static_cast<std::size_t>(p));
    auto src = ctx_->createUnboundBuffer(const_cast<T*>(in), bytes);
    auto dst = ctx_->createUnboundBuffer(scratch_.data(), scratch_.size());
    for (int q = 0; q < p; ++q)
      if (q != r) dst->recv(q, slot, static_cast<std::size_t>(q) * bytes, bytes);
    for (int q = 0; q < p; ++q)
      if (q != r) src->send(q, slot);
    for (int q = 1; q < p; ++q) dst->waitRecv(timeout_);
    for (int q = 1; q < p; ++q) src->waitSend(timeout_);
    std::memcpy(scratch_.data() + static_cast<std::size_t>(r) * bytes, in, bytes);
    // Same order on every rank, so every rank gets identical bits.
    std::memcpy(out, scratch_.data(), bytes);
    for (int q = 1; q < p; ++q) f(out, out, scratch_.data() + static_cast<std::size_t>(q) * bytes, n);
  }

  // Prototype: recursive doubling for 2^k ranks.
  void rd_all_reduce(const T* in, T* out, std::size_t n, Fn f) {
    const int p = size(), r = rank();
    if (p & (p - 1)) throw std::invalid_argument("--algo rd needs a power-of-two world size");
    const std::size_t bytes = n * sizeof(T);
    if (in != out) std::memcpy(out, in, bytes);
    const auto slot = static_cast<std::uint64_t>(::gloo::Slot::build(0x32, RawTags::next++));
    scratch_.resize(bytes);
    auto acc = ctx_->createUnboundBuffer(out, bytes);
    auto tmp = ctx_->createUnboundBuffer(scratch_.data(), bytes);
    for (int k = 1, step = 0; k < p; k <<= 1, ++step) {
      const int partner = r ^ k;
      tmp->recv(partner, slot + static_cast<std::uint8_t>(step));
      acc->send(partner, slot + static_cast<std::uint8_t>(step));
      tmp->waitRecv(timeout_);
      acc->waitSend(timeout_);
      f(out, out, scratch_.data(), n);  // commutative: both partners get the same bits
    }
  }

  std::shared_ptr<::gloo::Context> ctx_;
  std::chrono::milliseconds timeout_;
  std::vector<std::byte> scratch_;
  std::map<std::tuple<std::string, void*, std::size_t, int>, std::unique_ptr<::gloo::Algorithm>> persistent_;
};

}  // namespace comm::bench
