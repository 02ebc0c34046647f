#pragma once
// TcpStore: definitions of the client (declared in <comm/store.hpp>); the server is in
// <comm/detail/store/tcp_store_server.hpp>.
// Included by <comm/store.hpp> after the declarations, and only from there: the public header
// declares, detail/ defines, and nothing here includes back up (include <comm/store.hpp>).

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <thread>
#include <type_traits>

#include <gsl/assert>

#include <comm/detail/net/socket.hpp>
#include <comm/detail/store/common.hpp>
#include <comm/detail/store/protocol.hpp>
#include <comm/detail/store/tcp_store_server.hpp>

namespace comm {

struct TcpStore::Reply {
  detail::store_proto::Status status = detail::store_proto::Status::ok;
  Bytes payload;  // the whole reply payload, status byte first
  [[nodiscard]] detail::store_proto::Reader fields() const {
    detail::store_proto::Reader r(payload);
    (void)r.u8();
    return r;
  }
};

namespace detail {
/// How long a client waits past its own deadline for the server's answer to a parked get/wait
/// (which the server times out itself) before it gives up on the connection.
[[nodiscard]] inline Clock::time_point with_grace(Clock::time_point deadline, std::chrono::milliseconds t) {
  const auto grace = std::clamp(t / 10, std::chrono::milliseconds(50), std::chrono::milliseconds(500));
  if (deadline == Clock::time_point::max() || Clock::time_point::max() - deadline < grace)
    return Clock::time_point::max();
  return deadline + grace;
}
}  // namespace detail

inline TcpStore::TcpStore(std::string host, std::uint16_t port, TcpStoreOptions opts)
    : Store(opts.timeout), host_(detail::strip_brackets(host)), port_(port), opts_(std::move(opts)) {
  set_rank(opts_.rank);
  const auto where = detail::format_host_port(host_, port_);
  if (opts_.token.empty()) {
    if (const char* t = std::getenv("COMM_STORE_TOKEN")) opts_.token = t;
  }
  if (opts_.job_id.empty()) opts_.job_id = detail::job_id_from_env();
  if (host_.empty()) throw InvalidArgument("store.connect", rank(), "TcpStore needs a host, got ''");
  if (opts_.timeout.count() < 0)
    throw InvalidArgument("store.connect", rank(), "timeout must not be negative, got " + detail::format_ms(opts_.timeout));
  if (opts_.token.size() > detail::store_proto::max_token_bytes)
    throw InvalidArgument("store.connect", rank(),
                          "token of " + std::to_string(opts_.token.size()) + " bytes is longer than " +
                              std::to_string(detail::store_proto::max_token_bytes));
  if (opts_.job_id.size() > detail::store_proto::max_job_id_bytes)
    throw InvalidArgument("store.connect", rank(),
                          "job id of " + std::to_string(opts_.job_id.size()) + " bytes is longer than " +
                              std::to_string(detail::store_proto::max_job_id_bytes));
  if (opts_.max_connections < 1)
    throw InvalidArgument("store.connect", rank(),
                          "max_connections must be at least 1, got " + std::to_string(opts_.max_connections));
  if (!opts_.is_server && port_ == 0)
    throw InvalidArgument("store.connect", rank(), "port 0 is only valid for the server (is_server = true)", where);
  if (opts_.is_server) {
    detail::TcpStoreServerConfig cfg;
    cfg.token = opts_.token;
    cfg.job_id = opts_.job_id;
    cfg.max_connections = static_cast<std::size_t>(opts_.max_connections);
    cfg.max_key_bytes = opts_.max_key_bytes;
    cfg.max_value_bytes = opts_.max_value_bytes;
    cfg.max_total_bytes = opts_.max_total_bytes;
    cfg.stall_timeout = opts_.stall_timeout;
    server_ = std::make_unique<detail::TcpStoreServer>(host_, port_, std::move(cfg), rank());
    port_ = server_->port();
  }
  address_ = detail::format_host_port(host_, port_);
  idle_.push_back(connect(detail::deadline_after(timeout())));
}

inline TcpStore::~TcpStore() {
  {
    std::lock_guard g(mu_);
    idle_.clear();
  }
  server_.reset();  // stops and joins the server thread
}

// Opens and handshakes a new connection, retrying with backoff until `deadline`.
inline detail::Fd TcpStore::connect(detail::Clock::time_point deadline) {
  namespace sp = detail::store_proto;
  const auto start = detail::Clock::now();
  std::string lost;
  {
    std::lock_guard g(mu_);
    lost = lost_;
  }
  auto step = std::chrono::milliseconds(10);
  std::string last_error = "no attempt made";
  // A store of another job: maybe an earlier job's, about to close (a world re-initialized on the
  // same port); retried for a while, then refused for good.
  std::optional<detail::Clock::time_point> wrong_job_until;
  std::string wrong_job;
  bool stale = false;  // the last server that answered (or timed out answering) was another job's
  for (;;) {
    const auto r = detail::resolve(host_, port_);
    if (r.addrs.empty()) {
      if (r.gai_error != EAI_AGAIN)
        throw InvalidArgument("store.connect", rank(), "cannot resolve host '" + host_ + "': " + r.error_text(), address_);
      last_error = "cannot resolve host '" + host_ + "': " + r.error_text();
    }
    for (const auto& a : r.addrs) {
      int err = 0;
      detail::Fd fd = detail::connect_once(a, deadline, err);
      if (!fd) {
        last_error = detail::to_string(a) + ": " + detail::errno_text(err);
        stale = false;
        continue;
      }
      // Handshake.
      const auto hello = sp::encode_hello(opts_.token, rank(), opts_.job_id);
      std::uint8_t head[sp::hello_reply_size];
      auto io = detail::send_all(fd.get(), hello, deadline);
      if (io.ok()) io = detail::recv_all(fd.get(), head, deadline);
      if (!io.ok()) {
        last_error = detail::to_string(a) + ": handshake " + io.text();
        continue;
      }
      sp::Reader rd(head);
      const auto magic = rd.u32();
      (void)rd.u16();
      const auto status = static_cast<sp::HelloStatus>(rd.u8());
      const std::size_t msg_len = rd.u16();
      if (magic != sp::magic || msg_len > sp::max_hello_message)
        throw RemoteError("store.connect", rank(), address_ + " answered, but is not a comm store (bad reply)", address_);
      std::string msg(msg_len, '\0');
      if (msg_len > 0) {
        io = detail::recv_all(fd.get(), std::span(reinterpret_cast<std::uint8_t*>(msg.data()), msg.size()), deadline);
        if (!io.ok()) {
          last_error = detail::to_string(a) + ": handshake " + io.text();
          continue;
        }
      }
      switch (status) {
        case sp::HelloStatus::ok: return fd;
        case sp::HelloStatus::wrong_token:
          throw InvalidArgument("store.connect", rank(),
                                "rejected: wrong token (the server at " + address_ +
                                    " checks COMM_STORE_TOKEN or TcpStoreOptions::token; every rank needs the same)",
                                address_);
        case sp::HelloStatus::bad_version:
          throw InvalidArgument("store.connect", rank(), "rejected: protocol version mismatch (" + msg + ")", address_);
        case sp::HelloStatus::too_many_connections:
          throw RemoteError("store.connect", rank(), "rejected: " + msg, address_);
        case sp::HelloStatus::wrong_job: {
          wrong_job = "rejected: the store server at " + address_ + " belongs to " + detail::describe_job(msg) +
                      ", this process to " + detail::describe_job(opts_.job_id) +
                      " (an earlier job's store still runs on this port, or the ranks were started with "
                      "different COMM_JOB_ID)";
          const auto now = detail::Clock::now();
          if (!wrong_job_until) wrong_job_until = std::min(deadline, now + std::chrono::seconds(5));
          if (now >= *wrong_job_until) throw InvalidArgument("store.connect", rank(), wrong_job, address_);
          last_error = wrong_job;
          stale = true;
          continue;
        }
      }
      throw RemoteError("store.connect", rank(), "rejected with unknown status " + std::to_string(static_cast<int>(status)),
                        address_);
    }
    if (!lost.empty())
      throw RemoteError("store.connect", rank(),
                        "the store server at " + address_ + " is gone (" + lost + "); reconnecting failed: " + last_error,
                        address_);
    const auto now = detail::Clock::now();
    if (!stale) wrong_job_until.reset();  // that store is gone; wait for ours
    if (wrong_job_until && now >= *wrong_job_until) throw InvalidArgument("store.connect", rank(), wrong_job, address_);
    if (now >= deadline)
      throw Timeout("store.connect", rank(),
                    "no store server answered at " + address_ + " within " +
                        detail::format_ms(std::chrono::duration_cast<std::chrono::milliseconds>(now - start)) +
                        " (last error: " + last_error + ")",
                    address_);
    std::this_thread::sleep_for(std::min<detail::Clock::duration>(step, deadline - now));
    step = std::min(step * 2, std::chrono::milliseconds(1000));
  }
}

// Sends one request on an idle (or new) connection and reads its reply. `reply_deadline` may be
// later than `deadline` (parked get/wait). Connection failures throw: Timeout when the deadline
// passes (naming `what`), RemoteError when the server closed the connection.
inline TcpStore::Reply TcpStore::call(std::string_view op, std::vector<std::uint8_t>& frame,
                                      detail::Clock::time_point deadline,
                                      detail::Clock::time_point reply_deadline) {
  namespace sp = detail::store_proto;
  Expects(frame.size() > sp::frame_header_size);  // request() built a whole frame: header and op code
  detail::Fd fd;
  {
    std::lock_guard g(mu_);
    if (!idle_.empty()) {
      fd = std::move(idle_.back());
      idle_.pop_back();
    }
  }
  if (!fd) fd = connect(deadline);

  auto fail = [&](const detail::IoResult& io, std::string_view during) -> Reply {
    if (io.status == detail::IoStatus::timeout) return Reply{sp::Status::timeout, {}};  // caller names the keys
    std::string why = "lost the connection to the store server at " + address_ + " " + std::string(during) + ": " +
                      io.text();
    {
      std::lock_guard g(mu_);
      if (lost_.empty()) lost_ = std::string(during) + ": " + io.text();
      idle_.clear();  // they share the server's fate
    }
    throw RemoteError(std::string(op), rank(), why, address_);
  };

  if (auto io = detail::send_all(fd.get(), frame, deadline); !io.ok()) return fail(io, "while sending");
  std::uint8_t head[sp::frame_header_size];
  if (auto io = detail::recv_all(fd.get(), head, reply_deadline); !io.ok()) return fail(io, "while waiting for the reply");
  const std::uint64_t len = sp::read_u64(head);
  const std::size_t cap = sp::frame_limit(opts_.max_key_bytes, opts_.max_value_bytes) + 64;
  if (len == 0 || len > cap)
    throw RemoteError(std::string(op), rank(),
                      "the store server sent a reply of " + std::to_string(len) + " bytes (limit " +
                          std::to_string(cap) + "); dropping the connection",
                      address_);
  Reply r;
  r.payload.resize(static_cast<std::size_t>(len));  // checked just above
  if (auto io = detail::recv_all(fd.get(), r.payload, reply_deadline); !io.ok()) return fail(io, "while reading the reply");
  r.status = static_cast<sp::Status>(r.payload[0]);
  {
    std::lock_guard g(mu_);
    if (idle_.size() < 8) idle_.push_back(std::move(fd));
  }
  return r;
}

inline void TcpStore::check_key(std::string_view op, std::string_view key) const {
  if (key.size() > opts_.max_key_bytes)
    throw InvalidArgument(std::string(op), rank(),
                          "key of " + std::to_string(key.size()) + " bytes exceeds max_key_bytes (" +
                              std::to_string(opts_.max_key_bytes) + ")",
                          address_);
}

/// Every key of a multi-key request, and the request's size (`verb`: "reading", for the error).
inline void TcpStore::check_keys(std::string_view op, const std::vector<std::string>& keys,
                                 std::string_view verb) const {
  std::size_t bytes = 0;
  for (const auto& k : keys) {
    check_key(op, k);
    bytes += k.size() + 8;
  }
  if (keys.size() > UINT32_MAX || bytes + 16 > detail::store_proto::frame_limit(opts_.max_key_bytes, opts_.max_value_bytes))
    throw InvalidArgument(std::string(op), rank(),
                          std::string(verb) + " " + std::to_string(keys.size()) + " keys (" + std::to_string(bytes) +
                              " bytes) exceeds the request size limit",
                          address_);
}

inline void TcpStore::check_value(std::string_view op, std::string_view key, std::size_t size) const {
  if (size > opts_.max_value_bytes)
    throw InvalidArgument(std::string(op), rank(),
                          "value of " + std::to_string(size) + " bytes for " + detail::quote_key(key) +
                              " exceeds max_value_bytes (" + std::to_string(opts_.max_value_bytes) + ")",
                          address_);
}

// A reply whose status is not ok: turn it into the right exception. A timeout reply with no
// payload is the client's own deadline (the connection was dropped): `keys` are then named.
inline void TcpStore::throw_reply_error(std::string_view op, const Reply& r, std::chrono::milliseconds waited,
                                        const std::vector<std::string>& keys) const {
  namespace sp = detail::store_proto;
  auto rd = r.fields();
  switch (r.status) {
    case sp::Status::timeout: {
      std::vector<std::string> missing;
      if (!r.payload.empty()) {
        const std::uint32_t n = rd.u32();
        for (std::uint32_t i = 0; i < n && rd.ok(); ++i) {
          const auto k = rd.str();
          if (rd.ok()) missing.emplace_back(k);
        }
      }
      if (missing.empty()) missing = keys;
      if (missing.empty())
        throw Timeout(std::string(op), rank(),
                      "no reply from the store server at " + address_ + " within " + detail::format_ms(waited), address_);
      throw Timeout(std::string(op), rank(),
                    detail::describe_keys(missing) + " not set within " + detail::format_ms(waited), address_);
    }
    case sp::Status::invalid: {
      const auto msg = rd.str();
      throw InvalidArgument(std::string(op), rank(), "the store server refused the request: " + std::string(msg),
                            address_);
    }
    case sp::Status::failed: {
      const auto msg = rd.str();
      throw RemoteError(std::string(op), rank(), std::string(msg), address_);
    }
    case sp::Status::ok: break;
  }
  throw RemoteError(std::string(op), rank(),
                    "the store server sent an unknown reply status " + std::to_string(static_cast<int>(r.status)),
                    address_);
}

// One request/reply exchange. The request is the frame of `code` with the fields `write(w,
// deadline)` adds (a parked get/wait sends the time it has left); the call ends by `budget` from
// now, a `parked` one's reply up to a grace later (the server times it out itself). A status other
// than ok throws, naming `keys` on a timeout; `read(r)` decodes an ok reply's fields, all of them,
// else the reply is malformed (RemoteError).
template <class Write, class Read>
auto TcpStore::request(std::string_view op, detail::store_proto::Op code, std::chrono::milliseconds budget, bool parked,
                       Write&& write, Read&& read, const std::vector<std::string>& keys) {
  namespace sp = detail::store_proto;
  std::vector<std::uint8_t> f;
  const std::size_t at = sp::begin_frame(f);
  f.push_back(static_cast<std::uint8_t>(code));
  const auto d = detail::deadline_after(budget);
  sp::Writer w(f);
  write(w, d);
  sp::finish_frame(f, at);
  const auto r = call(op, f, d, parked ? detail::with_grace(d, budget) : d);
  if (r.status != sp::Status::ok) throw_reply_error(op, r, budget, keys);
  auto rd = r.fields();
  auto v = read(rd);
  if (!rd.done()) throw RemoteError(std::string(op), rank(), "malformed reply from the store server", address_);
  return v;
}

namespace detail {
// The writers and readers the calls share.
inline int read_nothing(store_proto::Reader&) { return 0; }
inline Store::Bytes read_bytes(store_proto::Reader& r) {
  const auto v = r.bytes();
  return Store::Bytes(v.begin(), v.end());
}
inline std::int64_t read_i64(store_proto::Reader& r) { return r.i64(); }
inline bool read_flag(store_proto::Reader& r) { return r.u8() != 0; }
[[nodiscard]] inline std::uint64_t ms_left(Clock::time_point d) { return static_cast<std::uint64_t>(remaining(d).count()); }

/// A field that says how long the server may hold the request: the milliseconds left to the
/// call's deadline when the request is written.
struct TimeLeft {};

inline void put_field(store_proto::Writer& w, Clock::time_point d, const auto& f) {
  using F = std::remove_cvref_t<decltype(f)>;
  if constexpr (std::is_same_v<F, TimeLeft>) {
    w.u64(ms_left(d));
  } else if constexpr (std::is_same_v<F, std::string_view>) {
    w.str(f);
  } else if constexpr (std::is_same_v<F, std::span<const std::uint8_t>>) {
    w.bytes(f);
  } else if constexpr (std::is_same_v<F, std::int64_t>) {
    w.i64(f);
  } else if constexpr (std::is_same_v<F, std::uint32_t>) {
    w.u32(f);
  } else {
    static_assert(std::is_same_v<F, std::uint64_t>, "a request field is a key or text, a value, a count or TimeLeft");
    w.u64(f);
  }
}

/// The writer of a request whose fields are `f...` in order, each written as its type says
/// (put_field). The fields are views: they must outlive the call, as the arguments of a store
/// call do.
template <class... Fields>
[[nodiscard]] auto fields(const Fields&... f) {
  return [=]([[maybe_unused]] store_proto::Writer& w, [[maybe_unused]] Clock::time_point d) { (put_field(w, d, f), ...); };
}
}  // namespace detail

inline void TcpStore::set(std::string_view key, std::span<const std::uint8_t> value) {
  check_key("store.set", key);
  check_value("store.set", key, value.size());
  (void)request(
      "store.set", detail::store_proto::Op::set, timeout(), false, detail::fields(key, value), detail::read_nothing);
}

inline Store::Bytes TcpStore::get(std::string_view key) {
  check_key("store.get", key);
  return request(
      "store.get", detail::store_proto::Op::get, timeout(), true, detail::fields(key, detail::TimeLeft{}),
      detail::read_bytes, {std::string(key)});
}

inline std::int64_t TcpStore::add(std::string_view key, std::int64_t delta) {
  check_key("store.add", key);
  return request(
      "store.add", detail::store_proto::Op::add, timeout(), false, detail::fields(key, delta), detail::read_i64);
}

inline Store::Bytes TcpStore::compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                                          std::span<const std::uint8_t> desired) {
  check_key("store.compare_set", key);
  check_value("store.compare_set", key, expected.size());
  check_value("store.compare_set", key, desired.size());
  return request(
      "store.compare_set", detail::store_proto::Op::compare_set, timeout(), false,
      detail::fields(key, expected, desired), detail::read_bytes);
}

inline void TcpStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  if (keys.empty()) return;
  check_keys("store.wait", keys, "waiting on");
  (void)request(
      "store.wait", detail::store_proto::Op::wait, timeout, true,
      [&](detail::store_proto::Writer& w, detail::Clock::time_point d) {
        w.u32(static_cast<std::uint32_t>(keys.size()));
        for (const auto& k : keys) w.str(k);
        w.u64(detail::ms_left(d));
      },
      detail::read_nothing, keys);
}

inline std::vector<Store::Bytes> TcpStore::multi_get(const std::vector<std::string>& keys,
                                                     std::chrono::milliseconds timeout) {
  if (keys.empty()) return {};
  check_keys("store.multi_get", keys, "reading");
  return request(
      "store.multi_get", detail::store_proto::Op::multi_get, timeout, true,
      [&](detail::store_proto::Writer& w, detail::Clock::time_point d) {
        w.u32(static_cast<std::uint32_t>(keys.size()));
        for (const auto& k : keys) w.str(k);
        w.u64(detail::ms_left(d));
      },
      [&](detail::store_proto::Reader& r) {
        std::vector<Bytes> values;
        const std::uint32_t n = r.u32();
        if (n != keys.size()) return values;  // malformed: request() finds bytes left unread
        values.reserve(n);
        for (std::uint32_t i = 0; i < n && r.ok(); ++i) values.push_back(detail::read_bytes(r));
        return values;
      },
      keys);
}

inline std::int64_t TcpStore::num_keys() {
  return request("store.num_keys", detail::store_proto::Op::num_keys, timeout(), false, detail::fields(),
                 detail::read_i64);
}

inline bool TcpStore::delete_key(std::string_view key) {
  check_key("store.delete_key", key);
  return request(
      "store.delete_key", detail::store_proto::Op::delete_key, timeout(), false, detail::fields(key),
      detail::read_flag);
}

inline bool TcpStore::check(std::string_view key) {
  check_key("store.check", key);
  return request(
      "store.check", detail::store_proto::Op::check, timeout(), false, detail::fields(std::uint32_t{1}, key),
      detail::read_flag);
}

inline int TcpStore::watch(std::string_view key, std::string_view value, std::chrono::milliseconds silence) {
  check_key("store.watch", key);
  check_value("store.watch", key, value.size());
  return request(
      "store.watch", detail::store_proto::Op::watch, timeout(), false,
      detail::fields(key, value, static_cast<std::uint64_t>(std::max<std::int64_t>(silence.count(), key.empty() ? 1 : 0))),
      [](detail::store_proto::Reader& r) { return r.i32(); });
}

inline std::optional<Store::Bytes> TcpStore::heartbeat(std::chrono::milliseconds timeout,
                                                      std::chrono::milliseconds wait) {
  const auto held = std::max(wait, std::chrono::milliseconds(0));
  return request(
      "store.heartbeat", detail::store_proto::Op::heartbeat, timeout + held, false,
      detail::fields(static_cast<std::uint64_t>(held.count())),
      [](detail::store_proto::Reader& r) -> std::optional<Bytes> {
        const bool set = r.u8() != 0;
        const auto v = r.bytes();
        if (!set) return std::nullopt;
        return Bytes(v.begin(), v.end());
      });
}

}  // namespace comm
