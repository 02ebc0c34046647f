// A program that calls only comm::init_distributed() (examples/init_distributed) started as real
// processes by the environments of different launchers, without comm-run: OpenMPI, MPICH/Intel
// MPI, PMIx+SLURM and SLURM variables, and under mpirun when OpenMPI is installed. Also the error
// naming MASTER_ADDR when no master address can be derived.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <comm/detail/net/socket.hpp>

extern char** environ;

namespace {

using Env = std::map<std::string, std::string>;

struct Result {
  int code = -1;
  std::string output;
};

bool is_launcher_var(const std::string& k) {
  for (const char* p : {"RANK=", "WORLD_SIZE=", "LOCAL_RANK=", "LOCAL_WORLD_SIZE=", "MASTER_ADDR=", "MASTER_PORT=",
                        "OMPI_", "PMI_", "PMIX_", "SLURM_", "MPI_LOCAL", "GROUP_RANK=", "NODE_RANK="})
    if (k.rfind(p, 0) == 0) return true;
  return false;
}

// Starts one process per entry of `envs` running `argv`, each with the test's environment minus
// every launcher variable plus its entry; waits for all, killing any still running at `limit`.
std::vector<Result> run_all(const std::vector<std::string>& argv, const std::vector<Env>& envs,
                            std::chrono::seconds limit = std::chrono::seconds(60)) {
  const auto dir = std::filesystem::temp_directory_path() / ("comm-launch-test-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::vector<pid_t> pids;
  std::vector<std::string> logs;
  for (std::size_t i = 0; i < envs.size(); ++i) {
    std::vector<std::string> env_store;
    for (char** e = environ; *e; ++e)
      if (!is_launcher_var(*e)) env_store.emplace_back(*e);
    for (auto& [k, v] : envs[i]) env_store.push_back(k + "=" + v);
    std::vector<char*> envp;
    for (auto& s : env_store) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> args = argv;
    std::vector<char*> av;
    for (auto& a : args) av.push_back(a.data());
    av.push_back(nullptr);
    logs.push_back((dir / ("proc" + std::to_string(i) + ".log")).string());
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, logs.back().c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    pid_t pid = -1;
    const int rc = posix_spawnp(&pid, av[0], &fa, nullptr, av.data(), envp.data());
    posix_spawn_file_actions_destroy(&fa);
    REQUIRE_MESSAGE(rc == 0, "cannot start " << argv[0]);
    pids.push_back(pid);
  }
  std::vector<Result> out(pids.size());
  const auto deadline = std::chrono::steady_clock::now() + limit;
  std::size_t left = pids.size();
  while (left > 0) {
    for (std::size_t i = 0; i < pids.size(); ++i) {
      if (pids[i] < 0) continue;
      int status = 0;
      if (::waitpid(pids[i], &status, WNOHANG) == pids[i]) {
        out[i].code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        pids[i] = -1;
        --left;
      }
    }
    if (left > 0 && std::chrono::steady_clock::now() > deadline) {
      for (auto p : pids)
        if (p > 0) ::kill(p, SIGKILL);
      FAIL("processes still running after " << limit.count() << " s: killed");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (std::size_t i = 0; i < out.size(); ++i) {
    std::ifstream f(logs[i]);
    std::stringstream ss;
    ss << f.rdbuf();
    out[i].output = ss.str();
  }
  std::filesystem::remove_all(dir);
  return out;
}

std::string port() { return std::to_string(comm::detail::free_port()); }

void expect_success(const std::vector<Result>& rs, int n) {
  REQUIRE(rs.size() == static_cast<std::size_t>(n));
  const int sum = n * (n - 1) / 2;
  for (std::size_t r = 0; r < rs.size(); ++r) {
    INFO("process " << r << " output:\n" << rs[r].output);
    CHECK(rs[r].code == 0);
    CHECK(rs[r].output.find("rank " + std::to_string(r) + " of " + std::to_string(n)) != std::string::npos);
    CHECK(rs[r].output.find("sum of ranks = " + std::to_string(sum)) != std::string::npos);
  }
}

const std::vector<std::string> prog{COMM_INIT_DISTRIBUTED_EXE};

}  // namespace

TEST_CASE("OpenMPI variables, one node, no MASTER_ADDR: all ranks local") {
  const int n = 3;
  const auto p = port();
  std::vector<Env> envs;
  for (int r = 0; r < n; ++r)
    envs.push_back({{"OMPI_COMM_WORLD_RANK", std::to_string(r)},
                    {"OMPI_COMM_WORLD_SIZE", std::to_string(n)},
                    {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(r)},
                    {"OMPI_COMM_WORLD_LOCAL_SIZE", std::to_string(n)},
                    {"MASTER_PORT", p}});
  expect_success(run_all(prog, envs), n);
}

TEST_CASE("MPICH / Intel MPI variables") {
  const int n = 2;
  const auto p = port();
  std::vector<Env> envs;
  for (int r = 0; r < n; ++r)
    envs.push_back({{"PMI_RANK", std::to_string(r)}, {"PMI_SIZE", std::to_string(n)},
                    {"MPI_LOCALRANKID", std::to_string(r)}, {"MPI_LOCALNRANKS", std::to_string(n)},
                    {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", p}});
  expect_success(run_all(prog, envs), n);
}

TEST_CASE("SLURM variables: master is the first host of SLURM_JOB_NODELIST") {
  const int n = 4;
  const auto p = port();
  std::vector<Env> envs;
  for (int r = 0; r < n; ++r)
    envs.push_back({{"SLURM_PROCID", std::to_string(r)}, {"SLURM_NTASKS", std::to_string(n)},
                    {"SLURM_LOCALID", std::to_string(r)}, {"SLURM_TASKS_PER_NODE", std::to_string(n)},
                    {"SLURM_JOB_NODELIST", "localhost,node[2-4]"}, {"MASTER_PORT", p}});
  expect_success(run_all(prog, envs), n);
}

TEST_CASE("PMIx rank with SLURM task count") {
  const int n = 2;
  const auto p = port();
  std::vector<Env> envs;
  for (int r = 0; r < n; ++r)
    envs.push_back({{"PMIX_RANK", std::to_string(r)}, {"SLURM_NTASKS", std::to_string(n)},
                    {"SLURM_LOCALID", std::to_string(r)}, {"MASTER_ADDR", "localhost"}, {"MASTER_PORT", p}});
  expect_success(run_all(prog, envs), n);
}

TEST_CASE("launcher variables (what comm-run and torchrun set)") {
  const int n = 2;
  const auto p = port();
  std::vector<Env> envs;
  for (int r = 0; r < n; ++r)
    envs.push_back({{"RANK", std::to_string(r)}, {"WORLD_SIZE", std::to_string(n)}, {"LOCAL_RANK", std::to_string(r)},
                    {"LOCAL_WORLD_SIZE", std::to_string(n)}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", p}});
  expect_success(run_all(prog, envs), n);
}

TEST_CASE("no master address derivable: the error names MASTER_ADDR") {
  // Two nodes' worth of OpenMPI ranks (LOCAL_SIZE 1 of 2): 127.0.0.1 cannot be assumed.
  std::vector<Env> envs{{{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                         {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"}}};
  const auto t0 = std::chrono::steady_clock::now();
  auto rs = run_all(prog, envs, std::chrono::seconds(20));
  INFO(rs[0].output);
  CHECK(rs[0].code == 2);
  CHECK(rs[0].output.find("set MASTER_ADDR") != std::string::npos);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
}

TEST_CASE("a missing local rank is an error, not a silent 0") {
  std::vector<Env> envs{{{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port()}}};
  auto rs = run_all(prog, envs, std::chrono::seconds(20));
  INFO(rs[0].output);
  CHECK(rs[0].code == 2);
  CHECK(rs[0].output.find("cannot find the local rank") != std::string::npos);
  CHECK(rs[0].output.find("LOCAL_RANK") != std::string::npos);
}

TEST_CASE("under mpirun, when OpenMPI is installed") {
  if (std::system("command -v mpirun >/dev/null 2>&1") != 0) {
    MESSAGE("SKIPPED: mpirun not found (install openmpi-bin to run this case)");
    return;
  }
  const auto p = port();
  std::vector<Env> envs{{{"MASTER_PORT", p}, {"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}}};
  auto rs = run_all({"mpirun", "--oversubscribe", "-n", "3", "--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include",
                     "lo", "--mca", "oob_tcp_if_include", "lo", COMM_INIT_DISTRIBUTED_EXE},
                    envs);
  INFO(rs[0].output);
  CHECK(rs[0].code == 0);
  for (int r = 0; r < 3; ++r) CHECK(rs[0].output.find("rank " + std::to_string(r) + " of 3") != std::string::npos);
}
