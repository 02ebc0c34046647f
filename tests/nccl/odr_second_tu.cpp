// A second translation unit including the NCCL backend: with the first one in the same program,
// it shows the headers define nothing twice (everything inline or templated).
#include <comm/comm.hpp>
#include <comm/backends/nccl.hpp>

int nccl_odr_second_tu() {
  return comm::nccl::runtime_version() > 0 && comm::nccl::current_stream() == nullptr ? 1 : 0;
}
