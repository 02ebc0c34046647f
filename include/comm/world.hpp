#pragma once
/// \file
/// cdb's world: the one communicator a program gets from `init_distributed()` (see cdb.hpp's file
/// comment for the steps), `world()`, `is_initialized()`, `set_world()` and `destroy()`.

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include <comm/any_communicator.hpp>
#include <comm/backends/registry.hpp>
#include <comm/communicator.hpp>
#include <comm/detail/base/logging.hpp>
#include <comm/error.hpp>
#include <comm/init.hpp>
#include <comm/selection.hpp>

namespace comm {

namespace detail {

struct WorldState {
  std::mutex mu;
  std::unique_ptr<AnyCommunicator> world;
};

inline WorldState& world_state() {
  static WorldState s;
  return s;
}

}  // namespace detail

/// True once init_distributed() or set_world() installed a world and destroy() has not removed it.
[[nodiscard]] inline bool is_initialized() {
  auto& s = detail::world_state();
  std::lock_guard lock(s.mu);
  return s.world != nullptr;
}

/// The world communicator. Throws comm::Error when there is none.
[[nodiscard]] inline AnyCommunicator& world() {
  auto& s = detail::world_state();
  std::lock_guard lock(s.mu);
  if (!s.world) throw Error("world", -1, "comm is not initialized: call comm::init_distributed() first");
  return *s.world;
}

/// Installs a communicator the application built itself (create, from_env or adopt) as the world.
/// Throws comm::InvalidArgument when a world already exists.
template <backend B>
AnyCommunicator& set_world(Communicator<B>&& c) {
  auto& s = detail::world_state();
  std::lock_guard lock(s.mu);
  if (s.world)
    throw InvalidArgument("set_world", s.world->rank(), "a world is already initialized; call comm::destroy() first");
  s.world = std::make_unique<AnyCommunicator>(std::move(c));
  return *s.world;
}

/// Fault tolerance for the world (Communicator::shrink / grow): replaces the world by its next
/// generation, in place, so that `comm::world()` and references to it follow (use rank() and
/// size() again afterwards). Called by every live member, like the methods they stand for.
inline AnyCommunicator& shrink_world() {
  auto& w = world();
  w = w.shrink();
  return w;
}
/// Fault tolerance for the world: admits the replacements waiting to join (Communicator::grow) and
/// replaces the world by the grown one, in place. Called by every live member.
inline AnyCommunicator& grow_world() {
  auto& w = world();
  w = w.grow();
  return w;
}

/// Destroys the world (its pending work is finished or failed by the backend). Idempotent.
inline void destroy() {
  std::unique_ptr<AnyCommunicator> old;
  {
    auto& s = detail::world_state();
    std::lock_guard lock(s.mu);
    old = std::move(s.world);
  }
}

/// The world communicator, created on first call (see cdb.hpp's file comment for the steps).
inline AnyCommunicator& init_distributed(InitOptions o = {}) {
  auto& s = detail::world_state();
  std::lock_guard lock(s.mu);
  if (s.world) {
    auto& w = *s.world;
    if (o.backend != "auto" && !o.backend.empty() && o.backend != w.backend())
      throw InvalidArgument("init_distributed", w.rank(),
                            "backend '" + o.backend + "' conflicts with the initialized world's backend '" +
                                std::string(w.backend()) + "'");
    detail::check_init_matches(o, w.rank(), w.size(), "the initialized world's");
    detail::log(detail::LogLevel::info, "init_distributed: reusing the initialized world");
    return w;
  }
  const auto timeout = o.timeout.count() > 0 ? o.timeout : timeout_from_env();
  if (detail::elastic_restart_count() > 0) {  // a replacement joins the running world (rejoin.hpp)
    s.world = detail::join_world(o, timeout);
    return *s.world;
  }
  std::string backend = detail::resolve_backend(o.backend, o.rank);
#if defined(COMM_HAS_MPI)
  if (backend == "mpi") {
    s.world = detail::init_mpi_world(o, timeout);
    return *s.world;
  }
#endif
  InitResult r = detail::rendezvous_for(o, timeout);
  if (backend == "cpu") {
    if (r.size == 1 || detail::all_on_one_host(*r.store, r.rank, r.size, timeout)) {
      backend = "shm";
      detail::log(detail::LogLevel::info, "init_distributed: backend shm (auto: every rank is on this host)");
    } else {
      const backends::KnownBackend* h = backends::find_backend("hierarchical");
      if (h == nullptr || !h->compiled_in)
        throw InvalidArgument("init_distributed", r.rank,
                              "backend auto: the ranks span several hosts and Hierarchical is not compiled in (link " +
                                  std::string(h ? h->target : "comm::gloo") + ")");
      backend = "hierarchical";
      detail::log(detail::LogLevel::info,
                  "init_distributed: backend hierarchical (auto: the ranks span several hosts; shm within each host, "
                  "gloo across hosts)");
    }
  }
  s.world = detail::create_world(backend, r, timeout);
  // What a replacement reads to join this world with the same backend (join_world).
  if (r.rank == 0 && r.store) r.store->set(detail::kWorldBackendKey, backend);
  detail::log(detail::LogLevel::info, "init_distributed: rank " + std::to_string(r.rank) + " of " +
                                          std::to_string(r.size) + " ready on " + backend);
  return *s.world;
}

}  // namespace comm

