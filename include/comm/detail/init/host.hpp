#pragma once
// Which ranks share a host, for every engine and for backend selection: the Shm engine maps one
// segment among them, Hierarchical groups them into a node, cdb's `auto` asks whether all ranks
// are on one machine.
//
// Host identity: boot id + the IPC, PID and network namespaces (+ the host name). Ranks on one
// machine but in different network namespaces count as different hosts: that is how containers
// (and comm's multi-node test bed) separate nodes, and their /dev/shm may differ.

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <string>

namespace comm::detail {

/// This process's host identity (see the file comment).
[[nodiscard]] inline std::string host_identity() {
  std::string id;
  {
    std::ifstream f("/proc/sys/kernel/random/boot_id");
    std::string b;
    if (f >> b) id += "boot=" + b;
  }
  for (const char* ns : {"ipc", "pid", "net"}) {
    struct stat st {};
    const std::string path = std::string("/proc/self/ns/") + ns;
    if (::stat(path.c_str(), &st) == 0) id += std::string(" ") + ns + "=" + std::to_string(st.st_ino);
  }
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) == 0) id += std::string(" host=") + host;
  return id;
}

}  // namespace comm::detail
