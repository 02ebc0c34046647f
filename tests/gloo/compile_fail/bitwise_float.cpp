// Must not compile: a bitwise reduction over a floating element type.
#include <comm/backends/gloo.hpp>
#include <comm/communicator.hpp>

#include <vector>

void f(comm::Communicator<comm::backends::Gloo>& c) {
  std::vector<float> v(4);
#if COMM_CF_CASE == 1
  c.all_reduce(v, comm::op::band);
#elif COMM_CF_CASE == 2
  std::vector<double> out(1);
  c.reduce_scatter(std::vector<double>(1), out, std::bit_xor<>{});
#elif COMM_CF_CASE == 3
  std::vector<comm::half> h(2);
  (void)c.all_reduce(h, comm::op::bor, comm::async);
#endif
}

int main() {}
