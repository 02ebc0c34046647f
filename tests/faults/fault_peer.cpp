// fault_peer: the process the fault battery starts, stops and kills. One mode per role; every mode
// reads the launcher environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, COMM_STORE_TOKEN,
// COMM_TIMEOUT) the battery gives it, and reports on stdout in lines the battery parses:
//
//   READY ...                     set up (store served / connected / communicator created; the
//                                 gloo mode adds rank, size, pid and t_ns)
//   ITER <n>                      the first operations completed (printed at n = 1, 2, 4, 8, ...)
//   NEXT kind=<...> ms=<...>      after a failed operation: how the next one ended (see after_failure)
//   RESULT status=ok ...          finished without error
//   RESULT status=error kind=<Timeout|RemoteError|DesyncError|InvalidArgument|BackendError|Error> op=<op>
//          rank=<r> peer=<p> t_ns=<when, CLOCK_MONOTONIC> start_ns=<when the failing call began>
//          iter=<i> what=<the full message>
//
// Exit codes: 0 finished, 10 a comm::Error (RESULT says which), 11 another exception,
// 12 a wrong result, 2 bad arguments. Modes:
//
//   store-server [external]       host the TcpStore (as rank 0; `external`: as no rank, like a
//                                 launcher's agent) and serve until killed
//   store-get KEY                 connect as a client and block in get(KEY)
//   init                          env:// rendezvous only (init_env)
//   <backend> [options]           Communicator<B>::from_env for any backend of the list compiled in
//                                 here (gloo, shm, ...), then a loop of one collective:
//       --op all_reduce|broadcast|all_gather|gather|reduce_scatter|barrier   (all_reduce)
//       --dtype float|double|int32 (float)   --count N (1024)   --root R (0)   --reduce sum|max (sum)
//       --iters N (-1: until killed)         --async (every other op through comm::async)
//       --no-check (do not verify results)   --then-check (after the loop, one checked all_reduce)
//       --exit-at I --exit-code C            leave with code C before iteration I
//       --exit-rank R                        only rank R leaves (default: every rank)
//       --bad-buffers                        call every collective with wrong buffers first
//       --proxy-store                        connect the ranks through the battery's proxies
//                                            (Gloo; implies --client-store)
//       --client-store                       every rank, rank 0 too, is a client of a store
//                                            hosted elsewhere (the battery, a store-server)
//       --pace-ms M                          sleep M ms before each operation
//   cdb double-init | after-destroy          init_distributed() lifecycle checks (after-destroy
//                                            re-initializes on FAULT_REINIT_PORT when set)
// The gloo and cdb modes exist when comm::gloo is available.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <comm/init.hpp>
#if defined(COMM_HAS_GLOO)
#include <comm/backends/gloo.hpp>
#include <comm/backends/shm.hpp>
#include <comm/cdb.hpp>
#include <comm/communicator.hpp>
#endif
#include <comm/detail/engine/liveness.hpp>
#include <comm/store.hpp>

namespace {

using Clock = std::chrono::steady_clock;

constexpr int exit_comm_error = 10;
constexpr int exit_other = 11;
constexpr int exit_wrong = 12;

long long mono_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

const char* kind_of(const comm::Error& e) {
  if (dynamic_cast<const comm::DesyncError*>(&e)) return "DesyncError";
  if (dynamic_cast<const comm::Timeout*>(&e)) return "Timeout";
  if (dynamic_cast<const comm::RemoteError*>(&e)) return "RemoteError";
  if (dynamic_cast<const comm::InvalidArgument*>(&e)) return "InvalidArgument";
  if (dynamic_cast<const comm::BackendError*>(&e)) return "BackendError";
  return "Error";
}

std::string one_line(std::string s) {
  for (auto& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  return s;
}

void say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

// "rank 1" -> "rank_1": RESULT fields are separated by spaces.
std::string no_spaces(std::string s) {
  for (auto& ch : s)
    if (ch == ' ') ch = '_';
  return s;
}

int report(const comm::Error& e, long long start_ns, long long iter = -1) {
  const long long t = mono_ns();
  say(std::string("RESULT status=error kind=") + kind_of(e) + " op=" + e.op() + " rank=" + std::to_string(e.rank()) +
      " peer=" + (e.peer().empty() ? "-" : no_spaces(e.peer())) + " t_ns=" + std::to_string(t) +
      " start_ns=" + std::to_string(start_ns) + " iter=" + std::to_string(iter) + " what=" + one_line(e.what()));
  return exit_comm_error;
}

int report_other(const std::exception& e) {
  say(std::string("RESULT status=other t_ns=") + std::to_string(mono_ns()) + " what=" + one_line(e.what()));
  return exit_other;
}

// ---- store modes --------------------------------------------------------------------------------

comm::TcpStoreOptions store_options(bool server, bool external = false) {
  comm::TcpStoreOptions o;
  o.is_server = server;
  o.rank = server ? (external ? -1 : 0) : comm::detail::env_nonneg_int("RANK").value_or(1);
  o.timeout = comm::timeout_from_env();
  return o;
}

int store_server(bool external) {
  const auto addr = comm::detail::getenv_str("MASTER_ADDR").value_or("127.0.0.1");
  const auto port = comm::detail::parse_port("MASTER_PORT", comm::detail::getenv_str("MASTER_PORT").value_or(""));
  const long long t0 = mono_ns();
  try {
    comm::TcpStore s(addr, port, store_options(true, external));
    say("READY port=" + std::to_string(s.port()));
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  } catch (const comm::Error& e) {
    return report(e, t0);
  }
}

int store_get(const std::string& key) {
  const auto addr = comm::detail::getenv_str("MASTER_ADDR").value_or("127.0.0.1");
  const auto port = comm::detail::parse_port("MASTER_PORT", comm::detail::getenv_str("MASTER_PORT").value_or(""));
  long long t0 = mono_ns();
  try {
    comm::TcpStore s(addr, port, store_options(false));
    say("READY connected");
    t0 = mono_ns();
    auto v = s.get(key);
    say("RESULT status=ok value=" + std::string(v.begin(), v.end()));
    return 0;
  } catch (const comm::Error& e) {
    return report(e, t0);
  }
}

int init_only() {
  const long long t0 = mono_ns();
  try {
    auto r = comm::init_env();
    say("RESULT status=ok rank=" + std::to_string(r.rank) + " size=" + std::to_string(r.size));
    return 0;
  } catch (const comm::Error& e) {
    return report(e, t0);
  }
}

// ---- gloo mode ----------------------------------------------------------------------------------
#if defined(COMM_HAS_GLOO)
using Comm = comm::Communicator<comm::backends::Gloo>;
using ShmComm = comm::Communicator<comm::backends::Shm>;

struct Plan {
  std::string op = "all_reduce";
  std::string dtype = "float";
  std::size_t count = 1024;
  int root = 0;
  std::string reduce = "sum";
  long long iters = -1;
  bool async = false;
  bool check = true;
  bool then_check = false;
  long long exit_at = -1;
  int exit_code = 0;
  int exit_rank = -1;  // -1: every rank
  bool proxy_store = false;
  bool client_store = false;
  int pace_ms = 0;
  bool bad_buffers = false;
};

template <class T>
T value_for(int rank) {
  return static_cast<T>(rank + 1);
}

// One collective of the plan on element type T. Returns false when the result is wrong.
template <class T, class C>
bool run_once(C& c, const Plan& p, long long iter, std::vector<T>& a, std::vector<T>& b) {
  const int n = c.size(), me = c.rank();
  const auto un = static_cast<std::size_t>(n);
  const comm::ReduceOp red = p.reduce == "max" ? comm::ReduceOp::max : comm::ReduceOp::sum;
  const bool async = p.async && iter % 2 == 1;
  auto go = [&](auto&& blocking, auto&& asynchronous) {
    if (async)
      asynchronous().wait();
    else
      blocking();
  };
  if (p.op == "all_reduce") {
    a.assign(p.count, value_for<T>(me));
    go([&] { c.all_reduce(a, red); }, [&] { return c.all_reduce(a, red, comm::async); });
    if (!p.check || a.empty()) return true;
    const T want = red == comm::ReduceOp::sum ? static_cast<T>(n * (n + 1) / 2) : static_cast<T>(n);
    return a.front() == want && a.back() == want;
  }
  if (p.op == "broadcast") {
    a.assign(p.count, me == p.root ? static_cast<T>(7) : static_cast<T>(0));
    go([&] { c.broadcast(a, p.root); }, [&] { return c.broadcast(a, p.root, comm::async); });
    return !p.check || a.empty() || (a.front() == static_cast<T>(7) && a.back() == static_cast<T>(7));
  }
  if (p.op == "all_gather") {
    a.assign(p.count, value_for<T>(me));
    b.assign(p.count * un, T{});
    go([&] { c.all_gather(a, b); }, [&] { return c.all_gather(a, b, comm::async); });
    return !p.check || b.empty() || b.back() == value_for<T>(n - 1);
  }
  if (p.op == "gather") {
    a.assign(p.count, value_for<T>(me));
    b.assign(me == p.root ? p.count * un : 0, T{});
    go([&] { c.gather(a, b, p.root); }, [&] { return c.gather(a, b, p.root, comm::async); });
    return !p.check || b.empty() || b.back() == value_for<T>(n - 1);
  }
  if (p.op == "reduce_scatter") {
    a.assign(p.count * un, value_for<T>(me));
    b.assign(p.count, T{});
    go([&] { c.reduce_scatter(a, b, red); }, [&] { return c.reduce_scatter(a, b, red, comm::async); });
    return !p.check || b.empty() || red != comm::ReduceOp::sum || b.front() == static_cast<T>(n * (n + 1) / 2);
  }
  if (p.op == "barrier") {
    go([&] { c.barrier(); }, [&] { return c.barrier(comm::async); });
    return true;
  }
  throw std::invalid_argument("unknown --op " + p.op);
}

// Every collective with wrong buffers: each must throw InvalidArgument at once, naming the op.
template <class C>
int bad_buffers(C& c) {
  const auto n = static_cast<std::size_t>(c.size());
  std::vector<float> a(5), b(6), big(n * 4 + 1), small(3);
  struct Case {
    const char* op;
    std::function<void()> call;
  };
  const Case cases[] = {
      {"all_reduce", [&] { c.all_reduce(a, b); }},
      {"all_gather", [&] { c.all_gather(a, b); }},
      {"reduce_scatter", [&] { c.reduce_scatter(big, small); }},
      {"broadcast", [&] { c.broadcast(a, c.size()); }},
      {"broadcast", [&] { c.broadcast(a, -1); }},
      {"gather", [&] { c.gather(a, small, c.size() + 3); }},
      {"all_reduce", [&] { c.all_reduce(std::span<const float>(a).subspan(1), std::span<float>(a).first(4)); }},
  };
  int wrong = 0;
  for (const auto& k : cases) {
    const long long t0 = mono_ns();
    try {
      k.call();
      say(std::string("BAD no error from ") + k.op);
      ++wrong;
    } catch (const comm::InvalidArgument& e) {
      const double us = static_cast<double>(mono_ns() - t0) / 1e3;
      const bool named = std::string(e.what()).find(k.op) != std::string::npos && e.rank() == c.rank();
      say(std::string("BADBUF op=") + k.op + " us=" + std::to_string(us) + " named=" + (named ? "1" : "0") +
          " what=" + one_line(e.what()));
      if (!named) ++wrong;
    } catch (const comm::Error& e) {
      say(std::string("BAD wrong error type from ") + k.op + ": " + kind_of(e) + " " + e.what());
      ++wrong;
    }
  }
  return wrong;
}

// After a failed operation: the next operation must fail at once with the first cause. It also
// waits until the failed operation has really ended: when Work::wait() gives up by its own
// deadline, the operation may still run and write into the buffers (the Work contract: buffers
// stay alive until the operation completes), so the caller keeps them alive until this returns.
// And it orders the op-queue thread's release of the failed Work before this thread's, so the
// exception object dies here (TSan cannot see libstdc++'s exception_ptr refcount otherwise).
template <class C>
void after_failure(C& c) {
  const long long t0 = mono_ns();
  std::string kind = "none";
  try {
    c.barrier();
  } catch (const comm::Error& e) {
    kind = kind_of(e);
  }
  say("NEXT kind=" + kind + " ms=" + std::to_string(static_cast<double>(mono_ns() - t0) / 1e6));
}

template <class T, class C>
int collective_loop(C& c, const Plan& p) {
  std::vector<T> a, b;
  long long next_report = 1;
  for (long long i = 0; p.iters < 0 || i < p.iters; ++i) {
    if (i == p.exit_at && (p.exit_rank < 0 || p.exit_rank == c.rank())) {
      say("EXITING code=" + std::to_string(p.exit_code) + " t_ns=" + std::to_string(mono_ns()));
      std::exit(p.exit_code);
    }
    if (p.pace_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(p.pace_ms));
    const long long t0 = mono_ns();
    try {
      if (!run_once<T>(c, p, i, a, b)) {
        say("RESULT status=wrong iter=" + std::to_string(i));
        return exit_wrong;
      }
    } catch (const comm::Error& e) {
      const int rc = report(e, t0, i);
      after_failure(c);  // a, b stay alive until the failed operation has really ended
      return rc;
    }
    if (i + 1 == next_report) {
      say("ITER " + std::to_string(i + 1));
      next_report *= 2;
    }
  }
  if (p.then_check) {
    const long long t0 = mono_ns();
    try {
      std::vector<std::int32_t> v{1};
      c.all_reduce(v);
      if (v[0] != c.size()) {
        say("RESULT status=wrong then_check=" + std::to_string(v[0]));
        return exit_wrong;
      }
    } catch (const comm::Error& e) {
      return report(e, t0, p.iters);
    }
  }
  say("RESULT status=ok iters=" + std::to_string(p.iters) + " t_ns=" + std::to_string(mono_ns()));
  return 0;
}

// A store that routes gloo's connections through proxies the battery runs. gloo (this version)
// publishes, per rank, the address of its listening socket for every pair under
// "comm/gloo/<seq>/<device>/<rank>", and of each pair the side with the greater address connects.
// Every rank binds 127.0.0.2; reading the address of a higher rank, a rank asks the battery for a
// proxy to it (keys proxy/req/<me>/<peer> -> proxy/port/<me>/<peer>) and sees 127.0.0.1:<proxy>,
// which compares lower, so it connects, to the proxy; reading a lower rank's address, it sees
// 127.0.0.3, which compares higher, so it listens. Only the battery's fault_peer uses this.
class ProxiedStore final : public comm::Store, public comm::detail::WrappingStore {
 public:
  ProxiedStore(std::shared_ptr<comm::Store> base, int rank, int size)
      : Store(base->timeout()), base_(std::move(base)), rank_(rank), size_(size) {
    set_rank(rank);
  }
  using Store::set;
  using Store::wait;
  void set(std::string_view k, std::span<const std::uint8_t> v) override { base_->set(k, v); }
  std::int64_t add(std::string_view k, std::int64_t d) override { return base_->add(k, d); }
  Bytes compare_set(std::string_view k, std::span<const std::uint8_t> e, std::span<const std::uint8_t> d) override {
    return base_->compare_set(k, e, d);
  }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds t) override { base_->wait(keys, t); }
  std::int64_t num_keys() override { return base_->num_keys(); }
  bool delete_key(std::string_view k) override { return base_->delete_key(k); }
  bool check(std::string_view k) override { return base_->check(k); }
  // Keys are the base's: the liveness watch runs on the store server behind it (the link cuts
  // leave store connections alone).
  [[nodiscard]] comm::Store* wrapped() const noexcept override { return base_.get(); }

  Bytes get(std::string_view key) override {
    Bytes v = base_->get(key);
    const int peer = address_key_rank(key);
    if (peer < 0 || peer == rank_ || size_ < 2 || v.size() % static_cast<std::size_t>(size_ - 1) != 0) return v;
    const std::size_t per = v.size() / static_cast<std::size_t>(size_ - 1);
    const std::size_t at = static_cast<std::size_t>(rank_ > peer ? rank_ - 1 : rank_) * per;
    sockaddr_in sa{};
    if (per < sizeof sa) return v;
    std::memcpy(&sa, v.data() + at, sizeof sa);
    if (sa.sin_family != AF_INET) return v;
    if (rank_ < peer) {
      char ip[INET_ADDRSTRLEN] = {};
      ::inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof ip);
      const std::string pair = std::to_string(rank_) + "/" + std::to_string(peer);
      base_->set("proxy/req/" + pair, std::string(ip) + ":" + std::to_string(ntohs(sa.sin_port)));
      const auto port = base_->get("proxy/port/" + pair);
      sa.sin_port = htons(static_cast<std::uint16_t>(std::stoi(std::string(port.begin(), port.end()))));
      ::inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    } else {
      ::inet_pton(AF_INET, "127.0.0.3", &sa.sin_addr);
    }
    std::memcpy(v.data() + at, &sa, sizeof sa);
    return v;
  }

 private:
  // "comm/gloo/<seq>/<device>/<rank>" -> rank, else -1.
  static int address_key_rank(std::string_view key) {
    if (!key.starts_with("comm/gloo/")) return -1;
    int slashes = 0;
    for (char ch : key) slashes += ch == '/' ? 1 : 0;
    const auto last = key.substr(key.rfind('/') + 1);
    if (slashes != 4 || last.empty() || last.find_first_not_of("0123456789") != std::string_view::npos) return -1;
    return std::stoi(std::string(last));
  }

  std::shared_ptr<comm::Store> base_;
  int rank_, size_;
};

// --client-store: this rank's store is a client of the server at MASTER_ADDR:MASTER_PORT, which
// some other process hosts (env:// would host it in rank 0).
struct ClientStore {
  int rank, size;
  std::shared_ptr<comm::TcpStore> store;
};
ClientStore connect_client_store(std::chrono::milliseconds timeout) {
  ClientStore c;
  c.rank = comm::detail::required_env_int("RANK", "fault_peer");
  c.size = comm::detail::required_env_int("WORLD_SIZE", "fault_peer");
  const auto addr = comm::detail::getenv_str("MASTER_ADDR").value_or("127.0.0.1");
  const auto port = comm::detail::parse_port("MASTER_PORT", comm::detail::getenv_str("MASTER_PORT").value_or(""));
  comm::TcpStoreOptions so;
  so.rank = c.rank;
  so.timeout = timeout;
  c.store = std::make_shared<comm::TcpStore>(addr, port, so);
  c.store->set_rank(c.rank);
  return c;
}

Comm create_via_proxies(comm::backends::Gloo::Options o) {
  auto c = connect_client_store(o.timeout);  // the battery hosts the server
  o.hostname = "127.0.0.2";
  return Comm::create(std::make_shared<ProxiedStore>(c.store, c.rank, c.size), c.rank, c.size, o);
}

// The plan on a communicator made by `make` (one backend's).
template <class Make>
int backend_mode(const Plan& p, Make&& make) {
  long long t0 = mono_ns();
  try {
    auto c = make();
    say("READY rank=" + std::to_string(c.rank()) + " size=" + std::to_string(c.size()) + " pid=" +
        std::to_string(::getpid()) + " t_ns=" +
        std::to_string(mono_ns()) + " init_ms=" + std::to_string((mono_ns() - t0) / 1000000));
    if (p.bad_buffers && bad_buffers(c) != 0) return exit_wrong;
    if (p.dtype == "float") return collective_loop<float>(c, p);
    if (p.dtype == "double") return collective_loop<double>(c, p);
    if (p.dtype == "int32") return collective_loop<std::int32_t>(c, p);
    say("bad --dtype " + p.dtype);
    return 2;
  } catch (const comm::Error& e) {
    return report(e, t0);
  }
}

// ---- cdb mode -----------------------------------------------------------------------------------

int check(bool ok, const std::string& what) {
  say(std::string(ok ? "STEP ok " : "STEP FAILED ") + what);
  return ok ? 0 : 1;
}

template <class E, class F>
int expect_throw(const std::string& what, F&& f, std::string_view text) {
  try {
    f();
  } catch (const E& e) {
    const bool has = std::string(e.what()).find(text) != std::string::npos;
    return check(has, what + ": " + kind_of(e) + ": " + e.what());
  } catch (const std::exception& e) {
    return check(false, what + ": wrong exception: " + e.what());
  }
  return check(false, what + ": no exception");
}

int all_reduce_ok(comm::AnyCommunicator& w, const std::string& what) {
  std::vector<std::int32_t> v{1};
  w.all_reduce(v);
  return check(v[0] == w.size(), what + " (all_reduce gave " + std::to_string(v[0]) + ")");
}

int cdb(const std::string& scenario) {
  const long long t0 = mono_ns();
  int bad = 0;
  try {
    comm::InitOptions o;
    o.backend = "gloo";
    auto& w = comm::init_distributed(o);
    bad += all_reduce_ok(w, "first init");
    if (scenario == "double-init") {
      auto& again = comm::init_distributed(o);
      bad += check(&again == &w, "a second init_distributed returns the same world");
      comm::InitOptions other = o;
      other.world_size = w.size() + 1;
      bad += expect_throw<comm::InvalidArgument>("init with another world_size", [&] { (void)comm::init_distributed(other); },
                                                 "conflicts with the initialized world's size");
      other = o;
      other.rank = (w.rank() + 1) % (w.size() + 1);
      bad += expect_throw<comm::InvalidArgument>("init with another rank", [&] { (void)comm::init_distributed(other); },
                                                 "conflicts with the initialized world's rank");
      other = o;
      other.backend = "nccl";
      bad += expect_throw<comm::InvalidArgument>("init with another backend", [&] { (void)comm::init_distributed(other); },
                                                 "nccl");
      bad += all_reduce_ok(w, "the world still works");
    } else if (scenario == "after-destroy") {
      std::vector<float> v(1 << 16, 1.0f);
      auto work = w.all_reduce(v, comm::ReduceOp::sum, comm::async);
      const long long td = mono_ns();
      comm::destroy();
      say("DESTROY ms=" + std::to_string((mono_ns() - td) / 1000000));
      bool settled = false;
      try {
        work.wait();  // finished by destroy (or failed): it must not hang or crash
        settled = v[0] == static_cast<float>(comm::detail::env_nonneg_int("WORLD_SIZE").value_or(0));
      } catch (const comm::Error& e) {
        settled = true;
        say(std::string("WORK error after destroy: ") + e.what());
      }
      bad += check(settled, "a Work issued before destroy() completes");
      bad += check(!comm::is_initialized(), "is_initialized() is false after destroy()");
      bad += expect_throw<comm::Error>("world() after destroy", [] { (void)comm::world(); }, "not initialized");
      comm::destroy();
      bad += check(true, "destroy() twice is harmless");
      // A new world on a new port: on the old one a fast rank may still reach the previous
      // world's store on rank 0 before rank 0's destroy() closed it (see docs/RELIABILITY.md).
      if (const auto port = comm::detail::getenv_str("FAULT_REINIT_PORT")) ::setenv("MASTER_PORT", port->c_str(), 1);
      auto& w2 = comm::init_distributed(o);
      bad += all_reduce_ok(w2, "init_distributed after destroy gives a working world");
      comm::destroy();
    } else {
      say("bad cdb scenario " + scenario);
      return 2;
    }
  } catch (const comm::Error& e) {
    return report(e, t0);
  }
  say(bad == 0 ? "RESULT status=ok" : "RESULT status=wrong");
  return bad == 0 ? 0 : exit_wrong;
}

#endif  // COMM_HAS_GLOO

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "fault_peer: %s\n", why.c_str());
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  ::signal(SIGPIPE, SIG_IGN);
  if (argc < 2) usage("no mode");
  const std::string mode = argv[1];
  try {
    if (mode == "store-server") return store_server(argc > 2 && std::string(argv[2]) == "external");
    if (mode == "store-get") return store_get(argc > 2 ? argv[2] : "never-set");
    if (mode == "init") return init_only();
#if defined(COMM_HAS_GLOO)
    if (mode == "cdb") return cdb(argc > 2 ? argv[2] : "");
    if (const auto* b = comm::backends::find_backend(mode); b != nullptr && b->compiled_in) {
      Plan p;
      for (int i = 2; i < argc; ++i) {
        const std::string a = argv[i];
        auto next = [&]() -> std::string {
          if (i + 1 >= argc) usage(a + " needs a value");
          return argv[++i];
        };
        if (a == "--op") p.op = next();
        else if (a == "--dtype") p.dtype = next();
        else if (a == "--count") p.count = std::stoul(next());
        else if (a == "--root") p.root = std::stoi(next());
        else if (a == "--reduce") p.reduce = next();
        else if (a == "--iters") p.iters = std::stoll(next());
        else if (a == "--async") p.async = true;
        else if (a == "--no-check") p.check = false;
        else if (a == "--then-check") p.then_check = true;
        else if (a == "--exit-at") p.exit_at = std::stoll(next());
        else if (a == "--exit-code") p.exit_code = std::stoi(next());
        else if (a == "--exit-rank") p.exit_rank = std::stoi(next());
        else if (a == "--proxy-store") p.proxy_store = true;
        else if (a == "--client-store") p.client_store = true;
        else if (a == "--pace-ms") p.pace_ms = std::stoi(next());
        else if (a == "--bad-buffers") p.bad_buffers = true;
        else usage("unknown option " + a);
      }
      // Any backend of the list (comm/backends/list.hpp) compiled in here, by its name.
      int code = 2;
      comm::backends::for_each_backend([&]<class B>(std::type_identity<B>, std::string_view name) {
        if (name != mode) return;
        code = backend_mode(p, [&] {
          typename B::Options o;  // timeout: COMM_TIMEOUT
          if constexpr (std::is_same_v<B, comm::backends::Gloo>) {
            if (p.proxy_store) return create_via_proxies(o);
          }
          if (!p.client_store) return comm::Communicator<B>::from_env(o);
          auto c = connect_client_store(o.timeout);
          return comm::Communicator<B>::create(c.store, c.rank, c.size, o);
        });
      });
      return code;
    }
#endif
    usage("unknown mode " + mode);
  } catch (const comm::Error& e) {
    return report(e, mono_ns());
  } catch (const std::exception& e) {
    return report_other(e);
  }
}
