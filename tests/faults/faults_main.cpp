// The fault battery's main: plain doctest (the battery starts and kills its own processes, so it
// does not run under comm-run). Run one suite per CTest entry: fault_battery --test-suite=store;
// the suite "backend" on one backend of the list: --test-suite=backend --fault-backend=<name>.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <csignal>
#include <cstring>

#include "battery.hpp"

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);  // a peer that dies mid-write must not kill the battery
  constexpr const char* opt = "--fault-backend=";
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], opt, std::strlen(opt)) == 0) comm::faults::fault_backend_setting() = argv[i] + std::strlen(opt);
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
