// Tests of comm-run: runs the built launcher on tests/launcher/probe.cpp and checks the
// environment contract, output prefixing, exit codes, kill-on-failure, signal forwarding,
// argument validation and --timeout; the store comm-run hosts (it outlives rank 0, and refuses a
// stranger), and --max-restarts. Every launch has a hard time limit, so nothing can hang.

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <comm/init.hpp>
#include <comm/store.hpp>

#include <algorithm>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#ifndef COMM_RUN_PATH
#error "COMM_RUN_PATH must name the comm-run executable"
#endif
#ifndef PROBE_PATH
#error "PROBE_PATH must name the probe executable"
#endif
#ifndef STORE_PROBE_PATH
#error "STORE_PROBE_PATH must name the store probe executable"
#endif

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct Result {
  int code = -1;         // exit code, or 128 + signal when comm-run itself died by a signal
  bool timed_out = false;  // the hard limit was hit and comm-run was SIGKILLed
  std::string out, err;
  double seconds = 0;
};

/// One run of comm-run with its stdout and stderr captured.
class Launch {
 public:
  explicit Launch(std::vector<std::string> args, std::map<std::string, std::string> env = {}) {
    args.insert(args.begin(), COMM_RUN_PATH);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    // A hermetic environment: nothing a surrounding job set leaks into the one under test.
    std::vector<std::string> envs;
    for (char** e = environ; *e != nullptr; ++e) {
      std::string_view kv = *e;
      const std::string key(kv.substr(0, kv.find('=')));
      if (key == "COMM_STORE_TOKEN" || key == "RANK" || key == "WORLD_SIZE" || key == "MASTER_ADDR" ||
          key == "MASTER_PORT" || key == "COMM_AGENT_STORE" || key == "COMM_RESTART_COUNT" || key == "COMM_DEBUG" ||
          env.count(key) != 0)
        continue;
      envs.emplace_back(kv);
    }
    for (auto& [k, v] : env) envs.push_back(k + "=" + v);
    std::vector<char*> envp;
    for (auto& kv : envs) envp.push_back(kv.data());
    envp.push_back(nullptr);

    int out[2], err[2];
    REQUIRE(::pipe2(out, O_CLOEXEC) == 0);
    REQUIRE(::pipe2(err, O_CLOEXEC) == 0);
    start_ = Clock::now();
    pid_ = ::fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      int devnull = ::open("/dev/null", O_RDONLY);
      ::dup2(devnull, 0);
      ::dup2(out[1], 1);
      ::dup2(err[1], 2);
      ::execve(argv[0], argv.data(), envp.data());
      ::_exit(126);
    }
    ::close(out[1]);
    ::close(err[1]);
    out_fd_ = out[0];
    err_fd_ = err[0];
  }
  Launch(const Launch&) = delete;
  Launch& operator=(const Launch&) = delete;

  ~Launch() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    for (int fd : {out_fd_, err_fd_})
      if (fd >= 0) ::close(fd);
  }

  pid_t pid() const { return pid_; }

  /// Reads output until `done(stdout)` holds; false when `limit_s` passes first.
  bool wait_stdout(const std::function<bool(const std::string&)>& done, double limit_s) {
    const auto start = Clock::now();
    while (!done(res_.out)) {
      if (seconds_since(start) > limit_s) return false;
      if (!pump(20) && out_fd_ < 0) return done(res_.out);
    }
    return true;
  }

  /// Waits for comm-run to exit (SIGKILLing it after `limit_s`) and returns what it did.
  Result finish(double limit_s = 15) {
    int status = 0;
    for (;;) {
      pump(20);
      const pid_t p = ::waitpid(pid_, &status, WNOHANG);
      if (p == pid_) break;
      if (seconds_since(start_) > limit_s) {
        res_.timed_out = true;
        ::kill(pid_, SIGKILL);  // its ranks die too (PR_SET_PDEATHSIG)
        ::waitpid(pid_, &status, 0);
        break;
      }
    }
    reaped_ = true;
    res_.seconds = seconds_since(start_);
    // Whatever is left in the pipes; a leftover grandchild must not make us wait.
    const auto drain_start = Clock::now();
    while ((out_fd_ >= 0 || err_fd_ >= 0) && seconds_since(drain_start) < 1.0) pump(20);
    res_.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return res_;
  }

 private:
  /// One poll over both pipes; false when nothing came within `ms`.
  bool pump(int ms) {
    pollfd fds[2] = {{out_fd_, POLLIN, 0}, {err_fd_, POLLIN, 0}};
    if (::poll(fds, 2, ms) <= 0) return false;
    for (int k = 0; k < 2; ++k) {
      if (fds[k].revents == 0) continue;
      int& fd = k == 0 ? out_fd_ : err_fd_;
      char buf[4096];
      ssize_t n = ::read(fd, buf, sizeof buf);
      if (n > 0) {
        (k == 0 ? res_.out : res_.err).append(buf, static_cast<std::size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        ::close(fd);
        fd = -1;
      }
    }
    return true;
  }

  pid_t pid_ = -1;
  bool reaped_ = false;
  int out_fd_ = -1, err_fd_ = -1;
  Clock::time_point start_;
  Result res_;
};

Result run(std::vector<std::string> args, std::map<std::string, std::string> env = {}, double limit_s = 15) {
  Launch l(std::move(args), std::move(env));
  return l.finish(limit_s);
}

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> v;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) v.push_back(line);
  return v;
}

bool contains(const std::string& hay, std::string_view needle) { return hay.find(needle) != std::string::npos; }

std::size_t count_of(const std::string& hay, std::string_view needle) {
  std::size_t n = 0;
  for (auto p = hay.find(needle); p != std::string::npos; p = hay.find(needle, p + 1)) ++n;
  return n;
}

/// "[r] NAME=value" lines → per-rank maps.
std::map<int, std::map<std::string, std::string>> parse_env(const std::string& out) {
  std::map<int, std::map<std::string, std::string>> by_rank;
  for (const auto& line : lines(out)) {
    REQUIRE_MESSAGE(line.starts_with('['), line);
    const auto close = line.find("] ");
    REQUIRE(close != std::string::npos);
    const int rank = std::stoi(line.substr(1, close - 1));
    const auto kv = line.substr(close + 2);
    const auto eq = kv.find('=');
    REQUIRE(eq != std::string::npos);
    by_rank[rank][kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return by_rank;
}

bool is_hex(const std::string& s) {
  return !s.empty() && s.find_first_not_of("0123456789abcdef") == std::string::npos;
}

/// True when `pid` is gone (or a zombie nobody has reaped yet).
bool process_gone(pid_t pid) {
  if (::kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string content((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto paren = content.rfind(')');
  return paren == std::string::npos || (paren + 2 < content.size() && content[paren + 2] == 'Z');
}

bool wait_gone(pid_t pid, double limit_s) {
  const auto start = Clock::now();
  while (!process_gone(pid)) {
    if (seconds_since(start) > limit_s) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

pid_t read_pid(const fs::path& file) {
  std::ifstream in(file);
  int pid = -1;
  in >> pid;
  return pid;
}

struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "comm-run-test-XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

const std::string probe = PROBE_PATH;
const std::string store_probe = STORE_PROBE_PATH;

/// The value of `key` in "key=value" fields of the first line of `out` holding `marker`.
std::string field_of(const std::string& out, std::string_view marker, const std::string& key) {
  for (const auto& line : lines(out)) {
    if (!contains(line, marker)) continue;
    const auto at = line.find(" " + key + "=");
    if (at == std::string::npos) return {};
    const auto from = at + key.size() + 2;
    return line.substr(from, line.find(' ', from) - from);
  }
  return {};
}

/// The t_ns= values of rank `rank`'s lines holding `marker`, in order.
std::vector<long long> times_of(const std::string& out, int rank, std::string_view marker) {
  std::vector<long long> v;
  const std::string prefix = "[" + std::to_string(rank) + "] ";
  for (const auto& line : lines(out)) {
    if (!line.starts_with(prefix) || !contains(line, marker)) continue;
    const auto at = line.find("t_ns=");
    if (at != std::string::npos) v.push_back(std::stoll(line.substr(at + 5)));
  }
  return v;
}

}  // namespace

TEST_CASE("environment contract for -n 1..4") {
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    const Result r = run({"-n", std::to_string(n), probe, "env"});
    CHECK(r.code == 0);
    CHECK(r.seconds < 10);
    CHECK_MESSAGE(r.err.empty(), r.err);
    auto env = parse_env(r.out);
    REQUIRE(env.size() == static_cast<std::size_t>(n));
    const std::string port = env[0]["MASTER_PORT"];
    const std::string token = env[0]["COMM_STORE_TOKEN"];
    CHECK(std::stoi(port) > 0);
    CHECK(std::stoi(port) < 65536);
    CHECK(token.size() == 32);
    CHECK(is_hex(token));
    for (int rank = 0; rank < n; ++rank) {
      CAPTURE(rank);
      auto& e = env[rank];
      CHECK(e["RANK"] == std::to_string(rank));
      CHECK(e["LOCAL_RANK"] == std::to_string(rank));
      CHECK(e["WORLD_SIZE"] == std::to_string(n));
      CHECK(e["LOCAL_WORLD_SIZE"] == std::to_string(n));
      CHECK(e["GROUP_RANK"] == "0");
      CHECK(e["NODE_RANK"] == "0");
      CHECK(e["GROUP_WORLD_SIZE"] == "1");
      CHECK(e["MASTER_ADDR"] == "127.0.0.1");
      CHECK(e["MASTER_PORT"] == port);
      CHECK(e["COMM_STORE_TOKEN"] == token);
      CHECK(e["COMM_AGENT_STORE"] == "1");
      CHECK(e["COMM_RESTART_COUNT"] == "<unset>");
    }
  }
}

TEST_CASE("environment contract for --nnodes 2 --node-rank 1") {
  const std::map<std::string, std::string> env{{"COMM_STORE_TOKEN", "0123abcd"}};
  SUBCASE("separate values") {
    const Result r = run({"--nnodes", "2", "--node-rank", "1", "-n", "3", "--master-addr", "127.0.0.1",
                          "--master-port", "29513", probe, "env"},
                         env);
    CHECK(r.code == 0);
    auto e = parse_env(r.out);
    REQUIRE(e.size() == 3);
    for (int local = 0; local < 3; ++local) {
      const int rank = 3 + local;
      CAPTURE(rank);
      REQUIRE(e.count(rank) == 1);
      CHECK(e[rank]["RANK"] == std::to_string(rank));
      CHECK(e[rank]["LOCAL_RANK"] == std::to_string(local));
      CHECK(e[rank]["WORLD_SIZE"] == "6");
      CHECK(e[rank]["LOCAL_WORLD_SIZE"] == "3");
      CHECK(e[rank]["GROUP_RANK"] == "1");
      CHECK(e[rank]["NODE_RANK"] == "1");
      CHECK(e[rank]["GROUP_WORLD_SIZE"] == "2");
      CHECK(e[rank]["MASTER_ADDR"] == "127.0.0.1");
      CHECK(e[rank]["MASTER_PORT"] == "29513");
      CHECK(e[rank]["COMM_STORE_TOKEN"] == "0123abcd");
      CHECK(e[rank]["COMM_AGENT_STORE"] == "1");  // node 0's launcher hosts it
    }
  }
  SUBCASE("--flag=value forms, --nproc-per-node and --") {
    const Result r = run({"--nnodes=2", "--node-rank=1", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                          "--master-port=29514", "--", probe, "env"},
                         env);
    CHECK(r.code == 0);
    auto e = parse_env(r.out);
    REQUIRE(e.size() == 2);
    CHECK(e[2]["RANK"] == "2");
    CHECK(e[3]["LOCAL_RANK"] == "1");
    CHECK(e[3]["WORLD_SIZE"] == "4");
    CHECK(e[3]["MASTER_PORT"] == "29514");
  }
}

TEST_CASE("store token: fresh per job unless set") {
  const Result a = run({"-n", "1", probe, "env"});
  const Result b = run({"-n", "1", probe, "env"});
  auto ea = parse_env(a.out);
  auto eb = parse_env(b.out);
  CHECK(ea[0]["COMM_STORE_TOKEN"] != eb[0]["COMM_STORE_TOKEN"]);
  const Result c = run({"-n", "2", probe, "env"}, {{"COMM_STORE_TOKEN", "feedface"}});
  auto ec = parse_env(c.out);
  CHECK(ec[0]["COMM_STORE_TOKEN"] == "feedface");
  CHECK(ec[1]["COMM_STORE_TOKEN"] == "feedface");
  // Several nodes need one token: comm-run refuses to invent a different one on each node.
  const Result d = run({"--nnodes", "2", "--node-rank", "0", "--master-port", "29515", probe, "env"});
  CHECK(d.code == 2);
  CHECK(contains(d.err, "COMM_STORE_TOKEN"));
}

TEST_CASE("output lines are prefixed with the rank and never mixed") {
  const int count = 20;
  const Result r = run({"-n", "3", probe, "hello", std::to_string(count)});
  CHECK(r.code == 0);
  CHECK(r.seconds < 10);
  std::map<std::string, int> seen;
  for (const auto& line : lines(r.out)) seen[line]++;
  for (int rank = 0; rank < 3; ++rank) {
    const std::string p = "[" + std::to_string(rank) + "] ";
    CHECK(seen[p + "hello world"] == count);
    CHECK(seen[p + "tail"] == 1);  // the last line without a newline, completed at exit
    CHECK(count_of(r.err, p + "err line\n") == static_cast<std::size_t>(count));
  }
  CHECK(seen.size() == 6);  // nothing else: no line made of pieces of two ranks
  CHECK(lines(r.err).size() == static_cast<std::size_t>(3 * count));
  CHECK(r.out.ends_with('\n'));

  SUBCASE("--no-prefix") {
    const Result q = run({"--no-prefix", "-n", "2", probe, "hello", "3"});
    CHECK(q.code == 0);
    CHECK(count_of(q.out, "hello world\n") == 6);
    CHECK(count_of(q.out, "tail\n") == 2);
    CHECK(!contains(q.out, "["));
  }
}

TEST_CASE("all ranks succeed: exit 0") {
  const Result r = run({"-n", "4", probe, "sleep", "100"});
  CHECK(r.code == 0);
  CHECK(r.err.empty());
  CHECK(r.seconds < 10);
}

TEST_CASE("the first failing rank's code is the job's, and the others are stopped") {
  // Ranks 0 and 2 sleep 30 s: they must be terminated at once, not waited for.
  const Result r = run({"-n", "3", probe, "exit", "1", "7"});
  CHECK(r.code == 7);
  CHECK(r.seconds < 4);
  CHECK_MESSAGE(contains(r.err, "comm-run: rank 1 exited with code 7"), r.err);
  // Ranks the launcher terminated are not reported as the cause.
  CHECK(!contains(r.err, "rank 0 exited"));
  CHECK(!contains(r.err, "rank 2 exited"));
  CHECK(!contains(r.err, "rank 0 was killed"));
  CHECK(!contains(r.err, "rank 2 was killed"));
}

TEST_CASE("a rank killed by a signal: 128 + signo and the signal's name") {
  const Result r = run({"-n", "2", probe, "signal", "1", std::to_string(SIGKILL)});
  CHECK(r.code == 128 + SIGKILL);
  CHECK(r.seconds < 4);
  CHECK_MESSAGE(contains(r.err, "comm-run: rank 1 was killed by signal SIGKILL"), r.err);
  CHECK(!contains(r.err, "rank 0 "));
}

TEST_CASE("a rank ignoring SIGTERM gets SIGKILL after the grace period") {
  // Rank 0 fails once every rank has set SIGTERM to ignored; rank 1 ignores the SIGTERM and
  // sleeps, so only the SIGKILL after --grace-period 1 ends it.
  TempDir dir;
  const Result r = run({"--grace-period", "1", "-n", "2", probe, "ignore-term", "0", "5", dir.path.string()});
  CHECK(r.code == 5);
  CHECK(r.seconds >= 1.0);
  CHECK(r.seconds < 5);
  CHECK_MESSAGE(contains(r.err, "comm-run: rank 0 exited with code 5"), r.err);
  CHECK(!contains(r.err, "rank 1 exited"));
  CHECK(!contains(r.err, "rank 1 was killed"));
}

TEST_CASE("a failing job takes the ranks' own child processes with it") {
  TempDir dir;
  const Result r = run({"-n", "3", probe, "grandchild", "1", "4", dir.path.string()});
  CHECK(r.code == 4);
  CHECK(r.seconds < 5);
  CHECK_MESSAGE(contains(r.err, "comm-run: rank 1 exited with code 4"), r.err);
  for (int rank : {0, 2}) {
    CAPTURE(rank);
    const pid_t gc = read_pid(dir.path / ("gc." + std::to_string(rank)));
    REQUIRE(gc > 0);
    CHECK(wait_gone(gc, 3));
  }
}

TEST_CASE("SIGTERM, SIGINT and SIGHUP sent to comm-run reach every rank") {
  for (int sig : {SIGTERM, SIGINT, SIGHUP}) {
    CAPTURE(sig);
    Launch l({"-n", "3", probe, "trap"});
    REQUIRE(l.wait_stdout([](const std::string& out) { return count_of(out, "ready\n") == 3; }, 10));
    const auto sent = Clock::now();
    ::kill(l.pid(), sig);
    const Result r = l.finish();
    CHECK(r.code == 128 + sig);
    CHECK(seconds_since(sent) < 4);
    const std::string name = sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : "SIGHUP";
    for (int rank = 0; rank < 3; ++rank) CHECK(contains(r.out, "[" + std::to_string(rank) + "] got " + name + "\n"));
    CHECK(contains(r.err, name));
    CHECK(!contains(r.err, "exited with code"));
  }
}

TEST_CASE("a second SIGINT kills ranks that ignore the first") {
  Launch l({"--grace-period", "20", "-n", "2", probe, "ignore-term", "9", "0"});
  REQUIRE(l.wait_stdout([](const std::string& out) { return count_of(out, "ready\n") == 2; }, 10));
  ::kill(l.pid(), SIGTERM);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ::kill(l.pid(), SIGTERM);
  const Result r = l.finish();
  CHECK(r.code == 128 + SIGTERM);
  CHECK(r.seconds < 6);
  CHECK(contains(r.err, "again"));
}

TEST_CASE("ranks die with a SIGKILLed launcher") {
  TempDir dir;
  Launch l({"-n", "2", probe, "pidfile", dir.path.string()});
  REQUIRE(l.wait_stdout([](const std::string& out) { return count_of(out, "ready\n") == 2; }, 10));
  std::vector<pid_t> pids;
  for (int rank = 0; rank < 2; ++rank) pids.push_back(read_pid(dir.path / ("rank." + std::to_string(rank))));
  ::kill(l.pid(), SIGKILL);
  const Result r = l.finish();
  CHECK(r.code == 128 + SIGKILL);
  for (pid_t p : pids) {
    REQUIRE(p > 0);
    CHECK(wait_gone(p, 3));
  }
}

TEST_CASE("--timeout stops the job with exit code 124") {
  const Result r = run({"--timeout", "1", "-n", "2", probe, "exit", "9", "0"});  // nobody exits by itself
  CHECK(r.code == 124);
  CHECK(r.seconds >= 0.9);
  CHECK(r.seconds < 4);
  CHECK_MESSAGE(contains(r.err, "timeout"), r.err);
  CHECK(!contains(r.err, "exited with code"));
}

TEST_CASE("bad arguments: a clear message and exit code 2") {
  struct Case {
    std::vector<std::string> args;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{"-n", "abc", probe, "env"}, "got 'abc'"},
      {{"-n", "0", probe, "env"}, "got '0'"},
      {{"-n", "-1", probe, "env"}, "got '-1'"},
      {{"-n=2x", probe, "env"}, "got '2x'"},
      {{"-n"}, "needs a value"},
      {{"-n", "2"}, "no program"},
      {{}, "no program"},
      {{"--nnodes", "2", "--node-rank", "2", "--master-port", "29516", probe, "env"}, "--node-rank"},
      {{"--nnodes", "0", probe, "env"}, "--nnodes"},
      {{"--node-rank", "-1", probe, "env"}, "--node-rank"},
      {{"--master-port", "70000", probe, "env"}, "--master-port"},
      {{"--master-port", "0", probe, "env"}, "--master-port"},
      {{"--master-port=http", probe, "env"}, "--master-port"},
      {{"--nnodes", "2", "--node-rank", "1", probe, "env"}, "--master-port is required"},
      {{"--grace-period", "soon", probe, "env"}, "--grace-period"},
      {{"--timeout", "0", probe, "env"}, "--timeout"},
      {{"--timeout", "-3", probe, "env"}, "--timeout"},
      // The library's syntax (comm/detail/base/duration.hpp): no exponents, no inf, one '.'.
      {{"--timeout", "1e3", probe, "env"}, "--timeout"},
      {{"--timeout=inf", probe, "env"}, "--timeout"},
      {{"--grace-period", "1.5.2", probe, "env"}, "--grace-period"},
      {{"--bogus", probe, "env"}, "unknown option '--bogus'"},
      {{"--max-restarts", "-1", probe, "env"}, "--max-restarts"},
      {{"--max-restarts", "two", probe, "env"}, "--max-restarts"},
      {{"--max_restarts=1x", probe, "env"}, "--max-restarts"},
      // CLI11 finds the option, comm-run checks the value: the same messages for every spelling.
      {{"--nproc_per_node=abc", probe, "env"}, "got 'abc'"},
      {{"--nproc-per-node", "2.5", probe, "env"}, "got '2.5'"},
      {{"--master_port"}, "option '--master-port' needs a value"},
      {{"--node_rank=x", probe, "env"}, "--node-rank"},
      {{"--no-prefix=1", probe, "env"}, "no-prefix"},
      {{"-n", "2", "--bogus=3", probe, "env"}, "unknown option '--bogus=3'"},
      {{"-5", probe, "env"}, "unknown option '-5'"},
      // torchrun's spellings comm-run cannot honour: refused, saying why.
      {{"--nnodes", "1:4", probe, "env"}, "MIN:MAX) is not supported"},
      {{"--nnodes=0:0", probe, "env"}, "--nnodes"},
      {{"-m", "pkg.train"}, "-m/--module (torchrun's) is not supported"},
      {{"--run_path", probe}, "--run-path/--run_path (torchrun's) is not supported"},
      {{"--rdzv-conf", "timeout=5", probe, "env"}, "--rdzv-conf/--rdzv_conf (torchrun's) is not supported"},
      {{"--local_addr", "10.0.0.2", probe, "env"}, "is not supported"},
      {{"--rdzv-backend", "etcd", probe, "env"}, "--rdzv-backend etcd is not supported"},
      {{"--rdzv-backend=c10d", "--nnodes", "2", "--master-port", "29516", probe, "env"}, "needs --node-rank"},
      {{"--rdzv-endpoint", "127.0.0.1:29519", "--master-port", "29519", probe, "env"}, "not both"},
      {{"--rdzv-endpoint", "127.0.0.1:99999", probe, "env"}, "--rdzv-endpoint's port"},
      {{"--rdzv-endpoint", ":29519", probe, "env"}, "HOST[:PORT]"},
      {{"--rdzv-id=", probe, "env"}, "--rdzv-id must not be empty"},
      {{"--standalone", "--nnodes", "2", probe, "env"}, "--standalone is one node"},
      {{"--standalone", "--node_rank=1", "--nnodes=2", probe, "env"}, "--standalone is one node"},
      {{"--standalone", "--master-port", "29516", probe, "env"}, "drop --master-port"},
      {{"--standalone", "--master_addr=127.0.0.1", probe, "env"}, "drop --master-addr"},
      {{"--nproc_per_node", "0", probe, "env"}, "got '0'"},
      // Output options.
      {{"--log-dir=", probe, "env"}, "--log-dir must not be empty"},
      {{"--log-dir", "/tmp", "--tee", "4", probe, "env"}, "--tee must be 0 (none), 1 (stdout), 2 (stderr) or 3 (both), got '4'"},
      {{"-t", "x", probe, "env"}, "--tee must be"},
      {{"--tee", "0:1,1:2", probe, "env"}, "a value per local rank"},
      {{"-r", "-1", probe, "env"}, "--redirects must be"},
      {{"-n", "2", "--local-ranks-filter", "2", probe, "env"}, "local rank 2 is not in 0..1"},
      {{"-n", "2", "--local-ranks-filter", "0,x", probe, "env"}, "'x' is not a rank or a range"},
      {{"-n", "4", "--local_ranks_filter=3-1", probe, "env"}, "the range '3-1' is empty"},
      {{"-n", "4", "--local-ranks-filter", "", probe, "env"}, "--local-ranks-filter must list local ranks"},
      {{"-n", "4", "--local-ranks-filter", "-1", probe, "env"}, "local rank -1 is not in 0..3"},
  };
  for (const auto& c : cases) {
    std::string joined;
    for (const auto& a : c.args) joined += a + " ";
    CAPTURE(joined);
    const Result r = run(c.args);
    CHECK(r.code == 2);
    CHECK(r.seconds < 4);
    CHECK_MESSAGE(contains(r.err, c.says), r.err);
    CHECK(r.out.empty());
  }
}

TEST_CASE("--help") {
  for (const char* flag : {"--help", "-h"}) {
    CAPTURE(flag);
    const Result r = run({flag});
    CHECK(r.code == 0);
    CHECK(r.err.empty());
    CHECK(r.out.starts_with("Starts N processes"));
    CHECK(contains(r.out, "Usage: comm-run [OPTIONS] [--] program [args...]"));
    CHECK(contains(r.out, "--nproc-per-node"));
    CHECK(contains(r.out, "--nproc_per_node"));
    CHECK(contains(r.out, "--max-restarts,--max_restarts N"));
    CHECK(contains(r.out, "--standalone"));
    CHECK(contains(r.out, "--log-dir,--log_dir DIR"));
    CHECK(contains(r.out, "-t,--tee 0-3"));
    CHECK(contains(r.out, "--local-ranks-filter"));
    CHECK(contains(r.out, "--rdzv-endpoint"));
    CHECK(contains(r.out, "COMM_RESTART_COUNT"));
    CHECK(contains(r.out, "COMM_AGENT_STORE"));
    CHECK(contains(r.out, "\nExamples:\n  comm-run -n 4 ./train"));
    CHECK(!contains(r.out, "--rdzv-conf"));  // refused torchrun options are not advertised
  }
}

TEST_CASE("--version prints the project's version") {
  const Result r = run({"--version"});
  CHECK(r.code == 0);
  CHECK(r.out == std::string("comm-run ") + COMM_PROJECT_VERSION + "\n");
  CHECK(r.err.empty());
  // Options after the program are the program's: comm-run's --version is not taken from there.
  const Result p = run({"-n", "1", probe, "env", "--version"});
  CHECK(p.code == 0);
  CHECK(contains(p.out, "[0] RANK=0"));
}

TEST_CASE("a program that cannot be found is reported") {
  for (std::string prog : {"/nonexistent/comm-run-test-prog", "comm-run-test-no-such-program"}) {
    CAPTURE(prog);
    const Result r = run({"-n", "2", prog, "arg"});
    CHECK(r.code == 127);
    CHECK(r.seconds < 4);
    CHECK_MESSAGE(contains(r.err, "cannot run '" + prog + "'"), r.err);
    CHECK(contains(r.err, std::strerror(ENOENT)));
  }
  TempDir dir;  // a file without execute permission: 126
  const auto file = dir.path / "not-executable";
  std::ofstream(file) << "#!/bin/sh\n";
  const Result r = run({"-n", "1", file.string()});
  CHECK(r.code == 126);
  CHECK(contains(r.err, std::strerror(EACCES)));
}

// ---------------------------------------------------------------------------------------------
// The store comm-run hosts

TEST_CASE("the launcher hosts the store unless --no-agent-store") {
  auto e = parse_env(run({"-n", "2", "--no-agent-store", probe, "env"}).out);
  REQUIRE(e.size() == 2);
  CHECK(e[0]["COMM_AGENT_STORE"] == "<unset>");
  CHECK(e[1]["COMM_AGENT_STORE"] == "<unset>");
  // The port comm-run hosts the store on is taken for the job's life: another launcher given the
  // same port cannot host there and says so.
  const std::string port = "29517";
  TempDir dir;
  Launch holder({"-n", "1", "--master-port", port, probe, "pidfile", dir.path.string()});
  // Its rank runs: the store was bound before.
  REQUIRE(holder.wait_stdout([](const std::string& out) { return contains(out, "ready\n"); }, 10));
  const Result second = run({"-n", "1", "--master-port", port, probe, "env"});
  CHECK(second.code == 1);
  CHECK_MESSAGE(contains(second.err, "cannot host the job's store"), second.err);
  ::kill(holder.pid(), SIGTERM);
  CHECK(holder.finish().code == 128 + SIGTERM);
}

TEST_CASE("rank 0 SIGKILLed: the others see it within ms, and the store stays up for them") {
  const std::map<std::string, std::string> env{{"COMM_TIMEOUT", "20s"}};
  const Result r = run({"-n", "3", "--max-restarts", "1", store_probe, "survive"}, env, 40);
  INFO(r.out);
  INFO(r.err);
  CHECK(r.code == 0);
  const auto died = times_of(r.out, 0, "DYING");
  REQUIRE(died.size() == 1);
  for (int rank : {1, 2}) {
    CAPTURE(rank);
    CHECK(contains(r.out, "[" + std::to_string(rank) + "] DEAD rank=0 "));
    CHECK(contains(r.out, "[" + std::to_string(rank) + "] STORE OK"));
    const auto seen = times_of(r.out, rank, "DEAD rank=0");
    REQUIRE(seen.size() == 1);
    const double ms = static_cast<double>(seen[0] - died[0]) / 1e6;
    MESSAGE("rank " << rank << " saw rank 0's death after " << ms << " ms");
    CHECK(ms < 1000);
  }
  CHECK(contains(r.out, "[0] REPLACEMENT restart=1"));
  CHECK(contains(r.err, "rank 0 was killed by signal SIGKILL; restarting it (restart 1 of 1)"));

  // The same job with rank 0 hosting the store: its death takes the store with it, and the job fails.
  const Result old = run({"-n", "3", "--max-restarts", "1", "--no-agent-store", store_probe, "survive"}, env, 40);
  CHECK_MESSAGE(old.code != 0, std::string(old.out + old.err));
  CHECK(!contains(old.out, "STORE OK"));
}

TEST_CASE("a stranger without the job's token is refused and logged; the members see nothing") {
  ::unsetenv("COMM_STORE_TOKEN");  // the stranger's "no token" must really be none
  const std::string token = "0123456789abcdef0123456789abcdef";
  Launch job({"-n", "2", store_probe, "members"},
             {{"COMM_STORE_TOKEN", token}, {"COMM_DEBUG", "WARN"}, {"COMM_TIMEOUT", "20s"}});
  std::string out;
  REQUIRE(job.wait_stdout(
      [&](const std::string& o) {
        out = o;
        return contains(o, "[0] JOB port=") && o.find('\n', o.find("[0] JOB port=")) != std::string::npos;
      },
      15));
  const int port = std::stoi(field_of(out, "[0] JOB", "port"));
  const std::string job_id = field_of(out, "[0] JOB", "job");
  REQUIRE(port > 0);
  REQUIRE(!job_id.empty());

  auto options = [&](std::string t) {
    comm::TcpStoreOptions o;
    o.token = std::move(t);
    o.job_id = job_id;  // job ids are not secret: the stranger gets as far as the token check
    o.timeout = std::chrono::seconds(3);
    o.rank = 0;  // it claims to be rank 0
    return o;
  };
  // A wrong token and no token: refused at connect, before any set/get/add.
  for (const std::string& t : {std::string("not-the-token"), std::string()}) {
    CAPTURE(t);
    CHECK_THROWS_AS(
        {
          comm::TcpStore stranger("127.0.0.1", static_cast<std::uint16_t>(port), options(t));
          stranger.set(t.empty() ? "stranger-none" : "stranger", "x");
        },
        comm::Error);
  }
  // A raw stranger that sends its requests right behind a wrong hello: the server answers the
  // hello with a refusal and closes; the set and add are never applied.
  {
    namespace sp = comm::detail::store_proto;
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd >= 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    auto buf = sp::encode_hello("guess", 1, job_id);
    for (auto op : {sp::Op::set, sp::Op::add}) {
      const auto at = sp::begin_frame(buf);
      sp::Writer w(buf);
      w.u8(static_cast<std::uint8_t>(op));
      w.str("stranger-raw");
      if (op == sp::Op::set)
        w.str("x");
      else
        w.i64(1);
      sp::finish_frame(buf, at);
    }
    REQUIRE(::send(fd, buf.data(), buf.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(buf.size()));
    std::vector<std::uint8_t> got;
    timeval tv{5, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    std::uint8_t chunk[512];
    for (ssize_t n; (n = ::recv(fd, chunk, sizeof chunk, 0)) > 0;) got.insert(got.end(), chunk, chunk + n);
    ::close(fd);
    REQUIRE(got.size() >= sp::hello_reply_size);
    sp::Reader rd(got);
    CHECK(rd.u32() == sp::magic);
    (void)rd.u16();
    CHECK(rd.u8() == static_cast<std::uint8_t>(sp::HelloStatus::wrong_token));
    const std::size_t msg = rd.u16();
    CHECK(got.size() == sp::hello_reply_size + msg);  // the refusal and nothing else
  }
  // The job's own client (the right token) lets the members go on.
  {
    comm::TcpStore member("127.0.0.1", static_cast<std::uint16_t>(port), options(token));
    CHECK(!member.check("stranger"));
    CHECK(!member.check("stranger-raw"));
    member.set("go", "1");
  }
  const Result r = job.finish(30);
  INFO(r.out);
  INFO(r.err);
  CHECK(r.code == 0);
  CHECK(contains(r.out, "[0] MEMBER OK"));
  CHECK(contains(r.out, "[1] MEMBER OK"));
  // One WARN line per refused connection, from comm-run's store, naming the peer.
  CHECK(count_of(r.err, "store server refused a connection from 127.0.0.1:") == 3);
  CHECK(count_of(r.err, ": no token") == 1);
  CHECK(count_of(r.err, ": a wrong token") == 2);
}

// ---------------------------------------------------------------------------------------------
// --max-restarts

TEST_CASE("--max-restarts: a failed rank is restarted alone with COMM_RESTART_COUNT; the job ends 0") {
  struct Case {
    std::vector<std::string> flag;
    std::string code;  // probe's CODE: an exit code, or -signal
    std::string said;
  };
  for (const Case& c : {Case{{"--max-restarts", "2"}, "5", "rank 1 exited with code 5; restarting it (restart 1 of 2)"},
                        Case{{"--max_restarts=3"}, "-9", "rank 1 was killed by signal SIGKILL; restarting it (restart 1 of 3)"}}) {
    CAPTURE(c.said);
    std::vector<std::string> args = c.flag;
    for (const std::string& a : {std::string("-n"), std::string("3"), probe, std::string("restart"), std::string("1"),
                                 c.code, std::string("1"), std::string("1500")})
      args.push_back(a);
    const Result r = run(args);
    INFO(r.out);
    INFO(r.err);
    CHECK(r.code == 0);
    CHECK(contains(r.err, c.said));
    CHECK(count_of(r.err, "restarting it") == 1);
    CHECK(count_of(r.out, "[1] START rank=1 restart=unset") == 1);
    CHECK(count_of(r.out, "[1] START rank=1 restart=1 ") == 1);
    CHECK(count_of(r.out, "[1] DONE") == 1);
    for (int other : {0, 2}) {  // neither restarted nor signalled: one start, and it finished
      const std::string p = "[" + std::to_string(other) + "] ";
      CHECK(count_of(r.out, p + "START") == 1);
      CHECK(count_of(r.out, p + "DONE") == 1);
    }
  }
}

TEST_CASE("--max-restarts: once the budget is spent, the next failure ends the job") {
  const Result r = run({"--max-restarts", "2", "-n", "2", probe, "restart", "1", "4", "10", "30000"});
  INFO(r.out);
  INFO(r.err);
  CHECK(r.code == 4);
  CHECK(r.seconds < 10);
  CHECK(contains(r.err, "restarting it (restart 1 of 2)"));
  CHECK(contains(r.err, "restarting it (restart 2 of 2)"));
  CHECK(count_of(r.err, "restarting it") == 2);
  CHECK(contains(r.err, "no restart left"));
  CHECK(contains(r.err, "rank 1 exited with code 4\n"));
  CHECK(count_of(r.out, "[1] START") == 3);
  CHECK(contains(r.out, "[1] START rank=1 restart=2 "));
  CHECK(count_of(r.out, "[0] START") == 1);
}

TEST_CASE("without --max-restarts nothing is restarted") {
  for (const char* code : {"4", "-9"}) {
    const Result r = run({"-n", "2", probe, "restart", "1", code, "1", "30000"});
    INFO(r.err);
    CHECK(r.code == (std::string(code) == "4" ? 4 : 128 + SIGKILL));
    CHECK(r.seconds < 10);
    CHECK(!contains(r.err, "restart"));
    CHECK(count_of(r.out, "[1] START") == 1);
    CHECK(contains(r.err, "stopping the other 1 rank(s)"));
  }
}

TEST_CASE("--max-restarts: from a rank's death to its replacement's start (measured)") {
  const int n = 30;
  const Result r = run({"--max-restarts", std::to_string(n), "-n", "2", probe, "restart", "1", "3", std::to_string(n), "0"},
                       {}, 60);
  INFO(r.err);
  REQUIRE(r.code == 0);
  const auto died = times_of(r.out, 1, "DYING");
  std::vector<long long> started;
  for (const auto& line : lines(r.out))
    if (line.starts_with("[1] START") && !contains(line, "restart=unset"))
      started.push_back(std::stoll(line.substr(line.find("t_ns=") + 5)));
  REQUIRE(died.size() == static_cast<std::size_t>(n));
  REQUIRE(started.size() == static_cast<std::size_t>(n));
  std::vector<double> ms;
  for (int i = 0; i < n; ++i) ms.push_back(static_cast<double>(started[i] - died[i]) / 1e6);
  std::sort(ms.begin(), ms.end());
  const double p50 = ms[ms.size() / 2], worst = ms.back();
  std::printf("comm-run --max-restarts: death to replacement's main(), %d restarts: p50 %.2f ms, max %.2f ms\n", n, p50,
              worst);
  CHECK(p50 < 1000);
}

TEST_CASE("COMM_AGENT_STORE: 1 makes rank 0 a client; another value is InvalidArgument naming it") {
  // In this process, as a rank would see it (nothing listens on the port: a client times out).
  const std::map<std::string, std::string> vars{
      {"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "1"}};
  for (const auto& [k, v] : vars) ::setenv(k.c_str(), v.c_str(), 1);
  ::setenv("COMM_AGENT_STORE", "yes", 1);
  try {
    (void)comm::init_env(std::chrono::milliseconds(200));
    FAIL("init_env accepted COMM_AGENT_STORE=yes");
  } catch (const comm::InvalidArgument& e) {
    CHECK_MESSAGE(contains(e.what(), "COMM_AGENT_STORE='yes'"), e.what());
  }
  ::setenv("COMM_AGENT_STORE", "1", 1);
  const auto t0 = Clock::now();
  CHECK_THROWS_AS((void)comm::init_env(std::chrono::milliseconds(300)), comm::Timeout);  // connected, did not host
  CHECK(seconds_since(t0) >= 0.25);
  for (const auto& [k, v] : vars) ::unsetenv(k.c_str());
  ::unsetenv("COMM_AGENT_STORE");
}

TEST_CASE("--nnodes 2: node 0's launcher hosts the store, node 1's ranks use it, rank 0's death included") {
  const std::map<std::string, std::string> env{{"COMM_STORE_TOKEN", "two-nodes"}, {"COMM_TIMEOUT", "20s"}};
  auto node = [&](int i) {
    return std::vector<std::string>{"--nnodes", "2", "--node-rank", std::to_string(i), "--master-port", "29518",
                                    "-n", "2", "--max-restarts", "1", store_probe, "survive"};
  };
  Launch one(node(1), env);  // first: its ranks retry until node 0's launcher listens
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  Launch zero(node(0), env);
  const Result r0 = zero.finish(40), r1 = one.finish(40);
  INFO(std::string(r0.out + r0.err));
  INFO(std::string(r1.out + r1.err));
  CHECK(r0.code == 0);
  CHECK(r1.code == 0);
  CHECK(contains(r0.out, "[1] STORE OK"));
  CHECK(contains(r0.out, "[0] REPLACEMENT restart=1"));
  for (int rank : {2, 3}) {
    CHECK(contains(r1.out, "[" + std::to_string(rank) + "] DEAD rank=0 "));
    CHECK(contains(r1.out, "[" + std::to_string(rank) + "] STORE OK"));
  }
}

TEST_CASE("--nnodes 2: node 0's launcher keeps the store up while node 1's ranks still use it") {
  // Node 0's ranks exit at once; node 1's use the store a second later. Without the linger the
  // store would close under them (what failed in CI once, by timing, in the test above).
  const std::map<std::string, std::string> env{{"COMM_STORE_TOKEN", "linger"}, {"COMM_TIMEOUT", "20s"}};
  auto node = [&](int i) {
    return std::vector<std::string>{"--nnodes", "2",     "--node-rank", std::to_string(i), "--master-port",
                                    "29524",    "-n",    "2",           store_probe,       "late"};
  };
  Launch zero(node(0), env);
  Launch one(node(1), env);
  const Result r0 = zero.finish(40), r1 = one.finish(40);
  INFO(std::string(r0.out + r0.err));
  INFO(std::string(r1.out + r1.err));
  CHECK(r0.code == 0);
  CHECK(r1.code == 0);
  for (int rank : {2, 3}) CHECK(contains(r1.out, "[" + std::to_string(rank) + "] LATE OK"));
}

// ---------------------------------------------------------------------------------------------
// torchrun's spellings, --standalone, --log-dir/--tee/--redirects, --local-ranks-filter

namespace {

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

/// The ranks `[r] ` prefixes seen in `text`.
std::set<int> ranks_in(const std::string& text) {
  std::set<int> seen;
  for (const auto& line : lines(text))
    if (line.starts_with('[')) seen.insert(std::stoi(line.substr(1, line.find(']') - 1)));
  return seen;
}

int expected_auto_nproc(bool gpus_first) {
  int gpus = 0;
  std::error_code ec;
  if (gpus_first && std::getenv("CUDA_VISIBLE_DEVICES") != nullptr) {
    std::istringstream in(std::getenv("CUDA_VISIBLE_DEVICES"));
    for (std::string item; std::getline(in, item, ',');) gpus += item.empty() ? 0 : 1;
  } else if (gpus_first) {
    for (fs::directory_iterator it("/proc/driver/nvidia/gpus", ec), end; !ec && it != end; it.increment(ec)) ++gpus;
  }
  const long cpus = ::sysconf(_SC_NPROCESSORS_ONLN);
  return static_cast<int>(std::min<long>(gpus > 0 ? gpus : std::max(1L, cpus), 1024));
}

}  // namespace

TEST_CASE("torchrun's spellings set the same environment") {
  const std::map<std::string, std::string> env{{"COMM_STORE_TOKEN", "0123abcd"}};
  SUBCASE("underscores, --nnodes K:K, and options without effect") {
    const Result r = run({"--nproc_per_node=2", "--nnodes", "2:2", "--node_rank", "1", "--master_addr", "127.0.0.1",
                          "--master_port=29521", "--max_restarts", "0", "--no-python", "--no_python",
                          "--monitor-interval", "5", "--start_method=spawn", "--role", "trainer", probe, "env"},
                         env);
    INFO(r.err);
    CHECK(r.code == 0);
    auto e = parse_env(r.out);
    REQUIRE(e.size() == 2);
    CHECK(e[2]["RANK"] == "2");
    CHECK(e[3]["LOCAL_RANK"] == "1");
    CHECK(e[3]["WORLD_SIZE"] == "4");
    CHECK(e[3]["GROUP_RANK"] == "1");
    CHECK(e[3]["MASTER_PORT"] == "29521");
  }
  SUBCASE("--rdzv-backend c10d, --rdzv-endpoint HOST:PORT and --rdzv-id") {
    const Result r = run({"--rdzv-backend=c10d", "--rdzv_endpoint", "127.0.0.1:29522", "--rdzv-id", "my-job-7",
                          "--nnodes=2", "--node-rank=1", "-n", "1", probe, "env"},
                         env);
    INFO(r.err);
    CHECK(r.code == 0);
    auto e = parse_env(r.out);
    REQUIRE(e.count(1) == 1);
    CHECK(e[1]["MASTER_ADDR"] == "127.0.0.1");
    CHECK(e[1]["MASTER_PORT"] == "29522");
    CHECK(e[1]["COMM_JOB_ID"] == "my-job-7");
  }
  SUBCASE("--rdzv-id wins over COMM_JOB_ID; --rdzv-endpoint localhost:0 picks a free port") {
    const Result r = run({"--rdzv-backend", "static", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", "from-flag",
                          "-n", "2", probe, "env"},
                         {{"COMM_JOB_ID", "from-env"}});
    INFO(r.err);
    CHECK(r.code == 0);
    auto e = parse_env(r.out);
    REQUIRE(e.size() == 2);
    CHECK(e[0]["COMM_JOB_ID"] == "from-flag");
    CHECK(std::stoi(e[0]["MASTER_PORT"]) > 0);
    CHECK(e[1]["MASTER_PORT"] == e[0]["MASTER_PORT"]);
  }
  SUBCASE("--nproc-per-node gpu counts CUDA_VISIBLE_DEVICES, and says when there is none") {
    const Result r = run({"--nproc-per-node", "gpu", probe, "env"}, {{"CUDA_VISIBLE_DEVICES", "3,5,"}});
    CHECK(r.code == 0);
    CHECK(parse_env(r.out).size() == 2);
    const Result none = run({"--nproc-per-node=gpu", probe, "env"}, {{"CUDA_VISIBLE_DEVICES", ""}});
    CHECK(none.code == 2);
    CHECK(contains(none.err, "no GPU found"));
  }
  SUBCASE("--nproc-per-node cpu and auto") {
    for (const char* what : {"cpu", "auto"}) {
      CAPTURE(what);
      const int want = expected_auto_nproc(std::string(what) == "auto");
      if (want > 64) continue;  // a very large machine: not worth starting that many probes
      const Result r = run({"--nproc-per-node", what, probe, "env"});
      CHECK(r.code == 0);
      auto e = parse_env(r.out);
      CHECK(e.size() == static_cast<std::size_t>(want));
      CHECK(e[0]["WORLD_SIZE"] == std::to_string(want));
    }
  }
}

TEST_CASE("--standalone: one node, the store on 127.0.0.1 and a port of its own") {
  const Result a = run({"--standalone", "--nproc_per_node", "2", probe, "env"});
  INFO(a.err);
  CHECK(a.code == 0);
  auto e = parse_env(a.out);
  REQUIRE(e.size() == 2);
  CHECK(e[0]["MASTER_ADDR"] == "127.0.0.1");
  CHECK(std::stoi(e[0]["MASTER_PORT"]) > 0);
  CHECK(e[1]["MASTER_PORT"] == e[0]["MASTER_PORT"]);
  CHECK(e[0]["WORLD_SIZE"] == "2");
  CHECK(e[1]["GROUP_WORLD_SIZE"] == "1");
  CHECK(e[0]["COMM_AGENT_STORE"] == "1");
  // Two standalone jobs at once: each hosts its own store on its own port, and each job's ranks
  // use theirs (rank 0 killed and restarted, the store survives: the store really is the job's).
  const std::map<std::string, std::string> env{{"COMM_TIMEOUT", "20s"}};
  Launch one({"--standalone", "-n", "2", "--max-restarts", "1", store_probe, "survive"}, env);
  Launch two({"--standalone", "-n", "2", "--max-restarts", "1", store_probe, "survive"}, env);
  const Result r1 = one.finish(40), r2 = two.finish(40);
  for (const Result* r : {&r1, &r2}) {
    INFO(r->out);
    INFO(r->err);
    CHECK(r->code == 0);
    CHECK(contains(r->out, "[1] STORE OK"));
    CHECK(contains(r->out, "[0] REPLACEMENT restart=1"));
  }
}

TEST_CASE("--log-dir: each rank's streams in its own files, the console as --tee and --redirects say") {
  TempDir dir;
  const fs::path logs = dir.path / "logs";  // made by comm-run, parents included
  auto file = [&](int rank, const char* name) { return logs / ("rank_" + std::to_string(rank)) / name; };
  const std::string out_text = "hello world\nhello world\nhello world\ntail";  // as written: no prefix, no added newline
  const std::string err_text = "err line\nerr line\nerr line\n";
  struct Case {
    std::vector<std::string> flags;
    bool out_console, err_console, out_file, err_file;
  };
  const std::vector<Case> cases = {
      {{}, false, false, true, true},
      {{"--tee", "0"}, false, false, true, true},
      {{"--tee", "1"}, true, false, true, true},
      {{"-t", "2"}, false, true, true, true},
      {{"--tee=3"}, true, true, true, true},
      {{"-r", "1"}, false, true, true, false},         // stdout to its file only, stderr to the console only
      {{"--redirects", "0"}, true, true, false, false},  // torchrun: nothing redirected
      {{"-r", "1", "--tee", "2"}, false, true, true, true},
  };
  SUBCASE("each --tee and --redirects") {
    for (const Case& c : cases) {
      std::string joined;
      for (const auto& f : c.flags) joined += f + " ";
      CAPTURE(joined);
      fs::remove_all(logs);
      std::vector<std::string> args = {"-n", "2", "--log-dir", logs.string()};
      args.insert(args.end(), c.flags.begin(), c.flags.end());
      for (const std::string& a : {probe, std::string("hello"), std::string("3")}) args.push_back(a);
      const Result r = run(args);
      CHECK(r.code == 0);
      for (int rank = 0; rank < 2; ++rank) {
        CAPTURE(rank);
        const std::string p = "[" + std::to_string(rank) + "] ";
        CHECK(count_of(r.out, p + "hello world\n") == (c.out_console ? 3u : 0u));
        CHECK(count_of(r.err, p + "err line\n") == (c.err_console ? 3u : 0u));
        CHECK(fs::exists(file(rank, "stdout.log")) == c.out_file);
        CHECK(fs::exists(file(rank, "stderr.log")) == c.err_file);
        if (c.out_file) CHECK(read_file(file(rank, "stdout.log")) == out_text);
        if (c.err_file) CHECK(read_file(file(rank, "stderr.log")) == err_text);
      }
      if (!c.out_console) CHECK(r.out.empty());
      if (!c.err_console) CHECK_MESSAGE(r.err.empty(), r.err);
    }
  }
  SUBCASE("the files are emptied when a job starts") {
    for (int k = 0; k < 2; ++k) REQUIRE(run({"-n", "1", "--log-dir", logs.string(), probe, "hello", "3"}).code == 0);
    CHECK(read_file(file(0, "stdout.log")) == out_text);
  }
  SUBCASE("a failure names the failing rank's folder; a restarted rank appends") {
    const Result f = run({"-n", "2", "--log_dir=" + logs.string(), probe, "exit", "1", "7"});
    CHECK(f.code == 7);
    CHECK_MESSAGE(contains(f.err, "rank 1 exited with code 7 (its output: " + (logs / "rank_1").string() + "/)"), f.err);
    const Result r = run({"-n", "2", "--max-restarts", "1", "--log-dir", logs.string(), probe, "restart", "1", "5", "1",
                          "100"});
    INFO(r.err);
    CHECK(r.code == 0);
    CHECK(r.out.empty());
    const std::string one = read_file(file(1, "stdout.log"));
    CHECK(count_of(one, "START rank=1 restart=unset") == 1);
    CHECK(count_of(one, "DYING") == 1);
    CHECK(count_of(one, "START rank=1 restart=1 ") == 1);
    CHECK(count_of(one, "DONE") == 1);
    CHECK(contains(r.err, "restarting it (restart 1 of 1)"));
  }
  SUBCASE("a folder that cannot be made is an error before any rank starts") {
    std::ofstream(dir.path / "plain-file") << "x";
    const Result r = run({"-n", "2", "--log-dir", (dir.path / "plain-file").string(), probe, "hello", "1"});
    CHECK(r.code == 1);
    CHECK(contains(r.err, "--log-dir: cannot create"));
    CHECK(r.out.empty());
  }
}

TEST_CASE("--local-ranks-filter shows only the chosen ranks' output on the console") {
  for (const std::string& filter : {std::string("0,2"), std::string("0,2-2"), std::string("2,0,0")}) {
    CAPTURE(filter);
    const Result r = run({"-n", "3", "--local-ranks-filter", filter, probe, "hello", "2"});
    CHECK(r.code == 0);
    CHECK(ranks_in(r.out) == std::set<int>{0, 2});
    CHECK(ranks_in(r.err) == std::set<int>{0, 2});
    CHECK(count_of(r.out, "[2] hello world\n") == 2);
  }
  // Local ranks: on node 1 of 2, local rank 1 is rank 3; the hidden ranks still write their files.
  TempDir dir;
  const Result r = run({"--nnodes", "2", "--node-rank", "1", "--master-port", "29523", "-n", "2",
                        "--local_ranks_filter=1", "--log-dir", dir.path.string(), "--tee", "3", probe, "hello", "1"},
                       {{"COMM_STORE_TOKEN", "0123abcd"}});
  CHECK(r.code == 0);
  CHECK(ranks_in(r.out) == std::set<int>{3});
  CHECK(ranks_in(r.err) == std::set<int>{3});
  CHECK(read_file(dir.path / "rank_2" / "stdout.log") == "hello world\ntail");
  CHECK(read_file(dir.path / "rank_3" / "stdout.log") == "hello world\ntail");
  // A failing hidden rank is still reported: comm-run's own messages are never filtered.
  const Result f = run({"-n", "2", "--local-ranks-filter", "0", probe, "exit", "1", "6"});
  CHECK(f.code == 6);
  CHECK(contains(f.err, "comm-run: rank 1 exited with code 6"));
}
