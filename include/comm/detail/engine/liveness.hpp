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
// Every other rank gets the value at once and calls `on_dead(rank, why)` (an echo, below, after
// kEchoGrace), which fails the communicator (CommCore::note_peer_failure, then the engine:
// EngineCore::peer_failed closes the host transport, the NCCL engine aborts its communicator
// through the watchdog): its running operation ends with RemoteError naming the op, its number,
// this rank and the dead rank.
//
// The rank hosting the store server cannot report itself: a heartbeat that gets no answer for
// `silence` names it, and so does a watch connection the server closes, which is its host's death
// because a host that leaves normally says so first ("<rank>~|" on the key, stop()): its watchers
// then stop watching without a verdict.
//
// A rank whose operation failed on a closed connection publishes that too, on the same key
// ("<rank>!<blamed rank>|<its error>", announce_failure; the first death or failure stays): the
// other ranks fail at once, instead of at COMM_TIMEOUT where a closed connection alone would not
// wake them (after a link cut, a send libgloo had begun writing, a receive it had begun reading).
// Connection failures, and a desync only some ranks can see (UnsharedDesync: a header one receiver
// checks alone, announced before the close, "<rank>#<blamed rank>|"). Not a timeout or a desync
// that every rank sees on its own: naming the rank that was first to see it would hide the error
// each rank reports. Nor is a closed connection announced by a peer the cause at the rank it
// blames when that rank's own wait timed out: libgloo closes the connections of a wait that timed
// out, so the announcement is the timeout's echo, and that rank reports its Timeout
// (Verdict::echo: the watch holds such news for kEchoGrace, and the engine takes it only if it has
// not recorded a failure of its own by then).
//
// Cost: nothing on the operations' path (one thread, one request per silence/2 per rank, on
// another socket; the thread sleeps in the store's reply). Leaving costs one short connection: a
// rank that leaves normally withdraws its will first. Off with COMM_LIVENESS=0,
// for stores other than TcpStore (FileStore, HashStore), and for subgroups (their root watches).
//
//   COMM_LIVENESS=0|1              default 1
//   COMM_LIVENESS_INTERVAL=<dur>   the shortest heartbeat period, default 100ms
//   COMM_LIVENESS_SILENCE=<dur>    a rank silent this long is dead, default 2s (at least 4 periods)

#include <algorithm>
#include <charconv>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>

#include <comm/detail/base/env.hpp>
#include <comm/detail/base/logging.hpp>
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

/// A Store that forwards every key unchanged to another (a wrapper that logs, or rewrites values):
/// the liveness watch looks through it to the TcpStore underneath.
class WrappingStore {
 public:
  virtual ~WrappingStore() = default;
  [[nodiscard]] virtual Store* wrapped() const noexcept = 0;
};

/// The TcpStore under `store` (through PrefixStores and WrappingStores) and the prefix they add;
/// null if none.
[[nodiscard]] inline TcpStore* underlying_tcp_store(Store* store, std::string& prefix) {
  while (store != nullptr) {
    if (auto* t = dynamic_cast<TcpStore*>(store)) return t;
    if (auto* w = dynamic_cast<WrappingStore*>(store)) {
      store = w->wrapped();
      continue;
    }
    auto* p = dynamic_cast<PrefixStore*>(store);
    if (p == nullptr) return nullptr;
    prefix = p->prefix() + "/" + prefix;
    store = p->base().get();
  }
  return nullptr;
}

class Liveness {
  static constexpr std::size_t kAnnouncedMax = 1024;

 public:
  /// `echo`: the news is a closed connection announced by a rank that blames this one (Verdict).
  using OnDead = std::function<void(int rank, const std::string& why, bool echo)>;

  /// How long the watch holds an echo (Verdict::echo) before it tells the engine: longer than the
  /// path from libgloo's close to the engine's catch block on a loaded machine (in Hierarchical,
  /// through the members' teardown, which counts as the catch: CommCore::failing_scope), short
  /// beside the deadline an echo that is news would otherwise end at.
  static constexpr std::chrono::milliseconds kEchoGrace{250};

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
    const std::string key = prefix + Liveness::key(key_prefix);
    const int host = own->watch(key, std::to_string(rank) + "|", cfg.silence);
    return std::unique_ptr<Liveness>(new Liveness(std::move(own), key, rank, size, host, cfg, std::move(on_dead)));
  }

  Liveness(const Liveness&) = delete;
  Liveness& operator=(const Liveness&) = delete;
  ~Liveness() { stop(); }

  /// The key (under a communicator's prefix) every watcher of it wakes on, and where the server
  /// keeps each member's death on its own (tcp_store_requests.hpp: fire_will).
  [[nodiscard]] static std::string key(const std::string& key_prefix) { return key_prefix + "liveness/dead"; }
  [[nodiscard]] static std::string death_key(const std::string& key_prefix, int rank) {
    return key(key_prefix) + "/" + std::to_string(rank);
  }
  /// What revoke() publishes on key(): every member's watch fails its communicator, naming `rank`.
  [[nodiscard]] static std::string revoke_value(int rank, const std::string& reason) {
    return std::to_string(rank) + "^|" + reason.substr(0, kAnnouncedMax);
  }
  /// The rank hosting the store server (-1: none of this communicator's ranks, e.g. comm-run's).
  [[nodiscard]] int store_host() const noexcept { return host_; }

  struct Verdict {
    int rank = -1;    // the rank an error names
    std::string why;  // "rank 2 is dead: ...", "rank 1's operation failed: ..."
    int source = -1;  // the rank the news is about or from (a rank ignores its own)
    bool left = false;  // the store's host left normally: no verdict, the watch ends
    // A closed connection announced by a rank that blames this one. When this rank's own wait
    // has timed out, that is its echo: libgloo closes a context's connections when a wait times
    // out, so the peer fails on the close and may announce it before this rank has recorded its
    // Timeout (EngineCore::consult_liveness and peer_failed).
    bool echo = false;

    /// Whether this news is the cause of this rank's own failure, a Timeout or not.
    [[nodiscard]] bool explains(bool own_timeout) const noexcept { return !(echo && own_timeout); }
  };

  /// Asks the store now whether a rank of the communicator is dead (on a connection of its own,
  /// bounded by `timeout`, at most 200 ms): what a rank whose operation just failed uses to name the rank that caused it
  /// rather than a survivor that closed its connections first. Any thread.
  [[nodiscard]] std::optional<Verdict> verdict_now(std::chrono::milliseconds timeout) {
    {
      std::lock_guard g(io_mu_);
      if (verdict_) return verdict_;
      if (host_left_) return std::nullopt;
      if (store_lost_) return host_verdict();
    }
    // The watch thread's own heartbeat may be held by the server: ask on a connection of our own.
    try {
      TcpStore probe = short_connection(std::min(timeout, std::chrono::milliseconds(200)));
      if (probe.check(key_)) {
        auto d = parse(probe.get(key_));
        if (d.left) return std::nullopt;
        return d;
      }
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

  /// Publishes that this rank's operation failed on a closed connection (`blamed`: the rank it
  /// blames, -1 if none), or on a mismatch it diagnosed itself (`diagnosed`: UnsharedDesync),
  /// unless a death or failure is published already. On a connection of its own, at most 200 ms;
  /// never throws (the others then find out by their own means).
  void announce_failure(int blamed, const std::string& what, bool diagnosed = false) noexcept {
    try {
      TcpStore s = short_connection(std::chrono::milliseconds(200));
      // The server bounds values; an error's text is a few hundred bytes.
      publish_first(s, std::to_string(rank_) + (diagnosed ? "#" : "!") + std::to_string(blamed) + "|" +
                           what.substr(0, kAnnouncedMax));
    } catch (...) {
    }
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
    // connection of its own, which also answers that heartbeat at once. The store's host first
    // tells the others that it leaves (the server goes with it): their watches end without
    // taking the closed connection for its death.
    if (thread_.joinable()) {
      try {
        if (!finished_.load()) {
          TcpStore s = short_connection(std::chrono::milliseconds(200));
          if (host_ == rank_) publish_first(s, std::to_string(rank_) + "~|left");
          (void)s.watch(key_, std::to_string(rank_) + "|", std::chrono::milliseconds(0));
        }
      } catch (...) {  // the store is gone: nobody is left to be told
      }
      thread_.join();
    }
  }

 private:
  /// A short connection of its own to the store, bounded by `timeout`: the watch thread's own
  /// may be held by the server in a parked heartbeat.
  [[nodiscard]] TcpStore short_connection(std::chrono::milliseconds timeout) const {
    TcpStoreOptions o = store_->options();
    o.timeout = timeout;
    return TcpStore(store_->host(), store_->port(), o);
  }

  /// Sets the liveness key to `v` unless a death, failure or leave is there already: the first
  /// cause stays.
  void publish_first(TcpStore& s, const std::string& v) const {
    (void)s.compare_set(key_, {}, std::span(reinterpret_cast<const std::uint8_t*>(v.data()), v.size()));
  }

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
          if (d.left)
            host_left_ = true;
          else
            verdict_ = d;
        }
        // An echo is held for kEchoGrace first: the timeout it echoes ends this rank's wait at about
        // the moment the peer fails on the close, and the engine records that Timeout (peer_failed
        // then finds the communicator failed) unless the news came from elsewhere.
        if (!d.left && d.source != rank_ && (!d.echo || !stopped_within(kEchoGrace))) notify(d.rank, d.why, d.echo);
        break;  // one death is enough: the communicator has failed
      } catch (const Timeout&) {
        // The server did not answer for `silence`: the process hosting it is stopped or hung.
        std::optional<Verdict> d;
        if (host_ >= 0 && host_ < size_ && host_ != rank_)
          d = Verdict{host_,
                      "rank " + std::to_string(host_) + " is dead: the store server it hosts did not answer a heartbeat for " +
                          std::to_string(cfg_.silence.count()) + " ms (stopped, hung or cut off)",
                      host_};
        {
          std::lock_guard g(io_mu_);
          verdict_ = d;
        }
        if (d) notify(d->rank, d->why, false);
        withdraw = false;
        break;
      } catch (const RemoteError& e) {
        // The server closed the connection: its host died (one that leaves says so first), unless
        // no rank hosts it (then only the store is gone, not a rank).
        std::optional<Verdict> d;
        {
          std::lock_guard g(io_mu_);
          store_lost_ = true;
          if (!host_left_) d = host_verdict();
          if (d) verdict_ = d;
        }
        if (d && !stop_requested()) notify(d->rank, d->why, false);
        log(LogLevel::detail, std::string("comm: liveness watch ended: ") + e.what());
        withdraw = false;
        break;
      } catch (const std::exception& e) {
        // The store refused us, or this process is out of memory: no verdict.
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
    return Verdict{host_,
                   "rank " + std::to_string(host_) +
                       " is dead: the store server it hosted went away (the process exited or was killed)",
                   host_};
  }

  [[nodiscard]] bool stop_requested() {
    std::lock_guard g(mu_);
    return stop_;
  }
  /// Waits up to `d`; true if stop() came meanwhile.
  [[nodiscard]] bool stopped_within(std::chrono::milliseconds d) {
    std::unique_lock l(mu_);
    return cv_.wait_for(l, d, [&] { return stop_; });
  }

  [[nodiscard]] static int rank_in(std::string_view s) {
    int v = -1;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    return ec == std::errc() && end == s.data() + s.size() ? v : -1;
  }

  /// "<rank>|<reason>": the server fired a rank's will (a death); "<host>~|left": the store's
  /// host left normally; "<rank>!<blamed>|<error>": a rank's operation failed on a closed
  /// connection, "<rank>#<blamed>|<error>": on a mismatch it diagnosed (announce_failure);
  /// "<rank>^|<reason>": a rank revoked the communicator (revoke_value()).
  /// An announcement that blames this rank names its announcer: the rank this one failed to reach.
  [[nodiscard]] Verdict parse(const Store::Bytes& v) const { return parse_value(v, rank_, size_); }

 public:
  /// parse() as seen by rank `me` of a communicator of `size` ranks.
  [[nodiscard]] static Verdict parse_value(const Store::Bytes& v, int me, int size) {
    const std::string s(v.begin(), v.end());
    const auto bar = s.find('|');
    const std::string_view head = bar == std::string::npos ? std::string_view() : std::string_view(s).substr(0, bar);
    const std::string tail = bar == std::string::npos ? s : s.substr(bar + 1);
    Verdict d;
    if (head.ends_with('~')) {  // "<host>~|left": the store's host left normally
      d.source = rank_in(head.substr(0, head.size() - 1));
      d.left = true;
      return d;
    }
    if (head.ends_with('^')) {  // "<rank>^|<reason>": a rank revoked the communicator
      d.source = rank_in(head.substr(0, head.size() - 1));
      d.rank = d.source;
      d.why = "rank " + std::to_string(d.source) + " revoked the communicator" + (tail.empty() ? "" : ": " + tail);
      return d;
    }
    const auto bang = head.find_first_of("!#");
    d.source = rank_in(head.substr(0, bang));
    if (bang == std::string_view::npos) {
      d.rank = d.source;
      d.why = "rank " + std::to_string(d.source) + " is dead: " + tail;
      return d;
    }
    const int blamed = rank_in(head.substr(bang + 1));
    d.rank = blamed >= 0 && blamed < size && blamed != me ? blamed : d.source;
    d.echo = blamed == me && head[bang] == '!';
    d.why = "rank " + std::to_string(d.source) + "'s operation failed: " + tail;
    return d;
  }

 private:
  void notify(int dead, const std::string& reason, bool echo) noexcept {
    try {
      on_dead_(dead, reason, echo);
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
  std::mutex io_mu_;  // verdict_, store_lost_, host_left_ (store_ itself is the thread's alone)
  std::optional<Verdict> verdict_;
  bool store_lost_ = false;
  bool host_left_ = false;  // the store's host said it leaves: its server's end is no death
  std::thread thread_;  // last: starts after everything above
};

}  // namespace comm::detail
