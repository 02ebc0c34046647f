// Must not compile: a custom reduction that is not callable as T(T, T).
#include <comm/backends/gloo.hpp>
#include <comm/communicator.hpp>

#include <vector>

void f(comm::Communicator<comm::backends::Gloo>& c) {
  std::vector<float> v(4);
  c.all_reduce(v, [](float a) { return a; });
}

int main() {}
