// A program for launcher_test to run under comm-run. The first argument picks what it does;
// all output goes through write(2) so nothing waits in a stdio buffer.
//
//   probe env                         print the launcher variables, one NAME=value per line
//   probe hello COUNT                 COUNT lines "hello world" written in two pieces, COUNT lines
//                                     "err line" on stderr, then "tail" with no newline
//   probe exit R CODE [DELAY_MS]      rank R exits with CODE after DELAY_MS; the others sleep 30 s
//   probe signal R SIG                rank R kills itself with signal SIG; the others sleep 30 s
//   probe ignore-term R CODE DIR      every rank ignores SIGTERM and prints "ready"; rank R exits
//                                     with CODE once all ranks are ready (files in DIR); the others
//                                     sleep 30 s. Without DIR, nobody exits by itself.
//   probe trap                        on SIGTERM/SIGINT/SIGHUP print "got SIG..." and exit 0;
//                                     prints "ready" first, then sleeps 30 s
//   probe grandchild R CODE DIR       every other rank forks a child that sleeps 30 s, writes its
//                                     pid to DIR/gc.RANK, prints "ready"; rank R exits with CODE
//                                     once all those files exist; the others sleep 30 s
//   probe pidfile DIR                 writes its pid to DIR/rank.RANK, prints "ready", sleeps 30 s
//   probe sleep MS                    sleeps MS and exits 0
//   probe restart R CODE FAILS MS     prints "START rank=.. restart=<COMM_RESTART_COUNT> t_ns=..";
//                                     rank R, while COMM_RESTART_COUNT (unset: 0) < FAILS, prints
//                                     "DYING t_ns=.." and exits with CODE (CODE < 0: kills itself
//                                     with signal -CODE); every process that does not die prints
//                                     "DONE" after MS (rank R: at once) and exits 0. t_ns: steady
//                                     clock, comparable across processes.

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <filesystem>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <string_view>

namespace {

void say(int fd, std::string_view s) {
  while (!s.empty()) {
    ssize_t n = ::write(fd, s.data(), s.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    s.remove_prefix(static_cast<std::size_t>(n));
  }
}

void sleep_ms(long ms) {
  timespec ts{ms / 1000, (ms % 1000) * 1'000'000L};
  while (::nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

int my_rank() {
  const char* r = std::getenv("RANK");
  return r != nullptr ? std::atoi(r) : -1;
}

int arg_int(int argc, char** argv, int i, int fallback) { return i < argc ? std::atoi(argv[i]) : fallback; }

void write_pid_file(const std::string& path, pid_t pid) {
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) std::exit(90);
  std::fprintf(f, "%d\n", static_cast<int>(pid));
  std::fclose(f);
  std::rename(tmp.c_str(), path.c_str());  // readers never see a half-written file
}

/// Waits (at most 10 s) until `count` files named `prefix`.* exist in `dir`.
void wait_for_files(const std::string& dir, const std::string& prefix, int count) {
  for (int waited = 0; waited < 10'000; waited += 5) {
    int found = 0;
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
      const std::string name = entry.path().filename().string();
      if (name.starts_with(prefix + ".") && !name.ends_with(".tmp")) ++found;
    }
    if (found >= count) return;
    sleep_ms(5);
  }
}

int world_size() {
  const char* w = std::getenv("WORLD_SIZE");
  return w != nullptr ? std::atoi(w) : 1;
}

extern "C" void on_signal(int sig) {
  const char* text = sig == SIGTERM ? "got SIGTERM\n" : sig == SIGINT ? "got SIGINT\n" : "got SIGHUP\n";
  say(STDOUT_FILENO, text);
  ::_exit(0);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string_view mode = argc > 1 ? argv[1] : "";
  const int rank = my_rank();

  if (mode == "env") {
    for (const char* name : {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                             "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "COMM_STORE_TOKEN", "COMM_AGENT_STORE",
                             "COMM_RESTART_COUNT", "COMM_JOB_ID"}) {
      const char* v = std::getenv(name);
      say(STDOUT_FILENO, std::string(name) + "=" + (v != nullptr ? v : "<unset>") + "\n");
    }
    return 0;
  }
  if (mode == "hello") {
    const int count = arg_int(argc, argv, 2, 10);
    for (int i = 0; i < count; ++i) {
      say(STDOUT_FILENO, "hello ");
      sleep_ms(2);  // let other ranks write in between the two halves
      say(STDOUT_FILENO, "world\n");
      say(STDERR_FILENO, "err line\n");
    }
    say(STDOUT_FILENO, "tail");
    return 0;
  }
  if (mode == "exit") {
    if (rank == arg_int(argc, argv, 2, 0)) {
      sleep_ms(arg_int(argc, argv, 4, 0));
      return arg_int(argc, argv, 3, 1);
    }
    sleep_ms(30'000);
    return 0;
  }
  if (mode == "signal") {
    if (rank == arg_int(argc, argv, 2, 0)) ::kill(::getpid(), arg_int(argc, argv, 3, SIGKILL));
    sleep_ms(30'000);
    return 0;
  }
  if (mode == "ignore-term") {
    ::signal(SIGTERM, SIG_IGN);
    say(STDOUT_FILENO, "ready\n");
    if (argc > 4) {
      write_pid_file(std::string(argv[4]) + "/ready." + std::to_string(rank), ::getpid());
      if (rank == arg_int(argc, argv, 2, 0)) {
        wait_for_files(argv[4], "ready", world_size());
        return arg_int(argc, argv, 3, 1);
      }
    }
    sleep_ms(30'000);
    return 0;
  }
  if (mode == "restart") {
    const char* count_env = std::getenv("COMM_RESTART_COUNT");
    const int count = count_env != nullptr ? std::atoi(count_env) : 0;
    auto t_ns = [] {
      return std::to_string(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                std::chrono::steady_clock::now().time_since_epoch())
                                .count());
    };
    say(STDOUT_FILENO, "START rank=" + std::to_string(rank) + " restart=" + (count_env != nullptr ? count_env : "unset") +
                           " t_ns=" + t_ns() + "\n");
    const int victim = arg_int(argc, argv, 2, 0);
    const int code = arg_int(argc, argv, 3, 1);
    if (rank == victim && count < arg_int(argc, argv, 4, 1)) {
      say(STDOUT_FILENO, "DYING t_ns=" + t_ns() + "\n");
      if (code < 0) ::kill(::getpid(), -code);
      return code;
    }
    if (rank != victim) sleep_ms(arg_int(argc, argv, 5, 0));
    say(STDOUT_FILENO, "DONE\n");
    return 0;
  }
  if (mode == "trap") {
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    for (int s : {SIGTERM, SIGINT, SIGHUP}) ::sigaction(s, &sa, nullptr);
    say(STDOUT_FILENO, "ready\n");
    sleep_ms(30'000);
    return 0;
  }
  if (mode == "grandchild") {
    const std::string dir = argc > 4 ? argv[4] : ".";
    if (rank == arg_int(argc, argv, 2, 0)) {
      wait_for_files(dir, "gc", world_size() - 1);
      return arg_int(argc, argv, 3, 1);
    }
    const pid_t child = ::fork();
    if (child == 0) {
      sleep_ms(30'000);
      ::_exit(0);
    }
    write_pid_file(dir + "/gc." + std::to_string(rank), child);
    say(STDOUT_FILENO, "ready\n");
    sleep_ms(30'000);
    return 0;
  }
  if (mode == "pidfile") {
    const std::string dir = argc > 2 ? argv[2] : ".";
    write_pid_file(dir + "/rank." + std::to_string(rank), ::getpid());
    say(STDOUT_FILENO, "ready\n");
    sleep_ms(30'000);
    return 0;
  }
  if (mode == "sleep") {
    sleep_ms(arg_int(argc, argv, 2, 0));
    return 0;
  }
  say(STDERR_FILENO, "probe: unknown mode '" + std::string(mode) + "'\n");
  return 99;
}
