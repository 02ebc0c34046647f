#pragma once
// The operations of a policy whose engine takes them as they are (concepts.hpp, requirement 7):
// each forwards to `engine_`, written once for every such backend. A policy that must adapt its
// buffers first (Gloo's device staging) defines its own.
//
// The policy derives from ForwardOps<Policy>, befriends it and has `engine_` (a pointer to an
// engine with the EngineCore entry points).

#include <span>
#include <utility>

#include <comm/types.hpp>

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

 private:
  [[nodiscard]] auto& engine() { return *static_cast<Policy&>(*this).engine_; }
};

}  // namespace comm::detail
