#pragma once
// Liveness: a channel beside the data path through which every rank of a communicator learns
// within a fraction of a second that another rank died or went silent.
//
// Each rank keeps one connection of its own to the TcpStore server (a second TcpStore client, so
// nothing of it touches the connections rendezvous or the user use) and gives it a "will"
// (Op::watch): the key "<communicator prefix>liveness/dead", the value "<rank>|". A thread keeps a
// heartbeat pending on it, renewed every silence/2 (the server holds it that long): the server
// answers it the moment the will key is set, with its value.
// When a rank's process dies its connection closes and the server sets the key at once ("<rank>|
// its connection to the store closed ..."); when a rank stops (SIGSTOP) or hangs so that its
// heartbeats stop for `silence`, the server sets it too ("... sent no heartbeat for N ms").
// Every other rank gets the value at once and calls `on_dead(rank, why)`, which
// fails the communicator (EngineCore::peer_failed): its running operation ends with RemoteError
// naming the op, its number, this rank and the dead rank. The rank hosting the store server
// cannot report itself: a heartbeat that gets no answer for `silence` names that rank.
//
// Cost: nothing on the operations' path (one thread, one request per silence/2 per rank, on
// another socket; the thread sleeps in the store's reply). Leaving costs one short connection. A rank that leaves normally withdraws its will first. Off with COMM_LIVENESS=0,
// for stores other than TcpStore (FileStore, HashStore), and for subgroups (their root watches).
//
//   COMM_LIVENESS=0|1              default 1
//   COMM_LIVENESS_INTERVAL=<dur>   the shortest heartbeat period, default 100ms
//   COMM_LIVENESS_SILENCE=<dur>    a rank silent this long is dead, default 2s (at least 4 periods)

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include <comm/detail/env.hpp>
#include <comm/detail/logging.hpp>
#include <comm/error.hpp>
#include <comm/store.hpp>

namespace comm::detail {

struct LivenessConfig {
  bool enabled = true;
  std::chrono::milliseconds interval{100};
  std::chrono::milliseconds silence{2000};
};

[[nodiscard]] inline LivenessConfig liveness_config(int rank) {
  LivenessConfig c;
  if (auto v = getenv_str("COMM_LIVENESS")) {
    const auto t = trim(*v);
    if (t == "0" || t == "off" || t == "false") c.enabled = false;
  }
  auto duration = [&](const char* name, std::chrono::milliseconds& out) {
    auto v = getenv_str(name);
    if (!v || trim(*v).empty()) return;
    auto d = parse_duration(*v);
    if (!d || d->count() == 0) bad_env("init", rank, name, *v, "not a duration (seconds, or a number with ms, s or m)");
    out = *d;
  };
  duration("COMM_LIVENESS_INTERVAL", c.interval);
  duration("COMM_LIVENESS_SILENCE", c.silence);
  c.silence = std::max(c.silence, 4 * c.interval);
  return c;
}

/// The TcpStore under `store` (through PrefixStores) and the prefix they add; null if none.
[[nodiscard]] inline TcpStore* underlying_tcp_store(Store* store, std::string& prefix) {
  while (store != nullptr) {
    if (auto* t = dynamic_cast<TcpStore*>(store)) return t;
    auto* p = dynamic_cast<PrefixStore*>(store);
    if (p == nullptr) return nullptr;
    prefix = p->prefix() + "/" + prefix;
    store = p->base().get();
  }
  return nullptr;
}

class Liveness {
 public:
  using OnDead = std::function<void(int rank, const std::string& why)>;

  /// Starts watching the ranks of a communicator whose keys live under `key_prefix` on `store`;
  /// null when liveness is off or cannot work here (see the file comment). Throws what connecting
  /// to the store throws.
  static std::unique_ptr<Liveness> start(const std::shared_ptr<Store>& store, const std::string& key_prefix, int rank,
                                         int size, OnDead on_dead) {
    if (size < 2 || !store) return nullptr;
    const auto cfg = liveness_config(rank);
    if (!cfg.enabled) return nullptr;
    std::string prefix;
    TcpStore* tcp = underlying_tcp_store(store.get(), prefix);
    if (tcp == nullptr) return nullptr;
    TcpStoreOptions o = tcp->options();
    o.is_server = false;
    o.rank = rank;
    o.timeout = std::min(store->timeout(), std::max(cfg.silence, std::chrono::milliseconds(5000)));
    auto own = std::make_unique<TcpStore>(tcp->host(), tcp->port(), o);
    const std::string key = prefix + key_prefix + "liveness/dead";
    const int host = own->watch(key, std::to_string(rank) + "|", cfg.silence);
    return std::unique_ptr<Liveness>(new Liveness(std::move(own), key, rank, size, host, cfg, std::move(on_dead)));
  }

  Liveness(const Liveness&) = delete;
  Liveness& operator=(const Liveness&) = delete;
  ~Liveness() { stop(); }

  struct Verdict {
    int rank = -1;
    std::string why;
  };

  /// Asks the store now whether a rank of the communicator is dead (on a connection of its own,
  /// bounded by `timeout`, at most 200 ms): what a rank whose operation just failed uses to name the rank that caused it
  /// rather than a survivor that closed its connections first. Any thread.
  [[nodiscard]] std::optional<Verdict> verdict_now(std::chrono::milliseconds timeout) {
    {
      std::lock_guard g(io_mu_);
      if (verdict_) return verdict_;
      if (store_lost_) return host_verdict();
    }
    // The watch thread's own heartbeat may be held by the server: ask on a connection of our own.
    try {
      TcpStoreOptions o = store_->options();
      o.timeout = std::min(timeout, std::chrono::milliseconds(200));
      TcpStore probe(store_->host(), store_->port(), o);
      if (probe.check(key_)) return parse(probe.get(key_));
    } catch (const InvalidArgument&) {
    } catch (const Error&) {
      // The store server is gone (or silent) while an operation failed: its host died or left,
      // which is what broke the operation (a rank that leaves normally has finished every
      // operation with us).
      return host_verdict();
    } catch (const std::exception&) {
    }
    return std::nullopt;
  }

  /// Withdraws this rank's will (a normal exit is not a death) and ends the thread.
  void stop() noexcept {
    {
      std::lock_guard g(mu_);
      if (stop_) return;
      stop_ = true;
    }
    cv_.notify_all();
    // The thread's heartbeat is held by the server for up to silence/2: release our will from a
    // connection of its own, which also answers that heartbeat at once.
    if (thread_.joinable()) {
      try {
        TcpStoreOptions o = store_->options();
        o.timeout = std::chrono::milliseconds(200);
        if (!finished_.load())
          (void)TcpStore(store_->host(), store_->port(), o)
              .watch(key_, std::to_string(rank_) + "|", std::chrono::milliseconds(0));
      } catch (...) {  // the store is gone: nobody is left to be told
      }
      thread_.join();
    }
  }

 private:
  Liveness(std::unique_ptr<TcpStore> store, std::string key, int rank, int size, int host, LivenessConfig cfg,
           OnDead on_dead)
      : store_(std::move(store)),
        key_(std::move(key)),
        rank_(rank),
        size_(size),
        host_(host),
        cfg_(cfg),
        on_dead_(std::move(on_dead)) {
    thread_ = std::thread([this] { loop(); });
  }

  void loop() noexcept {
    bool withdraw = true;
    for (;;) {
      if (stop_requested()) break;
      try {
        // Held by the server for up to silence/2, answered at once when a rank dies.
        const auto t0 = std::chrono::steady_clock::now();
        const auto v = store_->heartbeat(cfg_.silence, cfg_.silence / 2);
        if (!v) {
          if (std::chrono::steady_clock::now() - t0 < cfg_.interval / 4) {  // not held: pace it
            std::unique_lock l(mu_);
            cv_.wait_for(l, cfg_.interval, [&] { return stop_; });
          }
          continue;
        }
        const auto d = parse(*v);
        {
          std::lock_guard g(io_mu_);
          verdict_ = d;
        }
        if (d.rank != rank_) notify(d.rank, d.why);
        break;  // one death is enough: the communicator has failed
      } catch (const Timeout&) {
        // The server did not answer for `silence`: the process hosting it is stopped or hung.
        std::optional<Verdict> d;
        if (host_ >= 0 && host_ < size_ && host_ != rank_)
          d = Verdict{host_, "the store server it hosts did not answer a heartbeat for " +
                                 std::to_string(cfg_.silence.count()) + " ms (stopped, hung or cut off)"};
        {
          std::lock_guard g(io_mu_);
          verdict_ = d;
        }
        if (d) notify(d->rank, d->why);
        withdraw = false;
        break;
      } catch (const std::exception& e) {
        // The store is gone (its host exited, or died: the data path sees that) or refused us.
        {
          std::lock_guard g(io_mu_);
          store_lost_ = true;
        }
        log(LogLevel::detail, std::string("comm: liveness watch ended: ") + e.what());
        withdraw = false;
        break;
      }
    }
    if (withdraw) {
      try {
        (void)store_->watch({}, {}, cfg_.silence);
      } catch (...) {
      }
    }
    finished_.store(true);
  }


  [[nodiscard]] std::optional<Verdict> host_verdict() const {
    if (host_ < 0 || host_ >= size_ || host_ == rank_) return std::nullopt;
    return Verdict{host_, "the store server it hosted went away (the process exited or was killed)"};
  }

  [[nodiscard]] bool stop_requested() {
    std::lock_guard g(mu_);
    return stop_;
  }

  [[nodiscard]] static Verdict parse(const Store::Bytes& v) {
    const std::string s(v.begin(), v.end());
    const auto bar = s.find('|');
    Verdict d;
    try {
      d.rank = bar == std::string::npos ? -1 : std::stoi(s.substr(0, bar));
    } catch (...) {
    }
    d.why = bar == std::string::npos ? s : s.substr(bar + 1);
    return d;
  }

  void notify(int dead, const std::string& reason) noexcept {
    try {
      on_dead_(dead, reason);
    } catch (...) {
    }
  }

  std::unique_ptr<TcpStore> store_;
  std::string key_;
  int rank_;
  int size_;
  int host_;
  LivenessConfig cfg_;
  OnDead on_dead_;
  std::mutex mu_;  // stop_
  std::condition_variable cv_;
  bool stop_ = false;
  std::atomic<bool> finished_{false};  // the thread has left its loop
  std::mutex io_mu_;  // verdict_, store_lost_ (store_ itself is the thread's alone)
  std::optional<Verdict> verdict_;
  bool store_lost_ = false;
  std::thread thread_;  // last: starts after everything above
};

}  // namespace comm::detail
