#pragma once
/// \file
/// Key-value stores for rendezvous (the c10d Store API): `Store`, `TcpStore`, `FileStore`,
/// `HashStore`, `PrefixStore`. Every blocking call takes a deadline and ends with comm::Timeout
/// naming the key(s) and the store's address.

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <comm/detail/base/env.hpp>
#include <comm/detail/net/socket.hpp>
#include <comm/error.hpp>

namespace comm {

/// Abstract store. Values are byte strings. Implementations are thread-safe.
class Store {
 public:
  /// A value: a byte string.
  using Bytes = std::vector<std::uint8_t>;
  /// The timeout of a store made without one when COMM_TIMEOUT is not set.
  static constexpr std::chrono::milliseconds default_timeout = std::chrono::minutes(30);

  /// The timeout of a store made without one (TcpStoreOptions, FileStore, HashStore): COMM_TIMEOUT
  /// when set (seconds, or a number with ms, s or m; an invalid value is comm::InvalidArgument
  /// naming it), else default_timeout. The communicators' default, so that one variable bounds
  /// the rendezvous and the operations alike.
  [[nodiscard]] static std::chrono::milliseconds timeout_from_env() { return detail::default_timeout(); }

  virtual ~Store() = default;

  /// Sets `key` to `value`, replacing any previous value, and wakes waiters on `key`.
  virtual void set(std::string_view key, std::span<const std::uint8_t> value) = 0;
  /// set() of a text value (its bytes, unchanged).
  void set(std::string_view key, std::string_view value) {
    set(key, std::span(reinterpret_cast<const std::uint8_t*>(value.data()), value.size()));
  }
  /// Blocks until `key` exists (or the store's timeout passes), then returns its value.
  virtual Bytes get(std::string_view key) = 0;
  /// Adds `delta` to the integer stored at `key` (missing: 0) and returns the new value. The value
  /// is kept as decimal text; one that is not an integer, or an overflow, is comm::InvalidArgument.
  virtual std::int64_t add(std::string_view key, std::int64_t delta) = 0;
  /// Sets `key` to `desired` if its current value equals `expected` (an empty `expected` matches
  /// a missing key). Returns the value stored after the call (empty if the key is still missing).
  virtual Bytes compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                            std::span<const std::uint8_t> desired) = 0;
  /// Blocks until all `keys` exist or `timeout` passes (then comm::Timeout naming the missing keys).
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  /// wait() with the store's timeout().
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout()); }

  /// Blocks like wait() until all `keys` exist, then returns their values in the order given:
  /// how a rendezvous reads every rank's record. TcpStore answers it in one round trip (the server
  /// refuses, with comm::InvalidArgument, a reply larger than one frame: ask for fewer keys);
  /// PrefixStore forwards it; this default waits, then gets each key.
  virtual std::vector<Bytes> multi_get(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
    wait(keys, timeout);
    std::vector<Bytes> values;
    values.reserve(keys.size());
    for (const auto& k : keys) values.push_back(get(k));
    return values;
  }
  /// Number of keys currently stored.
  virtual std::int64_t num_keys() = 0;
  /// Removes `key`; true if it existed.
  virtual bool delete_key(std::string_view key) = 0;
  /// True if `key` exists now (does not block).
  virtual bool check(std::string_view key) = 0;

  /// The timeout used by get() and wait() without an explicit one.
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  /// Changes the timeout of later calls without an explicit one.
  void set_timeout(std::chrono::milliseconds t) noexcept { timeout_ = t; }

  /// The rank used in error messages (-1 unknown).
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// Changes the rank named in error messages.
  void set_rank(int r) noexcept { rank_ = r; }

 protected:
  Store() = default;
  /// A store whose calls without an explicit timeout wait at most `timeout`.
  explicit Store(std::chrono::milliseconds timeout) : timeout_(timeout) {}

 private:
  std::chrono::milliseconds timeout_ = default_timeout;
  int rank_ = -1;
};

/// Options of a TcpStore. The limits apply on the server (what it accepts from any client) and on
/// the client (what it sends and accepts back); use the same values on every rank.
struct TcpStoreOptions {
  /// Host the server in this process (a thread; this store is also a client of it).
  bool is_server = false;
  /// Deadline of every call (get() and wait() without an explicit timeout, connect, replies).
  std::chrono::milliseconds timeout = Store::timeout_from_env();
  /// The rank named in error messages (-1: unknown).
  int rank = -1;
  /// Shared secret checked at connect. Empty: COMM_STORE_TOKEN from the environment; if that is
  /// empty too, no token (client and server must agree either way).
  std::string token;
  /// The job this store belongs to: a client and a server of different jobs refuse each other
  /// (comm::InvalidArgument naming both job ids), so a new job on the port of an earlier one that
  /// is still running never talks to its store. Empty: COMM_JOB_ID from the environment (comm-run
  /// sets one per job), else TORCHELASTIC_RUN_ID, else SLURM_JOB_ID; empty too: no job id (a
  /// launch by hand). A client refused for its job id retries for up to 5 s (bounded by `timeout`)
  /// in case the earlier job's store is closing, then throws.
  std::string job_id;
  /// Server: connections beyond this many are rejected with an error. Each rank holds two (its
  /// store and its liveness watch), plus short ones; the server raises its process's soft
  /// RLIMIT_NOFILE toward this (within the hard limit).
  int max_connections = 16384;
  /// Largest value accepted by set/compare_set (bytes).
  std::size_t max_value_bytes = std::size_t{64} << 20;
  /// Largest key accepted (bytes).
  std::size_t max_key_bytes = 4096;
  /// Server: total bytes of keys and values it stores, plus the keys that blocked get()/wait()
  /// calls wait on (128 bytes of bookkeeping each); a set, or a wait, beyond it fails with
  /// RemoteError ("store full").
  std::size_t max_total_bytes = std::size_t{1} << 30;
  /// Server: a connection whose handshake does not complete within this long, or whose half-sent
  /// request or unread reply makes no progress for this long, is dropped (so stalled peers cannot
  /// pin memory or connection slots). Handshaken idle connections are never dropped.
  std::chrono::milliseconds stall_timeout = std::chrono::seconds(5);
};

namespace detail {
class TcpStoreServer;
namespace store_proto {
enum class Op : std::uint8_t;
}  // namespace store_proto
}  // namespace detail

/// A store served over TCP by one process (the one constructed with `is_server`), the others
/// being clients. Binds exactly the address(es) `host` resolves to (127.0.0.1 / localhost stay
/// on loopback), IPv4 or IPv6. Clients retry connecting with backoff until the timeout, then
/// throw comm::Timeout ("store.connect", the rank, host:port). get()/wait() block on the server
/// and end by their deadline with comm::Timeout naming the missing keys; a server that goes away
/// makes calls fail with comm::RemoteError. Thread-safe: concurrent calls use separate
/// connections, so a thread blocked in get() does not block a set() from another thread.
class TcpStore final : public Store {
 public:
  /// Connects to (and with `opts.is_server`, first starts) the store at host:port. A server with
  /// port 0 picks a free port (see port()). Throws comm::BackendError when the server cannot bind
  /// (the message names the address and port), comm::Timeout when no server answers in time, and
  /// comm::Error when the server rejects the connection (wrong token, another job's store,
  /// version, connection limit).
  TcpStore(std::string host, std::uint16_t port, TcpStoreOptions opts = {});
  ~TcpStore() override;
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  /// The port of the store (the one the server picked when constructed with port 0).
  [[nodiscard]] std::uint16_t port() const noexcept { return port_; }
  /// The host given at construction (without brackets for IPv6 literals).
  [[nodiscard]] const std::string& host() const noexcept { return host_; }
  /// "host:port" as used in messages ("[::1]:port" for IPv6).
  [[nodiscard]] const std::string& address() const noexcept { return address_; }
  /// True if this instance hosts the server.
  [[nodiscard]] bool is_server() const noexcept { return server_ != nullptr; }

  /// Store::set of text, as in Store.
  using Store::set;
  /// Store::wait with the store's timeout, as in Store.
  using Store::wait;
  void set(std::string_view key, std::span<const std::uint8_t> value) override;
  Bytes get(std::string_view key) override;
  std::int64_t add(std::string_view key, std::int64_t delta) override;
  Bytes compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                    std::span<const std::uint8_t> desired) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  std::int64_t num_keys() override;
  bool delete_key(std::string_view key) override;
  bool check(std::string_view key) override;
  std::vector<Bytes> multi_get(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;

  /// The options in effect (token and job id filled in from the environment where they were empty).
  [[nodiscard]] const TcpStoreOptions& options() const noexcept { return opts_; }

  /// Liveness (what communicators use, detail/engine/liveness.hpp; call from one thread only, on a
  /// TcpStore of its own, so that every call uses the same connection): gives this client's
  /// connection a will. When the connection closes, errs, or makes no call for `silence`, the
  /// server sets `key` (unless already set) to `value` followed by the reason, and drops the
  /// connection. An empty key withdraws the will; `silence` 0 releases the will of `key` and
  /// `value` held by any connection (and answers its pending heartbeat). Returns the rank of the
  /// process hosting the server (-1 unknown). Bounded by the store's timeout.
  int watch(std::string_view key, std::string_view value, std::chrono::milliseconds silence);
  /// Keeps the will alive; returns the value of its key once some connection's will has set it
  /// (empty while not). While it is not set, the server holds the answer for up to `wait` (capped
  /// at half the silence bound) and answers the moment it is set. Bounded by `timeout` + `wait`.
  std::optional<Bytes> heartbeat(std::chrono::milliseconds timeout,
                                 std::chrono::milliseconds wait = std::chrono::milliseconds(0));

 private:
  struct Reply;
  detail::Fd connect(std::chrono::steady_clock::time_point deadline);
  Reply call(std::string_view op, std::vector<std::uint8_t>& frame, std::chrono::steady_clock::time_point deadline,
             std::chrono::steady_clock::time_point reply_deadline);
  void check_key(std::string_view op, std::string_view key) const;
  void check_keys(std::string_view op, const std::vector<std::string>& keys, std::string_view verb) const;
  void check_value(std::string_view op, std::string_view key, std::size_t size) const;
  [[noreturn]] void throw_reply_error(std::string_view op, const Reply& r, std::chrono::milliseconds waited,
                                      const std::vector<std::string>& keys = {}) const;
  /// The skeleton of every call (detail/store/tcp_store.hpp): `write` adds the request's fields,
  /// `read` decodes the reply's.
  template <class Write, class Read>
  auto request(std::string_view op, detail::store_proto::Op code, std::chrono::milliseconds budget, bool parked,
               Write&& write, Read&& read, const std::vector<std::string>& keys = {});

  std::string host_;
  std::uint16_t port_;
  std::string address_;
  TcpStoreOptions opts_;
  std::unique_ptr<detail::TcpStoreServer> server_;
  std::mutex mu_;                       // guards idle_ and lost_
  std::vector<detail::Fd> idle_;        // connected, handshaken connections not in use
  std::string lost_;                    // why the server connection was lost; empty while healthy
};

/// A store in a file shared by the processes of one machine (or a shared file system with
/// working fcntl locks): an append-only log of operations, guarded by a file lock, that every
/// instance replays. Blocking calls poll the file with backoff until their deadline and then
/// throw comm::Timeout naming the keys and the path. The file is created if missing and never
/// removed; use a fresh path per job (a file left by an earlier job still holds its keys).
class FileStore final : public Store {
 public:
  /// Opens (creating if needed, mode 0600) the store file at `path`. Throws comm::BackendError
  /// when it cannot be opened and comm::Error when it is not a store file.
  explicit FileStore(std::string path, std::chrono::milliseconds timeout = Store::timeout_from_env());
  ~FileStore() override;
  FileStore(const FileStore&) = delete;
  FileStore& operator=(const FileStore&) = delete;

  /// The path of the store file.
  [[nodiscard]] const std::string& path() const noexcept { return path_; }

  /// Store::set of text, as in Store.
  using Store::set;
  /// Store::wait with the store's timeout, as in Store.
  using Store::wait;
  void set(std::string_view key, std::span<const std::uint8_t> value) override;
  Bytes get(std::string_view key) override;
  std::int64_t add(std::string_view key, std::int64_t delta) override;
  Bytes compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                    std::span<const std::uint8_t> desired) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  std::int64_t num_keys() override;
  bool delete_key(std::string_view key) override;
  bool check(std::string_view key) override;

 private:
  class Lock;
  void replay(std::string_view op, bool writer);
  void append(std::string_view op, char type, std::string_view key, std::span<const std::uint8_t> value);
  std::vector<std::string> missing(const std::vector<std::string>& keys);
  template <class Look>
  bool poll(std::string_view op, std::chrono::milliseconds timeout, Look&& look);

  std::string path_;
  detail::Fd fd_;
  std::mutex mu_;  // one operation of this instance at a time (threads share the lock's file description)
  std::map<std::string, Bytes, std::less<>> kv_;
  std::uint64_t replayed_ = 0;  // file offset up to which the log was applied to kv_
};

/// A store inside one process: a map under a mutex; get()/wait() block on a condition variable
/// until their deadline, then throw comm::Timeout naming the keys.
class HashStore final : public Store {
 public:
  /// An empty store whose calls without an explicit timeout wait at most `timeout`.
  explicit HashStore(std::chrono::milliseconds timeout = Store::timeout_from_env()) : Store(timeout) {}

  /// Store::set of text, as in Store.
  using Store::set;
  /// Store::wait with the store's timeout, as in Store.
  using Store::wait;
  void set(std::string_view key, std::span<const std::uint8_t> value) override;
  Bytes get(std::string_view key) override;
  std::int64_t add(std::string_view key, std::int64_t delta) override;
  Bytes compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                    std::span<const std::uint8_t> desired) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  std::int64_t num_keys() override;
  bool delete_key(std::string_view key) override;
  bool check(std::string_view key) override;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Bytes, std::less<>> kv_;
};

/// A view of another store in which every key is "prefix/key", so users of different prefixes
/// never see each other's keys. num_keys() counts the keys of the whole underlying store (as
/// c10d does). Takes the timeout and rank of `base` at construction; get() honours this store's
/// own timeout if it is changed later.
class PrefixStore final : public Store {
 public:
  /// Throws comm::InvalidArgument when `base` is null.
  PrefixStore(std::string prefix, std::shared_ptr<Store> base);

  /// The prefix, without the trailing '/'.
  [[nodiscard]] const std::string& prefix() const noexcept { return prefix_; }
  /// The underlying store.
  [[nodiscard]] const std::shared_ptr<Store>& base() const noexcept { return base_; }

  /// Store::set of text, as in Store.
  using Store::set;
  /// Store::wait with the store's timeout, as in Store.
  using Store::wait;
  void set(std::string_view key, std::span<const std::uint8_t> value) override;
  Bytes get(std::string_view key) override;
  std::int64_t add(std::string_view key, std::int64_t delta) override;
  Bytes compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                    std::span<const std::uint8_t> desired) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  std::int64_t num_keys() override;
  bool delete_key(std::string_view key) override;
  bool check(std::string_view key) override;
  std::vector<Bytes> multi_get(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;

 private:
  [[nodiscard]] std::string full(std::string_view key) const;

  std::string prefix_;
  std::shared_ptr<Store> base_;
};

}  // namespace comm

#include <comm/detail/store/hash_store.hpp>
#include <comm/detail/store/prefix_store.hpp>
#include <comm/detail/store/file_store.hpp>
#include <comm/detail/store/tcp_store.hpp>
