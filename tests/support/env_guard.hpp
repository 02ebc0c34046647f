#pragma once
// Sets environment variables for one scope and restores the previous values afterwards.

#include <cstdlib>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <utility>

namespace comm::test {

class EnvGuard {
 public:
  /// Starts from an environment without any launcher variable (comm-run set some for the
  /// harness; discovery would otherwise see them), then applies `vars` (nullptr unsets).
  EnvGuard(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (const char* k : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                          "COMM_AGENT_STORE", "COMM_RESTART_COUNT",
                          "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                          "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
                          "PMIX_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST",
                          "SLURM_NODELIST", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"})
      unset(k);
    for (auto [k, v] : vars) {
      save(k);
      if (v) ::setenv(k, v, 1); else ::unsetenv(k);
    }
  }
  ~EnvGuard() {
    for (auto& [k, v] : saved_) {
      if (v) ::setenv(k.c_str(), v->c_str(), 1); else ::unsetenv(k.c_str());
    }
  }
  EnvGuard(const EnvGuard&) = delete;
  EnvGuard& operator=(const EnvGuard&) = delete;

 private:
  void save(const char* k) {
    if (saved_.contains(k)) return;
    const char* old = std::getenv(k);
    saved_[k] = old ? std::optional<std::string>(old) : std::nullopt;
  }
  void unset(const char* k) {
    save(k);
    ::unsetenv(k);
  }
  std::map<std::string, std::optional<std::string>> saved_;
};

/// Sets (or, with nullptr, unsets) one variable for one scope, leaving the rest as it is.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value)
      ::setenv(name, value, 1);
    else
      ::unsetenv(name);
  }
  ScopedEnv(const char* name, const std::string& value) : ScopedEnv(name, value.c_str()) {}
  ~ScopedEnv() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace comm::test
