// Must not compile (COMM_CF_CASE 1-7), and the FIRST error must be the element concept's one-line
// message (CMake stops the compiler at its first error), whatever the operation: no "no matching
// function" from the engines, no blame on the backend or the reduction first. Case 0 is the
// control: long long and unsigned long long, the 64-bit types as MPI and NCCL users write them,
// compile on every operation, through Communicator and AnyCommunicator.
#include <comm/backends/gloo.hpp>
#include <comm/cdb.hpp>
#include <comm/communicator.hpp>

#include <span>
#include <string>
#include <vector>

void f(comm::Communicator<comm::backends::Gloo>& c, comm::AnyCommunicator& a) {
#if COMM_CF_CASE == 0
  std::vector<long long> v(4), w(4);
  std::vector<unsigned long long> u(4);
  c.all_reduce(v);
  c.all_reduce(u, comm::op::bxor, comm::async).wait();
  c.all_to_all(std::span<const long long>(v), w);
  c.reduce(v, 0, [](long long x, long long y) { return x + y; });
  c.batch_isend_irecv({comm::isend(v, 1), comm::irecv(w, 1)});
  a.all_reduce(v, comm::ReduceOp::max);
  a.all_to_all(v, w);
  a.batch_isend_irecv({comm::isend(v, 1)});
#else
  std::vector<std::string> s(4), t(4);
  (void)a;
#if COMM_CF_CASE == 1
  c.all_reduce(s);
#elif COMM_CF_CASE == 2
  c.all_to_all(std::span<const std::string>(s), t);
#elif COMM_CF_CASE == 3
  c.reduce(s, t, 0, comm::op::sum, comm::async);
#elif COMM_CF_CASE == 4
  std::vector<char> x(4);
  c.broadcast(x, 0);
#elif COMM_CF_CASE == 5
  c.batch_isend_irecv({comm::isend(s, 1)});
#elif COMM_CF_CASE == 6
  a.all_reduce(s);
#elif COMM_CF_CASE == 7
  a.all_gather(std::span<const std::string>(s).first(1), t);
#endif
#endif
}

int main() {}
