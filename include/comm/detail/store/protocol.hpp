#pragma once
// The TcpStore wire protocol. All integers are little-endian.
//
// Handshake (once per connection, client first):
//   hello        u32 magic "CMST" | u16 version | u16 token_len | i32 rank | token bytes
//                | u16 job_len | job id bytes                      (version 2; version 1 stops
//                                                                   after the token: job id "")
//   hello reply  u32 magic | u16 version | u8 HelloStatus | u16 msg_len | msg bytes
// Then request/reply frames, one reply per request, in order:
//   frame        u64 payload_len | payload            (payload_len in 1..frame_limit)
//   request      u8 Op | fields                       (see Op)
//   reply        u8 Status | fields                   (see Status)
// Strings and byte strings are u64 length | bytes. The server drops a connection that sends a
// bad magic, an oversized length, or a payload it cannot parse (after an error reply where the
// framing still holds); nothing is allocated from a length that was not checked first.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace comm::detail::store_proto {

inline constexpr std::uint32_t magic = 0x54534d43u;  // bytes "CMST"
inline constexpr std::uint16_t version = 2;
inline constexpr std::uint16_t min_version = 1;      // accepted by the server (job id "")
inline constexpr std::size_t hello_size = 12;        // without the token
inline constexpr std::size_t hello_reply_size = 9;   // without the message
inline constexpr std::size_t frame_header_size = 8;
inline constexpr std::size_t max_token_bytes = 4096;
inline constexpr std::size_t max_hello_message = 1024;
inline constexpr std::size_t max_job_id_bytes = 256;

/// Requests. Fields after the op byte:
enum class Op : std::uint8_t {
  set = 1,          // str key | bytes value                         -> ok
  get = 2,          // str key | u64 timeout_ms                      -> ok bytes value | timeout keys
  add = 3,          // str key | i64 delta                           -> ok i64 value
  compare_set = 4,  // str key | bytes expected | bytes desired      -> ok bytes value_after
  wait = 5,         // u32 n | n * str key | u64 timeout_ms          -> ok | timeout keys
  check = 6,        // u32 n | n * str key                           -> ok u8 all_exist
  num_keys = 7,     //                                               -> ok i64 count
  delete_key = 8,   // str key                                       -> ok u8 existed
  // Liveness (detail/engine/liveness.hpp). watch gives this connection a "will": when the connection
  // closes or errs, or sends no request for silence_ms, the server sets `key` (unless set) to
  // `value` followed by the reason, and drops the connection. An empty key withdraws the will;
  // silence_ms 0 releases the will of `key` and `value` held by any connection (a rank leaving).
  watch = 9,        // str key | bytes value | u64 silence_ms       -> ok i32 server_rank
  heartbeat = 10,   // u64 wait_ms                                   -> ok u8 set | bytes value
                    //   (the watched key's value, once some connection's will set it; while it is
                    //   not set the server holds the reply up to wait_ms, and sends it the moment
                    //   the key is set)
  // Batched get (a rendezvous: every rank reads every other's record in one round trip). Waits
  // like `wait` until every key exists, then answers all the values in the order asked; a reply
  // that would pass the frame limit is refused (`invalid`) rather than built.
  multi_get = 11,   // u32 n | n * str key | u64 timeout_ms         -> ok u32 n | n * bytes value
                    //                                                 | timeout keys
};

/// Reply status. `timeout` carries u32 n | n * str missing_key; `invalid` (the request was wrong)
/// and `failed` (the server could not do it, e.g. store full) carry str message.
enum class Status : std::uint8_t { ok = 0, timeout = 1, invalid = 2, failed = 3 };

/// `wrong_job`: the server belongs to another job (its message is the server's job id).
enum class HelloStatus : std::uint8_t {
  ok = 0,
  bad_version = 1,
  wrong_token = 2,
  too_many_connections = 3,
  wrong_job = 4,
};

[[nodiscard]] constexpr std::size_t sat_add(std::size_t a, std::size_t b) noexcept {
  return a > SIZE_MAX - b ? SIZE_MAX : a + b;
}

/// The largest frame payload a peer with these limits sends or accepts: a compare_set with two
/// maximal values, or a wait on many keys.
[[nodiscard]] constexpr std::size_t frame_limit(std::size_t max_key_bytes, std::size_t max_value_bytes) noexcept {
  const std::size_t cas = sat_add(sat_add(sat_add(max_value_bytes, max_value_bytes), max_key_bytes), 64);
  return std::max<std::size_t>(cas, std::size_t{1} << 20);
}

/// Appends little-endian fields to a byte vector.
class Writer {
 public:
  explicit Writer(std::vector<std::uint8_t>& buf) : buf_(buf) {}
  void u8(std::uint8_t v) { buf_.push_back(v); }
  void u16(std::uint16_t v) { put(v, 2); }
  void u32(std::uint32_t v) { put(v, 4); }
  void u64(std::uint64_t v) { put(v, 8); }
  void i32(std::int32_t v) { put(static_cast<std::uint32_t>(v), 4); }
  void i64(std::int64_t v) { put(static_cast<std::uint64_t>(v), 8); }
  void raw(std::span<const std::uint8_t> b) { buf_.insert(buf_.end(), b.begin(), b.end()); }
  void bytes(std::span<const std::uint8_t> b) {
    u64(b.size());
    raw(b);
  }
  void str(std::string_view s) {
    bytes(std::span(reinterpret_cast<const std::uint8_t*>(s.data()), s.size()));
  }

 private:
  void put(std::uint64_t v, int n) {
    std::uint8_t b[8];  // one insert, not n push_backs: a multi_get reply writes a length per value
    for (int i = 0; i < n; ++i) b[i] = static_cast<std::uint8_t>(v >> (8 * i));
    buf_.insert(buf_.end(), b, b + n);
  }
  std::vector<std::uint8_t>& buf_;
};

/// Reads little-endian fields from a byte span. Never reads past the end: a short read sets
/// `ok()` false and yields zeros / empty spans. Spans point into the input (no allocation).
class Reader {
 public:
  explicit Reader(std::span<const std::uint8_t> data) : data_(data) {}
  std::uint8_t u8() { return static_cast<std::uint8_t>(get(1)); }
  std::uint16_t u16() { return static_cast<std::uint16_t>(get(2)); }
  std::uint32_t u32() { return static_cast<std::uint32_t>(get(4)); }
  std::uint64_t u64() { return get(8); }
  std::int32_t i32() { return static_cast<std::int32_t>(static_cast<std::uint32_t>(get(4))); }
  std::int64_t i64() { return static_cast<std::int64_t>(get(8)); }
  std::span<const std::uint8_t> raw(std::size_t n) {
    if (!ok_ || n > left()) {
      ok_ = false;
      return {};
    }
    auto s = data_.subspan(pos_, n);
    pos_ += n;
    return s;
  }
  std::span<const std::uint8_t> bytes() {
    const std::uint64_t n = u64();
    if (n > left()) {
      ok_ = false;
      return {};
    }
    return raw(static_cast<std::size_t>(n));
  }
  std::string_view str() {
    auto b = bytes();
    return {reinterpret_cast<const char*>(b.data()), b.size()};
  }
  [[nodiscard]] bool ok() const noexcept { return ok_; }
  [[nodiscard]] std::size_t left() const noexcept { return data_.size() - pos_; }
  /// True when everything was read and nothing is left over.
  [[nodiscard]] bool done() const noexcept { return ok_ && pos_ == data_.size(); }

 private:
  std::uint64_t get(int n) {
    if (!ok_ || static_cast<std::size_t>(n) > left()) {
      ok_ = false;
      return 0;
    }
    std::uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= static_cast<std::uint64_t>(data_[pos_ + i]) << (8 * i);
    pos_ += static_cast<std::size_t>(n);
    return v;
  }
  std::span<const std::uint8_t> data_;
  std::size_t pos_ = 0;
  bool ok_ = true;
};

/// Starts a frame in `buf` (a placeholder length); finish_frame() fills it in.
inline std::size_t begin_frame(std::vector<std::uint8_t>& buf) {
  const std::size_t at = buf.size();
  buf.resize(at + frame_header_size);
  return at;
}
inline void finish_frame(std::vector<std::uint8_t>& buf, std::size_t at) {
  const std::uint64_t len = buf.size() - at - frame_header_size;
  for (int i = 0; i < 8; ++i) buf[at + static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(len >> (8 * i));
}

[[nodiscard]] inline std::uint64_t read_u64(const std::uint8_t* p) noexcept {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return v;
}

[[nodiscard]] inline std::vector<std::uint8_t> encode_hello(std::string_view token, std::int32_t rank,
                                                            std::string_view job_id = {}) {
  job_id = job_id.substr(0, max_job_id_bytes);
  std::vector<std::uint8_t> b;
  Writer w(b);
  w.u32(magic);
  w.u16(version);
  w.u16(static_cast<std::uint16_t>(token.size()));
  w.i32(rank);
  w.raw(std::span(reinterpret_cast<const std::uint8_t*>(token.data()), token.size()));
  w.u16(static_cast<std::uint16_t>(job_id.size()));
  w.raw(std::span(reinterpret_cast<const std::uint8_t*>(job_id.data()), job_id.size()));
  return b;
}

[[nodiscard]] inline std::vector<std::uint8_t> encode_hello_reply(HelloStatus s, std::string_view msg) {
  msg = msg.substr(0, max_hello_message);
  std::vector<std::uint8_t> b;
  Writer w(b);
  w.u32(magic);
  w.u16(version);
  w.u8(static_cast<std::uint8_t>(s));
  w.u16(static_cast<std::uint16_t>(msg.size()));
  w.raw(std::span(reinterpret_cast<const std::uint8_t*>(msg.data()), msg.size()));
  return b;
}

}  // namespace comm::detail::store_proto
