#pragma once
/// \file
/// cdb's selection and discovery (see cdb.hpp's file comment): `InitOptions`, where the rank,
/// sizes and master come from (`describe_environment()`), the rendezvous of init_distributed's
/// steps 2-4, and which backend "auto" or a name picks. The backends and their names come from
/// the one list, backends/list.hpp.

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <comm/any_communicator.hpp>
#include <comm/backends/registry.hpp>
#include <comm/communicator.hpp>
#include <comm/detail/init/discovery.hpp>
#include <comm/detail/init/host.hpp>
#include <comm/detail/base/logging.hpp>
#include <comm/init.hpp>
#include <comm/store.hpp>
#include <comm/types.hpp>

#if defined(COMM_HAS_NCCL)
#include <cuda_runtime_api.h>
#endif

namespace comm {

/// Options of init_distributed. -1 and empty values mean "from the environment".
struct InitOptions {
  std::string backend = "auto";          ///< "auto", or a name of the backend list: "shm" | "gloo" |
                                         ///< "hierarchical" | "nccl" | "mpi" (backends/list.hpp)
  std::string init_method = "env://";    ///< "env://" | "tcp://host:port" | "file:///path"
  /// This process's rank; -1: from the environment (RANK, or the discovered launcher's variable).
  int rank = -1;
  /// The number of ranks; -1: from the environment.
  int world_size = -1;
  std::chrono::milliseconds timeout{0};  ///< 0: COMM_TIMEOUT, else 30 minutes
  /// When RANK is not set, read the rank from OpenMPI, MPICH, PMIx or SLURM variables (no MPI library
  /// is used); false: RANK is required.
  bool auto_mpi_discovery = true;
};

namespace detail {

/// Whether a CUDA device is usable here; `why` says why not.
[[nodiscard]] inline bool cuda_usable([[maybe_unused]] std::string& why) {
#if defined(COMM_HAS_NCCL)
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    why = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(e);
    return false;
  }
  if (n == 0) {
    why = "no CUDA device";
    return false;
  }
  return true;
#elif defined(COMM_NCCL_BUILT)
  why = "this program does not link comm::nccl (comm was built with NCCL: target_link_libraries(<program> comm::nccl))";
  return false;
#else
  why = "comm was built without NCCL (CMake found no CUDA toolkit and NCCL)";
  return false;
#endif
}

/// Rendezvous for init_distributed: steps 2-4 of the file comment.
[[nodiscard]] inline InitResult rendezvous_for(const InitOptions& o, std::chrono::milliseconds timeout) {
  if (!o.init_method.empty() && o.init_method != "env://") return init_method(o.init_method, o.rank, o.world_size, timeout);
  if (!getenv_str("RANK") && !o.auto_mpi_discovery)
    throw InvalidArgument("init_distributed", o.rank,
                          "RANK is not set and auto_mpi_discovery is off: launch with comm-run or set RANK, "
                          "WORLD_SIZE, MASTER_ADDR and MASTER_PORT");
  const Discovery d = discover_environment();
  log(LogLevel::info, describe(d));
  if (o.rank >= 0 && o.rank != d.rank.value)
    throw InvalidArgument("init_distributed", d.rank.value,
                          "rank " + std::to_string(o.rank) + " conflicts with " + d.rank.from + "=" +
                              std::to_string(d.rank.value));
  if (o.world_size >= 0 && o.world_size != d.size.value)
    throw InvalidArgument("init_distributed", d.rank.value,
                          "world_size " + std::to_string(o.world_size) + " conflicts with " + d.size.from + "=" +
                              std::to_string(d.size.value));
  export_discovered(d);
  InitResult r;
  r.rank = d.rank.value;
  r.size = d.size.value;
  r.local_rank = d.local_rank.value;
  r.local_size = d.local_size.value;
  r.master_addr = d.master_addr;
  r.master_port = d.master_port;
  r.store = connect_tcp_store(d.master_addr, d.master_port, r.rank, timeout);
  return r;
}

/// Whether every rank of the store's world runs on this host (Shm's identity: boot id and
/// namespaces). Collective over the store: every rank publishes its identity and reads the others'.
[[nodiscard]] inline bool all_on_one_host(Store& store, int rank, int size, std::chrono::milliseconds timeout) {
  const std::string me = host_identity();
  store.set("comm/cdb/host/" + std::to_string(rank), me);
  bool same = true;
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    const std::string key = "comm/cdb/host/" + std::to_string(p);
    store.wait({key}, timeout);
    const auto v = store.get(key);
    same = same && std::string(reinterpret_cast<const char*>(v.data()), v.size()) == me;
  }
  return same;
}

/// comm::InvalidArgument unless the rank and world size that `o` asks for (if any) are those of
/// the communicator init_distributed would use (`whose`: "MPI_COMM_WORLD's", "the initialized
/// world's").
inline void check_init_matches(const InitOptions& o, int rank, int size, const std::string& whose) {
  if (o.rank >= 0 && o.rank != rank)
    throw InvalidArgument("init_distributed", rank,
                          "rank " + std::to_string(o.rank) + " conflicts with " + whose + " rank " + std::to_string(rank));
  if (o.world_size >= 0 && o.world_size != size)
    throw InvalidArgument("init_distributed", rank,
                          "world_size " + std::to_string(o.world_size) + " conflicts with " + whose + " size " +
                              std::to_string(size));
}

#if defined(COMM_HAS_MPI)
/// Whether "auto" may pick MPI: the application initialized MPI and an MPI launcher started the job.
[[nodiscard]] inline bool mpi_world_ready() {
  return mpi::initialized() && !mpi::finalized() && mpi::launched_by_mpi();
}

/// The world over MPI: MPI_COMM_WORLD adopted when MPI is initialized (the rendezvous is not used:
/// MPI already knows the ranks; no store, so no monitored_barrier), else the rendezvous of steps
/// 2-4 and Mpi::create, which initializes MPI and checks the ranks against MPI_COMM_WORLD.
[[nodiscard]] inline std::unique_ptr<AnyCommunicator> init_mpi_world(const InitOptions& o,
                                                                     std::chrono::milliseconds timeout) {
  backends::Mpi::Options mo;
  mo.timeout = timeout;
  if (mpi::initialized() && !mpi::finalized()) {
    auto c = Communicator<backends::Mpi>::adopt(MPI_COMM_WORLD, mo);
    check_init_matches(o, c.rank(), c.size(), "MPI_COMM_WORLD's");
    log(LogLevel::info, "init_distributed: backend mpi, MPI_COMM_WORLD adopted (MPI was initialized)");
    return std::make_unique<AnyCommunicator>(std::move(c));
  }
  InitResult r = rendezvous_for(o, timeout);
  auto c = Communicator<backends::Mpi>::create(r.store, r.rank, r.size, mo);
  log(LogLevel::info, "init_distributed: backend mpi, MPI initialized by comm");
  return std::make_unique<AnyCommunicator>(std::move(c));
}
#endif

/// The backend to use: the requested one, or for "auto" (and a CPU job) "cpu", which
/// init_distributed resolves to Shm or Hierarchical once the ranks can compare hosts. Names and
/// "not compiled in" come from the backend list (backends/list.hpp).
[[nodiscard]] inline std::string resolve_backend(const std::string& requested, int rank) {
  if (!requested.empty() && requested != "auto") {
    const backends::KnownBackend* b = backends::find_backend(requested);
    if (b == nullptr)
      throw InvalidArgument("init_distributed", rank,
                            "backend '" + requested + "' is not " + backends::backend_names("auto"));
    if (!b->compiled_in)
      throw InvalidArgument("init_distributed", rank,
                            "backend '" + requested + "' is not compiled in (link " + std::string(b->target) + ")");
    return requested;
  }
  std::string why;
  if (cuda_usable(why)) {
    log(LogLevel::info, "init_distributed: backend nccl (auto: a CUDA device is usable)");
    return "nccl";
  }
#if defined(COMM_HAS_MPI)
  if (mpi_world_ready()) {
    log(LogLevel::info, "init_distributed: backend mpi (auto: MPI is initialized and an MPI launcher started the job)");
    return "mpi";
  }
#endif
  log(LogLevel::info, "init_distributed: no GPU backend (auto: " + why + "); choosing a CPU backend by host");
  return "cpu";
}

/// The world communicator of the compiled-in backend `name` (resolve_backend's answer) over the
/// rendezvous `r`, with the backend's default options and `timeout`.
[[nodiscard]] inline std::unique_ptr<AnyCommunicator> create_world(std::string_view name, const InitResult& r,
                                                                   std::chrono::milliseconds timeout) {
  std::unique_ptr<AnyCommunicator> world;
  backends::for_each_backend([&]<class B>(std::type_identity<B>, std::string_view n) {
    if (world || n != name) return;
    typename B::Options o;
    o.timeout = timeout;
    world = std::make_unique<AnyCommunicator>(Communicator<B>::create(r.store, r.rank, r.size, o));
  });
  if (!world)
    throw InvalidArgument("init_distributed", r.rank, "backend '" + std::string(name) + "' is not compiled in");
  return world;
}

/// Where rank 0 of cdb's world says which backend the world runs, for replacements.
inline constexpr const char* kWorldBackendKey = "comm/world/backend";

/// A replacement process's world (COMM_RESTART_COUNT > 0): the backend named in `o`, else the one
/// the world's rank 0 recorded; joined when the members next call grow().
[[nodiscard]] inline std::unique_ptr<AnyCommunicator> join_world(const InitOptions& o, std::chrono::milliseconds timeout) {
  auto store = join_store_from_env(timeout);
  std::string name = o.backend;
  if (name.empty() || name == "auto" || name == "cpu") {
    store->wait({kWorldBackendKey}, timeout);
    const auto v = store->get(kWorldBackendKey);
    name.assign(v.begin(), v.end());
  }
  std::unique_ptr<AnyCommunicator> world;
  backends::for_each_backend([&]<class B>(std::type_identity<B>, std::string_view n) {
    if (world || n != name) return;
    if constexpr (supports_grow<B>) {
      typename B::Options bo;
      bo.timeout = timeout;
      world = std::make_unique<AnyCommunicator>(Communicator<B>(B::join(store, bo, timeout)));
    } else {
      throw InvalidArgument("init_distributed", -1,
                            "this process replaces a rank (COMM_RESTART_COUNT is set) but the world's backend '" + name +
                                "' cannot grow (only Gloo, Shm and Hierarchical can)");
    }
  });
  if (!world) throw InvalidArgument("init_distributed", -1, "backend '" + name + "' is not compiled in");
  return world;
}

}  // namespace detail

/// Says where rank, sizes and the master address would come from (the discovery of step 3-4).
[[nodiscard]] inline std::string describe_environment() { return detail::describe(detail::discover_environment()); }

}  // namespace comm
