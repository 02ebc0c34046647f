// A peer that exits mid-loop: the survivors must fail with comm::RemoteError (or comm::Timeout)
// within seconds, not hang. Standalone (no doctest harness: its end-of-run rendezvous would wait
// for the dead rank). Run under `comm-run -n N`: the last rank _exit(0)s before iteration 50 (exit
// code 0 so comm-run does not kill the job); every other rank must catch the error and exit 0.
// The communicator timeout is 60 s, so an error within seconds shows the death was detected
// through the closed connections, not by a deadline.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <comm/backends/gloo.hpp>
#include <comm/communicator.hpp>

using Comm = comm::Communicator<comm::backends::Gloo>;
using namespace std::chrono_literals;

namespace {

long long now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

int main() {
  comm::backends::Gloo::Options o;
  o.timeout = 60s;
  auto c = Comm::from_env(o);
  const int n = c.size();
  const int rank = c.rank();
  if (n < 2) {
    std::printf("SKIPPED: the peer-death test needs at least 2 ranks\n");
    return 0;
  }
  const int victim = n - 1;
  const char* port = std::getenv("MASTER_PORT");
  // In the working directory (the build tree under ctest); left there, since the survivors read
  // it at different times.
  const std::string death_file = "gloo_peer_death_" + std::string(port ? port : "0") + ".ns";
  constexpr int kDeathIteration = 50;

  std::vector<float> v(4096);
  for (int i = 0; i < 100000; ++i) {
    if (rank == victim && i == kDeathIteration) {
      std::ofstream(death_file) << now_ns() << "\n";
      std::printf("rank %d: exiting abruptly before iteration %d\n", rank, i);
      std::fflush(stdout);
      ::_exit(0);
    }
    std::fill(v.begin(), v.end(), 1.0f);
    try {
      if (i % 2 == 0)
        c.all_reduce(v);
      else
        c.all_reduce(v, comm::async).wait();
      if (v[4095] != static_cast<float>(n)) {
        std::printf("rank %d: wrong result %f at iteration %d\n", rank, static_cast<double>(v[4095]), i);
        return 1;
      }
    } catch (const comm::Error& e) {
      const long long err_ns = now_ns();
      const bool expected_kind = dynamic_cast<const comm::RemoteError*>(&e) != nullptr ||
                                 dynamic_cast<const comm::Timeout*>(&e) != nullptr;
      long long death_ns = 0;
      for (int tries = 0; tries < 100 && death_ns == 0; ++tries) {
        std::ifstream(death_file) >> death_ns;
        if (death_ns == 0) std::this_thread::sleep_for(10ms);
      }
      const double ms = death_ns > 0 ? static_cast<double>(err_ns - death_ns) / 1e6 : -1.0;
      std::printf("rank %d: %s at iteration %d, %.1f ms after the peer died: %s\n", rank,
                  expected_kind ? (dynamic_cast<const comm::RemoteError*>(&e) ? "RemoteError" : "Timeout")
                                : "UNEXPECTED error kind",
                  i, ms, e.what());
      // Later operations fail at once with the first cause.
      const auto t0 = std::chrono::steady_clock::now();
      bool again = false;
      try {
        c.barrier();
      } catch (const comm::Error&) {
        again = true;
      }
      const long long later_ms =
          std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
      std::printf("rank %d: the next operation failed too: %s (%lld ms)\n", rank, again ? "yes" : "NO", later_ms);
      std::fflush(stdout);
      // Iteration 49 may fail too: the victim finished its part of it, but this rank may still be
      // reading the victim's last message when the death arrives (the liveness watch, or a reset
      // connection, which discards what the socket had not yet delivered). Seen 1 in ~30 runs.
      const bool at_death = i == kDeathIteration || i == kDeathIteration - 1;
      const bool ok = expected_kind && at_death && death_ns > 0 && ms < 10000.0 && again && later_ms < 1000;
      return ok ? 0 : 1;
    }
  }
  std::printf("rank %d: no error although rank %d died\n", rank, victim);
  return 1;
}
