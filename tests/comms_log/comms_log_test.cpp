// The comms log and the trace (include/comm/detail/diagnostics/comms_log.hpp), on the backend this suite is
// built for (tests/comms_log/CMakeLists.txt): one CSV line per operation with nccl-tests' bytes and
// bandwidths, a summary table by op and size at destroy, subgroups in the same per-rank file, and
// a per-rank Chrome trace that python3's json module reads. Off, nothing is written.
#include <collectives/backend_test_util.hpp>

#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <comm/detail/diagnostics/comms_log.hpp>
#include <support/env_guard.hpp>

using namespace suite;

namespace {

using comm::test::ScopedEnv;

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

/// A directory made by rank 0 and shared with every rank through the harness store; removed by
/// rank 0 at the end of the test case, once every rank is done with it.
class SharedTmpdir {
 public:
  SharedTmpdir() {
    auto store = comm::test::fresh_store();
    if (comm::test::world().rank == 0) {
      char tmpl[] = "/tmp/comm-comms-log-XXXXXX";
      REQUIRE(::mkdtemp(tmpl) != nullptr);
      store->set("dir", std::string(tmpl));
    }
    const auto v = store->get("dir");
    path_.assign(v.begin(), v.end());
  }
  ~SharedTmpdir() {
    comm::test::barrier();
    std::error_code ec;
    if (comm::test::world().rank == 0) std::filesystem::remove_all(path_, ec);
  }
  SharedTmpdir(const SharedTmpdir&) = delete;
  SharedTmpdir& operator=(const SharedTmpdir&) = delete;
  [[nodiscard]] const std::string& path() const noexcept { return path_; }

 private:
  std::string path_;
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out(1);
  for (char c : s) {
    if (c == sep)
      out.emplace_back();
    else
      out.back() += c;
  }
  return out;
}

struct Line {
  std::string comm, op, dtype, peer;
  unsigned long long seq = 0, count = 0, bytes = 0;
  double start = 0, dur = 0, algbw = 0, busbw = 0;
};

struct Log {
  std::string header;
  std::vector<Line> ops;
  std::vector<std::string> summary;  // the "#" lines
};

Log parse_log(const std::string& text) {
  Log log;
  std::istringstream in(text);
  std::string l;
  std::getline(in, log.header);
  while (std::getline(in, l)) {
    if (l.empty()) continue;
    if (l[0] == '#') {
      log.summary.push_back(l);
      continue;
    }
    const auto f = split(l, ',');
    REQUIRE_MESSAGE(f.size() == 11, "log line: ", l);
    Line x;
    x.comm = f[0];
    x.seq = std::stoull(f[1]);
    x.op = f[2];
    x.dtype = f[3];
    x.count = std::stoull(f[4]);
    x.bytes = std::stoull(f[5]);
    x.peer = f[6];
    x.start = std::stod(f[7]);
    x.dur = std::stod(f[8]);
    x.algbw = std::stod(f[9]);
    x.busbw = std::stod(f[10]);
    log.ops.push_back(x);
  }
  return log;
}

std::vector<Line> lines_of(const Log& log, const std::string& comm, const std::string& op) {
  std::vector<Line> out;
  for (const auto& l : log.ops)
    if (l.comm == comm && l.op == op) out.push_back(l);
  return out;
}

/// The line's bandwidths follow nccl-tests: algbw = bytes / time, busbw = algbw x factor.
void check_bandwidth(const Line& l, double factor) {
  INFO(l.op, " bytes=", l.bytes, " dur=", l.dur, " algbw=", l.algbw, " busbw=", l.busbw);
  CHECK(l.dur >= 0.0);
  if (l.dur > 0.01) {
    const double algbw = static_cast<double>(l.bytes) / l.dur * 1e-3;  // B/us -> GB/s
    CHECK(std::fabs(l.algbw - algbw) <= 1e-3 + 0.01 * algbw);
  }
  CHECK(std::fabs(l.busbw - l.algbw * factor) <= 2e-4 + 1e-3 * l.algbw);
}

/// all_to_all_v above: rank r sends r + 1 elements to each of n ranks, receives p + 1 from rank p.
unsigned long long total_in_of(int rank, int n) { return static_cast<unsigned long long>(rank + 1) * n; }
unsigned long long total_out_of(int n) { return static_cast<unsigned long long>(n) * (n + 1) / 2; }

}  // namespace

TEST_CASE("nccl-tests bytes and bus factors") {
  using comm::OpKind;
  using comm::detail::traffic;
  CHECK(traffic(OpKind::all_reduce, 1024, 4, 4).bytes == 4096);
  CHECK(traffic(OpKind::all_reduce, 1024, 4, 4).bus_factor == doctest::Approx(1.5));
  CHECK(traffic(OpKind::reduce_scatter, 256, 4, 4).bytes == 4096);  // the whole input
  CHECK(traffic(OpKind::reduce_scatter, 256, 4, 4).bus_factor == doctest::Approx(0.75));
  CHECK(traffic(OpKind::all_gather, 256, 8, 4).bytes == 8192);  // the whole output
  CHECK(traffic(OpKind::all_gather, 256, 8, 4).bus_factor == doctest::Approx(0.75));
  CHECK(traffic(OpKind::broadcast, 10, 8, 4).bus_factor == doctest::Approx(1.0));
  CHECK(traffic(OpKind::reduce, 10, 8, 4).bus_factor == doctest::Approx(1.0));
  CHECK(traffic(OpKind::gather, 10, 2, 4).bytes == 80);
  CHECK(traffic(OpKind::scatter, 10, 2, 4).bus_factor == doctest::Approx(0.75));
  CHECK(traffic(OpKind::all_to_all, 40, 2, 4).bytes == 80);
  CHECK(traffic(OpKind::all_to_all, 40, 2, 4).bus_factor == doctest::Approx(0.75));
  CHECK(traffic(OpKind::send, 10, 4, 4).bus_factor == doctest::Approx(1.0));
  CHECK(traffic(OpKind::barrier, 0, 0, 4).bytes == 0);
  CHECK(traffic(OpKind::all_reduce, 8, 4, 1).bus_factor == doctest::Approx(0.0));  // one rank moves nothing
  CHECK(comm::detail::comms_log_file("/x/log.{rank}.csv", 3) == "/x/log.3.csv");
  CHECK(comm::detail::comms_log_file("/x/log", 3) == "/x/log.3");
  CHECK(comm::detail::trace_file("/x/t.json", 2) == "/x/t.json.2");
}

TEST_CASE("comms log off: nothing recorded") {
  ScopedEnv a("COMM_COMMS_LOG", nullptr);
  ScopedEnv b("COMM_TRACE", nullptr);
  comm::detail::CommsLog log;
  CHECK_FALSE(log.on());
  CHECK(log.start() == comm::detail::CommsLog::Clock::time_point{});
  auto c = make_comm();
  std::vector<float> x(4, 1.0f);
  c.all_reduce(std::span<float>(x));
  CHECK(x[0] == doctest::Approx(static_cast<float>(c.size())));
}

TEST_CASE("comms log: a line per operation, nccl-tests bandwidths, a summary by op and size") {
  const auto& w = comm::test::world();
  const int n = w.size;
  const SharedTmpdir tmp;
  const std::string& dir = tmp.path();
  const std::string file = dir + "/ops." + std::to_string(w.rank) + ".csv";
  {
    ScopedEnv env("COMM_COMMS_LOG", dir + "/ops.{rank}.csv");
    auto c = make_comm();
    std::vector<float> a(1024, 1.0f);
    for (int i = 0; i < 3; ++i) c.all_reduce(std::span<float>(a));
    comm::Work work = c.all_reduce(std::span<float>(a), comm::async);  // on the worker thread
    work.wait();
    std::vector<double> mine(256, 1.0), all(256 * static_cast<std::size_t>(n));
    c.all_gather(std::span<const double>(mine), std::span<double>(all));
    std::vector<std::int32_t> rs_in(64 * static_cast<std::size_t>(n), 1), rs_out(64);
    c.reduce_scatter(std::span<const std::int32_t>(rs_in), std::span<std::int32_t>(rs_out));
    std::vector<std::int64_t> b(100, w.rank);
    c.broadcast(std::span<std::int64_t>(b), n - 1);
    std::vector<comm::half> g_in(8), g_out(w.rank == 0 ? 8 * static_cast<std::size_t>(n) : 0);
    c.gather(std::span<const comm::half>(g_in), std::span<comm::half>(g_out), 0);
    c.barrier();
  }
  const std::string text = read_file(file);
  REQUIRE_MESSAGE(!text.empty(), "no comms log at ", file);
  const Log log = parse_log(text);
  CHECK(log.header == "comm,seq,op,dtype,count,bytes,peer,start_us,duration_us,algbw_GBps,busbw_GBps");
  const std::string me = kBackendName;
  const double shared = static_cast<double>(n - 1) / n;

  const auto ar = lines_of(log, me, "all_reduce");
  REQUIRE(ar.size() == 4);
  for (const auto& l : ar) {
    CHECK(l.dtype == "float");
    CHECK(l.count == 1024);
    CHECK(l.bytes == 4096);
    CHECK(l.peer.empty());
    check_bandwidth(l, 2.0 * shared);
  }
  for (std::size_t i = 1; i < ar.size(); ++i) {
    CHECK(ar[i].seq > ar[i - 1].seq);
    CHECK(ar[i].start >= ar[i - 1].start);
  }
  const auto ag = lines_of(log, me, "all_gather");
  REQUIRE(ag.size() == 1);
  CHECK(ag[0].dtype == "double");
  CHECK(ag[0].count == 256);
  CHECK(ag[0].bytes == 256ull * 8 * static_cast<unsigned>(n));
  check_bandwidth(ag[0], shared);
  const auto rs = lines_of(log, me, "reduce_scatter");
  REQUIRE(rs.size() == 1);
  CHECK(rs[0].count == 64);
  CHECK(rs[0].bytes == 64ull * 4 * static_cast<unsigned>(n));
  check_bandwidth(rs[0], shared);
  const auto bc = lines_of(log, me, "broadcast");
  REQUIRE(bc.size() == 1);
  CHECK(bc[0].dtype == "int64");
  CHECK(bc[0].bytes == 800);
  CHECK(bc[0].peer == std::to_string(n - 1));
  check_bandwidth(bc[0], 1.0);
  const auto ga = lines_of(log, me, "gather");
  REQUIRE(ga.size() == 1);
  CHECK(ga[0].dtype == "half");
  CHECK(ga[0].bytes == 8ull * 2 * static_cast<unsigned>(n));
  CHECK(ga[0].peer == "0");
  const auto ba = lines_of(log, me, "barrier");
  REQUIRE(ba.size() == 1);
  CHECK(ba[0].bytes == 0);
  CHECK(ba[0].dtype.empty());
  CHECK(ba[0].algbw == 0.0);

  // The summary: a title naming the communicator, a header, one row per (op, size).
  bool title = false, ar_row = false;
  for (const auto& s : log.summary) {
    if (s.rfind("# comms summary: " + me + ", rank " + std::to_string(w.rank) + " of " + std::to_string(n), 0) == 0)
      title = true;
    const auto f = split(s, ' ');
    std::vector<std::string> words;
    for (const auto& x : f)
      if (!x.empty()) words.push_back(x);
    // "# all_reduce 4 KiB 4 <total_ms> <avg_us> <algbw> <busbw>"
    if (words.size() == 9 && words[1] == "all_reduce" && words[2] == "4" && words[3] == "KiB") {
      ar_row = true;
      CHECK(words[4] == "4");
    }
  }
  CHECK_MESSAGE(title, text);
  CHECK_MESSAGE(ar_row, text);
}

TEST_CASE("comms log: reduce, scatter, all_to_all(_v), send/recv and batches") {
  COMM_REQUIRE_RANKS(2);
  const auto& w = comm::test::world();
  const int n = w.size;
  const auto un = static_cast<std::size_t>(n);
  const SharedTmpdir tmp;
  const std::string& dir = tmp.path();
  {
    ScopedEnv env("COMM_COMMS_LOG", dir + "/ops");
    auto c = make_comm();
    std::vector<float> r_in(10, 1.0f), r_out(w.rank == 1 ? 10 : 0);
    c.reduce(r_in, r_out, 1);
    std::vector<float> s_in(w.rank == 0 ? 4 * un : 0, 1.0f), s_out(4);
    c.scatter(s_in, s_out, 0);
    std::vector<std::int32_t> a_in(3 * un, w.rank), a_out(3 * un);
    c.all_to_all(a_in, a_out);
    // all_to_all_v: rank r sends r + 1 elements to every rank, so receives p + 1 from rank p.
    std::vector<std::size_t> in_counts(un, static_cast<std::size_t>(w.rank) + 1), out_counts(un);
    std::size_t total_in = 0, total_out = 0;
    for (int p = 0; p < n; ++p) {
      out_counts[static_cast<std::size_t>(p)] = static_cast<std::size_t>(p) + 1;
      total_in += in_counts[static_cast<std::size_t>(p)];
      total_out += out_counts[static_cast<std::size_t>(p)];
    }
    std::vector<double> v_in(total_in, 1.0), v_out(total_out);
    c.all_to_all_v(v_in, in_counts, v_out, out_counts);
    // A ring: send 5 to the next rank, receive 5 from the previous one (ranks 0 and 1 by send/recv).
    const int next = (w.rank + 1) % n, prev = (w.rank + n - 1) % n;
    std::vector<std::int64_t> out5(5, w.rank), in5(5);
    auto works = c.batch_isend_irecv({comm::isend(out5, next), comm::irecv(in5, prev)});
    for (auto& x : works) x.wait();
    std::vector<std::uint8_t> msg(7);
    if (w.rank == 0) c.send(msg, 1);
    if (w.rank == 1) c.recv(msg, 0);
  }
  const Log log = parse_log(read_file(dir + "/ops." + std::to_string(w.rank)));
  const std::string me = kBackendName;
  const double shared = static_cast<double>(n - 1) / n;
  const auto rd = lines_of(log, me, "reduce");
  REQUIRE(rd.size() == 1);
  CHECK(rd[0].bytes == 40);
  CHECK(rd[0].peer == "1");
  check_bandwidth(rd[0], 1.0);
  const auto sc = lines_of(log, me, "scatter");
  REQUIRE(sc.size() == 1);
  CHECK(sc[0].count == 4);
  CHECK(sc[0].bytes == 16 * un);
  check_bandwidth(sc[0], shared);
  const auto aa = lines_of(log, me, "all_to_all");
  REQUIRE(aa.size() == 1);
  CHECK(aa[0].bytes == 12 * un);
  check_bandwidth(aa[0], shared);
  const auto av = lines_of(log, me, "all_to_all_v");
  REQUIRE(av.size() == 1);
  CHECK(av[0].bytes == 8 * std::max(total_in_of(w.rank, n), total_out_of(n)));
  check_bandwidth(av[0], shared);
  const auto bt = lines_of(log, me, "batch_isend_irecv");
  REQUIRE(bt.size() == 1);
  CHECK(bt[0].count == 2);
  CHECK(bt[0].bytes == 40);
  check_bandwidth(bt[0], 1.0);
  if (w.rank <= 1) {
    const auto p2p = lines_of(log, me, w.rank == 0 ? "send" : "recv");
    REQUIRE(p2p.size() == 1);
    CHECK(p2p[0].bytes == 7);
    CHECK(p2p[0].peer == (w.rank == 0 ? "1" : "0"));
  }
}

TEST_CASE("comms log: subgroups share the rank's file, on their own track") {
  COMM_REQUIRE_RANKS(2);
  const auto& w = comm::test::world();
  const SharedTmpdir tmp;
  const std::string& dir = tmp.path();
  {
    ScopedEnv env("COMM_COMMS_LOG", dir + "/ops");
    auto c = make_comm();
    auto g = c.split(w.rank % 2, w.rank);
    REQUIRE(g.has_value());
    std::vector<float> x(16, 1.0f);
    g->all_reduce(std::span<float>(x));
    c.all_reduce(std::span<float>(x));
  }
  const Log log = parse_log(read_file(dir + "/ops." + std::to_string(w.rank)));
  CHECK(lines_of(log, kBackendName, "split").size() == 1);
  CHECK(lines_of(log, kBackendName, "all_reduce").size() == 1);
  CHECK(lines_of(log, kBackendName + ":g0", "all_reduce").size() == 1);
}

TEST_CASE("trace: one valid Chrome trace per rank") {
  const auto& w = comm::test::world();
  const SharedTmpdir tmp;
  const std::string& dir = tmp.path();
  const std::string base = dir + "/trace.json";
  {
    ScopedEnv env("COMM_TRACE", base);
    auto c = make_comm();
    std::vector<float> x(1000, 1.0f);
    for (int i = 0; i < 5; ++i) c.all_reduce(std::span<float>(x));
    c.barrier();
  }
  const std::string file = comm::detail::trace_file(base, w.rank);
  const std::string cmd = std::string("python3 ") + COMM_TEST_CHECK_TRACE + " file '" + file + "' --rank " +
                          std::to_string(w.rank) + " --min-events 6 --track " + kBackendName;
  CHECK_MESSAGE(std::system(cmd.c_str()) == 0, cmd);
}
