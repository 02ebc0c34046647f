// Must not compile: an output buffer of const elements.
#include <comm/backends/gloo.hpp>
#include <comm/communicator.hpp>

#include <span>
#include <vector>

void f(comm::Communicator<comm::backends::Gloo>& c) {
  const std::vector<float> v(4);
  c.all_reduce(std::span<const float>(v));
}

int main() {}
