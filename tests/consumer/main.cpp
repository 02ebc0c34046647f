// Built by the consumer tests through find_package, add_subdirectory and FetchContent.
#include <comm/comm.hpp>

#include <cstdio>
#include <memory>
#include <vector>

int main() {
  auto store = std::make_shared<comm::HashStore>();
  store->set("k", std::string_view("v"));
  auto v = store->get("k");
  if (v.size() != 1 || v[0] != 'v') return 1;
#if defined(COMM_HAS_GLOO)
  auto c = comm::Communicator<comm::backends::Gloo>::create(store, 0, 1);
  std::vector<float> x{1.f, 2.f, 3.f};
  c.all_reduce(std::span<float>(x), comm::op::sum);
  if (x[2] != 3.f) return 2;
  std::puts("consumer: comm with gloo works");
#else
  std::puts("consumer: comm core works");
#endif
  return 0;
}
