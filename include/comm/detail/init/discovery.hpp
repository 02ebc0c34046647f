#pragma once
// Finds rank, world size, local rank and the master address from whatever launched this process:
// comm-run/torchrun variables first, then OpenMPI, MPICH/Intel MPI, PMIx and SLURM ones. No MPI
// library is needed. Every value remembers which variable it came from, for describe_environment().

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <comm/detail/base/env.hpp>
#include <comm/error.hpp>

namespace comm::detail {

struct Sourced {
  int value = -1;
  std::string from;  // the variable, or a sentence saying how it was derived
  [[nodiscard]] bool known() const { return value >= 0; }
};

struct Discovery {
  std::string family;  // "launcher", "openmpi", "mpich", "pmix", "slurm"
  Sourced rank, size, local_rank, local_size;
  std::string master_addr, master_addr_from;
  std::uint16_t master_port = 29500;
  std::string master_port_from = "default 29500";
};

/// Expands the first host of a SLURM node list: "node[03-05,9],gpu1" -> "node03".
[[nodiscard]] inline std::string first_slurm_host(std::string_view list) {
  list = trim(list);
  // The first entry ends at a comma that is outside brackets.
  int depth = 0;
  std::size_t end = list.size();
  for (std::size_t i = 0; i < list.size(); ++i) {
    if (list[i] == '[') ++depth;
    else if (list[i] == ']') --depth;
    else if (list[i] == ',' && depth == 0) {
      end = i;
      break;
    }
  }
  std::string_view first = list.substr(0, end);
  std::string out;
  while (!first.empty()) {
    auto open = first.find('[');
    if (open == std::string_view::npos) {
      out += first;
      break;
    }
    auto close = first.find(']', open);
    if (close == std::string_view::npos)
      throw InvalidArgument("init", -1, "SLURM_JOB_NODELIST='" + std::string(list) + "' has an unclosed '['");
    out += first.substr(0, open);
    // The first value of the range list: up to the first ',' or '-'.
    std::string_view range = first.substr(open + 1, close - open - 1);
    auto stop = range.find_first_of(",-");
    std::string_view lo = range.substr(0, stop);
    if (lo.empty() || lo.find_first_not_of("0123456789") != std::string_view::npos)
      throw InvalidArgument("init", -1, "SLURM_JOB_NODELIST='" + std::string(list) + "' has a malformed range");
    out += lo;  // keeps leading zeros, as SLURM's own expansion does
    first.remove_prefix(close + 1);
  }
  if (out.empty()) throw InvalidArgument("init", -1, "SLURM_JOB_NODELIST is empty");
  return out;
}

/// The launcher names (RANK, MASTER_ADDR, ...) that init_distributed exported itself for libraries
/// that read only those, each with the value it set: a later discovery reads past them and finds
/// the variables they came from, so describe_environment() never names comm's own export as the source.
struct ExportedVars {
  std::mutex mu;
  std::map<std::string, std::string, std::less<>> values;
};
inline ExportedVars& exported_vars() {
  static ExportedVars e;
  return e;
}

/// Whether `var` holds what comm exported into it (a user who set it again since wins).
[[nodiscard]] inline bool exported_by_comm(const char* var) {
  auto& e = exported_vars();
  std::lock_guard lock(e.mu);
  const auto it = e.values.find(var);
  return it != e.values.end() && getenv_str(var) == it->second;
}

inline bool set_from(Sourced& s, const char* var) {
  if (auto v = env_nonneg_int(var)) {
    s.value = *v;
    s.from = var;
    return true;
  }
  return false;
}

/// Reads the environment. Throws InvalidArgument when a family is present but incomplete or
/// inconsistent, or when nothing names this process's rank.
[[nodiscard]] inline Discovery discover_environment() {
  Discovery d;
  struct Family {
    const char* name;
    const char* rank;
    const char* size;
    std::vector<const char*> local_rank;
    std::vector<const char*> local_size;
  };
  const Family families[] = {
      {"launcher", "RANK", "WORLD_SIZE", {"LOCAL_RANK"}, {"LOCAL_WORLD_SIZE"}},
      {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", {"OMPI_COMM_WORLD_LOCAL_RANK"},
       {"OMPI_COMM_WORLD_LOCAL_SIZE"}},
      {"mpich", "PMI_RANK", "PMI_SIZE", {"MPI_LOCALRANKID", "PMI_LOCAL_RANK"}, {"MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"}},
      {"pmix", "PMIX_RANK", "PMIX_SIZE", {"PMIX_LOCAL_RANK", "SLURM_LOCALID"}, {"PMIX_LOCAL_SIZE"}},
      {"slurm", "SLURM_PROCID", "SLURM_NTASKS", {"SLURM_LOCALID"}, {"SLURM_NTASKS_PER_NODE"}},
  };
  const Family* found = nullptr;
  for (const auto& f : families) {
    if (&f == &families[0] && exported_by_comm(f.rank)) continue;
    if (set_from(d.rank, f.rank)) {
      found = &f;
      break;
    }
  }
  if (!found)
    throw InvalidArgument("init", -1,
                          "cannot find this process's rank: set RANK and WORLD_SIZE (comm-run does), or launch "
                          "with mpirun or srun (OMPI_COMM_WORLD_RANK, PMI_RANK, PMIX_RANK, SLURM_PROCID)");
  d.family = found->name;
  if (!set_from(d.size, found->size)) {
    // PMIx sets no size of its own; under SLURM the task count is it.
    if (!(d.family == "pmix" && set_from(d.size, "SLURM_NTASKS")))
      throw InvalidArgument("init", d.rank.value,
                            std::string(found->rank) + " is set but " + found->size + " is not: cannot tell the world size");
  }
  if (d.size.value < 1) throw InvalidArgument("init", d.rank.value, std::string(d.size.from) + "=0 must be at least 1");
  if (d.rank.value >= d.size.value)
    throw InvalidArgument("init", -1,
                          d.rank.from + "=" + std::to_string(d.rank.value) + " is not below " + d.size.from + "=" +
                              std::to_string(d.size.value));
  for (auto* v : found->local_rank)
    if (set_from(d.local_rank, v)) break;
  for (auto* v : found->local_size)
    if (set_from(d.local_size, v)) break;
  if (!d.local_size.known() && d.family == "slurm") {
    // SLURM_TASKS_PER_NODE looks like "4(x2),3": the first node's count is the common case.
    if (auto t = getenv_str("SLURM_TASKS_PER_NODE")) {
      auto head = std::string_view(*t).substr(0, std::string_view(*t).find_first_of("(,"));
      if (auto n = parse_int<int>(head); n && *n > 0) d.local_size = {*n, "SLURM_TASKS_PER_NODE"};
    }
  }
  if (d.size.value == 1) {
    if (!d.local_rank.known()) d.local_rank = {0, "the only rank"};
    if (!d.local_size.known()) d.local_size = {1, "the only rank"};
  }
  if (!d.local_rank.known() && d.family != "launcher")
    throw InvalidArgument("init", d.rank.value,
                          "cannot find the local rank for " + d.family + " (rank from " + d.rank.from +
                              "): set LOCAL_RANK");
  if (d.local_rank.known() && d.local_size.known() && d.local_rank.value >= d.local_size.value)
    throw InvalidArgument("init", d.rank.value,
                          d.local_rank.from + "=" + std::to_string(d.local_rank.value) + " is not below " +
                              d.local_size.from + "=" + std::to_string(d.local_size.value));

  if (auto a = getenv_str("MASTER_ADDR"); a && !trim(*a).empty() && !exported_by_comm("MASTER_ADDR")) {
    d.master_addr = std::string(trim(*a));
    d.master_addr_from = "MASTER_ADDR";
  } else if (auto nl = getenv_str("SLURM_JOB_NODELIST"); nl && !trim(*nl).empty()) {
    d.master_addr = first_slurm_host(*nl);
    d.master_addr_from = "first host of SLURM_JOB_NODELIST";
  } else if (auto nl2 = getenv_str("SLURM_NODELIST"); nl2 && !trim(*nl2).empty()) {
    d.master_addr = first_slurm_host(*nl2);
    d.master_addr_from = "first host of SLURM_NODELIST";
  } else if (d.size.value == 1 || (d.local_size.known() && d.local_size.value == d.size.value)) {
    d.master_addr = "127.0.0.1";  // every rank is on this node
    d.master_addr_from = "all ranks are local (" + (d.local_size.known() ? d.local_size.from : d.size.from) + ")";
  } else {
    throw InvalidArgument("init", d.rank.value,
                          "cannot find the master address (rank 0's host) for " + d.family +
                              ": set MASTER_ADDR (and MASTER_PORT, default 29500)");
  }
  if (auto p = getenv_str("MASTER_PORT"); p && !trim(*p).empty() && !exported_by_comm("MASTER_PORT")) {
    d.master_port = parse_port("MASTER_PORT", *p);
    d.master_port_from = "MASTER_PORT";
  }
  return d;
}

/// Exports what `d` found under the launcher names, where the launcher did not set them itself
/// (its own values win), and remembers each export for exported_by_comm().
inline void export_discovered(const Discovery& d) {
  auto put = [](const char* name, const std::string& value) {
    if (getenv_str(name)) return;
    auto& e = exported_vars();
    std::lock_guard lock(e.mu);
    ::setenv(name, value.c_str(), 0);
    e.values[name] = value;
  };
  put("RANK", std::to_string(d.rank.value));
  put("WORLD_SIZE", std::to_string(d.size.value));
  if (d.local_rank.known()) put("LOCAL_RANK", std::to_string(d.local_rank.value));
  if (d.local_size.known()) put("LOCAL_WORLD_SIZE", std::to_string(d.local_size.value));
  put("MASTER_ADDR", d.master_addr);
  put("MASTER_PORT", std::to_string(d.master_port));
}

[[nodiscard]] inline std::string describe(const Discovery& d) {
  auto line = [](std::string_view what, const Sourced& s) {
    return "  " + std::string(what) + " = " + (s.known() ? std::to_string(s.value) : std::string("unknown")) +
           (s.from.empty() ? "" : "  (" + s.from + ")") + "\n";
  };
  return "comm environment (" + d.family + "):\n" + line("rank", d.rank) + line("world_size", d.size) +
         line("local_rank", d.local_rank) + line("local_world_size", d.local_size) + "  master_addr = " +
         d.master_addr + "  (" + d.master_addr_from + ")\n" + "  master_port = " + std::to_string(d.master_port) +
         "  (" + d.master_port_from + ")\n";
}

}  // namespace comm::detail
