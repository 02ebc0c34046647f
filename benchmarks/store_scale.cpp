// comm-bench-store-scale: the control plane of an N-rank job, simulated on loopback.
//
// A child process hosts comm's TcpStore server (so its CPU time is its own, read from /proc);
// this process plays N ranks from a few threads, each rank a state machine on its own
// non-blocking connections speaking the store protocol (detail/store/protocol.hpp), so that all N
// are in flight at once as real ranks would be. Three phases, each bounded in time:
//
//   rendezvous  every rank connects, publishes its record (set "<run>/member/<r>"), waits for all
//               and reads all: --pattern batched is what comm does now (one multi_get, the
//               highest rank's key first), batched-ascending the same lowest first (as comm
//               asked before 2026-12-05),
//               --pattern per-key what it did before (a wait and a get per other rank);
//   watch       every rank opens a second connection with a will (Op::watch, the liveness key)
//               and keeps a heartbeat parked on it, renewed when answered (every silence/2), as
//               detail/engine/liveness.hpp does; the rendezvous connections stay open, idle.
//               The server's CPU over --steady seconds is the steady-state cost;
//   death       one rank's watch connection is closed (a process death closes it the same way);
//               the time until every survivor's heartbeat returns with the death is measured.
//
// One JSON line per N (schema store-scale/1). Example:
//   comm-bench-store-scale --ranks 256,1024,4096 --threads 2 --steady 5
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <arpa/inet.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <comm/store.hpp>

namespace {

namespace sp = comm::detail::store_proto;
using Clock = std::chrono::steady_clock;
using Bytes = std::vector<std::uint8_t>;

double secs(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

struct Args {
  std::vector<int> ranks{256, 1024, 4096};
  int threads = 2;
  bool batched = true;
  bool descending = true;  // the multi_get's keys highest rank first
  int silence_ms = 2000;
  double steady_s = 5;
  double bound_s = 120;  // per phase
};

// --- the server, in a child process ----------------------------------------------------------

struct Server {
  pid_t pid = -1;
  int port = 0;
  int ctl = -1;  // closing it stops the child
};

Server start_server(std::size_t max_connections) {
  int ports[2], ctl[2];
  if (::pipe(ports) != 0 || ::pipe(ctl) != 0) std::abort();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(ports[0]);
    ::close(ctl[1]);
    comm::detail::TcpStoreServerConfig cfg;
    cfg.max_connections = max_connections;
    comm::detail::TcpStoreServer server("127.0.0.1", 0, cfg, -1);
    const int port = server.port();
    if (::write(ports[1], &port, sizeof port) != sizeof port) _exit(2);
    char c;
    while (::read(ctl[0], &c, 1) > 0) {
    }
    _exit(0);
  }
  ::close(ports[1]);
  ::close(ctl[0]);
  Server s;
  s.pid = pid;
  s.ctl = ctl[1];
  if (::read(ports[0], &s.port, sizeof s.port) != sizeof s.port) {
    std::fprintf(stderr, "store server did not start\n");
    std::exit(1);
  }
  ::close(ports[0]);
  return s;
}

void stop_server(Server& s) {
  ::close(s.ctl);
  int st = 0;
  ::waitpid(s.pid, &st, 0);
}

// utime + stime of a process, seconds.
double cpu_of(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string all((std::istreambuf_iterator<char>(f)), {});
  const auto close = all.rfind(')');
  std::istringstream in(all.substr(close + 2));
  std::string field;
  long long ut = 0, st = 0;
  for (int i = 3; i <= 15 && in >> field; ++i) {
    if (i == 14) ut = std::stoll(field);
    if (i == 15) st = std::stoll(field);
  }
  return static_cast<double>(ut + st) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

// --- the simulated ranks -----------------------------------------------------------------------

enum class St { hello, set, multi_get, wait_one, get_one, done, w_hello, w_watch, w_beat, w_dead, closed };

struct Link {
  int fd = -1;
  Bytes in, out;
  std::size_t out_off = 0;
  bool hello_done = false;
};

struct Rank {
  int r = 0;
  St st = St::hello;
  Link main, watch;
  int next_peer = 0;
  Clock::time_point seen{};
};

struct Shared {
  Args a;
  int n = 0;
  int port = 0;
  std::string run;
  std::atomic<int> rdv_done{0}, watching{0}, seen{0}, errors{0};
  std::atomic<bool> go_watch{false}, kill{false}, stop{false};
  std::atomic<long long> killed_at_ns{0};
  int victim = 0;
  std::vector<double> seen_s;  // per rank (written by its thread)
  // Every member key in wire form, and where each starts: a rank's multi_get is this less its own
  // (built once: the ranks of a real job build theirs in parallel, on their own cores).
  Bytes all_keys;
  std::vector<std::size_t> key_off;
  // The place of rank r's key in all_keys (and of the i-th key's rank: the map is its own inverse).
  [[nodiscard]] int place_of(int r) const noexcept { return a.descending ? n - 1 - r : r; }
};

void put_frame(Link& l, sp::Op op, auto&& fields) {
  const std::size_t at = sp::begin_frame(l.out);
  l.out.push_back(static_cast<std::uint8_t>(op));
  sp::Writer w(l.out);
  fields(w);
  sp::finish_frame(l.out, at);
}

int open_link(int port, int rank) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    std::perror("socket");
    std::exit(1);
  }
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<std::uint16_t>(port));
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  while (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
    if (errno != EINTR) {
      std::perror("connect");
      std::exit(1);
    }
  }
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  const auto hello = sp::encode_hello("", rank);
  if (::send(fd, hello.data(), hello.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(hello.size())) std::exit(1);
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  return fd;
}

class Driver {
 public:
  Driver(Shared& s, int t) : s_(s), ep_(::epoll_create1(EPOLL_CLOEXEC)) {
    for (int r = t; r < s.n; r += s.a.threads) {
      Rank rk;
      rk.r = r;
      ranks_.push_back(std::move(rk));
    }
  }
  ~Driver() { ::close(ep_); }

  void run() {
    for (std::size_t i = 0; i < ranks_.size(); ++i) {
      ranks_[i].main.fd = open_link(s_.port, ranks_[i].r);
      add(ranks_[i].main.fd, 2 * i);
    }
    loop([&] { return rdv_count_ == ranks_.size(); });
    while (!s_.go_watch.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    for (std::size_t i = 0; i < ranks_.size(); ++i) {
      ranks_[i].watch.fd = open_link(s_.port, ranks_[i].r);
      ranks_[i].st = St::w_hello;
      add(ranks_[i].watch.fd, 2 * i + 1);
    }
    loop([&] { return s_.stop.load(); });
    for (auto& r : ranks_) {
      if (r.main.fd >= 0) ::close(r.main.fd);
      if (r.watch.fd >= 0) ::close(r.watch.fd);
    }
  }

 private:
  void add(int fd, std::uint64_t tag) {
    epoll_event e{};
    e.events = EPOLLIN;
    e.data.u64 = tag;
    ::epoll_ctl(ep_, EPOLL_CTL_ADD, fd, &e);
  }

  template <class Done>
  void loop(Done&& done) {
    std::vector<epoll_event> evs(512);
    const auto bound = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s_.a.bound_s));
    while (!done()) {
      if (Clock::now() > bound && !s_.stop.load()) {
        std::fprintf(stderr, "store-scale: a phase passed its bound of %.0f s\n", s_.a.bound_s);
        std::exit(3);
      }
      const int n = ::epoll_wait(ep_, evs.data(), static_cast<int>(evs.size()), 5);
      for (int i = 0; i < n; ++i) {
        const auto tag = evs[static_cast<std::size_t>(i)].data.u64;
        Rank& r = ranks_[tag / 2];
        Link& l = tag % 2 == 0 ? r.main : r.watch;
        if (l.fd < 0) continue;
        read_from(r, l);
      }
      if (s_.kill.load() && !killed_) {
        killed_ = true;
        for (auto& r : ranks_)
          if (r.r == s_.victim) {
            s_.killed_at_ns.store(Clock::now().time_since_epoch().count());
            ::close(r.watch.fd);  // what the kernel does when the process dies
            r.watch.fd = -1;
            r.st = St::closed;
          }
      }
    }
  }

  void flush(Link& l) {
    while (l.out_off < l.out.size()) {
      const ssize_t k = ::send(l.fd, l.out.data() + l.out_off, l.out.size() - l.out_off, MSG_NOSIGNAL);
      if (k > 0) {
        l.out_off += static_cast<std::size_t>(k);
        continue;
      }
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && errno == EAGAIN) {
        // Requests are small; a full send buffer means the server is behind: wait for it.
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        continue;
      }
      std::fprintf(stderr, "store-scale: send failed: %s\n", std::strerror(errno));
      std::exit(1);
    }
    l.out.clear();
    l.out_off = 0;
  }

  void read_from(Rank& r, Link& l) {
    std::uint8_t buf[1 << 16];
    for (;;) {
      const ssize_t k = ::recv(l.fd, buf, sizeof buf, 0);
      if (k > 0) {
        l.in.insert(l.in.end(), buf, buf + k);
        continue;
      }
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && errno == EAGAIN) break;
      std::fprintf(stderr, "store-scale: rank %d: the server closed a connection\n", r.r);
      std::exit(1);
    }
    std::size_t off = 0;
    for (;;) {
      const std::span<const std::uint8_t> rest(l.in.data() + off, l.in.size() - off);
      if (!l.hello_done) {
        if (rest.size() < sp::hello_reply_size) break;
        sp::Reader rd(rest);
        (void)rd.u32();
        (void)rd.u16();
        const auto status = rd.u8();
        const std::size_t mlen = rd.u16();
        if (rest.size() < sp::hello_reply_size + mlen) break;
        if (status != 0) {
          std::fprintf(stderr, "store-scale: rank %d refused (status %d)\n", r.r, status);
          std::exit(1);
        }
        off += sp::hello_reply_size + mlen;
        l.hello_done = true;
        on_reply(r, l, {});
        continue;
      }
      if (rest.size() < sp::frame_header_size) break;
      const auto len = sp::read_u64(rest.data());
      if (rest.size() < sp::frame_header_size + len) break;
      on_reply(r, l, rest.subspan(sp::frame_header_size, static_cast<std::size_t>(len)));
      off += sp::frame_header_size + static_cast<std::size_t>(len);
    }
    l.in.erase(l.in.begin(), l.in.begin() + static_cast<std::ptrdiff_t>(off));
    flush(l);
  }

  std::string member_key(int p) const { return s_.run + "/member/" + std::to_string(p); }
  std::string dead_key() const { return s_.run + "/liveness/dead"; }

  void next_per_key(Rank& r) {
    if (r.next_peer == r.r) ++r.next_peer;
    if (r.next_peer >= s_.n) return finish_rdv(r);
    const auto k = member_key(r.next_peer);
    r.st = St::wait_one;
    put_frame(r.main, sp::Op::wait, [&](sp::Writer& w) {
      w.u32(1);
      w.str(k);
      w.u64(60000);
    });
  }

  void finish_rdv(Rank& r) {
    r.st = St::done;
    ++rdv_count_;
    s_.rdv_done.fetch_add(1);
  }

  void on_reply(Rank& r, Link& l, std::span<const std::uint8_t> p) {
    if (!p.empty() && p[0] != 0) {
      sp::Reader rd(p);
      (void)rd.u8();
      std::fprintf(stderr, "store-scale: rank %d: error reply %d in state %d\n", r.r, p[0], static_cast<int>(r.st));
      std::exit(1);
    }
    switch (r.st) {
      case St::hello: {
        r.st = St::set;
        const std::string v = std::to_string(s_.n) + "|" + std::to_string(100000 + r.r) + "|node-" +
                              std::to_string(r.r / 8) + ".cluster.example";
        const auto k = member_key(r.r);
        put_frame(l, sp::Op::set, [&](sp::Writer& w) {
          w.str(k);
          w.str(v);
        });
        return;
      }
      case St::set:
        if (!s_.a.batched) return next_per_key(r);
        r.st = St::multi_get;
        put_frame(l, static_cast<sp::Op>(11), [&](sp::Writer& w) {
          w.u32(static_cast<std::uint32_t>(s_.n - 1));
          const auto* k = s_.all_keys.data();
          const auto me = static_cast<std::size_t>(s_.place_of(r.r));
          w.raw(std::span(k, s_.key_off[me]));
          w.raw(std::span(k + s_.key_off[me + 1], s_.all_keys.size() - s_.key_off[me + 1]));
          w.u64(60000);
        });
        return;
      case St::multi_get: {
        sp::Reader rd(p);
        (void)rd.u8();
        if (rd.u32() != static_cast<std::uint32_t>(s_.n - 1)) {
          std::fprintf(stderr, "store-scale: rank %d: multi_get returned a wrong count\n", r.r);
          std::exit(1);
        }
        return finish_rdv(r);
      }
      case St::wait_one: {
        r.st = St::get_one;
        const auto k = member_key(r.next_peer);
        put_frame(l, sp::Op::get, [&](sp::Writer& w) {
          w.str(k);
          w.u64(60000);
        });
        return;
      }
      case St::get_one:
        ++r.next_peer;
        return next_per_key(r);
      case St::w_hello: {
        r.st = St::w_watch;
        const auto k = dead_key();
        const auto v = std::to_string(r.r) + "|";
        put_frame(l, sp::Op::watch, [&](sp::Writer& w) {
          w.str(k);
          w.str(v);
          w.u64(static_cast<std::uint64_t>(s_.a.silence_ms));
        });
        return;
      }
      case St::w_watch:
        r.st = St::w_beat;
        s_.watching.fetch_add(1);
        return beat(l);
      case St::w_beat: {
        sp::Reader rd(p);
        (void)rd.u8();
        if (rd.u8() == 0) return beat(l);
        r.st = St::w_dead;
        const double dt = static_cast<double>(Clock::now().time_since_epoch().count() - s_.killed_at_ns.load()) * 1e-9;
        s_.seen_s[static_cast<std::size_t>(r.r)] = dt;
        s_.seen.fetch_add(1);
        return;
      }
      default:
        std::fprintf(stderr, "store-scale: rank %d: unexpected reply in state %d\n", r.r, static_cast<int>(r.st));
        std::exit(1);
    }
  }

  void beat(Link& l) {
    put_frame(l, sp::Op::heartbeat, [&](sp::Writer& w) { w.u64(static_cast<std::uint64_t>(s_.a.silence_ms / 2)); });
  }

  Shared& s_;
  int ep_;
  std::vector<Rank> ranks_;
  std::size_t rdv_count_ = 0;
  bool killed_ = false;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void run_one(const Args& a, int n) {
  Server srv = start_server(static_cast<std::size_t>(2 * n + 256));
  Shared s;
  s.a = a;
  s.n = n;
  s.port = srv.port;
  s.run = "scale" + std::to_string(n);
  s.victim = n / 2;
  s.seen_s.assign(static_cast<std::size_t>(n), -1);
  {
    // Highest rank first, as detail/engine/membership.hpp asks (key_off[i]: where the i-th key
    // starts; place_of: a rank's i).
    sp::Writer w(s.all_keys);
    for (int i = 0; i < n; ++i) {
      s.key_off.push_back(s.all_keys.size());
      w.str(s.run + "/member/" + std::to_string(s.place_of(i)));
    }
    s.key_off.push_back(s.all_keys.size());
  }
  const double cpu0 = cpu_of(srv.pid);
  const auto t0 = Clock::now();
  std::vector<std::thread> th;
  for (int t = 0; t < a.threads; ++t) th.emplace_back([&s, t] { Driver(s, t).run(); });
  auto wait_for = [&](auto&& cond, const char* what) {
    const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(a.bound_s));
    while (!cond()) {
      if (Clock::now() > until) {
        std::fprintf(stderr, "store-scale: N=%d: %s not reached within %.0f s\n", n, what, a.bound_s);
        std::exit(3);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  };
  wait_for([&] { return s.rdv_done.load() == n; }, "rendezvous");
  const double rdv = secs(Clock::now() - t0);
  const double cpu_rdv = cpu_of(srv.pid) - cpu0;
  const auto tw = Clock::now();
  s.go_watch = true;
  wait_for([&] { return s.watching.load() == n; }, "every watch open");
  const double watch_setup = secs(Clock::now() - tw);
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));  // every heartbeat renewed once
  const double c0 = cpu_of(srv.pid);
  const auto ts = Clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double>(a.steady_s));
  const double steady_cpu = (cpu_of(srv.pid) - c0) / secs(Clock::now() - ts);
  s.kill = true;
  wait_for([&] { return s.seen.load() == n - 1; }, "the death seen by every survivor");
  std::vector<double> seen;
  for (int r = 0; r < n; ++r)
    if (r != s.victim) seen.push_back(s.seen_s[static_cast<std::size_t>(r)]);
  s.stop = true;
  for (auto& t : th) t.join();
  stop_server(srv);
  std::printf(
      "{\"schema\":\"store-scale/1\",\"ranks\":%d,\"pattern\":\"%s\",\"threads\":%d,\"rendezvous_s\":%.3f,"
      "\"rendezvous_server_cpu_s\":%.2f,\"watch_setup_s\":%.3f,\"silence_ms\":%d,\"steady_server_cpu_frac\":%.4f,"
      "\"death_seen_median_ms\":%.2f,\"death_seen_max_ms\":%.2f}\n",
      n, !a.batched ? "per-key" : a.descending ? "batched" : "batched-ascending", a.threads, rdv, cpu_rdv, watch_setup, a.silence_ms, steady_cpu,
      median(seen) * 1e3, *std::max_element(seen.begin(), seen.end()) * 1e3);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", k.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--ranks") {
      a.ranks.clear();
      std::stringstream ss(val());
      std::string x;
      while (std::getline(ss, x, ',')) a.ranks.push_back(std::stoi(x));
    } else if (k == "--threads") {
      a.threads = std::max(1, std::stoi(val()));
    } else if (k == "--pattern") {
      const auto v = val();
      if (v != "batched" && v != "batched-ascending" && v != "per-key") {
        std::fprintf(stderr, "--pattern batched|batched-ascending|per-key\n");
        return 2;
      }
      a.batched = v != "per-key";
      a.descending = v == "batched";
    } else if (k == "--silence-ms") {
      a.silence_ms = std::max(4, std::stoi(val()));
    } else if (k == "--steady") {
      a.steady_s = std::stod(val());
    } else if (k == "--bound") {
      a.bound_s = std::stod(val());
    } else {
      std::fprintf(stderr,
                   "usage: comm-bench-store-scale [--ranks 256,1024,4096] [--threads 2] [--pattern batched|batched-ascending|per-key]\n"
                   "       [--silence-ms 2000] [--steady 5] [--bound 120]\n");
      return 2;
    }
  }
  // Each rank holds two connections; this process holds the client ends, the server child the others.
  const int most = *std::max_element(a.ranks.begin(), a.ranks.end());
  rlimit rl{};
  ::getrlimit(RLIMIT_NOFILE, &rl);
  const rlim_t want = static_cast<rlim_t>(2 * most + 512);
  if (rl.rlim_cur < want) {
    rl.rlim_cur = std::min(want, rl.rlim_max);
    ::setrlimit(RLIMIT_NOFILE, &rl);
  }
  if (rl.rlim_cur < want) {
    std::fprintf(stderr, "store-scale: RLIMIT_NOFILE hard limit %llu is below the %llu descriptors %d ranks need\n",
                 static_cast<unsigned long long>(rl.rlim_max), static_cast<unsigned long long>(want), most);
    return 1;
  }
  for (const int n : a.ranks) run_one(a, n);
  return 0;
}
