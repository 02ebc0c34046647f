#pragma once
// The operations of a policy whose engine takes them as they are (concepts.hpp, requirement 7):
// each forwards to `engine_`, written once for every such backend. A policy that must adapt its
// buffers first (Gloo's device staging) defines its own.
//
// The policy derives from ForwardOps<Policy>, befriends it and has `engine_` (a pointer to an
// engine with the EngineCore entry points).

#include <cstddef>
#include <span>
#include <utility>
#include <vector>

#include <comm/types.hpp>
#include <comm/work.hpp>

namespace comm::detail {

template <class Policy>
class ForwardOps {
 public:
  template <element T, class Red, class Launch>
  auto all_reduce(std::span<const T> in, std::span<T> out, Red red, Launch l) {
    return engine().template all_reduce<T>(in, out, std::move(red), l);
  }
  template <element T, class Red, class Launch>
  auto reduce_scatter(std::span<const T> in, std::span<T> out, Red red, Launch l) {
    return engine().template reduce_scatter<T>(in, out, std::move(red), l);
  }
  template <element T, class Launch>
  auto all_gather(std::span<const T> in, std::span<T> out, Launch l) {
    return engine().template all_gather<T>(in, out, l);
  }
  template <element T, class Launch>
  auto broadcast(std::span<T> data, int root, Launch l) {
    return engine().template broadcast<T>(data, root, l);
  }
  template <element T, class Launch>
  auto gather(std::span<const T> in, std::span<T> out, int root, Launch l) {
    return engine().template gather<T>(in, out, root, l);
  }
  template <class Launch>
  auto barrier(Launch l) {
    return engine().barrier(l);
  }
  template <element T, class Red, class Launch>
  auto reduce(std::span<const T> in, std::span<T> out, int root, Red red, Launch l) {
    return engine().template reduce<T>(in, out, root, std::move(red), l);
  }
  template <element T, class Launch>
  auto scatter(std::span<const T> in, std::span<T> out, int root, Launch l) {
    return engine().template scatter<T>(in, out, root, l);
  }
  template <element T, class Launch>
  auto all_to_all(std::span<const T> in, std::span<T> out, Launch l) {
    return engine().template all_to_all<T>(in, out, l);
  }
  template <element T, class Launch>
  auto all_to_all_v(std::span<const T> in, std::span<const std::size_t> in_counts, std::span<T> out,
                    std::span<const std::size_t> out_counts, Launch l) {
    return engine().template all_to_all_v<T>(in, in_counts, out, out_counts, l);
  }
  template <element T, class Launch>
  auto send(std::span<const T> data, int peer, int tag, Launch l) {
    return engine().template send<T>(data, peer, tag, l);
  }
  template <element T, class Launch>
  auto recv(std::span<T> data, int peer, int tag, Launch l) {
    return engine().template recv<T>(data, peer, tag, l);
  }
  template <element T>
  std::vector<Work> batch_isend_irecv(std::span<const P2POp<T>> ops) {
    return engine().template batch_isend_irecv<T>(ops);
  }

 private:
  [[nodiscard]] auto& engine() { return *static_cast<Policy&>(*this).engine_; }
};

}  // namespace comm::detail
