#pragma once
// Child processes for the fault battery: fork/exec with an explicit environment, output captured
// line by line, signals, and waits bounded by a deadline. A Process never outlives its object: the
// destructor SIGKILLs (and reaps) a child that is still running, so a failed check cannot leave
// stray ranks behind. Each child runs in its own process group, so a kill reaches its children too.

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

extern char** environ;

namespace comm::faults {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

/// Milliseconds since `t0`, as a double (sub-millisecond resolution for the report).
inline double ms_since(Clock::time_point t0, Clock::time_point t1 = Clock::now()) {
  return std::chrono::duration<double, std::milli>(t1 - t0).count();
}

/// steady_clock in nanoseconds since its epoch: CLOCK_MONOTONIC, the same clock in every process
/// of this machine, so children can report when something happened and the parent compare.
inline std::int64_t mono_ns(Clock::time_point t = Clock::now()) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

/// How a child ended.
struct Exit {
  bool exited = false;     // normal exit (then `code`)
  int code = -1;
  int signal = 0;          // killed by this signal
  bool killed_by_us = false;  // we SIGKILLed it at a deadline
  [[nodiscard]] std::string str() const {
    if (killed_by_us) return "killed at the deadline (HANG)";
    if (exited) return "exit " + std::to_string(code);
    if (signal != 0) return std::string("signal ") + ::strsignal(signal);
    return "still running";
  }
};

/// Variables a launcher sets; children start without them unless the test gives them.
inline constexpr const char* launcher_vars[] = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "GROUP_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "COMM_STORE_TOKEN", "COMM_JOB_ID", "COMM_TIMEOUT", "GLOO_SOCKET_IFNAME",
    "COMM_AGENT_STORE", "COMM_RESTART_COUNT"};

class Process {
 public:
  using Env = std::map<std::string, std::string>;

  /// Starts `argv` with this process's environment minus the launcher variables, plus `env`.
  Process(std::vector<std::string> argv, const Env& env) : argv_(std::move(argv)) {
    if (argv_.empty()) throw std::invalid_argument("Process: empty argv");
    std::map<std::string, std::string> vars;
    for (char** e = environ; *e != nullptr; ++e) {
      std::string_view kv = *e;
      const auto eq = kv.find('=');
      if (eq == std::string_view::npos) continue;
      vars[std::string(kv.substr(0, eq))] = std::string(kv.substr(eq + 1));
    }
    for (const char* k : launcher_vars) vars.erase(k);
    for (const auto& [k, v] : env) vars[k] = v;
    std::vector<std::string> env_strings;
    for (const auto& [k, v] : vars) env_strings.push_back(k + "=" + v);
    std::vector<char*> cargv, cenv;
    for (auto& a : argv_) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    for (auto& s : env_strings) cenv.push_back(s.data());
    cenv.push_back(nullptr);

    int out[2];
    if (::pipe2(out, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      ::setpgid(0, 0);
      ::dup2(out[1], 1);
      ::dup2(out[1], 2);
      const int devnull = ::open("/dev/null", O_RDONLY);
      if (devnull >= 0) ::dup2(devnull, 0);
      ::execve(cargv[0], cargv.data(), cenv.data());
      std::fprintf(stderr, "exec %s: %s\n", cargv[0], std::strerror(errno));
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also here: no race with the child's own call
    ::close(out[1]);
    pid_ = pid;
    out_fd_ = out[0];
    started_ = Clock::now();
    reader_ = std::thread([this] { read_output(); });
  }

  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  ~Process() {
    if (!exit_) {
      ::kill(-pid_, SIGKILL);
      ::kill(pid_, SIGKILL);
      int st = 0;
      ::waitpid(pid_, &st, 0);
    }
    if (reader_.joinable()) reader_.join();
    ::close(out_fd_);
  }

  [[nodiscard]] pid_t pid() const noexcept { return pid_; }
  [[nodiscard]] Clock::time_point started() const noexcept { return started_; }

  /// Sends `sig` to the child (its whole process group).
  void signal(int sig) const {
    ::kill(-pid_, sig);
    ::kill(pid_, sig);
  }

  /// Waits until the child exits or `within` passes; nullopt if still running.
  std::optional<Exit> wait_for(milliseconds within) {
    const auto deadline = Clock::now() + within;
    for (;;) {
      if (reap(false)) return exit_;
      if (Clock::now() >= deadline) return std::nullopt;
      std::this_thread::sleep_for(milliseconds(2));
    }
  }

  /// Waits up to `within`; a child still running then is SIGKILLed and reported as a hang.
  Exit wait_or_kill(milliseconds within) {
    if (auto e = wait_for(within)) return *e;
    signal(SIGKILL);
    reap(true);
    exit_->killed_by_us = true;
    return *exit_;
  }

  [[nodiscard]] std::optional<Exit> exit_status() {
    reap(false);
    return exit_;
  }
  /// When the child was seen to have exited (valid once exit_status() has a value).
  [[nodiscard]] Clock::time_point exited_at() const noexcept { return exited_at_; }

  /// Blocks until a whole output line starting with `prefix` appears (returns it), the child's
  /// output ends, or `within` passes (then nullopt).
  std::optional<std::string> wait_line(std::string_view prefix, milliseconds within) {
    std::unique_lock lock(mu_);
    std::size_t scanned = 0;
    const auto deadline = Clock::now() + within;
    for (;;) {
      for (; scanned < lines_.size(); ++scanned)
        if (std::string_view(lines_[scanned]).starts_with(prefix)) return lines_[scanned];
      if (eof_) return std::nullopt;
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && scanned == lines_.size()) return std::nullopt;
    }
  }

  /// Every line whose text starts with `prefix`.
  std::vector<std::string> lines(std::string_view prefix = {}) {
    std::lock_guard lock(mu_);
    std::vector<std::string> out;
    for (const auto& l : lines_)
      if (std::string_view(l).starts_with(prefix)) out.push_back(l);
    return out;
  }

  /// All output so far (after the child exited: all of it, once the pipe reached EOF).
  std::string output() {
    if (exit_) {
      std::unique_lock lock(mu_);
      cv_.wait_for(lock, milliseconds(2000), [&] { return eof_; });
    }
    std::lock_guard lock(mu_);
    std::string s;
    for (const auto& l : lines_) s += l + "\n";
    return s + partial_;
  }

 private:
  bool reap(bool block) {
    if (exit_) return true;
    int st = 0;
    const pid_t r = ::waitpid(pid_, &st, block ? 0 : WNOHANG);
    if (r != pid_) return false;
    exited_at_ = Clock::now();
    Exit e;
    if (WIFEXITED(st)) {
      e.exited = true;
      e.code = WEXITSTATUS(st);
    } else if (WIFSIGNALED(st)) {
      e.signal = WTERMSIG(st);
    }
    exit_ = e;
    // The group may still hold grandchildren; they must not outlive the test.
    ::kill(-pid_, SIGKILL);
    return true;
  }

  void read_output() {
    char buf[4096];
    for (;;) {
      const ssize_t n = ::read(out_fd_, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      std::lock_guard lock(mu_);
      if (n <= 0) {
        if (!partial_.empty()) lines_.push_back(std::move(partial_));
        partial_.clear();
        eof_ = true;
        cv_.notify_all();
        return;
      }
      partial_.append(buf, static_cast<std::size_t>(n));
      std::size_t nl;
      while ((nl = partial_.find('\n')) != std::string::npos) {
        lines_.push_back(partial_.substr(0, nl));
        partial_.erase(0, nl + 1);
      }
      cv_.notify_all();
    }
  }

  std::vector<std::string> argv_;
  pid_t pid_ = -1;
  int out_fd_ = -1;
  Clock::time_point started_;
  Clock::time_point exited_at_;
  std::optional<Exit> exit_;
  std::thread reader_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> lines_;
  std::string partial_;
  bool eof_ = false;
};

/// `key=value` fields of a line such as "RESULT rank=1 kind=RemoteError t_ns=123 what=..." (the
/// field `what` runs to the end of the line).
inline std::map<std::string, std::string> fields(std::string_view line) {
  std::map<std::string, std::string> out;
  std::size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && line[i] == ' ') ++i;
    const auto eq = line.find('=', i);
    const auto sp = line.find(' ', i);
    if (eq == std::string_view::npos || (sp != std::string_view::npos && sp < eq)) {
      i = sp == std::string_view::npos ? line.size() : sp + 1;
      continue;
    }
    const std::string key(line.substr(i, eq - i));
    if (key == "what") {
      out[key] = std::string(line.substr(eq + 1));
      break;
    }
    const auto end = line.find(' ', eq + 1);
    out[key] = std::string(line.substr(eq + 1, end == std::string_view::npos ? std::string_view::npos : end - eq - 1));
    i = end == std::string_view::npos ? line.size() : end + 1;
  }
  return out;
}

}  // namespace comm::faults
