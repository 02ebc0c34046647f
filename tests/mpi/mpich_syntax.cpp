// Compiled with -fsyntax-only against MPICH's mpi.h (mpi_mpich_syntax): MPICH's handles are ints
// where OpenMPI's are pointers, so anything that leans on OpenMPI's representation fails here.
#include <comm/comm.hpp>

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

static_assert(comm::backend<comm::backends::Mpi>);
static_assert(comm::supports_split<comm::backends::Mpi> && comm::supports_new_group<comm::backends::Mpi>);
static_assert(comm::supports_monitored_barrier<comm::backends::Mpi> && comm::supports_flight_recorder<comm::backends::Mpi>);

namespace {

using Comm = comm::Communicator<comm::backends::Mpi>;

template <class T>
void every_op(Comm& c) {
  std::vector<T> a(4), b(4 * static_cast<std::size_t>(c.size()));
  c.all_reduce(a);
  c.all_reduce(std::span<const T>(a), std::span<T>(a), comm::ReduceOp::max);
  c.all_reduce(a, comm::op::sum, comm::async).wait();
  c.all_reduce(a, [](T x, T) { return x; }, comm::async).wait();
  c.reduce_scatter(b, a, comm::ReduceOp::avg);
  c.all_gather(a, b);
  c.all_gather(a, b, comm::async).wait();
  c.broadcast(a, 0);
  c.gather(a, b, 0, comm::async).wait();
}

[[maybe_unused]] void everything() {
  auto c = Comm::adopt(MPI_COMM_WORLD);
  // The engine is compiled once whatever the types; the typed parts are the datatype map and the
  // facade, so every operation on one MPI-native and one comm-kernel type, and the map for all.
  every_op<float>(c);
  every_op<comm::half>(c);
  [[maybe_unused]] const MPI_Datatype types[] = {
      comm::detail::mpi::datatype<std::int8_t>(),        comm::detail::mpi::datatype<std::uint8_t>(),
      comm::detail::mpi::datatype<std::int32_t>(),       comm::detail::mpi::datatype<std::uint32_t>(),
      comm::detail::mpi::datatype<std::int64_t>(),       comm::detail::mpi::datatype<std::uint64_t>(),
      comm::detail::mpi::datatype<double>(),             comm::detail::mpi::datatype<comm::bfloat16>(),
      comm::detail::mpi::datatype<comm::float8_e4m3>(), comm::detail::mpi::datatype<comm::float8_e5m2>()};
  c.barrier();
  auto g = c.split(0, 0);
  auto h = c.new_group({0});
  c.monitored_barrier();
  (void)c.flight_record();
  comm::InitOptions o;
  o.backend = "mpi";
  comm::AnyCommunicator& w = comm::init_distributed(o);
  std::vector<float> v(3);
  w.all_reduce(v);
  auto d = Comm::create(nullptr, 0, 1);
}

}  // namespace

int main() {}
