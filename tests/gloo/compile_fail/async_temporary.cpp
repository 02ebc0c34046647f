// Must not compile: an async collective on a temporary container (it would dangle).
#include <comm/backends/gloo.hpp>
#include <comm/communicator.hpp>

#include <vector>

void f(comm::Communicator<comm::backends::Gloo>& c) {
  auto w = c.all_reduce(std::vector<float>(4), comm::async);
  w.wait();
}

int main() {}
