#pragma once
// What the TcpStore server stores and how it answers a request, apart from the network side
// (tcp_store_server.hpp: listening, the epoll loop, reading frames, the handshake, sending).
// The table of keys and values with its memory bound, the replies, the get()/wait() requests
// parked until their keys appear, and the wills (Op::watch) that set a key when a rank dies.
// Requests arrive one frame at a time from the loop; nothing here blocks or throws out of it.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <comm/detail/net/socket.hpp>
#include <comm/detail/store/common.hpp>
#include <comm/detail/store/protocol.hpp>

namespace comm::detail {

/// What the server enforces (from TcpStoreOptions).
struct TcpStoreServerConfig {
  std::string token;
  std::string job_id;  // a client of another job is refused (HelloStatus::wrong_job)
  std::size_t max_connections = 16384;
  std::size_t max_key_bytes = 4096;
  std::size_t max_value_bytes = std::size_t{64} << 20;
  std::size_t max_total_bytes = std::size_t{1} << 30;
  std::chrono::milliseconds stall_timeout = std::chrono::seconds(5);
};

/// The TcpStore server's table and request semantics; TcpStoreServer runs the network side.
class TcpStoreRequests {
 protected:
  TcpStoreRequests(TcpStoreServerConfig cfg, int rank)
      : opts_(std::move(cfg)), host_rank_(rank), stall_(std::max(opts_.stall_timeout, std::chrono::milliseconds(1))) {}

  using Bytes = std::vector<std::uint8_t>;
  using Op = store_proto::Op;
  using Status = store_proto::Status;

  enum class Phase : std::uint8_t { hello, ready, closing, draining };


  // A parked request keeps its keys as they came on the wire (u64 length | bytes each, one
  // allocation however many keys) and waits on one missing key at a time: `at` is the offset of
  // that key in `keys`. Setting it moves `at` on to the next missing key; the request is answered
  // when none is left. So a key set costs one step per request waiting on it, and a rendezvous
  // of N ranks each reading N keys costs O(N^2) steps and bytes in all, never N^2 waiter entries.
  struct Pending {
    Op op = Op::get;
    Bytes keys;
    std::size_t count = 0;
    std::size_t at = 0;
    Clock::time_point deadline;
    std::size_t cost = 0;  // counted in parked_bytes_
  };

  template <class F>
  static void each_key(const Pending& p, F&& f) {
    store_proto::Reader r(p.keys);
    for (std::size_t i = 0; i < p.count; ++i) f(r.str());
  }
  [[nodiscard]] static std::string_view key_at(const Pending& p) {
    store_proto::Reader r(std::span<const std::uint8_t>(p.keys).subspan(p.at));
    return r.str();
  }
  [[nodiscard]] static Bytes one_key(std::string_view key) {
    Bytes b;
    store_proto::Writer(b).str(key);
    return b;
  }

  // What one key of a parked get()/wait() costs the server: its copy, its place in the request's
  // key list and in waiters_. Counted against max_total_bytes, so that a request of millions of
  // empty keys (8 bytes each on the wire) cannot make the server take many times its size.
  static constexpr std::size_t parked_key_overhead = 128;
  [[nodiscard]] static std::size_t parked_cost(std::string_view key) noexcept {
    return key.size() + parked_key_overhead;
  }
  // A request parked on several keys holds them in one buffer (Pending::keys) and is listed under
  // one at a time: its wire bytes (8 + size per key) and one overhead.
  [[nodiscard]] static std::size_t parked_cost(std::size_t wire_bytes) noexcept {
    return wire_bytes + parked_key_overhead;
  }

  // Op::watch: set `key` to `value` + the reason when this connection ends or falls silent.
  struct Will {
    std::string key;
    Bytes value;
    std::chrono::milliseconds silence{};
    Clock::time_point last;  // the last request
    std::size_t cost = 0;    // counted in parked_bytes_
  };

  struct Conn {
    Fd fd;
    std::uint64_t id = 0;
    Phase phase = Phase::hello;
    Bytes in;
    std::size_t in_off = 0;
    Bytes out;
    std::size_t out_off = 0;
    Clock::time_point accepted;
    Clock::time_point progress;  // last time bytes moved
    Clock::time_point until;     // closing/draining: drop at this time
    std::optional<Pending> pending;
    bool dead = false;
    bool counted = true;  // counts against max_connections (false: being rejected)
    int rank = -1;
    std::optional<Will> will;
    // The network side's bookkeeping (tcp_store_server.hpp): the events registered with epoll,
    // and the earliest time this connection is queued in the timer heap (max: not queued).
    std::uint32_t events = 0;
    Clock::time_point timer = Clock::time_point::max();

    [[nodiscard]] std::size_t unread() const noexcept { return in.size() - in_off; }
    [[nodiscard]] bool out_pending() const noexcept { return out_off < out.size(); }
  };

  void send_hello(Conn& c, store_proto::HelloStatus s, const std::string& msg) {
    const auto r = store_proto::encode_hello_reply(s, msg);
    c.out.insert(c.out.end(), r.begin(), r.end());
  }

  void close_after_reply(Conn& c, Clock::time_point now) {
    c.phase = Phase::closing;
    c.until = now + std::min(stall_, std::chrono::milliseconds(2000));
  }

  // --- replies --------------------------------------------------------------------------------

  void start_reply(Conn& c) {
    if (!c.out_pending()) {
      c.out.clear();
      c.out_off = 0;
    }
  }

  void reply_ok(Conn& c) {
    start_reply(c);
    const auto at = store_proto::begin_frame(c.out);
    c.out.push_back(static_cast<std::uint8_t>(Status::ok));
    store_proto::finish_frame(c.out, at);
  }

  template <class F>
  void reply_ok_with(Conn& c, F&& fields) {
    start_reply(c);
    const auto at = store_proto::begin_frame(c.out);
    store_proto::Writer w(c.out);
    w.u8(static_cast<std::uint8_t>(Status::ok));
    fields(w);
    store_proto::finish_frame(c.out, at);
  }

  void reply_error(Conn& c, Status s, const std::string& msg) {
    start_reply(c);
    const auto at = store_proto::begin_frame(c.out);
    store_proto::Writer w(c.out);
    w.u8(static_cast<std::uint8_t>(s));
    w.str(msg);
    store_proto::finish_frame(c.out, at);
  }

  void reply_timeout(Conn& c, const std::vector<std::string>& missing) {
    reply_timeout_with(c, missing.size(), [&](store_proto::Writer& w) {
      for (const auto& k : missing) w.str(k);
    });
  }

  // A timeout reply naming `n` missing keys, which `keys(w)` writes.
  template <class F>
  void reply_timeout_with(Conn& c, std::size_t n, F&& keys) {
    start_reply(c);
    const auto at = store_proto::begin_frame(c.out);
    store_proto::Writer w(c.out);
    w.u8(static_cast<std::uint8_t>(Status::timeout));
    w.u32(static_cast<std::uint32_t>(n));
    keys(w);
    store_proto::finish_frame(c.out, at);
  }

  // --- requests -------------------------------------------------------------------------------

  bool key_ok(Conn& c, std::string_view key) {
    if (key.size() <= opts_.max_key_bytes) return true;
    reply_error(c, Status::invalid,
                "key of " + std::to_string(key.size()) + " bytes exceeds the server's max_key_bytes (" +
                    std::to_string(opts_.max_key_bytes) + ")");
    return false;
  }

  bool value_ok(Conn& c, std::string_view key, std::size_t size) {
    if (size <= opts_.max_value_bytes) return true;
    reply_error(c, Status::invalid,
                "value of " + std::to_string(size) + " bytes for " + quote_key(key) +
                    " exceeds the server's max_value_bytes (" + std::to_string(opts_.max_value_bytes) + ")");
    return false;
  }

  // Stores key=value unless that would pass max_total_bytes (then replies `failed`).
  bool put(Conn& c, std::string_view key, std::span<const std::uint8_t> value) {
    auto it = kv_.find(key);
    const std::size_t old = it == kv_.end() ? 0 : key.size() + it->second.size();
    const std::size_t add = key.size() + value.size();
    if (add > old && total_bytes_ + parked_bytes_ - old + add > opts_.max_total_bytes) {
      reply_error(c, Status::failed,
                  "store full: storing " + std::to_string(add) + " bytes for " + quote_key(key) + " would pass " +
                      "max_total_bytes (" + std::to_string(opts_.max_total_bytes) + "; " +
                      std::to_string(total_bytes_ + parked_bytes_) + " in use)");
      return false;
    }
    if (it == kv_.end()) {
      kv_.emplace(std::string(key), Bytes(value.begin(), value.end()));
    } else {
      it->second.assign(value.begin(), value.end());
    }
    total_bytes_ = total_bytes_ - old + add;
    return true;
  }

  // Whether parking keys that cost `cost` fits in max_total_bytes (else replies `failed`).
  bool parked_fits(Conn& c, std::size_t keys, std::size_t cost) {
    if (cost <= opts_.max_total_bytes && total_bytes_ + parked_bytes_ <= opts_.max_total_bytes - cost) return true;
    reply_error(c, Status::failed,
                "store full: waiting on " + std::to_string(keys) + (keys == 1 ? " key" : " keys") + " takes about " +
                    std::to_string(cost) + " bytes of server memory, which would pass max_total_bytes (" +
                    std::to_string(opts_.max_total_bytes) + "; " + std::to_string(total_bytes_ + parked_bytes_) +
                    " in use)");
    return false;
  }

  void malformed(Conn& c, Clock::time_point now) {
    reply_error(c, Status::invalid, "malformed request");
    close_after_reply(c, now);
  }

  static std::uint64_t clamp_ms(std::uint64_t ms) noexcept {
    constexpr std::uint64_t year = 365ull * 24 * 3600 * 1000;
    return std::min(ms, 100 * year);
  }

  void handle(Conn& c, std::span<const std::uint8_t> payload, Clock::time_point now) {
    store_proto::Reader r(payload);
    const auto op = static_cast<Op>(r.u8());
    if (c.will) c.will->last = now;
    switch (op) {
      case Op::watch: {
        const auto key = r.str();
        const auto value = r.bytes();
        const auto ms = clamp_ms(r.u64());
        if (!r.done()) return malformed(c, now);
        if (ms == 0 && !key.empty()) {  // release: the will(s) of this key and value, on any connection
          release_wills(key, value);
          return reply_ok_with(c, [&](store_proto::Writer& w) { w.i32(host_rank_); });
        }
        if (c.will) {
          parked_bytes_ -= c.will->cost;
          c.will.reset();
        }
        if (!key.empty()) {
          if (!key_ok(c, key) || !value_ok(c, key, value.size())) return;
          const std::size_t cost = parked_cost(key) + value.size() + will_reason_bytes;
          if (!parked_fits(c, 1, cost)) return;
          parked_bytes_ += cost;
          c.will = Will{std::string(key), Bytes(value.begin(), value.end()),
                        std::chrono::milliseconds(std::max<std::uint64_t>(ms, 1)), now, cost};
        }
        return reply_ok_with(c, [&](store_proto::Writer& w) { w.i32(host_rank_); });
      }
      case Op::heartbeat: {
        // Parks (as a get of the will's key, for at most wait_ms, below the silence bound) so that
        // a death reaches every watcher the moment the server sees it.
        const auto ms = clamp_ms(r.u64());
        if (!r.done()) return malformed(c, now);
        const auto it = c.will ? kv_.find(c.will->key) : kv_.end();
        if (it != kv_.end() || !c.will || ms == 0) return reply_heartbeat(c, it != kv_.end() ? &it->second : nullptr);
        const auto wait = std::min(std::chrono::milliseconds(ms), c.will->silence / 2);
        if (!parked_fits(c, 1, parked_cost(c.will->key))) return;
        return park(c, Op::heartbeat, one_key(c.will->key), 1, now + wait, parked_cost(c.will->key));
      }
      case Op::set: {
        const auto key = r.str();
        const auto value = r.bytes();
        if (!r.done()) return malformed(c, now);
        if (!key_ok(c, key) || !value_ok(c, key, value.size()) || !put(c, key, value)) return;
        reply_ok(c);
        return key_changed(key);
      }
      case Op::get: {
        const auto key = r.str();
        const auto ms = clamp_ms(r.u64());
        if (!r.done()) return malformed(c, now);
        if (!key_ok(c, key)) return;
        if (auto it = kv_.find(key); it != kv_.end()) {
          return reply_ok_with(c, [&](store_proto::Writer& w) { w.bytes(it->second); });
        }
        if (ms == 0) return reply_timeout_with(c, 1, [&](store_proto::Writer& w) { w.str(key); });
        if (!parked_fits(c, 1, parked_cost(key))) return;
        return park(c, Op::get, one_key(key), 1, now + std::chrono::milliseconds(ms), parked_cost(key));
      }
      case Op::add: {
        const auto key = r.str();
        const auto delta = r.i64();
        if (!r.done()) return malformed(c, now);
        if (!key_ok(c, key)) return;
        auto it = kv_.find(key);
        const auto res = apply_add(key, it == kv_.end() ? nullptr : &it->second, delta);
        if (!res.error.empty()) return reply_error(c, Status::invalid, res.error);
        if (!put(c, key, format_counter(res.value))) return;
        reply_ok_with(c, [&](store_proto::Writer& w) { w.i64(res.value); });
        return key_changed(key);
      }
      case Op::compare_set: {
        const auto key = r.str();
        const auto expected = r.bytes();
        const auto desired = r.bytes();
        if (!r.done()) return malformed(c, now);
        if (!key_ok(c, key) || !value_ok(c, key, desired.size())) return;
        auto it = kv_.find(key);
        if (cas_matches(it == kv_.end() ? nullptr : &it->second, expected)) {
          if (!put(c, key, desired)) return;
          reply_ok_with(c, [&](store_proto::Writer& w) { w.bytes(desired); });
          return key_changed(key);
        }
        return reply_ok_with(c, [&](store_proto::Writer& w) {
          if (it == kv_.end()) {
            w.bytes({});
          } else {
            w.bytes(it->second);
          }
        });
      }
      case Op::wait:
      case Op::multi_get:
      case Op::check: {
        // Two passes over the keys. The first checks and counts them without copying anything,
        // so nothing is copied before the cost of parking them is known to fit (parked_fits).
        // Keys are looked up only up to the first missing one (check: all); a parked request
        // goes on from there.
        // A multi_get keeps the values it finds on the way, so that one with every key set
        // (a rendezvous' late ranks) looks each key up once.
        const std::uint32_t n = r.u32();
        const store_proto::Reader first_key = r;
        std::size_t count = 0, missing = 0, first_missing = 0;
        std::vector<const Bytes*> values;
        for (std::uint32_t i = 0; i < n && r.ok(); ++i) {
          const std::size_t at = first_key.left() - r.left();
          const auto key = r.str();
          if (!r.ok()) break;
          if (!key_ok(c, key)) return;
          ++count;
          if (missing == 0 || op == Op::check) {
            const auto it = kv_.find(key);
            if (it == kv_.end()) {
              if (missing++ == 0) first_missing = at;
            } else if (op == Op::multi_get && missing == 0) {
              values.push_back(&it->second);
            }
          }
        }
        const std::size_t wire = first_key.left() - r.left();  // the keys' bytes on the wire
        const std::size_t cost = parked_cost(wire);
        const auto ms = op != Op::check ? clamp_ms(r.u64()) : 0;
        if (!r.done()) return malformed(c, now);
        if (op == Op::check) {
          return reply_ok_with(c, [&](store_proto::Writer& w) { w.u8(missing == 0 ? 1 : 0); });
        }
        auto for_keys = [&](auto&& f) {
          store_proto::Reader k = first_key;
          for (std::size_t i = 0; i < count; ++i) f(k.str());
        };
        if (missing == 0 && op == Op::multi_get) return reply_values(c, values);
        if (missing == 0) return reply_ok(c);
        if (ms == 0) {
          std::vector<std::string_view> absent;
          for_keys([&](std::string_view key) {
            if (kv_.find(key) == kv_.end()) absent.push_back(key);
          });
          return reply_timeout_with(c, absent.size(), [&](store_proto::Writer& w) {
            for (const auto k : absent) w.str(k);
          });
        }
        if (!parked_fits(c, count, cost)) return;
        const auto blob = store_proto::Reader(first_key).raw(wire);
        return park(c, op, Bytes(blob.begin(), blob.end()), count, now + std::chrono::milliseconds(ms), cost,
                    first_missing);
      }
      case Op::num_keys: {
        if (!r.done()) return malformed(c, now);
        return reply_ok_with(c, [&](store_proto::Writer& w) { w.i64(static_cast<std::int64_t>(kv_.size())); });
      }
      case Op::delete_key: {
        const auto key = r.str();
        if (!r.done()) return malformed(c, now);
        if (!key_ok(c, key)) return;
        auto it = kv_.find(key);
        const bool existed = it != kv_.end();
        if (existed) {
          total_bytes_ -= key.size() + it->second.size();
          kv_.erase(it);
        }
        return reply_ok_with(c, [&](store_proto::Writer& w) { w.u8(existed ? 1 : 0); });
      }
    }
    reply_error(c, Status::invalid, "unknown request type " + std::to_string(static_cast<int>(op)));
    close_after_reply(c, now);
  }

  // --- liveness -----------------------------------------------------------------------------------

  static constexpr std::size_t will_reason_bytes = 128;

  void reply_heartbeat(Conn& c, const Bytes* value) {
    reply_ok_with(c, [&](store_proto::Writer& w) {
      w.u8(value != nullptr ? 1 : 0);
      w.bytes(value != nullptr ? std::span<const std::uint8_t>(*value) : std::span<const std::uint8_t>());
    });
  }

  // A rank that leaves withdraws its will from another connection (its own is held by a pending
  // heartbeat): the will goes, and the held heartbeat is answered now.
  void release_wills(std::string_view key, std::span<const std::uint8_t> value) {
    for (auto& [id, cp] : conns_) {
      Conn& o = *cp;
      if (o.dead || !o.will || o.will->key != key ||
          !std::equal(o.will->value.begin(), o.will->value.end(), value.begin(), value.end()))
        continue;
      parked_bytes_ -= o.will->cost;
      o.will.reset();
      if (o.pending && o.pending->op == Op::heartbeat) {
        reply_heartbeat(o, nullptr);
        unpark(o);
        ready_.push_back(o.id);
      }
    }
  }

  // The first will to fire sets its key; later ones (the same death seen twice, or a second
  // death) leave the first cause in place.
  // The will's key keeps the first death (what every watcher wakes on); each death is also kept
  // under "<key>/<id>", id being the value up to its first '|' (the rank, for liveness), so that
  // a shrink can tell every dead member from a live one, not only the first.
  void fire_will(Conn& c, const std::string& reason) {
    Will w = std::move(*c.will);
    c.will.reset();
    parked_bytes_ -= w.cost;
    Bytes v = std::move(w.value);
    v.insert(v.end(), reason.begin(), reason.end());
    const auto bar = std::find(v.begin(), v.end(), std::uint8_t{'|'});
    if (bar != v.end() && bar != v.begin()) {
      std::string record = w.key + "/";
      record.append(v.begin(), bar);
      if (kv_.find(record) == kv_.end()) {
        total_bytes_ += record.size() + v.size();  // bounded like the will: one per connection
        kv_.emplace(record, v);
        key_changed(record);
      }
    }
    if (kv_.find(w.key) != kv_.end()) return;
    total_bytes_ += w.key.size() + v.size();  // bounded: charged as parked while the will was held
    kv_.emplace(w.key, std::move(v));
    key_changed(w.key);
  }

  // --- parked get()/wait() ----------------------------------------------------------------------

  // Moves `c`'s parked request on to its next missing key and lists it there; false when every
  // key is set. Keys before `at` were set when passed; one deleted since is found by the final
  // check (answer_parked), which starts over.
  bool wait_next(Conn& c) {
    auto& p = *c.pending;
    while (p.at < p.keys.size()) {
      store_proto::Reader r(std::span<const std::uint8_t>(p.keys).subspan(p.at));
      const auto key = r.str();
      if (kv_.find(key) == kv_.end()) {
        auto it = waiters_.find(key);
        if (it == waiters_.end()) it = waiters_.emplace(std::string(key), std::unordered_set<std::uint64_t>{}).first;
        it->second.insert(c.id);
        return true;
      }
      p.at = p.keys.size() - r.left();
    }
    return false;
  }

  // `at`: the offset in `keys` of the first key that may be missing.
  void park(Conn& c, Op op, Bytes keys, std::size_t count, Clock::time_point deadline, std::size_t cost,
            std::size_t at = 0) {
    c.pending = Pending{op, std::move(keys), count, at, deadline, cost};
    parked_bytes_ += cost;
    (void)wait_next(c);
  }

  void unpark(Conn& c) {
    auto& p = *c.pending;
    if (p.at < p.keys.size()) {
      auto it = waiters_.find(key_at(p));
      if (it != waiters_.end()) {
        it->second.erase(c.id);
        if (it->second.empty()) waiters_.erase(it);
      }
    }
    parked_bytes_ -= p.cost;
    c.pending.reset();
  }

  // Answers `c`'s parked request when its keys are all set, or when `final` (its deadline passed:
  // then naming the missing keys), and unparks it; false (nothing sent) when it must wait on.
  bool answer_parked(Conn& c, bool final) {
    const auto& p = *c.pending;
    std::vector<const Bytes*> values;
    values.reserve(p.count);
    std::size_t missing = 0;
    each_key(p, [&](std::string_view k) {
      const auto it = kv_.find(k);
      values.push_back(it == kv_.end() ? nullptr : &it->second);
      missing += it == kv_.end() ? 1 : 0;
    });
    if (missing > 0 && !final) return false;
    if (p.op == Op::heartbeat) {
      reply_heartbeat(c, values.front());
    } else if (missing > 0) {
      reply_timeout_with(c, missing, [&](store_proto::Writer& w) {
        std::size_t i = 0;
        each_key(p, [&](std::string_view k) {
          if (values[i++] == nullptr) w.str(k);
        });
      });
    } else if (p.op == Op::get) {
      reply_ok_with(c, [&](store_proto::Writer& w) { w.bytes(*values.front()); });
    } else if (p.op == Op::multi_get) {
      reply_values(c, values);
    } else {
      reply_ok(c);
    }
    unpark(c);
    return true;
  }

  // multi_get's answer: every key's value in order (all exist), unless the reply would pass the
  // frame limit a client accepts.
  void reply_values(Conn& c, const std::vector<const Bytes*>& values) {
    std::size_t size = 1 + 4;
    for (const auto* v : values) size = store_proto::sat_add(size, 8 + v->size());
    const std::size_t cap = store_proto::frame_limit(opts_.max_key_bytes, opts_.max_value_bytes);
    if (size > cap)
      return reply_error(c, Status::invalid,
                         "the values of " + std::to_string(values.size()) + " keys take " + std::to_string(size) +
                             " bytes, more than one reply holds (" + std::to_string(cap) +
                             "); ask for fewer keys at a time");
    start_reply(c);
    const std::size_t need = c.out.size() + store_proto::frame_header_size + size;
    if (c.out.empty() && c.out.capacity() < need && spare_.capacity() >= need) c.out.swap(spare_);
    c.out.reserve(need);
    reply_ok_with(c, [&](store_proto::Writer& w) {
      w.u32(static_cast<std::uint32_t>(values.size()));
      for (const auto* v : values) w.bytes(*v);
    });
  }

  void key_changed(std::string_view key) {
    auto it = waiters_.find(key);
    if (it == waiters_.end()) return;
    const std::unordered_set<std::uint64_t> ids = std::move(it->second);  // the key exists now: none waits on it
    waiters_.erase(it);
    for (const auto id : ids) {
      auto ct = conns_.find(id);
      if (ct == conns_.end() || ct->second->dead || !ct->second->pending) continue;
      Conn& c = *ct->second;
      // Every key is set: answered in its connection's turn (TcpStoreServer::process), right
      // before its reply goes out. When the last rank of a rendezvous joins, every rank's
      // multi_get is answered at once: built here, their replies would all be held together
      // (~0.75 GiB at 4,096 ranks), where one at a time they take turns with one buffer.
      if (!wait_next(c)) ready_.push_back(c.id);
    }
  }

  // A parked request whose keys key_changed() found all set; false if it waits on (a key passed
  // earlier was deleted since: it waits for that one again).
  bool answer_complete(Conn& c) {
    if (!c.pending || c.pending->at < c.pending->keys.size()) return false;
    if (answer_parked(c, false)) return true;
    c.pending->at = 0;
    (void)wait_next(c);
    return false;
  }

  // A connection's reply buffer once its reply is out: a large one becomes the spare (one at a
  // time, at most max_spare) that the next large reply starts from, rather than going back to the
  // allocator. A rendezvous' ~180 KiB multi_get replies then reuse one buffer instead of each
  // being mapped, faulted in and unmapped (~12% of the server's CPU at 4,096 ranks).
  void recycle_out(Conn& c, std::size_t keep) {
    c.out.clear();
    c.out_off = 0;
    if (c.out.capacity() <= keep) return;
    if (c.out.capacity() <= max_spare && c.out.capacity() > spare_.capacity()) spare_.swap(c.out);
    Bytes().swap(c.out);
  }

  TcpStoreServerConfig opts_;
  int host_rank_;  // the rank of the process hosting this server (-1: unknown)
  std::chrono::milliseconds stall_;

  // Hash tables with lookup by string_view: a rendezvous looks up every rank's key once per rank.
  struct KeyHash {
    using is_transparent = void;
    std::size_t operator()(std::string_view k) const noexcept { return std::hash<std::string_view>{}(k); }
  };
  std::unordered_map<std::string, Bytes, KeyHash, std::equal_to<>> kv_;
  std::size_t total_bytes_ = 0;
  std::size_t parked_bytes_ = 0;  // what parked get()/wait() requests hold (Pending::cost)
  std::unordered_map<std::string, std::unordered_set<std::uint64_t>, KeyHash, std::equal_to<>> waiters_;
  std::unordered_map<std::uint64_t, std::unique_ptr<Conn>> conns_;
  std::vector<std::uint64_t> ready_;  // connections to go on with once a reply went out
  static constexpr std::size_t max_spare = std::size_t{4} << 20;
  Bytes spare_;  // recycle_out()
};

}  // namespace comm::detail
