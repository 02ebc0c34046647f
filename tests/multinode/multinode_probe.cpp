// The rank program of the multi-node tests (tests/multinode/multinode_test.sh), run under comm-run
// inside the namespaces of scripts/cluster. Every line it prints starts with "rank R:" and has
// key=value fields that the script checks; exit 0 only when the mode's checks passed.
//
//   multinode_probe split            world, per-node (split by GROUP_RANK) and cross-node groups
//   multinode_probe bytes N ITERS    ITERS all_reduces of N bytes (traffic for interface checks)
//   multinode_probe loop DIR [COUNT] all_reduce of COUNT floats (4096) until an error (SIGTERM
//                                    noted, not fatal); writes DIR/pid.R, DIR/ready.R
//   multinode_probe sink ADDR PORT   TCP: accepts one connection, reads to EOF, reports the time
//   multinode_probe source ADDR PORT N   TCP: connects (reports the connect time), sends N bytes
// Times are wall-clock (CLOCK_REALTIME, shared by every namespace) so that the script can relate
// them to when it killed something.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <comm/comm.hpp>

namespace {

using Gloo = comm::Communicator<comm::backends::Gloo>;
using namespace std::chrono_literals;

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

int env_int(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) {
    std::fprintf(stderr, "multinode_probe: %s is not set (run me under comm-run)\n", name);
    std::exit(2);
  }
  return std::atoi(v);
}

std::string error_kind(const std::exception& e) {
  if (dynamic_cast<const comm::Timeout*>(&e)) return "comm::Timeout";
  if (dynamic_cast<const comm::RemoteError*>(&e)) return "comm::RemoteError";
  if (dynamic_cast<const comm::BackendError*>(&e)) return "comm::BackendError";
  if (dynamic_cast<const comm::InvalidArgument*>(&e)) return "comm::InvalidArgument";
  if (dynamic_cast<const comm::Error*>(&e)) return "comm::Error";
  return "std::exception";
}

int failures = 0;
void expect(int rank, bool ok, const std::string& what) {
  if (ok) return;
  ++failures;
  std::printf("rank %d: FAIL %s\n", rank, what.c_str());
}

// The world, then one group per node and one group of the ranks with the same local rank (the
// "leaders" pattern of hierarchical all_reduce), each checked by size, rank and a sum.
int run_split() {
  auto world = Gloo::from_env();
  const int rank = world.rank();
  const int node = env_int("GROUP_RANK"), nnodes = env_int("GROUP_WORLD_SIZE");
  const int local = env_int("LOCAL_RANK"), per_node = env_int("LOCAL_WORLD_SIZE");
  expect(rank, world.size() == nnodes * per_node, "world size " + std::to_string(world.size()));

  std::vector<long> x{rank};
  world.all_reduce(std::span<long>(x));
  const long n = world.size();
  expect(rank, x[0] == n * (n - 1) / 2, "world all_reduce " + std::to_string(x[0]));

  auto in_node = world.split(node);
  expect(rank, in_node.has_value(), "split by node gave no group");
  if (!in_node) return 1;
  expect(rank, in_node->size() == per_node, "node group size " + std::to_string(in_node->size()));
  expect(rank, in_node->rank() == local, "node group rank " + std::to_string(in_node->rank()));
  std::vector<long> y{rank};
  in_node->all_reduce(std::span<long>(y));
  // Ranks node*L .. node*L+L-1.
  const long first = static_cast<long>(node) * per_node, want_node = per_node * first + per_node * (per_node - 1L) / 2;
  expect(rank, y[0] == want_node, "node all_reduce " + std::to_string(y[0]) + ", want " + std::to_string(want_node));
  std::vector<int> members(static_cast<std::size_t>(per_node), -1);
  in_node->all_gather(std::vector<int>{rank}, members);
  for (int l = 0; l < per_node; ++l)
    expect(rank, members[static_cast<std::size_t>(l)] == node * per_node + l, "node all_gather slot " + std::to_string(l));

  auto across = world.split(local);
  expect(rank, across.has_value(), "split by local rank gave no group");
  if (!across) return 1;
  expect(rank, across->size() == nnodes, "cross-node group size " + std::to_string(across->size()));
  expect(rank, across->rank() == node, "cross-node group rank " + std::to_string(across->rank()));
  std::vector<long> z{node};
  across->all_reduce(std::span<long>(z));
  expect(rank, z[0] == nnodes * (nnodes - 1L) / 2, "cross-node all_reduce " + std::to_string(z[0]));

  world.barrier();
  if (failures == 0)
    std::printf("rank %d: split OK node=%d node_size=%d node_sum=%ld cross_size=%d cross_sum=%ld world_sum=%ld\n", rank,
                node, in_node->size(), y[0], across->size(), z[0], x[0]);
  return failures == 0 ? 0 : 1;
}

int run_bytes(std::size_t bytes, int iters) {
  auto c = Gloo::from_env();
  std::vector<float> v(bytes / sizeof(float));
  const double t0 = now_s();
  for (int i = 0; i < iters; ++i) {
    std::fill(v.begin(), v.end(), 1.0f);
    c.all_reduce(std::span<float>(v));
    expect(c.rank(), v.empty() || v.back() == static_cast<float>(c.size()), "all_reduce value " + std::to_string(v.back()));
  }
  std::printf("rank %d: bytes OK bytes=%zu iters=%d s=%.3f\n", c.rank(), bytes, iters, now_s() - t0);
  return failures == 0 ? 0 : 1;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path + ".tmp") << text << "\n";
  std::rename((path + ".tmp").c_str(), path.c_str());
}

volatile sig_atomic_t got_term = 0;

int run_loop(const std::string& dir, std::size_t count) {
  // When one rank of a node fails first, comm-run SIGTERMs the node's other ranks; they keep
  // going until their own comm::Error (the test's point is that every rank gets one), as a
  // program that checkpoints on SIGTERM would. comm-run's grace period bounds this.
  struct sigaction sa {};
  sa.sa_handler = [](int) { got_term = 1; };
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGTERM, &sa, nullptr);
  const int env_rank = env_int("RANK");
  write_file(dir + "/pid." + std::to_string(env_rank), std::to_string(::getpid()));
  double last_ok = now_s();
  try {
    auto c = Gloo::from_env();
    std::vector<float> v(count);
    for (long i = 0;; ++i) {
      std::fill(v.begin(), v.end(), 1.0f);
      c.all_reduce(std::span<float>(v));
      if (v[0] != static_cast<float>(c.size())) {
        std::printf("rank %d: FAIL all_reduce value %g\n", c.rank(), static_cast<double>(v[0]));
        return 1;
      }
      last_ok = now_s();
      if (i == 0) write_file(dir + "/ready." + std::to_string(env_rank), "1");
      // Gentle on a 2-core CI machine; failures are still seen within milliseconds.
      std::this_thread::sleep_for(10ms);
    }
  } catch (const std::exception& e) {
    const double t = now_s();
    std::printf("rank %d: ERROR kind=%s at=%.3f since_ok=%.3f sigterm=%d what=%s\n", env_rank, error_kind(e).c_str(),
                t, t - last_ok, static_cast<int>(got_term), e.what());
    std::fflush(stdout);
    return 3;
  }
}

// Raw TCP, for checking the cluster itself (reachability, tc shaping) without other tools.
sockaddr_in parse_addr(const char* addr, const char* port) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<std::uint16_t>(std::atoi(port)));
  if (::inet_pton(AF_INET, addr, &sa.sin_addr) != 1) {
    std::fprintf(stderr, "multinode_probe: bad IPv4 address '%s'\n", addr);
    std::exit(2);
  }
  return sa;
}

bool wait_fd(int fd, short events, int timeout_ms) {
  pollfd p{fd, events, 0};
  return ::poll(&p, 1, timeout_ms) == 1;
}

constexpr int io_timeout_ms = 30000;

int run_sink(const char* addr, const char* port) {
  const auto sa = parse_addr(addr, port);
  const int ls = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  ::setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(ls, reinterpret_cast<const sockaddr*>(&sa), sizeof sa) != 0 || ::listen(ls, 4) != 0) {
    std::perror("multinode_probe sink: bind/listen");
    return 2;
  }
  std::printf("sink: listening\n");
  std::fflush(stdout);
  if (!wait_fd(ls, POLLIN, io_timeout_ms)) {
    std::fprintf(stderr, "multinode_probe sink: nobody connected within %d ms\n", io_timeout_ms);
    return 1;
  }
  const int fd = ::accept4(ls, nullptr, nullptr, SOCK_CLOEXEC);
  double t0 = 0;
  std::size_t total = 0;
  std::vector<char> buf(1 << 16);
  for (;;) {
    if (!wait_fd(fd, POLLIN, io_timeout_ms)) {
      std::fprintf(stderr, "multinode_probe sink: no data for %d ms\n", io_timeout_ms);
      return 1;
    }
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n <= 0) break;
    if (total == 0) t0 = now_s();
    total += static_cast<std::size_t>(n);
  }
  std::printf("sink: bytes=%zu s=%.4f\n", total, total ? now_s() - t0 : 0.0);
  return 0;
}

int run_source(const char* addr, const char* port, std::size_t bytes) {
  const auto sa = parse_addr(addr, port);
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  const double t0 = now_s();
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof sa) != 0 && errno != EINPROGRESS) {
    std::perror("multinode_probe source: connect");
    return 1;
  }
  int err = 0;
  socklen_t len = sizeof err;
  if (!wait_fd(fd, POLLOUT, io_timeout_ms) || ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
    std::fprintf(stderr, "multinode_probe source: cannot connect to %s:%s: %s\n", addr, port,
                 err ? std::strerror(err) : "timed out");
    return 1;
  }
  const double connect_s = now_s() - t0;
  std::vector<char> buf(1 << 16, 'x');
  std::size_t sent = 0;
  while (sent < bytes) {
    if (!wait_fd(fd, POLLOUT, io_timeout_ms)) {
      std::fprintf(stderr, "multinode_probe source: stalled after %zu bytes\n", sent);
      return 1;
    }
    const ssize_t n = ::write(fd, buf.data(), std::min(buf.size(), bytes - sent));
    if (n < 0 && errno != EAGAIN) {
      std::perror("multinode_probe source: write");
      return 1;
    }
    if (n > 0) sent += static_cast<std::size_t>(n);
  }
  ::close(fd);
  std::printf("source: connect_ms=%.3f bytes=%zu\n", connect_s * 1000, sent);
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "split") return run_split();
  if (mode == "bytes" && argc == 4) return run_bytes(std::stoul(argv[2]), std::stoi(argv[3]));
  if (mode == "loop" && (argc == 3 || argc == 4)) return run_loop(argv[2], argc == 4 ? std::stoul(argv[3]) : 4096);
  if (mode == "sink" && argc == 4) return run_sink(argv[2], argv[3]);
  if (mode == "source" && argc == 5) return run_source(argv[2], argv[3], std::stoul(argv[4]));
  std::fprintf(stderr, "usage: multinode_probe split | bytes N ITERS | loop DIR [COUNT] | sink ADDR PORT | source ADDR PORT N\n");
  return 2;
} catch (const std::exception& e) {
  const char* r = std::getenv("RANK");
  std::printf("rank %s: ERROR kind=%s at=%.3f what=%s\n", r ? r : "?", error_kind(e).c_str(), now_s(), e.what());
  return 3;
}
