// Must not compile (COMM_CF_CASE >= 1): reductions the NCCL backend cannot run are compile errors
// with comm's message. COMM_CF_CASE=0 is the control: the same file with supported ops compiles.
#include <comm/backends/nccl.hpp>
#include <comm/communicator.hpp>

#include <cstdint>
#include <functional>
#include <span>

using Comm = comm::Communicator<comm::backends::Nccl>;

void f(Comm& c, std::span<float> f32, std::span<std::int32_t> i32, std::span<std::uint8_t> u8) {
#if COMM_CF_CASE == 0
  c.all_reduce(f32, comm::op::avg);
  c.all_reduce(i32, comm::op::max);
  c.all_reduce(u8, comm::op::avg, comm::async).wait();
  c.reduce_scatter(i32, i32.subspan(0, 1), std::plus<>{});
  c.all_reduce(i32, comm::ReduceOp::band);  // a runtime value: checked when it runs
  c.all_reduce(f32, comm::op::premul_sum(0.5));
  c.reduce(f32, 0, comm::op::premul_sum(2.0), comm::async).wait();
  c.reduce_scatter(f32, f32.subspan(0, 1), comm::op::premul_sum(0.25));
  c.reduce(i32, 1, comm::op::min);
#elif COMM_CF_CASE == 1
  c.all_reduce(i32, comm::op::band);  // NCCL has no bitwise reductions
#elif COMM_CF_CASE == 2
  c.reduce_scatter(u8, u8.subspan(0, 1), std::bit_xor<>{}, comm::async).wait();
#elif COMM_CF_CASE == 3
  c.all_reduce(i32, comm::op::avg);  // NCCL's integer avg truncates; comm's floors
#elif COMM_CF_CASE == 4
  c.all_reduce(f32, [](float a, float b) { return a + b; });  // no custom callables on NCCL
#elif COMM_CF_CASE == 5
  c.all_reduce(f32, comm::op::bor);  // bitwise on a floating type
#elif COMM_CF_CASE == 6
  c.all_reduce(i32, comm::op::premul_sum(2.0));  // premul_sum scales: floating types only
#elif COMM_CF_CASE == 7
  c.reduce(u8, 0, comm::op::bor);  // reduce: the same reductions as all_reduce
#endif
  (void)f32;
  (void)i32;
  (void)u8;
}

int main() {}
