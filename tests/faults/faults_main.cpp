// The fault battery's main: plain doctest (the battery starts and kills its own processes, so it
// does not run under comm-run). Run one suite per CTest entry: fault_battery --test-suite=store.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <csignal>

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);  // a peer that dies mid-write must not kill the battery
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
