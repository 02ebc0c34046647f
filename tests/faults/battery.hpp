#pragma once
// Shared pieces of the fault battery: where the helper programs are, a hard per-scenario
// deadline (a hang kills the test process with a message naming the scenario), the report lines
// the docs quote, starting a world of fault_peer ranks with an explicit environment, and the
// proxies between Gloo ranks started with fault_peer --proxy-store (ProxyBroker).

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <comm/detail/net/socket.hpp>
#include <comm/store.hpp>

#include "process.hpp"
#include "tcp_proxy.hpp"

#ifndef COMM_FAULT_PEER_EXE
#error "COMM_FAULT_PEER_EXE must name the fault_peer program"
#endif
#ifndef COMM_RUN_EXE
#error "COMM_RUN_EXE must name the comm-run program"
#endif

namespace comm::faults {

/// The backend of the list that the suite "backend" runs on: fault_battery --fault-backend=<name>
/// (faults_main.cpp; CMake registers one faults.<name> entry per backend). Default: gloo.
inline std::string& fault_backend_setting() {
  static std::string name = "gloo";
  return name;
}
inline const std::string& fault_backend() { return fault_backend_setting(); }

using namespace std::chrono_literals;

inline constexpr const char* fault_peer = COMM_FAULT_PEER_EXE;
inline constexpr const char* comm_run = COMM_RUN_EXE;

/// The hard deadline of one scenario: if the scenario is still running when it passes, the whole
/// test process prints what hung and exits with 124 (a Process's children die with their group
/// leader's pipe; CTest's TIMEOUT is the last line of defence).
class HangGuard {
 public:
  HangGuard(std::string scenario, milliseconds limit) : scenario_(std::move(scenario)) {
    thread_ = std::thread([this, limit] {
      std::unique_lock lock(mu_);
      if (!cv_.wait_for(lock, limit, [&] { return done_; })) {
        std::fprintf(stderr, "fault-battery: HANG: scenario '%s' still running after %lld ms; aborting\n",
                     scenario_.c_str(), static_cast<long long>(limit.count()));
        std::fflush(stderr);
        std::_Exit(124);
      }
    });
  }
  ~HangGuard() {
    {
      std::lock_guard lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  HangGuard(const HangGuard&) = delete;
  HangGuard& operator=(const HangGuard&) = delete;

 private:
  std::string scenario_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

/// One measured outcome. Printed as
///   fault-battery | <scenario> | <outcome> | <ms> ms | bound <ms> ms | <message>
/// and appended as a tab-separated line to $COMM_FAULT_REPORT when that is set.
inline void report(const std::string& scenario, const std::string& outcome, double ms, double bound_ms,
                   const std::string& message = {}) {
  char head[512];
  std::snprintf(head, sizeof head, "fault-battery | %s | %s | %.1f ms | bound %.0f ms | ", scenario.c_str(),
                outcome.c_str(), ms, bound_ms);
  std::printf("%s%s\n", head, message.c_str());
  std::fflush(stdout);
  if (const char* path = std::getenv("COMM_FAULT_REPORT"); path != nullptr && *path != '\0') {
    std::ofstream f(path, std::ios::app);
    f << scenario << '\t' << outcome << '\t' << ms << '\t' << bound_ms << '\t' << message << '\n';
  }
}

/// Percentile (0..100) of `v` (nearest rank); 0 for an empty list.
inline double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const auto k = static_cast<std::size_t>(std::clamp(p / 100.0 * static_cast<double>(v.size()) + 0.5, 1.0,
                                                     static_cast<double>(v.size())));
  return v[k - 1];
}

inline bool contains(const std::string& hay, const std::string& needle) { return hay.find(needle) != std::string::npos; }

/// The launcher environment of rank `rank` of `size`, store at 127.0.0.1:`port`.
inline Process::Env rank_env(int rank, int size, std::uint16_t port, const std::string& timeout,
                             const std::string& token = "fault-battery-token") {
  return {{"RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(size)},
          {"LOCAL_RANK", std::to_string(rank)},
          {"LOCAL_WORLD_SIZE", std::to_string(size)},
          {"MASTER_ADDR", "127.0.0.1"},
          {"MASTER_PORT", std::to_string(port)},
          {"COMM_STORE_TOKEN", token},
          {"COMM_TIMEOUT", timeout}};
}

/// A world of fault_peer ranks, each with its own arguments and environment.
struct World {
  std::vector<std::unique_ptr<Process>> ranks;

  Process& operator[](std::size_t i) { return *ranks.at(i); }
  [[nodiscard]] std::size_t size() const { return ranks.size(); }

  /// Waits until every rank in `which` (all when empty) printed a line starting with `prefix`.
  bool all_said(const std::string& prefix, milliseconds within, std::vector<int> which = {}) {
    if (which.empty())
      for (std::size_t i = 0; i < ranks.size(); ++i) which.push_back(static_cast<int>(i));
    const auto deadline = Clock::now() + within;
    for (int r : which) {
      const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
      if (!ranks.at(static_cast<std::size_t>(r))->wait_line(prefix, std::max(left, milliseconds(1)))) return false;
    }
    return true;
  }

  /// Every rank's output, prefixed with its rank (for failure messages).
  std::string outputs() {
    std::string s;
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      const auto out = ranks[i]->output();
      std::size_t at = 0;
      while (at < out.size()) {
        const auto nl = out.find('\n', at);
        s += "[" + std::to_string(i) + "] " + out.substr(at, nl == std::string::npos ? std::string::npos : nl - at) + "\n";
        if (nl == std::string::npos) break;
        at = nl + 1;
      }
    }
    return s;
  }
};

/// Starts `size` fault_peer ranks: rank r runs `fault_peer args(r)...` with rank_env(r) + `extra`.
template <class ArgsOf>
World start_world(int size, std::uint16_t port, const std::string& timeout, ArgsOf&& args_of,
                  const Process::Env& extra = {}) {
  World w;
  for (int r = 0; r < size; ++r) {
    std::vector<std::string> argv{fault_peer};
    for (auto& a : args_of(r)) argv.push_back(a);
    auto env = rank_env(r, size, port, timeout);
    for (const auto& [k, v] : extra) env[k] = v;
    w.ranks.push_back(std::make_unique<Process>(std::move(argv), env));
  }
  return w;
}

/// The RESULT line of a finished rank, as fields (empty when there was none).
inline std::map<std::string, std::string> result_of(Process& p, milliseconds within = 10s) {
  auto line = p.wait_line("RESULT ", within);
  return line ? fields(*line) : std::map<std::string, std::string>{};
}

/// A loopback port nobody listens on right now.
inline std::uint16_t free_port() { return detail::free_port("127.0.0.1"); }

/// The proxies between the Gloo ranks of a world started with fault_peer --proxy-store, whose
/// store `store` this process hosts: one TcpProxy per pair of ranks (a < b), made when rank a asks
/// for it while it connects (keys proxy/req/a/b -> proxy/port/a/b, see ProxiedStore in
/// fault_peer.cpp). One thread per pair serves its request; every pair's traffic then goes through
/// its proxy, so a test can cut, stall or corrupt any link.
class ProxyBroker {
 public:
  /// Serves the pairs of `size` ranks; a request not made within `within` is given up.
  ProxyBroker(TcpStore& store, int size, milliseconds within = 30s) : size_(size) {
    for (int a = 0; a < size; ++a)
      for (int b = a + 1; b < size; ++b) pairs_.push_back(std::make_unique<Pair>());
    for (int a = 0; a < size; ++a)
      for (int b = a + 1; b < size; ++b) {
        Pair& p = *pairs_[index(a, b)];
        p.thread = std::thread([&store, &p, a, b, within] {
          const std::string pair = std::to_string(a) + "/" + std::to_string(b);
          try {
            store.wait({"proxy/req/" + pair}, within);
            const auto req = store.get("proxy/req/" + pair);
            const std::string target(req.begin(), req.end());
            const auto colon = target.rfind(':');
            auto proxy = std::make_unique<TcpProxy>(target.substr(0, colon),
                                                    static_cast<std::uint16_t>(std::stoi(target.substr(colon + 1))));
            const auto port = proxy->port();
            {
              std::lock_guard g(p.mu);
              p.proxy = std::move(proxy);
            }
            store.set("proxy/port/" + pair, std::to_string(port));
          } catch (const std::exception& e) {
            std::lock_guard g(p.mu);
            p.error = e.what();
          }
        });
      }
  }
  ~ProxyBroker() {
    for (auto& p : pairs_)
      if (p->thread.joinable()) p->thread.join();
  }
  ProxyBroker(const ProxyBroker&) = delete;
  ProxyBroker& operator=(const ProxyBroker&) = delete;

  /// Waits until every pair has its proxy; false (see error()) when one could not be made.
  bool ready() {
    for (auto& p : pairs_)
      if (p->thread.joinable()) p->thread.join();
    return error().empty();
  }
  /// Why a proxy is missing (empty: none is).
  std::string error() {
    std::string e;
    for (auto& p : pairs_) {
      std::lock_guard g(p->mu);
      if (!p->error.empty()) e += (e.empty() ? "" : "; ") + p->error;
    }
    return e;
  }
  /// The proxy between ranks a and b (either order), once ready().
  TcpProxy& between(int a, int b) {
    auto& p = *pairs_.at(index(std::min(a, b), std::max(a, b)));
    std::lock_guard g(p.mu);
    if (!p.proxy) throw std::logic_error("ProxyBroker: no proxy between ranks " + std::to_string(a) + " and " +
                                         std::to_string(b));
    return *p.proxy;
  }

  /// Cuts every link of rank `victim` (TcpProxy::cut: resets its connections, refuses new ones),
  /// all at once: one thread per link, so no survivor learns of another's cut first.
  void cut_links_of(int victim) {
    std::vector<std::thread> t;
    for (int r = 0; r < size_; ++r)
      if (r != victim) t.emplace_back([this, r, victim] { between(r, victim).cut(); });
    for (auto& th : t) th.join();
  }

 private:
  struct Pair {
    std::mutex mu;
    std::unique_ptr<TcpProxy> proxy;
    std::string error;
    std::thread thread;
  };
  // Pairs (a, b), a < b, in order (0,1), (0,2), ... (1,2), ...
  [[nodiscard]] std::size_t index(int a, int b) const {
    return static_cast<std::size_t>(a * size_ - a * (a + 1) / 2 + (b - a - 1));
  }
  int size_;
  std::vector<std::unique_ptr<Pair>> pairs_;
};

}  // namespace comm::faults
