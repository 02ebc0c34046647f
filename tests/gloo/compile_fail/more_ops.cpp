// Must not compile (COMM_CF_CASE 1-3): the rest of the surface keeps the facade's compile-time
// checks. Case 0 is the control: the same calls, correct, compile.
#include <comm/backends/gloo.hpp>
#include <comm/communicator.hpp>

#include <span>
#include <vector>

void f(comm::Communicator<comm::backends::Gloo>& c) {
  std::vector<float> v(4), w(4);
  std::vector<int> i(4);
#if COMM_CF_CASE == 0
  c.reduce(v, w, 0, comm::op::premul_sum(0.5));
  c.recv(w, 1);
  c.all_to_all(v, w, comm::async).wait();
#elif COMM_CF_CASE == 1
  c.reduce(i, 0, comm::op::premul_sum(0.5));  // premul_sum on integers
#elif COMM_CF_CASE == 2
  const std::vector<float> cv(4);
  c.recv(std::span<const float>(cv), 1);  // receive into const elements
#elif COMM_CF_CASE == 3
  c.all_to_all(v, std::vector<float>(4), comm::async);  // async into a temporary
#endif
}

int main() {}
