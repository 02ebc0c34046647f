// cdb: discovery of every launcher family, init_distributed (reuse, conflicts, destroy),
// set_world with a user-built communicator, and AnyCommunicator's typed API over Gloo.
#include <doctest/doctest.h>

#include <chrono>
#include <numeric>
#include <string>
#include <vector>

#include <comm/comm.hpp>
#include <support/env_guard.hpp>
#include <support/multirank.hpp>

using comm::test::EnvGuard;
using comm::test::world;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

template <class F>
std::string invalid_message(F&& f) {
  try {
    f();
  } catch (const comm::InvalidArgument& e) {
    return e.what();
  }
  return "<no InvalidArgument>";
}

// Launcher variables for this rank of the harness's world, with a fresh port for the store.
struct WorldEnv {
  std::string rank = std::to_string(world().rank), size = std::to_string(world().size);
  std::string port = std::to_string(comm::test::shared_free_port());
  EnvGuard guard{{"RANK", rank.c_str()}, {"WORLD_SIZE", size.c_str()}, {"LOCAL_RANK", rank.c_str()},
                 {"LOCAL_WORLD_SIZE", size.c_str()}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port.c_str()},
                 {"COMM_TIMEOUT", "30s"}};
};

}  // namespace

TEST_CASE("discovery: each launcher family, with the source of every value") {
  using comm::detail::discover_environment;
  SUBCASE("launcher") {
    EnvGuard g{{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
               {"MASTER_ADDR", "10.1.2.3"}, {"MASTER_PORT", "1234"}};
    auto d = discover_environment();
    CHECK(d.family == "launcher");
    CHECK(d.rank.value == 3);
    CHECK(d.size.value == 8);
    CHECK(d.local_rank.value == 1);
    CHECK(d.local_size.value == 2);
    CHECK(d.master_addr == "10.1.2.3");
    CHECK(d.master_port == 1234);
    CHECK(d.master_port_from == "MASTER_PORT");
  }
  SUBCASE("openmpi") {
    EnvGuard g{{"OMPI_COMM_WORLD_RANK", "5"}, {"OMPI_COMM_WORLD_SIZE", "6"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
               {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"}, {"MASTER_ADDR", "head"}};
    auto d = discover_environment();
    CHECK(d.family == "openmpi");
    CHECK(d.rank.from == "OMPI_COMM_WORLD_RANK");
    CHECK(d.local_rank.value == 2);
    CHECK(d.local_rank.from == "OMPI_COMM_WORLD_LOCAL_RANK");
    CHECK(d.master_port == 29500);
    CHECK(d.master_port_from == "default 29500");
  }
  SUBCASE("mpich") {
    EnvGuard g{{"PMI_RANK", "1"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "4"}};
    auto d = discover_environment();
    CHECK(d.family == "mpich");
    CHECK(d.local_rank.from == "MPI_LOCALRANKID");
    CHECK(d.master_addr == "127.0.0.1");  // every rank is local
  }
  SUBCASE("slurm") {
    EnvGuard g{{"SLURM_PROCID", "7"}, {"SLURM_NTASKS", "16"}, {"SLURM_LOCALID", "3"},
               {"SLURM_TASKS_PER_NODE", "4(x4)"}, {"SLURM_JOB_NODELIST", "gpu[012-015],login1"}};
    auto d = discover_environment();
    CHECK(d.family == "slurm");
    CHECK(d.rank.value == 7);
    CHECK(d.size.value == 16);
    CHECK(d.local_rank.value == 3);
    CHECK(d.local_size.value == 4);
    CHECK(d.master_addr == "gpu012");
    CHECK(contains(d.master_addr_from, "SLURM_JOB_NODELIST"));
    CHECK(contains(comm::detail::describe(d), "master_addr = gpu012  (first host of SLURM_JOB_NODELIST)"));
  }
  SUBCASE("pmix takes the size from SLURM") {
    EnvGuard g{{"PMIX_RANK", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}, {"MASTER_ADDR", "x"}};
    auto d = discover_environment();
    CHECK(d.family == "pmix");
    CHECK(d.size.from == "SLURM_NTASKS");
  }
  SUBCASE("launcher variables win over MPI ones") {
    EnvGuard g{{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"},
               {"MASTER_ADDR", "127.0.0.1"}};
    CHECK(discover_environment().rank.value == 1);
  }
}

TEST_CASE("discovery: what init_distributed exported is not named as the source") {
  using comm::detail::discover_environment;
  EnvGuard g{{"OMPI_COMM_WORLD_RANK", "5"}, {"OMPI_COMM_WORLD_SIZE", "6"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "5"},
             {"OMPI_COMM_WORLD_LOCAL_SIZE", "6"}};
  comm::detail::export_discovered(discover_environment());
  REQUIRE(comm::detail::getenv_str("RANK") == "5");  // exported for libraries that read RANK
  auto d = discover_environment();
  CHECK(d.family == "openmpi");
  CHECK(d.rank.from == "OMPI_COMM_WORLD_RANK");
  CHECK(contains(d.master_addr_from, "all ranks are local"));
  CHECK(d.master_port_from == "default 29500");
  CHECK(contains(comm::describe_environment(), "(OMPI_COMM_WORLD_RANK)"));
  // A value set again by someone else is theirs.
  ::setenv("RANK", "4", 1);
  CHECK(discover_environment().family == "launcher");
}

TEST_CASE("auto without a GPU backend says why: not linked, or not built") {
  std::string why;
  CHECK_FALSE(comm::detail::cuda_usable(why));  // this test links comm::gloo, never comm::nccl
#if defined(COMM_NCCL_BUILT)
  CHECK(contains(why, "does not link comm::nccl"));
#else
  CHECK(contains(why, "built without NCCL"));
#endif
}

TEST_CASE("discovery: errors name what to set") {
  using comm::detail::discover_environment;
  SUBCASE("nothing at all") {
    EnvGuard g{};
    CHECK(contains(invalid_message([] { (void)discover_environment(); }), "set RANK and WORLD_SIZE"));
  }
  SUBCASE("no master address on several nodes") {
    EnvGuard g{{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
               {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};
    CHECK(contains(invalid_message([] { (void)discover_environment(); }), "set MASTER_ADDR"));
  }
  SUBCASE("local rank missing") {
    EnvGuard g{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "n1"}};
    CHECK(contains(invalid_message([] { (void)discover_environment(); }), "cannot find the local rank for slurm"));
  }
  SUBCASE("rank beyond size") {
    EnvGuard g{{"PMI_RANK", "4"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "0"}};
    CHECK(contains(invalid_message([] { (void)discover_environment(); }), "PMI_RANK=4 is not below PMI_SIZE=4"));
  }
  SUBCASE("bad values are quoted") {
    EnvGuard g{{"SLURM_PROCID", "x1"}, {"SLURM_NTASKS", "2"}};
    CHECK(contains(invalid_message([] { (void)discover_environment(); }), "SLURM_PROCID='x1'"));
  }
  SUBCASE("malformed node list") {
    CHECK(contains(invalid_message([] { (void)comm::detail::first_slurm_host("n[01-"); }), "unclosed"));
    CHECK(contains(invalid_message([] { (void)comm::detail::first_slurm_host("n[a-b]"); }), "malformed range"));
  }
}

TEST_CASE("init_distributed: gives the world, reuses it, rejects conflicting options") {
  WorldEnv env;
  REQUIRE_FALSE(comm::is_initialized());
  comm::InitOptions o;
  o.backend = "gloo";
  auto& w = comm::init_distributed(o);
  CHECK(comm::is_initialized());
  CHECK(w.rank() == world().rank);
  CHECK(w.size() == world().size);
  CHECK(w.backend() == "gloo");
  CHECK(&comm::init_distributed() == &w);  // reused
  CHECK(&comm::world() == &w);
  comm::InitOptions bad;
  bad.backend = "nccl";
  CHECK(contains(invalid_message([&] { (void)comm::init_distributed(bad); }), "conflicts with the initialized world's backend 'gloo'"));
  bad = {};
  bad.world_size = world().size + 1;
  CHECK(contains(invalid_message([&] { (void)comm::init_distributed(bad); }), "conflicts with the initialized world's size"));
  std::vector<int> x{w.rank()};
  w.all_reduce(x);
  CHECK(x[0] == world().size * (world().size - 1) / 2);
  comm::destroy();
  CHECK_FALSE(comm::is_initialized());
  CHECK_THROWS_AS((void)comm::world(), comm::Error);
  comm::test::barrier();
}

TEST_CASE("init_distributed: auto picks shm when every rank is on this host; \"shm\" names it") {
  for (const char* name : {"auto", "shm"}) {
    WorldEnv env;
    comm::InitOptions o;
    o.backend = name;
    auto& w = comm::init_distributed(o);
    INFO("backend option ", name);
    // No CUDA device on the CPU test machines: auto is a CPU choice there (gpu-check covers NCCL).
    if (std::string(name) == "shm" || w.backend() != "nccl") CHECK(w.backend() == "shm");
    CHECK((w.get_if<comm::backends::Shm>() != nullptr) == (w.backend() == "shm"));
    std::vector<int> x{w.rank() + 1};
    w.all_reduce(x);
    CHECK(x[0] == world().size * (world().size + 1) / 2);
    comm::destroy();
    comm::test::barrier();
  }
}

TEST_CASE("init_distributed: tcp:// init method with explicit rank and size") {
  const auto port = comm::test::shared_free_port();
  comm::InitOptions o;
  o.backend = "gloo";
  o.init_method = "tcp://127.0.0.1:" + std::to_string(port);
  o.rank = world().rank;
  o.world_size = world().size;
  o.timeout = std::chrono::seconds(30);
  auto& w = comm::init_distributed(o);
  std::vector<double> v{1.5};
  w.all_reduce(v, comm::ReduceOp::max);
  CHECK(v[0] == 1.5);
  comm::destroy();
  comm::test::barrier();
}

TEST_CASE("init_distributed: bad backend name") {
  comm::InitOptions o;
  o.backend = "mpi2";
  CHECK(contains(invalid_message([&] { (void)comm::init_distributed(o); }), "backend 'mpi2' is not auto"));
  CHECK_FALSE(comm::is_initialized());
}

TEST_CASE("set_world installs a communicator the application built") {
  auto c = comm::Communicator<comm::backends::Gloo>::create(comm::test::fresh_store(), world().rank, world().size);
  auto& w = comm::set_world(std::move(c));
  CHECK(&comm::init_distributed() == &w);
  CHECK(w.get_if<comm::backends::Gloo>() != nullptr);
  CHECK(contains(invalid_message([] {
                   (void)comm::set_world(comm::Communicator<comm::backends::Gloo>::create(
                       std::make_shared<comm::HashStore>(), 0, 1));
                 }),
                 "already initialized"));
  comm::destroy();
  comm::test::barrier();
}

TEST_CASE("AnyCommunicator: the typed API over a runtime-selected backend") {
  comm::AnyCommunicator w(
      comm::Communicator<comm::backends::Gloo>::create(comm::test::fresh_store(), world().rank, world().size));
  const int n = w.size(), r = w.rank();
  SUBCASE("all_reduce: runtime and compile-time ops, several types") {
    std::vector<std::int64_t> a{r + 1, -r};
    w.all_reduce(a, comm::ReduceOp::prod);
    std::int64_t fact = 1;
    for (int i = 1; i <= n; ++i) fact *= i;
    CHECK(a[0] == fact);
    std::vector<comm::bfloat16> h{comm::bfloat16(float(r))};
    w.all_reduce(h, comm::op::max);
    CHECK(float(h[0]) == float(n - 1));
    std::vector<std::uint32_t> bits{1u << r};
    w.all_reduce(bits, std::bit_or<>{});
    CHECK(bits[0] == (1u << n) - 1);
    std::vector<float> f{float(r)}, out(1);
    auto work = w.all_reduce(std::span<const float>(f), out, comm::ReduceOp::avg, comm::async);
    work.wait();
    CHECK(out[0] == doctest::Approx((n - 1) / 2.0));
  }
  SUBCASE("custom callable on Gloo") {
    std::vector<int> v{r + 1};
    w.all_reduce(v, [](int a, int b) { return a > b ? a : b; });
    CHECK(v[0] == n);
  }
  SUBCASE("custom callable, async: the operation keeps its own copy of the callable") {
    std::vector<int> v{r + 1};
    auto work = w.all_reduce(v, [](int a, int b) { return a > b ? a : b; }, comm::async);
    work.wait();
    CHECK(v[0] == n);
  }
  SUBCASE("reduce_scatter, all_gather, broadcast, gather, barrier") {
    std::vector<int> in(static_cast<std::size_t>(2 * n), 1), out(2);
    w.reduce_scatter(in, out);
    CHECK(out == std::vector<int>{n, n});
    std::vector<double> mine{double(r)}, all(static_cast<std::size_t>(n));
    w.all_gather(mine, all);
    for (int i = 0; i < n; ++i) CHECK(all[static_cast<std::size_t>(i)] == i);
    std::vector<std::uint8_t> b{static_cast<std::uint8_t>(r == n - 1 ? 42 : 0)};
    w.broadcast(b, n - 1, comm::async).wait();
    CHECK(b[0] == 42);
    std::vector<comm::half> g{comm::half(float(r))}, gout(r == 0 ? static_cast<std::size_t>(n) : 0);
    w.gather(g, gout, 0);
    if (r == 0)
      for (int i = 0; i < n; ++i) CHECK(float(gout[static_cast<std::size_t>(i)]) == float(i));
    w.barrier();
  }
  SUBCASE("reduce, scatter, all_to_all(_v), send/recv and batch_isend_irecv") {
    std::vector<int> v{r + 1};
    w.reduce(v, n - 1);
    if (r == n - 1) CHECK(v[0] == n * (n + 1) / 2);
    std::vector<double> sc_in(r == 0 ? static_cast<std::size_t>(n) : 0), sc_out(1, -1.0);
    for (std::size_t i = 0; i < sc_in.size(); ++i) sc_in[i] = 10.0 * static_cast<double>(i);
    w.scatter(sc_in, sc_out, 0);
    CHECK(sc_out[0] == 10.0 * r);
    std::vector<std::int64_t> a2a(static_cast<std::size_t>(n)), got(static_cast<std::size_t>(n));
    for (int p = 0; p < n; ++p) a2a[static_cast<std::size_t>(p)] = r * 100 + p;
    w.all_to_all(a2a, got, comm::async).wait();
    for (int p = 0; p < n; ++p) CHECK(got[static_cast<std::size_t>(p)] == p * 100 + r);
    std::vector<std::size_t> ones(static_cast<std::size_t>(n), 1);
    std::fill(got.begin(), got.end(), -1);
    w.all_to_all_v(a2a, ones, got, ones);
    for (int p = 0; p < n; ++p) CHECK(got[static_cast<std::size_t>(p)] == p * 100 + r);
    if (n >= 2) {
      std::vector<float> out{float(r)}, in{-1.f};
      auto works = w.batch_isend_irecv({comm::isend(out, (r + 1) % n), comm::irecv(in, (r + n - 1) % n)});
      for (auto& x : works) x.wait();
      CHECK(in[0] == float((r + n - 1) % n));
      if (r == 0) w.send(out, 1, 4);
      if (r == 1) {
        w.recv(in, 0, 4);
        CHECK(in[0] == 0.f);
      }
    }
    w.barrier();
  }
  SUBCASE("run-time errors name the op, rank and values") {
    std::vector<float> f{1.f};
    CHECK(contains(invalid_message([&] { w.all_reduce(f, comm::ReduceOp::bxor); }),
                   "bitwise reductions (band/bor/bxor) need an integer element type"));
    std::vector<float> big(3);
    CHECK(contains(invalid_message([&] { w.all_reduce(std::span<const float>(f), big); }),
                   "input has 1 element but output has 3"));
    CHECK(contains(invalid_message([&] { w.broadcast(f, n); }), "root " + std::to_string(n) + " is out of range"));
    w.barrier();  // still usable
  }
}
